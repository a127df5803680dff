"""``_core/_stats.py``: the squared norm, the finite test and the relative difference.

Properties, over seeded generated pytrees of mixed dtypes (float16/bfloat16/float32, complex64,
int32 leaves, NaN and inf planted): ``sq_norm`` is the float64 NumPy sum of ``|x|^2`` over the
inexact leaves (integer leaves ignored); ``all_finite`` is NumPy's ``isfinite`` over the same
leaves, each in its own dtype; ``relative_difference`` is the closed form |a - b| / |b|.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccum._core import _stats

DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64, jnp.int32)


def _tree(seed, plant=None):
  rng = np.random.default_rng(seed)
  tree = {}
  for k in range(int(rng.integers(1, 5))):
    shape = tuple(int(d) for d in rng.integers(1, 4, size=int(rng.integers(0, 3))))
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    x = rng.normal(size=shape) * 10.0 ** rng.integers(-2, 3)
    if dtype == jnp.complex64:
      x = x + 1j * rng.normal(size=shape)
    tree[f"leaf{k}"] = jnp.asarray(x, dtype)
  if plant is not None:
    tree["planted"] = jnp.array([1.0, plant], jnp.float32)
  return tree


def _inexact_f64(tree):
  return [np.asarray(x).astype(np.complex128) for x in tree.values()
          if np.issubdtype(np.asarray(x).dtype, np.inexact) or x.dtype == jnp.bfloat16]


@pytest.mark.parametrize("seed", range(12))
def test_sq_norm_is_the_float64_sum_of_squared_moduli(seed):
  tree = _tree(seed)
  ref = sum(float(np.sum(np.abs(x) ** 2)) for x in _inexact_f64(tree))
  chex.assert_trees_all_close(_stats.sq_norm(tree), jnp.float32(ref), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("plant", [None, np.nan, np.inf, -np.inf])
def test_all_finite_is_numpys_test_on_the_inexact_leaves(seed, plant):
  tree = _tree(seed, plant)
  ref = all(bool(np.all(np.isfinite(x))) for x in _inexact_f64(tree))
  assert bool(_stats.all_finite(tree)) == ref


def test_an_integer_leaf_is_neither_squared_nor_tested():
  tree = {"count": jnp.array([2**30], jnp.int32), "w": jnp.array([3.0, 4.0])}
  assert float(_stats.sq_norm(tree)) == 25.0 and bool(_stats.all_finite(tree))


@pytest.mark.parametrize("seed", range(8))
def test_relative_difference_is_the_closed_form(seed):
  rng = np.random.default_rng(seed)
  b = {"x": rng.normal(size=(3, 2)), "y": rng.normal(size=(4,))}
  a = {k: v + rng.normal(size=v.shape) * 10.0 ** rng.integers(-6, 0) for k, v in b.items()}
  diff = np.sqrt(sum(np.sum((a[k] - b[k]) ** 2) for k in b))
  size = np.sqrt(sum(np.sum(b[k] ** 2) for k in b))
  assert _stats.relative_difference(a, b) == pytest.approx(diff / size, rel=1e-12)
  zero = {k: np.zeros_like(v) for k, v in b.items()}
  assert _stats.relative_difference(a, zero) == pytest.approx(
      np.sqrt(sum(np.sum(a[k] ** 2) for k in a)), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_within_passes_only_finite_differences_at_most_rtol(seed):
  rng = np.random.default_rng(seed)
  rtol = float(10.0 ** rng.uniform(-7, -2))
  found = {f"d{k}": float(rtol * rng.uniform(0, 2)) for k in range(int(rng.integers(1, 4)))}
  assert _stats.within(found, rtol) == all(v <= rtol for v in found.values())
  assert not _stats.within({**found, "bad": float(rng.choice([np.nan, np.inf]))}, rtol)
  assert _stats.within({"exact": rtol}, rtol) and _stats.within({}, rtol)
