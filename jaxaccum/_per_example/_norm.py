"""Norms of one example's gradient and its scaling, without overflow: what the clip reads.

The L2 norm of a pytree (:func:`norm`) and of its groups (:func:`group_norms`), the norm
of a vector of norms (:func:`norm_of_norms`), and the scaling of a gradient by a factor per
example (:func:`scale`, :func:`scale_rows`), exactly zero where the factor is.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._core import _stats
from jaxaccum._core._types import PyTree


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
  leaves = [_stats.magnitude(x) for x in _stats.inexact(tree)]
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
