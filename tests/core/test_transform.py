"""jaxaccum.value_and_grad / grad against the full batch through plain jax.value_and_grad.

The core equivalence tests run with and without ``jax.jit`` (``chex.variants``) on the
shared problems of ``tests/_problems.py`` and compare with ``chex.assert_trees_all_close``
at float32 tolerances: rtol 1e-5 (the accumulated and the full-batch sums add the same
terms in another order, a few float32 ulps apart) and atol 1e-6 for entries near zero,
whose relative error is round-off of larger terms that cancel.

References built from micro-batches slice them explicitly (``x[i::N]`` is micro-batch
``i`` of ``N``) on batches with distinct rows, never with ``jaxaccum.split_micro_batches``.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxaccum
from tests import _problems
from tests._problems import micro_batch, micro_batches, mlp_loss
from tests._util import assert_close  # tolerance relative to each leaf's largest entry

B = 16
RTOL, ATOL = 1e-5, 1e-6  # float32; see the module docstring


# Full-batch references, plain jax.value_and_grad / jax.grad, jitted once for the module:
# one compile per shape and dtype serves every test that uses them.
mlp_value_and_grad = jax.jit(jax.value_and_grad(mlp_loss))
mlp_grad = jax.jit(jax.grad(mlp_loss))


def make_mlp(seed, din=5, dh=7, dout=3, batch=B, dtype=jnp.float32):
  return _problems.mlp_problem(seed, (din, dh, dout), batch, dtype=dtype)


def assert_all_close(actual, expected, rtol=RTOL, atol=ATOL):
  chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)


class FullBatchEquivalenceTest(chex.TestCase):
  """The accumulated value and gradients equal the full batch's, jitted or not."""

  def _check(self, problem, form):
    p = _problems.make(problem)
    f = self.variant(jaxaccum.value_and_grad(p.fun(form), num_micro_batches=4, reduce=form))
    assert_all_close(f(p.params, p.batch),
                     _problems.full_batch(p.fun(form), p.params, p.batch, form=form))

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*_problems.FORMS)
  def test_mlp_loss_forms(self, form):
    self._check("mlp", form)

  @chex.variants(with_jit=True)  # jit only: these compile the larger programs
  @parameterized.parameters(*[("cnn", f) for f in _problems.FORMS], ("lm", "weighted"))
  def test_cnn_and_lm_loss_forms(self, problem, form):
    self._check(problem, form)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(1, 2, B)
  def test_every_micro_batch_count(self, n):
    params, batch = make_mlp(0)
    f = self.variant(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=n))
    assert_all_close(f(params, batch), _problems.full_batch(mlp_loss, params, batch))

  @chex.variants(with_jit=True, without_jit=True)
  def test_grad_with_and_without_aux(self):
    params, batch = make_mlp(4)
    g = self.variant(jaxaccum.grad(mlp_loss, num_micro_batches=8))(params, batch)
    assert_all_close(g, mlp_grad(params, batch))

    def with_aux(p, b):
      loss = mlp_loss(p, b)
      return loss, {"loss": loss}

    out = self.variant(jaxaccum.grad(with_aux, num_micro_batches=8, has_aux=True))(params, batch)
    assert_all_close(out, jax.jit(jax.grad(with_aux, has_aux=True))(params, batch))


@pytest.mark.parametrize(("option", "value", "rows"), [
    ("num_micro_batches", 2, 8), ("micro_batch_size", 2, 2), ("micro_batch_size", 1, 1)])
