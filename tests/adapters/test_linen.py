"""jaxaccum.linen: a Linen CNN with BatchNorm and dropout in a TrainState step.

References, both under ``jax.jit``:
* GroupNorm without dropout: plain ``jax.value_and_grad`` on the full batch;
* BatchNorm and dropout: a Python loop over the micro-batches sliced by hand (``x[i::N]``
  is micro-batch ``i`` of ``N``; inputs have distinct rows) that threads
  ``batch_stats`` from micro-batch to micro-batch and gives micro-batch ``i`` the key
  ``jax.random.fold_in(key, i)``, then averages the gradients.
Tolerance: ``tests._util.assert_close`` (float32, 1e-5 relative to each leaf's maximum).
"""

import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxaccum
from tests._problems import micro_batch
from tests._util import assert_close


class CNN(nn.Module):
  norm: str = "batch"
  dropout: float = 0.5

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(4, (3, 3))(x)
    if self.norm == "batch":
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    else:
      x = nn.GroupNorm(num_groups=2)(x)
    x = nn.relu(x).mean(axis=(1, 2))
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return nn.Dense(3)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any


def make_loss(model):
  def loss_fn(params, batch, model_state, rngs):
    x, y = batch
    logits, new_state = model.apply({"params": params, **model_state}, x, train=True,
                                    mutable=list(model_state), rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new_state

  return loss_fn


@functools.partial(jax.jit, static_argnums=1)
def data(step, batch_size=8):
  kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(42), step))
  return (jax.random.normal(kx, (batch_size, 6, 6, 1)),
          jax.random.randint(ky, (batch_size,), 0, 3))


def create(model, tx=None):
  variables = jax.jit(model.init, static_argnames="train")(jax.random.key(0), data(0)[0],
                                                           train=False)
  tx = tx or optax.sgd(0.1, momentum=0.9)
  if "batch_stats" in variables:
    return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                             batch_stats=variables["batch_stats"])
  return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)


@jax.jit
def _reference_step(state, batch, key):
  """The sequential micro-batch loop for the BatchNorm + dropout CNN, N = 4."""
  n = 4
  loss_fn = make_loss(CNN("batch", 0.5))
  model_state = {"batch_stats": state.batch_stats}
  loss, grads = 0.0, jax.tree.map(jnp.zeros_like, state.params)
  for i in range(n):
    mb = micro_batch(batch, i, n)
    (l_i, model_state), g_i = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, mb, model_state, {"dropout": jax.random.fold_in(key, i)})
    loss, grads = loss + l_i / n, jax.tree.map(lambda a, g: a + g / n, grads, g_i)
  return state.apply_gradients(grads=grads, **model_state), loss, grads


def test_batchnorm_dropout_train_steps_match_sequential_micro_batches():
  model = CNN("batch", 0.5)
  state = ref_state = create(model)
  vg = jax.jit(jaxaccum.linen.value_and_grad(make_loss(model), num_micro_batches=4))
  train_step = jax.jit(jaxaccum.linen.make_train_step(make_loss(model), num_micro_batches=4))
  root = jax.random.key(7)
  for step in range(3):
    batch, key = data(step), jax.random.fold_in(root, step)
    (loss, new_stats), grads = vg(state.params, batch, {"batch_stats": state.batch_stats},
                                  {"dropout": key})
    state, step_loss = train_step(state, batch, {"dropout": key})
    ref_state, ref_loss, ref_grads = _reference_step(ref_state, batch, key)
    assert_close(loss, ref_loss, err_msg=f"step {step}")
    assert_close(step_loss, ref_loss, err_msg=f"step {step}")
    assert_close(grads, ref_grads, err_msg=f"step {step}")
    assert_close(new_stats["batch_stats"], ref_state.batch_stats, err_msg=f"step {step}")
  assert int(state.step) == 3
  assert_close(state.params, ref_state.params)
  assert_close(state.batch_stats, ref_state.batch_stats)
  assert_close(state.opt_state, ref_state.opt_state)


