"""FSDP placement under ``data_axis``: ``param_gather`` and ``grad_scatter``, on 8 CPU devices.

Parameters sharded over the data axis (FSDP, ``Explicit`` mesh axes) are all-gathered once
per step (``param_gather="step"``) or in every micro-batch (``"micro_batch"``), and their
gradients reduce-scattered in every micro-batch (``grad_scatter="micro_batch"``) or once
after the loop (``"step"``). Each of the four combinations must give the full batch's loss
and gradients (plain ``jax.value_and_grad`` on the whole batch), and the compiled program,
read by ``jaxaccum.planning.collectives``, must hold its gathers and reduce-scatters where the
options put them. HSDP (``data_axis=("replica", "fsdp")``, parameters over ``"fsdp"``):
the reduce-scatter runs over ``"fsdp"`` and the all-reduce over ``"replica"`` once per
step, outside the loop.

Tolerances: float32, ``assert_close``'s 1e-5 relative to the largest entry (the sharded
program sums the same terms in another order).
"""

import contextlib
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests import _problems
from tests._util import assert_close

SIZES = (16, 64, 8)  # every dimension a multiple of 8: each parameter splits over 8 devices
BATCH, N = 64, 4
COMBOS = list(itertools.product(("step", "micro_batch"), ("micro_batch", "step")))


def loss(params, batch):
  return _problems.mlp_loss(params, batch, "mean")


def _problem():
  return _problems.mlp_problem(3, SIZES, BATCH)


def _placed(mesh, param_axis, batch_axes):
  params, batch = _problem()
  params = jax.device_put(params, NamedSharding(mesh, P(param_axis)))
  batch = jax.device_put(batch, NamedSharding(mesh, P(batch_axes)))
  return params, batch


def _step(data_axis, mesh, gather, scatter, **options):
  return jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N,
                 data_axis=jaxaccum.DataParallel(data_axis, mesh=mesh, param_gather=gather,
                                                 grad_scatter=scatter),
                                         **options))


def _check_placement(colls, gather, scatter, sharded_leaves):
  """The all-gathers and reduce-scatters sit inside or outside the loop as chosen."""
  inside = {"step": False, "micro_batch": True}
  for kind, where in (("all-gather", gather), ("reduce-scatter", scatter)):
    assert colls.count(kind, in_loop=inside[where]) >= 1, (kind, where, str(colls))
    assert colls.count(kind, in_loop=not inside[where]) == 0, (kind, where, str(colls))
  # Parameters are what is gathered: never more gathers than sharded parameter leaves.
  assert colls.count("all-gather") <= sharded_leaves, str(colls)
  assert colls.count("all-reduce", in_loop=True) == 0, str(colls)


@pytest.mark.parametrize(("gather", "scatter"), COMBOS)
def test_fsdp_combinations_equal_the_full_batch(gather, scatter):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _placed(mesh, "data", "data")
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(*_problem())
  step = _step("data", mesh, gather, scatter)
  colls = jaxaccum.planning.collectives(step, params, batch)
  _check_placement(colls, gather, scatter, len(jax.tree.leaves(params)))
  # A gather per micro-batch runs N times per step; once per step, once.
  runs = {c.executions for c in colls.select("all-gather")}
  assert runs == ({N} if gather == "micro_batch" else {1}), str(colls)

  value, grads = step(params, batch)
  assert_close(value, ref_loss)
  assert_close(grads, ref_grads)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, ref_grads),
                              rtol=1e-5, atol=1e-6)
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)


