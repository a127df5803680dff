"""FSDP parameters gathered in every micro-batch (``param_gather="micro_batch"``) change no
value and no gradient of the user's, on 8 CPU devices.

The gathers are tied to the micro-batch so that XLA keeps them inside the micro-batch loop;
the tie must be invisible to the user. Each test compares the per-micro-batch gather with a
reference that does not use it: the full batch through plain ``jax.vjp`` of
``jax.value_and_grad``, the same step under ``param_gather="step"`` (the gather before the
loop, which needs no tie), or the batch itself (what ``fun`` sees must be the batch's values
bit for bit). Where the gathers sit is read from the compiled program by
``jaxaccum.planning.collectives``; the scanned-layers model's placement is checked in
``test_fsdp_placement.py``.

Differentiating through the data (adversarial examples, data distillation, saliency) is
``jax.vjp`` of the whole jitted step with respect to the batch, with cotangents on both the
loss and the parameters' gradients (the second covers data distillation, which
differentiates the parameter update). Integer and bool leaves get ``float0`` cotangents.

Tolerances: float32, ``assert_close``'s 1e-5 relative to the largest entry (the sharded
program sums the same terms in another order); the step placement runs the same per-shard
arithmetic as the micro-batch placement, so those two are compared at 1e-6.
"""

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
from tests._util import assert_close

F, H, C = 8, 8, 4  # features, hidden, classes: multiples of every mesh axis size used
MESHES = {(8,): ("data",), (4, 2): ("data", "model"), (2, 4): ("data", "model")}


def _loss(params, batch):
  """A mean over rows that reads a float, an integer and a bool leaf of the batch."""
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  out = h @ params["w2"]
  per_row = jnp.sum((out - jax.nn.one_hot(batch["ids"], C)) ** 2, axis=-1)
  return jnp.mean(jnp.where(batch["mask"], per_row, 0.5 * per_row))


def _problem(seed, rows, hidden=H):
  k = jax.random.split(jax.random.key(seed), 5)
  params = {"w1": jax.random.normal(k[0], (F, hidden)) / F**0.5, "b1": jnp.full((hidden,), 0.1),
            "w2": jax.random.normal(k[1], (hidden, C)) / hidden**0.5}
  batch = {"x": jax.random.normal(k[2], (rows, F)),
           "ids": jax.random.randint(k[3], (rows,), 0, C),
           "mask": jax.random.uniform(k[4], (rows,)) < 0.6}
  cts = (jnp.float32(1.5), {name: jax.random.normal(jax.random.fold_in(k[4], i), p.shape)
                            for i, (name, p) in enumerate(params.items())})
  return params, batch, cts


def _through_batch(fun):
  """``fun(params, batch)``'s outputs and ``jax.vjp``'s cotangent for ``batch["x"]``,
  jitted; the integer and bool leaves' cotangents are checked to be ``float0`` as it traces
  (a ``float0`` output of a program on a 2-D Explicit mesh cannot leave it)."""
  @jax.jit
  def run(params, batch, cts):
    out, vjp = jax.vjp(lambda b: fun(params, b), batch)
    ct = vjp(cts)[0]
    for name in ("ids", "mask"):
      assert ct[name].dtype == jax.dtypes.float0 and ct[name].shape == batch[name].shape
    return out, ct["x"]
  return run


@functools.cache
def _reference():
  return _through_batch(jax.value_and_grad(_loss))


@functools.cache
def _placed_step(gather, scatter, n, mesh, remat=False):
  step = jax.jit(jaxaccum.value_and_grad(_loss, num_micro_batches=n, remat=remat, data_axis=(
      jaxaccum.DataParallel("data", mesh=mesh, param_gather=gather, grad_scatter=scatter))))
  return step, _through_batch(step)


def _place(tree, mesh, specs):
  return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


