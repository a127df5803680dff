"""The adapters' evaluate (nnx.evaluate, eqx.filter_evaluate) and core options through them.

References, written without the library's split:
* a model in eval mode (nnx ``Dropout`` deterministic, ``BatchNorm`` on its running
  averages; an equinox MLP): ``fun`` on the full batch;
* a model in train mode (dropout draws, batch statistics): a Python loop over the
  micro-batches sliced by hand (``x[i::N]`` is micro-batch ``i`` of ``N``), calling ``fun``
  on each in order with the state threaded (the NNX model mutated in place, the equinox
  ``State`` passed on, ``fold_in(key, i)`` for keys); values averaged, per-example rows put
  back at ``i::N``.
The last part runs ``rng_argnames`` and ``batch_axis`` through the adapters against the same
kind of references (``per_example`` and ``batch_axis`` on the adapters'
value_and_grad are in tests/per_example/test_rule.py and tests/core/test_split.py).
float32, rtol 1e-5.
"""

import chex
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxaccum

B, N, F = 16, 4, 3
X = jax.random.normal(jax.random.key(0), (B, F))
Y = jnp.arange(B) % 2
KEY = jax.random.key(5)


def close(actual, expected, rtol=1e-5, atol=1e-6):
  chex.assert_trees_all_close(jax.tree.map(np.asarray, actual),
                              jax.tree.map(np.asarray, expected), rtol=rtol, atol=atol)


def rows_in_batch_order(parts):
  """Per-micro-batch rows (micro-batch ``i`` held rows ``i::N``) back in batch order."""
  out = np.zeros((B, *parts[0].shape[1:]), np.float32)
  for i, p in enumerate(parts):
    out[i::N] = p
  return out


# --- jaxaccum.nnx.evaluate ---------------------------------------------------------------


class Net(nnx.Module):
  """Linear -> BatchNorm -> Dropout -> Linear: per-micro-batch in train mode only."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(F, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.l2 = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def nnx_metrics(model, x, y):
  logits = model(x)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return jnp.mean(ce), {"ce": ce, "logits": logits, "correct": jnp.sum(logits.argmax(-1) == y)}


NNX_AUX = {"ce": "concat", "logits": "concat", "correct": None}


def nnx_arrays(model):
  def raw(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  return jax.tree.map(raw, nnx.to_pure_dict(nnx.state(model)))


def test_nnx_evaluate_eval_mode_equals_the_full_batch():
  model = Net(nnx.Rngs(0))
  model.bn.mean[...] = jnp.linspace(-1.0, 1.0, 8)  # running averages that matter
  model.bn.var[...] = jnp.linspace(0.5, 2.0, 8)
  model.eval()  # Dropout deterministic, BatchNorm on its running averages
  before = nnx_arrays(model)
  ev = nnx.jit(jaxaccum.nnx.evaluate(nnx_metrics, num_micro_batches=N, batch_argnums=(1, 2),
                                     has_aux=True, aux_reduce=NNX_AUX))
  got = ev(model, X, Y)
  close(got, nnx_metrics(model, X, Y))
  close(nnx_arrays(model), before)  # nothing written


def test_nnx_evaluate_train_mode_threads_the_state_like_a_hand_loop():
  model, ref = Net(nnx.Rngs(1)), Net(nnx.Rngs(1))
  ev = nnx.jit(jaxaccum.nnx.evaluate(nnx_metrics, num_micro_batches=N, batch_argnums=(1, 2),
                                     has_aux=True, aux_reduce=NNX_AUX))
  value, aux = ev(model, X, Y)
  step = nnx.jit(nnx_metrics)
  outs = [step(ref, X[i::N], Y[i::N]) for i in range(N)]  # ref's stats and rngs advance
  close(value, np.mean([o[0] for o in outs]))
  close(aux["ce"], rows_in_batch_order([o[1]["ce"] for o in outs]))
  close(aux["logits"], rows_in_batch_order([o[1]["logits"] for o in outs]))
  assert int(aux["correct"]) == sum(int(o[1]["correct"]) for o in outs)
  # BatchNorm's running averages (updated N times, in order), the dropout stream's counter.
  close(nnx_arrays(model), nnx_arrays(ref))
  assert int(model.drop.rngs.count[...]) == N  # one dropout draw per micro-batch


class Counter(nnx.Variable):
  pass


class Scaled(nnx.Module):
  """Writes a Param (its scale) and a Counter on every call."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(F, 1, rngs=rngs)
    self.scale = nnx.Param(jnp.float32(1.0))
    self.calls = Counter(jnp.int32(0))

  def __call__(self, x):
    self.scale[...] = self.scale[...] * 0.5
    self.calls[...] += 1
    return self.lin(x)[:, 0] * self.scale[...]


