"""jaxaccum on a mesh of 8 virtual CPU devices, checked in the compiled HLO text.

* The column-major split keeps a sharded batch where it is: no all-to-all, no
  collective-permute, and no all-gather of anything but parameters.
* With ``data_axis`` the gradients are reduced once per step, after the loop: no
  all-reduce in the while body, and the same collectives for N = 2 and N = 16.
* With FSDP parameters, each micro-batch's gradient is reduce-scattered once.
* The results equal the full batch through plain ``jax.value_and_grad`` on one device.

Comparisons: ``chex.assert_trees_all_close`` with ``strict=True`` (structure, shapes and
dtypes equal too). Tolerances: float32, ``rtol=1e-5``, as the sharded program sums the same
terms in another order (per device, then across devices), and ``atol=1e-6`` for gradient
entries that cancel to near zero (losses and gradient entries here are of order 1; the
summed loss, of order ``BATCH``, scales its ``atol`` by that).
"""

import collections
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests import _problems
from tests._util import count_compiles

BATCH, FEATURES, HIDDEN, CLASSES = 256, 12, 32, 5
close = functools.partial(chex.assert_trees_all_close, rtol=1e-5, atol=1e-6, strict=True)
# Shapes that only parameters have: an all-gather of any other shape moves batch data.
PARAM_SHAPES = {(FEATURES, HIDDEN), (HIDDEN, CLASSES)}


def _problem(seed=0):
  """The shared MLP as a classifier, without biases: every parameter is a matrix, which
  the FSDP layout shards over its rows."""
  return _problems.mlp_problem(seed, (FEATURES, HIDDEN, CLASSES), BATCH, bias=False)


_nll = _problems.mlp_nll


def mean_loss(params, batch):
  return jnp.mean(_nll(params, batch)[0])


def token_loss(params, batch):
  """reduce='weighted': (summed masked loss, real rows), with aux."""
  nll, logits = _nll(params, batch)
  mask = batch["mask"]
  correct = (jnp.argmax(logits, axis=1) == batch["label"]).astype(jnp.float32)
  den = jnp.sum(mask)
  aux = {
      "accuracy": jnp.sum(correct * mask) / jnp.maximum(den, 1.0),  # weighted mean
      "tokens": den,  # "sum"
      "max_logit": jnp.max(logits),  # "max"
  }
  return (jnp.sum(nll * mask), den), aux


AUX_REDUCE = {"accuracy": None, "tokens": "sum", "max_logit": "max"}


def _token_reference(params, batch):
  def loss(p):
    nll, logits = _nll(p, batch)
    return jnp.sum(nll * batch["mask"]) / jnp.sum(batch["mask"]), logits

  (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  correct = (jnp.argmax(logits, axis=1) == batch["label"]).astype(jnp.float32)
  aux = {
      "accuracy": jnp.sum(correct * batch["mask"]) / jnp.sum(batch["mask"]),
      "tokens": jnp.sum(batch["mask"]),
      "max_logit": jnp.max(logits),
  }
  return (value, aux), grads


def _setup(kind, axis_type, params, batch):
  """A mesh, the arguments placed on it, and the data_axis for that layout."""
  if kind == "dp":
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    batch_spec, param_spec, data_axis = P("data"), P(), "data"
  else:  # data parallel x FSDP: the batch over both axes, parameters over "fsdp"
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(axis_type,) * 2)
    batch_spec, param_spec, data_axis = P(("data", "fsdp")), P("fsdp", None), ("data", "fsdp")
  params = jax.device_put(params, NamedSharding(mesh, param_spec))
  batch = jax.device_put(batch, NamedSharding(mesh, batch_spec))
  return mesh, params, batch, data_axis


def _compile(step, *args):
  colls = jaxaccum.planning.collectives(step, *args)
  assert colls.num_loops, "no while loop in the compiled program: the accumulation scan is missing"
  return colls


def _assert_no_batch_movement(colls, where):
  moved = [c for c in colls if c.kind in ("all-to-all", "collective-permute")]
  moved += [c for c in colls if c.kind == "all-gather"
            and not set(c.shapes) <= PARAM_SHAPES]
  assert not moved, f"{where}: the program moves batch data: {moved}"


def _assert_same_shardings(grads, params):
  for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params),
                          strict=True):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (
        f"grads{jax.tree_util.keystr(path)} has sharding {g.sharding}, params {p.sharding}")


KINDS = ["dp", "dp_fsdp"]
AXIS_TYPES = [pytest.param(AxisType.Explicit, id="explicit"),
              pytest.param(AxisType.Auto, id="auto")]


