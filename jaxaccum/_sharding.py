"""Sharded accumulation: keep the batch where it lives, reduce gradients once per step.

Two things live here.

1. Helpers that let the core scan run on sharded values: its zero accumulators take the
   sharding (``Explicit`` mesh axes) and the varying manual axes (inside ``shard_map``) of
   the values they accumulate, and a batch whose leading axis is sharded over ``D``
   devices is checked to split into micro-batches of a multiple of ``D`` rows, which is
   what keeps the column-major split free of communication.

2. The data-parallel mode (``data_axis=...``). The whole accumulation runs inside
   :func:`jax.shard_map`, manual over the data axes (mesh axes not named stay under the
   compiler's control). Each device scans over its own rows with its parameters marked
   device-varying, so the backward pass of a micro-batch yields a local, unreduced
   gradient and no cross-device reduction is emitted inside the loop. After the loop the
   accumulators (loss, gradients, denominators, aux) are reduced over the data axes with
   one ``psum``: the number of all-reduces per step does not depend on the number of
   micro-batches. A parameter sharded over some of the data axes (FSDP, read from its
   ``Explicit`` sharding type) is all-gathered inside ``fun``; the transpose of that
   gather reduce-scatters its gradient once per micro-batch into an accumulator of the
   shard's size, and only the remaining data axes are reduced after the loop.

Semantics under ``data_axis`` (``D`` data shards, ``N`` micro-batches, batch ``B``): ``fun``
sees ``B / (N * D)`` rows per call, the rows of global micro-batch ``i`` that live on its
shard (the split is the same column-major one, applied per shard). ``"mean"`` divides the
summed gradients by ``N * D`` (equal-size pieces, so exact); ``"weighted"`` sums numerator
gradients and denominators over all shards and micro-batches before dividing; ``"sum"``
sums. Aux ``"mean"``/``"sum"``/``"max"``/``"min"``/``"all"``/``"any"`` reduce over shards
the same way; ``"stack"`` entries are averaged over shards (summed under ``reduce="sum"``
and for integer leaves; OR-ed for booleans; keys are shard 0's): stacked scalars, such as a
per-micro-batch loss, come out right, while stacked per-row arrays keep one shard's
micro-batch shape and are combined element-wise, not gathered. Under ``reduce="weighted"``
stacked entries are averaged over shards without weights. Mutable state is threaded per
shard; at the end its floating leaves are averaged over shards, integer leaves (counters)
take the maximum and PRNG keys are shard 0's. A PRNG key argument (``rng_argnums``) is
folded with the shard index and then the micro-batch index; keys carried in the state (e.g.
``nnx.Rngs``) are not, so every shard draws the same masks for its own rows: pass keys
through ``rng_argnums`` when shards must draw independently.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax import lax
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec
from jaxlib.mlir.dialects import sdy

from jaxaccum import _reduce, _split
from jaxaccum._types import AxisName, PyTree

# --- "Shard like": a sharding propagation hint for Auto mesh axes -------------------------
#
# jax.experimental.shard_alike (jax <= 0.10) is gone in later releases; this primitive does
# what it did on every supported jax, with the public extension API: it lowers to one Shardy
# sharding group per pair, which makes the partitioner give both values the same sharding.
# It changes no value; under the GSPMD partitioner (Shardy off) it is only the identity.

_tie_p = jax.extend.core.Primitive("jaxaccum_shard_like")
_tie_p.multiple_results = True
_tie_p.def_impl(lambda x, y: (x, y))
_tie_p.def_abstract_eval(lambda x, y: (x, y))
_tie_groups = itertools.count()


def _tie_lowering(ctx, x, y):
  if jax.config.values.get("jax_use_shardy_partitioner", True):
    group = next(_tie_groups)
    sdy.sharding_group(x, group)
    sdy.sharding_group(y, group)
  return x, y


def _tie_batched(args, dims):
  x, y = args
  if dims[0] == dims[1]:
    return _tie_p.bind(x, y), dims
  return (x, y), dims  # a hint only: drop it rather than move an axis


mlir.register_lowering(_tie_p, _tie_lowering)
ad.deflinear(_tie_p, lambda cts: list(cts))
batching.primitive_batchers[_tie_p] = _tie_batched


def shard_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x``, with a hint that the partitioner should shard it like ``like`` (same shape)."""
  return _tie_p.bind(x, like)[0]