def test_fun_sees_micro_batches_of_the_requested_shape(option, value, rows):
  """A full-batch comparison cannot tell N micro-batches from B / N: check the shape."""
  params, batch = make_mlp(1)
  traced_shapes = []

  def fun(params, batch):
    traced_shapes.append(batch["x"].shape)  # at trace time: the micro-batch's static shape
    return mlp_loss(params, batch), jnp.int32(batch["x"].shape[0])

  (loss, seen_rows), grads = jax.jit(jaxaccum.value_and_grad(
      fun, has_aux=True, aux_reduce="stack", **{option: value}))(params, batch)
  assert traced_shapes and set(traced_shapes) == {(rows, 5)}, traced_shapes
  np.testing.assert_array_equal(seen_rows, np.full(B // rows, rows))  # N entries of `rows`
  assert_all_close((loss, grads), _problems.full_batch(mlp_loss, params, batch))


def test_mean_of_summed_losses_would_be_off_by_n():
  # The anti-pattern: summing gradients of mean-reduced micro-batch losses is N x too big.
  params, batch = make_mlp(3)
  ref = mlp_grad(params, batch)
  wrong = jax.jit(jaxaccum.grad(mlp_loss, num_micro_batches=4, reduce="sum"))(params, batch)
  assert_all_close(wrong, jax.tree.map(lambda g: 4 * g, ref))
  right = jax.jit(jaxaccum.grad(mlp_loss, num_micro_batches=4))(params, batch)
  assert_all_close(right, ref)


def test_split_is_column_major():
  batch = {"a": jnp.arange(12), "b": jnp.arange(24).reshape(12, 2)}
  mbs = jaxaccum.split_micro_batches(batch, num_micro_batches=3)
  np.testing.assert_array_equal(mbs["a"][1], [1, 4, 7, 10])
  np.testing.assert_array_equal(mbs["b"][2], batch["b"][2::3])
  same = jaxaccum.split_micro_batches(batch, micro_batch_size=4)
  np.testing.assert_array_equal(same["a"], mbs["a"])


def test_aux_reductions_mean_sum_stack_max_min():
  def loss_aux(params, batch):
    x, y = batch["x"], batch["y"]
    err = (x @ params["layers"][0]["w"])[:, :3] - y
    loss = jnp.mean(err**2)
    aux = {
        "mse": loss,
        "count": jnp.int32(x.shape[0]),
        "per_mb": jnp.mean(jnp.abs(err), axis=0),
        "worst": jnp.max(jnp.abs(err)),
        "best": jnp.min(jnp.abs(err)),
        "first_row": x[0],
    }
    return loss, aux

  params, batch = make_mlp(5)
  n = 4
  spec = {"mse": None, "count": "sum", "per_mb": "stack", "worst": "max", "best": "min",
          "first_row": "stack"}
  (loss, aux), grads = jax.jit(jaxaccum.value_and_grad(
      loss_aux, num_micro_batches=n, has_aux=True, aux_reduce=spec))(params, batch)
  (ref_loss, ref_aux), ref_grads = jax.jit(jax.value_and_grad(loss_aux, has_aux=True))(
      params, batch)
  assert_all_close((loss, grads), (ref_loss, ref_grads))
  per = [jax.jit(loss_aux)(params, mb)[1] for mb in micro_batches(batch, n)]
  assert_all_close(aux["mse"], ref_aux["mse"])  # mean of equal-size means = full-batch mean
  assert aux["count"].dtype == jnp.int32 and int(aux["count"]) == B
  assert_all_close(aux["per_mb"], jnp.stack([p["per_mb"] for p in per]))
  assert_all_close(aux["worst"], ref_aux["worst"])
  assert_all_close(aux["best"], ref_aux["best"])
  np.testing.assert_array_equal(aux["first_row"], batch["x"][:n])  # row i opens micro-batch i


def test_aux_default_mean_and_string_spec():
  def loss_aux(params, batch):
    loss = mlp_loss(params, batch)
    return loss, (loss * 2, jnp.sum(batch["x"]))

  params, batch = make_mlp(6)
  (_, aux), _ = jax.jit(jaxaccum.value_and_grad(loss_aux, num_micro_batches=4, has_aux=True))(
      params, batch)
  ref = loss_aux(params, batch)[1]
  assert_all_close(aux[0], ref[0])
  assert_all_close(aux[1], ref[1] / 4)  # the mean of per-micro-batch sums
  (_, aux), _ = jax.jit(jaxaccum.value_and_grad(
      loss_aux, num_micro_batches=4, has_aux=True, aux_reduce="sum"))(params, batch)
  assert_all_close(aux[1], ref[1])


def test_several_batch_arguments_nested_pytrees_and_extra_args():
  def loss(params, images, scale, targets, *, offset):
    feats = images["pixels"].reshape(images["pixels"].shape[0], -1) * scale
    feats = feats + images["extra"][0]
    pred = feats @ params["w"][0] + params["w"][1]["bias"] + offset
    return jnp.mean((pred - targets["y"]) ** 2)

  k = jax.random.split(jax.random.key(7), 5)
  params = {"w": (jax.random.normal(k[0], (6, 2)), {"bias": jnp.ones(2)})}
  images = {"pixels": jax.random.normal(k[1], (12, 2, 3)),
            "extra": [jax.random.normal(k[2], (12, 6))]}
  targets = {"y": jax.random.normal(k[3], (12, 2))}
  scale = jnp.float32(0.5)
  f = jaxaccum.value_and_grad(loss, num_micro_batches=3, batch_argnums=(1, 3), argnums=(0, 2))
  out = jax.jit(functools.partial(f, offset=1.0))(params, images, scale, targets)
  ref = jax.jit(functools.partial(jax.value_and_grad(loss, argnums=(0, 2)), offset=1.0))(
      params, images, scale, targets)
  assert_all_close(out, ref)
  assert isinstance(out[1], tuple) and len(out[1]) == 2


def test_negative_argnums():
  params, batch = make_mlp(8)
  out = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=2, argnums=-2,
                                        batch_argnums=-1))(params, batch)
  assert_all_close(out, mlp_value_and_grad(params, batch))


