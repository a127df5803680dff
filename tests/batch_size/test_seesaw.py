"""jaxaccum.contrib.seesaw: the rule against sequences computed by hand (step and cosine references,
both optimizers, the cap) and over generated schedules, exact counts past 2**31, one
compiled program while k changes, every row used once (RowFeeder), MultiSteps windows, the
noise guard, an orbax round trip, and the errors."""

import functools
import math
from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import jaxaccum

# The rule's tolerance on a level: equal within 8 float32 ulps counts as decayed.
ULPS8 = 8 * 2.0**-23


def hand(schedule, n, *, init, cap, optimizer="adam", r=2, start=0):
  """``(k, lr)`` at ``n`` from the rule's definition: ``j`` the largest with
  ``schedule(n) * r**j <= peak`` within 8 float32 ulps (0 before ``start``), ``k =
  min(init * r**j, cap)``."""
  peak = float(schedule(start))
  value = float(schedule(n))
  j = 0
  if n >= start:
    while init * r ** j < cap and value * float(r) ** (j + 1) <= peak * (1 + ULPS8):
      j += 1
  k = min(init * r ** j, cap)
  factor = math.sqrt(k / init) if optimizer == "adam" else k / init
  return k, np.float32(schedule(n)) * np.float32(factor)


def check_against_hand(rule, counts):
  """Every path (Python int, jitted int32 and float32, SeesawState, AdaptiveBatchState)
  gives the hand sequence: k exactly, the learning rate to float32 round-off."""
  kw = dict(init=rule.init_micro_batches, cap=rule.max_micro_batches,
            optimizer=rule.optimizer, r=rule.ramp_factor, start=rule.decay_start)
  want = [hand(rule.schedule, int(n), **kw) for n in counts]
  ks = [int(rule.micro_batches(int(n))) for n in counts]
  assert ks == [k for k, _ in want]
  lrs = [float(rule.learning_rate(int(n))) for n in counts]
  np.testing.assert_allclose(lrs, [lr for _, lr in want], rtol=1e-6, atol=0)
  small = [n for n in counts if n < 2**31]
  if small:
    # Every jitted path in one program (one compilation per rule): int32 and float32
    # counts, SeesawState, and the controller's exact two-word counter (AdaptiveBatchState).
    exact = [n for n in small if n < 2**24]  # float32 counts, exact below 2**24
    ab = jaxaccum.contrib.AdaptiveBatch(8).init()

    @jax.jit
    def paths(ints, floats, his, los):
      k = jax.vmap(rule.micro_batches)
      states = jax.vmap(lambda n: rule.update(rule.init(), samples=n))(ints.astype(jnp.float32))
      ab_states = jax.vmap(lambda hi, lo: ab._replace(samples_hi=hi, samples_lo=lo))(his, los)
      return k(ints), k(states), k(ab_states), k(floats)

    arr = np.asarray(small, np.int64)
    by_int, by_state, by_counter, by_float = paths(
        jnp.asarray(arr, jnp.int32), jnp.asarray(exact, jnp.float32),
        jnp.asarray(arr >> 24, jnp.int32), jnp.asarray(arr & (2**24 - 1), jnp.int32))
    assert by_int.tolist() == ks[:len(small)]
    assert by_state.tolist() == ks[:len(small)]
    assert by_counter.tolist() == ks[:len(small)]
    assert by_float.tolist() == ks[:len(exact)]


# --- hand-picked references ------------------------------------------------------------------


def test_step_decay_by_hand_adam_and_sgd():
  ref = optax.piecewise_constant_schedule(1.0, {100: 0.5, 200: 0.5, 300: 0.5, 400: 0.1})
  counts = [0, 99, 100, 199, 200, 300, 399, 400, 10_000]
  adam = jaxaccum.contrib.seesaw(ref, init_micro_batches=1, max_micro_batches=4, total=20_000)
  # Lr 1, .5, .25, .125, .0125 -> k 1, 2, 4 (cap), 4, 4; lr x sqrt(k).
  assert [int(adam.micro_batches(n)) for n in counts] == [1, 1, 2, 2, 4, 4, 4, 4, 4]
  np.testing.assert_allclose([float(adam.learning_rate(n)) for n in counts],
                             [1, 1, .5 * 2**.5, .5 * 2**.5, .5, .25, .25, .025, .025],
                             rtol=1e-6)
  sgd = jaxaccum.contrib.seesaw(ref, init_micro_batches=3, max_micro_batches=100, optimizer="sgd",
                        total=20_000)
  # Three halvings, then 1/10: 1/80 of the peak is 6 halvings (64 <= 80 < 128), k = 3 * 64
  # capped at 100, where the rest of the decay stays: lr = 1/80 * 100/3.
  assert sgd.ks == (3, 6, 12, 24, 100)
  assert sgd.thresholds == (0, 100, 200, 300, 400)
  np.testing.assert_allclose([float(sgd.learning_rate(n)) for n in counts],
                             [1, 1, 1, 1, 1, 1, 1, 100 / 240, 100 / 240], rtol=1e-6)
  check_against_hand(adam, counts)
  check_against_hand(sgd, counts)


