"""jaxaccum.contrib.AdaptiveBatch: the rules against sequences of k computed by hand, the counters,
the learning-rate scales in closed form, and the controller inside real steps (one compiled
program, data_axis, MultiSteps, an orbax round trip)."""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum

# --- synthetic steps ------------------------------------------------------------------------


def info_for(k, g2, tr, m=4.0, devices=1):
  """The AccumInfo of a step of k micro-batches of m rows whose estimates are exactly
  |G|^2 = g2 and tr(Sigma) = tr: E|g_i|^2 = g2 + tr/b and |G_B|^2 = g2 + tr/B, exact."""
  samples = k * devices
  b, big = m / devices, k * m
  return jaxaccum.AccumInfo(
      num_micro_batches=jnp.int32(samples), micro_batch_size=jnp.float32(b),
      batch_size=jnp.float32(big), micro_grad_sq_norm=jnp.float32(g2 + tr / b),
      batch_grad_sq_norm=jnp.float32(g2 + tr / big), num_samples=jnp.int32(samples),
      skipped=jnp.int32(0))


_UPDATES = {}


def jit_update(ab):
  """One compiled update per controller configuration, shared by the tests."""
  if ab not in _UPDATES:
    _UPDATES[ab] = jax.jit(ab.update)
  return _UPDATES[ab]


def run_ks(ab, targets, *, g2=1.0, m=4.0, devices=1, state=None):
  """Feeds steps whose k* (= tr / (c g2 m)) is each of ``targets``; returns k after each."""
  update = jit_update(ab)
  c = ab.theta ** 2 if ab.rule == "norm_test" else 1 / ab.fraction
  state, ks = ab.init() if state is None else state, []
  for target in targets:
    k = int(ab.micro_batches(state))
    state = update(state, info_for(k, g2, target * c * g2 * m, m, devices))
    ks.append(int(ab.micro_batches(state)))
  return ks, state


def test_norm_test_follows_warmup_cooldown_and_growth_limit():
  # k* = tr / (theta^2 |G|^2 m) = 329.6 / (4 * 1 * 4) = 20.6 on every step; EMAs of constants
  # are the constants (bias-corrected), so the sequence follows from the rules alone:
  # steps 1-2 warm-up; step 3 grows 2 -> 4 (x2 limit); one step of cooldown between
  # changes; 4 -> 8 -> 16 -> 21 (20.6 > 16 * 1.25; ceil(k*), under the x2 limit), then held.
  ab = jaxaccum.contrib.AdaptiveBatch(64, theta=2.0, warmup_steps=3, cooldown_steps=2,
                              hysteresis=0.25, max_growth=2.0)
  ks, state = run_ks(ab, [20.6] * 11)
  assert ks == [2, 2, 4, 4, 8, 8, 16, 16, 21, 21, 21]
  assert int(state.steps) == 11 and int(state.noise.count) == 11
  assert int(state.since_change) == 2
  np.testing.assert_allclose(ab.b_simple(state), 329.6, rtol=1e-5)
  np.testing.assert_allclose(ab.target_micro_batches(state), 20.6, rtol=1e-5)
  # At k* = 19.9 the last change would need 19.9 > 16 * 1.25: it does not clear the margin.
  ks, _ = run_ks(ab, [19.9] * 11)
  assert ks[-3:] == [16, 16, 16]


def test_b_simple_rule_and_its_fraction():
  # B* = fraction * tr / |G|^2 rows: with fraction 0.5, tr = 2 * 4 * 12.6 gives k* = 12.6;
  # no warm-up or cooldown: 2 -> 4 -> 8 -> 13 (ceil, under x2), then held; max 10 clips.
  ab = jaxaccum.contrib.AdaptiveBatch(64, rule="b_simple", fraction=0.5, warmup_steps=0,
                              cooldown_steps=0)
  ks, _ = run_ks(ab, [12.6] * 5)
  assert ks == [4, 8, 13, 13, 13]
  ks, _ = run_ks(dataclasses.replace(ab, max_micro_batches=10), [12.6] * 5)
  assert ks == [4, 8, 10, 10, 10]
  # The two rules are one family: theta^2 = 1 / fraction gives the same sequence.
  ks_norm, _ = run_ks(jaxaccum.contrib.AdaptiveBatch(64, theta=math.sqrt(2.0), warmup_steps=0,
                                             cooldown_steps=0), [12.6] * 5)
  assert ks_norm == [4, 8, 13, 13, 13]


def test_hysteresis_and_growth_limit_by_hand():
  # decay=0: no smoothing, each step's k* acts alone (smoothing is tested below).
  ab = jaxaccum.contrib.AdaptiveBatch(64, init_micro_batches=8, decay=0.0, warmup_steps=0,
                              cooldown_steps=0, hysteresis=0.25, max_growth=1.5)
  # 9.9 < 8 * 1.25 = 10 holds; 10.5 > 10 grows to ceil(10.5) = 11; then 11 * 1.25 = 13.75:
  # 13.5 holds; 30.6 grows by at most x1.5: floor(11 * 1.5) = 16, then 24, then
  # ceil(30.6) = 31 (30.6 > 24 * 1.25 = 30).
  ks, _ = run_ks(ab, [9.9, 9.9, 10.5, 13.5, 30.6, 30.6, 30.6, 30.6])
  assert ks == [8, 8, 11, 11, 16, 24, 31, 31]
  # A growth limit below one micro-batch still grows by one: 2 -> 3 -> 4 -> 5 -> 6, then
  # 6.6 < 6 * 1.25 holds.
  ks, _ = run_ks(dataclasses.replace(ab, init_micro_batches=2, max_growth=1.1), [6.6] * 5)
  assert ks == [3, 4, 5, 6, 6]


