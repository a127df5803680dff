"""The replica driver's key rule, shared by ``data_axis``, ``local_value_and_grad`` and Linen's
``make_train_step(axis_name=...)``: replica ``d`` of ``D`` gets ``fold_in(key, d)``, and its
micro-batch ``i`` gets ``fold_in(fold_in(key, d), i)``; and its state rule: each replica
threads its own state through its micro-batches, as ``fun`` on the replica's rows alone.

Reference: a Python loop over the replicas and their micro-batches, sliced by hand (replica
``d`` holds rows ``d * B/D .. (d + 1) * B/D - 1``, its micro-batch ``i`` the local rows
``i::N``), each through plain ``jax.value_and_grad`` with the key folded as the rule says; the
loss and gradients are the mean over the ``D * N`` equal micro-batches. Tolerance: float32,
1e-5 relative (``tests._util.assert_close``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxaccum
from tests._util import assert_close

LR = 0.1


class DropNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dropout(0.5, deterministic=False)(jnp.tanh(nn.Dense(8)(x)))
    return nn.Dense(1)(h)[:, 0]


MODEL = DropNet()


def loss_fn(params, batch, model_state, rngs):
  """Squared error under dropout; aux "bits": per row, the first random word of the
  micro-batch's dropout key, so each replica's rows say which key it used."""
  x, y = batch
  pred = MODEL.apply({"params": params}, x, rngs=rngs)
  bits = jax.random.bits(rngs["dropout"], (), jnp.uint32)
  return jnp.mean((pred - y) ** 2), (model_state, {"bits": jnp.full(x.shape[:1], bits)})


def _data(seed, b):
  kx, ky, kp, kd = jax.random.split(jax.random.key(seed), 4)
  x, y = jax.random.normal(kx, (b, 3)), jax.random.normal(ky, (b,))
  params = jax.jit(MODEL.init)({"params": kp, "dropout": kp}, x[:1])["params"]
  return params, x, y, kd


def _reference(params, x, y, key, replicas, n):
  """Loss, gradients and per-row key bits, by hand: each replica's key folded with its index."""
  rows = x.shape[0] // replicas
  grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  losses, grads, bits = [], [], np.zeros(x.shape[0], np.uint32)
  for d in range(replicas):
    kd = jax.random.fold_in(key, d)
    for i in range(n):
      at = np.arange(d * rows, (d + 1) * rows)[i::n]
      (loss, (_, aux)), g = grad(params, (x[at], y[at]), {},
                                 {"dropout": jax.random.fold_in(kd, i)})
      losses.append(loss)
      grads.append(g)
      bits[at] = np.asarray(aux["bits"])
  mean = lambda *xs: sum(xs) / len(xs)  # noqa: E731
  return mean(*losses), jax.tree.map(mean, *grads), bits


def _step(n):
  return jaxaccum.linen.make_train_step(
      loss_fn, num_micro_batches=n, collections=(), has_aux=True,
      aux_reduce={"bits": "concat"}, axis_name="batch")


def _state(params):
  return train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=optax.sgd(LR))


def _check(params, new_params, loss, bits, ref):
  ref_loss, ref_grads, ref_bits = ref
  np.testing.assert_array_equal(bits, ref_bits)
  assert_close(loss, ref_loss)
  assert_close(new_params, jax.tree.map(lambda p, g: p - LR * g, params, ref_grads))


# A seeded fuzz over the replica count, micro-batch count, rows and seed.
CASES = [(seed, replicas, n, rows) for seed, (replicas, n, rows) in enumerate(
    [(2, 1, 4), (2, 2, 4), (4, 2, 2), (2, 4, 8), (4, 1, 3)])]


@pytest.mark.parametrize("seed,replicas,n,rows", CASES)
def test_linen_axis_name_under_pmap_folds_each_replicas_key(seed, replicas, n, rows):
  params, x, y, key = _data(seed, replicas * rows * n)
  state = _state(params)
  rep = jax.tree.map(lambda a: np.broadcast_to(a, (replicas,) + np.shape(a)), state)
  split = jax.tree.map(lambda a: a.reshape((replicas, -1) + a.shape[1:]), (x, y))
  keys = jax.random.key_data(key)[None].repeat(replicas, 0)  # the same key on every replica

  def step(s, b, k):
    return _step(n)(s, b, {"dropout": jax.random.wrap_key_data(k)})

  new, (loss, aux) = jax.pmap(step, axis_name="batch", devices=jax.devices()[:replicas])(
      rep, split, keys)
  ref = _reference(params, x, y, key, replicas, n)
  bits = np.asarray(aux["bits"])  # "concat": replica r holds its own rows
  # The replicas drew different keys from one key.
  assert len({tuple(b) for b in bits}) == replicas
  for r in range(replicas):
    _check(params, jax.tree.map(lambda a, r=r: a[r], new.params), loss[r], bits[r],
           ref[:2] + (ref[2].reshape(replicas, -1)[r],))


