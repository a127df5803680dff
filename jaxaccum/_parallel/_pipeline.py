"""GPipe pipeline parallelism over a stage mesh axis: accumulation across model stages.

``S`` devices along a ``stage`` mesh axis each hold one stage of a model (a slice of
parameters stacked with a leading axis of size ``S``). The batch is split into ``M``
micro-batches that flow through the stages: at tick ``t`` stage ``s`` works on
micro-batch ``t - s``, then hands its output to stage ``s + 1`` with one ``ppermute``.
The forward pass is one :func:`jax.lax.scan` over ``T = M + S - 1`` ticks inside
:func:`jax.shard_map` (manual over the stage axis only); the backward pass is the
autodiff of that scan, which runs the mirrored schedule (ticks in reverse, activations
sent backwards with the transposed ``ppermute``). Each stage's parameter gradient is the
sum over the micro-batches it processed: it stays on that stage's device, with the
parameters' ``P(stage)`` sharding, and no all-reduce over the stage axis runs inside the
loop.

Bubble ticks (``t < s`` while the pipeline fills, ``t - s >= M`` while it drains) never
see garbage: a stage in a bubble computes on a real micro-batch of the pipeline's input
and its result is discarded. A stage that is finite on real inputs but NaN on, say,
zeros therefore never produces a NaN whose zero cotangent could turn into ``0 * NaN`` in
the backward pass.

A circular schedule (``num_repeats=R``) runs ``R`` rounds through the stages in the same
scan: device ``s`` holds model chunks ``s, S + s, ...``, the ``ppermute`` closes the ring,
and stage 0 keeps the last stage's outputs in a buffer of ``max(M, S)`` micro-batches
until their next round.

Outside the loop: the input micro-batches, replicated over the stage axis, are marked
stage-varying once before the scan (so their cotangent is summed over the stage axis
once, after the backward loop), and the last stage's outputs reach every stage with one
masked ``psum`` after the loop, so that whatever follows (a head, a loss) sees an
ordinary, stage-replicated array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum._core import _sharding, _split
from jaxaccum._core._types import PyTree
from jaxaccum._parallel import _axes

_STAGE_AXIS = _axes.MeshUse(
    argument="stage_axis", caller="jaxaccum.contrib.pipeline",
    along="the stages are laid out along",
    manual_fix="Call the pipeline outside your shard_map over that axis.", nest=True)


def pipeline_schedule(num_stages: int, num_micro_batches: int, *,
                      num_repeats: int = 1) -> tuple[tuple[int | None, ...], ...]:
  """The forward schedule that :func:`pipeline` runs, as a table.

  Row ``t`` is tick ``t``; entry ``s`` is the micro-batch stage ``s`` works on at that
  tick, or ``None`` in a bubble (the stage then computes on a real micro-batch and the
  result is discarded). With one repeat (GPipe) there are ``T = M + S - 1`` ticks and
  ``S * M`` of the ``S * T`` slots are busy: the bubble fraction is
  ``(S - 1) / (M + S - 1)``. With ``R`` repeats (circular schedule) micro-batch ``i``
  enters stage 0 for round ``r`` at tick ``i + r * max(M, S)``, stage ``s`` then runs
  model chunk ``r * S + s``, and there are ``T = (R - 1) max(M, S) + M + S - 1`` ticks, so
  for ``M >= S`` the bubble fraction is ``(S - 1) / (R * M + S - 1)``. The backward pass
  runs the same table from the last tick to the first.

  Args:
    num_stages: ``S``, the size of the stage mesh axis.
    num_micro_batches: ``M``, the number of micro-batches.
    num_repeats: ``R``, the number of rounds through the stages.

  Returns:
    A tuple of ``T`` rows, each a tuple of ``S`` entries (``int`` or ``None``).

  Raises:
    TypeError, ValueError: if a count is not a positive Python int.

  >>> import jaxaccum
  >>> for row in jaxaccum.contrib.pipeline_schedule(num_stages=3, num_micro_batches=2):
  ...   print(" ".join("." if m is None else str(m) for m in row))
  0 . .
  1 0 .
  . 1 0
  . . 1
  """
  s = _split.check_count("num_stages", num_stages, required=True)
  m = _split.check_count("num_micro_batches", num_micro_batches, required=True)
  r = _split.check_count("num_repeats", num_repeats, required=True)
  period = max(m, s) if r > 1 else m
  ticks = (r - 1) * period + m + s - 1

  def entry(u):
    return u % period if 0 <= u and u % period < m and u // period < r else None

  return tuple(tuple(entry(t - j) for j in range(s)) for t in range(ticks))


def pipeline(stage_fn: Callable[[PyTree, PyTree], PyTree], *, num_micro_batches: int,
             stage_axis: str = "stage", num_repeats: int = 1, mesh: Any = None,
             remat: bool = True) -> Callable[[PyTree, PyTree], PyTree]:
  """Runs ``stage_fn`` as a GPipe pipeline over the devices of a stage mesh axis.

  ``pipe(stage_params, x)`` computes the same value as applying the ``S`` stages one
  after the other to the whole batch (``x = stage_fn(stage_params[s], x)`` for ``s = 0
  .. S-1``), with stage ``s`` on the ``s``-th device along ``stage_axis``, and the batch
  split into ``num_micro_batches`` micro-batches (micro-batch ``i`` holds rows ``i, i+M,
  ...``, the column-major split of :func:`jaxaccum.split_micro_batches`, so a batch
  sharded over a data axis stays where it is). It is differentiable (the backward pass
  is the autodiff of the forward scan), works under :func:`jax.jit`, and composes with
  :func:`jaxaccum.value_and_grad`: keep the embedding, head and loss outside ``pipe``.

  Other mesh axes (data, FSDP) are left to the compiler or to an outer ``shard_map``
  such as ``jaxaccum.value_and_grad(..., data_axis=...)``.

  Args:
    stage_fn: ``stage_fn(one_stage_params, x_micro) -> y_micro``, with ``y_micro`` of
      the same structure, shapes and dtypes as ``x_micro`` (a stage boundary). For
      several layers per stage, stack them and ``lax.scan`` over them inside.
    num_micro_batches: ``M``, a positive Python int dividing the batch size. The bubble
      fraction is ``(S - 1) / (M + S - 1)``.
    stage_axis: the name of the mesh axis the stages are laid out along.
    num_repeats: ``R``, for a circular (interleaved) schedule: the model is cut into
      ``R * S`` chunks, device ``s`` holds chunks ``s, S + s, 2S + s, ...``, and every
      micro-batch goes round the stage axis ``R`` times. The leaves of ``stage_params``
      then have leading axes ``(R, S)`` (entry ``[r, s]`` is chunk ``r * S + s``). For
      ``M >= S`` the bubble fraction drops to ``(S - 1) / (R * M + S - 1)``; with
      ``M < S`` each round waits for ``S`` ticks.
    mesh: a :class:`jax.sharding.Mesh` (or ``AbstractMesh``) with ``stage_axis``; by
      default the mesh set with :func:`jax.set_mesh`.
    remat: recompute each tick's stage internals in the backward pass
      (:func:`jax.checkpoint`), so the loop stores only the stage inputs of each tick
      instead of every stage's activations for every tick.

  Returns:
    ``pipe(stage_params, x)``: ``stage_params`` is a pytree whose array leaves have a
    leading axis of size ``S`` (``(R, S)`` with repeats), ideally sharded over
    ``stage_axis`` there; gradients come back that way. ``x`` is a pytree of arrays with
    a common leading batch axis. Returns the last stage's output for the whole batch, in
    the original row order, replicated over the stage axis.

  Raises:
    TypeError, ValueError: at construction for bad options, and at trace time for a
      missing mesh or axis, leading sizes that differ from the stage axis size, a batch
      not divisible by ``num_micro_batches`` or a ``stage_fn`` whose output does not
      match its input.

  >>> import jax, jax.numpy as jnp, jaxaccum
  >>> mesh = jax.make_mesh((4,), ("stage",))
  >>> w = jnp.stack([jnp.eye(3) * (s + 1) for s in range(4)])  # 4 stages
  >>> pipe = jaxaccum.contrib.pipeline(lambda w, x: x @ w, num_micro_batches=2, mesh=mesh)
  >>> y = jax.jit(pipe)(w, jnp.ones((4, 3)))
  >>> y[0].tolist()  # 1 * 2 * 3 * 4
  [24.0, 24.0, 24.0]
  """
  if not callable(stage_fn):
    raise TypeError(f"stage_fn must be callable, got {stage_fn!r}.")
  m = _split.check_count("num_micro_batches", num_micro_batches, required=True)
  r = _split.check_count("num_repeats", num_repeats, required=True)
  if not isinstance(stage_axis, str):
    raise TypeError(
        f"stage_axis must be a mesh axis name (a str), got stage_axis={stage_axis!r}.")
  if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh (e.g. from jax.make_mesh) or None, got {mesh!r}.")
  if not isinstance(remat, bool):
    raise TypeError(f"remat must be True or False, got remat={remat!r}.")

  def pipe(stage_params: PyTree, x: PyTree) -> PyTree:
    the_mesh = _axes.resolve_mesh(mesh, (stage_axis,), _STAGE_AXIS)
    s = the_mesh.shape[stage_axis]
    _check_stage_params(stage_params, s, r, stage_axis)
    x_leaves, x_def = jax.tree.flatten(x)
    _check_batch(x, m)
    micro = [_retype(_split.split(leaf, m), the_mesh, stage_axis, lead=None)
             for leaf in x_leaves]
    p_leaves, p_def = jax.tree.flatten(stage_params)
    lead = 0 if r == 1 else 1  # the dimension of the stage parameters sharded over stages
    p_leaves = [_retype(leaf, the_mesh, stage_axis, lead=lead) for leaf in p_leaves]
    body = _make_body(stage_fn, p_def, x_def, m, s, r, stage_axis, remat)
    p_spec = PartitionSpec(*([None] * lead), stage_axis)
    mapped = jax.shard_map(
        body, mesh=the_mesh, axis_names=frozenset({stage_axis}),
        in_specs=(tuple(p_spec for _ in p_leaves), tuple(PartitionSpec() for _ in micro)),
        out_specs=tuple(PartitionSpec() for _ in micro))
    if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
      mapped = _recompute_in_backward(mapped, body, the_mesh, stage_axis, p_spec,
                                      len(p_leaves), len(micro))
    out = mapped(tuple(p_leaves), tuple(micro))
    return jax.tree.unflatten(x_def, [_split.merge(y) for y in out])

  return pipe


def _make_body(stage_fn, p_def, x_def, m: int, s: int, r: int, axis: str, remat: bool):
  """The per-device program: one scan over the ticks, one ppermute each."""
  def chunk_fn(local, rnd, x):
    # The round's chunk is selected inside the (checkpointed) function: the selected
    # parameters are then recomputed in the backward pass, not stored at every tick.
    return stage_fn(jax.tree.map(lambda p: lax.dynamic_index_in_dim(p, rnd, keepdims=False),
                                 local), x)

  # (params, x) for one round, (params, round, x) for several
  fn: Callable[..., Any] = stage_fn if r == 1 else chunk_fn
  if remat:
    fn = jax.checkpoint(fn)
  period = max(m, s) if r > 1 else m
  ticks = (r - 1) * period + m + s - 1
  # One round: an open chain; several: a ring, the last stage feeding the first.
  perm = [(j, (j + 1) % s) for j in range(s if r > 1 else s - 1)]

  def body(p_leaves, micro):
    stage = lax.axis_index(axis)
    # This stage's slice (with repeats, its R chunks).
    local = [p[0] if r == 1 else p[:, 0] for p in p_leaves]
    # Marked stage-varying here, once: the transpose (a psum of their cotangent over the
    # stage axis) then runs once after the backward loop, not at every tick.
    micro = tuple(_sharding.vary(micro, (axis,)))
    first = [_split.take(u, jnp.int32(0)) for u in micro]
    first_params = jax.tree.unflatten(p_def, local if r == 1 else [p[0] for p in local])
    _check_stage_output(stage_fn, first_params, jax.tree.unflatten(x_def, first))
    # A stage's output varies over every manual axis its inputs vary over: the stage axis,
    # and the data axes of an enclosing shard_map (value_and_grad(data_axis=...)).
    varying = tuple(sorted(frozenset().union(
        *(_sharding.varying(v) for v in (*local, *micro))), key=str))

    def tick(carry, t):
      state, buffer = carry
      u = t - stage  # this stage's position in the schedule
      rnd = jnp.clip(u // period, 0, r - 1)
      busy = (u >= 0) & (u % period < m) & (u // period < r)
      fresh = [_split.take(v, t % m) for v in micro]
      if r == 1:
        received = state
      else:
        # Stage 0 keeps what the last stage sent until its next round (M > S) in a
        # buffer indexed by micro-batch; it is written before it is read.
        buffer = tuple(lax.dynamic_update_index_in_dim(buf, v, (t - s) % period, 0)
                       for buf, v in zip(buffer, state, strict=True))
        stored = [lax.dynamic_index_in_dim(buf, t % period, keepdims=False) for buf in buffer]
        received = [jnp.where(stage == 0, a, b) for a, b in zip(stored, state, strict=True)]
      # Round 0 of stage 0 reads the pipeline's input; a stage in a bubble reads a real
      # micro-batch too (never zeros or a previous bubble's output) and its result is
      # thrown away, so no NaN can reach the gradients.
      own = ~busy | ((stage == 0) & (u < period))
      inp = [jnp.where(own, a, b) for a, b in zip(fresh, received, strict=True)]
      x_in = jax.tree.unflatten(x_def, inp)
      rnd_x = (x_in,) if r == 1 else (rnd, x_in)
      out = jax.tree.leaves(fn(jax.tree.unflatten(p_def, local), *rnd_x))
      nxt = tuple(lax.ppermute(y, axis, perm) for y in out) if perm else tuple(out)
      return (nxt, buffer), tuple(out)

    init = tuple(jnp.zeros_like(u) for u in first)
    buffer = () if r == 1 else tuple(jnp.zeros((period, *u.shape), u.dtype) for u in first)
    init, buffer = _sharding.vary((init, buffer), varying)
    _, ys = lax.scan(tick, (init, buffer), jnp.arange(ticks, dtype=jnp.int32))
    # The last stage's outputs for micro-batches 0..M-1 in the last round.
    done = (r - 1) * period + s - 1
    last = stage == s - 1
    return tuple(lax.psum(jnp.where(last, y[done:done + m], jnp.zeros_like(y[done:done + m])),
                          axis) for y in ys)

  return body


def _recompute_in_backward(mapped, body, mesh, axis: str, p_spec: PartitionSpec,
                           num_params: int, num_x: int):
  """``mapped`` with a backward pass that differentiates the scan inside one shard_map.

  Used when the pipeline is nested in another ``shard_map`` (such as
  ``jaxaccum.value_and_grad(..., data_axis=...)``). Differentiating through the nested
  ``shard_map`` would pass the scan's residuals out of it with a spec over both the outer
  (already manual) axes and the stage axis, which jax 0.10 cannot lower ("manual axes
  come before free axes"). Here no residual leaves the ``shard_map``: the backward pass
  runs the forward scan again and differentiates it where it runs, which costs one more
  forward pass of the pipeline.
  """
  p_specs = tuple(p_spec for _ in range(num_params))
  x_specs = tuple(PartitionSpec() for _ in range(num_x))

  def backward_body(p_leaves, micro, g):
    return jax.vjp(body, p_leaves, micro)[1](g)

  backward = jax.shard_map(backward_body, mesh=mesh, axis_names=frozenset({axis}),
                           in_specs=(p_specs, x_specs, x_specs), out_specs=(p_specs, x_specs))

  @jax.custom_vjp
  def run(p_leaves, micro):
    return mapped(p_leaves, micro)

  def run_fwd(p_leaves, micro):
    return mapped(p_leaves, micro), (p_leaves, micro)

  def run_bwd(res, g):
    p_leaves, micro = res
    return backward(p_leaves, micro, g)

  run.defvjp(run_fwd, run_bwd)
  return run


# --- Helpers ------------------------------------------------------------------------------


def _check_stage_params(stage_params: PyTree, s: int, r: int, axis: str) -> None:
  want = (s,) if r == 1 else (r, s)
  what = (f"a leading axis of size {s}, one slice per stage" if r == 1 else
          f"leading axes (num_repeats, stages) = {want}, entry [r, s] for chunk r * {s} + s")
  leaves = jax.tree_util.tree_leaves_with_path(stage_params)
  if not leaves:
    raise ValueError("stage_params has no array leaves; pass the stacked stage parameters.")
  for path, leaf in leaves:
    shape = getattr(leaf, "shape", None)
    if shape is None:
      raise TypeError(
          f"stage_params{jax.tree_util.keystr(path)} is {type(leaf).__name__} {leaf!r}, not "
          f"an array: every leaf needs {what}.")
    if tuple(shape[:len(want)]) != want:
      raise ValueError(
          f"stage_params{jax.tree_util.keystr(path)} has shape {tuple(shape)}, but the "
          f"stage axis {axis!r} has size {s}"
          + (f" and num_repeats={r}" if r > 1 else "") + f": every leaf needs {what} "
          "(stack the stages' parameters, e.g. with jax.tree.map(lambda *a: jnp.stack(a), "
          "*per_stage)). With several layers per stage, add a layers axis after it and "
          "scan over it inside stage_fn.")


def _check_batch(x: PyTree, m: int) -> None:
  """The core's checks: array leaves sharing a leading axis that ``m`` divides."""
  if not jax.tree.leaves(x):
    raise ValueError("x has no array leaves; pass the activations entering stage 0.")
  _split.resolve_count(_split.batch_size({"x": x}), m, None)


def _check_stage_output(stage_fn, params, first) -> None:
  out = jax.eval_shape(stage_fn, params, first)
  want = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), first)
  got_def, want_def = jax.tree.structure(out), jax.tree.structure(want)

  def show(tree):
    return jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree)

  if got_def != want_def or any(
      (a.shape, a.dtype) != (b.shape, b.dtype)
      for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True)):
    raise ValueError(
        f"stage_fn must return a value shaped like its input (a stage boundary), but on a "
        f"micro-batch {show(want)} it returns {show(out)}. Move layers that change the "
        "shape (embedding, head) outside the pipeline, or pad the boundary activations.")