def test_monotone_by_default_and_decreases_when_allowed():
  base = jaxaccum.contrib.AdaptiveBatch(64, init_micro_batches=16, decay=0.0, warmup_steps=0,
                                cooldown_steps=0)
  ks, _ = run_ks(base, [1.0] * 3 + [40.5])
  assert ks == [16, 16, 16, 32]
  down = dataclasses.replace(base, allow_decrease=True, min_micro_batches=3)
  # 16 -> ceil(16 / 2) = 8 -> 4 -> 3 (min) with k* = 1, held at the minimum; then up:
  # 3 -> ceil(4.6) = 5, 5 -> 10 (x2 limit), 10 -> 13 = ceil(12.9) (12.9 > 10 * 1.25).
  ks, _ = run_ks(down, [1.0] * 4 + [4.6] + [12.9] * 2)
  assert ks == [8, 4, 3, 3, 5, 10, 13]
  # Hysteresis downwards: k = 16 holds while k* > 16 / 1.25 = 12.8.
  ks, _ = run_ks(down, [12.9, 12.7])
  assert ks == [16, 13]


def test_smoothing_follows_the_bias_corrected_averages_not_the_last_step():
  # Targets are kept off integers: k* is computed in float32 and rounded up.
  # decay 0.5, |G|^2 = 1, theta = 1, m = 4: tr = 18 then 162 (k* of the steps alone: 4.5,
  # 40.5). EMA of tr: 9 (/ 0.5 = 18), then 0.5 * 9 + 0.5 * 162 = 85.5 (/ 0.75 = 114).
  ab = jaxaccum.contrib.AdaptiveBatch(64, theta=1.0, decay=0.5, warmup_steps=0, cooldown_steps=0,
                              max_growth=100.0)
  ks, state = run_ks(ab, [4.5, 40.5])
  assert ks == [5, math.ceil(114 / 4)]
  np.testing.assert_allclose(ab.b_simple(state), 114.0, rtol=1e-6)
  # A spike after 20 quiet steps: the bias-corrected average gives it the weight
  # w = (1 - d) / (1 - d**21), so k* = 4.5 (1 - w) + 100.5 w; on the last step's estimate
  # alone (decay=0) k jumps to the spike (clipped at 64).
  ab = dataclasses.replace(ab, decay=0.9, init_micro_batches=8)
  w = 0.1 / (1 - 0.9 ** 21)
  spike = math.ceil(4.5 * (1 - w) + 100.5 * w)
  assert spike == 16
  ks, _ = run_ks(ab, [4.5] * 20 + [100.5])
  assert ks == [8] * 20 + [spike]
  ks, _ = run_ks(dataclasses.replace(ab, decay=0.0), [4.5] * 20 + [100.5])
  assert ks == [8] * 20 + [64]


def test_nan_and_single_sample_estimates_hold_k():
  ab = jaxaccum.contrib.AdaptiveBatch(64, warmup_steps=0, cooldown_steps=0)
  update = jit_update(ab)
  state = ab.init()
  one = info_for(1, 1.0, 1e6)._replace(num_samples=jnp.int32(1))  # one sample: NaN
  nan = info_for(2, 1.0, 1e6)._replace(micro_grad_sq_norm=jnp.float32(jnp.nan))
  for info in (one, nan):
    assert not np.isfinite(info.b_simple())
    state = update(state, info)
    assert int(ab.micro_batches(state)) == 2 and int(state.noise.count) == 0
  # The steps ran: they count, with their samples.
  assert int(state.steps) == 2 and ab.sample_count(state) == 4 + 8
  # A MultiSteps call that completes no window (an empty info) changes nothing.
  empty = jaxaccum.MultiSteps(optax.sgd(1.0), 2, with_info=True).init(jnp.zeros(1)).info
  before = state
  state = update(state, empty)
  chex.assert_trees_all_equal(state, before)
  # A finite step after them grows k at once (no warm-up): the held steps left no trace.
  state = update(state, info_for(2, 1.0, 1e6))
  assert int(ab.micro_batches(state)) == 4
  # Once the averages ask for more, a NaN step still holds k (and the averages).
  held = update(state, nan._replace(num_micro_batches=jnp.int32(4)))
  assert int(ab.micro_batches(held)) == 4
  chex.assert_trees_all_equal(held.noise, state.noise)
  # |G|^2 averaging to <= 0 while tr > 0: the noise dominates, k grows by the limit.
  state = update(ab.init(), info_for(2, -1.0, 10.0))
  assert int(ab.micro_batches(state)) == 4


def test_sample_counter_is_exact_across_the_float32_and_int32_limits():
  ab = jaxaccum.contrib.AdaptiveBatch(4)
  update = jit_update(ab)

  def add(state, size):
    info = info_for(1, 1.0, 1.0)._replace(batch_size=jnp.float32(size),
                                          num_samples=jnp.int32(1))
    return update(state, info)

  state, total = ab.init(), 0
  # Around 2**24 (float32's last exact integer) and 2**31 (int32's limit), then to 1e13.
  for size in (2**24 - 1, 1, 1, 2**24, 2**24 + 2, 2**31 - 128, 2**31 + 256, 2**33 + 2**10):
    state, total = add(state, size), total + size
    assert ab.sample_count(state) == total
  assert total > 2**31 + 2**33

  def many(state, _):
    return add(state, 2**33 + 2**10), None

  state, _ = jax.jit(lambda s: jax.lax.scan(many, s, None, length=1200))(state)
  total += 1200 * (2**33 + 2**10)
  assert total > 1e13 and ab.sample_count(state) == total
  assert 0 <= int(state.samples_lo) < 2**24
  np.testing.assert_allclose(float(ab.samples(state)), total, rtol=1e-7)
  # Non-integer sizes are rounded per step; NaN and negative sizes count nothing.
  state = ab.init()
  for size in (2.4, 2.6, float("nan"), -3.0):
    state = add(state, size)
  assert ab.sample_count(state) == 5 and int(state.steps) == 2


