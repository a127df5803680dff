"""``MultiSteps(data_axis=...)`` with ``local_value_and_grad``: one reduction per window.

On 8 CPU devices, a scan-over-layers model with replicated parameters and a batch sharded over
``"data"``: each call computes per-device, unreduced gradients (no collective) and the window's
last call sums them, once, in float32, before the inner optimizer. References: the whole
window's batch through plain ``jax.value_and_grad`` and the same optax optimizer, and each
shard's rows sliced by hand. Collective counts are read with ``jaxaccum.planning.collectives`` and
checked against the compiled text.
"""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

K = 4  # calls per window
ROWS = 64  # rows per call: 8 per device
D = 8


def loss_fn(params, batch):
  x, y = batch

  def layer(h, p):
    return jnp.tanh(h @ p["w"] + p["b"]), None

  h, _ = jax.lax.scan(layer, x.astype(params["head"].dtype), params["layers"])
  return jnp.mean((h @ params["head"] - y) ** 2)


# The references, jitted once (eager scans over layers are slow).
value_and_grad_ref = jax.jit(jax.value_and_grad(loss_fn))


def sum_loss(params, batch):
  return loss_fn(params, batch) * batch[0].shape[0]


def make_problem(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(0), 5)
  params = {"layers": {"w": jax.random.normal(k[0], (3, 8, 8)) / 3,
                       "b": jax.random.normal(k[1], (3, 8)) / 5},
            "head": jax.random.normal(k[2], (8, 1))}
  params = jax.tree.map(lambda p: p.astype(dtype), params)
  x = jax.random.normal(k[3], (K * ROWS, 8))
  y = jax.random.normal(k[4], (K * ROWS, 1))
  return params, (x, y)


def mesh_of(axis_type):
  return jax.make_mesh((D,), ("data",), axis_types=(axis_type,))


def make_step(opt, grad_fn):
  @jax.jit
  def train_step(params, state, micro_batch):
    loss, grads = grad_fn(params, micro_batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  return train_step


def after_one_step(tx, params, grads):
  @jax.jit
  def one_step(params, grads):
    return optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
  return one_step(params, grads)


def run_window(mesh, params, batch, *, loss=loss_fn, reduce="mean", use_grad_mean=True,
               tx=None, pass_mesh=True, **accumulate):
  tx = tx or optax.sgd(0.1, momentum=0.9)
  # without pass_mesh, the mesh set with jax.set_mesh
  opt = jaxaccum.MultiSteps(tx, every_k_schedule=K, use_grad_mean=use_grad_mean,
                            data_axis=_dp(mesh if pass_mesh else None))
  grad_fn = jaxaccum.local_value_and_grad(
      loss, data_axis=jaxaccum.DataParallel("data", mesh=mesh if pass_mesh else None),
      reduce=reduce, **accumulate)
  step = make_step(opt, grad_fn)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = opt.init(params)
  losses, emitted = [], []
  for i in range(K):  # call i gets rows i, i + K, ... of the window's batch
    micro = jax.device_put(jax.tree.map(lambda a, i=i: a[i::K], batch),
                           NamedSharding(mesh, P("data")))
    params, state, value = step(params, state, micro)
    losses.append(value.sum())
    emitted.append(bool(opt.has_updated(state)))
  return params, state, losses, emitted


def _dp(mesh):
  """MultiSteps' data axis and its mesh, as one record."""
  return jaxaccum.DataParallel("data", mesh=mesh)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_window_equals_full_batch(axis_type):
  params, batch = make_problem()
  tx = optax.sgd(0.1, momentum=0.9)  # not scale-invariant, unlike Adam
  got, state, losses, emitted = run_window(mesh_of(axis_type), params, batch, tx=tx)
  expected = after_one_step(tx, params, value_and_grad_ref(params, batch)[1])
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
  assert emitted == [False] * (K - 1) + [True]
  # Each call's value pieces sum to that call's loss, sliced by hand.
  for i, value in enumerate(losses):
    hand = value_and_grad_ref(params, (batch[0][i::K], batch[1][i::K]))[0]
    chex.assert_trees_all_close(value, hand, rtol=1e-5)
  # The accumulator stays one piece per device, and the next window starts empty.
  for acc, p in zip(jax.tree.leaves(state.acc_grads), jax.tree.leaves(params), strict=True):
    assert acc.shape == (D, *p.shape) and acc.dtype == jnp.float32
    assert not acc.sharding.is_fully_replicated
    chex.assert_trees_all_close(acc, jnp.zeros_like(acc))


def test_sum_loss_without_grad_mean():
  params, batch = make_problem()
  tx = optax.sgd(1e-3)
  got, *_ = run_window(mesh_of(AxisType.Explicit), params, batch, loss=sum_loss,
                       reduce="sum", use_grad_mean=False, tx=tx)
  expected = after_one_step(tx, params, jax.jit(jax.grad(sum_loss))(params, batch))
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)