# --- Helpers the core scan uses -----------------------------------------------------------


def _varying(x: Any) -> frozenset:
  """The manual mesh axes along which ``x`` (a value or a ShapeDtypeStruct) varies."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))  # older jax spelling


def _explicit_spec(x: Any) -> PartitionSpec | None:
  """The PartitionSpec of ``x`` if it is sharded over ``Explicit`` mesh axes, else None."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or getattr(mesh, "empty", True) or not mesh.explicit_axes:
    return None
  spec = sharding.spec
  used = {a for entry in spec if entry is not None
          for a in (entry if isinstance(entry, tuple) else (entry,))}
  return spec if used & set(mesh.explicit_axes) else None


def conform(x: jax.Array, like: Any) -> jax.Array:
  """Gives ``x`` the explicit sharding and the varying manual axes of ``like``.

  The scan's carry must keep one type across iterations. Zeros made with ``jnp.zeros``
  are replicated and device-invariant; the gradients added to them may be sharded over
  ``Explicit`` mesh axes (FSDP parameters) or vary over ``shard_map`` axes.
  """
  spec = _explicit_spec(like)
  if spec is not None and _explicit_spec(x) != spec:
    x = jax.sharding.reshard(x, like.sharding if isinstance(like, jax.ShapeDtypeStruct)
                             else jax.typeof(like).sharding)
  missing = tuple(sorted(_varying(like) - _varying(x), key=str))
  if missing:
    x = lax.pcast(x, missing, to="varying")
  return x


def align(acc: PyTree, params: PyTree) -> PyTree:
  """Ties each accumulator leaf's sharding to its parameter's, for ``Auto`` mesh axes.

  Under ``jax.jit`` with ``Auto`` axes a tracer carries no sharding, so the compiler picks
  the accumulator's layout; left alone it may keep a replicated full-size accumulator for
  FSDP-sharded parameters and all-reduce every micro-batch's gradients into it. Marking
  the accumulator "sharded like its parameter" (:func:`shard_like`) keeps it sharded and
  lets the compiler reduce-scatter each micro-batch's gradients instead. Explicit axes
  need nothing: the types already carry the parameters' shardings.
  """
  if jax.sharding.get_abstract_mesh().manual_axes:
    return acc

  def one(a, p):
    if not _is_array(p) or _explicit_spec(p) is not None or a.shape != p.shape:
      return a
    return shard_like(a, p)

  return jax.tree.map(one, acc, params)


def check_split_sharding(batches: dict[Any, PyTree], n: int) -> None:
  """Raises if a batch sharded over Explicit axes cannot be split without moving data.

  Micro-batch ``i`` takes rows ``i, i + N, ...``; with the batch axis in ``D`` contiguous
  blocks, every device keeps its own rows only when ``D`` divides ``B // N``. (For
  ``Auto`` mesh axes the sharding is unknown at trace time; see the README.)
  """
  for argnum, tree in batches.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      spec = _explicit_spec(leaf)
      if spec is None or not len(spec) or spec[0] is None:
        continue
      axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
      mesh = jax.typeof(leaf).sharding.mesh
      shards = math.prod(mesh.shape[a] for a in axes)
      rows = leaf.shape[0] // n
      if rows % shards:
        where = f"{argnum}{jax.tree_util.keystr(path)}"
        raise ValueError(
            f"batch leaf {where} has its batch axis of {leaf.shape[0]} rows sharded over "
            f"{_axes_str(axes, mesh)} ({shards} shards), but {n} micro-batches give "
            f"micro-batches of {rows} rows, not a multiple of {shards}: the split would "
            f"have to move rows between devices. Use a micro-batch count that divides "
            f"{leaf.shape[0] // shards} (batch / shards), e.g. one of "
            f"{_split.divisors(leaf.shape[0] // shards)}."
        )


# --- Options ------------------------------------------------------------------------------