def test_cosine_with_warmup_by_hand():
  """Cosine to 0 after a warm-up: halvings where cos(pi t) = 0, -1/2, -3/4, ... of the
  decay; the cap (not a power of two times init) is the last level."""
  warm, total = 100, 1100
  ref = optax.warmup_cosine_decay_schedule(0.0, 1.0, warm, total, end_value=0.0)
  rule = jaxaccum.contrib.seesaw(ref, init_micro_batches=2, max_micro_batches=12, decay_start=warm,
                         total=total)
  assert rule.ks == (2, 4, 8, 12)
  # 0.5 (1 + cos(pi t)) = 2**-j  ->  t = arccos(2**(1-j) - 1) / pi.
  for j, th in enumerate(rule.thresholds[1:], start=1):
    t = math.acos(2.0 ** (1 - j) - 1) / math.pi
    assert abs(th - (warm + t * (total - warm))) <= 1, (j, th)
    assert float(ref(th)) * 2**j <= 1.0 < float(ref(th - 1)) * 2**j
  counts = list(range(0, total + 50, 7)) + list(rule.thresholds) + [
      t - 1 for t in rule.thresholds[1:]]
  check_against_hand(rule, sorted(counts))
  check_against_hand(jaxaccum.contrib.seesaw(ref, init_micro_batches=2, max_micro_batches=12,
                                     decay_start=warm, total=total, optimizer="sgd"), counts)


