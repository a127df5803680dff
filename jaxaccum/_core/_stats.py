"""Gradient statistics: the squared norm and the test of finite values.

Shared by the core, its wings and :class:`jaxaccum.MultiSteps`: one definition each of the
squared norm behind :class:`jaxaccum.AccumInfo`, of the test that ``skip_nonfinite``
applies and of the relative difference the checks measure. Every leaf is tested in its own
dtype: a finite float64 value above float32's range is finite.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._core._types import PyTree


def inexact(tree: PyTree) -> list[jax.Array]:
  """The real- or complex-valued leaves of a pytree."""
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]


def magnitude(x: Any) -> jax.Array:
  """``|x|`` entrywise in float32 where ``x`` is complex, else ``x`` in float32: what an L2
  norm squares (a cast of a complex value to float32 would keep its real part only)."""
  x = jnp.asarray(x)
  return (jnp.abs(x) if jnp.iscomplexobj(x) else x).astype(jnp.float32)


def sq_norm(tree: PyTree) -> jax.Array:
  """The squared L2 norm of the inexact leaves of a pytree, in float32 (NaN if one is);
  a complex entry adds ``|x|^2``."""
  leaves = [jnp.sum(jnp.square(magnitude(x))) for x in inexact(tree)]
  return functools.reduce(jnp.add, leaves, jnp.zeros((), jnp.float32))


def all_finite(tree: PyTree) -> jax.Array:
  """Whether every entry of every floating leaf is finite, each tested in its own dtype."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in inexact(tree)]
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


def within(found: dict[str, float], rtol: float) -> bool:
  """Whether every relative difference a check measured (:func:`relative_difference`) is
  finite and at most ``rtol``: the verdict of the checks of a rule on a sample batch."""
  return all(np.isfinite(v) and v <= rtol for v in found.values())
