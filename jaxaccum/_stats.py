"""Statistics of gradient pytrees shared by the core and :class:`jaxaccum.MultiSteps`.

One definition each of the squared norm behind :class:`jaxaccum.AccumInfo` (and behind
:func:`clip_per_example`, the per-example norm clip) and of the test that
``skip_nonfinite`` applies. Every leaf is tested in its own dtype: a finite
float64 value above float32's range is finite.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

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


def clip_per_example(max_norm: float | jax.Array) -> Callable[[PyTree], PyTree]:
  """A ``per_example_transform`` that clips each example's gradient to a global L2 norm.

  The returned function scales a gradient pytree ``g`` by ``min(1, max_norm / |g|)``, where
  ``|g|`` is the L2 norm over all its floating leaves (computed in float32): the per-example
  clipping of DP-SGD (Abadi et al., 2016). Pass it as ``per_example_transform=`` to
  :func:`jaxaccum.value_and_grad` or :func:`jaxaccum.grad`, which apply it to each
  example's gradient before the mean. Unlike ``optax.per_example_global_norm_clip``, which
  takes gradients with a batch axis and returns their clipped sum, it takes one example's
  gradient and returns it clipped; a NaN norm leaves the gradient as it is (NaN), for
  ``skip_nonfinite`` to see.

  Args:
    max_norm: the largest L2 norm an example's gradient keeps; a positive number, or a
      scalar array (e.g. a schedule's value inside a jitted step).

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> clip = jaxaccum.clip_per_example(1.0)
  >>> clip({"w": jnp.array([3.0, 4.0])})["w"], clip({"w": jnp.array([0.3, 0.4])})["w"]
  (Array([0.6, 0.8], dtype=float32), Array([0.3, 0.4], dtype=float32))
  """
  if isinstance(max_norm, bool) or not (isinstance(max_norm, (int, float, np.number))
                                        or hasattr(max_norm, "dtype")):
    raise TypeError(
        f"clip_per_example: max_norm must be a positive number, got max_norm={max_norm!r}.")
  if isinstance(max_norm, (int, float, np.number)) and not float(max_norm) > 0:
    raise ValueError(
        f"clip_per_example: max_norm must be positive, got max_norm={max_norm!r}; an "
        "example's gradient is scaled to at most this L2 norm.")

  def clip(grads: PyTree) -> PyTree:
    norm = jnp.sqrt(sq_norm(grads))
    limit = jnp.asarray(max_norm, jnp.float32)
    scale = jnp.where(norm > limit, limit / norm, jnp.float32(1.0))
    return jax.tree.map(
        lambda g: (g * scale.astype(g.dtype)) if jnp.issubdtype(jnp.asarray(g).dtype,
                                                                jnp.inexact) else g, grads)

  return clip
