"""jaxaccum.linen in real train steps: FrozenDict state, replicas under jax.pmap with
axis_name, a TrainState driven by jaxaccum.MultiSteps with weight=, keyword batches and the
core's options forwarded.

References: ``jax.value_and_grad`` on the full batch (one device) where the forward pass is
per example; ``jax.value_and_grad`` on each micro-batch built by explicit slicing
(``x[i::N]``), one after the other, for BatchNorm in training mode and dropout; plain optax
arithmetic for MultiSteps. float32, 1e-5 relative (``tests._util.assert_close``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import FrozenDict, freeze
from flax.training import train_state

import jaxaccum
from tests._problems import micro_batch
from tests._util import assert_close

B, N = 16, 4


class Net(nn.Module):
  train: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not self.train, momentum=0.8)(x)
    return nn.Dense(3)(nn.relu(x))


def data(seed=0, b=B):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (b, 4)), jax.random.randint(ky, (b,), 0, 3)


# The references' glue runs in NumPy on the host and their gradients under jit: eagerly,
# every op of every leaf's shape compiles a program of its own.
def replicate(tree, n=2):
  return jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n,) + np.shape(a)), tree)


def micro(tree, i, n=N):
  """Micro-batch ``i`` of ``n``: rows ``i::n``, sliced by hand."""
  return micro_batch(tree, i, n)


def host(tree):
  return jax.tree.map(np.asarray, tree)


def mean_of(trees):
  return jax.tree.map(lambda *a: sum(np.asarray(x) for x in a) / len(a), *trees)


def replica(tree, r):
  return jax.tree.map(lambda a: np.asarray(a)[r], tree)


MODEL = Net()
VARIABLES = MODEL.init(jax.random.key(0), data()[0])


def loss_fn(params, batch, model_state, rngs):
  x, y = batch
  logits, new_state = MODEL.apply({"params": params, **model_state}, x,
                                  mutable=list(model_state))
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new_state


ref_value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def test_frozendict_state_is_accepted_and_returned_as_frozendict():
  params = freeze(VARIABLES["params"])
  state = FrozenDict({"batch_stats": freeze(VARIABLES["batch_stats"])})
  batch = host(data())

  # Reference: the micro-batches one after the other, BatchNorm statistics carried over.
  ref_state, losses, grads = state, [], []
  for i in range(N):
    (loss, ref_state), g = ref_value_and_grad(params, micro(batch, i), ref_state, {})
    losses.append(loss)
    grads.append(g)
  ref_loss = mean_of(losses)
  ref_grads = mean_of(grads)

  vg = jax.jit(jaxaccum.linen.value_and_grad(loss_fn, num_micro_batches=N))
  (loss, new_state), grads = vg(params, batch, state, {})
  assert type(new_state) is FrozenDict and type(new_state["batch_stats"]) is FrozenDict
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)
  assert_close(new_state.unfreeze(), FrozenDict(ref_state).unfreeze())

  # The same through make_train_step with a FrozenDict batch_stats field.
  class State(train_state.TrainState):
    batch_stats: FrozenDict

  ts = State.create(apply_fn=MODEL.apply, params=params, tx=optax.sgd(0.1),
                    batch_stats=state["batch_stats"])
  step = jax.jit(jaxaccum.linen.make_train_step(loss_fn, num_micro_batches=N))
  ts, loss = step(ts, batch, {})
  assert type(ts.batch_stats) is FrozenDict
  assert_close(loss, ref_loss)
  assert_close(ts.params, jax.tree.map(lambda p, g: np.asarray(p) - 0.1 * g, params, ref_grads))


class Dense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(jnp.tanh(nn.Dense(8)(x)))


def dense_setup():
  model = Dense()
  x, y = data(1)
  params = model.init(jax.random.key(2), x)["params"]

  def loss_fn(params, batch, model_state, rngs):
    x, y, w = batch
    logits = model.apply({"params": params}, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    correct = jnp.sum((jnp.argmax(logits, -1) == y) * (w > 0))
    return (jnp.sum(ce * w), jnp.sum(w)), (model_state, {"correct": correct,
                                                         "max_logit": jnp.max(logits)})

  # Replica 0 holds many more real tokens than replica 1 after the pmap split.
  w = jnp.where(jnp.arange(B) < B // 2, 1.0, jnp.where(jnp.arange(B) % 4 == 0, 1.0, 0.0))
  return model, params, loss_fn, (x, y, w)


def test_pmap_axis_name_combines_replicas_once_per_step_and_equals_full_batch():
  model, params, loss_fn, batch = dense_setup()
  tx = optax.sgd(0.5)

  def full(params, batch):
    (num, den), (_, aux) = loss_fn(params, batch, {}, {})
    return num / den, aux

  (ref_loss, ref_aux), ref_grads = jax.jit(jax.value_and_grad(full, has_aux=True))(params, batch)
  ref_params = jax.jit(lambda p, g: optax.apply_updates(p, tx.update(g, tx.init(p))[0]))(
      params, ref_grads)

  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  devices = jax.devices()[:2]
  rep = replicate(state)
  sharded = jax.tree.map(lambda a: np.asarray(a).reshape((2, B // 2) + a.shape[1:]), batch)

  step = jaxaccum.linen.make_train_step(
      loss_fn, num_micro_batches=2, collections=(), reduce="weighted", has_aux=True,
      aux_reduce={"correct": "sum", "max_logit": "max"}, axis_name="batch")
  new, (loss, aux) = jax.pmap(step, axis_name="batch", devices=devices)(rep, sharded, {})
  for r in range(2):
    assert_close(replica(new.params, r), ref_params)
    assert_close(loss[r], ref_loss)
    assert int(aux["correct"][r]) == int(ref_aux["correct"])
    assert_close(aux["max_logit"][r], ref_aux["max_logit"])

  # Without axis_name each replica applies the gradient of its own rows only.
  step = jaxaccum.linen.make_train_step(loss_fn, num_micro_batches=2, collections=(),
                                        reduce="weighted", has_aux=True)
  new, _ = jax.pmap(step, axis_name="batch", devices=devices)(rep, sharded, {})
  assert not np.allclose(new.params["Dense_0"]["kernel"][0],
                         new.params["Dense_0"]["kernel"][1])


def test_pmap_axis_name_mean_averages_batch_stats_like_the_imagenet_example():
  params, stats = VARIABLES["params"], VARIABLES["batch_stats"]
  batch = host(data(3))

  class State(train_state.TrainState):
    batch_stats: dict

  # Reference: each replica's micro-batches in order, then the Flax ImageNet recipe:
  # pmean the gradients, the loss and the batch statistics.
  halves = [jax.tree.map(lambda a, r=r: a[r * B // 2:(r + 1) * B // 2], batch) for r in range(2)]
  losses, grads, new_stats = [], [], []
  for h in halves:
    s = {"batch_stats": stats}
    for i in range(2):
      (loss, s), g = ref_value_and_grad(params, micro(h, i, 2), s, {})
      losses.append(loss)
      grads.append(g)
    new_stats.append(s["batch_stats"])
  ref_grads = mean_of(grads)
  ref_stats = mean_of(new_stats)

  state = State.create(apply_fn=MODEL.apply, params=params, tx=optax.sgd(0.1),
                       batch_stats=stats)
  devices = jax.devices()[:2]
  step = jaxaccum.linen.make_train_step(loss_fn, num_micro_batches=2, axis_name="batch")
  new, loss = jax.pmap(step, axis_name="batch", devices=devices)(
      replicate(state),
      jax.tree.map(lambda a: a.reshape((2, B // 2) + a.shape[1:]), batch), {})
  for r in range(2):
    assert_close(replica(new.params, r),
                 jax.tree.map(lambda p, g: np.asarray(p) - 0.1 * g, params, ref_grads))
    assert_close(replica(new.batch_stats, r), ref_stats)
    assert_close(loss[r], mean_of(losses))


def test_axis_name_needs_a_known_reduction():
  with pytest.raises(ValueError, match=r"axis_name='batch' combines replicas for reduce="):
    jaxaccum.linen.make_train_step(loss_fn, num_micro_batches=2, axis_name="batch",
                                   reduce={"a": "mean"})


def test_apply_gradients_drives_a_train_state_with_multisteps_and_weight():
  params = {"w": jnp.zeros(3)}
  schedule = optax.linear_schedule(1.0, 0.1, transition_steps=10)
  inner = optax.sgd(schedule)
  tx = jaxaccum.MultiSteps(inner, every_k_schedule=3)
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  step = jax.jit(lambda s, g, w: jaxaccum.linen.apply_gradients(s, grads=g, weight=w))

  rng = np.random.default_rng(0)
  ref_params, ref_inner = params, inner.init(params)
  for window in range(2):
    gs = [{"w": jnp.asarray(rng.normal(size=3), jnp.float32)} for _ in range(3)]
    ws = [2.0, 0.0, 5.0]
    for k, (g, w) in enumerate(zip(gs, ws, strict=True)):
      state = step(state, g, jnp.float32(w))
      assert int(state.step) == window + (k == 2)  # optimizer steps, not micro-steps
    mean = {"w": sum(wi * g["w"] for wi, g in zip(ws, gs, strict=True)) / sum(ws)}
    updates, ref_inner = inner.update(mean, ref_inner, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    assert_close(state.params, ref_params)
  # The inner optimizer's schedule counted one step per window, like state.step.
  assert int(state.opt_state.inner_opt_state[-1].count) == int(state.step) == 2

  with pytest.raises(TypeError, match=r"opt_state holds exactly one MultiStepsState; found 0"):
    jaxaccum.linen.apply_gradients(
        train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)),
        grads=params)


def test_batch_argnames_options_and_reserved_arguments():
  params = VARIABLES["params"]
  x, y = data(4)
  seen = []

  def kw_loss(params, x, model_state, rngs, *, labels):
    seen.append(labels.shape)
    logits = MODEL.clone(train=False).apply({"params": params, **model_state}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), model_state

  stats = {"batch_stats": VARIABLES["batch_stats"]}
  (ref_loss, _), ref_grads = jax.jit(jax.value_and_grad(kw_loss, has_aux=True))(
      params, x, stats, {}, labels=y)
  vg = jaxaccum.linen.value_and_grad(kw_loss, num_micro_batches=N, batch_argnames="labels",
                                     with_info=True)
  (loss, _), grads, info = vg(params, x, stats, {}, labels=y)
  assert seen[-1] == (B // N,)
  assert_close((loss, grads), (ref_loss, ref_grads))
  assert isinstance(info, jaxaccum.AccumInfo) and int(info.num_micro_batches) == N

  with pytest.raises(TypeError, match=r"takes no rng_argnums= option"):
    jaxaccum.linen.value_and_grad(kw_loss, num_micro_batches=N, rng_argnums=4)
