"""The data-parallel mode's options: the mesh axes the batch is sharded over, and how.

:class:`DataParallel` is the ``data_axis=`` record: its axes (or ``"auto"``, read from the
batch by :func:`batch_data_axes`), its mesh (:func:`resolve_mesh` finds it at the call) and
the FSDP placement of parameters sharded over the data axes (:data:`PLACEMENTS`).
:data:`KEYWORDS` is how the front ends fold the ``data_axis`` keyword, and the deprecated
keywords it replaces, into ``Options.parallel``; the core holds the record and reads none
of its fields. The mode that uses them is :mod:`jaxaccum._parallel._data_parallel`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxaccum._core import _options, _sharding
from jaxaccum._core._types import AxisName, PyTree

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
      axes = _sharding.dim_axes(spec, axis)
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


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """The data-parallel mode: the mesh axes the batch is sharded over, and how.

  Pass it as ``data_axis=`` to :func:`jaxaccum.value_and_grad` (a plain axis name, tuple of
  names or ``"auto"`` means ``DataParallel(axis)``). Each device accumulates the gradients
  of its own rows and they are reduced once per step, after the loop; ``fun`` sees
  ``B / (N * D)`` rows per call on each of the ``D`` data shards. Arrays ``fun`` closes over
  and non-batch keyword arguments are replicated. See the devices guide.

  Attributes:
    axis: the mesh axis name (or a tuple of names) the batch is sharded over, or ``"auto"``:
      the mesh axes the batch's batch axis is sharded over (from the types under
      ``Explicit`` mesh axes; under ``Auto`` axes only from placed arrays, outside
      :func:`jax.jit`). Stored as a tuple of names (or ``"auto"``).
    mesh: the mesh holding ``axis``; ``None`` uses the mesh set with :func:`jax.set_mesh`.
    param_gather: when parameters sharded over the data axes (FSDP) are all-gathered:
      ``"step"`` (default) once per step, before the loop (the full parameters stay live
      across it), or ``"micro_batch"`` inside every micro-batch, behind an optimization
      barrier that XLA cannot hoist (``N`` times the gather bytes).
    grad_scatter: when their gradients are reduce-scattered: ``"micro_batch"`` (default)
      inside every micro-batch, into an accumulator of the shard's size, or ``"step"``
      once after the loop, from a full-size accumulator of local gradients. Both need an
      FSDP parameter (an ``Explicit`` sharding type over a data axis).
    overlap_grad_reduce: run the last micro-batch after the loop instead of inside it
      (Megatron's option of the same name), so that the reduction of each gradient across
      the data shards can start as soon as its last contribution exists. The results are
      the same; the program holds the per-micro-batch computation twice (longer compile,
      larger code) and on GPU the temporary memory of two micro-batches. Whether the
      compiler overlaps depends on the model and on XLA's all-reduce combiner: see
      "Overlapping the last reduction" in the devices guide. Experimental: the evidence
      is from compiled programs only, never timed (for 8 described H100s, on the LM 2 of
      its 7 gradient all-reduces start before the last GEMM and 1 GEMM runs inside one, at
      1.9x the peak memory, 13.97 to 26.54 GiB; ``benchmarks/results/overlap.md``).

  Raises:
    TypeError, ValueError: a bad axis, a mesh without ``axis``, an unknown placement.

  >>> import jaxaccum
  >>> dp = jaxaccum.DataParallel("data", grad_scatter="step")
  >>> dp.axis, dp.grad_scatter
  (('data',), 'step')
  """

  axis: tuple[AxisName, ...] | str
  mesh: Any = None
  # The default placement is the first of each field's choices (PLACEMENTS).
  param_gather: str = PLACEMENTS["param_gather"][0]
  grad_scatter: str = PLACEMENTS["grad_scatter"][0]
  overlap_grad_reduce: bool = False

  def __post_init__(self):
    axis = check_data_axis_option(self.axis)
    if axis is None:
      raise TypeError(
          "DataParallel needs the mesh axis name (or names) the batch is sharded over, e.g. "
          "DataParallel('data'), got axis=None; for no data parallelism pass data_axis=None.")
    object.__setattr__(self, "axis", axis)
    check_mesh(self.mesh, axis)
    check_placement("param_gather", self.param_gather, axis)
    check_placement("grad_scatter", self.grad_scatter, axis)
    check_overlap(self.overlap_grad_reduce, axis)

  @property
  def default_placement(self) -> bool:
    """Whether ``param_gather`` and ``grad_scatter`` are the defaults (gather once per step,
    reduce-scatter every micro-batch): what a replicated run does."""
    return all(getattr(self, name) == choices[0]
               for name, choices in PLACEMENTS.items())

  @property
  def reduces_only(self) -> bool:
    """Whether only the axes and the mesh are given: the default placement and no
    ``overlap_grad_reduce``, what a front end that places no collectives takes."""
    return self.default_placement and not self.overlap_grad_reduce


def check_overlap(overlap: Any, axes: Any) -> bool:
  """``overlap_grad_reduce``: a bool, and only with ``data_axis``, the one mode whose
  cross-device reduction runs after the loop (without it there is none to overlap)."""
  if not isinstance(overlap, bool):
    raise TypeError(f"overlap_grad_reduce must be a bool, got overlap_grad_reduce={overlap!r}.")
  if overlap and axes is None:
    raise ValueError(
        "overlap_grad_reduce=True overlaps the cross-device gradient reduction that "
        "data_axis runs once after the micro-batch loop with the last micro-batch's backward "
        "pass, but data_axis is not set, so there is no such reduction: without data_axis "
        "the compiler reduces gradients inside every micro-batch. Pass "
        "data_axis='data' (the mesh axis the batch is sharded over), or drop "
        "overlap_grad_reduce.")
  return overlap


def unreduced_axes(where: str, data_axis: Any, given: dict[str, Any]) -> tuple[Any, Any]:
  """``(axis names, mesh)`` for a front end that reduces nothing across devices itself
  (``local_value_and_grad``, ``MultiSteps``): ``data_axis`` is axis names or a
  :class:`DataParallel` without a placement, and ``given`` may hold the deprecated
  ``mesh=`` keyword (popped, with a :class:`DeprecationWarning`)."""
  mesh = None
  if "mesh" in given:
    warnings.warn(
        f"{where}(mesh=...) is deprecated and will be removed in the next release: use "
        f"{_options.DEPRECATED['mesh'].instead}.", DeprecationWarning, stacklevel=3)
    mesh = given.pop("mesh")
    if isinstance(data_axis, DataParallel):
      raise TypeError(f"{where} got mesh= and data_axis=DataParallel(...) both: give the "
                      "mesh inside DataParallel only.")
  if isinstance(data_axis, DataParallel):
    if not data_axis.reduces_only:
      raise TypeError(
          f"{where} reduces nothing across devices, so it takes DataParallel(axis, "
          f"mesh=...) only, got data_axis={data_axis!r}: drop param_gather, grad_scatter and "
          "overlap_grad_reduce.")
    data_axis, mesh = data_axis.axis, data_axis.mesh
  return data_axis, mesh


# The deprecated keywords folded into DataParallel (value_and_grad(mesh=...) and the others).
FOLDED = ("mesh", "param_gather", "grad_scatter", "overlap_grad_reduce")


def fold(data_axis: Any, old: dict[str, Any], clash: Callable[[str, str], None]
         ) -> DataParallel | None:
  """``Options.parallel`` from the ``data_axis`` keyword and the deprecated keywords given
  (``old``) that :class:`DataParallel` now holds; ``clash(record, name)`` raises for one given
  beside a ``DataParallel``."""
  dp_old = {k: old[k] for k in FOLDED if k in old}
  if isinstance(data_axis, DataParallel):
    for name in dp_old:
      clash("data_axis=DataParallel(...)", name)
    return data_axis
  axis = check_data_axis_option(data_axis)
  if axis is not None:
    return DataParallel(axis, **dp_old)
  # each deprecated keyword's own error (it needs data_axis), or its default
  check_mesh(dp_old.get("mesh"), None)
  for name in ("param_gather", "grad_scatter"):
    if name in dp_old:
      check_placement(name, dp_old[name], None)
  check_overlap(dp_old.get("overlap_grad_reduce", False), None)
  return None


def check_evaluate(data_axis: Any, where: str) -> None:
  """:func:`jaxaccum.evaluate`'s ``data_axis``: a :class:`DataParallel` without a placement."""
  if isinstance(data_axis, DataParallel) and not data_axis.reduces_only:
    raise TypeError(
        f"{where} takes DataParallel(axis, mesh=...) only, got {data_axis!r}: param_gather, "
        "grad_scatter and overlap_grad_reduce are about gradients, and evaluate "
        "differentiates nothing. Drop them.")


# What the front ends pass to jaxaccum._core._options.make_options.
KEYWORDS = _options.ParallelKeywords(fold, check_evaluate)