class DenseDropout(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dropout(0.5, deterministic=False)(nn.Dense(32)(x))


def test_dropout_masks_differ_per_micro_batch():
  """Micro-batch i (rows i::n, fun sees 2 rows) uses fold_in(key, i): distinct masks."""
  n = 4
  model = DenseDropout()
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 3)))["params"]
  traced_shapes = []

  def loss_fn(params, x, model_state, rngs):
    traced_shapes.append(x.shape)
    h = model.apply({"params": params}, x, rngs=rngs)
    return jnp.mean(h**2), (model_state, h)

  x, key = jax.random.normal(jax.random.key(1), (8, 3)), jax.random.key(5)  # distinct rows
  (_, (_, h)), _ = jax.jit(jaxaccum.linen.value_and_grad(
      loss_fn, micro_batch_size=2, has_aux=True, aux_reduce="stack"))(
          params, x, {}, {"dropout": key})
  assert traced_shapes and set(traced_shapes) == {(2, 3)}, traced_shapes
  apply = jax.jit(model.apply)
  for i in range(n):
    ref = apply({"params": params}, x[i::n], rngs={"dropout": jax.random.fold_in(key, i)})
    assert_close(h[i], ref, err_msg=f"micro-batch {i}")
  masks = (h == 0).reshape(n, -1)
  for i in range(n):
    for j in range(i):
      assert (masks[i] != masks[j]).any(), f"micro-batches {i} and {j} share a mask"


def test_batchnorm_gradient_differs_from_full_batch():
  model = CNN("batch", 0.0)
  state = create(model)
  batch = data(0)
  model_state = {"batch_stats": state.batch_stats}
  (_, _), grads = jax.jit(jaxaccum.linen.value_and_grad(make_loss(model), num_micro_batches=4))(
      state.params, batch, model_state, {})
  (_, _), ref = jax.jit(jax.value_and_grad(make_loss(model), has_aux=True))(
      state.params, batch, model_state, {})
  g, r = grads["Conv_0"]["kernel"], ref["Conv_0"]["kernel"]
  rel = float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
  assert rel > 1e-2, f"ghost-batch gradient unexpectedly equals the full batch (rel={rel})"


@pytest.mark.parametrize("n", [1, 4])
def test_groupnorm_train_steps_equal_full_batch(n):
  model = CNN("group", 0.0)
  loss_fn = make_loss(model)
  state = ref_state = create(model)
  train_step = jax.jit(jaxaccum.linen.make_train_step(loss_fn, num_micro_batches=n,
                                                      collections=()))

  @jax.jit
  def ref_step(state, batch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, {}, {})
    return state.apply_gradients(grads=grads), loss

  for step in range(3):
    state, loss = train_step(state, data(step), {})
    ref_state, ref_loss = ref_step(ref_state, data(step))
    assert_close(loss, ref_loss, err_msg=f"step {step}")
  assert_close(state.params, ref_state.params)


def test_no_retrace_on_second_step():
  model = CNN("batch", 0.5)
  train_step = jaxaccum.linen.make_train_step(make_loss(model), num_micro_batches=4)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, batch, rngs):
    return train_step(state, batch, rngs)

  state = create(model)
  for s in range(3):
    state, _ = step(state, data(s), {"dropout": jax.random.key(s)})


def test_has_aux():
  model = CNN("batch", 0.5)
  loss_fn = make_loss(model)

  def with_aux(params, batch, model_state, rngs):
    loss, new_state = loss_fn(params, batch, model_state, rngs)
    return loss, (new_state, {"loss": loss})

  state = create(model)
  train_step = jax.jit(jaxaccum.linen.make_train_step(with_aux, num_micro_batches=4,
                                                      has_aux=True))
  _, (loss, aux) = train_step(state, data(0), {"dropout": jax.random.key(0)})
  assert_close(aux["loss"], loss)


def test_bad_input():
  model = CNN("batch", 0.5)
  loss_fn = make_loss(model)
  state = create(model)
  with pytest.raises(TypeError, match=r"four positional arguments.*signature \(params, batch\)"):
    jaxaccum.linen.value_and_grad(lambda params, batch: 0.0, num_micro_batches=2)
  vg = jaxaccum.linen.value_and_grad(loss_fn, num_micro_batches=2)
  stats = {"batch_stats": state.batch_stats}
  with pytest.raises(TypeError, match=r"argument 3 \('rngs'\), but its leaf \['dropout'\] is an "
                                      r"array of shape \(\) and dtype int32"):
    vg(state.params, data(0), stats, {"dropout": jnp.int32(0)})
  x, y = data(0)
  with pytest.raises(ValueError,
                     match=r"8 at argument 1 \('batch'\)\[0\]; 6 at argument 1 \('batch'\)\[1\]"):
    vg(state.params, (x, y[:6]), stats, {"dropout": jax.random.key(0)})
  with pytest.raises(TypeError, match=r"TrainState has no field 'batch_stats'"):
    plain = train_state.TrainState.create(apply_fn=model.apply, params=state.params,
                                          tx=optax.sgd(0.1))
    jaxaccum.linen.make_train_step(loss_fn, num_micro_batches=2)(
        plain, data(0), {"dropout": jax.random.key(0)})
  with pytest.raises(TypeError, match=r"collections must be a sequence of collection names"):
    jaxaccum.linen.make_train_step(loss_fn, num_micro_batches=2, collections="batch_stats")


