"""Statistics of gradient pytrees shared by the core, its wings and :class:`jaxaccum.MultiSteps`.

One definition each of the squared norm behind :class:`jaxaccum.AccumInfo`, of the L2 norm
(computed so that it does not overflow) and the row scaling the per-example clip uses, and
of the test that ``skip_nonfinite`` applies. Every leaf is tested in its own
dtype: a finite float64 value above float32's range is finite.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._core._types import PyTree


def _inexact(tree: PyTree) -> list[jax.Array]:
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]


def magnitude(x: Any) -> jax.Array:
  """``|x|`` entrywise in float32 where ``x`` is complex, else ``x`` in float32: what an L2
  norm squares (a cast of a complex value to float32 would keep its real part only)."""
  x = jnp.asarray(x)
  return (jnp.abs(x) if jnp.iscomplexobj(x) else x).astype(jnp.float32)


def sq_norm(tree: PyTree) -> jax.Array:
  """The squared L2 norm of the inexact leaves of a pytree, in float32 (NaN if one is);
  a complex entry adds ``|x|^2``."""
  leaves = [jnp.sum(jnp.square(magnitude(x))) for x in _inexact(tree)]
  return functools.reduce(jnp.add, leaves, jnp.zeros((), jnp.float32))


def all_finite(tree: PyTree) -> jax.Array:
  """Whether every entry of every floating leaf is finite, each tested in its own dtype."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in _inexact(tree)]
  return functools.reduce(jnp.logical_and, leaves, jnp.ones((), jnp.bool_))


def relative_difference(actual: PyTree, expected: PyTree) -> float:
  """The L2 norm of ``actual - expected`` over the L2 norm of ``expected`` (the norm of the
  difference where ``expected`` is 0), in float64 on the host: how the checks of a rule on a
  sample batch measure (:func:`jaxaccum.dp.check_per_example_loss`,
  ``CachedValueAndGrad.check_encode``)."""
  a = [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(actual)]
  b = [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(expected)]
  diff = np.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b, strict=True)))
  size = np.sqrt(sum(float(np.sum(y ** 2)) for y in b))
  return float(diff / size) if size > 0 else float(diff)


def scale_divisor(peak: jax.Array) -> jax.Array:
  """What to divide entries by before squaring them: their largest absolute value ``peak``,
  or 1 where that is 0 or not finite (then the result is 0, or not finite, as it should)."""
  return jnp.where((peak > 0) & jnp.isfinite(peak), peak, 1.0)


def norm(tree: PyTree) -> jax.Array:
  """The L2 norm of the inexact leaves of a pytree, in float32, without overflow (a complex
  entry counts its modulus).

  The leaves are divided by their largest absolute entry before squaring, so a gradient
  whose squared norm is beyond float32's range (a norm above about 1.8e19) still has a
  finite norm. NaN if an entry is NaN, inf if one is infinite (and none is NaN).
  """
  leaves = [magnitude(x) for x in _inexact(tree)]
  if not leaves:
    return jnp.zeros((), jnp.float32)
  peak = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), initial=0.0) for x in leaves])
  scale = scale_divisor(peak)
  total = functools.reduce(jnp.add, [jnp.sum(jnp.square(x / scale)) for x in leaves])
  return jnp.where(jnp.isfinite(peak), scale * jnp.sqrt(total), peak)


def norm_of_norms(norms: jax.Array) -> jax.Array:
  """The L2 norm over the last axis of ``norms`` (each a norm of one part of a gradient),
  without overflow: the whole gradient's norm from its groups'."""
  peak = jnp.max(norms, axis=-1)
  scale = scale_divisor(peak)
  total = scale * jnp.sqrt(jnp.sum(jnp.square(norms / scale[..., None]), axis=-1))
  return jnp.where(jnp.isfinite(peak), total, peak)


def group_norms(leaves: list[Any], groups: list[int], count: int) -> jax.Array:
  """``(count,)``: the L2 norm (:func:`norm`) of each group's leaves (``groups``: each leaf's
  group)."""
  return jnp.stack([norm([x for x, g in zip(leaves, groups, strict=True) if g == k])
                    for k in range(count)])


def scale(g: jax.Array, c: jax.Array) -> jax.Array:
  """``c * g`` in ``g``'s dtype, exactly zero where ``c`` is 0 (even where ``g`` is not
  finite: a clip factor of 0 removes an example)."""
  g = jnp.asarray(g)
  out = g * c.astype(g.dtype)
  return jnp.where(c == 0, jnp.zeros_like(out), out)


def scale_rows(g: jax.Array, c: jax.Array) -> jax.Array:
  """:func:`scale` with one factor per leading row: ``c`` is ``(E,)``, ``g`` is ``(E, ...)``."""
  return scale(g, c.reshape(c.shape + (1,) * (jnp.ndim(g) - 1)))