def test_nnx_evaluate_writes_to_params_and_call_time_objects_are_threaded():
  model, ref = Scaled(nnx.Rngs(2)), Scaled(nnx.Rngs(2))
  other, ref_other = Scaled(nnx.Rngs(3)), Scaled(nnx.Rngs(3))

  def fun(model, x, extra):
    return jnp.mean(model(x) + extra["other"](x))

  value = nnx.jit(jaxaccum.nnx.evaluate(fun, num_micro_batches=N))(model, X, {"other": other})
  ref_values = [fun(ref, X[i::N], {"other": ref_other}) for i in range(N)]
  close(value, np.mean(ref_values))
  close((nnx_arrays(model), nnx_arrays(other)), (nnx_arrays(ref), nnx_arrays(ref_other)))
  assert int(model.calls[...]) == N and float(model.scale[...]) == 0.5 ** N


def test_nnx_evaluate_batch_axis_and_a_keyword_key():
  model = nnx.Linear(F, 1, rngs=nnx.Rngs(4))
  xt = jnp.swapaxes(X.reshape(B, 1, F), 0, 1).repeat(2, 0)  # time-major (T=2, B, F)

  def fun(model, x, *, key):
    noise = jax.random.normal(key, ())
    return jnp.mean(model(x) ** 2) + noise, model(x)[..., 0]

  ev = jaxaccum.nnx.evaluate(fun, num_micro_batches=N, batch_axis=1, rng_argnames="key",
                             has_aux=True, aux_reduce="concat")
  value, out = nnx.jit(ev)(model, xt, key=KEY)
  outs = [fun(model, xt[:, i::N], key=jax.random.fold_in(KEY, i)) for i in range(N)]
  close(value, np.mean([o[0] for o in outs]))
  want = np.zeros((2, B), np.float32)
  for i, o in enumerate(outs):
    want[:, i::N] = o[1]
  close(out, want)  # concat along batch_axis=1


def test_nnx_evaluate_refuses_options_that_make_no_sense():
  for option, value in [("wrt", nnx.Param), ("argnums", 0), ("with_info", True),
                        ("remat", True), ("grads_dtype", jnp.float32),
                        ("per_example", lambda g: g)]:
    with pytest.raises(TypeError, match=rf"jaxaccum.nnx.evaluate takes no {option}= option"):
      jaxaccum.nnx.evaluate(nnx_metrics, num_micro_batches=N, **{option: value})
  with pytest.raises(TypeError, match="takes no state_argnums= option"):
    jaxaccum.nnx.evaluate(nnx_metrics, num_micro_batches=N, state_argnums=2)
  with pytest.raises(TypeError, match=r"must be an NNX object.*jaxaccum.evaluate"):
    jaxaccum.nnx.evaluate(nnx_metrics, num_micro_batches=N)({"w": 1.0}, X, Y)
  assert "jaxaccum.nnx.evaluate" in repr(jaxaccum.nnx.evaluate(nnx_metrics,
                                                               num_micro_batches=N))


# --- jaxaccum.eqx.filter_evaluate ---------------------------------------------------------


class EqxNet(eqx.Module):
  lin: eqx.nn.Linear
  bn: eqx.nn.BatchNorm
  drop: eqx.nn.Dropout
  head: eqx.nn.Linear
  act: object = eqx.field(static=True)
  steps: jax.Array  # an integer array leaf: passed whole, like the floats

  def __init__(self, key, *, inference=False):
    k1, k2 = jax.random.split(key)
    self.lin = eqx.nn.Linear(F, 8, key=k1)
    self.bn = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.5, mode="batch",
                               inference=inference)
    self.drop = eqx.nn.Dropout(0.5, inference=inference)
    self.head = eqx.nn.Linear(8, 2, key=k2)
    self.act = jax.nn.relu
    self.steps = jnp.int32(3)