def test_optax_step_schedule_indexed_by_samples():
  """The docs' recipe: a step-indexed schedule at B0 rows per step is n -> sched(n // B0)."""
  b0 = 16
  sched = optax.exponential_decay(1.0, transition_steps=10, decay_rate=0.5, staircase=True)
  rule = jaxaccum.contrib.seesaw(lambda n: sched(n // b0), init_micro_batches=1,
                         max_micro_batches=8, total=100 * b0)
  assert rule.thresholds == (0, 10 * b0, 20 * b0, 30 * b0)
  check_against_hand(rule, [0, 159, 160, 320, 479, 480, 1599])


# --- generated schedules ---------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_generated_step_schedules_match_the_hand_rule(data):
  bounds = sorted(set(data.draw(st.lists(st.integers(1, 5000), min_size=1, max_size=6))))
  scales = data.draw(st.lists(st.floats(0.05, 1.0), min_size=len(bounds),
                              max_size=len(bounds)))
  init = data.draw(st.integers(1, 5))
  cap = init * data.draw(st.integers(1, 70))
  optimizer = data.draw(st.sampled_from(["adam", "sgd"]))
  r = data.draw(st.sampled_from([2, 2, 3, 4]))
  ref = optax.piecewise_constant_schedule(0.3, dict(zip(bounds, scales, strict=True)))
  rule = jaxaccum.contrib.seesaw(ref, init_micro_batches=init, max_micro_batches=cap,
                         optimizer=optimizer, ramp_factor=r, total=6000)
  counts = sorted({0, 6000} | {b + d for b in bounds for d in (-1, 0, 1)}
                  | set(data.draw(st.lists(st.integers(0, 6000), max_size=20))))
  check_against_hand(rule, counts)


@settings(max_examples=8, deadline=None)
@given(warm=st.integers(0, 300), total=st.integers(400, 100_000), alpha=st.floats(0, 0.5),
       init=st.integers(1, 4), levels=st.integers(0, 6),
       optimizer=st.sampled_from(["adam", "sgd"]), seed=st.integers(0, 2**31))
def test_generated_cosine_schedules_match_the_hand_rule(warm, total, alpha, init, levels,
                                                        optimizer, seed):
  ref = optax.warmup_cosine_decay_schedule(0.0, 1e-3, max(warm, 1), total,
                                           end_value=1e-3 * alpha)
  start = max(warm, 1)
  rule = jaxaccum.contrib.seesaw(ref, init_micro_batches=init, max_micro_batches=init * 2**levels,
                         optimizer=optimizer, decay_start=start, total=total)
  rng = np.random.default_rng(seed)
  counts = sorted(set(rng.integers(0, total + 10, 40).tolist())
                  | {t + d for t in rule.thresholds for d in (-1, 0)} - {-1})
  check_against_hand(rule, counts)


def test_counts_past_2_31_are_exact():
  edge = 3 * 2**31 + 5
  ref = optax.piecewise_constant_schedule(1.0, {edge: 0.5})
  # The reference is a Python-int function of samples here, so it is exact at any size.
  rule = jaxaccum.contrib.seesaw(lambda n: 1.0 if n < edge else 0.5, init_micro_batches=2,
                         max_micro_batches=4, total=2**40)
  del ref
  assert rule.thresholds == (0, edge)
  assert [int(rule.micro_batches(n)) for n in (edge - 1, edge)] == [2, 4]
  state = rule.init()
  update = jax.jit(lambda s, n: rule.update(s, samples=n))
  for _ in range(3):
    state = update(state, jnp.float32(2**31))
  state = update(state, jnp.float32(4))
  assert rule.sample_count(state) == edge - 1
  assert int(jax.jit(rule.micro_batches)(state)) == 2
  state = update(state, jnp.float32(1))
  assert int(jax.jit(rule.micro_batches)(state)) == 4
  assert int(rule.micro_batches(np.int64(edge))) == 4
  # Counts whose low word is past the threshold's but whose high word is not (and back).
  for count in (100, 2**24 + 6, 2**31 + 2**24 - 1, edge - 2**24 + 7, edge + 2**24 - 1):
    state = rule.update(rule.init(), samples=jnp.float32(0))
    state = state._replace(samples_hi=jnp.int32(count >> 24),
                           samples_lo=jnp.int32(count & (2**24 - 1)))
    assert rule.sample_count(state) == count
    assert int(jax.jit(rule.micro_batches)(state)) == (4 if count >= edge else 2), count


def float32_at_or_above(n):
  """The smallest float32 at or above the Python int ``n >= 0``: float32 holds the counts
  past ``2**24`` only every ``2**(e - 23)``."""
  f = np.float32(n)  # the nearest: one step up if it is below n
  return f if int(f) >= n else np.nextafter(f, np.float32(np.inf))


def exact_steps(drops):
  """A step reference, 1.0 times ``scale`` from each ``(count, scale)`` of ``drops`` on,
  exact at every count: a Python int compared as it is, a float32 count with the first
  float32 at or above each drop (so it decays exactly where the Python int does)."""
  firsts = [float32_at_or_above(b) for b, _ in drops]

  def schedule(n):
    if isinstance(n, int):
      return math.prod(scale for b, scale in drops if n >= b)
    n = jnp.asarray(n, jnp.float32)
    value = jnp.float32(1.0)
    for first, (_, scale) in zip(firsts, drops, strict=True):
      value = jnp.where(n >= first, value * jnp.float32(scale), value)
    return value

  return schedule


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_learning_rate_from_a_counter_past_2_24_is_the_levels(data):
  """From a state's exact counter, past 2**24 where float32 cannot hold every count: the
  learning rate at count n is the reference at n times the factor of the level at n, on
  the first and last count of every level (the reference read at a float32 count rounded
  below a threshold would give the first step of a level twice the rule's learning rate).
  Reference: the rule by hand in Python ints (``hand``)."""
  r = data.draw(st.sampled_from([2, 3, 4]))
  near = st.integers(2**24 - 4, 2**24 + 64)
  counts = sorted(set(data.draw(st.lists(st.one_of(near, st.integers(2**24, 2**40)),
                                         min_size=1, max_size=4))))
  bounds = []  # two levels within one float32 step cannot both be read from a float32
  for b in counts:
    if not bounds or float32_at_or_above(b) > np.nextafter(
        float32_at_or_above(bounds[-1]), np.float32(np.inf)):
      bounds.append(b)
  powers = data.draw(st.lists(st.integers(1, 2), min_size=len(bounds), max_size=len(bounds)))
  init = data.draw(st.integers(1, 3))
  optimizer = data.draw(st.sampled_from(["adam", "sgd"]))
  schedule = exact_steps([(b, 1 / r**m) for b, m in zip(bounds, powers, strict=True)])
  rule = jaxaccum.contrib.seesaw(schedule, init_micro_batches=init, optimizer=optimizer,
                         max_micro_batches=init * r ** sum(powers), ramp_factor=r, total=2**41)
  assert rule.thresholds == (0, *bounds)
  seen = sorted({max(b + d, 0) for b in bounds for d in (-2, -1, 0, 1, 2)}
                | {b + d * 2 ** max(b.bit_length() - 24, 0) for b in bounds for d in (-1, 1)}
                | set(data.draw(st.lists(st.integers(0, 2**41), max_size=8))))
  kw = dict(init=init, cap=rule.max_micro_batches, optimizer=optimizer, r=r)
  want = [hand(schedule, n, **kw) for n in seen]
  ab = jaxaccum.contrib.AdaptiveBatch(8).init()

  @jax.jit
  def read(his, los):
    states = jax.vmap(lambda hi, lo: rule.init()._replace(samples_hi=hi, samples_lo=lo))(
        his, los)
    ab_states = jax.vmap(lambda hi, lo: ab._replace(samples_hi=hi, samples_lo=lo))(his, los)
    return (jax.vmap(rule.micro_batches)(states), jax.vmap(rule.learning_rate)(states),
            jax.vmap(rule.learning_rate)(ab_states))

  arr = np.asarray(seen, np.int64)
  ks, lrs, ab_lrs = read(jnp.asarray(arr >> 24, jnp.int32),
                         jnp.asarray(arr & (2**24 - 1), jnp.int32))
  assert ks.tolist() == [k for k, _ in want]
  np.testing.assert_allclose(lrs, [lr for _, lr in want], rtol=1e-6, atol=0)
  np.testing.assert_allclose(ab_lrs, [lr for _, lr in want], rtol=1e-6, atol=0)


def rational_levels(drops, *, init, cap, r):
  """``(thresholds, ks)`` of a step reference in exact rationals: ``drops`` is ``[(count,
  factor)]`` (Fractions), the level the largest ``j`` with ``value * r**j <= peak``."""
  thresholds, ks, value = [0], [init], Fraction(1)
  for b, factor in drops:
    value *= factor
    j = 0
    while init * r**j < cap and value * r ** (j + 1) <= 1:
      j += 1
    k = min(init * r**j, cap)
    if k > ks[-1]:
      thresholds.append(b)
      ks.append(k)
  return tuple(thresholds), tuple(ks)


@settings(max_examples=12, deadline=None)
@example(r=3, drops=[(1, 1)] * 3, peak=1.0, init=1, levels=3)
@example(r=10, drops=[(1, 1)] * 2, peak=1.0, init=1, levels=2)
@given(r=st.integers(2, 12),
       drops=st.lists(st.tuples(st.integers(1, 2), st.one_of(st.just(1),
                                                              st.integers(50, 950))),
                      min_size=1, max_size=4),
       peak=st.sampled_from([1.0, 0.3, 3e-4]), init=st.integers(1, 3),
       levels=st.integers(1, 8))
def test_ramp_factor_r_ramps_once_per_r_fold_decay(r, drops, peak, init, levels):
  """``ramp_factor=r`` on a float32 step reference (optax): a decay by exactly ``1/r**m``
  (``1/3``, ``0.1``, which float32 rounds one ulp up) is ``m`` levels; the levels against
  the rule in exact rationals. Each drop is ``1/r**m`` (the second entry 1) or ``a/1000``,
  kept away from every level by more than float32 round-off."""
  factors = [Fraction(1, r**m) if a == 1 else Fraction(a, 1000) for m, a in drops]
  value = Fraction(1)
  for f in factors:  # off-level products: more than 1e-4 from peak / r**j
    value *= f
    assume(all(v == 1 or abs(v - 1) > Fraction(1, 10**4)
               for v in (value * r**j for j in range(1, 64))))
  bounds = [100 * (i + 1) for i in range(len(factors))]
  ref = optax.piecewise_constant_schedule(peak, {b: float(f) for b, f in zip(
      bounds, factors, strict=True)})
  cap = init * r**levels
  rule = jaxaccum.contrib.seesaw(ref, init_micro_batches=init, max_micro_batches=cap, ramp_factor=r,
                         total=100 * (len(factors) + 1))
  assert (rule.thresholds, rule.ks) == rational_levels(
      list(zip(bounds, factors, strict=True)), init=init, cap=cap, r=r)


# --- inside a train step ---------------------------------------------------------------------

N, M, D = 8, 2, 3  # micro-batches, rows per micro-batch, features
REF = optax.piecewise_constant_schedule(0.1, {20: 0.5, 40: 0.5, 60: 0.5, 200: 0.5})
RULE = jaxaccum.contrib.seesaw(REF, init_micro_batches=1, max_micro_batches=N, total=400)


def loss_fn(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


VG = jaxaccum.value_and_grad(loss_fn, num_micro_batches=N, with_info=True)
OPT = optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, weight_decay=0.1, b2=0.99)


@jax.jit
def train_step(w, opt_state, state, batch):
  k = RULE.micro_batches(state)
  _, grads, info = VG(w, batch, active_micro_batches=k)
  opt_state.hyperparams.update(learning_rate=RULE.learning_rate(state),
                               b2=RULE.b2(state, 0.99))
  updates, opt_state = OPT.update(grads, opt_state, w)
  return optax.apply_updates(w, updates), opt_state, RULE.update(state, info), grads


def stream(rows):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(rows, D)).astype(np.float32)
  return x, (x @ np.arange(1.0, D + 1) + 0.1 * rng.normal(size=rows)).astype(np.float32)


