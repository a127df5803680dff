"""How values are accumulated over micro-batches: loss reductions, dtypes, aux reductions.

Everything here works on one leaf at a time and is shared by the scan transform and by
:class:`jaxaccum.MultiSteps`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

REDUCTIONS = ("mean", "sum", "weighted")
AUX_REDUCTIONS = ("mean", "sum", "stack", "max", "min")


def check_reduce(reduce: Any) -> str:
  if reduce not in REDUCTIONS:
    raise ValueError(
        f"reduce must be one of {', '.join(map(repr, REDUCTIONS))}, got reduce={reduce!r}. "
        "Use 'mean' when fun returns the mean over its micro-batch, 'sum' when it returns a "
        "sum, 'weighted' when it returns (numerator, denominator)."
    )
  return reduce


def accumulator_dtype_for(dtype: Any, accumulator_dtype: Any) -> np.dtype:
  """The dtype a value of ``dtype`` is accumulated in.

  ``accumulator_dtype=None`` (the default) promotes floating types narrower than 32 bits
  (bfloat16, float16) to float32 and keeps wider ones (float32, float64) as they are;
  integers and booleans are accumulated as int32 (sums) by the callers that need it.
  An explicit dtype applies to every floating value.
  """
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return dtype
  if accumulator_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
    return jnp.dtype(accumulator_dtype)
  if dtype.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return dtype


def check_dtype(name: str, dtype: Any) -> Any:
  """Validates an optional floating dtype argument."""
  if dtype is None:
    return None
  try:
    out = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name} must be a floating dtype such as jnp.float32, got {dtype!r}.") from e
  if not jnp.issubdtype(out, jnp.floating):
    raise TypeError(f"{name} must be a floating dtype such as jnp.float32, got {dtype!r}.")
  return out


def _mean_dtype(dtype: Any, accumulator_dtype: Any) -> np.dtype:
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return accumulator_dtype_for(dtype, accumulator_dtype)
  return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))  # float32 unless x64


def _sum_dtype(dtype: Any, accumulator_dtype: Any) -> np.dtype:
  """Integer and boolean sums are counted in at least int32: they neither wrap nor saturate."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer):
    return jnp.promote_types(dtype if dtype != jnp.bool_ else jnp.int32, jnp.int32)
  return accumulator_dtype_for(dtype, accumulator_dtype)


def check_aux_leaf(path: str, kind: str, shape: jax.ShapeDtypeStruct) -> None:
  """Only numbers can be averaged or summed; keys and the like can only be stacked."""
  dtype = shape.dtype
  numeric = jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.number)
  if kind != "stack" and not numeric:
    raise TypeError(
        f"aux leaf {path or '(root)'} has dtype {dtype}, which cannot be reduced with "
        f"aux_reduce {kind!r}. Mark it aux_reduce='stack' (one entry per micro-batch) or "
        "return it outside aux."
    )


def resolve_aux_reduce(spec: Any, aux_shapes: PyTree, default: str) -> PyTree:
  """Expands ``spec`` (a string, or a pytree prefix of aux with strings or None) to aux.

  Returns a pytree with the structure of ``aux_shapes`` whose leaves are reduction names.
  """
  def is_spec_leaf(x):
    return x is None or isinstance(x, str)

  def check(name):
    if name is None:
      return default
    if name not in AUX_REDUCTIONS:
      raise ValueError(
          f"aux_reduce entries must be one of {', '.join(map(repr, AUX_REDUCTIONS))} or "
          f"None (the default), got {name!r}."
      )
    return name

  if spec is None or isinstance(spec, str):
    name = check(spec)
    return jax.tree.map(lambda _: name, aux_shapes)
  try:
    return jax.tree.map(
        lambda name, sub: jax.tree.map(lambda _: check(name), sub),
        spec, aux_shapes, is_leaf=is_spec_leaf,
    )
  except ValueError as e:
    if "aux_reduce entries" in str(e):
      raise
    raise ValueError(
        "aux_reduce must be a string or a pytree prefix of the aux that fun returns, with "
        f"a reduction name or None at each leaf. Got aux_reduce={spec!r} for aux of "
        f"structure {jax.tree.structure(aux_shapes)}."
    ) from e


def aux_init(kind: str, shape: jax.ShapeDtypeStruct, accumulator_dtype: Any) -> jax.Array | None:
  """The scan carry that accumulates one aux leaf (``None`` for stacked leaves)."""
  if kind == "stack":
    return None
  if kind == "mean":
    return jnp.zeros(shape.shape, _mean_dtype(shape.dtype, accumulator_dtype))
  if kind == "sum":
    return jnp.zeros(shape.shape, _sum_dtype(shape.dtype, accumulator_dtype))
  dtype = jnp.dtype(shape.dtype)
  if dtype == jnp.bool_:
    fill = kind == "min"
  elif jnp.issubdtype(dtype, jnp.inexact):
    fill = -jnp.inf if kind == "max" else jnp.inf
  else:
    info = jnp.iinfo(dtype)
    fill = info.min if kind == "max" else info.max
  return jnp.full(shape.shape, fill, dtype)


def aux_update(kind: str, carry: jax.Array | None, value: jax.Array, weight: jax.Array | None):
  """Adds one micro-batch's aux leaf to the carry. ``weight`` scales means when weighted."""
  if kind == "stack":
    return None
  if kind == "max":
    return jnp.maximum(carry, value)
  if kind == "min":
    return jnp.minimum(carry, value)
  value = value.astype(carry.dtype)
  if kind == "mean" and weight is not None:
    # A micro-batch of weight 0 adds nothing, even if its aux is NaN (e.g. a mean over
    # zero tokens): 0 * aux is 0 for every finite aux, so this only removes NaN and inf.
    w = weight.astype(carry.dtype)
    value = jnp.where(w == 0, jnp.zeros_like(value), value * w)
  return carry + value


def aux_finalize(kind: str, carry: jax.Array | None, stacked: jax.Array | None,
                 shape: jax.ShapeDtypeStruct, divisor: jax.Array | None):
  """The reduced aux leaf. ``divisor`` is N for plain means, the total weight if weighted."""
  if kind == "stack":
    return stacked
  if kind in ("max", "min"):
    return carry
  if kind == "sum":  # floats come back in their own dtype, counts in the wider one
    dtype = jnp.dtype(shape.dtype)
    return carry.astype(dtype) if jnp.issubdtype(dtype, jnp.inexact) else carry
  out = safe_divide(carry, divisor)
  dtype = jnp.dtype(shape.dtype)
  return out.astype(dtype) if jnp.issubdtype(dtype, jnp.inexact) else out


def safe_divide(x: jax.Array, d: jax.Array) -> jax.Array:
  """``x / d``, and exactly 0 where ``d == 0`` (no NaN, even if ``x`` is NaN there)."""
  d = jnp.asarray(d, x.dtype)
  zero = d == 0
  return jnp.where(zero, jnp.zeros_like(x), x / jnp.where(zero, jnp.ones_like(d), d))
