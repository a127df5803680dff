"""The DP-SGD clip: :func:`clip_per_example` and the record it returns, :class:`ClipPerExample`.

The record validates itself and computes the clip factors from per-example norms; the rule
in :mod:`jaxaccum._per_example._rule` recognises it and takes the clip path (each example's
norm, the factors, one weighted sum), by per-example gradients or ghost norms.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._core import _validate
from jaxaccum._core._types import PyTree
from jaxaccum._per_example import _norm

METHODS = ("auto", "ghost", "materialize")


def _is_norm_tree(max_norm: Any) -> bool:
  """Whether ``max_norm`` is a pytree of clip norms rather than one (a number or an array)."""
  if isinstance(max_norm, (dict, list, tuple)):
    return True
  if isinstance(max_norm, (bool, int, float, np.number)) or hasattr(max_norm, "dtype"):
    return False
  return jax.tree.leaves(max_norm) != [max_norm]


def _check_max_norm(max_norm: Any) -> Any:
  """A concrete clip norm must be a positive scalar (inf: no clipping), or a pytree of them
  (one per group of parameters); a traced one is checked where it is used
  (:meth:`ClipPerExample.factors`)."""
  if _is_norm_tree(max_norm):
    leaves = jax.tree.leaves(max_norm)
    if not leaves:
      raise ValueError(
          f"clip_per_example: max_norm={max_norm!r} holds no clip norm; give one positive "
          "number, or a pytree of them whose structure is a prefix of the gradient's (one "
          "norm per subtree, e.g. {'encoder': 1.0, 'head': 0.5}).")
    for leaf in leaves:
      _check_max_norm(leaf)
    return max_norm
  if isinstance(max_norm, bool) or not (isinstance(max_norm, (int, float, np.number))
                                        or hasattr(max_norm, "dtype")):
    raise TypeError(
        f"clip_per_example: max_norm must be a positive number, got max_norm={max_norm!r}.")
  if np.shape(max_norm) != ():
    raise TypeError(
        "clip_per_example: max_norm must be a scalar (one norm for every example), got "
        f"an array of shape {tuple(np.shape(max_norm))}.")
  dtype = getattr(max_norm, "dtype", None)
  if dtype is not None and not (jnp.issubdtype(dtype, jnp.floating)
                                or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(
        f"clip_per_example: max_norm must be a real number, got an array of dtype {dtype}.")
  try:
    value = float(max_norm)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
          TypeError):
    return max_norm  # traced: see ClipPerExample.factors
  if not value > 0:
    raise ValueError(
        f"clip_per_example: max_norm must be positive, got max_norm={max_norm!r}; an "
        "example's gradient is scaled to at most this L2 norm (a NaN or a norm of 0 or "
        "less would leave it unclipped, zero it or flip it).")
  return max_norm


@dataclasses.dataclass(frozen=True, eq=False)
class ClipPerExample:
  """What :func:`clip_per_example` returns: the DP-SGD clip as a ``per_example=`` transform.

  Called on one example's gradient it returns the gradient clipped. Passed as
  ``per_example=``, the core recognises it and takes the clip path: each
  example's norm, then the factor :meth:`factors`, then one sum of the gradients weighted
  by the factors (see :func:`clip_per_example` for the fields).
  """

  max_norm: Any
  method: str = "auto"
  nan_safe: bool = False
  keep_batch_dim: bool = True
  example_mask: str | None = None

  def __post_init__(self):
    _check_max_norm(self.max_norm)
    _validate.check_choice("clip_per_example", "method", self.method, METHODS)
    for name in ("nan_safe", "keep_batch_dim"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(
            f"clip_per_example: {name} must be a bool, got {name}={getattr(self, name)!r}.")
    if self.example_mask is not None and not (isinstance(self.example_mask, str)
                                              and self.example_mask.isidentifier()):
      raise TypeError(
          "clip_per_example: example_mask must be the name of a keyword batch argument "
          f"(e.g. example_mask='mask'), got example_mask={self.example_mask!r}.")

  @property
  def grouped(self) -> bool:
    """Whether ``max_norm`` is a pytree of norms, one per group of parameters."""
    return _is_norm_tree(self.max_norm)

  def limits(self) -> jax.Array:
    """The clip norms: a scalar, or ``(G,)`` in the order of ``max_norm``'s leaves."""
    if not self.grouped:
      return jnp.asarray(self.max_norm, jnp.float32)
    return jnp.stack([jnp.asarray(c, jnp.float32) for c in jax.tree.leaves(self.max_norm)])

  def leaf_groups(self, grads: PyTree) -> list[int]:
    """Each leaf of ``grads``'s group: the index of the ``max_norm`` leaf whose subtree holds
    it (all 0 for one norm)."""
    if not self.grouped:
      return [0] * len(jax.tree.leaves(grads))
    index = jax.tree.unflatten(jax.tree.structure(self.max_norm),
                               range(len(jax.tree.leaves(self.max_norm))))
    try:
      per = jax.tree.map(lambda k, sub: [k] * len(jax.tree.leaves(sub)), index, grads)
    except ValueError as e:
      raise ValueError(
          "clip_per_example: max_norm's structure must be a prefix of the gradient's (one "
          f"norm per subtree): max_norm has structure {jax.tree.structure(self.max_norm)}, "
          f"the gradient {jax.tree.structure(grads)}. Give one norm per top-level entry "
          "(e.g. {'encoder': 1.0, 'head': 0.5} for parameters {'encoder': ..., 'head': "
          "...}), or one number for the whole gradient.") from e
    return [k for ks in jax.tree.leaves(per, is_leaf=lambda x: isinstance(x, list)) for k in ks]

  def factors(self, norms: jax.Array) -> jax.Array:
    """Each example's clip factor from its gradient's L2 norm (float32, any shape; with a
    pytree ``max_norm``, its groups' norms along the last axis).

    ``min(1, max_norm / norm)``, 1 for a zero gradient. A non-finite norm gives NaN (the
    gradient stays visibly non-finite, for ``skip_nonfinite``), or 0 under ``nan_safe``
    (the example adds nothing; in every group, where one group's norm is not finite). A
    traced ``max_norm`` that is not positive (or NaN) gives NaN factors: a gradient of NaN
    rather than a flipped or unclipped one.
    """
    norms = jnp.asarray(norms, jnp.float32)
    limit = self.limits()
    c = jnp.where(norms > limit, limit / jnp.where(norms > limit, norms, 1.0), 1.0)
    finite = jnp.isfinite(norms)
    if self.grouped:
      finite = jnp.broadcast_to(jnp.all(finite, axis=-1, keepdims=True), finite.shape)
    c = jnp.where(finite, c, 0.0 if self.nan_safe else jnp.nan)
    return jnp.where(limit > 0, c, jnp.nan)

  def __call__(self, grads: PyTree) -> PyTree:
    """Clips one example's gradient (a pytree) to L2 norm ``max_norm`` (each group to its
    own norm, with a pytree ``max_norm``)."""
    leaves, treedef = jax.tree.flatten(grads)
    groups = self.leaf_groups(grads)
    inexact = [x if _is_inexact(x) else jnp.zeros(()) for x in leaves]
    c = self.factors(_norm.group_norms(inexact, groups, max(groups, default=0) + 1)
                     if self.grouped else _norm.norm(grads))
    if self.grouped:
      return jax.tree.unflatten(treedef, [_norm.scale(x, c[k]) if _is_inexact(x) else x
                                          for x, k in zip(leaves, groups, strict=True)])
    return jax.tree.map(lambda g: _norm.scale(g, c) if _is_inexact(g) else g, grads)