def test_one_program_every_row_once_and_the_gradient_of_the_rows_that_ran():
  """RowFeeder feeds k * M fresh rows each step; the step's gradient is that of exactly
  those rows (plain jax.grad on them); over the run every row runs once, k takes every
  level, and one compiled program serves them all."""
  x, y = stream(400)
  feeder = jaxaccum.contrib.RowFeeder((x, y), num_micro_batches=N, micro_batch_size=M)
  w, opt_state, state = jnp.zeros(D), OPT.init(jnp.zeros(D)), RULE.init()
  ks, used = [], 0
  while True:
    k = int(RULE.micro_batches(state))
    if feeder.position + k * M > len(x):
      break
    start = feeder.position
    batch = feeder.next_batch(k)
    rows = (x[start:start + k * M], y[start:start + k * M])
    w_before = w
    w, opt_state, state, grads = train_step(w, opt_state, state, batch)
    # Micro-batch i of the step holds rows[i::k]; the mean over them all is the mean loss.
    chex.assert_trees_all_close(grads, jax.grad(loss_fn)(w_before, rows), rtol=1e-5,
                               atol=1e-6)
    ks.append(k)
    used += k * M
  assert RULE.sample_count(state) == used == feeder.position
  assert used > len(x) - N * M
  assert sorted(set(ks)) == list(RULE.ks) and ks == sorted(ks)
  # The sample counter drives the same k the hand rule gives at each step's count.
  counts = np.cumsum([0] + [k * M for k in ks[:-1]])
  assert ks == [hand(REF, int(c), init=1, cap=N)[0] for c in counts]
  assert train_step._cache_size() == 1