def _retype(x: Any, mesh: Any, axis: str, *, lead: int | None) -> Any:
  """Under an ``Explicit`` stage axis, types ``x`` as ``shard_map`` will map it.

  Stage parameters get dimension ``lead`` sharded over the stage axis (and nothing else
  over it); micro-batches (``lead=None``) are made replicated over it. Other mesh axes keep their
  sharding. Under ``Auto`` axes the compiler moves data as needed and ``x`` is returned.
  """
  if axis not in getattr(mesh, "explicit_axes", ()):
    return x
  sharding = getattr(jax.typeof(x), "sharding", None)
  on_mesh = getattr(getattr(sharding, "mesh", None), "empty", True) is False
  have = sharding.spec if sharding is not None and on_mesh else PartitionSpec()
  entries = list(have) + [None] * (len(x.shape) - len(have))

  def strip(entry):
    names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                  if a is not None and a != axis)
    return None if not names else names[0] if len(names) == 1 else names

  want = [strip(e) for e in entries]
  if lead is not None:
    rest = want[lead]
    want[lead] = axis if rest is None else (axis, *(rest if isinstance(rest, tuple) else (rest,)))
  if want == entries:
    return x
  spec = PartitionSpec(*want)
  target = (jax.sharding.NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh)
            else spec)
  return jax.sharding.reshard(x, target)