def test_lr_scales_in_closed_form():
  ab = jaxaccum.contrib.AdaptiveBatch(64, init_micro_batches=2, warmup_steps=0, cooldown_steps=0)
  # One step at k = 2 (m = 4 rows), |G|^2 = 1, tr = 9 * 4 * 8 = 288: k grows to 4.
  state = jit_update(ab)(ab.init(), info_for(2, 1.0, 288.0))
  assert int(ab.micro_batches(state)) == 4
  scales = {mode: float(dataclasses.replace(ab, lr_scaling=mode).lr_scale(state))
            for mode in ("none", "sqrt", "linear", "adascale")}
  # AdaScale: r = (tr/B0 + g2) / (tr/B + g2), B0 = 2 * 4 rows, B = 4 * 4 rows.
  r = (288 / 8 + 1) / (288 / 16 + 1)
  np.testing.assert_allclose(
      [scales["none"], scales["sqrt"], scales["linear"], scales["adascale"]],
      [1.0, math.sqrt(2.0), 2.0, r], rtol=1e-6)
  np.testing.assert_allclose(ab.gain(state), r, rtol=1e-6)
  # Before any estimate the gain is 1; at k = k0 it is 1.
  assert float(ab.gain(ab.init())) == 1.0
  # Progress sums the scale each step ran with: steps for "none", gains for "adascale".
  ada = dataclasses.replace(ab, lr_scaling="adascale")
  st = ada.init()
  for _ in range(3):
    st = jit_update(ada)(st, info_for(int(ada.micro_batches(st)), 1.0, 288.0))
  k_seq = [2, 4, 8]  # grows x2 per step to k* = 288 / (9 * 4) = 8
  gains = [(288 / 8 + 1) / (288 / (4 * k) + 1) for k in k_seq]
  np.testing.assert_allclose(st.progress, sum(gains), rtol=1e-6)


def _reference_k(ab, k, t, floor):
  """The documented rule on the controller's own float32 target ``t`` (decay, warm-up and
  cooldown aside): grow when t > (1 + h) k, to ceil(t) within [k + 1, max(k + 1,
  floor(g k))]; shrink (allow_decrease) when t (1 + h) < k, to ceil(t) within
  [min(k - 1, ceil(k / g)), k - 1]; then into [max(floor, min), max]."""
  f32 = np.float32
  kf, margin, g = f32(k), f32(1 + ab.hysteresis), f32(ab.max_growth)
  t = f32(t)
  if t > kf * margin:
    new = max(min(math.ceil(min(t, 2**30)), max(k + 1, math.floor(kf * g))), k + 1)
  elif ab.allow_decrease and t * margin < kf:
    new = min(max(math.ceil(max(t, 0)), min(k - 1, math.ceil(kf / g))), k - 1)
  else:
    new = k
  low = min(max(floor, ab.min_micro_batches), ab.max_micro_batches)
  return int(min(max(new, low), ab.max_micro_batches))


def test_growth_and_shrink_boundaries_and_caps_over_generated_cases():
  # rule b_simple with fraction 1, |G|^2 = 1, m = 4 rows, no smoothing: tr = 4 t makes the
  # step's target exactly t when t, k are small dyadic numbers (checked below).
  base = jaxaccum.contrib.AdaptiveBatch(64, rule="b_simple", fraction=1.0, decay=0.0,
                                warmup_steps=0, cooldown_steps=0, allow_decrease=True,
                                min_micro_batches=1)

  def step(ab, k, t):
    state = ab.init()._replace(micro_batches=jnp.int32(k))
    state = jit_update(ab)(state, info_for(k, 1.0, 4.0 * t))
    return int(ab.micro_batches(state)), float(ab.target_micro_batches(state))

  # By hand. Exactly on the growth boundary k* = (1 + h) k = 10 at k = 8: held; a float32
  # ulp above it grows to ceil = 11.
  assert step(base, 8, 10.0) == (8, 10.0)
  assert step(base, 8, float(np.nextafter(np.float32(10), np.float32(11))))[0] == 11
  # Exactly on the shrink boundary k / (1 + h) = 4 at k = 8, h = 1: held.
  assert step(dataclasses.replace(base, hysteresis=1.0), 8, 4.0) == (8, 4.0)
  # The shrink cap ceil(k / max_growth) from odd k: 9 -> 5, 7 -> 4, 9 -> 3 at x3.
  assert step(base, 9, 1.0)[0] == 5
  assert step(base, 7, 1.0)[0] == 4
  assert step(dataclasses.replace(base, max_growth=3.0), 9, 1.0)[0] == 3
  assert step(dataclasses.replace(base, max_growth=3.0), 11, 0.5)[0] == 4
  # Generated: k, h, g and targets on, near and away from both boundaries, one vmapped
  # program per (h, g).
  rng = np.random.default_rng(7)
  exact = 0
  for h, g in ((0.0, 2.0), (0.25, 1.5), (0.5, 3.0), (1.0, 4.0), (0.25, 2.0)):
    ab = dataclasses.replace(base, hysteresis=h, max_growth=g)
    ks = rng.integers(2, 40, size=12)
    cases = [(int(k), want) for k in ks for want in (
        k * (1 + h), k / (1 + h), k * (1 + h) * 1.001, k / (1 + h) * 0.999,
        float(rng.uniform(0.1, 3 * k)))]
    k_in = jnp.asarray([k for k, _ in cases], jnp.int32)
    t_in = jnp.asarray([t for _, t in cases], jnp.float32)

    def one(k, t, ab=ab):
      state = ab.init()._replace(micro_batches=k)
      state = ab.update(state, info_for(k, 1.0, 4.0 * t))
      return ab.micro_batches(state), ab.target_micro_batches(state)

    new, t_out = jax.jit(jax.vmap(one))(k_in, t_in)
    for (k, _), got, t in zip(cases, np.asarray(new), np.asarray(t_out), strict=True):
      exact += float(t) in (k * (1 + h), k / (1 + h))
      assert got == _reference_k(ab, k, t, floor=2), (k, h, g, t)
  assert exact > 60  # the boundaries themselves were hit, not only stepped around


