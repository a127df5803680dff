"""Sharding of accumulators: typed like what they accumulate, the batch kept where it lives.

Its zero accumulators take the sharding (``Explicit`` mesh axes) and the varying manual
axes (inside ``shard_map``) of the values they accumulate (:func:`conform`), accumulators
are tied to their parameters' shardings under ``Auto`` axes (:func:`align`), and a batch
whose leading axis is sharded over ``D`` devices is checked to split into micro-batches of a
multiple of ``D`` rows, which is what keeps the column-major split free of communication.
"""

from __future__ import annotations

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


def axes_str(axes: Sequence[AxisName], mesh: Any) -> str:
  return " x ".join(f"{a!r} (size {mesh.shape[a]})" for a in axes)


def vary(tree: PyTree, axes: tuple[AxisName, ...]) -> PyTree:
  """``tree``, every leaf made to vary over the manual ``axes`` (those it does not yet)."""
  def one(x):
    missing = tuple(a for a in axes if a not in varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(one, tree)


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))