def eqx_metrics(model, x, y, state, *, key):
  keys = jax.random.split(key, x.shape[0])

  def one(xi, k, state):
    h, state = model.bn(model.act(model.lin(xi)), state)
    return model.head(model.drop(h, key=k)), state

  logits, state = jax.vmap(one, axis_name="batch", in_axes=(0, 0, None),
                           out_axes=(0, None))(x, keys, state)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y) * model.steps
  return jnp.mean(ce), (state, {"ce": ce, "correct": jnp.sum(logits.argmax(-1) == y)})


EQX_OPTIONS = dict(num_micro_batches=N, batch_argnums=(1, 2), state_argnums=3,
                   rng_argnames="key", has_aux=True, aux_reduce={"ce": "concat", "correct": None})


def floats(tree):
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def test_eqx_filter_evaluate_inference_mode_equals_the_full_batch():
  model, state = eqx.nn.make_with_state(EqxNet)(jax.random.key(6), inference=True)
  ev = eqx.filter_jit(jaxaccum.eqx.filter_evaluate(eqx_metrics, **EQX_OPTIONS))
  value, (new_state, aux) = ev(model, X, Y, state, key=KEY)
  ref_value, (_, ref_aux) = eqx_metrics(model, X, Y, state, key=KEY)
  close((value, aux), (ref_value, ref_aux))
  close(floats(new_state), floats(state))  # inference: the statistics are not updated


def test_eqx_filter_evaluate_train_mode_threads_state_and_folds_the_key_like_a_hand_loop():
  model, state = eqx.nn.make_with_state(EqxNet)(jax.random.key(7))
  ev = eqx.filter_jit(jaxaccum.eqx.filter_evaluate(**EQX_OPTIONS)(eqx_metrics))  # decorator
  value, (new_state, aux) = ev(model, X, Y, state, key=KEY)
  ref_state, outs = state, []
  step = eqx.filter_jit(eqx_metrics)
  for i in range(N):
    v, (ref_state, a) = step(model, X[i::N], Y[i::N], ref_state, key=jax.random.fold_in(KEY, i))
    outs.append((v, a))
  close(value, np.mean([o[0] for o in outs]))
  close(aux["ce"], rows_in_batch_order([o[1]["ce"] for o in outs]))
  assert int(aux["correct"]) == sum(int(o[1]["correct"]) for o in outs)
  close(floats(new_state), floats(ref_state))


def test_eqx_filter_evaluate_refuses_gradient_options():
  for option, value in [("argnums", 0), ("with_info", True), ("remat", True),
                        ("loss_weights", {"a": 1.0})]:
    with pytest.raises(TypeError, match=rf"filter_evaluate takes no {option}= option.*"
                       r"filter_value_and_grad"):
      jaxaccum.eqx.filter_evaluate(eqx_metrics, num_micro_batches=N, **{option: value})
  with pytest.raises(TypeError, match="fun must be a callable"):
    jaxaccum.eqx.filter_evaluate(3, num_micro_batches=N)


def test_linen_evaluate_refuses_gradient_options():
  with pytest.raises(TypeError, match=r"jaxaccum.linen.evaluate takes no with_info= option"):
    jaxaccum.linen.evaluate(lambda p, b, s, r: (0.0, s), num_micro_batches=N, with_info=True)


# --- rng_argnames and batch_axis through the adapters --------------------------------------