def test_one_device_never_traps_k_at_one():
  # Generated target sequences that pull k down, allow_decrease, min_micro_batches=1: on
  # one device (one sample per micro-batch) k never reaches 1, where it could measure
  # nothing; with 2 data shards per micro-batch it does.
  rng = np.random.default_rng(1)
  ab = jaxaccum.contrib.AdaptiveBatch(32, allow_decrease=True, decay=0.0, warmup_steps=0,
                              cooldown_steps=0, init_micro_batches=9)
  for devices in (1, 2):
    seen = set()
    for _ in range(8):
      ks, _ = run_ks(ab, rng.choice([0.05, 0.3, 0.9, 3.3, 12.5], size=10), devices=devices)
      seen |= set(ks)
    assert min(seen) == (2 if devices == 1 else 1), (devices, sorted(seen))
  # A run that starts at k = 1 on one device (NaN estimates) moves to 2 on its first step,
  # warm-up or not; under data_axis k = 1 measures and is kept.
  one = jaxaccum.contrib.AdaptiveBatch(32, init_micro_batches=1)  # warm-up 10, cooldown 5
  state = jit_update(one)(one.init(), info_for(1, 1.0, 1.0))
  assert int(one.micro_batches(state)) == 2 and int(state.since_change) == 0
  state = jit_update(one)(one.init(), info_for(1, 1.0, 1.0, devices=2))
  assert int(one.micro_batches(state)) == 1
  # With max_micro_batches=1 there is nothing else to run.
  single = jaxaccum.contrib.AdaptiveBatch(1)
  assert int(single.micro_batches(jit_update(single)(single.init(), info_for(1, 1.0, 1.0)))) == 1


def test_real_steps_on_one_device_shrink_to_two_not_one():
  # Noise-free regression: k* falls towards 0, so k shrinks from 8 to its one-device floor.
  n, rows = 8, 2
  vg = jaxaccum.value_and_grad(lambda w, b: 0.5 * jnp.mean((b[0] @ w - b[1]) ** 2),
                               num_micro_batches=n, with_info=True)
  ab = jaxaccum.contrib.AdaptiveBatch(n, init_micro_batches=n, allow_decrease=True, warmup_steps=1,
                              cooldown_steps=0).check(vg)

  @jax.jit
  def step(w, st, t):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(3), t), (n * rows, DIM))
    _, g, info = vg(w, (x, x @ W_STAR), active_micro_batches=ab.micro_batches(st))
    return w - 0.01 * g, ab.update(st, info)

  w, st, ks = jnp.zeros(DIM), ab.init(), []
  for t in range(12):
    w, st = step(w, st, t)
    ks.append(int(ab.micro_batches(st)))
  assert ks[-4:] == [2] * 4 and min(ks) == 2, ks


def _mean_loss(w, batch):
  x, y = batch
  return 0.5 * jnp.mean((x @ w - y) ** 2)


def test_check_and_update_catch_k_above_the_transforms_count():
  vg = jaxaccum.value_and_grad(_mean_loss, micro_batch_size=4, with_info=True)
  ab = jaxaccum.contrib.AdaptiveBatch(16, lr_scaling="linear")
  for transform in (vg, jaxaccum.grad(_mean_loss, micro_batch_size=4, with_info=True)):
    with pytest.raises(ValueError, match=r"splits each batch into micro-batches of "
                       r"micro_batch_size=4 rows, so its num_micro_batches depends on the "
                       r"batch; pass the rows of a step, check\(transform, batch_size=...\)"):
      ab.check(transform)
    with pytest.raises(ValueError, match=r"max_micro_batches=16\) exceeds the transform's "
                       r"num_micro_batches=4 \(batch_size=16 / micro_batch_size=4\)"):
      ab.check(transform, batch_size=16)
    assert ab.check(transform, batch_size=64) is ab
  with pytest.raises(ValueError, match="batch size 18 is not divisible by micro_batch_size=4"):
    ab.check(vg, batch_size=18)
  with pytest.raises(TypeError, match="batch_size must be a Python int"):
    ab.check(vg, batch_size=16.0)
  # A step that got k = 16 with N = 4 ran 4 (jit clips): update takes the k that ran, so
  # lr_scale and the rows per micro-batch follow it.
  x = jax.random.normal(jax.random.key(0), (16, DIM))
  batch = (x, x @ W_STAR)
  state = ab.init()._replace(micro_batches=jnp.int32(16))
  info = jax.jit(lambda st: vg(W0, batch, active_micro_batches=ab.micro_batches(st))[2])(state)
  assert int(info.num_micro_batches) == 4
  new = jit_update(ab)(state, info)
  assert int(ab.micro_batches(new)) == 4 and float(ab.lr_scale(new)) == 2.0
  assert float(new.micro_batch_samples) == 4.0 and ab.sample_count(new) == 16
  # Eagerly, with a concrete info, it is refused with the fix.
  with pytest.raises(ValueError, match=r"the step ran info.num_micro_batches=4 micro-batches, "
                     r"fewer than the k=16 the controller set.* Lower max_micro_batches"):
    ab.update(state, info)


def test_rows_per_micro_batch_count_only_the_micro_batches_not_skipped():
  # A real step: 4 micro-batches of 4 rows, one row of micro-batch 1 is NaN and skipped.
  vg = jaxaccum.value_and_grad(_mean_loss, num_micro_batches=4, with_info=True,
                               skip_nonfinite=True)
  x = np.array(jax.random.normal(jax.random.key(1), (16, DIM)))
  y = x @ np.asarray(W_STAR)
  x[5, 0] = np.nan  # row 5 is in micro-batch 5 % 4 = 1
  _, _, info = vg(W0, (jnp.asarray(x), jnp.asarray(y)))
  assert int(info.skipped) == 1 and float(info.batch_size) == 12.0
  ab = jaxaccum.contrib.AdaptiveBatch(4, init_micro_batches=4)
  state = jit_update(ab)(ab.init(), info)
  assert float(state.micro_batch_samples) == 4.0 and ab.sample_count(state) == 12
  # Generated: k micro-batches of m rows on D shards, s pieces skipped.
  rng = np.random.default_rng(2)
  ab = jaxaccum.contrib.AdaptiveBatch(64, init_micro_batches=64)
  for _ in range(40):
    k, d, m = int(rng.integers(1, 65)), int(rng.choice([1, 2, 4, 8])), float(rng.choice([4, 8]))
    s = int(rng.integers(0, k * d))
    info = info_for(k, 1.0, 2.0, m=m, devices=d)._replace(
        batch_size=jnp.float32((k * d - s) * m / d), skipped=jnp.int32(s))
    state = jit_update(ab)(ab.init()._replace(micro_batches=jnp.int32(k)), info)
    assert float(state.micro_batch_samples) == m, (k, d, m, s)