def test_micro_batches_within_each_call():
  params, batch = make_problem()
  tx = optax.sgd(0.1, momentum=0.9)
  got, *_ = run_window(mesh_of(AxisType.Explicit), params, batch, tx=tx, num_micro_batches=2)
  expected = after_one_step(tx, params, value_and_grad_ref(params, batch)[1])
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)


def test_pieces_are_each_shards_rows():
  mesh = mesh_of(AxisType.Explicit)
  params, (x, y) = make_problem()
  x, y = x[:ROWS], y[:ROWS]
  grad_fn = jax.jit(jaxaccum.local_value_and_grad(loss_fn, data_axis=jaxaccum.DataParallel("data",
                    mesh=mesh)))
  value, grads = grad_fn(jax.device_put(params, NamedSharding(mesh, P())),
                         jax.device_put((x, y), NamedSharding(mesh, P("data"))))
  value, grads = jax.device_get((value, grads))
  rows = ROWS // D
  for d in range(D):  # shard d holds the contiguous block d of the rows; its piece is 1/D
    block = (x[d * rows:(d + 1) * rows], y[d * rows:(d + 1) * rows])
    v, g = value_and_grad_ref(params, block)
    chex.assert_trees_all_close(value[d], v / D, rtol=1e-5)
    chex.assert_trees_all_close(jax.tree.map(lambda a, d=d: a[d], grads),
                                jax.tree.map(lambda a: a / D, g), rtol=1e-5, atol=1e-7)


def test_token_weighted_calls():
  """A token mean over the window: each call's mean over its real tokens, its count as weight."""
  mesh = mesh_of(AxisType.Explicit)
  params, (x, y) = make_problem()
  mask = (jax.random.uniform(jax.random.key(7), (K * ROWS,)) < 0.6).astype(jnp.float32)
  mask = mask.at[:K].set(1.0)  # every call has some tokens

  def token_sum(params, batch, count):  # the call's token losses over its total count
    x, y, m = batch

    def layer(h, p):
      return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, x, params["layers"])
    return jnp.sum(((h @ params["head"])[:, 0] - y[:, 0]) ** 2 * m) / count

  def token_mean(params, batch):
    return token_sum(params, batch, jnp.sum(batch[2]))

  tx = optax.sgd(0.1)
  opt = jaxaccum.MultiSteps(tx, every_k_schedule=K, data_axis=_dp(mesh))
  grad_fn = jaxaccum.local_value_and_grad(token_sum, data_axis=jaxaccum.DataParallel("data",
                                          mesh=mesh), reduce="sum")

  @jax.jit
  def step(params, state, micro, count):
    _, grads = grad_fn(params, micro, count)
    updates, state = opt.update(grads, state, params, weight=count)
    return optax.apply_updates(params, updates), state

  p = jax.device_put(params, NamedSharding(mesh, P()))
  state = opt.init(p)
  for i in range(K):
    micro = (x[i::K], y[i::K], mask[i::K])
    count = jnp.sum(micro[2])  # known from the data: the call's real tokens
    p, state = step(p, state, jax.device_put(micro, NamedSharding(mesh, P("data"))), count)
  expected = after_one_step(tx, params, jax.jit(jax.grad(token_mean))(params, (x, y, mask)))
  chex.assert_trees_all_close(p, expected, rtol=1e-5, atol=1e-6)


