"""Property-based tests: random pytrees, shapes, dtypes and micro-batch counts vs the full batch."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxaccum
from jaxaccum._split import divisors
from tests._util import assert_close

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


def trees(leaf):
  """Nested dicts, lists and tuples with `leaf` at the leaves."""
  return st.recursive(
      leaf,
      lambda children: st.one_of(
          st.lists(children, min_size=1, max_size=3),
          st.lists(children, min_size=1, max_size=3).map(tuple),
          st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
      ),
      max_leaves=5,
  )


def _materialize(tree, key, lead=()):
  leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, tuple) and all(
      isinstance(i, int) for i in x))
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, lead + s) for k, s in
                                      zip(keys, leaves, strict=True)])


def _loss(params, batch):
  """Mixes every parameter leaf with every batch leaf, nonlinearly."""
  p = sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(params))
  b = sum(jnp.tanh(x.reshape(x.shape[0], -1) * p).sum(axis=1) for x in jax.tree.leaves(batch))
  return jnp.mean(b**2)


@st.composite
def problems(draw):
  param_shapes = draw(trees(shapes))
  batch_shapes = draw(trees(shapes))
  batch_size = draw(st.sampled_from([1, 2, 6, 8, 12]))
  n = draw(st.sampled_from(divisors(batch_size)))
  seed = draw(st.integers(0, 2**16))
  reduce = draw(st.sampled_from(["mean", "sum"]))
  return param_shapes, batch_shapes, batch_size, n, seed, reduce


@SETTINGS
@given(problems())
def test_random_pytrees_equal_full_batch(problem):
  param_shapes, batch_shapes, batch_size, n, seed, reduce = problem
  kp, kb = jax.random.split(jax.random.key(seed))
  params = _materialize(param_shapes, kp)
  batch = _materialize(batch_shapes, kb, lead=(batch_size,))
  fun = _loss if reduce == "mean" else (lambda p, b: _loss(p, b) * batch_size / n)
  ref_fun = _loss if reduce == "mean" else (lambda p, b: _loss(p, b) * batch_size)
  out = jax.jit(jaxaccum.value_and_grad(fun, num_micro_batches=n, reduce=reduce))(params, batch)
  assert_close(out, jax.value_and_grad(ref_fun)(params, batch), rtol=2e-5)


@SETTINGS
@given(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
       st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**16))
def test_dtypes_keep_param_dtype_and_match_float32_reference(dtype, n, seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {"w": jax.random.normal(k1, (4, 3)).astype(dtype)}
  x = jax.random.normal(k2, (8, 4)).astype(dtype)

  def loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

  loss_val, grads = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=n))(params, x)
  assert grads["w"].dtype == dtype and loss_val.dtype == dtype
  up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
  ref = jax.value_and_grad(loss)(up(params), up(x))
  # Tolerance: a few units of the dtype's rounding (f32 1e-5; bf16 8 bits; f16 11 bits).
  rtol = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}[dtype]
  assert_close(up((loss_val, grads)), ref, rtol=rtol, atol=rtol * 1e-2)


@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=8, max_size=8), st.sampled_from([1, 2, 4, 8]))
def test_weighted_with_random_token_counts(lengths, n):
  mask = jnp.arange(6)[None, :] < jnp.asarray(lengths)[:, None]
  x = jnp.linspace(-1.0, 1.0, 48).reshape(8, 6)

  def weighted(w, batch):
    x, m = batch
    return jnp.sum(jnp.sin(x * w) * m), jnp.sum(m)

  def token_mean(w, batch):
    num, den = weighted(w, batch)
    return jnp.where(den > 0, num / jnp.maximum(den, 1), 0.0)

  w = jnp.float32(1.3)
  out = jax.jit(jaxaccum.value_and_grad(weighted, num_micro_batches=n, reduce="weighted"))(
      w, (x, mask))
  assert_close(out, jax.value_and_grad(token_mean)(w, (x, mask)))
  assert np.isfinite(np.asarray(out[0]))