@pytest.mark.parametrize("n", [2, 16])
def test_no_retrace_and_a_trace_count_independent_of_n(n):
  params, batch = make_mlp(9, batch=32)
  chex.clear_trace_counter()
  # fun is traced at most twice (its output shapes, then the scan body), whatever N is;
  # the step is traced once: later calls with the same shapes reuse the compiled program.
  vg = jaxaccum.value_and_grad(chex.assert_max_traces(mlp_loss, n=2), num_micro_batches=n)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, batch):
    return vg(params, batch)

  out = step(params, batch)
  step(params, batch)
  step(jax.tree.map(lambda a: a + 1, params), batch)
  assert_all_close(out, _problems.full_batch(mlp_loss, params, batch))


def test_one_scan_in_the_program():
  params, batch = make_mlp(10, batch=64)
  f = jaxaccum.value_and_grad(mlp_loss, num_micro_batches=16)
  jaxpr = jax.make_jaxpr(f)(params, batch)
  prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  assert prims.count("scan") == 1, prims
  hlo = jax.jit(f).lower(params, batch).compile().as_text()
  assert hlo.count(" while(") == 1


def test_rng_keys_distinct_per_micro_batch_and_reproducible():
  def noisy_loss(params, batch, key):
    x, y = batch["x"], batch["y"]
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    pred = (jnp.where(keep, x, 0.0) @ params["layers"][0]["w"])[:, :3]
    return jnp.mean((pred - y) ** 2), jax.random.key_data(key)

  params, batch = make_mlp(11)
  key = jax.random.key(42)
  n = 4
  f = jax.jit(jaxaccum.value_and_grad(noisy_loss, num_micro_batches=n, has_aux=True,
                                      rng_argnums=2, aux_reduce="stack"))
  (loss, keys), grads = f(params, batch, key)
  expected = jnp.stack([jax.random.key_data(jax.random.fold_in(key, i)) for i in range(n)])
  np.testing.assert_array_equal(keys, expected)
  assert len({tuple(np.asarray(k)) for k in keys}) == n
  # Exactly the hand-written loop over micro-batches with those keys.
  noisy_value_and_grad = jax.jit(jax.value_and_grad(noisy_loss, has_aux=True))
  ref = [noisy_value_and_grad(params, micro_batch(batch, i, n), jax.random.fold_in(key, i))
         for i in range(n)]
  assert_all_close(loss, sum(r[0][0] for r in ref) / n)
  assert_all_close(grads, jax.tree.map(lambda *g: sum(g) / n, *[r[1] for r in ref]))
  again = f(params, batch, key)
  np.testing.assert_array_equal(again[0][0], loss)
  other = f(params, batch, jax.random.key(43))
  assert not np.allclose(other[0][0], loss)


def test_rng_pytree_of_raw_keys():
  def loss(w, x, rngs):
    noise = jax.random.normal(rngs["dropout"], x.shape) * 0.1
    return jnp.mean((x + noise) * w), rngs["dropout"]

  w, x = jnp.float32(2.0), jnp.arange(8.0)
  rngs = {"dropout": jax.random.PRNGKey(0)}
  (_, keys), _ = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=2, has_aux=True, rng_argnums=2, aux_reduce="stack"))(w, x, rngs)
  np.testing.assert_array_equal(keys[1], jax.random.fold_in(rngs["dropout"], 1))


def _stateful_loss(params, batch, stats):
  """A BatchNorm-like layer: normalizes by micro-batch statistics, updates running means."""
  x, y = batch["x"], batch["y"]
  mean = jnp.mean(x, axis=0)
  new_stats = {"mean": 0.9 * stats["mean"] + 0.1 * mean, "steps": stats["steps"] + 1}
  pred = ((x - mean) @ params["layers"][0]["w"])[:, :3]
  return jnp.mean((pred - y) ** 2), new_stats