@pytest.mark.parametrize("axes", [("batch",), ("a", "b")])
def test_linen_axis_name_under_shard_map_folds_each_replicas_key(axes):
  """Over one axis, and over two (the replica's index is row-major over them, as the
  batch's ``P(("a", "b"))`` lays out its rows)."""
  shape = (4,) if len(axes) == 1 else (2, 2)
  mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  n = 2
  params, x, y, key = _data(7, 16)
  step = jaxaccum.linen.make_train_step(
      loss_fn, num_micro_batches=n, collections=(), has_aux=True,
      aux_reduce={"bits": "concat"}, axis_name=axes if len(axes) > 1 else axes[0])
  mapped = jax.shard_map(lambda s, b, k: step(s, b, {"dropout": k}), mesh=mesh,
                         in_specs=(jax.P(), jax.P(axes), jax.P()),
                         out_specs=(jax.P(), (jax.P(), {"bits": jax.P(axes)})))
  new, (loss, aux) = jax.jit(mapped)(_state(params), (x, y), key)
  _check(params, new.params, loss, np.asarray(aux["bits"]),
         _reference(params, x, y, key, 4, n))


def test_linen_axis_name_draws_the_keys_of_data_axis():
  """One rule: make_train_step(axis_name=...) and linen.value_and_grad(data_axis=...) give
  the same loss, gradients and per-row keys on the same rows and key."""
  replicas, n = 2, 2
  params, x, y, key = _data(11, 8)
  mesh = jax.make_mesh((replicas,), ("data",), devices=jax.devices()[:replicas])
  core = jax.jit(jaxaccum.linen.value_and_grad(
      loss_fn, num_micro_batches=n, has_aux=True, aux_reduce={"bits": "concat"},
      data_axis=jaxaccum.DataParallel("data", mesh=mesh)))
  (ref_loss, (_, ref_aux)), ref_grads = core(params, (x, y), {}, {"dropout": key})
  ref_bits = np.asarray(ref_aux["bits"])
  hand_loss, hand_grads, hand_bits = _reference(params, x, y, key, replicas, n)
  np.testing.assert_array_equal(ref_bits, hand_bits)
  assert_close((ref_loss, ref_grads), (hand_loss, hand_grads))
  state = _state(params)
  rep = jax.tree.map(lambda a: np.broadcast_to(a, (replicas,) + np.shape(a)), state)
  split = jax.tree.map(lambda a: a.reshape((replicas, -1) + a.shape[1:]), (x, y))
  keys = jax.random.key_data(key)[None].repeat(replicas, 0)
  new, (loss, aux) = jax.pmap(
      lambda s, b, k: _step(n)(s, b, {"dropout": jax.random.wrap_key_data(k)}),
      axis_name="batch", devices=jax.devices()[:replicas])(rep, split, keys)
  np.testing.assert_array_equal(np.asarray(aux["bits"]).reshape(-1), ref_bits)
  for r in range(replicas):
    assert_close(loss[r], ref_loss)
    assert_close(jax.tree.map(lambda a, r=r: a[r], new.params),
                 jax.tree.map(lambda p, g: p - LR * g, params, ref_grads))


def test_local_value_and_grad_folds_each_shards_key():
  """local_value_and_grad: shard d's piece is its rows' loss under fold_in(key, d)."""
  replicas = 4
  params, x, y, key = _data(5, 8)
  mesh = jax.make_mesh((replicas,), ("data",), devices=jax.devices()[:replicas])

  def loss(params, batch, rngs):
    return loss_fn(params, batch, {}, rngs)[0]

  fn = jax.jit(jaxaccum.local_value_and_grad(
      loss, data_axis=jaxaccum.DataParallel("data", mesh=mesh), rng_argnums=2))
  value, grads = jax.device_get(fn(params, (x, y), {"dropout": key}))
  rows = x.shape[0] // replicas
  for d in range(replicas):
    at = slice(d * rows, (d + 1) * rows)
    ref_value, ref_grads = jax.value_and_grad(loss)(
        params, (x[at], y[at]), {"dropout": jax.random.fold_in(key, d)})
    assert_close(value[d], ref_value / replicas)
    assert_close(jax.tree.map(lambda g, d=d: g[d], grads),
                 jax.tree.map(lambda g: g / replicas, ref_grads))