def check_data_axis(data_axis: Any) -> tuple[str, ...] | None:
  """Normalizes ``data_axis`` (a mesh axis name or a tuple of them) to a tuple."""
  if data_axis is None:
    return None
  axes = tuple(data_axis) if isinstance(data_axis, (tuple, list)) else (data_axis,)
  if not axes or any(not isinstance(a, str) for a in axes):
    raise TypeError(
        "data_axis must be a mesh axis name or a tuple of them, e.g. data_axis='data' or "
        f"data_axis=('replica', 'data'), got data_axis={data_axis!r}."
    )
  if len(set(axes)) != len(axes):
    raise ValueError(f"data_axis names a mesh axis twice: data_axis={data_axis!r}.")
  return axes


def check_mesh(mesh: Any, data_axis: tuple[AxisName, ...] | None) -> Any:
  """Validates the ``mesh`` option (a Mesh, an AbstractMesh or None)."""
  if mesh is None:
    return None
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh (e.g. from jax.make_mesh) or None, got {mesh!r}.")
  if data_axis is None:
    raise ValueError(
        "mesh=... was given without data_axis: the mesh is only used by the data-parallel "
        "mode. Pass data_axis='<your data axis>' too, or drop mesh (sharded inputs under "
        "jax.jit need no option).")
  _check_axes_in(data_axis, mesh)
  return mesh


def _axes_str(axes: Sequence[AxisName], mesh: Any) -> str:
  return " x ".join(f"{a!r} (size {mesh.shape[a]})" for a in axes)


def _check_axes_in(axes: tuple[AxisName, ...], mesh: Any) -> None:
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    sizes = ", ".join(f"{a!r}: {s}" for a, s in mesh.shape.items())
    raise ValueError(
        f"data_axis={axes[0] if len(axes) == 1 else axes!r} names mesh axis "
        f"{', '.join(map(repr, missing))}, which is not in the mesh; its axes are {{{sizes}}}. "
        "Pass the name of the axis the batch is sharded over."
    )


def _resolve_mesh(mesh: Any, axes: tuple[AxisName, ...]) -> Any:
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError(
          f"data_axis={axes[0] if len(axes) == 1 else axes!r} needs a mesh: pass mesh=... "
          "to jaxaccum.value_and_grad, or call the step inside `with jax.set_mesh(mesh):`."
      )
  _check_axes_in(axes, mesh)
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
  if manual & set(axes):
    raise ValueError(
        f"data_axis axes {sorted(manual & set(axes))} are already manual here (this is "
        "inside a shard_map over them), so jaxaccum cannot map over them again. Call the "
        "transform outside your shard_map, or drop data_axis and do what it does: mark the "
        f"differentiated arguments device-varying first, params = jax.lax.pcast(params, "
        f"{tuple(sorted(manual & set(axes)))}, to='varying') (otherwise JAX sums their "
        "gradients over the devices inside every micro-batch), so that each device "
        "accumulates the gradients of its own rows; the full-batch result is then the pmean "
        "(not the psum) of the loss and gradients over these axes for reduce='mean', their "
        "psum for reduce='sum', and for reduce='weighted' each device's loss and gradients "
        "weighed by its own total denominator d: psum(x * d) / psum(d).")
  return mesh


# --- The data-parallel mode ---------------------------------------------------------------


