"""Sharding helpers of the core: keep the batch where it lives.

Its zero accumulators take the sharding (``Explicit`` mesh axes) and the varying manual
axes (inside ``shard_map``) of the values they accumulate (:func:`conform`), accumulators
are tied to their parameters' shardings under ``Auto`` axes (:func:`align`), and a batch
whose leading axis is sharded over ``D`` devices is checked to split into micro-batches of a
multiple of ``D`` rows, which is what keeps the column-major split free of communication.
The ``data_axis`` and ``mesh`` options are validated here; the data-parallel mode that uses
them is :mod:`jaxaccum._parallel._data_parallel`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core
import numpy as np
from jax import lax
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec
from jaxlib.mlir.dialects import sdy

from jaxaccum._core import _split
from jaxaccum._core._types import AxisName, PyTree

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


def varying(x: Any) -> frozenset:
  """The manual mesh axes along which ``x`` (a value or a ShapeDtypeStruct) varies."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))  # older jax spelling


def dim_axes(spec: PartitionSpec | None, dim: int) -> tuple[AxisName, ...]:
  """The mesh axes that dimension ``dim`` of ``spec`` is sharded over (``()`` for none)."""
  entry = spec[dim] if spec is not None and len(spec) > dim else None
  return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def explicit_spec(x: Any) -> PartitionSpec | None:
  """The PartitionSpec of ``x`` if it is sharded over ``Explicit`` mesh axes, else None."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or getattr(mesh, "empty", True) or not mesh.explicit_axes:
    return None
  spec = sharding.spec
  used = {a for dim in range(len(spec)) for a in dim_axes(spec, dim)}
  return spec if used & set(mesh.explicit_axes) else None


def conform(x: jax.Array, like: Any) -> jax.Array:
  """Gives ``x`` the explicit sharding and the varying manual axes of ``like``.

  The scan's carry must keep one type across iterations. Zeros made with ``jnp.zeros``
  are replicated and device-invariant; the gradients added to them may be sharded over
  ``Explicit`` mesh axes (FSDP parameters) or vary over ``shard_map`` axes.
  """
  spec = explicit_spec(like)
  if spec is not None and explicit_spec(x) != spec:
    x = jax.sharding.reshard(x, like.sharding if isinstance(like, jax.ShapeDtypeStruct)
                             else jax.typeof(like).sharding)
  return vary(x, tuple(sorted(varying(like), key=str)))


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
    if not is_array(p) or explicit_spec(p) is not None or a.shape != p.shape:
      return a
    return shard_like(a, p)

  return jax.tree.map(one, acc, params)


def check_split_sharding(batches: dict[Any, PyTree], n: int,
                         batch_axes: dict[Any, PyTree]) -> None:
  """Raises if a batch sharded over Explicit axes cannot be split without moving data.

  Micro-batch ``i`` takes rows ``i, i + N, ...``; with the batch axis in ``D`` contiguous
  blocks, every device keeps its own rows only when ``D`` divides ``B // N``. (For
  ``Auto`` mesh axes the sharding is unknown at trace time; see the README.)
  ``batch_axes`` gives each leaf's batch axis (:func:`jaxaccum._core._split.batch_axes`).
  """
  for argnum, tree in batches.items():
    for (path, leaf), a in zip(jax.tree_util.tree_leaves_with_path(tree),
                               jax.tree.leaves(batch_axes[argnum]), strict=True):
      axes = dim_axes(explicit_spec(leaf), a)
      if not axes:
        continue
      mesh = jax.typeof(leaf).sharding.mesh
      shards = math.prod(mesh.shape[name] for name in axes)
      size = leaf.shape[a]
      rows = size // n
      if rows % shards:
        where = f"{argnum}{jax.tree_util.keystr(path)}"
        raise ValueError(
            f"batch leaf {where} has its batch axis{f' (axis {a})' if a else ''} of {size} "
            f"rows sharded over {axes_str(axes, mesh)} ({shards} shards), but {n} "
            f"micro-batches give micro-batches of {rows} rows, not a multiple of "
            f"{shards}: the split would have to move rows between devices. Use a "
            f"micro-batch count that divides {size // shards} (batch / shards), e.g. one "
            f"of {_split.divisors(size // shards)}.")


# --- Options ------------------------------------------------------------------------------


AUTO = "auto"  # data_axis="auto": the axes the batch's leading axis is sharded over


def check_data_axis_option(data_axis: Any) -> tuple[str, ...] | str | None:
  """The ``data_axis`` option: :func:`check_data_axis`, or ``"auto"`` (:data:`AUTO`) as it
  is, whose axes are read from the batch at trace time (:func:`batch_data_axes`)."""
  return AUTO if data_axis == AUTO else check_data_axis(data_axis)


def check_data_axis(data_axis: Any) -> tuple[str, ...] | None:
  """Normalizes ``data_axis`` (a mesh axis name or a tuple of them) to a tuple."""
  if data_axis is None:
    return None
  axes = tuple(data_axis) if isinstance(data_axis, (tuple, list)) else (data_axis,)
  if not axes or any(not isinstance(a, str) for a in axes):
    raise TypeError(
        "data_axis must be a mesh axis name or a tuple of them, e.g. data_axis='data' or "
        f"data_axis=('replica', 'data'), got data_axis={data_axis!r}.")
  if len(set(axes)) != len(axes):
    raise ValueError(f"data_axis names a mesh axis twice: data_axis={data_axis!r}.")
  return axes


def check_mesh(mesh: Any, data_axis: tuple[AxisName, ...] | str | None) -> Any:
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
  if data_axis != AUTO:
    _check_axes_in(tuple(data_axis), mesh)
  return mesh


PLACEMENTS = {"param_gather": ("step", "micro_batch"), "grad_scatter": ("micro_batch", "step")}


def check_placement(name: str, value: Any, data_axis: Any) -> str:
  """Validates ``param_gather`` / ``grad_scatter`` (the FSDP placement under ``data_axis``)."""
  choices = PLACEMENTS[name]
  if not isinstance(value, str) or value not in choices:
    raise ValueError(
        f"{name} must be one of {', '.join(map(repr, choices))}, got {name}={value!r}.")
  if value != choices[0] and data_axis is None:
    raise ValueError(
        f"{name}={value!r} places the gathers and reduce-scatters of parameters sharded over "
        "the data axes (FSDP), which only the data-parallel mode runs: pass data_axis=... "
        f"(the mesh axes the batch and the parameters are sharded over), or drop {name}.")
  return value


def batch_data_axes(batches: dict[str, PyTree], leaf_axes: dict[str, PyTree]
                    ) -> tuple[tuple[AxisName, ...], Any]:
  """``data_axis="auto"``: the mesh axes every batch leaf's batch axis is sharded over.

  ``batches`` maps a label (``"argument 1 ('batch')"``) to a batch argument, ``leaf_axes``
  (:func:`jaxaccum._core._split.batch_axes`, keyed alike) each leaf's batch axis. A leaf's axes
  are read from its type under ``Explicit`` mesh axes, or from a placed (concrete) array's
  sharding under ``Auto`` axes; inside :func:`jax.jit` a tracer typed with ``Auto`` axes
  carries no sharding, so there the axes must be named. Returns ``(axes, mesh)``, the mesh
  the batch is placed on.

  Raises:
    ValueError: a leaf not sharded on its batch axis, leaves sharded over different axes,
      or a tracer whose sharding is unknown.
  """
  found: dict[str, tuple[AxisName, ...]] = {}
  meshes = []
  for label, tree in batches.items():
    along = jax.tree.leaves(leaf_axes[label])
    for (path, x), axis in zip(jax.tree_util.tree_leaves_with_path(tree), along, strict=True):
      if not hasattr(x, "shape") or not np.shape(x):
        continue
      where = f"{label}{jax.tree_util.keystr(path)}"
      spec, mesh = None, None
      # A placed array has a sharding; a tracer (a jax.Array too) has none, only its type.
      placed = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
      if isinstance(placed, jax.sharding.NamedSharding):
        spec, mesh = placed.spec, placed.mesh
      elif isinstance(x, jax.Array) and placed is None:
        typed = jax.typeof(x).sharding
        mesh = typed.mesh
        if not mesh.empty and mesh.explicit_axes:
          spec = typed.spec
        else:
          raise ValueError(
              f"data_axis='auto' cannot read how batch leaf {where} (shape {x.shape}) is "
              "sharded: inside jax.jit an array on a mesh with Auto axes carries no sharding "
              "at trace time. Name the axes, e.g. data_axis='data', or use Explicit axes "
              "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Explicit, ...))), whose "
              "types carry the sharding; outside jax.jit, placed arrays work too.")
      axes = dim_axes(spec, axis)
      if not axes:
        placed = (f"spec {spec}" if spec is not None else "not placed on a mesh")
        raise ValueError(
            f"data_axis='auto' needs the batch sharded over mesh axes on its batch axis "
            f"(axis {axis}), but batch leaf {where} (shape {x.shape}) is not ({placed}). "
            "Place the batch, "
            "e.g. jax.device_put(batch, NamedSharding(mesh, P('data'))), or name the axes: "
            "data_axis='data'.")
      found[where] = axes
      meshes.append(mesh)
  if not found:
    raise ValueError("data_axis='auto' found no array in the batch arguments to read the "
                     "data axes from: name them, e.g. data_axis='data'.")
  if len(set(found.values())) > 1:
    listed = "; ".join(f"{w}: {a}" for w, a in found.items())
    raise ValueError(
        "data_axis='auto' found batch leaves sharded over different mesh axes on their "
        f"batch axis ({listed}). Place every batch leaf alike, or name the axes with "
        "data_axis=(...).")
  return next(iter(found.values())), meshes[0]


def axes_str(axes: Sequence[AxisName], mesh: Any) -> str:
  return " x ".join(f"{a!r} (size {mesh.shape[a]})" for a in axes)


class MeshUse(NamedTuple):
  """Who asks :func:`resolve_mesh` for a mesh, for its messages and its one difference.

  ``argument`` is the keyword that names the axes (``data_axis``, ``stage_axis``),
  ``caller`` the function that takes ``mesh=``, ``along`` what is laid out along the axes,
  ``manual_fix`` what to do when the axes are already manual here; with ``nest`` the mesh of
  an enclosing ``shard_map`` over other axes is used (it knows which axes are manual).
  """

  argument: str
  caller: str
  along: str
  manual_fix: str
  nest: bool = False


DATA_AXIS = MeshUse(
    argument="data_axis", caller="jaxaccum.value_and_grad", along="the batch is sharded over",
    manual_fix=(
        "Call the transform outside your shard_map, or drop data_axis and do what it does: "
        "mark the differentiated arguments device-varying first, params = "
        "jax.lax.pcast(params, {axes}, to='varying') (otherwise JAX sums their gradients "
        "over the devices inside every micro-batch), so that each device accumulates the "
        "gradients of its own rows; the full-batch result is then the pmean (not the psum) "
        "of the loss and gradients over these axes for reduce='mean', their psum for "
        "reduce='sum', and for reduce='weighted' each device's loss and gradients weighed by "
        "its own total denominator d: psum(x * d) / psum(d)."))


def _named(use: MeshUse, axes: tuple[AxisName, ...]) -> str:
  return f"{use.argument}={axes[0] if len(axes) == 1 else axes!r}"


def _check_axes_in(axes: tuple[AxisName, ...], mesh: Any, use: MeshUse = DATA_AXIS) -> None:
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    sizes = ", ".join(f"{a!r}: {s}" for a, s in mesh.shape.items())
    raise ValueError(
        f"{_named(use, axes)} names mesh axis {', '.join(map(repr, missing))}, which is not "
        f"in the mesh; its axes are {{{sizes}}}. Pass the name of the axis {use.along}, e.g. "
        f"{use.argument}={next(iter(mesh.axis_names))!r}.")


def resolve_mesh(mesh: Any, axes: tuple[AxisName, ...], use: MeshUse = DATA_AXIS) -> Any:
  """The mesh ``axes`` name: ``mesh``, else the one set by ``jax.set_mesh``; raises the
  package's messages when there is none, an axis is not in it, or one is already manual."""
  context = jax.sharding.get_abstract_mesh()
  if mesh is None:
    if context.empty:
      raise ValueError(
          f"{_named(use, axes)} needs a mesh: pass mesh=... to {use.caller}, or call it "
          "inside `with jax.set_mesh(mesh):`.")
    mesh = context
  _check_axes_in(axes, mesh, use)
  manual = set(getattr(context, "manual_axes", ()))
  if manual & set(axes):
    raise ValueError(
        f"{use.argument} axes {sorted(manual & set(axes))} are already manual here (this is "
        f"inside a shard_map over them), so it cannot map over them again. "
        + use.manual_fix.format(axes=tuple(sorted(manual & set(axes)))))
  if use.nest and not context.empty and manual:
    # Inside an outer shard_map over other axes: nest in the context's mesh, which knows
    # which axes are already manual.
    if dict(context.shape) != dict(mesh.shape):
      raise ValueError(
          f"mesh={dict(mesh.shape)} differs from the mesh of the enclosing shard_map "
          f"({dict(context.shape)}). Pass the same mesh, or mesh=None.")
    mesh = context
  return mesh


def vary(tree: PyTree, axes: tuple[AxisName, ...]) -> PyTree:
  """``tree``, every leaf made to vary over the manual ``axes`` (those it does not yet)."""
  def one(x):
    missing = tuple(a for a in axes if a not in varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(one, tree)


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))