def test_grad_through_the_batch_equals_the_full_batch_and_the_step_gather():
  """The case that read 0 at element [0] of every micro-batch leaf: every element of the
  batch's cotangent, in every micro-batch, equals plain ``jax.vjp`` on the full batch and
  the step placement's; ``jax.grad`` of the loss alone too."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  n = 4
  params, batch, cts = _problem(0, 64)
  ref_out, ref_ct = _reference()(params, batch, cts)
  sharded = _place(params, mesh, {"w1": P("data"), "b1": P("data"), "w2": P()})
  placed = _place(batch, mesh, dict.fromkeys(batch, P("data")))
  got = {}
  for gather in ("micro_batch", "step"):
    through = _placed_step(gather, "micro_batch", n, mesh)[1]
    got[gather] = through(sharded, placed, cts)
    out, ct = got[gather]
    assert_close(out, ref_out, err_msg=gather)
    assert_close(ct, ref_ct, err_msg=gather)
  # jax.grad of the loss alone, through the jitted step.
  step = _placed_step("micro_batch", "micro_batch", n, mesh)[0]
  grad_x = jax.jit(jax.grad(lambda b: step(sharded, b)[0], allow_int=True))(placed)["x"]
  assert_close(grad_x, jax.grad(_loss, argnums=1, allow_int=True)(params, batch)["x"])
  assert_close(got["micro_batch"][1], got["step"][1], rtol=1e-6)
  # Row r of micro-batch i is row i + N * r of its shard: the first row of each micro-batch
  # on each shard (rows 0 to N - 1 of the shard) is right, not only the whole within 1e-5.
  first_rows = np.asarray(got["micro_batch"][1]).reshape(8, -1, F)[:, :n]
  np.testing.assert_allclose(first_rows, np.asarray(ref_ct).reshape(8, -1, F)[:, :n],
                             rtol=1e-5, atol=1e-6)
  assert np.all(first_rows != 0)


def _special_batch(rows):
  """Rows of values a copy that passes through arithmetic would change: NaNs with payloads
  (quiet and signalling, both signs), -0.0, infinities, subnormals, the integer limits."""
  bits = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 0x7F800000, 0xFF800000,
                   0x00000001, 0x7F7FFFFF], np.uint32)
  x = np.resize(bits, rows * F).reshape(rows, F)
  x[::3] = np.float32(np.arange(F) - 3.5).view(np.uint32)  # some finite rows too
  return {"x": x.view(np.float32),
          "ids": np.resize(np.array([np.iinfo(np.int32).min, -1, 0, np.iinfo(np.int32).max],
                                    np.int32), rows),
          "bytes": np.resize(np.array([0, 1, 127, 255], np.uint8), rows),
          "mask": np.resize(np.array([True, False, False]), rows)}


def _reads_everything(params, batch):
  """A finite loss of the finite entries; every leaf of the micro-batch as fun saw it, per
  example (aux ``"concat"``)."""
  x = jnp.where(jnp.isfinite(batch["x"]), batch["x"], 0.0)
  h = jnp.tanh(x @ params["w1"]) @ params["w2"]
  return jnp.mean(jnp.where(batch["mask"], h[:, 0], h[:, 1])), batch


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint32) if x.dtype == np.float32 else x


@pytest.mark.parametrize("scatter", ["micro_batch", "step"])
def test_fun_sees_the_batch_bit_for_bit_donated_or_not(scatter):
  """What ``fun`` sees of each micro-batch (returned as per-example aux) is the batch, bit
  for bit, in every leaf and dtype; donating the batch changes nothing; the loss and
  gradients equal the step placement's."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  rows, n = 32, 2
  params = _problem(2, rows)[0]
  batch = _special_batch(rows)
  sharded = _place(params, mesh, {"w1": P("data"), "b1": P(), "w2": P("data")})
  results = {}
  for gather, donate in (("micro_batch", ()), ("micro_batch", (1,)), ("step", ())):
    step = jax.jit(jaxaccum.value_and_grad(
        _reads_everything, num_micro_batches=n, has_aux=True, aux_reduce="concat",
        data_axis=jaxaccum.DataParallel("data", mesh=mesh, param_gather=gather,
                                        grad_scatter=scatter)), donate_argnums=donate)
    placed = _place(batch, mesh, dict.fromkeys(batch, P("data")))
    (value, seen), grads = step(sharded, placed)
    if donate:
      assert all(x.is_deleted() for x in jax.tree.leaves(placed))
    for k in batch:
      assert seen[k].dtype == batch[k].dtype, k
      np.testing.assert_array_equal(_bits(seen[k]), _bits(batch[k]), err_msg=k)
    results[gather, donate] = (value, grads)
  chex.assert_trees_all_equal(results["micro_batch", ()], results["micro_batch", (1,)])
  assert np.isfinite(results["micro_batch", ()][0])
  assert_close(results["micro_batch", ()], results["step", ()], rtol=1e-6)