def test_sample_counter_saturates_exactly_at_its_top():
  ab = jaxaccum.contrib.AdaptiveBatch(4)
  update = jit_update(ab)
  top = (2**31 - 1) * 2**24 + 2**24 - 1

  def add(hi, lo, size):
    state = ab.init()._replace(samples_hi=jnp.int32(hi), samples_lo=jnp.int32(lo))
    info = info_for(1, 1.0, 1.0)._replace(batch_size=jnp.float32(size))
    return ab.sample_count(update(state, info))

  # By hand: the last units below the top, the top itself, and one past it.
  assert add(2**31 - 2, 0, 2**24) == (2**31 - 1) * 2**24
  assert add(2**31 - 2, 2**24 - 1, 2**24) == top
  assert add(2**31 - 2, 2**24 - 1, 2**24 - 1) == top - 1
  assert add(2**31 - 1, 2**24 - 2, 1) == top
  assert add(2**31 - 1, 2**24 - 1, 1) == top
  # Generated: high words near 2**31, steps whose float32 value is an exact integer.
  rng = np.random.default_rng(4)
  for _ in range(100):
    hi = int(rng.integers(2**31 - 6, 2**31))
    lo = int(rng.integers(0, 2**24))
    size = int(np.float32(rng.integers(1, 2**27)))  # as float32 holds it
    assert add(hi, lo, size) == min(hi * 2**24 + lo + size, top), (hi, lo, size)
  # The documented bound: a step of more than 2**24 samples counts its float32 value.
  for size in (2**24 + 21, 2**25 + 3, 3 * 2**26 + 5):
    got = add(0, 0, size)
    assert got == int(np.float32(size)) and abs(got - size) <= size * 2.0**-24


def test_progress_is_a_compensated_sum():
  # lr_scaling="sqrt" at k / k0 = 3 / 2: every step adds float32(sqrt(1.5)). 200,000
  # steps: a plain float32 sum is off by about 1e-3 here; the compensated one is not.
  ab = jaxaccum.contrib.AdaptiveBatch(3, init_micro_batches=2, lr_scaling="sqrt")
  state = ab.init()._replace(micro_batches=jnp.int32(3))
  info = info_for(3, 1.0, 0.0)  # no noise: k* = 0 holds k

  def body(st, _):
    return ab.update(st, info), None

  n = 200_000
  state, _ = jax.jit(lambda st: jax.lax.scan(body, st, None, length=n))(state)
  term = float(np.float32(np.sqrt(np.float32(1.5))))
  exact = n * term
  assert int(ab.micro_batches(state)) == 3
  assert abs(float(state.progress) - exact) <= 2 * np.spacing(np.float32(exact))
  assert abs((float(state.progress) - float(state.progress_error)) - exact) <= 1e-7 * exact
  # At 2**24 a plain float32 sum can no longer add 1; the compensated one adds every step.
  none = jaxaccum.contrib.AdaptiveBatch(3)
  st = none.init()._replace(progress=jnp.float32(2**24))
  st, _ = jax.jit(lambda s: jax.lax.scan(lambda c, _: (none.update(c, info), None), s, None,
                                         length=1001))(st)
  assert float(st.progress) - float(st.progress_error) == 2**24 + 1001


def test_replace_keeps_defaults_the_user_never_gave():
  ab = jaxaccum.contrib.AdaptiveBatch(64)
  simple = dataclasses.replace(ab, rule="b_simple")
  assert (simple.theta, simple.fraction) == (None, 0.25)
  back = dataclasses.replace(simple, rule="norm_test")
  assert (back.theta, back.fraction) == (3.0, None) and back == ab
  raised = dataclasses.replace(ab, min_micro_batches=8)
  assert raised.init_micro_batches == 8
  assert dataclasses.replace(raised, min_micro_batches=1).init_micro_batches == 2
  # What the user gave stays given, and the error says how to drop it.
  with pytest.raises(ValueError, match=r"theta=2.0 is the parameter of rule='norm_test'; "
                     r"rule='b_simple' takes fraction .* Drop theta \(theta=None in "
                     r"dataclasses.replace\)"):
    dataclasses.replace(jaxaccum.contrib.AdaptiveBatch(64, theta=2.0), rule="b_simple")
  with pytest.raises(ValueError, match=r"init_micro_batches=2 must lie in \[min_micro_batches"
                     r", max_micro_batches\] = \[8, 64\]; pass an init_micro_batches in "
                     r"that range, or init_micro_batches=None"):
    dataclasses.replace(jaxaccum.contrib.AdaptiveBatch(64, init_micro_batches=2),
                        min_micro_batches=8)


# --- the controller in a real step ---------------------------------------------------------

N, ROWS, DIM, LR = 8, 4, 4, 0.1
W_STAR = jnp.array([1.0, -2.0, 0.5, 3.0])


def weighted_loss(w, batch):
  x, y, mask = batch
  return jnp.sum(0.5 * (x @ w - y) ** 2 * mask), jnp.sum(mask)


def make_batch(t):
  kx, ky, km = jax.random.split(jax.random.fold_in(jax.random.key(0), t), 3)
  x = jax.random.normal(kx, (N * ROWS, DIM))
  y = x @ W_STAR + jax.random.normal(ky, (N * ROWS,))
  mask = (jax.random.uniform(km, (N * ROWS,)) < 0.8).astype(jnp.float32)
  return x, y, mask


