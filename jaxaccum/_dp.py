"""``dp_noise``: the Gaussian noise of DP-SGD, added to an accumulated clipped gradient.

:func:`jaxaccum.clip_per_example` gives the mean (or sum) of the clipped per-example
gradients; DP-SGD then adds Gaussian noise of standard deviation ``noise_multiplier *
l2_norm_clip`` to the sum, that is ``noise_multiplier * l2_norm_clip / batch_size`` to the
mean. ``optax.contrib.dpsgd`` does both steps on per-example gradients (a leading batch
axis); :func:`dp_noise` is its noise step alone, for gradients that are already clipped and
reduced, as an optax transformation to chain before the optimizer.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import numpy as np
import optax


class DpNoiseState(NamedTuple):
  """The state of :func:`dp_noise`: the key of the next step's noise."""

  rng_key: jax.Array


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
  if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.number)):
    raise TypeError(f"dp_noise: {name} must be a number, got {name}={value!r}.")
  v = float(value)
  if not (v >= 0 if allow_zero else v > 0) or not np.isfinite(v):
    raise ValueError(
        f"dp_noise: {name} must be {'non-negative' if allow_zero else 'positive'} and "
        f"finite, got {name}={value!r}.")
  return v


def dp_noise(l2_norm_clip: float, noise_multiplier: float, *, batch_size: float,
             key: jax.Array) -> optax.GradientTransformation:
  """Adds DP-SGD's Gaussian noise to a mean of clipped per-example gradients.

  Each update leaf gets ``noise_multiplier * l2_norm_clip / batch_size`` times a standard
  normal draw: the noise that ``optax.contrib.differentially_private_aggregate`` adds to
  the sum of the clipped per-example gradients before dividing by the batch size, with the
  same keys (``optax.chain(dp_noise(C, sigma, batch_size=B, key=k), optax.sgd(lr))`` on the
  mean that ``clip_per_example(C)`` gives equals ``optax.contrib.dpsgd(lr, C, sigma, ...)``
  on the per-example gradients, started from key ``k``). It must come first in a chain,
  before any transform that rescales the updates.

  Args:
    l2_norm_clip: the clip norm ``C`` of :func:`jaxaccum.clip_per_example`.
    noise_multiplier: the ratio of the noise's standard deviation (on the sum) to ``C``.
    batch_size: what the gradient is a mean over (``B``, or the expected batch size under
      Poisson sampling); ``1`` for a sum (``reduce="sum"``).
    key: a PRNG key; each update splits it (the new state keeps the first part).

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`DpNoiseState`.

  >>> import jax, jax.numpy as jnp, optax
  >>> import jaxaccum
  >>> tx = optax.chain(jaxaccum.dp_noise(1.0, 1.1, batch_size=256, key=jax.random.key(0)),
  ...                  optax.sgd(0.1))
  >>> grads = {"w": jnp.zeros(3)}
  >>> updates, state = tx.update(grads, tx.init(grads))
  >>> updates["w"].shape
  (3,)
  """
  clip = _positive("l2_norm_clip", l2_norm_clip)
  sigma = _positive("noise_multiplier", noise_multiplier, allow_zero=True)
  size = _positive("batch_size", batch_size)
  std = clip * sigma

  def init_fn(params):
    del params
    return DpNoiseState(rng_key=key)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    new_key, *keys = jax.random.split(state.rng_key, len(leaves) + 1)
    noised = [g + std * jax.random.normal(k, g.shape, g.dtype) / size
              for g, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, noised), DpNoiseState(rng_key=new_key)

  return optax.GradientTransformation(init_fn, update_fn)