# Generated cases: a mesh (8 devices on "data", or "data" x "model" both ways), N, the rows
# and hidden width, which parameters are sharded over "data" (at least one) and whether the
# float leaf is also sharded over "model" on its feature dimension, P("data", "model") (the
# case that raised a ShardingTypeError; always in cases 1 and 2, the (4, 2) and (2, 4)
# meshes); the gradient placement and remat.
def _fuzz_case(seed):
  rng = np.random.default_rng(seed)
  shape = list(MESHES)[seed % 3]
  n = int(rng.choice([1, 2, 4]))
  rows = shape[0] * n * int(rng.integers(1, 3))
  fsdp = rng.random(3) < 0.5
  fsdp[rng.integers(3)] = True
  specs = {k: P("data") if f else P() for k, f in zip(("w1", "b1", "w2"), fsdp, strict=True)}
  over_model = len(shape) == 2 and (seed < 3 or rng.random() < 0.5)
  return dict(shape=shape, n=n, rows=rows, hidden=int(rng.choice([8, 16])), specs=specs,
              x_spec=P("data", "model") if over_model else P("data"),
              scatter=str(rng.choice(["micro_batch", "step"])), remat=bool(rng.random() < 0.3))


@pytest.mark.parametrize("seed", range(6))
def test_generated_placements_equal_the_step_gather_and_the_full_batch(seed):
  """Loss, parameter gradients and the batch's cotangent equal the step placement's and the
  full batch's; the compiled step (without the vjp) gathers each sharded parameter only
  inside its loop, once per micro-batch."""
  case = _fuzz_case(seed)
  shape, n = case["shape"], case["n"]
  mesh = jax.make_mesh(shape, MESHES[shape], axis_types=(AxisType.Explicit,) * len(shape))
  params, batch, cts = _problem(10 + seed, case["rows"], case["hidden"])
  ref_out, ref_ct = _reference()(params, batch, cts)
  sharded = _place(params, mesh, case["specs"])
  placed = _place(batch, mesh, {"x": case["x_spec"], "ids": P("data"), "mask": P("data")})
  got = {}
  for gather in ("micro_batch", "step"):
    through = _placed_step(gather, case["scatter"], n, mesh, case["remat"])[1]
    got[gather] = through(sharded, placed, cts)
  assert_close(got["micro_batch"], got["step"], rtol=1e-6, err_msg=str(case))
  assert_close(got["micro_batch"][0], ref_out, err_msg=str(case))
  assert_close(got["micro_batch"][1], ref_ct, err_msg=str(case))
  assert got["micro_batch"][1].sharding.is_equivalent_to(placed["x"].sharding, 2)
  if n > 1:
    step = _placed_step("micro_batch", case["scatter"], n, mesh, case["remat"])[0]
    colls = jaxaccum.planning.collectives(step, sharded, placed)
    # The parameters' gathers (over "data"; XLA gathers a batch sharded over "model" itself).
    gathers = [c for c in colls.select("all-gather") if c.mesh_axes == ("data",)]
    assert gathers and all(c.in_loop for c in gathers), (case, str(colls))
    assert {c.executions for c in gathers} == {n}, (case, str(colls))
    sharded_leaves = sum(s != P() for s in case["specs"].values())
    # Under remat the recomputed gathers are in the traced program; XLA may merge them.
    assert sharded_leaves <= len(gathers) <= sharded_leaves * (1 + case["remat"]), str(colls)