def branch_computations(text):
  """The computations run by the branches of the text's conditionals."""
  names = set()
  for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
    names |= {n.strip().lstrip("%") for n in group.split(",")}
  names |= set(re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", text))
  return names


@pytest.mark.parametrize(("axis_type", "dtype"), [(AxisType.Explicit, jnp.bfloat16),
                                                  (AxisType.Auto, jnp.float32)],
                         ids=["explicit-bf16", "auto-f32"])
def test_collectives_one_float32_reduction_per_window(axis_type, dtype):
  mesh = mesh_of(axis_type)
  params, batch = make_problem(dtype)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  micro = jax.device_put(jax.tree.map(lambda a: a[::K], batch), NamedSharding(mesh, P("data")))
  opt = jaxaccum.MultiSteps(optax.adam(1e-2), every_k_schedule=K, data_axis=_dp(mesh))
  grad_fn = jaxaccum.local_value_and_grad(loss_fn, data_axis=jaxaccum.DataParallel("data",
                                          mesh=mesh))
  state = opt.init(params)
  step = make_step(opt, grad_fn)

  # The micro-step path: the per-device gradients communicate nothing.
  assert jaxaccum.planning.collectives(jax.jit(grad_fn), params, micro).count() == 0
  compiled = step.lower(params, state, micro).compile()
  found = jaxaccum.planning.collectives(compiled)
  text = compiled.as_text()
  # The whole step: all-reduces only, none in a loop, all in the branch that only the window's
  # last call takes, one float32 result per gradient leaf (XLA may fuse them into one op).
  assert found.count() == found.count("all-reduce") >= 1, found
  assert found.count(in_loop=True) == 0, found
  assert {op.computation for op in found} <= branch_computations(text), found
  reduced = [o for op in found for o in op.operands]
  leaves = jax.tree.leaves(params)
  assert sorted(o.shape for o in reduced) == sorted(p.shape for p in leaves), found
  assert {o.dtype for o in reduced} == {"float32"}, found
  # Read independently: the text's all-reduce ops, none in a while body.
  assert len(re.findall(r"\sall-reduce(?:-start)?\(", text)) == found.count()

  # The default path for contrast: jax.grad of the sharded batch reduces in the layer loop.
  plain = jaxaccum.MultiSteps(optax.adam(1e-2), every_k_schedule=K)
  default = make_step(plain, jax.value_and_grad(loss_fn))
  per_call = jaxaccum.planning.collectives(default, params, plain.init(params), micro)
  assert per_call.count("all-reduce", in_loop=True) >= 1, per_call


def test_errors():
  mesh = mesh_of(AxisType.Explicit)
  params, batch = make_problem()
  opt = jaxaccum.MultiSteps(optax.sgd(0.1), every_k_schedule=K, data_axis=_dp(mesh))
  state = opt.init(params)
  grads = jax.jit(jax.grad(loss_fn))(params, batch)  # reduced: no leading shard axis
  with pytest.raises(ValueError, match=r"leading axis of the 8 data shards.*"
                     r"\['head'\].*local_value_and_grad"):
    opt.update(grads, state, params)
  with pytest.raises(ValueError, match="with_info=True cannot be combined with data_axis"):
    jaxaccum.MultiSteps(optax.sgd(0.1), K, with_info=True, data_axis=_dp(mesh))
  with pytest.raises(ValueError, match="mesh=... was given without data_axis"), \
       pytest.warns(DeprecationWarning, match=r"MultiSteps\(mesh=\.\.\.\) is deprecated"):
    jaxaccum.MultiSteps(optax.sgd(0.1), K, mesh=mesh)
  with pytest.raises(ValueError, match="reduce must be 'mean' or 'sum'.*reduce='weighted'"):
    jaxaccum.local_value_and_grad(loss_fn, data_axis="data", reduce="weighted")
  with pytest.raises(TypeError, match="local_value_and_grad needs data_axis"):
    jaxaccum.local_value_and_grad(loss_fn, data_axis=None)
  with pytest.raises(ValueError, match=r"batch axis must be the leading one, got "
                     r"batch_axis=1.*jnp.moveaxis"):
    jaxaccum.local_value_and_grad(loss_fn, data_axis="data", num_micro_batches=2,
                                  batch_axis=1)
  grad_fn = jaxaccum.local_value_and_grad(loss_fn, data_axis=jaxaccum.DataParallel("data",
                                          mesh=mesh))
  with pytest.raises(ValueError, match=r"shape \(12, 8\).*multiple of the 8 data shards"):
    grad_fn(params, (batch[0][:12], batch[1][:12]))


def test_skip_nonfinite_costs_one_boolean_all_reduce_per_call():
  mesh = mesh_of(AxisType.Explicit)
  opt = jaxaccum.MultiSteps(optax.sgd(1.0), 2, skip_nonfinite=True, data_axis=_dp(mesh))
  params = jax.device_put(jnp.zeros(3), NamedSharding(mesh, P()))
  state = opt.init(params)

  def pieces(g):  # D equal pieces that sum to g
    return jax.device_put(jnp.broadcast_to(g / D, (D, 3)), NamedSharding(mesh, P("data")))

  update = jax.jit(opt.update)
  found = jaxaccum.planning.collectives(update, pieces(jnp.ones(3)), state, params)
  text = update.lower(pieces(jnp.ones(3)), state, params).compile().as_text()
  every_call = [op for op in found if op.computation not in branch_computations(text)]
  assert [(op.kind, op.dtype) for op in every_call] == [("all-reduce", "bool")], found
  _, state = update(pieces(jnp.array([1.0, 2.0, 3.0])), state, params)
  _, state = update(pieces(jnp.array([jnp.nan, 2.0, 3.0])), state, params)  # dropped
  updates, state = update(pieces(jnp.array([3.0, 4.0, 5.0])), state, params)
  chex.assert_trees_all_close(updates, -jnp.array([2.0, 3.0, 4.0]))
  assert int(state.skipped) == 1


@pytest.mark.parametrize("pass_mesh", [True, False], ids=["mesh", "no-mesh"])
def test_window_under_set_mesh(pass_mesh):
  """Under ``jax.set_mesh`` on an Explicit mesh the window's last call resets the accumulator
  to zeros typed like it (sharded over "data"), with or without ``mesh=``."""
  mesh = mesh_of(AxisType.Explicit)
  params, batch = make_problem()
  tx = optax.sgd(0.1, momentum=0.9)
  with jax.set_mesh(mesh):
    got, state, _, emitted = run_window(mesh, params, batch, tx=tx, pass_mesh=pass_mesh)
  expected = after_one_step(tx, params, value_and_grad_ref(params, batch)[1])
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
  assert emitted == [False] * (K - 1) + [True]
  for acc in jax.tree.leaves(state.acc_grads):
    assert acc.sharding.spec[0] == "data", acc.sharding
    chex.assert_trees_all_close(acc, jnp.zeros_like(acc))


def _pieces(mesh, values, dtype):
  """Per-device gradient pieces, shaped (D, ...) and sharded over "data"."""
  return jax.device_put(jnp.asarray(values, dtype), NamedSharding(mesh, P("data")))


def test_float16_pieces_without_accumulator_dtype_are_summed_in_float32():
  # accumulator_dtype=None keeps float16 pieces in float16, but the window's one reduction over
  # the shards still runs in float32: the update is the float32 sum, rounded once to float16.
  # Both calls of the window bring the same pieces, so the float16 running mean is exact.
  mesh = mesh_of(AxisType.Explicit)
  pieces = jax.random.uniform(jax.random.key(3), (D, 64), minval=60.0, maxval=70.0)
  pieces = jax.device_get(pieces.astype(jnp.float16))
  opt = jaxaccum.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=None, data_axis=_dp(mesh))
  params = jax.device_put(jnp.zeros(64, jnp.float16), NamedSharding(mesh, P()))
  state = opt.init(params)
  assert jax.tree.leaves(state.acc_grads)[0].dtype == jnp.float16
  update = jax.jit(opt.update)
  _, state = update(_pieces(mesh, pieces, jnp.float16), state, params)
  updates, _ = update(_pieces(mesh, pieces, jnp.float16), state, params)
  want = -(pieces.astype("float32").sum(0)).astype("float16")  # sgd(1.0): minus the gradient
  assert updates.dtype == jnp.float16
  chex.assert_trees_all_close(updates, want, rtol=0, atol=0)
  # The data is such that a float16 sum would be off (spacing 0.5 between 512 and 1024).
  assert not (pieces.sum(0, dtype="float16") == pieces.astype("float32").sum(0)
              .astype("float16")).all()


