"""``jaxaccum.AccumInfo``: what accumulation sees that a full-batch step does not.

With ``with_info=True`` the transforms return, next to the loss and gradients, the squared
norms of the micro-batch gradients and of their mean. From the two, McCandlish et al.
(2018, "An Empirical Model of Large-Batch Training", appendix A) estimate without bias the
true gradient's squared norm ``|G|^2`` and the trace of the per-example gradient covariance
``tr(Sigma)``, and their ratio, the simple noise scale ``B_simple``: about the batch size
beyond which a larger batch stops paying.

Each *sample* is one micro-batch gradient ``g_i`` of ``b`` rows (per data shard under
``data_axis``), normalised as its reduction says; ``G_B`` is the gradient of the whole
batch of ``B`` rows. For ``E|g_i|^2 = |G|^2 + tr(Sigma) / b`` and
``E|G_B|^2 = |G|^2 + tr(Sigma) / B``::

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

where ``|G_b|^2`` is the mean of ``|g_i|^2`` over the samples. Under
``reduce="weighted"`` the sizes are the denominators (e.g. real tokens): ``B`` is their
total and ``b`` the harmonic mean of the samples' denominators, which keeps the estimates
unbiased when the samples have unequal sizes (``E|g_i|^2 = |G|^2 + tr(Sigma) / b_i``
averages to ``|G|^2 + tr(Sigma) mean(1 / b_i)``). Samples whose denominator is 0 are left
out. With a single sample (``B == b``) the estimates are NaN: there is no spread to
measure.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class AccumInfo(NamedTuple):
  """Statistics of one accumulated step, returned with ``with_info=True``.

  A pytree of arrays (a ``NamedTuple``), safe to return from ``jax.jit``, to carry through
  ``lax.scan`` and to checkpoint.

  Attributes:
    num_micro_batches: int32, the micro-batches that ran (``k``: ``active_micro_batches``
      when given, else ``N``), skipped ones included. Under ``data_axis`` each of the ``D``
      data shards runs its own piece of every micro-batch and each piece counts, ``k * D``:
      the pieces that ``skipped`` and ``num_samples`` count, and the count a mean divides by.
    micro_batch_size: float32, ``b``: rows per micro-batch per data shard; under
      ``reduce="weighted"`` the harmonic mean of the samples' denominators.
    batch_size: float32, ``B``: rows of the micro-batches that ran (the total denominator
      under ``reduce="weighted"``).
    micro_grad_sq_norm: float32, the mean over samples of ``|g_i|^2``.
    batch_grad_sq_norm: float32, ``|G_B|^2`` of the returned gradient (as a mean: the
      summed gradient divided by ``B`` under ``reduce="sum"``).
    num_samples: int32, the samples behind ``micro_grad_sq_norm``: micro-batches times
      data shards, less skipped ones and those with denominator 0.
    skipped: int32, micro-batches (pieces, under ``data_axis``) dropped by
      ``skip_nonfinite=True`` (0 otherwise).
    terms: the value of each loss term, each normalised by its own rule, when ``reduce``
      is a dict of terms; ``None`` otherwise.
    example_grad_norms: under ``per_example=jaxaccum.dp.clip_per_example(C)``, a
      float32 vector of each example's gradient L2 norm before clipping, in the batch's
      row order (all ``B`` rows, every data shard's, padding included; NaN for the rows of
      micro-batches that did not run under ``active_micro_batches``), for monitoring and
      adaptive clipping (e.g. the fraction clipped, ``mean(norms > C)``); ``None``
      otherwise. Under ``keep_batch_dim=False`` one entry per unit.
  """

  num_micro_batches: jax.Array
  micro_batch_size: jax.Array
  batch_size: jax.Array
  micro_grad_sq_norm: jax.Array
  batch_grad_sq_norm: jax.Array
  num_samples: jax.Array
  skipped: jax.Array
  terms: Any = None
  example_grad_norms: Any = None

  def grad_sq_norm_estimate(self) -> jax.Array:
    """The unbiased estimate of the true gradient's squared norm ``|G|^2``."""
    b, big = self.micro_batch_size, self.batch_size
    ok = (self.num_samples > 1) & (big > b)
    den = jnp.where(ok, big - b, 1.0)
    est = (big * self.batch_grad_sq_norm - b * self.micro_grad_sq_norm) / den
    return jnp.where(ok, est, jnp.nan)

  def trace_cov_estimate(self) -> jax.Array:
    """The unbiased estimate of ``tr(Sigma)``, the per-example gradient covariance's trace."""
    b, big = self.micro_batch_size, self.batch_size
    ok = (self.num_samples > 1) & (big > b) & (b > 0)
    den = jnp.where(ok, 1.0 / jnp.where(ok, b, 1.0) - 1.0 / jnp.where(ok, big, 2.0), 1.0)
    est = (self.micro_grad_sq_norm - self.batch_grad_sq_norm) / den
    return jnp.where(ok, est, jnp.nan)

  def b_simple(self) -> jax.Array:
    """The simple noise scale ``tr(Sigma) / |G|^2`` of this one step (noisy: average it)."""
    return self.trace_cov_estimate() / self.grad_sq_norm_estimate()