# One micro-batch of the hand-written loops below (jitted: compiled once per shape).
stateful_value_and_grad = jax.jit(jax.value_and_grad(_stateful_loss, has_aux=True))


def test_state_threads_through_micro_batches_in_order():
  params, batch = make_mlp(12)
  stats = {"mean": jnp.zeros(5), "steps": jnp.int32(0)}
  n = 4
  (loss, new_stats), grads = jax.jit(jaxaccum.value_and_grad(
      _stateful_loss, num_micro_batches=n, state_argnums=2))(params, batch, stats)
  s, losses, gs = stats, [], []
  for mb in micro_batches(batch, n):
    (l_i, s), g = stateful_value_and_grad(params, mb, s)
    losses.append(l_i)
    gs.append(g)
  assert_all_close(new_stats, s)
  assert int(new_stats["steps"]) == n
  assert_all_close(loss, sum(losses) / n)
  assert_all_close(grads, jax.tree.map(lambda *g: sum(g) / n, *gs))


def test_state_with_aux_and_tuple_of_states():
  def loss(params, batch, s1, s2):
    l_val, new_s1 = _stateful_loss(params, batch, s1)
    return l_val, ((new_s1, s2 * 2.0), {"l": l_val})

  params, batch = make_mlp(13)
  s1 = {"mean": jnp.zeros(5), "steps": jnp.int32(0)}
  s2 = jnp.ones(2)
  ((value, ((out1, out2), aux)), grads) = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=2, state_argnums=(2, 3), has_aux=True))(params, batch, s1, s2)
  assert int(out1["steps"]) == 2
  np.testing.assert_array_equal(out2, jnp.full(2, 4.0))
  s, ref, ref_g = s1, [], []
  for mb in micro_batches(batch, 2):
    (l_i, s), g_i = stateful_value_and_grad(params, mb, s)
    ref.append(l_i)
    ref_g.append(g_i)
  assert_all_close((value, aux["l"]), (sum(ref) / 2, sum(ref) / 2))
  assert_all_close(out1, s)
  assert_all_close(grads, jax.tree.map(lambda *g: sum(g) / 2, *ref_g))


def test_remat_same_numbers_less_temporary_memory():
  from jax.ad_checkpoint import checkpoint_name

  def deep_loss(params, x):
    for w in params:
      x = jax.nn.gelu(x @ w)
      x = checkpoint_name(jnp.sin(x) * jnp.cos(x) + jnp.tanh(x), "layer_out")
    return jnp.mean(x**2)

  ks = jax.random.split(jax.random.key(14), 5)
  params = [jax.random.normal(k, (64, 64)) / 8 for k in ks[:4]]
  x = jax.random.normal(ks[4], (512, 64))
  plain = jaxaccum.value_and_grad(deep_loss, num_micro_batches=2)
  remat = jaxaccum.value_and_grad(
      deep_loss, num_micro_batches=2,
      remat=jax.checkpoint_policies.save_only_these_names("layer_out"))
  assert_all_close(jax.jit(remat)(params, x), jax.jit(plain)(params, x))
  assert_all_close(jax.jit(remat)(params, x), jax.jit(jax.value_and_grad(deep_loss))(params, x))

  def temp(f):
    return jax.jit(f).lower(params, x).compile().memory_analysis().temp_size_in_bytes

  # The bounds come from the programs' own arrays: a micro-batch's activation is a
  # [256, 64] float32 array (64 KiB). The remat program holds at least what its policy saves
  # (each layer's "layer_out"), and it holds at least one activation fewer than the plain
  # program, which keeps per layer what the backward pass reads (gelu's input, sin, cos,
  # tanh: XLA fuses and recomputes some of them, the more so on a GPU). Measured: 6
  # activations fewer on the CPU (737,504 against 1,130,720 bytes), 2 on an H200 (557,664
  # against 688,736 bytes; the ratio 0.81 there, 0.65 on the CPU).
  activation = (x.shape[0] // 2) * params[0].shape[1] * x.dtype.itemsize
  assert len(params) * activation <= temp(remat) <= temp(plain) - activation, (
      temp(remat), temp(plain), activation)
  whole = jaxaccum.value_and_grad(deep_loss, num_micro_batches=2, remat=True)
  assert_all_close(jax.jit(whole)(params, x), jax.jit(plain)(params, x))
  assert temp(whole) < temp(plain)


def test_unroll_gives_the_same_numbers():
  params, batch = make_mlp(15)
  out = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=8, unroll=2))(
      params, batch)
  assert_all_close(out, mlp_value_and_grad(params, batch))


