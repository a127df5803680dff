"""Property-based tests: random pytrees, shapes, dtypes and micro-batch counts vs the full batch.

Each draw is compared with the full batch through plain ``jax.value_and_grad`` (or, for aux
reductions, with a Python loop over the micro-batches sliced by hand, ``x[i::n]``) by
``chex.assert_trees_all_close`` with ``strict=True``: the same structure, shapes and dtypes,
and values within ``atol + rtol * |expected|`` entry by entry. float32: ``rtol=1e-5`` (the
accumulated sum adds the same terms in another order, a few units of the last place), and an
``atol`` for entries that cancel to near zero, whose error is relative to the terms summed,
not to the result (each test says its scale).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import jaxaccum
from jaxaccum._core._split import divisors

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


def _materialize(tree, rng, lead=()):
  """Standard normal float32 leaves of the shapes in `tree`, drawn on the host (random
  shapes: no eager device op compiled for each)."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, tuple) and all(
      isinstance(i, int) for i in x))
  return jax.tree.unflatten(treedef, [jnp.asarray(rng.standard_normal(lead + s, np.float32))
                                      for s in leaves])


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


@settings(SETTINGS, max_examples=8)  # the reference-model test draws the options widely
@given(problems())
def test_random_pytrees_equal_full_batch(problem):
  param_shapes, batch_shapes, batch_size, n, seed, reduce = problem
  rng = np.random.default_rng(seed)
  params = _materialize(param_shapes, rng)
  batch = _materialize(batch_shapes, rng, lead=(batch_size,))
  fun = _loss if reduce == "mean" else (lambda p, b: _loss(p, b) * batch_size / n)
  ref_fun = _loss if reduce == "mean" else (lambda p, b: _loss(p, b) * batch_size)
  out = jax.jit(jaxaccum.value_and_grad(fun, num_micro_batches=n, reduce=reduce))(params, batch)
  # The loss is a mean of tanh terms (|.| <= 1) times up to the batch size under "sum":
  # round-off is relative to that scale, so atol grows with it.
  scale = 1.0 if reduce == "mean" else batch_size
  chex.assert_trees_all_close(out, jax.jit(jax.value_and_grad(ref_fun))(params, batch),
                              rtol=2e-5, atol=2e-6 * scale, strict=True)


DTYPE_ROWS = 256


def _dtype_loss(p, x):  # >= 1 per micro-batch, so the running sum of N values grows to >= N
  return jnp.mean(1.0 + jnp.tanh(x @ p["w"]) ** 2)


@functools.partial(jax.jit, static_argnums=2)
def _dtype_reference(params, x, n):
  """Each micro-batch x[i::n] in x's dtype, a float32 sum, one rounding; in float32."""
  dtype = x.dtype
  stacked = x[jnp.arange(n)[:, None] + n * jnp.arange(DTYPE_ROWS // n)[None, :]]  # [i] = x[i::n]
  values, per_mb = jax.vmap(jax.value_and_grad(_dtype_loss), in_axes=(None, 0))(params, stacked)
  ref = jax.tree.map(lambda v: (jnp.sum(v.astype(jnp.float32), axis=0) / n).astype(dtype),
                     (values, per_mb))
  return jax.tree.map(lambda a: a.astype(jnp.float32), ref)


@settings(SETTINGS, max_examples=6)
@example(jnp.bfloat16, DTYPE_ROWS, 0)  # the case where a bf16 running sum is visibly off
@given(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
       st.sampled_from([1, 4, 16, DTYPE_ROWS]), st.integers(0, 2**16))
def test_dtypes_keep_param_dtype_and_sum_micro_batches_in_float32(dtype, n, seed):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.standard_normal((4, 3), np.float32).astype(dtype))}
  x = jnp.asarray(rng.standard_normal((DTYPE_ROWS, 4), np.float32).astype(dtype))

  loss_val, grads = jax.jit(jaxaccum.value_and_grad(_dtype_loss, num_micro_batches=n))(params, x)
  assert grads["w"].dtype == dtype and loss_val.dtype == dtype
  # The reference: each micro-batch x[i::n] in `dtype`, a float32 sum, one rounding.
  ref = _dtype_reference(params, x, n)
  up = lambda t: jax.tree.map(lambda a: np.asarray(a).astype(np.float32), t)  # noqa: E731
  # Tolerance: the final rounding plus round-off of the micro-batch results, which may be
  # fused differently in the scan: two units of the dtype's last place (bf16 8 bits, f16
  # 11 bits). A running sum in bf16 is 11% off in the value here (measured, n = 256).
  # The value is >= 1; gradient entries are means of terms of size about 1, so an entry that
  # cancels to near zero is held to the same absolute bound (rtol times 1).
  rtol = {jnp.float32: 1e-5, jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10}[dtype]
  chex.assert_trees_all_close(up((loss_val, grads)), up(ref), rtol=rtol, atol=rtol,
                              strict=True)


def _token_weighted(w, batch):
  x, m = batch
  return jnp.sum(jnp.sin(x * w) * m), jnp.sum(m)


def _token_mean(w, batch):
  num, den = _token_weighted(w, batch)
  return jnp.where(den > 0, num / jnp.maximum(den, 1), 0.0)


# The full-batch reference, compiled once for every draw (the shapes do not change).
_token_mean_value_and_grad = jax.jit(jax.value_and_grad(_token_mean))