VG = jaxaccum.value_and_grad(weighted_loss, num_micro_batches=N, reduce="weighted",
                             with_info=True)
AB = jaxaccum.contrib.AdaptiveBatch(N, theta=1.0, warmup_steps=2, cooldown_steps=1,
                            lr_scaling="sqrt").check(VG)
OPT = optax.inject_hyperparams(optax.sgd)(learning_rate=LR)


@jax.jit
def train_step(w, opt_state, ab_state, batch):
  k = AB.micro_batches(ab_state)
  _, grads, info = VG(w, batch, active_micro_batches=k)
  opt_state.hyperparams["learning_rate"] = LR * AB.lr_scale(ab_state)
  updates, opt_state = OPT.update(grads, opt_state, w)
  return optax.apply_updates(w, updates), opt_state, AB.update(ab_state, info)


def run_steps(w, opt_state, ab_state, start, stop):
  for t in range(start, stop):
    w, opt_state, ab_state = train_step(w, opt_state, ab_state, make_batch(t))
  return w, opt_state, ab_state


W0 = W_STAR + 0.3


def test_one_program_while_k_changes_with_samples_and_lr_by_hand():
  w, opt_state, ab_state = W0, OPT.init(W0), AB.init()
  ref_w, tokens, ks = W0, 0.0, []
  for t in range(9):
    k = int(AB.micro_batches(ab_state))
    ks.append(k)
    batch = make_batch(t)
    w, opt_state, ab_state = train_step(w, opt_state, ab_state, batch)
    # Reference: the rows of micro-batches 0..k-1 (row r is in micro-batch r % N), the
    # token-weighted loss over them through plain jax.grad, SGD at LR * sqrt(k / 2).
    x, y, mask = batch
    ran = mask * (np.arange(N * ROWS) % N < k)
    active = (x, y, ran)
    g = jax.grad(lambda v, b=active: weighted_loss(v, b)[0] / np.sum(b[2]))(ref_w)
    ref_w = ref_w - LR * math.sqrt(k / 2) * g
    tokens += float(np.sum(ran))
    chex.assert_trees_all_close(w, ref_w, rtol=1e-5, atol=1e-6)
    assert AB.sample_count(ab_state) == tokens  # the denominators: real tokens
    # An optax schedule indexed by samples rather than steps.
    lr = optax.linear_schedule(LR, 0.0, 1000)(AB.samples(ab_state))
    np.testing.assert_allclose(lr, LR * (1 - tokens / 1000), rtol=1e-5)
  assert len(set(ks)) >= 3, ks  # k changed at least twice
  assert ks == sorted(ks)
  assert train_step._cache_size() == 1


def test_orbax_round_trip_resumes_bit_identically(tmp_path):
  t_half = 5
  straight = run_steps(W0, OPT.init(W0), AB.init(), 0, 2 * t_half)
  half = run_steps(W0, OPT.init(W0), AB.init(), 0, t_half)
  assert int(AB.micro_batches(half[2])) != int(AB.micro_batches(AB.init()))
  path = tmp_path / "ckpt"
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, {"w": half[0], "opt": half[1], "ab": half[2]})
  ckpt.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          {"w": W0, "opt": OPT.init(W0), "ab": AB.init()})
  restored = ckpt.restore(path, abstract)
  ckpt.close()
  assert isinstance(restored["ab"], jaxaccum.contrib.AdaptiveBatchState)
  chex.assert_trees_all_equal(restored["ab"], half[2])
  resumed = run_steps(restored["w"], restored["opt"], restored["ab"], t_half, 2 * t_half)
  chex.assert_trees_all_equal(resumed, straight)