def test_gathering_per_micro_batch_keeps_no_full_parameters_across_the_loop():
  """What the placement is for: on an MLP whose parameters outweigh its activations, the
  per-micro-batch gather's compiled temporaries are below the step gather's (which keeps
  the gathered parameters live across the loop), its gathers all inside the loop. A tie
  that XLA could see through would hoist the gathers and give the step's program."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  kp, kb = jax.random.split(jax.random.key(4))
  params = jax.device_put(_problems.mlp_params(kp, (64,) * 4), NamedSharding(mesh, P("data")))
  batch = jax.device_put(_problems.mlp_batch(kb, 64, 64, 64), NamedSharding(mesh, P("data")))
  temp = {}
  for gather in ("micro_batch", "step"):
    step = jax.jit(jaxaccum.value_and_grad(
        lambda p, b: _problems.mlp_loss(p, b, "mean"), num_micro_batches=4,
        data_axis=jaxaccum.DataParallel("data", mesh=mesh, param_gather=gather)))
    compiled = step.lower(params, batch).compile()
    temp[gather] = compiled.memory_analysis().temp_size_in_bytes
    colls = jaxaccum.planning.collectives(compiled)
    assert colls.count("all-gather", in_loop=gather == "micro_batch") == 6, str(colls)
  assert temp["micro_batch"] < temp["step"], temp


def test_hsdp_with_a_gathered_keyword_argument():
  """HSDP, ``data_axis=("replica", "fsdp")``: parameters and a keyword argument (not
  differentiated) sharded over ``"fsdp"`` only, gathered in every micro-batch next to a
  positional argument (once a raw pytree-sorting error), tied with a batch that varies over
  both axes. Values, gradients and the batch's cotangent equal the step placement's and the
  full batch's."""
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
  params, batch, cts = _problem(5, 32)
  scale = jnp.linspace(0.5, 1.5, C)

  def scaled(params, batch, *, scale):
    return _loss({**params, "w2": params["w2"] * scale}, batch)

  ref = _through_batch(jax.value_and_grad(functools.partial(scaled, scale=scale)))
  ref_out, ref_ct = ref(params, batch, cts)
  sharded = _place(params, mesh, {"w1": P("fsdp"), "b1": P(), "w2": P("fsdp")})
  placed = _place(batch, mesh, dict.fromkeys(batch, P(("replica", "fsdp"))))
  on_fsdp = jax.device_put(scale, NamedSharding(mesh, P("fsdp")))
  got = {}
  for gather in ("micro_batch", "step"):
    step = jaxaccum.value_and_grad(scaled, num_micro_batches=2, data_axis=jaxaccum.DataParallel(
        ("replica", "fsdp"), mesh=mesh, param_gather=gather))
    got[gather] = _through_batch(functools.partial(step, scale=on_fsdp))(sharded, placed, cts)
  assert_close(got["micro_batch"], got["step"], rtol=1e-6)
  assert_close(got["micro_batch"], (ref_out, ref_ct))


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def _ties(jaxpr):
  """Per jaxpr (inner ones included): the tie's calls in it and the variables it reads."""
  for eqn in jaxpr.eqns:
    inner = list(_sub_jaxprs(eqn))
    if eqn.primitive.name == "custom_jvp_call" and any(
        e.primitive.name == "optimization_barrier" for j in inner for e in j.eqns):
      read = {id(v) for e in jaxpr.eqns for v in (*e.invars, *jaxpr.outvars)}
      yield eqn, read
    for sub in inner:
      yield from _ties(sub)


def test_fun_reads_every_output_of_the_tie():
  """Why the tie holds: every output of its barrier is read (``fun`` reads the micro-batch
  from it, the gathers the shards). XLA's simplifier drops a barrier operand whose output
  nothing reads where nothing else reads the operand either (a scalar from the micro-batch
  was dropped so, and the gathers left the loop); a barrier output that is read cannot be
  replaced by its input. On jax 0.10 the compiled placement tests cannot see an unread
  micro-batch output (XLA keeps an operand that ``fun`` also reads directly): this does."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch, _ = _problem(0, 64)
  sharded = _place(params, mesh, {"w1": P("data"), "b1": P("data"), "w2": P()})
  placed = _place(batch, mesh, dict.fromkeys(batch, P("data")))
  step = _placed_step("micro_batch", "micro_batch", 4, mesh)[0]
  ties = list(_ties(jax.make_jaxpr(step)(sharded, placed).jaxpr))
  assert ties
  for eqn, read in ties:
    # Two gathered leaves (w1, b1) and the three leaves of the micro-batch.
    assert len(eqn.outvars) == 5 and all(id(v) in read for v in eqn.outvars), eqn