@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=8, max_size=8), st.sampled_from([1, 2, 4, 8]))
def test_weighted_with_random_token_counts(lengths, n):
  mask = jnp.asarray(np.arange(6)[None, :] < np.asarray(lengths)[:, None])
  x = jnp.asarray(np.linspace(-1.0, 1.0, 48, dtype=np.float32).reshape(8, 6))

  w = jnp.float32(1.3)
  out = jax.jit(jaxaccum.value_and_grad(_token_weighted, num_micro_batches=n,
                                        reduce="weighted"))(w, (x, mask))
  # A token mean of sin terms (|.| <= 1) and its gradient (|.| <= max |x| = 1).
  chex.assert_trees_all_close(out, _token_mean_value_and_grad(w, (x, mask)), rtol=1e-5,
                              atol=1e-6, strict=True)
  assert np.isfinite(np.asarray(out[0]))


AUX_KINDS = ["mean", "sum", "max", "min", "stack"]


def _aux_fun(w, batch, count, weighted):
  x, m = batch
  num, den = jnp.sum(jnp.tanh(x @ w) * m), jnp.sum(m)
  aux = {"f": jnp.sum(x), "i": jnp.sum(m).astype(jnp.int32), "v": jnp.max(x, axis=0),
         # bools: one that varies between micro-batches, one always False, one always True
         "b": jnp.any(m == 0),
         "bv": jnp.stack([x[0, 0] > 0, jnp.any(jnp.abs(x) > 100), jnp.all(jnp.abs(x) < 100)])}
  value = (num, den) if weighted else num / x.shape[0]
  return value, (count + 1, aux)


# The references' pieces, jitted (compiled once per micro-batch shape, not per draw).
_aux_fun_jit = jax.jit(_aux_fun, static_argnums=3)


@functools.partial(jax.jit, static_argnums=2)
def _aux_full_batch(w, batch, weighted):
  """The whole batch through plain jax.value_and_grad (the token mean when weighted)."""
  def value(w):
    v = _aux_fun(w, batch, 0, weighted)[0]
    return v[0] / jnp.sum(batch[1]) if weighted else v
  return jax.value_and_grad(value)(w)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
# Bool max/min in both orders (a wrong starting value shows as a True max or False min).
@example(3, {"f": None, "i": "sum", "v": "stack", "b": "max", "bv": "min"}, False, 1)
@example(2, {"f": "max", "i": "min", "v": "mean", "b": "min", "bv": "max"}, True, 2)
@given(st.sampled_from([1, 2, 3, 6]),
       st.fixed_dictionaries({
           # Scalars may use the default (None): integer counts sum, floats average, bools
           # are AND-ed.
           **{k: st.sampled_from([None] + AUX_KINDS) for k in ("f", "i", "b")},
           # A non-scalar leaf has no default reduction: it must be named.
           **{k: st.sampled_from(AUX_KINDS) for k in ("v", "bv")}}),
       st.booleans(), st.integers(0, 2**16))
def test_aux_reductions_and_state_match_a_python_loop(n, spec, weighted, seed):
  """Every aux reduction of float, int and bool leaves, scalar and not, against a Python
  loop over the explicitly sliced micro-batches ``x[i::n]``."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((6, 3), np.float32))
  m = jnp.asarray((rng.uniform(size=6) > 0.3).astype(np.float32))
  fun = functools.partial(_aux_fun, weighted=weighted)

  w = jnp.linspace(-1.0, 1.0, 3)
  reduce = "weighted" if weighted else "mean"
  (value, (count, aux)), g = jax.jit(jaxaccum.value_and_grad(
      fun, num_micro_batches=n, reduce=reduce, has_aux=True, state_argnums=2,
      aux_reduce=spec))(w, (x, m), jnp.int32(0))

  # The reference: a Python loop over the micro-batches, sliced by hand.
  mbs = [(x[i::n], m[i::n]) for i in range(n)]
  auxes = [_aux_fun_jit(w, mb, 0, weighted)[1][1] for mb in mbs]
  dens = [float(np.sum(mb[1])) for mb in mbs] if weighted else [1.0] * n
  total = sum(dens)
  for key, kind in spec.items():
    vals = np.stack([np.asarray(a[key]) for a in auxes])
    if kind is None:  # the default: integer counts sum, floats average, bools are AND-ed
      kind = {"f": "mean", "b": "all"}.get(key, "sum")
    if kind == "mean":
      wts = np.asarray(dens).reshape((n,) + (1,) * (vals.ndim - 1))
      expected = np.sum(vals * wts, 0) / total if total > 0 else np.zeros(vals.shape[1:])
    else:
      expected = {"sum": lambda v: np.sum(v.astype(np.float32), 0), "max": lambda v: np.max(v, 0),
                  "min": lambda v: np.min(v, 0), "stack": lambda v: v,
                  "all": lambda v: np.all(v, 0)}[kind](vals)
    if kind in ("max", "min", "stack", "all"):  # these keep the leaf's dtype
      assert aux[key].dtype == auxes[0][key].dtype, (key, kind, aux[key].dtype)
    # Sums and means of up to 6 standard normal entries: atol 1e-5 on values of size ~1.
    chex.assert_trees_all_close(
        np.asarray(aux[key], np.float32), np.asarray(expected, np.float32), rtol=1e-5,
        atol=1e-5, strict=True, custom_message=f"aux {key!r} reduced with {kind!r}")
  assert int(count) == n
  full_value, full_g = _aux_full_batch(w, (x, m), weighted)
  if not weighted or float(np.sum(m)) > 0:
    chex.assert_trees_all_close((value, g), (full_value, full_g), rtol=1e-5, atol=1e-6,
                                strict=True)