def test_data_axis_on_8_devices_equals_one_device_fed_the_same_samples():
  """Under data_axis each shard's piece of a micro-batch is a sample: a one-device step whose
  micro-batches are those pieces (N * D of them, k * D active) gives the same statistics,
  so the controller takes the same decisions."""
  devices, n, local = 8, 2, 8  # 8 local rows per device: 2 micro-batches of 4 rows
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  rows = devices * local
  # Single-device micro-batch j = i * D + d (of n * D) holds piece (d, i): local rows i::n
  # of device d; it takes global rows j::(n * D) of its input.
  perm = np.empty(rows, np.int64)
  for d in range(devices):
    for i in range(n):
      for r in range(local // n):
        perm[(i * devices + d) + n * devices * r] = d * local + i + n * r

  def loss(w, batch):
    x, y = batch
    return 0.5 * jnp.mean((x @ w - y) ** 2)

  ab = jaxaccum.contrib.AdaptiveBatch(n, init_micro_batches=1, theta=0.5, warmup_steps=1,
                              cooldown_steps=0)
  vg_dp = jaxaccum.value_and_grad(loss, num_micro_batches=n, with_info=True,
                                  data_axis="data")
  vg_one = jaxaccum.value_and_grad(loss, num_micro_batches=n * devices, with_info=True)

  def step(vg, scale):
    @jax.jit
    def run(w, st, batch):
      _, g, info = vg(w, batch, active_micro_batches=ab.micro_batches(st) * scale)
      return w - 0.1 * g, ab.update(st, info), info
    return run

  dp, one = step(vg_dp, 1), step(vg_one, devices)
  w_dp = w_one = W0
  st_dp, st_one = ab.init(), ab.init()
  ks = [int(ab.micro_batches(st_dp))]
  with jax.set_mesh(mesh):
    for t in range(4):
      kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), t))
      x = jax.random.normal(kx, (rows, DIM))
      y = x @ W_STAR + jax.random.normal(ky, (rows,))
      sharded = tuple(jax.sharding.reshard(a, P("data")) for a in (x, y))
      w_dp, st_dp, info_dp = dp(w_dp, st_dp, sharded)
      w_one, st_one, info_one = one(w_one, st_one, (x[perm], y[perm]))
      chex.assert_trees_all_close(info_dp, info_one, rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(st_dp, st_one, rtol=1e-5, atol=1e-6)
      ks.append(int(ab.micro_batches(st_dp)))
  assert ks[-1] == 2, ks  # one sample per shard suffices under data_axis
  assert ab.sample_count(st_dp) == ab.sample_count(st_one)


def test_multisteps_windows_have_the_lengths_the_controller_chose():
  inner = optax.sgd(LR)
  ms = jaxaccum.MultiSteps(inner, every_k_schedule=1, with_info=True, micro_batch_size=ROWS)
  ab = jaxaccum.contrib.AdaptiveBatch(8, theta=1.0, warmup_steps=1, cooldown_steps=0).check(ms)

  def loss(w, batch):
    x, y = batch
    return 0.5 * jnp.mean((x @ w - y) ** 2)

  @jax.jit
  def call(w, ms_state, ab_state, micro):
    opt = jaxaccum.MultiSteps(inner, every_k_schedule=ab.every_k_schedule(ab_state),
                              with_info=True, micro_batch_size=ROWS)
    updates, ms_state = opt.update(jax.grad(loss)(w, micro), ms_state, w)
    return (optax.apply_updates(w, updates), ms_state, ab.update(ab_state, ms_state.info),
            opt.has_updated(ms_state))

  w, ms_state, ab_state = W0, ms.init(W0), ab.init()
  ref_w, window, windows, t = W0, [], [], 0
  while len(windows) < 5:
    k = int(ab.micro_batches(ab_state))
    x, y, _ = make_batch(t)
    micro = (x[:ROWS], y[:ROWS])
    window.append((k, micro))
    w, ms_state, ab_state, done = call(w, ms_state, ab_state, micro)
    t += 1
    if bool(done):
      # k was the same on every call of the window, and the window has k calls.
      assert len({kk for kk, _ in window}) == 1 and len(window) == window[0][0]
      windows.append(len(window))
      xs = jnp.concatenate([mb[0] for _, mb in window])
      ys = jnp.concatenate([mb[1] for _, mb in window])
      ref_w = ref_w - LR * jax.grad(loss)(ref_w, (xs, ys))
      chex.assert_trees_all_close(w, ref_w, rtol=1e-5, atol=1e-6)
      window = []
  assert windows[0] == 2 and len(set(windows)) >= 2, windows
  assert ab.sample_count(ab_state) == ROWS * sum(windows)
  assert call._cache_size() == 1


# --- errors --------------------------------------------------------------------------------


def test_construction_errors_name_the_argument_and_the_fix():
  with pytest.raises(ValueError, match=r"min_micro_batches=8 is larger than "
                     r"max_micro_batches=4; lower min_micro_batches"):
    jaxaccum.contrib.AdaptiveBatch(4, min_micro_batches=8)
  with pytest.raises(TypeError, match=r"max_micro_batches must be a Python int .* got "
                     r"float 4.0"):
    jaxaccum.contrib.AdaptiveBatch(4.0)
  with pytest.raises(ValueError, match=r"max_micro_batches must be an int >= 1 .* got "
                     r"max_micro_batches=0"):
    jaxaccum.contrib.AdaptiveBatch(0)
  with pytest.raises(TypeError, match="min_micro_batches must be a Python int"):
    jaxaccum.contrib.AdaptiveBatch(4, min_micro_batches=True)
  with pytest.raises(ValueError, match=r"init_micro_batches=1 must lie in \[min_micro_batches"
                     r", max_micro_batches\] = \[2, 4\]"):
    jaxaccum.contrib.AdaptiveBatch(4, min_micro_batches=2, init_micro_batches=1)
  with pytest.raises(ValueError, match=r"rule must be one of 'norm_test', 'b_simple', got "
                     r"rule='bsimple'"):
    jaxaccum.contrib.AdaptiveBatch(4, rule="bsimple")
  with pytest.raises(ValueError, match=r"fraction=0.5 is the parameter of rule='b_simple'; "
                     r"rule='norm_test' takes theta"):
    jaxaccum.contrib.AdaptiveBatch(4, fraction=0.5)
  with pytest.raises(ValueError, match=r"theta=2 is the parameter of rule='norm_test'"):
    jaxaccum.contrib.AdaptiveBatch(4, rule="b_simple", theta=2)
  with pytest.raises(ValueError, match=r"theta must be a finite float > 0.0 .* got theta=0"):
    jaxaccum.contrib.AdaptiveBatch(4, theta=0)
  with pytest.raises(ValueError, match=r"fraction must be a finite float > 0.0 .* got "
                     r"fraction=inf"):
    jaxaccum.contrib.AdaptiveBatch(4, rule="b_simple", fraction=float("inf"))
  with pytest.raises(TypeError, match=r"theta must be a float .* got str"):
    jaxaccum.contrib.AdaptiveBatch(4, theta="3")
  with pytest.raises(ValueError, match=r"max_growth must be a finite float > 1.0 .* got "
                     r"max_growth=1.0"):
    jaxaccum.contrib.AdaptiveBatch(4, max_growth=1.0)
  with pytest.raises(ValueError, match=r"hysteresis must be a finite float >= 0.0"):
    jaxaccum.contrib.AdaptiveBatch(4, hysteresis=-0.1)
  with pytest.raises(ValueError, match=r"warmup_steps must be an int >= 0"):
    jaxaccum.contrib.AdaptiveBatch(4, warmup_steps=-1)
  with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
    jaxaccum.contrib.AdaptiveBatch(4, decay=1.0)
  with pytest.raises(ValueError, match=r"lr_scaling must be one of 'none', 'sqrt', "
                     r"'linear', 'adascale', got lr_scaling='adam'"):
    jaxaccum.contrib.AdaptiveBatch(4, lr_scaling="adam")
  with pytest.raises(TypeError, match="allow_decrease must be a bool"):
    jaxaccum.contrib.AdaptiveBatch(4, allow_decrease="yes")


def test_check_and_update_errors():
  with pytest.raises(ValueError, match=r"AdaptiveBatch\(max_micro_batches=16\) exceeds the "
                     r"transform's num_micro_batches=8: .* Lower max_micro_batches to 8"):
    jaxaccum.contrib.AdaptiveBatch(16).check(VG)
  no_info = jaxaccum.value_and_grad(weighted_loss, num_micro_batches=N, reduce="weighted")
  with pytest.raises(ValueError, match="build the transform with with_info=True"):
    AB.check(no_info)
  with pytest.raises(ValueError, match="build the transform with with_info=True"):
    AB.check(jaxaccum.grad(weighted_loss, num_micro_batches=N, reduce="weighted"))
  assert AB.check(jaxaccum.grad(weighted_loss, num_micro_batches=N, reduce="weighted",
                                with_info=True)) is AB
  with pytest.raises(ValueError, match=r"build the MultiSteps with with_info=True .* "
                     r"with with_info=False its state.info is always empty"):
    AB.check(jaxaccum.MultiSteps(optax.sgd(1.0), 2))
  with pytest.raises(TypeError, match="not a jitted wrapper"):
    AB.check(jax.jit(VG))
  with pytest.raises(TypeError, match=r"got info=None: .* Build the step with "
                     r"with_info=True"):
    AB.update(AB.init(), None)
  # What a step built without with_info returns in info's place: the gradients.
  _, grads = jaxaccum.value_and_grad(weighted_loss, num_micro_batches=N,
                                     reduce="weighted")(W0, make_batch(0))
  with pytest.raises(TypeError, match=r"takes the step's jaxaccum.AccumInfo .* got an array "
                     r"of shape \(4,\)"):
    AB.update(AB.init(), grads)
  with pytest.raises(TypeError, match="takes the AdaptiveBatchState"):
    AB.update(AB.init().noise, info_for(2, 1.0, 1.0))
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), info_for(2, 1.0, 1.0))
  with pytest.raises(TypeError, match=r"AccumInfo of one step .* use jax.lax.scan"):
    AB.update(AB.init(), stacked)