def test_weighted_loss_two_differentiated_arguments_and_remat():
  """The placement applies per differentiated argument and to every divisor group."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _placed(mesh, "data", "data")
  scale = jax.device_put(jnp.linspace(0.5, 1.5, SIZES[-1]), NamedSharding(mesh, P("data")))

  def weighted(params, scale, batch):
    out = _problems.mlp_apply(params, batch["x"]) * scale
    per_row = jnp.mean((out - batch["y"]) ** 2, axis=-1)
    return jnp.sum(per_row * batch["mask"]), jnp.sum(batch["mask"])

  def ref(params, scale, batch):
    num, den = weighted(params, scale, batch)
    return num / den

  full_params, full_batch = _problem()
  ref_out = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(full_params, np.asarray(scale),
                                                             full_batch)
  for gather, scatter in COMBOS:
    step = jax.jit(jaxaccum.value_and_grad(
        weighted, num_micro_batches=N, argnums=(0, 1), batch_argnums=2, reduce="weighted",
        remat=True, data_axis=jaxaccum.DataParallel("data", mesh=mesh, param_gather=gather,
                                                    grad_scatter=scatter)))
    # remat recomputes the forward pass, gathers included, in the backward pass: a gather
    # per micro-batch runs twice per micro-batch.
    _check_placement(jaxaccum.planning.collectives(step, params, scale, batch), gather, scatter,
                     (len(jax.tree.leaves(params)) + 1) * (2 if gather == "micro_batch" else 1))
    value, grads = step(params, scale, batch)
    assert_close(value, ref_out[0], err_msg=f"{gather}, {scatter}")
    assert_close(grads, ref_out[1], err_msg=f"{gather}, {scatter}")


@pytest.mark.parametrize("scatter", ["micro_batch", "step"])
def test_hsdp_reduce_scatter_over_fsdp_all_reduce_over_replica_once(scatter):
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
  params, batch = _placed(mesh, "fsdp", ("replica", "fsdp"))
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(*_problem())
  step = _step(("replica", "fsdp"), mesh, "step", scatter)
  colls = jaxaccum.planning.collectives(step, params, batch)
  assert colls.mesh_shape == (("replica", 2), ("fsdp", 4))
  scatters = colls.select("reduce-scatter")
  assert len(scatters) >= 1 and {c.mesh_axes for c in scatters} == {("fsdp",)}, str(colls)
  assert {c.in_loop for c in scatters} == {scatter == "micro_batch"}, str(colls)
  # The replica all-reduce of the gradients (shard-sized) runs once per step.
  reduces = colls.select("all-reduce")
  assert not reduces.in_loop, str(colls)
  grad_bytes = sum(p.addressable_shards[0].data.nbytes for p in jax.tree.leaves(params))
  over_replica = [c for c in reduces if c.mesh_axes == ("replica",)]
  assert sum(c.bytes for c in over_replica) >= grad_bytes, reduces
  assert all(c.executions == 1 for c in reduces), reduces
  # The gathers run over "fsdp" only: each replica holds its own copy of the shards.
  assert {c.mesh_axes for c in colls.select("all-gather")} == {("fsdp",)}, str(colls)

  value, grads = step(params, batch)
  assert_close(value, ref_loss)
  assert_close(grads, ref_grads)


def test_scan_over_layers_lm():
  """A causal LM whose layers run in a lax.scan (stacked, FSDP-sharded parameters)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  d, layers, vocab, seq = 16, 3, 32, 8
  k = jax.random.split(jax.random.key(5), 4)
  params = {"embed": jax.random.normal(k[0], (vocab, d)) * 0.3,
            "w": jax.random.normal(k[1], (layers, d, d)) / 4,
            "out": jax.random.normal(k[2], (d, vocab)) / 4}
  tokens = jax.random.randint(k[3], (BATCH, seq), 0, vocab)

  def lm_loss(p, tokens):
    h = p["embed"][tokens]

    def layer(h, w):
      return h + jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, h, p["w"])
    logp = jax.nn.log_softmax(h[:, :-1] @ p["out"])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

  ref = jax.jit(jax.value_and_grad(lm_loss))(params, tokens)
  specs = {"embed": P(None, "data"), "w": P(None, "data"), "out": P("data")}
  sharded = {k_: jax.device_put(v, NamedSharding(mesh, specs[k_])) for k_, v in params.items()}
  placed = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  for gather, scatter in COMBOS:
    step = jax.jit(jaxaccum.value_and_grad(lm_loss, num_micro_batches=N,
                   data_axis=jaxaccum.DataParallel("data", param_gather=gather,
                                                   grad_scatter=scatter)))
    with jax.set_mesh(mesh):
      colls = jaxaccum.planning.collectives(step, sharded, placed)
      value, grads = step(sharded, placed)
    _check_placement(colls, gather, scatter, len(params))
    assert_close(value, ref[0], err_msg=f"{gather}, {scatter}")
    assert_close(grads, ref[1], err_msg=f"{gather}, {scatter}")


# The usual LLM layout: the layers' weights stacked along a leading axis, run by a lax.scan,
# sharded on their rows, P(None, "data", None). Each case: a mesh (a data axis of 8, an
# Explicit data axis of 4 next to an Auto model axis, or next to an Explicit one with the
# batch's features sharded over it, P("data", "model")), given through jax.set_mesh or
# mesh=, and sizes drawn from a seed; cases 0 and 3 put first in the batch an integer leaf
# that the loss never reads.
SCAN_MESHES = {"explicit": ((8,), ("data",), (AxisType.Explicit,)),
               "explicit_data_auto_model": ((4, 2), ("data", "model"),
                                            (AxisType.Explicit, AxisType.Auto)),
               "explicit_data_explicit_model": ((4, 2), ("data", "model"),
                                                (AxisType.Explicit, AxisType.Explicit))}


def _scanned_loss(params, batch):
  def layer(h, w):
    return jnp.tanh(h @ w) + h, None

  h, _ = jax.lax.scan(layer, batch["x"], params["w"])
  return jnp.mean((h @ params["head"] - batch["y"]) ** 2)