def test_multisteps_window_follows_the_rule():
  """With MultiSteps, k is the window length: one micro-batch per call, and the rule's
  counter advances when a window completes."""
  rule = jaxaccum.contrib.seesaw(REF, init_micro_batches=1, max_micro_batches=4, total=400)
  state = rule.init()
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), every_k_schedule=lambda step: ks_now[0])
  w = jnp.zeros(D)
  ms_state = ms.init(w)
  x, y = stream(200)
  windows, calls = [], 0
  for i in range(0, 200, M):
    ks_now = [int(rule.micro_batches(state))]
    grads = jax.grad(loss_fn)(w, (x[i:i + M], y[i:i + M]))
    updates, ms_state = ms.update(grads, ms_state, w)
    w = optax.apply_updates(w, updates)
    calls += 1
    if calls == ks_now[0]:
      windows.append(calls)
      state = rule.update(state, samples=calls * M)
      calls = 0
  assert windows == [hand(REF, int(c), init=1, cap=4)[0]
                     for c in np.cumsum([0] + [k * M for k in windows[:-1]])]
  assert set(windows) == {1, 2, 4}
  assert rule.every_k_schedule(state)(0) == rule.micro_batches(state)


def run(w, opt_state, state, start, stop, x, y):
  for i in range(start, stop):
    batch = (x[i * N * M:(i + 1) * N * M], y[i * N * M:(i + 1) * N * M])
    w, opt_state, state, _ = train_step(w, opt_state, state, batch)
  return w, opt_state, state