def test_bfloat16_params_accumulate_in_float32_by_default():
  # bf16 parameters and pieces: the default accumulator is float32, so the window's running
  # mean is the float32 mean of the calls' pieces, and the update its float32 sum over the
  # shards, rounded once to bf16.
  mesh = mesh_of(AxisType.Explicit)
  k1, k2 = jax.random.split(jax.random.key(4))
  calls = [jax.device_get(jax.random.normal(k, (D, 64)).astype(jnp.bfloat16)) for k in (k1, k2)]
  calls.append(jax.device_get((1.0 + jax.random.uniform(k2, (D, 64)) / 8).astype(jnp.bfloat16)))
  opt = jaxaccum.MultiSteps(optax.sgd(1.0), len(calls), data_axis=_dp(mesh))
  params = jax.device_put(jnp.zeros(64, jnp.bfloat16), NamedSharding(mesh, P()))
  state = opt.init(params)
  update = jax.jit(opt.update)
  f32 = [c.astype("float32") for c in calls]
  for i, c in enumerate(calls[:-1]):
    _, state = update(_pieces(mesh, c, jnp.bfloat16), state, params)
    acc = state.acc_grads
    assert acc.dtype == jnp.float32 and acc.shape == (D, 64)
    chex.assert_trees_all_close(acc, sum(f32[:i + 1]) / (i + 1), rtol=1e-6, atol=1e-7)
  updates, state = update(_pieces(mesh, calls[-1], jnp.bfloat16), state, params)
  want = -(sum(f32) / len(f32)).sum(0)
  assert updates.dtype == jnp.bfloat16
  # One rounding to bf16 of the float32 result (bf16 keeps 8 significant bits).
  chex.assert_trees_all_close(updates.astype(jnp.float32), want, rtol=2 ** -8, atol=0)