def _scanned_case(seed, data):
  rng = np.random.default_rng(seed)
  layers, width = int(rng.integers(2, 5)), data * int(rng.integers(1, 4))
  n = int(rng.choice([2, 4]))
  rows = data * n * int(rng.integers(1, 3))
  k = jax.random.split(jax.random.key(seed), 4)
  params = {"w": jax.random.normal(k[0], (layers, width, width)) / width,
            "head": jax.random.normal(k[1], (width, 2)) / width**0.5}
  batch = {"x": jax.random.normal(k[2], (rows, width)), "y": jax.random.normal(k[3], (rows, 2))}
  if seed % 3 == 0:
    batch["a_ids"] = jnp.arange(rows, dtype=jnp.int32)  # first in the tree, never read
  return params, batch, n


@pytest.mark.parametrize(("seed", "mesh_kind", "scatter"), [
    (seed, m, s) for seed, (m, s) in enumerate(itertools.product(SCAN_MESHES,
                                                                 ("micro_batch", "step")))])
def test_scanned_stacked_layers_gather_inside_every_micro_batch(seed, mesh_kind, scatter):
  """``param_gather="micro_batch"`` on a scan over stacked layers: the compiled program's
  all-gather of the stack sits inside the micro-batch loop and runs once per micro-batch,
  none outside it; loss and gradients equal the full batch's."""
  shape, names, types = SCAN_MESHES[mesh_kind]
  mesh = jax.make_mesh(shape, names, axis_types=types)
  params, batch, n = _scanned_case(seed, shape[0])
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(_scanned_loss))(params, batch)
  specs = {"w": P(None, "data", None), "head": P()}
  sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
  if types[-1] == AxisType.Explicit and len(shape) == 2:
    placed["x"] = jax.device_put(batch["x"], NamedSharding(mesh, P("data", "model")))
  through_set_mesh = seed % 3 != 1
  step = jax.jit(jaxaccum.value_and_grad(
      _scanned_loss, num_micro_batches=n, data_axis=jaxaccum.DataParallel(
          "data", mesh=None if through_set_mesh else mesh, param_gather="micro_batch",
          grad_scatter=scatter)))
  with jax.set_mesh(mesh) if through_set_mesh else contextlib.nullcontext():
    colls = jaxaccum.planning.collectives(step, sharded, placed)
    value, grads = step(sharded, placed)
  # The parameters' gathers, over "data" (XLA gathers a batch sharded over "model" itself).
  gathers = [c for c in colls.select("all-gather") if c.mesh_axes == ("data",)]
  assert len(gathers) >= 1 and all(c.in_loop for c in gathers), str(colls)
  assert {c.loop_depth for c in gathers} == {1}, str(colls)
  assert {c.executions for c in gathers} == {n}, str(colls)
  # What is gathered in each micro-batch is the whole stack (float32), nothing else.
  assert sum(c.bytes for c in gathers) == params["w"].size * 4, str(colls)
  assert colls.count("reduce-scatter", in_loop=scatter == "micro_batch") >= 1, str(colls)
  assert colls.count("reduce-scatter", in_loop=scatter != "micro_batch") == 0, str(colls)
  # The program's computations, split by the same loop walk: each op's line is in its own.
  inside, outside = colls.computations(in_loop=True), colls.computations(in_loop=False)
  assert not set(inside) & set(outside) and {**inside, **outside} == colls.computations()
  for c in colls:
    assert c.line in map(str.strip, (inside if c.in_loop else outside)[c.computation]), c
  assert_close(value, ref_loss)
  assert_close(grads, ref_grads)
  assert grads["w"].sharding.spec == sharded["w"].sharding.spec


def test_bad_values_and_options_without_data_axis():
  with pytest.raises(ValueError, match=r"param_gather must be one of 'step', 'micro_batch', "
                     r"got param_gather='layer'"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel("data",
                            param_gather="layer"))
  with pytest.raises(ValueError, match=r"grad_scatter must be one of 'micro_batch', 'step'"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel("data",
                            grad_scatter=True))
  for name, value in (("param_gather", "micro_batch"), ("grad_scatter", "step")):
    # The deprecated keyword (DataParallel holds it now) keeps its old error.
    with pytest.raises(ValueError, match=rf"{name}='{value}' places.*pass data_axis=\.\.\."), \
        pytest.warns(DeprecationWarning, match="is deprecated"):
      jaxaccum.value_and_grad(loss, num_micro_batches=2, **{name: value})
  # The defaults are accepted without data_axis: they are what runs anyway.
  with pytest.warns(DeprecationWarning, match="is deprecated"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, param_gather="step",
                            grad_scatter="micro_batch")


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(("name", "value"), [("param_gather", "micro_batch"),
                                             ("grad_scatter", "step")])