def test_bf16_gradients_accumulate_in_float32():
  params32, batch32 = make_mlp(16, din=16, dh=32, dout=4, batch=1024)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params32)
  batch = jax.tree.map(lambda a: a.astype(jnp.bfloat16), batch32)
  up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
  ref = mlp_grad(up(params), up(batch))  # the same inputs, in float32

  def rel_err(g):
    g = up(g)
    pairs = zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True)
    num = sum(jnp.sum((a - b) ** 2) for a, b in pairs)
    return float(jnp.sqrt(num / sum(jnp.sum(b**2) for b in jax.tree.leaves(ref))))

  full_bf16 = rel_err(mlp_grad(params, batch))
  acc = jax.jit(jaxaccum.grad(mlp_loss, num_micro_batches=128))(params, batch)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(acc))  # the params' dtype
  acc_f32 = jax.jit(jaxaccum.grad(mlp_loss, num_micro_batches=128, grads_dtype=jnp.float32))(
      params, batch)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(acc_f32))
  naive = jax.jit(jaxaccum.grad(mlp_loss, num_micro_batches=128,
                                accumulator_dtype=jnp.bfloat16))(params, batch)
  # The float32 accumulator is no worse than the full batch computed in bf16 ...
  assert rel_err(acc_f32) <= full_bf16, (rel_err(acc_f32), full_bf16)
  # ... and rounding it to bf16 once at the end adds only bf16's own rounding
  # (2**-9 relative per entry), while a bf16 accumulator rounds 128 times.
  assert rel_err(acc) <= full_bf16 + 2.0**-9, (rel_err(acc), full_bf16)
  assert rel_err(naive) > 3 * rel_err(acc), (rel_err(naive), rel_err(acc))


def test_bf16_value_and_grads_are_one_rounding_of_a_float32_sum():
  """bf16 micro-batch results are summed in float32 and rounded to bf16 once, at the end.

  The reference does exactly that by hand: each of the n = 256 one-row micro-batches through
  plain jax.value_and_grad in bf16, a float32 sum, one rounding. The bound, per entry, from
  the unit roundoffs u = 2**-8 (bf16: half its epsilon 2**-7) and u32 = 2**-24 and the n
  terms t_i summed, whose mean magnitude is m = sum_i |t_i| / n:

  * each term is a bf16 result of a program other than the reference's (the loop body
    against the vmapped step; XLA fuses them differently, on a GPU above all), so the two
    may round it differently: u |t_i| each, u m in the mean;
  * the float32 sum of n terms is within (n - 1) u32 m of the exact one (recursive
    summation), the reference's too;
  * both round the mean to bf16 once: at most one bf16 spacing apart, 2 u |mean|.

  The terms cancel (gradients of opposite signs): m is ~17 times the mean here, which is why
  a tolerance relative to each leaf's largest entry held on the CPU (where the programs
  round alike: 0 off) and not on an H200 (0.29 of this bound there). A bf16 running sum
  rounds each partial sum instead (u |S_k| per addition, the sum of 256 losses in [1, 2)
  passing 128, where bf16's spacing is 1): it exceeds the bound, which the test checks.
  """
  n = 256
  params, batch = make_mlp(17, din=4, dh=8, dout=2, batch=n, dtype=jnp.bfloat16)

  def loss(params, batch):
    return 1.0 + jnp.tanh(mlp_loss(params, batch))  # in [1, 2): the sum grows to ~1.5 n

  value, grads = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=n))(params, batch)
  assert value.dtype == jnp.bfloat16
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  # Micro-batch i of n = B is row i alone: x[i::n] == x[i:i + 1].
  rows = jax.tree.map(lambda x: x[:, None], batch)
  values, per_row = jax.jit(jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0)))(params, rows)
  ref = jax.tree.map(lambda v: (jnp.sum(v.astype(jnp.float32), axis=0) / n).astype(jnp.bfloat16),
                     (values, per_row))
  u, u32 = 2.0**-8, 2.0**-24
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  terms = jax.tree.leaves((values, per_row))
  bounds = [(u + (n - 1) * u32) * np.mean(np.abs(f32(t)), axis=0) + 2 * u * np.abs(f32(r))
            for t, r in zip(terms, jax.tree.leaves(ref), strict=True)]

  def excess(result):  # the largest |result - ref| / bound over the entries of all leaves
    return max(float(np.max(np.abs(f32(a) - f32(r)) / b)) for a, r, b in
               zip(jax.tree.leaves(result), jax.tree.leaves(ref), bounds, strict=True))

  assert excess((value, grads)) <= 1.0, excess((value, grads))

  def bf16_running_sum(t):
    total, _ = jax.lax.scan(lambda s, x: (s + x, None), jnp.zeros(t.shape[1:], t.dtype), t)
    return (total.astype(jnp.float32) / n).astype(jnp.bfloat16)

  assert excess(jax.tree.map(bf16_running_sum, (values, per_row))) > 1.0