@pytest.mark.parametrize("use_data_axis", [False, True], ids=["plain", "data_axis"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_mean_loss_on_a_mesh(kind, axis_type, use_data_axis):
  params, batch = _problem()
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(mean_loss))(params, batch)
  mesh, params, batch, data_axis = _setup(kind, axis_type, params, batch)
  options = {"data_axis": jaxaccum.DataParallel(data_axis, mesh=mesh)} if use_data_axis else {}
  step = jax.jit(jaxaccum.value_and_grad(mean_loss, num_micro_batches=4, **options))

  _assert_no_batch_movement(_compile(step, params, batch), f"{kind}, {axis_type}")
  loss, grads = step(params, batch)
  close(loss, ref_loss)
  close(grads, ref_grads)
  _assert_same_shardings(grads, params)


@pytest.mark.parametrize(("kind", "axis_type", "use_data_axis"), [
    ("dp", AxisType.Explicit, False),
    ("dp", AxisType.Explicit, True),
    ("dp", AxisType.Auto, True),
    ("dp_fsdp", AxisType.Explicit, False),
    ("dp_fsdp", AxisType.Explicit, True),
])
def test_token_weighted_loss_and_aux_on_a_mesh(kind, axis_type, use_data_axis):
  params, batch = _problem(1)
  (ref_loss, ref_aux), ref_grads = _token_reference(params, batch)
  mesh, params, batch, data_axis = _setup(kind, axis_type, params, batch)
  options = {"data_axis": jaxaccum.DataParallel(data_axis, mesh=mesh)} if use_data_axis else {}
  step = jax.jit(jaxaccum.value_and_grad(
      token_loss, num_micro_batches=8, reduce="weighted", has_aux=True,
      aux_reduce=AUX_REDUCE, **options))
  _assert_no_batch_movement(_compile(step, params, batch), f"{kind}, weighted")
  (loss, aux), grads = step(params, batch)
  close(loss, ref_loss)
  close(aux, ref_aux)
  close(grads, ref_grads)
  _assert_same_shardings(grads, params)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_data_axis_reduces_once_per_step_whatever_n(axis_type):
  params, batch = _problem()
  mesh, params, batch, _ = _setup("dp", axis_type, params, batch)

  # Without data_axis, XLA keeps the gradient all-reduce in the loop: once per micro-batch.
  plain = _compile(jax.jit(jaxaccum.value_and_grad(mean_loss, num_micro_batches=4)),
                   params, batch)
  assert any(c.kind == "all-reduce" and c.in_loop for c in plain), plain

  counts = {}
  for n in (2, 16):
    step = jax.jit(jaxaccum.value_and_grad(mean_loss, num_micro_batches=n,
                   data_axis=jaxaccum.DataParallel("data", mesh=mesh)))
    colls = _compile(step, params, batch)
    assert not [c for c in colls if c.in_loop], f"N={n}: collectives in the loop: {colls}"
    _assert_no_batch_movement(colls, f"N={n}")
    counts[n] = collections.Counter(c.kind for c in colls)
  assert counts[2]["all-reduce"] >= 1
  assert counts[2] == counts[16], counts


def test_fsdp_reduce_scatters_once_per_micro_batch_and_gathers_only_parameters():
  params, batch = _problem()
  mesh, params, batch, data_axis = _setup("dp_fsdp", AxisType.Explicit, params, batch)
  sharded_leaves = len(jax.tree.leaves(params))
  counts = {}
  for n in (2, 16):
    step = jax.jit(jaxaccum.value_and_grad(mean_loss, num_micro_batches=n,
                                           data_axis=jaxaccum.DataParallel(data_axis, mesh=mesh)))
    colls = _compile(step, params, batch)
    in_loop = [c for c in colls if c.in_loop]
    # Per micro-batch: one reduce-scatter per FSDP gradient, nothing else.
    assert {c.kind for c in in_loop} <= {"reduce-scatter"}, in_loop
    assert len(in_loop) <= sharded_leaves, in_loop
    # Parameters are all-gathered for the forward pass (at most once each), never the batch;
    # after the loop only the data-parallel all-reduce remains.
    gathers = [c for c in colls if c.kind == "all-gather"]
    assert len(gathers) <= sharded_leaves, gathers
    _assert_no_batch_movement(colls, f"N={n}")
    counts[n] = collections.Counter((c.kind, c.in_loop) for c in colls)
  assert counts[2] == counts[16], counts

  loss, grads = step(params, batch)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(mean_loss))(*_problem())
  close(loss, ref_loss)
  close(grads, ref_grads)
  _assert_same_shardings(grads, params)