# --- make_train_step(axis_name=...) under jax.pmap: the core's cross-device rules ----------
#
# References: jax.value_and_grad on the rows that survive (a micro-batch with a NaN row is
# skipped whole; replica r holds rows r*B/2 .. (r+1)*B/2 - 1 and its micro-batch i the local
# rows i::N), and the core's value_and_grad(data_axis=...) on the same data.

R, NR = 2, 2  # replicas, micro-batches per replica
LR = 0.1


class Regressor(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(jnp.tanh(nn.Dense(4)(x)))[:, 0]


REGRESSOR = Regressor()
init_regressor = jax.jit(REGRESSOR.init)


def _regression_loss(reduce):
  def loss_fn(params, batch, model_state, rngs):
    x, y = batch
    sq = (REGRESSOR.apply({"params": params}, x) - y) ** 2
    value = {"mean": jnp.mean(sq), "sum": jnp.sum(sq), "weighted": (jnp.sum(sq), sq.size)}
    return value[reduce], model_state
  return loss_fn


@functools.partial(jax.jit, static_argnums=0)
def _regression_data(b=8):
  kx, ky = jax.random.split(jax.random.key(3))
  return jax.random.normal(kx, (b, 3)), jax.random.normal(ky, (b,))


_REFERENCE = {reduce: jax.jit(jax.value_and_grad(_regression_loss(reduce), has_aux=True))
              for reduce in ("mean", "sum")}


def _replicate(tree):
  return jax.tree.map(lambda a: np.broadcast_to(a, (R,) + np.shape(a)), tree)


def _per_replica(tree):
  return jax.tree.map(lambda a: np.reshape(a, (R, a.shape[0] // R) + a.shape[1:]), tree)


def _pmap_step(loss_fn, state, batch, **options):
  step = jaxaccum.linen.make_train_step(loss_fn, num_micro_batches=NR, axis_name="batch",
                                        **options)
  return jax.pmap(step, axis_name="batch", devices=jax.devices()[:R])(
      _replicate(state), _per_replica(batch), {})


# Local rows (0..3 of each replica) of micro-batch 0: rows 0 and 2.
NAN_CASES = {
    "replica0-all-nan": ((0, 1, 2, 3), (4, 5, 6, 7)),
    "replica0-keeps-one": ((0, 2), (1, 3, 4, 5, 6, 7)),
    "replicas-keep-one-and-zero": ((0, 2, 4, 5, 6, 7), (1, 3)),
}


@pytest.mark.parametrize("reduce", ["mean", "sum", "weighted"])
@pytest.mark.parametrize("case", list(NAN_CASES))
def test_axis_name_skip_nonfinite_weighs_replicas_by_micro_batches_kept(case, reduce):
  nan_rows, kept_rows = NAN_CASES[case]
  x, y = _regression_data()
  x, y = np.array(x), np.asarray(y)
  x[list(nan_rows)] = np.nan
  params = init_regressor(jax.random.key(0), x[:1])["params"]
  state = train_state.TrainState.create(apply_fn=REGRESSOR.apply, params=params,
                                        tx=optax.sgd(LR))
  new, loss = _pmap_step(_regression_loss(reduce), state, (x, y), collections=(),
                         reduce=reduce, skip_nonfinite=True)

  # Reference: the finite rows only, through plain jax.value_and_grad.
  keep = list(kept_rows)
  full = _REFERENCE["sum" if reduce == "sum" else "mean"]
  (ref_loss, _), ref_grads = full(params, (x[keep], y[keep]), {}, {})
  ref_params = jax.tree.map(lambda p, g: p - LR * g, params, ref_grads)
  loss, new_params = jax.device_get((loss, new.params))
  for r in range(R):
    chex.assert_trees_all_close(loss[r], ref_loss, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(jax.tree.map(lambda a, r=r: a[r], new_params), ref_params,
                                rtol=1e-5, atol=1e-6)


class BNRegressor(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=False, momentum=0.8)(nn.Dense(4)(x))
    return nn.Dense(1)(jnp.tanh(h))[:, 0]


def test_axis_name_equals_the_core_data_axis_mode():
  """Loss, gradients, aux of every kind, batch statistics and info, with a skipped
  micro-batch on one replica, against value_and_grad(data_axis='data') on the same rows."""
  model = BNRegressor()
  x, y = _regression_data(16)
  x = np.array(x)
  x[[1, 5]] = np.inf  # replica 0, local micro-batch 1 of 2
  variables = jax.jit(model.init)(jax.random.key(1), x[:2])
  params, stats = variables["params"], variables["batch_stats"]

  def loss_fn(params, batch, model_state, rngs):
    x, y = batch
    pred, new_state = model.apply({"params": params, **model_state}, x,
                                  mutable=list(model_state))
    sq = (pred - y) ** 2
    aux = {"mse": jnp.mean(sq), "rows": jnp.sum(jnp.isfinite(pred)), "worst": jnp.max(sq),
           "per_mb": jnp.mean(pred), "pred": pred}
    return (jnp.sum(sq), jnp.sum(jnp.abs(y) > 0.5) + 1), (new_state, aux)

  options = dict(num_micro_batches=NR, reduce="weighted", has_aux=True, skip_nonfinite=True,
                 with_info=True, aux_reduce={"mse": "mean", "rows": "sum", "worst": "max",
                                             "per_mb": "stack", "pred": "concat"})
  mesh = jax.make_mesh((R,), ("data",), devices=jax.devices()[:R])
  core = jax.jit(jaxaccum.linen.value_and_grad(loss_fn, data_axis=jaxaccum.DataParallel("data",
                 mesh=mesh), **options))
  ((ref_loss, (ref_state, ref_aux)), ref_grads, ref_info) = core(
      params, (x, y), {"batch_stats": stats}, {})

  class State(train_state.TrainState):
    batch_stats: Any

  state = State.create(apply_fn=model.apply, params=params, tx=optax.sgd(LR), batch_stats=stats)
  step = jaxaccum.linen.make_train_step(loss_fn, axis_name="batch", **options)
  new, (loss, aux), info = jax.pmap(step, axis_name="batch", devices=jax.devices()[:R])(
      _replicate(state), _per_replica((x, y)), {})
  ref_params = jax.tree.map(lambda p, g: p - LR * g, params, ref_grads)
  assert int(ref_info.skipped) == 1
  new, loss, aux, info = jax.device_get((new, loss, aux, info))
  for r in range(R):
    def at(tree, r=r):
      return jax.tree.map(lambda a: a[r], tree)
    chex.assert_trees_all_close(loss[r], ref_loss, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(at(new.params), ref_params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(at(new.batch_stats), ref_state["batch_stats"], rtol=1e-5,
                                atol=1e-6)
    scalars = {k: v for k, v in at(aux).items() if k != "pred"}
    chex.assert_trees_all_close(scalars, {k: v for k, v in ref_aux.items() if k != "pred"},
                                rtol=1e-5, atol=1e-6)
    # "concat" rows stay on their replica: replica r holds its own rows of the full result.
    chex.assert_trees_all_close(aux["pred"][r], np.asarray(ref_aux["pred"])[r * 8:(r + 1) * 8],
                                rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(at(info), ref_info, rtol=1e-5, atol=1e-6)


def test_axis_name_under_shard_map_equals_full_batch():
  """Replicated parameters inside shard_map: each replica's gradients are its own (not
  already summed over the replicas by the backward pass) until the one combine."""
  x, y = _regression_data()
  params = init_regressor(jax.random.key(0), x[:1])["params"]
  state = train_state.TrainState.create(apply_fn=REGRESSOR.apply, params=params,
                                        tx=optax.sgd(LR))
  mesh = jax.make_mesh((R,), ("batch",), devices=jax.devices()[:R],
                       axis_types=(jax.sharding.AxisType.Auto,))
  step = jaxaccum.linen.make_train_step(_regression_loss("mean"), num_micro_batches=NR,
                                        axis_name="batch", collections=())
  mapped = jax.shard_map(lambda s, b: step(s, b, {}), mesh=mesh,
                         in_specs=(jax.P(), jax.P("batch")), out_specs=jax.P())
  new, loss = jax.jit(mapped)(state, (x, y))
  (ref_loss, _), ref_grads = _REFERENCE["mean"](params, (x, y), {}, {})
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(new.params, jax.tree.map(lambda p, g: p - LR * g, params,
                                                       ref_grads), rtol=1e-5, atol=1e-6)
