"""``_per_example/_norm.py``: the clip's norms without overflow and its scaling.

Properties, over seeded generated pytrees whose magnitudes span 1e-30 to 1e30 (so the
squared norm leaves float32's range both ways): ``norm`` is NumPy's float64 L2 norm of the
inexact leaves to float32 rounding, NaN if an entry is NaN, inf if one is infinite;
``norm_of_norms`` of the groups' norms is the whole tree's norm; ``scale`` is ``c * g``
except that a factor of 0 gives exactly 0, even for a non-finite ``g``.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccum._per_example import _norm


def _leaves(seed):
  rng = np.random.default_rng(seed)
  exponent = float(rng.choice([-30, -15, 0, 15, 30]))
  return [jnp.asarray(rng.normal(size=(int(rng.integers(1, 5)),)) * 10.0 ** exponent,
                      jnp.float32) for _ in range(int(rng.integers(1, 5)))]


def _ref(leaves):
  return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in leaves)))


@pytest.mark.parametrize("seed", range(16))
def test_norm_is_the_float64_norm_at_every_magnitude(seed):
  leaves = _leaves(seed)
  ref = _ref(leaves)
  got = float(_norm.norm(leaves))
  assert np.isfinite(got) and got == pytest.approx(ref, rel=1e-5), (got, ref)


@pytest.mark.parametrize("bad, expected", [(np.nan, np.nan), (np.inf, np.inf),
                                           (-np.inf, np.inf)])
def test_a_non_finite_entry_gives_a_non_finite_norm(bad, expected):
  got = float(_norm.norm([jnp.array([1.0, bad]), jnp.ones(3)]))
  assert (np.isnan(got) and np.isnan(expected)) or got == expected


def test_an_empty_or_zero_tree_has_norm_zero():
  assert float(_norm.norm([])) == 0.0 and float(_norm.norm([jnp.zeros(4)])) == 0.0


@pytest.mark.parametrize("seed", range(12))
def test_group_norms_then_norm_of_norms_is_the_whole_norm(seed):
  leaves = _leaves(seed)
  rng = np.random.default_rng(seed + 1000)
  count = int(rng.integers(1, 4))
  groups = [int(g) for g in rng.integers(0, count, size=len(leaves))]
  per_group = _norm.group_norms(leaves, groups, count)
  for k in range(count):
    ref = _ref([x for x, g in zip(leaves, groups, strict=True) if g == k])
    assert float(per_group[k]) == pytest.approx(ref, rel=1e-5)
  assert float(_norm.norm_of_norms(per_group)) == pytest.approx(_ref(leaves), rel=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_scale_multiplies_and_a_zero_factor_removes_even_non_finite_rows(seed):
  rng = np.random.default_rng(seed)
  g = rng.normal(size=(5, 3)).astype(np.float32)
  g[int(rng.integers(5)), 0] = rng.choice([np.nan, np.inf])
  c = rng.uniform(0.0, 1.0, size=5).astype(np.float32)
  c[rng.integers(5, size=2)] = 0.0
  got = np.asarray(_norm.scale_rows(jnp.asarray(g), jnp.asarray(c)))
  with np.errstate(invalid="ignore"):  # inf * 0 in the rows the reference drops
    ref = np.where(c[:, None] == 0, 0.0, g * c[:, None])
  chex.assert_trees_all_equal(got, ref.astype(np.float32))
  bf = _norm.scale(jnp.asarray(g, jnp.bfloat16), jnp.float32(0.5))
  assert bf.dtype == jnp.bfloat16
