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

Semantics under ``data_axis`` (``D`` data shards, ``N`` micro-batches, batch ``B``):
``fun`` sees ``B / (N * D)`` rows per call, the rows of global micro-batch ``i`` that live
on its shard (the split is the same column-major one, applied per shard). ``"mean"``
divides the summed gradients by ``N * D`` (equal-size pieces, so exact); ``"weighted"``
sums numerator gradients and denominators over all shards and micro-batches before
dividing; ``"sum"`` sums. Aux ``"mean"``/``"sum"``/``"max"``/``"min"`` reduce over shards
the same way; ``"stack"`` entries are averaged over shards (summed under ``reduce="sum"``
and for integer leaves; OR-ed for booleans; keys are shard 0's): stacked scalars, such as a
per-micro-batch loss, come out right, while stacked per-row arrays keep one shard's
micro-batch shape and are combined element-wise, not gathered. Under ``reduce="weighted"``
stacked entries are averaged over shards without weights. Mutable state is threaded per
shard; at the end its floating leaves are averaged over shards, integer leaves (counters)
take the maximum and PRNG keys are shard 0's. A PRNG key argument (``rng_argnums``) is
folded with the shard index and then the micro-batch index; keys carried in the state
(e.g. ``nnx.Rngs``) are not, so every shard draws the same masks for its own rows: pass
keys through ``rng_argnums`` when shards must draw independently.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum import _split

try:  # Sharding propagation hint for Auto mesh axes; optional.
  from jax.experimental.shard_alike import shard_alike as _shard_alike
except ImportError:  # pragma: no cover
  _shard_alike = None

PyTree = Any
AxisName = Any


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
  if mesh is None or getattr(mesh, "empty", True) or not mesh.explicit_axes:
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
  the accumulator "sharded like its parameter" (``shard_alike``) keeps it sharded and
  lets the compiler reduce-scatter each micro-batch's gradients instead. Explicit axes
  need nothing: the types already carry the parameters' shardings.
  """
  if _shard_alike is None or jax.sharding.get_abstract_mesh().manual_axes:
    return acc

  def one(a, p):
    if not _is_array(p) or _explicit_spec(p) is not None or a.shape != p.shape:
      return a
    return _shard_alike(a, p)[0]

  return jax.tree.map(one, acc, params)


def check_split_sharding(batches: dict[int, PyTree], n: int) -> None:
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
        where = f"argument {argnum}{jax.tree_util.keystr(path)}"
        raise ValueError(
            f"batch leaf {where} has its batch axis of {leaf.shape[0]} rows sharded over "
            f"{_axes_str(axes, mesh)} ({shards} shards), but {n} micro-batches give "
            f"micro-batches of {rows} rows, not a multiple of {shards}: the split would "
            f"have to move rows between devices. Use a micro-batch count that divides "
            f"{leaf.shape[0] // shards} (batch / shards), e.g. one of "
            f"{_split.divisors(leaf.shape[0] // shards)}."
        )


# --- Options ------------------------------------------------------------------------------


def check_data_axis(data_axis: Any) -> tuple[AxisName, ...] | None:
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
        f"data_axis={axes if len(axes) > 1 else axes[0]!r} names mesh axis "
        f"{', '.join(map(repr, missing))}, which is not in the mesh; its axes are {{{sizes}}}. "
        "Pass the name of the axis the batch is sharded over."
    )


def _resolve_mesh(mesh: Any, axes: tuple[AxisName, ...]) -> Any:
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError(
          f"data_axis={axes if len(axes) > 1 else axes[0]!r} needs a mesh: pass mesh=... "
          "to jaxaccum.value_and_grad, or call the step inside `with jax.set_mesh(mesh):`."
      )
  _check_axes_in(axes, mesh)
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
  if manual & set(axes):
    raise ValueError(
        f"data_axis axes {sorted(manual & set(axes))} are already manual here (this is "
        "inside a shard_map over them), so jaxaccum cannot map over them again. Call the "
        "transform outside your shard_map, or drop data_axis and psum the result yourself."
    )
  return mesh


def resolve_count(size: int, shards: int, axes: tuple[AxisName, ...], mesh: Any,
                  count: int | None, micro: int | None) -> int:
  """The micro-batch count for a global batch of ``size`` rows over ``shards`` devices."""
  where = _axes_str(axes, mesh)
  if size % shards:
    raise ValueError(
        f"batch size {size} is not divisible by the data-axis size {shards} "
        f"(data_axis over {where}): every data shard needs the same number of rows. Use a "
        f"batch size that is a multiple of {shards}."
    )
  local = size // shards
  if count is not None:
    if size // count < shards and size % count == 0:
      raise ValueError(
          f"num_micro_batches={count} makes micro-batches of {size} / {count} = "
          f"{size // count} rows, smaller than the {shards} data shards (data_axis over "
          f"{where}). Use at most {local} micro-batches: valid counts are the divisors of "
          f"{local} (batch {size} / {shards} shards): {_split.divisors(local)}."
      )
    if local % count:
      raise ValueError(
          f"batch size {size} is not divisible by the data-axis size {shards} x "
          f"num_micro_batches={count} = {shards * count} (data_axis over {where}). Valid "
          f"counts are the divisors of {local} (batch {size} / {shards} shards): "
          f"{_split.divisors(local)}."
      )
    return count
  assert micro is not None  # guaranteed by the transform's constructor
  if micro < shards:
    raise ValueError(
        f"micro_batch_size={micro} is smaller than the {shards} data shards (data_axis "
        f"over {where}): each shard needs at least one row of every micro-batch. Use a "
        f"micro_batch_size that is a multiple of {shards} and divides {size}."
    )
  if micro % shards or size % micro:
    valid = [shards * d for d in _split.divisors(local)]
    raise ValueError(
        f"micro_batch_size={micro} does not split batch size {size} evenly over the "
        f"{shards} data shards (data_axis over {where}): it must divide {size} and be a "
        f"multiple of {shards}. Valid sizes: {valid}."
    )
  return size // micro


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


def _from_first_shard(x: jax.Array, axes: tuple[AxisName, ...]) -> jax.Array:
  """Shard 0's value of ``x`` on every shard (for keys, which cannot be averaged)."""
  is_key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  data = jax.random.key_data(x) if is_key else x
  data = lax.psum(jnp.where(lax.axis_index(axes) == 0, data, jnp.zeros_like(data)), axes)
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x)) if is_key else data