def _is_inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)


def clip_per_example(max_norm: float | jax.Array, method: str = "auto", *,
                     nan_safe: bool = False, keep_batch_dim: bool = True,
                     example_mask: str | None = None) -> ClipPerExample:
  """A ``per_example=`` transform that clips each example's gradient to a global L2 norm.

  Each example's gradient ``g`` is scaled by ``min(1, max_norm / |g|)``, where ``|g|`` is
  the L2 norm over all its floating leaves (in float32, computed without overflow): the
  per-example clipping of DP-SGD (Abadi et al., 2016). Pass it as
  ``per_example=`` to :func:`jaxaccum.value_and_grad` or :func:`jaxaccum.grad`
  (or an adapter): the gradient returned is then the mean (or sum) of the clipped
  per-example gradients. With ``with_info=True`` the :class:`jaxaccum.AccumInfo` holds each
  example's norm before clipping (``example_grad_norms``). Called on one example's
  gradient, it returns that gradient clipped.

  Args:
    max_norm: the largest L2 norm an example's gradient keeps: a positive number (``inf``
      clips nothing), or a scalar array (e.g. a schedule's value inside a jitted step). A
      concrete value that is not positive raises ``ValueError``; a traced one that is not
      positive (or NaN) makes the gradients NaN, which ``skip_nonfinite`` drops. Or a
      pytree of such norms whose structure is a prefix of the gradient's (per-layer
      clipping, e.g. ``{"encoder": 1.0, "head": 0.5}``): each subtree of an example's
      gradient is clipped to its own norm, in every ``method``, and an example then adds
      at most ``sqrt(sum C_g^2)`` (the ``l2_norm_clip`` of :func:`jaxaccum.dp.dp_noise`);
      ``example_grad_norms`` holds each example's whole-gradient norm.
    method: how the clipped sum is computed. ``"materialize"``: each example's gradient is
      formed under ``jax.vmap``, its norm taken, and the gradients summed with their
      factors (memory: micro-batch size x parameters). ``"ghost"``: the norms come from
      the activations and output gradients of the layers that use each parameter (ghost
      norms), and the clipped sum from those layers' activations and the factor-weighted
      output gradients, or from a second backward pass of the factor-weighted losses
      (whichever holds less memory; always the latter inside a ``lax.scan`` body),
      without per-example gradients; a parameter use it does not recognise raises an
      error naming it, and so does a second backward pass in a dtype narrower than
      float32 (bfloat16 layers in a ``lax.scan`` body), which does not scale with the
      clip factor. ``"auto"`` (the default): ghost norms where they are recognised,
      per-example gradients for the other leaves (for every leaf where ``"ghost"`` would
      need a second pass in a narrow dtype).
    nan_safe: an example whose gradient (or norm) is not finite contributes zero to the
      gradient and to the value, instead of making its micro-batch non-finite (which
      ``skip_nonfinite`` would drop whole). It still counts in a mean's divisor.
    keep_batch_dim: ``True`` (the default): ``fun`` sees each example as a batch of one
      (leading axis 1). ``False``: the batch axis is dropped, so ``fun`` sees one row
      ``x[j]``; with a batch of shape ``(users, rows_per_user, ...)`` each user is one
      unit, clipped as a whole (user-level DP).
    example_mask: the name of a keyword batch argument (named in ``batch_argnames``)
      holding one bool per example, ``False`` for padding: padding examples add nothing to
      the gradient, the value and the aux means, and a mean divides by the real examples
      only, so a batch padded to a fixed size needs no recompilation. It is split with the
      batch and not passed to ``fun``.

  Returns:
    A :class:`jaxaccum.dp.ClipPerExample`.

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> clip = jaxaccum.dp.clip_per_example(1.0)
  >>> clip({"w": jnp.array([3.0, 4.0])})["w"], clip({"w": jnp.array([0.3, 0.4])})["w"]
  (Array([0.6, 0.8], dtype=float32), Array([0.3, 0.4], dtype=float32))
  """
  return ClipPerExample(max_norm, method, nan_safe, keep_batch_dim, example_mask)