def test_orbax_round_trip_resumes_bit_identically(tmp_path):
  x, y = stream(30 * N * M)
  w0 = jnp.zeros(D)
  straight = run(w0, OPT.init(w0), RULE.init(), 0, 30, x, y)
  half = run(w0, OPT.init(w0), RULE.init(), 0, 15, x, y)
  assert int(RULE.micro_batches(half[2])) > RULE.init_micro_batches
  assert int(RULE.micro_batches(straight[2])) > int(RULE.micro_batches(half[2]))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", {"w": half[0], "opt": half[1], "seesaw": half[2]})
  ckpt.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          {"w": w0, "opt": OPT.init(w0), "seesaw": RULE.init()})
  restored = ckpt.restore(tmp_path / "ckpt", abstract)
  ckpt.close()
  assert isinstance(restored["seesaw"], jaxaccum.contrib.SeesawState)
  chex.assert_trees_all_equal(restored["seesaw"], half[2])
  resumed = run(restored["w"], restored["opt"], restored["seesaw"], 15, 30, x, y)
  chex.assert_trees_all_equal(resumed, straight)


# --- the noise guard and couplings -----------------------------------------------------------


def info_for(k, g2, tr, m=2.0):
  """A step of k micro-batches of m rows whose estimates are exactly |G|^2 = g2 and
  tr(Sigma) = tr (so B_simple = tr / g2)."""
  big = k * m
  return jaxaccum.AccumInfo(
      num_micro_batches=jnp.int32(k), micro_batch_size=jnp.float32(m),
      batch_size=jnp.float32(big), micro_grad_sq_norm=jnp.float32(g2 + tr / m),
      batch_grad_sq_norm=jnp.float32(g2 + tr / big), num_samples=jnp.int32(k),
      skipped=jnp.int32(0))


def guarded_by_hand(guard, b_simple):
  """The k of each step of REF's rule (init 2, cap 16, 2 rows per micro-batch) with
  ``noise_guard=guard``, by hand, given each step's B_simple: the ramp's k until a step
  whose next level's batch (k' * 2 rows) would pass guard * B_simple; then k stays there."""
  want, count, frozen = [], 0, None
  for b in b_simple:
    k = frozen or hand(REF, count, init=2, cap=16)[0]
    want.append(k)
    count += 2 * k
    k_next = hand(REF, count, init=2, cap=16)[0]
    if frozen is None and k_next > k and k_next * 2 > guard * b:
      frozen = k
  return want


@pytest.mark.parametrize("b_simple,guard", [(5.0, 1.0), (9.0, 1.0), (100.0, 1.0), (5.0, 2.0)])
def test_noise_guard_stops_before_the_batch_passes_the_measured_noise_scale(b_simple, guard):
  rule = jaxaccum.contrib.seesaw(REF, init_micro_batches=2, max_micro_batches=16, total=400,
                         noise_guard=guard)
  update = jax.jit(rule.update)
  state, ks = rule.init(), []
  for _ in range(60):
    k = int(rule.micro_batches(state))
    ks.append(k)
    state = update(state, info_for(k, g2=1.0, tr=b_simple))
  assert ks == guarded_by_hand(guard, [b_simple] * 60)
  assert max(ks) * 2 <= max(guard * b_simple, 4)
  # The learning rate keeps decaying as plain decay at the frozen k.
  count = rule.sample_count(state)
  np.testing.assert_allclose(float(rule.learning_rate(state)),
                             float(REF(count)) * math.sqrt(ks[-1] / 2), rtol=1e-6)


# Rules with B_simple read from each step alone (noise_decay=0), one compiled run each.
GUARDED = {guard: jaxaccum.contrib.seesaw(REF, init_micro_batches=2, max_micro_batches=16,
                                          total=400, noise_guard=guard, noise_decay=0.0)
           for guard in (1.0, 2.0)}