@pytest.mark.parametrize("use_data_axis", [False, True], ids=["plain", "data_axis"])
def test_fsdp_accumulators_keep_their_parameters_sharding_under_auto_axes(use_data_axis):
  """Under Auto axes a traced parameter carries no sharding, so only a hint ties each
  accumulator to its parameter; without it the compiler is free to keep a replicated
  full-size accumulator (and does, from jax 0.12 on). Checked on the returned gradients'
  shardings and on the compiled program's output buffers: one shard per gradient."""
  params, batch = _problem()
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(mean_loss))(params, batch)
  mesh, params, batch, data_axis = _setup("dp_fsdp", AxisType.Auto, params, batch)
  options = {"data_axis": jaxaccum.DataParallel(data_axis, mesh=mesh)} if use_data_axis else {}
  step = jax.jit(jaxaccum.value_and_grad(mean_loss, num_micro_batches=4, **options))
  memory = step.lower(params, batch).compile().memory_analysis()
  shard_bytes = sum(p.addressable_shards[0].data.nbytes for p in jax.tree.leaves(params))
  full_bytes = sum(p.nbytes for p in jax.tree.leaves(params))
  assert shard_bytes < full_bytes
  # The outputs on each device: one shard of every gradient, the loss and the output
  # tuple's table (a few bytes); a full-size gradient would add full_bytes - shard_bytes.
  extra = memory.output_size_in_bytes - shard_bytes
  assert 4 <= extra <= 64 < full_bytes - shard_bytes, (extra, shard_bytes, full_bytes)
  loss, grads = step(params, batch)
  _assert_same_shardings(grads, params)
  close(loss, ref_loss)
  close(grads, ref_grads)


def test_a_naive_contiguous_split_is_caught():
  """The check above is not vacuous: reshape(N, B // N) moves the batch between devices."""
  params, batch = _problem()
  _, params, batch, _ = _setup("dp", AxisType.Auto, params, batch)

  def naive(params, batch):
    stacked = jax.tree.map(lambda x: x.reshape((4, -1) + x.shape[1:]), batch)

    def body(acc, micro):
      return jax.tree.map(jnp.add, acc, jax.grad(mean_loss)(params, micro)), None

    return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), stacked)[0]

  with pytest.raises(AssertionError, match="moves batch data"):
    _assert_no_batch_movement(_compile(jax.jit(naive), params, batch), "naive")


def test_state_keys_and_stacked_aux_under_data_axis():
  """State is threaded per shard and averaged; keys are fold_in(fold_in(key, shard), i)."""
  params, batch = _problem(2)
  mesh, params_s, batch_s, _ = _setup("dp", AxisType.Explicit, params, batch)
  n, shards = 4, 8

  def fun(params, batch, key, state):
    loss = mean_loss(params, batch)
    new_state = {"ema": 0.5 * state["ema"] + 0.5 * jnp.mean(batch["x"]),
                 "steps": state["steps"] + 1,
                 "key": jax.random.fold_in(state["key"], 1)}
    aux = {"draw": jax.random.uniform(key), "row_mean": jnp.mean(batch["x"])}
    return loss, (new_state, aux)

  state = {"ema": jnp.float32(1.0), "steps": jnp.int32(0), "key": jax.random.key(3)}
  key = jax.random.key(7)
  step = jax.jit(jaxaccum.value_and_grad(
      fun, num_micro_batches=n, rng_argnums=2, state_argnums=3, has_aux=True,
      aux_reduce="stack", data_axis=jaxaccum.DataParallel("data", mesh=mesh)))
  (loss, (new_state, aux)), grads = step(params_s, batch_s, key, state)

  # The reference, by hand: shard d holds rows [d * L, (d + 1) * L) (L = B / 8); a Python
  # loop threads the state through its micro-batches shard[i::n] in order, with the key
  # fold_in(fold_in(key, d), i). Then float state is averaged over shards, counters take
  # the maximum, keys are shard 0's, and stacked aux is averaged over shards.
  vg = jax.jit(jax.value_and_grad(fun, has_aux=True))
  rows = BATCH // shards
  shard_states, per_mb = [], {"draw": [[] for _ in range(n)], "row_mean": [[] for _ in range(n)]}
  for d in range(shards):
    shard = jax.tree.map(lambda a, d=d: a[d * rows:(d + 1) * rows], batch)
    s = state
    for i, mb in enumerate(_problems.micro_batches(shard, n)):
      (_, (s, a)), _ = vg(params, mb, jax.random.fold_in(jax.random.fold_in(key, d), i), s)
      for name in per_mb:
        per_mb[name][i].append(a[name])
    shard_states.append(s)
  ref_loss, ref_grads = _problems.full_batch(mean_loss, params, batch)
  close(loss, ref_loss)
  close(grads, ref_grads)
  close(new_state["ema"], np.mean([s["ema"] for s in shard_states], dtype=np.float32))
  assert int(new_state["steps"]) == max(int(s["steps"]) for s in shard_states) == n
  np.testing.assert_array_equal(jax.random.key_data(new_state["key"]),  # a key in the state
                                jax.random.key_data(shard_states[0]["key"]))
  for name in per_mb:
    close(aux[name], np.asarray([np.mean(v) for v in per_mb[name]], np.float32),
          custom_message=name)