def test_float64_stays_float64():
  with jax.enable_x64(True):
    params, batch = make_mlp(18, dtype=jnp.float64)
    loss, grads = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=4))(params, batch)
    ref_loss, ref_grads = mlp_value_and_grad(params, batch)  # compiled for float64
    assert all(g.dtype == jnp.float64 for g in jax.tree.leaves(grads))
    assert_close((loss, grads), (ref_loss, ref_grads), rtol=1e-12, atol=0)


def test_remat_with_static_and_non_array_arguments():
  def loss(params, batch, train, name):
    assert isinstance(name, str)
    value = mlp_loss(params, batch)
    return value * 2.0 if train else value

  params, batch = make_mlp(19)
  f = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=4, remat=True),
              static_argnums=(2, 3))
  ref = jax.jit(jax.value_and_grad(loss), static_argnums=(2, 3))
  for train in (True, False):
    assert_all_close(f(params, batch, train, "mlp"),
                 ref(params, batch, train, "mlp"))


def test_integer_and_boolean_aux_sums_do_not_wrap():
  def loss(w, x):
    return jnp.mean(x * w), {"big": jnp.int8(100), "any": jnp.any(x > 0), "n": jnp.uint8(200)}

  (_, aux), _ = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=4, has_aux=True, aux_reduce="sum"))(jnp.float32(1.0),
                                                                   jnp.arange(8.0))
  assert int(aux["big"]) == 400 and int(aux["n"]) == 800  # not wrapped to int8/uint8
  assert aux["any"].dtype == jnp.int32 and int(aux["any"]) == 4  # a count, not a bool


def test_grad_with_empty_or_zero_state_argnums():
  params, batch = make_mlp(20)
  g = jax.jit(jaxaccum.grad(mlp_loss, num_micro_batches=2, state_argnums=()))(params, batch)
  assert_all_close(g, mlp_grad(params, batch))

  def stateful(count, params, batch):  # state as argument 0
    return mlp_loss(params, batch), count + 1

  g, count = jax.jit(jaxaccum.grad(stateful, num_micro_batches=2, argnums=1, batch_argnums=2,
                                   state_argnums=0))(jnp.int32(0), params, batch)
  assert int(count) == 2
  assert_all_close(g, mlp_grad(params, batch))


def test_weighted_aux_ignores_micro_batches_of_weight_zero():
  def loss(w, batch):
    x, m = batch
    num, den = jnp.sum(x * w * m), jnp.sum(m)
    return (num, den), {"mean_x": jnp.sum(x * m) / den}  # NaN when den == 0

  x = jnp.arange(8.0)
  m = jnp.array([1.0, 0.0] * 4)  # micro-batch 1 of 2 (odd rows) has no weight at all
  (value, aux), g = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=2, reduce="weighted", has_aux=True))(jnp.float32(2.0), (x, m))
  assert_all_close(value, jnp.sum(2.0 * x * m) / jnp.sum(m))
  assert_all_close(g, jnp.sum(x * m) / jnp.sum(m))
  assert_all_close(aux["mean_x"], jnp.sum(x * m) / jnp.sum(m))  # 3.0, not NaN


def test_int64_denominator_under_x64():
  with jax.enable_x64(True):
    def loss(w, x):
      return jnp.sum(x * w), jnp.int64(2**33) * jnp.int64(x.shape[0])

    x = jnp.arange(8.0)
    value, g = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=2, reduce="weighted"))(
        jnp.float64(3.0), x)
    assert_close(value, 3.0 * jnp.sum(x) / (2**33 * 8), rtol=1e-12, atol=0)
    assert_close(g, jnp.sum(x) / (2**33 * 8), rtol=1e-12, atol=0)