def test_replicated_parameters_are_refused(axis_type, name, value):
  """Replicated parameters (or, under Auto axes, shardings not in the types) have nothing to
  gather or scatter: an error, not a silent no-op."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  params, batch = _problem()
  if axis_type == AxisType.Explicit:
    params = jax.device_put(params, NamedSharding(mesh, P()))
  else:  # sharded, but an Auto type does not say so
    params = jax.device_put(params, NamedSharding(mesh, P("data")))
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  step = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=N,
      data_axis=jaxaccum.DataParallel("data", mesh=mesh, **{name: value})))
  with pytest.raises(ValueError, match=rf"{name}='{value}' places.*no differentiated argument "
                     r"is sharded.*FSDP needs Explicit mesh axes.*or drop"):
    step(params, batch)


# ---------------------------------------------------------------------------------- planner


def _memory(compiled):
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def _fsdp_shapes(rows=BATCH):
  """The problem's shapes, sharded over the data axis; the batch has ``rows`` rows."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _problem()

  def sds(tree, spec, rows=None):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape if rows is None else (rows, *a.shape[1:]), a.dtype,
        sharding=NamedSharding(mesh, spec)), tree)

  return mesh, sds(params, P("data")), sds(batch, P("data"), rows)


def test_plan_chooses_the_placement_with_the_least_communication_that_fits():
  """Every (count, placement) is compiled here independently; for each budget the expected
  answer is the fewest micro-batches whose least-memory placement fits, then the first
  placement in the order of communication that fits at that count."""
  # 32 rows over 8 shards: the counts that split each shard's 4 rows (fewer programs to
  # compile than at 64 rows, the same choice to make).
  mesh, params, batch = _fsdp_shapes(32)
  counts = [1, 2, 4]
  order = [("step", "step"), ("step", "micro_batch"), ("micro_batch", "step"),
           ("micro_batch", "micro_batch")]
  ref = {}
  for n in counts:
    for gather, scatter in order:
      step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=n,
                     data_axis=jaxaccum.DataParallel("data", mesh=mesh, param_gather=gather,
                                                     grad_scatter=scatter)))
      ref[n, (gather, scatter)] = _memory(step.lower(params, batch).compile())

  def expected(budget):
    for n in counts:
      if ref[n, order[-1]] <= budget:
        return n, next(p for p in order if ref[n, p] <= budget)
    return None

  # A budget at which the trade-off decides: the least communication does not fit there.
  budgets = [b for b in sorted(set(ref.values()))
             if expected(b) is not None and expected(b)[1] != ("step", "step")]
  assert budgets, ref
  for budget in (budgets[0], 2**40):
    p = jaxaccum.plan(loss, params, batch, memory_budget_bytes=budget, search="all",
                      data_axis=jaxaccum.DataParallel("data", mesh=mesh))
    assert (p.num_micro_batches, p.placement) == expected(budget), (budget, str(p))
    assert p.peak_bytes == ref[p.num_micro_batches, p.placement]
    for c in p.candidates:
      assert c.peak_bytes == ref[c.num_micro_batches, c.placement], c
      assert c.fits == (c.peak_bytes <= budget)
    # The chosen program is the one with those options: its collectives say so.
    gather, scatter = p.placement
    assert p.collectives.count("all-gather", in_loop=gather == "micro_batch") >= 1
    assert p.collectives.count("reduce-scatter", in_loop=scatter == "micro_batch") >= 1
    table = p.table()
    assert "gather/scatter" in table.splitlines()[1]
    chosen = next(line for line in table.splitlines() if "<- chosen" in line)
    assert f" {gather}/{scatter} " in chosen, table
    assert f"param_gather={gather!r}, grad_scatter={scatter!r}" in table


def test_plan_keeps_a_placement_the_options_fix_and_replicated_parameters():
  mesh, params, batch = _fsdp_shapes()
  p = jaxaccum.plan(loss, params, batch, memory_budget_bytes=2**40,
                    data_axis=jaxaccum.DataParallel("data", mesh=mesh, param_gather="micro_batch"))
  assert p.placement is None and all(c.placement is None for c in p.candidates)
  assert "gather/scatter" not in p.table()
  # A budget that needs micro-batches: the fixed per-micro-batch gather is in the loop.
  p = jaxaccum.plan(loss, params, batch, memory_budget_bytes=p.peak_bytes - 1,
                    data_axis=jaxaccum.DataParallel("data", mesh=mesh, param_gather="micro_batch"))
  assert p.num_micro_batches > 1 and p.placement is None
  assert p.collectives.count("all-gather", in_loop=True) >= 1, str(p.collectives)
  replicated = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())),
      params)
  p = jaxaccum.plan(loss, replicated, batch, memory_budget_bytes=2**40,
                    data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  assert p.placement is None and len(p.candidates) == 1