def test_mesh_keyword_is_deprecated_and_folded_into_data_parallel():
  # MultiSteps(data_axis="data", mesh=mesh), the old spelling, warns and runs the same window
  # as data_axis=DataParallel("data", mesh=mesh); a DataParallel with an FSDP placement (the
  # pieces are reduced by nothing) and a mesh given twice are refused, naming the fix.
  mesh = mesh_of(AxisType.Explicit)
  params, batch = make_problem()
  grad_fn = jax.jit(jaxaccum.local_value_and_grad(loss_fn, data_axis=_dp(mesh)))
  with pytest.warns(DeprecationWarning, match=r"MultiSteps\(mesh=\.\.\.\) is deprecated.*"
                    r"DataParallel\(axis, mesh=mesh\)"):
    old = jaxaccum.MultiSteps(optax.sgd(0.1), every_k_schedule=2, data_axis="data", mesh=mesh)
  new = jaxaccum.MultiSteps(optax.sgd(0.1), every_k_schedule=2, data_axis=_dp(mesh))
  p = jax.device_put(params, NamedSharding(mesh, P()))
  outs = []
  for opt in (old, new):
    state = opt.init(p)
    for i in range(2):
      micro = jax.device_put(jax.tree.map(lambda a, i=i: a[i::2], batch),
                             NamedSharding(mesh, P("data")))
      updates, state = jax.jit(opt.update)(grad_fn(p, micro)[1], state, p)
    outs.append((updates, state))
  chex.assert_trees_all_equal(outs[0], outs[1])
  with pytest.raises(TypeError, match=r"MultiSteps reduces nothing across devices.*"
                     r"param_gather='micro_batch'.*drop param_gather"):
    jaxaccum.MultiSteps(optax.sgd(0.1), 2, data_axis=jaxaccum.DataParallel(
        "data", mesh=mesh, param_gather="micro_batch"))
  with pytest.raises(TypeError, match="MultiSteps got mesh= and data_axis=DataParallel"), \
       pytest.warns(DeprecationWarning):
    jaxaccum.MultiSteps(optax.sgd(0.1), 2, data_axis=_dp(mesh), mesh=mesh)
