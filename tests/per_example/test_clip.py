"""``_per_example/_clip.py``: the clip record, called on one example's gradient.

Properties, over seeded generated gradients, bounds and groupings, against the closed form
in float64 NumPy: ``clip_per_example(C)(g) = g * min(1, C / |g|)`` (the identity for a zero
gradient), so its norm is ``min(|g|, C)``; with a pytree of bounds each group is clipped to
its own bound; ``factors`` is that min, NaN for a non-finite norm (0 under ``nan_safe``).
Bad arguments raise naming the argument and the value.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum
from jaxaccum._per_example import _clip


def _grad(seed):
  rng = np.random.default_rng(seed)
  scale = 10.0 ** rng.integers(-3, 4)
  return {"w": rng.normal(size=(3, 2)) * scale, "b": rng.normal(size=(2,)) * scale}, rng


def _norm64(tree):
  return np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in tree.values()))


@pytest.mark.parametrize("seed", range(16))
def test_the_clip_is_the_closed_form(seed):
  g, rng = _grad(seed)
  c = float(rng.uniform(0.01, 5.0)) * _norm64(g)  # below and above the norm alike
  clipped = jaxaccum.dp.clip_per_example(c)({k: jnp.asarray(v, jnp.float32)
                                             for k, v in g.items()})
  factor = min(1.0, c / _norm64(g))
  chex.assert_trees_all_close(clipped, {k: v * factor for k, v in g.items()}, rtol=2e-6,
                              atol=1e-30)
  assert _norm64(clipped) <= c * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_a_pytree_bound_clips_each_group_to_its_own(seed):
  g, rng = _grad(seed)
  bounds = {"w": float(rng.uniform(0.1, 3.0)), "b": float(rng.uniform(0.1, 3.0))}
  clipped = jaxaccum.dp.clip_per_example(bounds)({k: jnp.asarray(v, jnp.float32)
                                                  for k, v in g.items()})
  for k, v in g.items():
    factor = min(1.0, bounds[k] / np.sqrt(np.sum(v ** 2)))
    chex.assert_trees_all_close(clipped[k], v * factor, rtol=2e-6, atol=1e-30)


def test_factors_of_zero_and_non_finite_norms():
  clip = jaxaccum.dp.clip_per_example(1.0)
  got = np.asarray(clip.factors(jnp.array([0.0, 0.5, 4.0, np.inf, np.nan])))
  chex.assert_trees_all_close(got[:3], np.array([1.0, 1.0, 0.25], np.float32))
  assert np.isnan(got[3:]).all()
  safe = np.asarray(jaxaccum.dp.clip_per_example(1.0, nan_safe=True).factors(
      jnp.array([np.inf, np.nan, 2.0])))
  chex.assert_trees_all_equal(safe, np.array([0.0, 0.0, 0.5], np.float32))


def test_the_record_is_what_clip_per_example_returns():
  clip = jaxaccum.dp.clip_per_example(2.0, "materialize", example_mask="m")
  assert isinstance(clip, _clip.ClipPerExample) and clip is not jaxaccum.dp.clip_per_example(
      2.0, "materialize", example_mask="m")
  assert (clip.max_norm, clip.method, clip.example_mask) == (2.0, "materialize", "m")


@pytest.mark.parametrize("bad, match", [
    (dict(max_norm=-1.0), "max_norm"), (dict(max_norm=0.0), "max_norm"),
    (dict(max_norm=1.0, method="fast"), "method"),
    (dict(max_norm=1.0, example_mask=3), "example_mask")])
def test_bad_arguments_name_themselves(bad, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jaxaccum.dp.clip_per_example(**bad)