def test_nnx_value_and_grad_folds_a_keyword_key():
  model = nnx.Linear(F, 2, rngs=nnx.Rngs(8))

  def loss(model, x, y, *, key):
    keep = jax.random.bernoulli(key, 0.7, x.shape)
    return optax.softmax_cross_entropy_with_integer_labels(model(x * keep), y).mean()

  vg = nnx.jit(lambda m, x, y, key: jaxaccum.nnx.value_and_grad(
      loss, num_micro_batches=N, batch_argnums=(1, 2), rng_argnames="key")(m, x, y, key=key))
  loss_value, grads = vg(model, X, Y, KEY)
  ref_vg = nnx.jit(nnx.value_and_grad(lambda m, x, y, k: loss(m, x, y, key=k)))
  outs = [ref_vg(model, X[i::N], Y[i::N], jax.random.fold_in(KEY, i)) for i in range(N)]
  close((loss_value, nnx.to_pure_dict(grads)),
        jax.tree.map(lambda *v: sum(v) / N, *[(o[0], nnx.to_pure_dict(o[1])) for o in outs]))


def test_eqx_model_called_with_key_keyword():
  model = eqx.nn.Sequential([eqx.nn.Linear(F, 8, key=jax.random.key(9)), eqx.nn.Dropout(0.5),
                             eqx.nn.Lambda(jnp.tanh), eqx.nn.Linear(8, 2, key=jax.random.key(10))])

  def loss(model, x, y, *, key):
    logits = jax.vmap(lambda xi, k: model(xi, key=k))(x, jax.random.split(key, x.shape[0]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  grads = eqx.filter_jit(jaxaccum.eqx.filter_grad(
      loss, num_micro_batches=N, batch_argnums=(1, 2), rng_argnames="key"))(model, X, Y, key=KEY)
  ref_grad = eqx.filter_jit(eqx.filter_grad(loss))
  ref = [ref_grad(model, X[i::N], Y[i::N], key=jax.random.fold_in(KEY, i)) for i in range(N)]
  close(eqx.filter(grads, eqx.is_array), eqx.filter(
      jax.tree.map(lambda *g: sum(g) / N, *ref), eqx.is_array))


def linen_setup():
  model = nn.Dense(2)
  params = model.init(jax.random.key(11), X)["params"]

  def loss(params, batch, model_state, rngs, *, key=None):
    x, y = batch
    if key is not None:
      x = x * jax.random.bernoulli(key, 0.7, x.shape)
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), model_state

  return model, params, loss


def test_linen_value_and_grad_folds_a_keyword_key():
  _, params, loss = linen_setup()
  vg = jax.jit(jaxaccum.linen.value_and_grad(loss, num_micro_batches=N, rng_argnames="key"))
  (value, _), grads = vg(params, (X, Y), {}, {}, key=KEY)
  ref_vg = jax.jit(jax.value_and_grad(loss, has_aux=True))
  outs = [ref_vg(params, (X[i::N], Y[i::N]), {}, {}, key=jax.random.fold_in(KEY, i))
          for i in range(N)]
  close((value, grads), jax.tree.map(lambda *v: sum(v) / N, *[(o[0][0], o[1]) for o in outs]))


def test_linen_make_train_step_with_batch_axis_equals_the_full_batch_step():
  model, params, loss = linen_setup()
  tx = optax.sgd(0.1)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  xt, yt = X.reshape(4, 4, F).swapaxes(0, 1), Y.reshape(4, 4).swapaxes(0, 1)  # (4, 4, ...)

  def loss_t(params, batch, model_state, rngs):  # a time-major batch: axis 1 is the batch
    x, y = batch
    return loss(params, (x.reshape(-1, F), y.reshape(-1)), model_state, rngs)

  step = jax.jit(jaxaccum.linen.make_train_step(loss_t, num_micro_batches=2, collections=(),
                                                batch_axis=1))
  new, value = step(state, (xt, yt), {})
  (ref_value, _), grads = jax.jit(jax.value_and_grad(loss_t, has_aux=True))(
      params, (xt, yt), {}, {})
  close((value, new.params), (ref_value, state.apply_gradients(grads=grads).params))


def test_linen_make_train_step_refuses_keyword_roles():
  _, _, loss = linen_setup()
  for option in ("rng_argnames", "batch_argnames"):
    with pytest.raises(TypeError, match=rf"make_train_step takes no {option}= option.*rngs"):
      jaxaccum.linen.make_train_step(loss, num_micro_batches=N, **{option: "key"})