def _combine(carry, stacked, kinds, n, *, axes, grad_axes, shards, reduce):
  """Reduces the scan's accumulators over the data axes, once, after the loop.

  ``grad_axes`` gives, per gradient leaf, the data axes it still has to be summed over:
  all of them for a replicated parameter; those it is not sharded over for an FSDP
  parameter, whose gradient the backward pass already reduce-scattered.
  """
  num, den, grads, aux, state = carry
  num = lax.psum(num, axes)
  den = None if den is None else lax.psum(den, axes)
  flat, treedef = jax.tree.flatten(grads)
  grads = jax.tree.unflatten(treedef, [
      lax.psum(g, ax) if ax else g for g, ax in zip(flat, grad_axes, strict=True)])

  def aux_leaf(kind, c):
    if kind == "max":
      return lax.pmax(c, axes)
    if kind == "min":
      return lax.pmin(c, axes)
    if kind in ("mean", "sum"):
      return lax.psum(c, axes)
    return c  # "stack": no carry

  def stack_leaf(kind, s):
    if kind != "stack":
      return s
    if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
      return _from_first_shard(s, axes)
    if s.dtype == jnp.bool_:
      return lax.pmax(s.astype(jnp.int32), axes).astype(jnp.bool_)
    if reduce == "sum" or not jnp.issubdtype(s.dtype, jnp.inexact):
      return lax.psum(s, axes)
    return lax.pmean(s, axes)

  def state_leaf(s):
    if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
      return _from_first_shard(s, axes)
    if jnp.issubdtype(s.dtype, jnp.inexact):
      return lax.pmean(s, axes)
    if s.dtype == jnp.bool_:
      return lax.pmax(s.astype(jnp.int32), axes).astype(jnp.bool_)
    return lax.pmax(s, axes)

  aux = jax.tree.map(aux_leaf, kinds, aux)
  stacked = jax.tree.map(stack_leaf, kinds, stacked)
  state = jax.tree.map(state_leaf, state)
  return (num, den, grads, aux, state), stacked, n * shards


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def data_parallel(opts: Any, accumulate: Callable[..., Any], args: tuple, kwargs: dict):
  """Runs ``accumulate`` per data shard inside ``shard_map``; one reduction after the loop.

  Batch arguments are mapped over ``data_axis`` along their leading axis. Other array
  arguments are mapped with their own sharding over the data axes (replicated, for plain
  data parallelism); a differentiated argument sharded over a data axis (FSDP / ZeRO-3)
  is all-gathered inside ``fun``, so its gradient comes back reduce-scattered, one
  reduce-scatter per micro-batch, into an accumulator of the shard's size. The sharding
  of a non-batch argument is read from its type, so FSDP needs ``Explicit`` mesh axes;
  with ``Auto`` axes every non-batch argument is treated as replicated over the data axes.

  Args:
    opts: the transform's options (``_transform._Options``), with ``data_axis`` set.
    accumulate: the core's ``_accumulate(opts, args, kwargs, combine=...)``.
    args: the positional arguments of the transformed function (global arrays).
    kwargs: its keyword arguments (passed unchanged to every shard).

  Returns:
    ``(value, extra, grads)`` as ``accumulate`` returns them, reduced over the data axes.
  """
  axes = opts.data_axis
  mesh = _resolve_mesh(opts.mesh, axes)
  roles = opts.roles(len(args))
  argnums, batch_argnums = roles["argnums"], roles["batch_argnums"]
  state_argnums, rng_argnums = roles["state_argnums"], roles["rng_argnums"]
  shards = math.prod(mesh.shape[a] for a in axes)
  size = _split.batch_size({j: args[j] for j in batch_argnums})
  n = resolve_count(size, shards, axes, mesh, opts.count, opts.size)
  explicit_data = bool(set(getattr(mesh, "explicit_axes", ())) & set(axes))
  all_manual = set(axes) == set(mesh.axis_names)

  # Per argument: its leaves, which of them are arrays (only those cross the shard_map
  # boundary; anything else is closed over), their in_specs and the gathers undoing them.
  flat = [jax.tree.flatten(a) for a in args]
  kw_leaves, kw_def = jax.tree.flatten(kwargs)
  arrays, in_specs = [], []
  gathers: dict[int, list] = {}
  for j in range(len(args)):
    gathers[j] = []
    for path, x in jax.tree_util.tree_leaves_with_path(args[j]):
      if not _is_array(x):
        gathers[j].append(())
        continue
      have = _explicit_spec(x)
      if j in batch_argnums:
        spec, gather = PartitionSpec(axes), ()
        lead = _entry_axes(have[0]) if have is not None and len(have) else ()
        if set(lead) - set(axes):
          raise ValueError(
              f"batch leaf argument {j}{jax.tree_util.keystr(path)} is sharded over "
              f"{lead} (spec {have}), but data_axis={axes} leaves out "
              f"{tuple(a for a in lead if a not in axes)}. Name every mesh axis the batch "
              f"is sharded over: data_axis={lead}; parameters may stay sharded over any "
              "of them (FSDP)."
          )
        if explicit_data and all_manual and lead != axes:
          # A fully manual, Explicit shard_map needs its input typed as it maps it.
          spec = PartitionSpec(axes, *(tuple(have[1:]) if have is not None else ()))
          x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec)
                                   if isinstance(mesh, jax.sharding.Mesh) else spec)
          spec = PartitionSpec(axes)
      else:
        spec, gather = _manual_part(have, axes)
        if gather and (j in state_argnums or j in rng_argnums):
          raise ValueError(
              f"argument {j}{jax.tree_util.keystr(path)} is a "
              f"{'state' if j in state_argnums else 'PRNG key'} argument sharded over data "
              f"axis {sorted({a for _, g in gather for a in g})} (spec {have}); under "
              "data_axis, state and keys must be replicated over the data axes. Reshard "
              "it with jax.sharding.reshard(x, P()) first."
          )
      arrays.append(x)
      in_specs.append(spec)
      gathers[j].append(gather)
  kw_arrays = [x for x in kw_leaves if _is_array(x)]
  in_specs.extend(PartitionSpec() for _ in kw_arrays)

  # The gradient of leaf k of a differentiated argument is summed over the data axes it
  # is not sharded over, and comes back with the argument's own spec over the data axes.
  grad_axes, grad_specs = [], []
  for j in argnums:
    specs = []
    for gather in gathers[j]:
      sharded = {a for _, g in gather for a in g}
      grad_axes.append(tuple(a for a in axes if a not in sharded))
      spec = [None] * (max((d for d, _ in gather), default=-1) + 1)
      for d, g in gather:
        spec[d] = g[0] if len(g) == 1 else g
      specs.append(PartitionSpec(*spec))
    grad_specs.append(jax.tree.unflatten(flat[j][1], specs))
  grad_specs = tuple(grad_specs)

  fun = opts.fun
  to_gather = {j: g for j, g in gathers.items() if j not in batch_argnums and any(g)}

  def fun_local(*call_args, **call_kwargs):
    # Inside the differentiated function: the all-gather's transpose reduce-scatters.
    call_args = list(call_args)
    for j, gs in to_gather.items():
      leaves, treedef = jax.tree.flatten(call_args[j])
      call_args[j] = jax.tree.unflatten(treedef, [
          _gather(x, g) if g else x for x, g in zip(leaves, gs, strict=True)])
    return fun(*call_args, **call_kwargs)

  local_opts = copy.copy(opts)
  local_opts.count, local_opts.size = n, None
  local_opts.data_axis = local_opts.mesh = None
  local_opts.fun = fun_local if to_gather else fun
  combine = functools.partial(_combine, axes=axes, grad_axes=tuple(grad_axes),
                              shards=shards, reduce=opts.reduce)

  def local(*local_arrays):
    it = iter(local_arrays)
    largs = []
    for (leaves, treedef) in flat:
      largs.append(jax.tree.unflatten(
          treedef, [next(it) if _is_array(x) else x for x in leaves]))
    lkwargs = jax.tree.unflatten(kw_def, [next(it) if _is_array(x) else x for x in kw_leaves])
    for j in (*argnums, *state_argnums):
      largs[j] = _vary(largs[j], axes)
    shard = lax.axis_index(axes)
    for j in rng_argnums:
      largs[j] = jax.tree.map(lambda k: jax.random.fold_in(k, shard), _vary(largs[j], axes))
    value, extra, grads = accumulate(local_opts, tuple(largs), lkwargs, combine=combine)
    return value, extra, grads

  out_specs = (PartitionSpec(), PartitionSpec(), grad_specs)
  mapped = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         axis_names=frozenset(axes))
  value, extra, grads = mapped(*arrays, *kw_arrays)
  # Auto axes: the gradients leave the shard_map replicated over the data axes; tie
  # them to their parameters' shardings (a local slice if those are sharded).
  grads = align(grads, tuple(args[j] for j in argnums))
  return value, extra, grads