def test_mesh_from_context_and_grad():
  params, batch = _problem()
  ref = jax.jit(jax.grad(mean_loss))(params, batch)
  mesh, params, batch, _ = _setup("dp", AxisType.Explicit, params, batch)
  step = jax.jit(jaxaccum.grad(mean_loss, micro_batch_size=64, data_axis="data"))
  with jax.set_mesh(mesh):
    grads = step(params, batch)
  close(grads, ref)


# --- Bad input ----------------------------------------------------------------------------


def _dp(axis_type=AxisType.Explicit, rows=BATCH):
  params, batch = _problem()
  batch = jax.tree.map(lambda x: x[:rows], batch)
  return _setup("dp", axis_type, params, batch)


def test_batch_not_divisible_by_data_axis_times_n():
  mesh, params, batch, _ = _dp(rows=96)  # 96 / 8 shards = 12 rows each; 12 % 8 != 0
  step = jaxaccum.value_and_grad(mean_loss, num_micro_batches=8,
                                 data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  with pytest.raises(ValueError, match=r"batch size 96 is not divisible by the data-axis size "
                     r"8 x num_micro_batches=8 = 64.*divisors of 12.*\[1, 2, 3, 4, 6, 12\]"):
    jax.eval_shape(step, params, batch)


def test_batch_not_divisible_by_data_axis():
  mesh, _, _, _ = _dp()
  params, batch = _problem()
  batch = jax.tree.map(lambda x: x[:100], batch)  # unplaced: 100 rows cannot go on 8 devices
  step = jaxaccum.value_and_grad(mean_loss, num_micro_batches=2,
                                 data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  with pytest.raises(ValueError, match=r"batch size 100 is not divisible by the data-axis "
                     r"size 8 \(data_axis over 'data' \(size 8\)\)"):
    jax.eval_shape(step, params, batch)


def test_micro_batch_smaller_than_data_shards():
  mesh, params, batch, _ = _dp(rows=64)
  step = jaxaccum.value_and_grad(mean_loss, num_micro_batches=16,
                                 data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  with pytest.raises(ValueError, match=r"num_micro_batches=16 makes micro-batches of 64 / 16 "
                     r"= 4 rows, smaller than the 8 data shards.*at most 8 micro-batches"):
    jax.eval_shape(step, params, batch)
  step = jaxaccum.value_and_grad(mean_loss, micro_batch_size=4,
                                 data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  with pytest.raises(ValueError, match=r"micro_batch_size=4 is smaller than the 8 data shards"):
    jax.eval_shape(step, params, batch)
  step = jaxaccum.value_and_grad(mean_loss, micro_batch_size=12,
                                 data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  with pytest.raises(ValueError, match=r"micro_batch_size=12 does not split batch size 64.*"
                     r"Valid sizes: \[8, 16, 32, 64\]"):
    jax.eval_shape(step, params, batch)


def test_explicit_sharded_batch_that_cannot_split_locally_without_data_axis():
  mesh, params, batch, _ = _dp(rows=64)
  step = jaxaccum.value_and_grad(mean_loss, num_micro_batches=16)
  with pytest.raises(ValueError, match=r"batch axis of 64 rows sharded over 'data' \(size 8\) "
                     r"\(8 shards\), but 16 micro-batches give micro-batches of 4 rows"):
    jax.eval_shape(step, params, batch)


def test_data_axis_not_in_mesh():
  mesh, params, batch, _ = _dp()
  with pytest.raises(ValueError, match=r"data_axis='batch' names mesh axis 'batch', which is "
                     r"not in the mesh; its axes are \{'data': 8\}"):
    jaxaccum.value_and_grad(mean_loss, num_micro_batches=2,
                            data_axis=jaxaccum.DataParallel("batch", mesh=mesh))
  step = jaxaccum.value_and_grad(mean_loss, num_micro_batches=2, data_axis=("data", "model"))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"names mesh axis 'model'"):
    jax.eval_shape(step, params, batch)


def test_bad_data_axis_and_mesh_options():
  _, params, batch, _ = _dp()
  with pytest.raises(TypeError, match=r"data_axis must be a mesh axis name.*got data_axis=0"):
    jaxaccum.value_and_grad(mean_loss, num_micro_batches=2, data_axis=0)
  with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
    jaxaccum.value_and_grad(mean_loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel("data",
                            mesh="data"))
  with pytest.raises(ValueError, match=r"mesh=... was given without data_axis"), \
      pytest.warns(DeprecationWarning, match="is deprecated"):
    jaxaccum.value_and_grad(mean_loss, num_micro_batches=2, mesh=jax.make_mesh((8,), ("d",)))
  step = jaxaccum.value_and_grad(mean_loss, num_micro_batches=2, data_axis="data")
  with pytest.raises(ValueError, match=r"data_axis='data' needs a mesh: pass mesh=\.\.\."):
    jax.eval_shape(step, params, batch)


def test_data_axis_must_name_every_axis_the_batch_is_sharded_over():
  params, batch = _problem()
  mesh, params, batch, _ = _setup("dp_fsdp", AxisType.Explicit, params, batch)
  step = jaxaccum.value_and_grad(mean_loss, num_micro_batches=2,
                                 data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  with pytest.raises(ValueError, match=r"sharded over \('data', 'fsdp'\).*leaves out "
                     r"\('fsdp',\)\. Name every mesh axis.*data_axis=\('data', 'fsdp'\)"):
    jax.eval_shape(step, params, batch)


def test_sum_reduction_eager_numpy_inputs_and_keyword_arguments():
  """No jit, host arrays, a keyword argument: still the full-batch sum."""
  params, batch = _problem(3)
  params, batch = jax.tree.map(np.asarray, (params, batch))

  def sum_loss(params, batch, scale=1.0):
    return scale * jnp.sum(_nll(params, batch)[0])

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(sum_loss))(params, batch, 0.5)
  mesh = jax.make_mesh((8,), ("data",))
  step = jaxaccum.value_and_grad(sum_loss, num_micro_batches=4, reduce="sum",
                                 data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  loss, grads = step(params, batch, scale=0.5)
  close((loss, grads), (ref_loss, ref_grads), atol=1e-6 * BATCH)  # a sum over BATCH rows


def test_a_call_outside_jit_runs_one_compiled_program():
  """Outside jit the per-shard accumulation is one compiled program, not shard_map's
  op-by-op interpretation (hundreds of small programs, seconds for every call)."""
  params, batch = _problem(4)
  mesh = jax.make_mesh((8,), ("data",))
  step = jaxaccum.value_and_grad(lambda p, b: jnp.mean(_nll(p, b)[0]), num_micro_batches=4,
                                 data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  step(params, batch)  # first call: also the small programs that place the arguments
  with count_compiles() as compiled:
    loss, grads = step(params, batch)
  assert len(compiled) <= 2, compiled
  ref = jax.jit(jax.value_and_grad(lambda p, b: jnp.mean(_nll(p, b)[0])))(params, batch)
  close((loss, grads), ref)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_nnx_model_under_data_axis_equals_full_batch(axis_type):
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(6, 16, rngs=rngs)
      self.norm = nnx.LayerNorm(16, rngs=rngs)
      self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.norm(self.l1(x))))

  def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  model = Net(nnx.Rngs(0))
  kx, ky = jax.random.split(jax.random.key(1))
  batch = {"x": jax.random.normal(kx, (64, 6)), "y": jax.random.normal(ky, (64, 3))}
  ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, batch)

  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))

  @nnx.jit
  def step(model, batch):
    return jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=4,
                                       data_axis=jaxaccum.DataParallel("data", mesh=mesh))(model,
                                           batch)

  loss, grads = step(model, batch)
  close(loss, ref_loss)
  close(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_grads))
  graphdef, state = nnx.split(model)

  @jax.jit
  def pure_step(state, batch):  # the same step, split by hand, to read its compiled HLO
    return jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=4,
                                       data_axis=jaxaccum.DataParallel("data",
                                           mesh=mesh))(nnx.merge(graphdef, state), batch)

  colls = _compile(pure_step, state, batch)
  assert not [c for c in colls if c.in_loop and c.kind == "all-reduce"], colls
  assert 0 < sum(c.kind == "all-reduce" for c in colls) <= len(jax.tree.leaves(state)) + 1
