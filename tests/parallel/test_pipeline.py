"""jaxaccum.contrib.pipeline on 8 virtual CPU devices, against the unpipelined model.

The reference applies the stages one after the other to the whole batch (a Python loop
over the stacked parameters) under plain ``jax.value_and_grad`` on unsharded arrays. The
pipeline sums each stage's gradient over micro-batches in another order, so float32
results agree to round-off: ``assert_close``'s 1e-5 relative to the largest entry of
each leaf.

The compiled programs are checked too: one collective-permute per tick in the forward
loop and one in the backward loop, no all-reduce over the stage axis inside a loop, and
temp memory affine in ``M + S - 1`` and lowered by ``remat``.
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
from tests._util import assert_close, scan_lengths

D, H, VOCAB = 8, 16, 11  # boundary width, stage hidden width, classes


def mlp_stage(w, x):
  """A residual MLP block: one stage (its output is shaped like its input)."""
  return x + jnp.tanh(x @ w["w1"]) @ w["w2"]


def rms_stage(w, x):
  """RMS normalisation without epsilon: finite on real inputs, NaN on zeros."""
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
  return x + jnp.tanh(y @ w["w1"]) @ w["w2"]


def _stage_params(s, seed=0, repeats=1):
  rng = np.random.default_rng(seed)
  lead = (s,) if repeats == 1 else (repeats, s)
  return {"w1": (rng.normal(size=(*lead, D, H)) / np.sqrt(D)).astype(np.float32),
          "w2": (rng.normal(size=(*lead, H, D)) / np.sqrt(H)).astype(np.float32)}


def sequential(stage_fn, params, x, repeats=1):
  """The unpipelined model: the stages one after the other on the whole batch.

  With repeats, leaves are ``(R, S, ...)`` and entry ``[r, s]`` is chunk ``r * S + s``.
  """
  if repeats > 1:
    params = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), params)
  for s in range(jax.tree.leaves(params)[0].shape[0]):
    x = stage_fn(jax.tree.map(lambda a, s=s: a[s], params), x)
  return x


def _mesh(shape, axis_type=AxisType.Explicit):
  names = ("stage",) if len(shape) == 1 else ("data", "stage")
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _square_loss(body):
  def loss(params, x):
    return jnp.mean(jnp.sin(body(params, x)) ** 2)
  return loss


def _put(mesh, params, x, repeats=1):
  batch_spec = P("data") if "data" in mesh.axis_names else P()
  stage_spec = P("stage") if repeats == 1 else P(None, "stage")
  return (jax.device_put(params, NamedSharding(mesh, stage_spec)),
          jax.device_put(x, NamedSharding(mesh, batch_spec)))


def _compiled(shape, m, *, remat=True, axis_type=AxisType.Explicit, stage=mlp_stage, rows=2,
              repeats=1):
  """The value and gradients of a pipelined loss, compiled once per configuration.

  (Every option passed on by position: a default and the same value given by keyword
  are one cache entry, so tests that name different options share the compile.)
  """
  return _compiled_once(shape, m, remat, axis_type, stage, rows, repeats)


@functools.cache
def _compiled_once(shape, m, remat, axis_type, stage, rows, repeats):
  mesh = _mesh(shape, axis_type)
  s = mesh.shape["stage"]
  rng = np.random.default_rng(m)
  params = _stage_params(s, repeats=repeats)
  x = rng.normal(size=(m * rows * (2 if len(shape) == 2 else 1), D)).astype(np.float32)
  pipe = jaxaccum.contrib.pipeline(stage, num_micro_batches=m, mesh=mesh, remat=remat,
                           num_repeats=repeats)
  step = jax.jit(jax.value_and_grad(_square_loss(pipe), argnums=(0, 1)))
  args = _put(mesh, params, x, repeats)
  return step.lower(*args).compile(), args, (params, x)


def _reference(stage, params, x, repeats=1):
  body = functools.partial(sequential, stage, repeats=repeats)
  return jax.jit(jax.value_and_grad(_square_loss(body), argnums=(0, 1)))(params, x)


def _assert_same_shardings(grads, params):
  for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params),
                          strict=True):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (
        f"grads{jax.tree_util.keystr(path)} has sharding {g.sharding}, params {p.sharding}")


# ------------------------------------------------------------------------ the schedule


@pytest.mark.parametrize("s, m", [(1, 1), (4, 1), (4, 3), (4, 4), (8, 16), (3, 7)])
def test_schedule_has_s_times_m_busy_slots_out_of_s_times_m_plus_s_minus_1(s, m):
  table = jaxaccum.contrib.pipeline_schedule(num_stages=s, num_micro_batches=m)
  assert len(table) == m + s - 1 and all(len(row) == s for row in table)
  busy = [(t, j) for t, row in enumerate(table) for j, mb in enumerate(row) if mb is not None]
  assert len(busy) == s * m
  assert 1 - len(busy) / (s * len(table)) == pytest.approx((s - 1) / (m + s - 1))
  # Every stage sees every micro-batch once, in order, one tick after the stage before it.
  for j in range(s):
    assert [row[j] for row in table if row[j] is not None] == list(range(m))
  for t, j in busy:
    assert table[t][j] == t - j


@pytest.mark.parametrize("s, m, r", [(4, 4, 2), (4, 6, 3), (4, 2, 2), (8, 8, 2)])
def test_circular_schedule_runs_every_chunk_on_every_micro_batch_once(s, m, r):
  table = jaxaccum.contrib.pipeline_schedule(s, m, num_repeats=r)
  period = max(m, s)
  assert len(table) == (r - 1) * period + m + s - 1
  busy = sum(e is not None for row in table for e in row)
  assert busy == s * m * r
  if m >= s:  # the interleaved bubble
    assert 1 - busy / (s * len(table)) == pytest.approx((s - 1) / (r * m + s - 1))
  # Micro-batch i runs chunk k = round * S + stage at tick i + k: in model order, and
  # stage 0 starts a round only after the last stage finished the previous one.
  for i in range(m):
    ticks = [t for t, row in enumerate(table) for j, e in enumerate(row) if e == i]
    assert ticks == sorted(ticks) and len(ticks) == s * r
    for k, t in enumerate(ticks):
      assert table[t].index(i) == k % s
      assert t == i + (k // s) * period + k % s


# ------------------------------------------------------------ equal to the sequential model


CASES = [
    pytest.param((8,), 3, id="stage8-M3<S"),
    pytest.param((8,), 8, id="stage8-M=S"),
    pytest.param((8,), 16, id="stage8-M=2S"),
    pytest.param((8,), 12, id="stage8-M12-not-multiple"),
    pytest.param((2, 4), 2, id="data2xstage4-M2<S"),
    pytest.param((2, 4), 6, id="data2xstage4-M6-not-multiple"),
]


@pytest.mark.parametrize("shape, m", CASES)
def test_matches_the_sequential_model(shape, m):
  axis_type = AxisType.Auto if len(shape) == 2 else AxisType.Explicit
  compiled, args, (params, x) = _compiled(shape, m, axis_type=axis_type)
  value, grads = compiled(*args)
  ref_value, ref_grads = _reference(mlp_stage, params, x)
  assert_close(value, ref_value, rtol=1e-5)
  assert_close(grads, ref_grads, rtol=1e-5)
  _assert_same_shardings(grads[0], args[0])


CIRCULAR = [
    pytest.param((8,), 8, 2, mlp_stage, id="stage8-R2-M=S"),
    pytest.param((8,), 12, 2, mlp_stage, id="stage8-R2-M12>S-buffered"),
    pytest.param((8,), 3, 2, rms_stage, id="stage8-R2-M3<S-nan-on-zeros"),
    pytest.param((2, 4), 6, 3, mlp_stage, id="data2xstage4-R3-M6"),
]


@pytest.mark.parametrize("shape, m, r, stage", CIRCULAR)
def test_circular_schedule_matches_the_sequential_model(shape, m, r, stage):
  axis_type = AxisType.Auto if len(shape) == 2 else AxisType.Explicit
  compiled, args, (params, x) = _compiled(shape, m, axis_type=axis_type, repeats=r, stage=stage)
  value, grads = compiled(*args)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  ref_value, ref_grads = _reference(stage, params, x, repeats=r)
  assert_close(value, ref_value, rtol=1e-5)
  assert_close(grads, ref_grads, rtol=1e-5)
  _assert_same_shardings(grads[0], args[0])
  permutes = jaxaccum.planning.collectives(compiled).select("collective-permute")
  assert len(permutes) == 2 and all(c.in_loop for c in permutes), permutes


def test_forward_under_set_mesh_equals_sequential_in_row_order():
  mesh = _mesh((8,))
  params = _stage_params(8, seed=1)
  x = np.random.default_rng(1).normal(size=(10, 3, D)).astype(np.float32)
  pipe = jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=5)  # mesh=None: from set_mesh
  with jax.set_mesh(mesh):
    y = jax.jit(pipe)(*_put(mesh, params, x))
  assert_close(y, sequential(mlp_stage, params, x), rtol=1e-5)


def test_nan_on_zeros_stage_keeps_finite_exact_gradients():
  # The stage is NaN on zeros; M = 2 on 8 stages: 7 of every 9 ticks are bubbles.
  params = _stage_params(8, seed=2)
  assert np.all(np.isnan(rms_stage(jax.tree.map(lambda a: a[0], params),
                                   jnp.zeros((2, D)))))
  compiled, args, (params, x) = _compiled((8,), 2, stage=rms_stage)
  value, grads = compiled(*args)
  for g in jax.tree.leaves(grads):
    assert bool(jnp.all(jnp.isfinite(g)))
  ref_value, ref_grads = _reference(rms_stage, params, x)
  assert_close(value, ref_value, rtol=1e-5)
  assert_close(grads, ref_grads, rtol=1e-5)


# -------------------------------------------------- inside jaxaccum.value_and_grad


SEQ = 5


def _lm_problem(seed=3):
  rng = np.random.default_rng(seed)
  params = {"embed": (rng.normal(size=(VOCAB, D))).astype(np.float32),
            "stages": _stage_params(4, seed),
            "head": (rng.normal(size=(D, VOCAB)) / np.sqrt(D)).astype(np.float32)}
  b = 16
  lengths = rng.integers(1, SEQ + 1, size=b)
  batch = {"tokens": rng.integers(0, VOCAB, size=(b, SEQ)).astype(np.int32),
           "labels": rng.integers(0, VOCAB, size=(b, SEQ)).astype(np.int32),
           "mask": (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)}
  return params, batch


def _token_loss(body):
  """(summed masked cross-entropy, real tokens), aux: the real tokens."""
  def loss(params, batch):
    x = jax.nn.one_hot(batch["tokens"], VOCAB) @ params["embed"]  # outside the pipeline
    logits = body(params["stages"], x) @ params["head"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)[..., 0]
    tokens = jnp.sum(batch["mask"])
    return (jnp.sum(nll * batch["mask"]), tokens), {"tokens": tokens}
  return loss


@pytest.mark.parametrize("data_axis", [None, "data"])
def test_token_weighted_loss_inside_value_and_grad(data_axis):
  mesh = _mesh((2, 4))
  params, batch = _lm_problem()
  # 2 outer micro-batches x 2 pipeline micro-batches, with different numbers of tokens.
  tokens = np.asarray(jaxaccum.split_micro_batches(batch["mask"], num_micro_batches=2))
  assert len(set(tokens.sum(axis=(1, 2)))) == 2
  pipe = jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=2)
  step = jaxaccum.value_and_grad(_token_loss(pipe), num_micro_batches=2, reduce="weighted",
                                 has_aux=True, aux_reduce={"tokens": "sum"},
                                 data_axis=data_axis)
  with jax.set_mesh(mesh):
    sharded = (
        {"embed": jax.device_put(params["embed"], NamedSharding(mesh, P())),
         "stages": jax.device_put(params["stages"], NamedSharding(mesh, P("stage"))),
         "head": jax.device_put(params["head"], NamedSharding(mesh, P()))},
        jax.device_put(batch, NamedSharding(mesh, P("data"))))
    (value, aux), grads = jax.jit(step)(*sharded)

  def reference(p):
    (num, den), aux = _token_loss(functools.partial(sequential, mlp_stage))(p, batch)
    return num / den, aux

  (ref_value, ref_aux), ref_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
  assert_close(value, ref_value, rtol=1e-5)
  assert float(aux["tokens"]) == float(ref_aux["tokens"]) == float(batch["mask"].sum())
  assert_close(grads, ref_grads, rtol=1e-5)
  _assert_same_shardings(grads["stages"], sharded[0]["stages"])


REPEATS_IN_DATA_AXIS = [
    pytest.param(AxisType.Auto, 2, 2, id="auto-N2-M2<S"),
    pytest.param(AxisType.Explicit, 2, 2, id="explicit-N2-M2<S"),
    pytest.param(AxisType.Explicit, 1, 8, id="explicit-N1-M8>S"),
]


@pytest.mark.parametrize("axis_type, n, m", REPEATS_IN_DATA_AXIS)
def test_circular_schedule_inside_value_and_grad_data_axis(axis_type, n, m):
  """num_repeats=2 in each data shard: the stage-0 ring buffer varies over both axes."""
  mesh = _mesh((2, 4), axis_type)
  params, batch = _lm_problem()
  params["stages"] = _stage_params(4, seed=4, repeats=2)
  pipe = jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=m, num_repeats=2)
  step = jaxaccum.value_and_grad(_token_loss(pipe), num_micro_batches=n, reduce="weighted",
                                 has_aux=True, aux_reduce={"tokens": "sum"}, data_axis="data")
  with jax.set_mesh(mesh):
    sharded = (
        {"embed": jax.device_put(params["embed"], NamedSharding(mesh, P())),
         "stages": jax.device_put(params["stages"], NamedSharding(mesh, P(None, "stage"))),
         "head": jax.device_put(params["head"], NamedSharding(mesh, P()))},
        jax.device_put(batch, NamedSharding(mesh, P("data"))))
    (value, aux), grads = jax.jit(step)(*sharded)

  def reference(p):
    body = functools.partial(sequential, mlp_stage, repeats=2)
    (num, den), aux = _token_loss(body)(p, batch)
    return num / den, aux

  (ref_value, ref_aux), ref_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
  chex.assert_trees_all_close(value, ref_value, rtol=1e-5, atol=1e-6)
  assert float(aux["tokens"]) == float(ref_aux["tokens"])
  assert_close(grads, ref_grads, rtol=1e-5)
  _assert_same_shardings(grads["stages"], sharded[0]["stages"])


@pytest.mark.parametrize("s, m, r", [(4, 1, 1), (4, 3, 1), (4, 6, 1), (2, 5, 1), (4, 2, 2),
                                     (4, 6, 2), (2, 3, 3)])
def test_forward_scan_runs_the_ticks_of_the_schedule(s, m, r):
  """M + S - 1 ticks for GPipe ((R - 1) max(M, S) + M + S - 1 circular), not one more."""
  mesh = jax.make_mesh((s,), ("stage",), devices=jax.devices()[:s],
                       axis_types=(AxisType.Explicit,))
  params = _stage_params(s, repeats=r)
  x = np.ones((2 * m, D), np.float32)
  pipe = jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=m, num_repeats=r, mesh=mesh)
  lengths = scan_lengths(jax.make_jaxpr(pipe)(*_put(mesh, params, x, r)).jaxpr)
  assert lengths == [len(jaxaccum.contrib.pipeline_schedule(s, m, num_repeats=r))], lengths


# ------------------------------------------------------------------- compiled programs


def _spans_stage(groups, mesh):
  stage = {d.id: int(np.argwhere(mesh.devices == d)[0][mesh.axis_names.index("stage")])
           for d in mesh.devices.flat}
  return any(len({stage[i] for i in g}) > 1 for g in groups)


@pytest.mark.parametrize("shape, m", [((8,), 8), ((2, 4), 6)])
def test_compiled_loop_has_one_permute_per_tick_and_no_stage_all_reduce(shape, m):
  axis_type = AxisType.Auto if len(shape) == 2 else AxisType.Explicit
  compiled, _, _ = _compiled(shape, m, axis_type=axis_type)
  colls = jaxaccum.planning.collectives(compiled)
  permutes = [c for c in colls if c.kind == "collective-permute"]
  # One in the forward scan, its transpose in the backward scan; both inside the loops.
  assert len(permutes) == 2 and all(c.in_loop for c in permutes), colls
  mesh = _mesh(shape, axis_type)
  in_loop = [c for c in colls if c.kind == "all-reduce" and c.in_loop
             and _spans_stage(c.replica_groups, mesh)]
  assert not in_loop, f"all-reduce over the stage axis inside the loop: {in_loop}"
  # The stage axis is reduced only outside: the outputs (forward) and dx (backward).
  # (On the data x stage mesh with Auto axes, the compiler reduces the stages' weight
  # gradients over "data" at every tick; jaxaccum.value_and_grad(data_axis=...) does it
  # once per step instead, see test_token_weighted_loss_inside_value_and_grad.)
  outside = [c for c in colls if c.kind == "all-reduce" and not c.in_loop
             and _spans_stage(c.replica_groups, mesh)]
  assert len(outside) == 2, colls
  assert not [c for c in colls if c.kind in ("all-gather", "all-to-all", "reduce-scatter")]


def test_temp_memory_affine_in_ticks_and_lowered_by_remat():
  ms = (8, 12, 16)
  temp = {remat: [_compiled((8,), m, remat=remat)[0].memory_analysis().temp_size_in_bytes
                  for m in ms] for remat in (True, False)}
  ticks = [m + 8 - 1 for m in ms]
  boundary = 2 * D * 4  # one micro-batch of stage-boundary activations: rows x D x f32
  slopes = {}
  for remat, t in temp.items():
    slopes[remat] = [(t[i + 1] - t[i]) / (ticks[i + 1] - ticks[i]) for i in range(2)]
    # Grows with every tick (at least the stashed stage input), at a steady rate.
    assert min(slopes[remat]) >= boundary, (remat, t)
    assert max(slopes[remat]) <= 1.25 * min(slopes[remat]), (remat, t, slopes)
  # remat stores the stage inputs, not the hidden (2 x wider) activations of every tick.
  assert max(slopes[True]) < 0.75 * min(slopes[False]), slopes
  for with_remat, without in zip(temp[True], temp[False], strict=True):
    assert with_remat < 0.75 * without, temp


# ---------------------------------------------------------------------------- errors


def test_options_are_checked_when_the_pipeline_is_built():
  with pytest.raises(TypeError, match="num_micro_batches must be a positive Python int"):
    jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=2.0)
  with pytest.raises(ValueError, match="num_micro_batches=0"):
    jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=0)
  with pytest.raises(TypeError, match="stage_axis must be a mesh axis name"):
    jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=2, stage_axis=("stage",))
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=2, mesh="stage")
  with pytest.raises(TypeError, match="stage_fn must be callable"):
    jaxaccum.contrib.pipeline(None, num_micro_batches=2)
  with pytest.raises(TypeError, match="num_repeats must be a positive Python int"):
    jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=2, num_repeats=None)
  with pytest.raises(ValueError, match="num_stages=0"):
    jaxaccum.contrib.pipeline_schedule(0, 2)


def test_trace_time_errors():
  mesh = _mesh((8,))
  params = _stage_params(8)
  x = np.ones((16, D), np.float32)
  pipe = jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=4, mesh=mesh)
  with pytest.raises(ValueError, match=r"stage_params\['w1'\] has shape \(4, 8, 16\), but "
                                       r"the stage axis 'stage' has size 8"):
    pipe(_stage_params(4), x)
  with pytest.raises(ValueError, match=r"has shape \(8, 8, 16\), but the stage axis 'stage' "
                                       r"has size 8 and num_repeats=2: every leaf needs "
                                       r"leading axes \(num_repeats, stages\) = \(2, 8\)"):
    jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=4, mesh=mesh, num_repeats=2)(params, x)
  with pytest.raises(ValueError, match="batch size 18 is not divisible by "
                                       r"num_micro_batches=4.*divisors of 18: 1, 2, 3, 6, 9, 18"):
    pipe(params, np.ones((18, D), np.float32))
  with pytest.raises(ValueError, match=r"stage_fn must return a value shaped like its input.*"
                                       r"float32\[4, 8\].*float32\[4, 16\]"):
    jaxaccum.contrib.pipeline(lambda w, x: jnp.tanh(x @ w["w1"]), num_micro_batches=4,
                              mesh=mesh)(params, x)
  with pytest.raises(ValueError, match=r"stage_axis='pipe' names mesh axis 'pipe', which is "
                                       r"not in the mesh; its axes are \{'stage': 8\}"):
    jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=4, mesh=mesh,
                              stage_axis="pipe")(params, x)
  with pytest.raises(ValueError, match=r"stage_axis='stage' needs a mesh: pass mesh=\.\.\. "
                                       "to jaxaccum.contrib.pipeline"):
    jaxaccum.contrib.pipeline(mlp_stage, num_micro_batches=4)(params, x)
  with pytest.raises(ValueError, match=r"stage_axis axes \['stage'\] are already manual here.*"
                                       "outside your shard_map over that axis"):
    jax.shard_map(lambda p, x: pipe(p, x), mesh=mesh, in_specs=(P("stage"), P()),
                  out_specs=P())(*_put(mesh, params, x))


# --------------------------------------------------------------------------- example


def test_pipeline_lm_example_matches_the_unpipelined_run(tmp_path):
  import dataclasses
  import importlib.util
  import pathlib
  import sys

  path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pipeline_lm.py"
  spec = importlib.util.spec_from_file_location("_example_pipeline_lm", path)
  example = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = example  # dataclasses look their module up there
  spec.loader.exec_module(example)
  cfg = dataclasses.replace(example.TINY, steps=3, seq_len=8, d_model=8)
  out = example.main(cfg, out_dir=tmp_path, verbose=False)
  assert out["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  ref, got = np.asarray(out["curves"]["unpipelined"]), np.asarray(out["curves"]["pipelined"])
  assert ref.shape == got.shape == (3,) and np.all(np.isfinite(ref))
  # Same gradients up to float32 round-off, so the same Adam trajectory over 3 steps.
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  held = out["held_out"]
  np.testing.assert_allclose(held["pipelined"], held["unpipelined"], rtol=1e-5)
  # Training lowers the loss on a batch it never saw (the training curve compares losses
  # of different batches, so its ends may not be ordered), by far more than the two runs
  # differ anywhere.
  gap = max(float(np.max(np.abs(got - ref))), abs(held["pipelined"] - held["unpipelined"]))
  for run in ("pipelined", "unpipelined"):
    assert held["initial"] - held[run] > 100 * gap, (run, held, gap)
