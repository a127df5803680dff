"""Statistics of gradient pytrees shared by the core and :class:`jaxaccum.MultiSteps`.

One definition each of the squared norm behind :class:`jaxaccum.AccumInfo` and of the
test that ``skip_nonfinite`` applies. Every leaf is tested in its own dtype: a finite
float64 value above float32's range is finite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxaccum._types import PyTree


def _inexact(tree: PyTree) -> list[jax.Array]:
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]


def sq_norm(tree: PyTree) -> jax.Array:
  """The squared L2 norm of the floating leaves of a pytree, in float32 (NaN if one is)."""
  leaves = [jnp.sum(jnp.square(jnp.asarray(x).astype(jnp.float32))) for x in _inexact(tree)]
  return functools.reduce(jnp.add, leaves, jnp.zeros((), jnp.float32))


def all_finite(tree: PyTree) -> jax.Array:
  """Whether every entry of every floating leaf is finite, each tested in its own dtype."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in _inexact(tree)]
  return functools.reduce(jnp.logical_and, leaves, jnp.ones((), jnp.bool_))
