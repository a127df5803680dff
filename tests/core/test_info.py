"""with_info=True: the gradient noise statistics, checked by hand and for unbiasedness.

Linear regression with Gaussian inputs has a closed-form per-example gradient covariance:
with x ~ N(0, I_d), y = x . w* + eps, eps ~ N(0, s^2) and the loss 0.5 (x . w - y)^2, the
per-example gradient is g = x (x . r - eps) with r = w - w*, so G = E[g] = r and
Sigma = (|r|^2 + s^2) I + r r^T: |G|^2 = |r|^2 and tr(Sigma) = d (|r|^2 + s^2) + |r|^2.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum

DIM, SIGMA = 4, 0.5
W_STAR = jnp.array([1.0, -2.0, 0.5, 0.0])
W = jnp.zeros(DIM)
R2 = float(jnp.sum((W - W_STAR) ** 2))
EXACT_G2 = R2
EXACT_TR = DIM * (R2 + SIGMA**2) + R2


def mean_loss(w, batch):
  x, y = batch
  return 0.5 * jnp.mean((x @ w - y) ** 2)


def weighted_loss(w, batch):
  x, y, m = batch
  return 0.5 * jnp.sum(m * (x @ w - y) ** 2), jnp.sum(m)


def make_batch(key, rows):
  kx, ke, km = jax.random.split(key, 3)
  x = jax.random.normal(kx, (rows, DIM))
  y = x @ W_STAR + SIGMA * jax.random.normal(ke, (rows,))
  mask = (jax.random.uniform(km, (rows,)) < 0.6).astype(jnp.float32)
  return x, y, mask


def test_micro_grad_sq_norm_equals_a_hand_computation():
  x, y, m = make_batch(jax.random.key(0), 32)
  n = 4
  loss, grads, info = jax.jit(jaxaccum.value_and_grad(
      mean_loss, num_micro_batches=n, with_info=True))(W, (x, y))
  grad_of = jax.jit(jax.grad(mean_loss))
  micro = [grad_of(W, (x[i::n], y[i::n])) for i in range(n)]
  expect = np.mean([float(jnp.sum(g**2)) for g in micro])
  np.testing.assert_allclose(info.micro_grad_sq_norm, expect, rtol=1e-5)
  np.testing.assert_allclose(info.batch_grad_sq_norm, float(jnp.sum(grads**2)), rtol=1e-6)
  assert int(info.num_micro_batches) == n and int(info.num_samples) == n
  np.testing.assert_allclose(info.micro_batch_size, 8.0)
  np.testing.assert_allclose(info.batch_size, 32.0)
  b, big = 8.0, 32.0
  gb2, gs2 = float(info.batch_grad_sq_norm), expect
  np.testing.assert_allclose(info.grad_sq_norm_estimate(), (big * gb2 - b * gs2) / (big - b),
                             rtol=1e-4)
  np.testing.assert_allclose(info.trace_cov_estimate(), (gs2 - gb2) / (1 / b - 1 / big),
                             rtol=1e-4)
  np.testing.assert_allclose(info.b_simple(),
                             info.trace_cov_estimate() / info.grad_sq_norm_estimate(), rtol=1e-6)
  # The other outputs are unchanged by with_info.
  ref = jax.jit(jax.value_and_grad(mean_loss))(W, (x, y))
  chex.assert_trees_all_close((loss, grads), ref, rtol=1e-5)


def test_weighted_samples_are_token_means_and_sizes_the_denominators():
  x, y, m = make_batch(jax.random.key(1), 32)
  n = 4
  _, grads, info = jax.jit(jaxaccum.value_and_grad(
      weighted_loss, num_micro_batches=n, reduce="weighted", with_info=True))(W, (x, y, m))
  dens = [float(jnp.sum(m[i::n])) for i in range(n)]
  grad_of = jax.jit(jax.grad(lambda w, b: weighted_loss(w, b)[0]))
  micro = [grad_of(W, (x[i::n], y[i::n], m[i::n])) / d
           for i, d in zip(range(n), dens, strict=True)]
  np.testing.assert_allclose(info.micro_grad_sq_norm,
                             np.mean([float(jnp.sum(g**2)) for g in micro]), rtol=1e-5)
  np.testing.assert_allclose(info.batch_size, sum(dens))
  np.testing.assert_allclose(info.micro_batch_size, n / sum(1 / d for d in dens), rtol=1e-6)
  np.testing.assert_allclose(info.batch_grad_sq_norm, float(jnp.sum(grads**2)), rtol=1e-6)


def test_single_sample_gives_nan_not_an_error():
  x, y, _ = make_batch(jax.random.key(2), 8)
  _, _, info = jax.jit(jaxaccum.value_and_grad(mean_loss, num_micro_batches=1,
                                               with_info=True))(W, (x, y))
  assert bool(jnp.isnan(info.grad_sq_norm_estimate()))
  assert bool(jnp.isnan(info.trace_cov_estimate()))
  assert bool(jnp.isnan(info.b_simple()))


def _estimates(step, batch_fn, reps):
  keys = jax.random.split(jax.random.key(42), reps)

  def one(key):
    info = step(batch_fn(key))
    return info.grad_sq_norm_estimate(), info.trace_cov_estimate()

  g2, tr = jax.jit(lambda ks: jax.lax.map(one, ks))(keys)
  return np.asarray(g2), np.asarray(tr)


def _assert_unbiased(values, exact):
  mean, se = values.mean(), values.std(ddof=1) / np.sqrt(len(values))
  assert se < 0.15 * abs(exact), (mean, se, exact)  # enough draws to have power
  assert abs(mean - exact) < 4 * se, (mean, se, exact)


@pytest.mark.parametrize("reduce", ["mean", "weighted"])
def test_estimates_are_unbiased(reduce):
  rows, n, reps = 64, 8, 400
  if reduce == "mean":
    vg = jaxaccum.value_and_grad(mean_loss, num_micro_batches=n, with_info=True)
    batch_fn = lambda k: make_batch(k, rows)[:2]  # noqa: E731
  else:
    vg = jaxaccum.value_and_grad(weighted_loss, num_micro_batches=n, reduce="weighted",
                                 with_info=True)
    batch_fn = lambda k: make_batch(k, rows)  # noqa: E731
  g2, tr = _estimates(lambda b: vg(W, b)[2], batch_fn, reps)
  _assert_unbiased(g2, EXACT_G2)
  _assert_unbiased(tr, EXACT_TR)


def test_estimates_are_unbiased_under_data_axis():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  rows, n, reps = 64, 2, 300
  vg = jaxaccum.value_and_grad(mean_loss, num_micro_batches=n, with_info=True,
                               data_axis=jaxaccum.DataParallel("data", mesh=mesh))

  def batch_fn(k):
    x, y, _ = make_batch(k, rows)
    return (jax.sharding.reshard(x, P("data")), jax.sharding.reshard(y, P("data")))

  with jax.set_mesh(mesh):
    _, _, info = jax.jit(lambda b: vg(W, b))(batch_fn(jax.random.key(0)))
    assert int(info.num_samples) == n * 8
    np.testing.assert_allclose(info.micro_batch_size, rows / (n * 8))
    # Samples are per shard: compare with a hand computation over the 16 shard pieces.
    x, y, _ = make_batch(jax.random.key(0), rows)
    local = rows // 8
    pieces = [(x[d * local:(d + 1) * local][i::n], y[d * local:(d + 1) * local][i::n])
              for d in range(8) for i in range(n)]
    grad_of = jax.jit(jax.grad(mean_loss))
    expect = np.mean([float(jnp.sum(grad_of(W, p) ** 2)) for p in pieces])
    np.testing.assert_allclose(info.micro_grad_sq_norm, expect, rtol=1e-5)
    g2, tr = _estimates(lambda b: vg(W, b)[2], batch_fn, reps)
  _assert_unbiased(g2, EXACT_G2)
  _assert_unbiased(tr, EXACT_TR)


def test_info_is_one_scalar_reduction_after_the_loop_under_data_axis():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  x, y, _ = make_batch(jax.random.key(0), 64)
  counts = {}
  with jax.set_mesh(mesh):
    batch = (jax.sharding.reshard(x, P("data")), jax.sharding.reshard(y, P("data")))
    for with_info in (False, True):
      step = jax.jit(jaxaccum.value_and_grad(mean_loss, num_micro_batches=4,
                                             with_info=with_info, data_axis="data"))
      cs = jaxaccum.planning.collectives(step, W, batch)
      assert cs.num_loops, cs
      assert not [c for c in cs if c.in_loop], cs
      counts[with_info] = sum(c.kind == "all-reduce" for c in cs)
  assert counts[True] <= counts[False] + 1, counts
