"""``jaxaccum.dp``: DP-SGD on accumulated gradients.

Each example's gradient is transformed (clipped) before the sum
(:func:`per_example_value_and_grad` with :func:`clip_per_example`, the clipped sum formed from
per-example norms without the per-example gradients where the program allows), then
:func:`dp_noise` adds the Gaussian noise to the clipped sum, first in the optimizer's chain
(:func:`dp_optimizer` builds it; :func:`check_dp_chain` reads a chain built by hand).
:func:`check_per_example_loss` checks on a sample batch that a loss is a sum of per-row losses,
and :func:`place_padding_last` moves padded rows out of the micro-batches that run. See the
DP-SGD guide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxaccum import _transforms
from jaxaccum._core import _options
from jaxaccum._core._stats import relative_difference, within
from jaxaccum._per_example._clip import ClipPerExample as ClipPerExample
from jaxaccum._per_example._clip import clip_per_example as clip_per_example
from jaxaccum._per_example._dp import DpNoiseState as DpNoiseState
from jaxaccum._per_example._dp import check_dp_chain as check_dp_chain
from jaxaccum._per_example._dp import dp_noise as dp_noise
from jaxaccum._per_example._dp import dp_optimizer as dp_optimizer
from jaxaccum._per_example._dp import place_padding_last as place_padding_last

__all__ = (
    "ClipPerExample",
    "DpNoiseState",
    "check_dp_chain",
    "check_per_example_loss",
    "clip_per_example",
    "dp_noise",
    "dp_optimizer",
    "per_example_value_and_grad",
    "place_padding_last",
)


def per_example_value_and_grad(fun: Callable[..., Any], transform: Callable[[Any], Any],
                               **options: Any) -> Callable[..., Any]:
  """:func:`value_and_grad` with ``transform`` applied to each example's gradient.

  Sugar for ``jaxaccum.value_and_grad(fun, per_example=transform, **options)``, the one
  spelling every front end takes (:func:`jaxaccum.grad`, the adapters, the planner).

  ``transform(grads) -> grads`` sees one example's gradient (one row's, with
  :func:`jax.grad`'s structure) and returns one of the same shapes, e.g.
  :func:`jaxaccum.dp.clip_per_example` for DP-SGD; the transformed gradients are then summed.
  Each micro-batch's examples are differentiated under :func:`jax.vmap`, ``fun`` seeing
  one row as a batch of one, so the micro-batch size is the vmap width and bounds the
  memory. The gradients are the mean over all examples of the transformed gradients (their
  sum under ``reduce="sum"``; under ``"weighted"`` the sum of the transformed gradients of
  each example's numerator divided by the total denominator); the value is the mean (sum)
  of the examples' values. A dict ``reduce`` needs all its terms of one kind. Aux leaves
  are reduced over a micro-batch's examples as their ``aux_reduce`` says (not ``"stack"``
  or user reductions); state must come back the same from each example; example ``r`` of
  micro-batch ``i`` gets ``fold_in(fold_in(key, i), r)``. ``skip_nonfinite`` and
  ``with_info`` see each micro-batch's sum of transformed gradients. See the DP-SGD guide.

  Args:
    fun: the loss, as for :func:`value_and_grad`.
    transform: the function applied to each example's gradient.
    **options: the options of :func:`value_and_grad`.

  Returns:
    A function as :func:`value_and_grad` returns.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
  >>> w, x = jnp.ones(2), jnp.arange(8.0).reshape(4, 2)
  >>> step = jaxaccum.dp.per_example_value_and_grad(
  ...     loss_fn, jaxaccum.dp.clip_per_example(1.0), num_micro_batches=2)
  >>> loss, grads = step(w, x)
  >>> bool(jnp.linalg.norm(grads) <= 1.0)
  True
  """
  if transform is None or {"per_example", "per_example_transform"} & set(options):
    raise TypeError(
        "per_example_value_and_grad(fun, transform, **options) takes the transform once, as "
        f"its second argument, got transform={transform!r} and options {sorted(options)}: "
        "e.g. per_example_value_and_grad(fun, jaxaccum.dp.clip_per_example(1.0)), or "
        "jaxaccum.value_and_grad(fun, per_example=...). With no transform, use "
        "jaxaccum.value_and_grad.")
  return _transforms.make_value_and_grad(fun, {**options, "per_example": transform},
                                         where="per_example_value_and_grad")


def check_per_example_loss(fun: Callable[..., Any], *, rtol: float = 1e-4,
                           **options: Any) -> Callable[..., dict[str, float]]:
  """Checks on a sample batch that ``fun`` is a sum or mean of per-row losses.

  Per-example clipping (:func:`jaxaccum.dp.clip_per_example`) runs ``fun`` on each example
  alone, as a batch of one. A loss that mixes the rows of its batch (a contrastive loss,
  whose negatives are the other rows; BatchNorm's batch statistics; a loss normalised by
  the batch's own maximum) then computes something else, silently: a contrastive loss
  becomes 0, BatchNorm's output loses its input. The core cannot tell from the program
  (a mean over the batch's rows is how every loss ends), so this compares, on the batch
  given: ``fun``'s value and gradient on the whole batch against the same built from
  each example alone (the identity as ``per_example``), both through
  :func:`jaxaccum.value_and_grad` in one micro-batch with ``options``. For a loss that
  is a mean (or sum, or ``reduce="weighted"`` ratio) of per-row losses they agree to
  float rounding; otherwise this raises. Run it once, outside the training step, on a
  small batch: it forms every example's gradient.

  Randomness differs between the two (one key for the batch, one per example), so
  ``rng_argnums``/``rng_argnames`` are refused: check a deterministic version (dropout
  off). Only the default ``keep_batch_dim=True`` layout is checked (user-level units have
  no batch loss to compare with), and not through the Flax adapters.

  Args:
    fun: the loss, as given to :func:`jaxaccum.value_and_grad`.
    rtol: the largest relative difference accepted (of the value, and of the gradient's
      L2 norm of the difference against the batch gradient's norm).
    **options: :func:`jaxaccum.value_and_grad`'s options (``argnums``,
      ``batch_argnums``, ``has_aux``, ``reduce``, ``state_argnums``...);
      ``num_micro_batches``/``micro_batch_size`` and ``with_info`` are ignored, and a
      :class:`jaxaccum.dp.ClipPerExample` as ``per_example`` is replaced by the
      identity.

  Returns:
    A function of ``fun``'s arguments that returns ``{"value": ..., "grads": ...}``, the
    relative differences found, or raises ``ValueError`` naming them.

  Raises:
    ValueError: ``rng_argnums``/``rng_argnames``, ``keep_batch_dim=False`` or an
      ``example_mask`` given; or, when called, a difference above ``rtol`` (or a
      non-finite per-example result where the batch's is finite).

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> def contrastive(w, z):
  ...   s = (z @ w) @ (z @ w).T  # every row against every other row
  ...   return jnp.mean(jax.nn.logsumexp(s, axis=1) - jnp.diagonal(s))
  >>> z = jnp.arange(12.0).reshape(4, 3) / 10
  >>> jaxaccum.dp.check_per_example_loss(contrastive)(jnp.eye(3), z)
  Traceback (most recent call last):
  ...
  ValueError: check_per_example_loss: the loss computed from each example alone ...
  """
  for name in ("rng_argnums", "rng_argnames"):
    if options.setdefault(name, None) is not None:
      raise ValueError(
          f"check_per_example_loss: {name}={options[name]!r} is set, but the batch and "
          "each example alone draw different random numbers, so their losses differ for "
          "that reason alone. Check a deterministic version of fun (dropout off), without "
          f"{name}.")
  transform = options.pop("per_example", None)
  if "per_example_transform" in options:  # the deprecated spelling
    _options.warn_deprecated("check_per_example_loss", "per_example_transform")
    transform = options.pop("per_example_transform")
  if isinstance(transform, ClipPerExample) and (
      not transform.keep_batch_dim or transform.example_mask is not None):
    what = ("keep_batch_dim=False" if not transform.keep_batch_dim else
            f"example_mask={transform.example_mask!r}")
    raise ValueError(
        f"check_per_example_loss: clip_per_example({what}) is not checked: "
        + ("fun takes one unit's rows, with no batch loss to compare against."
           if not transform.keep_batch_dim else
           "pass a batch without padding and drop example_mask."))
  if not (isinstance(rtol, (int, float)) and not isinstance(rtol, bool) and rtol > 0):
    raise ValueError(f"check_per_example_loss: rtol must be a positive number, got {rtol!r}.")
  for name in ("num_micro_batches", "micro_batch_size", "with_info"):
    options.pop(name, None)
  whole = _transforms.make_value_and_grad(fun, {**options, "num_micro_batches": 1})
  alone = per_example_value_and_grad(fun, lambda g: g, num_micro_batches=1, **options)
  extra = whole.options.has_extra

  def value_of(out):
    value = out[0][0] if extra else out[0]
    return jax.tree.map(lambda v: np.asarray(v, np.float64), value), out[1]

  def check(*args: Any, **kwargs: Any) -> dict[str, float]:
    v_batch, g_batch = value_of(whole(*args, **kwargs))
    v_alone, g_alone = value_of(alone(*args, **kwargs))
    found = {"value": relative_difference(v_alone, v_batch),
             "grads": relative_difference(g_alone, g_batch)}
    if not within(found, rtol):
      raise ValueError(
          "check_per_example_loss: the loss computed from each example alone differs from "
          f"the batch's (relative difference {found['value']:.3g} in the value and "
          f"{found['grads']:.3g} in the gradient, above rtol={rtol:g}), so fun mixes the "
          "rows of its batch (a contrastive loss, BatchNorm's batch statistics, a "
          "normalisation by the batch). Per-example clipping runs fun on each example "
          "alone, where such a loss means something else: compute it from each row alone "
          "(GroupNorm or LayerNorm for BatchNorm; for a contrastive loss, treat the pair "
          "or group as the unit, keep_batch_dim=False), or do not clip per example.")
    return found

  return check