@functools.cache
def guarded_run(guard):
  rule = GUARDED[guard]

  @jax.jit
  def run(b_simple):
    def step(state, b):
      k = rule.micro_batches(state)
      return rule.update(state, info_for(k, g2=1.0, tr=b)), k
    return jax.lax.scan(step, rule.init(), b_simple)[1]

  return run


@settings(max_examples=10, deadline=None)
@example(guard=1.0, b_simple=[100.5] * 3 + [1.5] + [100.5] * 56)  # small where k stays
@given(guard=st.sampled_from([1.0, 2.0]),
       b_simple=st.lists(st.sampled_from([1.5, 2.5, 5.5, 9.5, 17.5, 33.5, 100.5]),
                         min_size=60, max_size=60))
def test_noise_guard_reads_the_noise_only_when_the_level_would_change(guard, b_simple):
  """B_simple moving from step to step: the ramp stops only on a step that would take it
  to the next level with a batch above guard * B_simple (that step's, as noise_decay=0
  reads it); a small B_simple on a step that stays at its level stops nothing. Reference:
  the rule by hand (``hand``), 2 rows per micro-batch; B_simple is a half-integer, so no
  batch (an even number of rows) is within round-off of guard * B_simple."""
  ks = guarded_run(guard)(jnp.asarray(b_simple, jnp.float32))
  assert ks.tolist() == guarded_by_hand(guard, b_simple)


def test_b2_coupling_in_closed_form():
  ks = np.array(RULE.ks, float)
  for level, th in enumerate(RULE.thresholds):
    s = ks[level] / RULE.init_micro_batches
    np.testing.assert_allclose(float(RULE.b2(th, 0.99)), 0.99 ** s, rtol=1e-6)


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(schedule=0.1), TypeError, r"schedule must be a callable.*sched\(n // B0\)"),
    (dict(init_micro_batches=8, max_micro_batches=4), ValueError,
     r"init_micro_batches=8 is more than max_micro_batches=4"),
    (dict(init_micro_batches=2.0), TypeError, r"init_micro_batches must be a Python int"),
    (dict(max_micro_batches=0), ValueError, r"max_micro_batches must be an int >= 1"),
    (dict(optimizer="lion"), ValueError, r"optimizer must be 'adam'.*'sgd'.*optimizer='lion'"),
    (dict(ramp_factor=1), ValueError, r"ramp_factor must be an int >= 2.*ramp_factor=1"),
    (dict(decay_start=-1), ValueError, r"decay_start must be an int >= 0"),
    (dict(total=0), ValueError, r"total must be an int >= 1"),
    (dict(noise_guard=0.0), ValueError, r"noise_guard must be None or a finite float > 0"),
    (dict(noise_guard="1"), TypeError, r"noise_guard must be None or a float"),
    (dict(noise_decay=1.0), ValueError, r"decay must be in \[0, 1\)"),
    (dict(schedule=optax.linear_schedule(0.0, 1.0, 100)), ValueError,
     r"positive at its peak.*schedule\(0\)=0.0.*decay_start="),
    (dict(schedule=optax.warmup_cosine_decay_schedule(0.1, 1.0, 100, 1000)), ValueError,
     r"rises from schedule\(0\)=0\.1.*to schedule\(\d+\)=.*decay_start="),
    (dict(schedule=lambda n: jnp.ones(3)), TypeError, r"must return a scalar learning rate"),
])
def test_errors_name_the_argument_the_value_and_the_fix(kwargs, error, match):
  args = dict(schedule=REF, init_micro_batches=1, max_micro_batches=8, total=400)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    jaxaccum.contrib.seesaw(args.pop("schedule"), **args)


def test_update_errors():
  with pytest.raises(TypeError, match="SeesawState from init"):
    RULE.update(None, samples=1)
  with pytest.raises(TypeError, match="without samples=, it counts"):
    RULE.update(RULE.init())
  guarded = jaxaccum.contrib.seesaw(REF, init_micro_batches=1, max_micro_batches=8, total=400,
                            noise_guard=1.0)
  with pytest.raises(TypeError, match=r"noise_guard=1.0 needs the step's jaxaccum.AccumInfo"):
    guarded.update(guarded.init(), samples=4)
  with pytest.raises(ValueError, match=r"b2 must be a float in \[0, 1\), got b2=1.5"):
    RULE.b2(0, 1.5)