def _vary(tree: PyTree, axes: tuple[AxisName, ...]) -> PyTree:
  def one(x):
    missing = tuple(a for a in axes if a not in _varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(one, tree)


def _entry_axes(entry: Any) -> tuple[AxisName, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _manual_part(spec: PartitionSpec | None, axes: tuple[AxisName, ...]):
  """Splits a leaf's spec into its part over the data axes and the gathers that undo it.

  Returns ``(in_spec, gathers)``: the spec restricted to ``axes`` (what ``shard_map``
  maps) and ``((dim, axes_of_dim), ...)`` for the dimensions sharded over data axes.
  """
  if spec is None:
    return PartitionSpec(), ()
  entries, gathers = [], []
  for dim, entry in enumerate(spec):
    mine = tuple(a for a in _entry_axes(entry) if a in axes)
    entries.append(None if not mine else mine[0] if len(mine) == 1 else mine)
    if mine:
      gathers.append((dim, mine))
  return PartitionSpec(*entries), tuple(gathers)


def _gather(x: jax.Array, gathers: tuple) -> jax.Array:
  for dim, names in gathers:
    x = lax.all_gather(x, names if len(names) > 1 else names[0], axis=dim, tiled=True)
  return x


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def combine(carry: Any, stacked: PyTree, kinds: PyTree, *, axes: tuple[AxisName, ...],
            grad_axes: tuple, shards: int, reduce_is_sum: bool):
  """Step 2 of the core: reduces the scan's carry over the data axes, once, after the loop.

  ``grad_axes`` gives, per gradient leaf, the data axes it still has to be summed over:
  all of them for a replicated parameter; those it is not sharded over for an FSDP
  parameter, whose gradient the backward pass already reduce-scattered.
  """
  num = tuple(lax.psum(c, axes) for c in carry.num)
  den = tuple(None if c is None else lax.psum(c, axes) for c in carry.den)
  grads = []
  for acc in carry.grads:
    flat, treedef = jax.tree.flatten(acc)
    grads.append(jax.tree.unflatten(treedef, [
        lax.psum(g, ax) if ax else g for g, ax in zip(flat, grad_axes, strict=True)]))
  def leaf(k, c):
    return c if c is None else _reduce.AUX_REDUCTIONS[k].combine(c, axes, reduce_is_sum)

  aux = jax.tree.map(leaf, kinds, carry.aux)
  stacked = jax.tree.map(leaf, kinds, stacked)
  state = jax.tree.map(lambda s: _reduce.combine_state(s, axes), carry.state)
  stats = lax.psum(carry.stats, axes)
  carry = carry._replace(num=num, den=den, grads=tuple(grads), aux=aux, state=state,
                         stats=stats)
  return carry, stacked, shards


def _local_spec(have: PartitionSpec | None, axes: tuple[AxisName, ...], where: str,
                batch: bool, replicated_only: str | None):
  """in_spec and gathers of one array argument leaf."""
  if batch:
    lead = _entry_axes(have[0]) if have is not None and len(have) else ()
    if set(lead) - set(axes):
      raise ValueError(
          f"batch leaf {where} is sharded over {lead} (spec {have}), but data_axis={axes} "
          f"leaves out {tuple(a for a in lead if a not in axes)}. Name every mesh axis the "
          f"batch is sharded over: data_axis={lead}; parameters may stay sharded over any "
          "of them (FSDP).")
    return PartitionSpec(axes), (), lead
  spec, gather = _manual_part(have, axes)
  if gather and replicated_only:
    raise ValueError(
        f"{where} is a {replicated_only} sharded over data axis "
        f"{sorted({a for _, g in gather for a in g})} (spec {have}); under data_axis, "
        f"{replicated_only}s must be replicated over the data axes. Reshard it with "
        "jax.sharding.reshard(x, P()) first.")
  return spec, gather, None


def data_parallel(opts: Any, args: tuple, kwargs: dict, active: Any):
  """Runs the core's steps per data shard inside ``shard_map``; one reduction after the loop.

  Batch arguments (positional and keyword) are mapped over ``data_axis`` along their
  leading axis. Other array arguments are mapped with their own sharding over the data
  axes (replicated, for plain data parallelism); a differentiated argument sharded over a
  data axis (FSDP / ZeRO-3) is all-gathered inside ``fun``, so its gradient comes back
  reduce-scattered, one reduce-scatter per micro-batch, into an accumulator of the
  shard's size. Non-batch keyword arrays sharded over a data axis are all-gathered too.
  The sharding of a non-batch argument is read from its type, so FSDP needs ``Explicit``
  mesh axes; with ``Auto`` axes every non-batch argument is treated as replicated. Arrays
  that ``fun`` closes over are replicated when typed with ``Auto`` axes; ``shard_map``
  cannot close over arrays typed with ``Explicit`` axes, so those raise an error that says
  to pass them as arguments.

  Returns:
    ``(value, extra, grads, info)`` as the core's ``finalize`` returns them, reduced over
    the data axes.
  """
  from jaxaccum import _transform  # noqa: PLC0415 (the core imports this module)

  axes = opts.data_axis
  mesh = _resolve_mesh(opts.mesh, axes)
  roles = opts.roles(len(args), kwargs)
  shards = math.prod(mesh.shape[a] for a in axes)
  where = _axes_str(axes, mesh)
  batches: dict[Any, PyTree] = {opts.label(j): args[j] for j in roles.batch}
  batches.update({f"keyword argument {k!r}": kwargs[k] for k in roles.batch_names})
  size = _split.batch_size(batches)
  n = _split.resolve_count(size, opts.count, opts.size, shards=shards, where=where)
  explicit_data = bool(set(getattr(mesh, "explicit_axes", ())) & set(axes))
  all_manual = set(axes) == set(mesh.axis_names)

  # Every argument, positional (by index) or keyword (by name), flattened: only array
  # leaves cross the shard_map boundary; anything else is closed over.
  named = [(j, args[j]) for j in range(len(args))] + sorted(kwargs.items())
  flat = [jax.tree.flatten(v) for _, v in named]
  arrays, in_specs = [], []
  gathers: dict[Any, list] = {}
  for (key, value), _ in zip(named, flat, strict=True):
    gathers[key] = []
    is_batch = key in roles.batch or key in roles.batch_names
    label = opts.label(key) if isinstance(key, int) else f"keyword argument {key!r}"
    kind = ("state argument" if key in roles.state else
            "PRNG key argument" if key in roles.rng else None) if isinstance(key, int) else None
    for path, x in jax.tree_util.tree_leaves_with_path(value):
      if not _is_array(x):
        gathers[key].append(())
        continue
      have = _explicit_spec(x)
      spec, gather, lead = _local_spec(have, axes, f"{label}{jax.tree_util.keystr(path)}",
                                       is_batch, kind)
      if is_batch and explicit_data and all_manual and lead != axes:
        # A fully manual, Explicit shard_map needs its input typed as it maps it.
        full = PartitionSpec(axes, *(tuple(have[1:]) if have is not None else ()))
        x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, full)
                                 if isinstance(mesh, jax.sharding.Mesh) else full)
      arrays.append(x)
      in_specs.append(spec)
      gathers[key].append(gather)

  # The gradient of leaf k of a differentiated argument is summed over the data axes it
  # is not sharded over, and comes back with the argument's own spec over the data axes.
  grad_axes, grad_specs = [], []
  for j in roles.diff:
    specs = []
    for gather in gathers[j]:
      sharded = {a for _, g in gather for a in g}
      grad_axes.append(tuple(a for a in axes if a not in sharded))
      spec = [None] * (max((d for d, _ in gather), default=-1) + 1)
      for d, g in gather:
        spec[d] = g[0] if len(g) == 1 else g
      specs.append(PartitionSpec(*spec))
    grad_specs.append(jax.tree.unflatten(flat[j][1], specs))
  if opts.with_info and any(len(a) != len(axes) for a in grad_axes):
    raise ValueError(
        "with_info=True under data_axis needs parameters replicated over the data axes: a "
        "parameter sharded over a data axis (FSDP) has its micro-batch gradients "
        "reduce-scattered across shards inside the loop, so no shard holds a sample of its "
        "own. Drop with_info, or keep the parameters replicated over data_axis.")

  to_gather = {k: g for k, g in gathers.items()
               if k not in roles.batch and k not in roles.batch_names and any(g)}
  # A traced count enters as a replicated input: shard_map cannot close over a tracer
  # typed with Explicit mesh axes.
  act = None if active is None else _transform.check_active(active, n)
  if act is not None:
    arrays.append(act)
    in_specs.append(PartitionSpec())
  meta: dict[str, Any] = {}

  def make_local(fun):
    def fun_local(*call_args, **call_kwargs):
      # Inside the differentiated function: the all-gather's transpose reduce-scatters.
      call_args = list(call_args)

      def gathered(value, gs):
        leaves, treedef = jax.tree.flatten(value)
        return jax.tree.unflatten(treedef, [
            _gather(x, g) if g else x for x, g in zip(leaves, gs, strict=True)])

      for k, gs in to_gather.items():
        if isinstance(k, int):
          call_args[k] = gathered(call_args[k], gs)
        else:
          call_kwargs[k] = gathered(call_kwargs[k], gs)
      return fun(*call_args, **call_kwargs)

    local_opts = dataclasses.replace(opts, fun=fun_local if to_gather else fun, count=n,
                                     size=None, data_axis=None, mesh=None)

    def local(*local_arrays):
      if act is not None:
        *local_arrays, local_act = local_arrays
      else:
        local_act = None
      it = iter(local_arrays)
      values = []
      for (leaves, treedef) in flat:
        values.append(jax.tree.unflatten(
            treedef, [next(it) if _is_array(x) else x for x in leaves]))
      largs = values[:len(args)]
      lkwargs = {k: v for (k, _), v in zip(named[len(args):], values[len(args):], strict=True)}
      for j in (*roles.diff, *roles.state):
        largs[j] = _vary(largs[j], axes)
      shard = lax.axis_index(axes)
      for j in roles.rng:
        largs[j] = jax.tree.map(lambda k: jax.random.fold_in(k, shard), _vary(largs[j], axes))
      problem = _transform.prepare(local_opts, tuple(largs), lkwargs, n)
      carry, stacked, shapes, kinds = _transform.scan(local_opts, problem, local_act, shards)
      carry, stacked, _ = combine(carry, stacked, kinds, axes=axes,
                                  grad_axes=tuple(grad_axes), shards=shards,
                                  reduce_is_sum=opts.single_term and opts.reduce == "sum")
      static = None if (opts.skip_nonfinite or local_act is not None) else n * shards
      value, extra, grads, info = _transform.finalize(
          local_opts, problem, carry, stacked, shapes, kinds, kept_static=static)
      # Concatenated aux rows stay on their shard: the output spec gathers them in order.
      rows_mask = jax.tree.map(lambda k: _reduce.AUX_REDUCTIONS[k].per_example, kinds)
      if problem.state0:
        no_rows = jax.tree.map(lambda _: False, extra[0] if opts.has_aux else extra)
        mask = (no_rows, rows_mask) if opts.has_aux else no_rows
      else:
        mask = rows_mask
      leaves, treedef = jax.tree.flatten(extra)
      mflat = jax.tree.leaves(mask)
      meta["treedef"], meta["mask"] = treedef, mflat
      kept = [x for x, m in zip(leaves, mflat, strict=True) if not m]
      rows = [x for x, m in zip(leaves, mflat, strict=True) if m]
      return value, kept, rows, grads, info

    return local

  def run(local):
    out_specs = (PartitionSpec(), PartitionSpec(), PartitionSpec(axes), tuple(grad_specs),
                 PartitionSpec())
    mapped = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                           axis_names=frozenset(axes))
    return mapped(*arrays)

  try:
    value, kept, rows, grads, info = run(make_local(opts.fun))
  except NotImplementedError as e:
    if "Closing over inputs to shard_map" not in str(e):
      raise
    got = str(e).split("Got input with shape")[-1].strip()
    raise ValueError(
        f"fun closes over an array typed with Explicit mesh axes ({got}): an array placed "
        "on the mesh, or an argument of the enclosing jax.jit. Under data_axis fun runs "
        "inside jax.shard_map, which cannot close over such arrays. Pass it to the "
        "accumulated function as an argument instead: a non-batch positional or keyword "
        "argument is replicated over the data axes (e.g. def loss(params, batch, *, table) "
        "called as step(params, batch, table=table)); or build it inside fun.") from None
  it_kept, it_rows = iter(kept), iter(rows)
  extra = jax.tree.unflatten(meta["treedef"], [
      next(it_rows) if m else next(it_kept) for m in meta["mask"]])
  # Auto axes: the gradients leave the shard_map replicated over the data axes; tie
  # them to their parameters' shardings (a local slice if those are sharded).
  grads = align(grads, tuple(args[j] for j in roles.diff))
  return value, extra, grads, info
