"""``jaxaccum.NoiseScale``: the simple gradient noise scale, smoothed over steps.

One step's estimates of ``|G|^2`` and ``tr(Sigma)`` (:class:`jaxaccum.AccumInfo`) are
unbiased but very noisy, and their ratio is biased and noisier still. As in McCandlish et
al. (2018, appendix A) and GPT-NeoX, :class:`NoiseScale` keeps an exponential moving
average (EMA) of each estimate and takes the ratio of the averages.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum._core import _validate
from jaxaccum._core._info import AccumInfo


class NoiseScaleState(NamedTuple):
  """State of :class:`jaxaccum.NoiseScale`: two EMAs and how many steps fed them.

  Attributes:
    count: int32, the steps whose estimates were finite and entered the averages
      (saturating at the largest int32).
    grad_sq_norm_ema: float32, the EMA of the ``|G|^2`` estimates, before bias correction.
    trace_cov_ema: float32, the EMA of the ``tr(Sigma)`` estimates, before bias correction.
  """

  count: jax.Array
  grad_sq_norm_ema: jax.Array
  trace_cov_ema: jax.Array


@dataclasses.dataclass(frozen=True)
class NoiseScale:
  """Tracks the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` across steps.

  Each :meth:`update` takes one step's :class:`jaxaccum.AccumInfo` (from
  ``jaxaccum.value_and_grad(..., with_info=True)``, or ``state.info`` of a
  ``MultiSteps(..., with_info=True)``) and folds its two unbiased estimates,
  ``info.grad_sq_norm_estimate()`` and ``info.trace_cov_estimate()``, into exponential
  moving averages::

      ema <- decay * ema + (1 - decay) * estimate

  :meth:`grad_sq_norm` and :meth:`trace_cov` return the averages *bias-corrected* as in
  Adam, ``ema / (1 - decay**count)``, so that the first steps are not pulled towards the
  initial zeros; :meth:`b_simple` is their ratio (the correction cancels in it).

  A step whose estimates are not finite is left out: both averages and ``count`` stay as
  they were. Estimates are NaN when a step has a single sample (one micro-batch on one
  device) and on :class:`jaxaccum.MultiSteps` calls that complete no window, so calling
  :meth:`update` on every call is safe. Single estimates can be negative (they are
  differences of noisy terms); the averages settle as steps accumulate: read
  :meth:`b_simple` after a few times ``1 / (1 - decay)`` steps.

  Everything is pure and jittable; the state is a ``NamedTuple`` of arrays, safe to carry
  through :func:`jax.lax.scan` and to checkpoint.

  Args:
    decay: the EMA's decay, a float in ``[0, 1)``; averages span about ``1 / (1 - decay)``
      steps.

  Raises:
    TypeError, ValueError: ``decay`` is not a real number in ``[0, 1)``.

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> ns = jaxaccum.NoiseScale(decay=0.9)
  >>> # One step: 4 micro-batches of 8 rows with mean |g_i|^2 = 3 and |G_B|^2 = 1.5.
  >>> info = jaxaccum.AccumInfo(
  ...     num_micro_batches=jnp.int32(4), micro_batch_size=jnp.float32(8),
  ...     batch_size=jnp.float32(32), micro_grad_sq_norm=jnp.float32(3.0),
  ...     batch_grad_sq_norm=jnp.float32(1.5), num_samples=jnp.int32(4),
  ...     skipped=jnp.int32(0))
  >>> state = ns.update(ns.init(), info)
  >>> float(ns.grad_sq_norm(state)), float(ns.trace_cov(state)), float(ns.b_simple(state))
  (1.0, 16.0, 16.0)
  """

  decay: float = 0.99

  def __post_init__(self):
    decay = self.decay
    if not _validate.is_real(decay):
      raise TypeError(
          f"NoiseScale: decay must be a float in [0, 1), got {decay!r} of type "
          f"{type(decay).__name__}.")
    if not 0 <= decay < 1:
      raise ValueError(
          f"NoiseScale: decay must be in [0, 1) (averages span about 1 / (1 - decay) "
          f"steps), got decay={decay}. Try decay=0.99.")
    object.__setattr__(self, "decay", float(decay))

  def init(self) -> NoiseScaleState:
    """The empty state: no steps seen, both averages 0."""
    return NoiseScaleState(count=jnp.zeros([], jnp.int32),
                           grad_sq_norm_ema=jnp.zeros([], jnp.float32),
                           trace_cov_ema=jnp.zeros([], jnp.float32))

  def update(self, state: NoiseScaleState, info: AccumInfo) -> NoiseScaleState:
    """Folds one step's estimates into the averages; non-finite estimates are left out.

    Args:
      state: from :meth:`init` or the previous :meth:`update`.
      info: the step's :class:`jaxaccum.AccumInfo`.

    Returns:
      The new state.
    """
    if not isinstance(info, AccumInfo):
      raise TypeError(
          "NoiseScale.update takes the step's jaxaccum.AccumInfo (from "
          "value_and_grad(..., with_info=True) or a MultiStepsState's info), got "
          f"{type(info).__name__}.")
    g2 = jnp.asarray(info.grad_sq_norm_estimate(), jnp.float32)
    tr = jnp.asarray(info.trace_cov_estimate(), jnp.float32)
    if g2.shape != () or tr.shape != ():
      raise TypeError(
          f"NoiseScale.update takes the AccumInfo of one step (scalar fields), got "
          f"estimates of shape {tuple(g2.shape)}; use jax.lax.scan over steps.")
    ok = jnp.isfinite(g2) & jnp.isfinite(tr)
    d = jnp.float32(self.decay)

    def ema(old, x):
      return jnp.where(ok, d * old + (1 - d) * jnp.where(ok, x, 0), old)

    count = jnp.asarray(state.count, jnp.int32)
    count = jnp.where(ok & (count < jnp.iinfo(jnp.int32).max), count + 1, count)
    return NoiseScaleState(count=count,
                           grad_sq_norm_ema=ema(state.grad_sq_norm_ema, g2),
                           trace_cov_ema=ema(state.trace_cov_ema, tr))

  def _debias(self, state: NoiseScaleState, ema: jax.Array) -> jax.Array:
    count = jnp.asarray(state.count)
    weight = 1 - jnp.float32(self.decay) ** count.astype(jnp.float32)
    return jnp.where(count > 0, ema / jnp.where(count > 0, weight, 1), jnp.nan)

  def grad_sq_norm(self, state: NoiseScaleState) -> jax.Array:
    """The bias-corrected average of the ``|G|^2`` estimates (NaN before any step)."""
    return self._debias(state, state.grad_sq_norm_ema)

  def trace_cov(self, state: NoiseScaleState) -> jax.Array:
    """The bias-corrected average of the ``tr(Sigma)`` estimates (NaN before any step)."""
    return self._debias(state, state.trace_cov_ema)

  def b_simple(self, state: NoiseScaleState) -> jax.Array:
    """``B_simple``: the ratio of the two averages, in the units of ``info.batch_size``."""
    return self.trace_cov(state) / self.grad_sq_norm(state)