BAD_KEYS = {
    "floats": (lambda key: jnp.ones(3), r"no need to split it"),
    # One key per row of the whole batch (8 rows, 4 per replica): the hint names the batch's size.
    "per-example": (lambda key: jax.random.split(key, 8),
                    r"Its leading axis of size 8 is the batch's"),
}


@pytest.mark.parametrize("bad", list(BAD_KEYS))
@pytest.mark.parametrize("driver", ["data_axis", "axis_name"])
def test_a_key_argument_that_holds_no_key_is_refused_before_it_is_folded(driver, bad):
  """The driver checks key arguments before folding them: the core's message, not JAX's."""
  params, x, y, key = _data(0, 8)
  make, hint = BAD_KEYS[bad]
  bad_rngs = {"dropout": make(key)}
  if driver == "data_axis":
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    run = lambda: jaxaccum.linen.value_and_grad(  # noqa: E731
        loss_fn, num_micro_batches=2, has_aux=True, aux_reduce={"bits": "concat"},
        data_axis=jaxaccum.DataParallel("data", mesh=mesh))(params, (x, y), {}, bad_rngs)
  else:
    rep = jax.tree.map(lambda a: np.broadcast_to(a, (2,) + np.shape(a)), _state(params))
    split = jax.tree.map(lambda a: a.reshape((2, -1) + a.shape[1:]), (x, y))
    run = lambda: jax.pmap(  # noqa: E731
        lambda s, b: _step(2)(s, b, bad_rngs), axis_name="batch", devices=jax.devices()[:2])(
            rep, split)
  with pytest.raises(TypeError, match=r"rng_argnums names argument 3 .*\['dropout'\] is .*"
                                      r"not a single PRNG key\." + ".*" + hint):
    run()


# --- the state arguments are each replica's own --------------------------------------------


def fitted_loss(w, batch, state):
  """Squared error of ``x @ w * s``; the state's ``s`` takes a gradient step of its own on
  the micro-batch's rows (an inner ``jax.grad``), and ``steps`` counts the micro-batches
  without reading the data."""
  x, y = batch
  loss, ds = jax.value_and_grad(lambda s: jnp.mean((x @ w * s - y) ** 2))(state["s"])
  return loss, {"s": state["s"] - 0.1 * ds, "steps": state["steps"] + 1}


fitted_reference = jax.jit(jax.value_and_grad(fitted_loss, has_aux=True))


@pytest.mark.parametrize("replicas,n,skip", [(2, 1, False), (2, 2, True), (4, 2, False),
                                             (4, 1, True)])
def test_state_arguments_are_each_replicas_own_under_data_axis(replicas, n, skip):
  """state_argnums under data_axis: replica ``d`` threads the state through its micro-batches
  (its inner gradient that of its rows, not their sum over the replicas), then the float
  state is averaged over the replicas and the counter is their maximum; with
  skip_nonfinite too. Reference: the replicas' micro-batches by hand, each through plain
  jax.value_and_grad, the state threaded in order."""
  rng = np.random.default_rng(10 * replicas + n)
  b = replicas * n * 4
  x, y = rng.normal(size=(b, 3)).astype(np.float32), rng.normal(size=b).astype(np.float32)
  w = np.asarray([0.3, -0.2, 0.5], np.float32)
  state = {"s": jnp.float32(0.7), "steps": jnp.int32(0)}
  mesh = jax.make_mesh((replicas,), ("data",), devices=jax.devices()[:replicas])
  step = jax.jit(jaxaccum.value_and_grad(
      fitted_loss, num_micro_batches=n, state_argnums=2, skip_nonfinite=skip,
      data_axis=jaxaccum.DataParallel("data", mesh=mesh)))
  (loss, new_state), grads = step(w, (x, y), state)
  rows, losses, all_grads, states = b // replicas, [], [], []
  for d in range(replicas):
    s = state
    for i in range(n):
      at = np.arange(d * rows, (d + 1) * rows)[i::n]
      (value, s), g = fitted_reference(w, (x[at], y[at]), s)
      losses.append(value)
      all_grads.append(g)
    states.append(s)
  assert_close(loss, np.mean(losses))
  assert_close(grads, np.mean(all_grads, axis=0))
  assert_close(new_state["s"], np.mean([s["s"] for s in states]))
  assert int(new_state["steps"]) == n