def _wraps(transform):
  @functools.wraps(transform)  # copies the transform's attributes, options included
  def wrapper(*args, **kwargs):
    return transform(*args, **kwargs)
  return wrapper


@pytest.mark.parametrize(("make", "takes"), [
    (lambda: VG, True),
    (lambda: jaxaccum.grad(weighted_loss, num_micro_batches=N, reduce="weighted",
                           with_info=True), True),
    (lambda: jax.jit(jaxaccum.grad(weighted_loss, num_micro_batches=N, reduce="weighted",
                                   with_info=True)), True),  # its value_and_grad is VG's kind
    (lambda: jaxaccum.evaluate(weighted_loss, num_micro_batches=N, reduce="weighted"), False),
    (lambda: jax.jit(VG), False),
    (lambda: _wraps(VG), False),
    (lambda: functools.partial(VG), False),
    (lambda: weighted_loss, False),
], ids=["value_and_grad", "grad", "jit(grad)", "evaluate", "jit(value_and_grad)",
        "functools.wraps", "partial", "plain function"])
def test_check_takes_the_transforms_that_differentiate_and_refuses_their_wrappers(make, takes):
  # check reads the transform's options without importing the API: what it takes is what
  # value_and_grad and grad return, whatever copies the options' attribute.
  transform = make()
  if takes:
    assert AB.check(transform) is AB
  else:
    with pytest.raises(TypeError, match=r"AdaptiveBatch.check takes what "
                       r"jaxaccum.value_and_grad or jaxaccum.grad returned \(not a jitted "
                       r"wrapper\), or a jaxaccum.MultiSteps; got "):
      AB.check(transform)


def test_weighted_controller_decides_in_micro_batches_whatever_the_unit_of_samples():
  # Rows of L tokens, every token real: the token-weighted mean over the tokens that ran is
  # the row mean, so the two reductions give the same gradients. B_simple and the counter
  # are in tokens under "weighted" (L times the rows' values), while k* = B* / m, with m
  # in the same unit, is a number of micro-batches: the same k on every step, same theta.
  n, rows, length, dim = 8, 2, 5, 3

  def row_loss(w, batch):
    x, y, _ = batch
    return 0.5 * jnp.mean((x @ w - y) ** 2)

  def token_loss(w, batch):
    x, y, mask = batch
    return jnp.sum(0.5 * (x @ w - y) ** 2 * mask), jnp.sum(mask)

  ab = jaxaccum.contrib.AdaptiveBatch(n, theta=1.0, warmup_steps=2, cooldown_steps=1)
  runs = {}
  for name, loss, reduce in (("rows", row_loss, "mean"), ("tokens", token_loss, "weighted")):
    vg = jaxaccum.value_and_grad(loss, num_micro_batches=n, reduce=reduce, with_info=True)

    @jax.jit
    def step(w, st, t, vg=vg):
      kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(5), t))
      x = jax.random.normal(kx, (n * rows, length, dim))
      y = x @ jnp.array([1.0, -1.0, 0.5]) + 2.0 * jax.random.normal(ky, (n * rows, length))
      _, g, info = vg(w, (x, y, jnp.ones((n * rows, length))),
                      active_micro_batches=ab.micro_batches(st))
      return w - 0.05 * g, ab.update(st, info)

    w, st, ks, b_simple = jnp.array([1.2, -0.8, 0.7]), ab.init(), [], []
    for t in range(14):
      w, st = step(w, st, t)
      ks.append(int(ab.micro_batches(st)))
      b_simple.append(float(ab.b_simple(st)))
    runs[name] = ks, np.array(b_simple), ab.sample_count(st)
  assert runs["tokens"][0] == runs["rows"][0] and len(set(runs["rows"][0])) >= 2, runs
  np.testing.assert_allclose(runs["tokens"][1], length * runs["rows"][1], rtol=2e-4)
  assert runs["tokens"][2] == length * runs["rows"][2]
