"""jaxaccum.batch_size_ramp: values at given steps, traced steps, and bad arguments.

Its use as ``MultiSteps(every_k_schedule=...)`` is tested in test_multisteps_stats.py.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum


def reference_linear(init, end, steps, begin, step):
  """The documented formula, in Python integers."""
  t = min(max(step - begin, 0), steps)
  delta = end - init
  move = abs(delta) * t // steps
  return init + (move if delta >= 0 else -move)


@pytest.mark.parametrize(("init", "end", "steps", "begin"), [
    (1, 8, 100, 0), (1, 8, 100, 20), (8, 1, 100, 0), (2, 64, 7, 3), (3, 3, 10, 0),
    (1, 2, 1, 0)])
def test_linear_values_equal_the_formula(init, end, steps, begin):
  ramp = jaxaccum.batch_size_ramp(init, end, steps, begin)
  probe = list(range(0, begin + steps + 5)) + [10**6, -3]
  traced = jax.jit(jax.vmap(ramp))(jnp.asarray(probe, jnp.int32))
  assert traced.dtype == jnp.int32
  expected = [reference_linear(init, end, steps, begin, s) for s in probe]
  np.testing.assert_array_equal(traced, expected)
  assert [int(ramp(s)) for s in probe[:5]] == expected[:5]
  assert int(ramp(begin + steps)) == end and int(ramp(begin)) == init


def test_documented_values():
  ramp = jaxaccum.batch_size_ramp(init_value=1, end_value=8, transition_steps=100)
  # k = 1 + floor(7 t / 100): 2 from t = 15 (105 >= 100), 8 at t = 100.
  assert [int(ramp(s)) for s in (0, 14, 15, 28, 29, 99, 100, 2**40)] == [1, 1, 2, 2, 3, 7, 8, 8]
  steps = jaxaccum.batch_size_ramp(init_value=2, boundaries_and_values={30: 8, 10: 4})
  assert [int(steps(s)) for s in (0, 9, 10, 29, 30, 10**9)] == [2, 2, 4, 4, 8, 8]
  down = jaxaccum.batch_size_ramp(init_value=8, boundaries_and_values={5: 1})
  assert [int(down(s)) for s in (4, 5)] == [8, 1]


def test_traced_step_compiles_once():
  ramp = jaxaccum.batch_size_ramp(init_value=1, end_value=4, transition_steps=6)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def k_at(step):
    return ramp(step)

  assert [int(k_at(jnp.int32(s))) for s in range(8)] == [1, 1, 2, 2, 3, 3, 4, 4]
  # The float step of an optax-style count (e.g. from inject_hyperparams) is floored.
  assert int(ramp(jnp.float32(3.9))) == 2


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"init_value": 0, "end_value": 4, "transition_steps": 10}, ValueError,
     "init_value must be an int in [1, 2**31 - 1] (the number of micro-batches at step 0), "
     "got init_value=0"),
    ({"init_value": 1.5, "end_value": 4, "transition_steps": 10}, TypeError,
     "init_value must be a Python int"),
    ({"init_value": True, "end_value": 4, "transition_steps": 10}, TypeError,
     "got True of type bool"),
    ({"init_value": 1, "end_value": 0, "transition_steps": 10}, ValueError,
     "end_value must be an int in [1, 2**31 - 1]"),
    ({"init_value": 1, "end_value": 4, "transition_steps": 0}, ValueError,
     "transition_steps must be an int in [1, 2**31 - 1]"),
    ({"init_value": 1, "end_value": 4, "transition_steps": 10, "transition_begin": -1},
     ValueError, "transition_begin must be an int in [0, 2**31 - 1]"),
    ({"init_value": 1, "end_value": 4}, ValueError,
     "needs end_value and transition_steps for a linear ramp, or boundaries_and_values"),
    ({"init_value": 1}, ValueError, "transition_steps=None"),
    ({"init_value": 1, "end_value": 4, "transition_steps": 10,
      "boundaries_and_values": {5: 2}}, ValueError, "not both"),
    ({"init_value": 1, "boundaries_and_values": [(5, 2)]}, TypeError,
     "boundaries_and_values must be a mapping {step: k}"),
    ({"init_value": 1, "boundaries_and_values": {5: 0}}, ValueError,
     "the value at step 5 in boundaries_and_values must be an int in [1"),
    ({"init_value": 1, "boundaries_and_values": {-5: 2}}, ValueError,
     "a step in boundaries_and_values must be an int in [0"),
    ({"init_value": 1, "boundaries_and_values": {5: 2.0}}, TypeError,
     "must be a Python int (a number of micro-batches), got 2.0"),
    ({"init_value": 1, "end_value": 4, "transition_steps": 2**31 - 1,
      "transition_begin": 5}, ValueError, "must fit in int32"),
])
def test_bad_arguments_are_rejected_with_clear_errors(kwargs, error, match):
  with pytest.raises(error, match=re.escape(match)):
    jaxaccum.batch_size_ramp(**kwargs)


def test_a_non_scalar_step_is_rejected():
  ramp = jaxaccum.batch_size_ramp(1, 4, 10)
  with pytest.raises(TypeError, match=r"takes a scalar step, got an array of shape \(3,\)"):
    ramp(jnp.arange(3))


def test_ramp_as_active_micro_batches_runs_the_rows_of_the_first_k_in_one_program():
  n = 4
  ramp = jaxaccum.batch_size_ramp(init_value=1, end_value=n, transition_steps=3)
  kx, ky = jax.random.split(jax.random.key(0))
  batch = {"x": jax.random.normal(kx, (16, 3)), "y": jax.random.normal(ky, (16,))}
  w = jnp.array([0.5, -1.0, 2.0])

  def loss(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

  vg = jaxaccum.value_and_grad(loss, num_micro_batches=n)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(w, batch, step):
    return vg(w, batch, active_micro_batches=ramp(step))

  for s in range(5):
    k = reference_linear(1, n, 3, 0, s)
    # Micro-batch i holds rows i, i + n, ...: the first k hold these rows.
    rows = jax.tree.map(lambda x, k=k: jnp.concatenate([x[i::n] for i in range(k)]), batch)
    chex.assert_trees_all_close(step(w, batch, jnp.int32(s)),
                                jax.value_and_grad(loss)(w, rows), rtol=1e-5)


INT_DTYPES = (jnp.int8, jnp.int16, jnp.int32, jnp.uint8, jnp.uint16, jnp.uint32)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_integer_step_dtype_gives_the_formula(dtype):
  # The clip to int32's range must happen in a type that holds it: in int8 or uint16 the
  # bound 2**31 - 1 wraps, and in uint32 a step above it must not come back negative.
  ramp = jaxaccum.batch_size_ramp(1, 8, 100)
  info = np.iinfo(jnp.dtype(dtype))
  probe = sorted({s for s in (0, 1, 14, 15, 50, 99, 100, 101, 127, 255, 1000, 65535,
                              2**31 - 1, info.max, info.min) if info.min <= s <= info.max})
  expected = [reference_linear(1, 8, 100, 0, s) for s in probe]
  steps = jnp.asarray(probe, dtype)
  assert steps.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(jax.jit(jax.vmap(ramp))(steps), expected)
  assert [int(ramp(s)) for s in steps] == expected  # eager, one scalar at a time


# ------------------------------------------------------------ ramps by samples or tokens

MEGATRON = "0:768 250B:1536 500B:3072"  # Megatron-LM's --step-batch-size-schedule example


def test_megatron_schedule_by_tokens_in_micro_batches_of_384_rows():
  ramp = jaxaccum.batch_size_ramp_by_count(MEGATRON, micro_batch_size=384,
                                           num_micro_batches=8)
  b = 10**9
  counts = [0, 1, 250 * b - 1, 250 * b, 250 * b + 1, 500 * b - 1, 500 * b, 10**15, -5]
  expected = [2, 2, 2, 4, 4, 4, 8, 8, 2]  # 768 / 384, 1536 / 384, 3072 / 384
  assert [int(ramp(c)) for c in counts] == expected  # Python ints, exact in Python
  assert [int(ramp(np.int64(c))) for c in counts] == expected
  assert [int(ramp(np.asarray(c))) for c in counts] == expected
  # Without micro_batch_size the values are micro-batch counts.
  counts_ramp = jaxaccum.batch_size_ramp_by_count("0:1 1.5K:3 2M:5")
  assert [int(counts_ramp(c)) for c in (0, 1499, 1500, 1_999_999, 2_000_000)] == [1, 1, 3, 3, 5]
  # Fractional counts floor (Python, NumPy and JAX floats).
  assert [int(counts_ramp(c)) for c in (1499.9, np.float32(1499.5), jnp.float32(1499.5),
                                        jnp.float32(1500.0))] == [1, 1, 1, 3]
  mapping = jaxaccum.batch_size_ramp_by_count({2_000_000: 5, 0: 1, 1500: 3})
  assert [int(mapping(c)) for c in (0, 1499, 1500, 1_999_999, 2_000_000)] == [1, 1, 3, 3, 5]
  lower = jaxaccum.batch_size_ramp_by_count("0:2, 1k:4, 1t:8")  # commas, lower case
  assert [int(lower(c)) for c in (999, 1000, 10**12 - 1, 10**12)] == [2, 4, 4, 8]


# Thresholds on both sides of 2**31 and 2**32, where an int32 count or search would wrap.
WIDE = {0: 1, 2**31 - 1: 2, 2**31: 3, 2**32 + 5: 4, 250 * 10**9: 5, 2**61: 6}
WIDE_PROBE = [0, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 + 4, 2**32 + 5,
              250 * 10**9 - 1, 250 * 10**9, 2**61 - 1, 2**61, 2**62 + 7, 2**70]
WIDE_EXPECTED = [1, 1, 2, 3, 3, 3, 4, 4, 5, 5, 6, 6, 6]  # by hand from WIDE


def _wide_reference(count):
  """The value whose threshold is the largest one <= count, by a loop in Python ints."""
  value = 1
  for threshold, k in sorted(WIDE.items()):
    if count >= threshold:
      value = k
  return value


_wide = jaxaccum.batch_size_ramp_by_count(WIDE)


_STATE = jaxaccum.contrib.AdaptiveBatch(8).init()


@jax.jit
@chex.assert_max_traces(n=1)
def _wide_state(high, low):
  return _wide(_STATE._replace(samples_hi=high, samples_lo=low))


@jax.jit
@chex.assert_max_traces(n=1)
def _wide_float(count):
  return _wide(count)


def test_counts_above_int32_are_exact_as_python_numpy_floats_and_two_words():
  assert [_wide_reference(c) for c in WIDE_PROBE] == WIDE_EXPECTED
  assert [int(_wide(c)) for c in WIDE_PROBE] == WIDE_EXPECTED
  assert [int(_wide(np.uint64(min(c, 2**64 - 1)))) for c in WIDE_PROBE] == WIDE_EXPECTED
  # The controller's exact counter, samples_hi * 2**24 + samples_lo, traced: one program.
  words = [(c >> 24, c & (2**24 - 1)) for c in WIDE_PROBE if c < 2**55]
  got = [int(_wide_state(jnp.int32(h), jnp.int32(lo))) for h, lo in words]
  assert got == WIDE_EXPECTED[:len(words)] and len(words) == 9
  assert int(_wide_state(jnp.int32(2**31 - 1), jnp.int32(2**24 - 1))) == 5  # 2**55 - 1
  # A float count is compared by its exact value (float32 rounds 2**31 - 1 up to 2**31,
  # and 250e9 down to 249999998976: its spacing there is 2**14).
  for dtype in (np.float32, np.float64):
    floats = [dtype(c) for c in WIDE_PROBE]
    exact = [_wide_reference(int(f)) for f in floats]
    assert [int(_wide(f)) for f in floats] == exact  # NumPy floats, in Python
    assert [int(_wide_float(jnp.asarray(f, jnp.float32))) for f in floats] == [
        _wide_reference(int(np.float32(f))) for f in floats]
  assert [int(_wide_float(jnp.float32(c))) for c in (2**31 - 1, 250 * 10**9)] == [3, 4]
  # Just below a threshold in float32.
  below = np.nextafter(np.float32(2**32 + 5), np.float32(0))
  assert int(_wide_float(jnp.float32(below))) == _wide_reference(int(below)) == 3
  assert int(_wide_float(jnp.float32(2**31 - 128))) == 1  # the float32 just below 2**31
  assert int(_wide_float(jnp.float32(np.nan))) == 1 and int(_wide_float(jnp.float32(-3))) == 1
  assert int(_wide_float(jnp.float32(np.inf))) == 6
  # bfloat16 and float16 counts are widened exactly.
  assert int(_wide(jnp.asarray(2.0**31, jnp.bfloat16))) == 3
  assert int(_wide(jnp.asarray(65504, jnp.float16))) == 1


def test_integer_dtypes_and_int64_under_x64():
  probe32 = [0, 2**31 - 2, 2**31 - 1, 2**31, 2**32 - 1]
  expected32 = [_wide_reference(c) for c in probe32]
  assert expected32 == [1, 1, 2, 3, 3]
  np.testing.assert_array_equal(
      jax.jit(jax.vmap(_wide))(jnp.asarray(probe32, jnp.uint32)), expected32)
  np.testing.assert_array_equal(
      jax.jit(jax.vmap(_wide))(jnp.asarray([-7, 0, 2**31 - 2, 2**31 - 1], jnp.int32)),
      [1, 1, 1, 2])
  np.testing.assert_array_equal(jax.vmap(_wide)(jnp.asarray([-1, 127], jnp.int8)), [1, 1])
  with jax.enable_x64(True):
    probe = [c for c in WIDE_PROBE if c < 2**63] + [-3]
    got = jax.jit(jax.vmap(_wide))(jnp.asarray(probe, jnp.int64))
    np.testing.assert_array_equal(got, [_wide_reference(c) for c in probe])
    got = jax.jit(jax.vmap(_wide))(jnp.asarray(probe, jnp.float64))
    np.testing.assert_array_equal(got, [_wide_reference(int(np.float64(c))) for c in probe])


def test_count_ramp_drives_active_micro_batches_in_one_program():
  # Samples seen as the count: k follows the schedule as the counter passes thresholds.
  n, rows = 4, 2
  ramp = jaxaccum.batch_size_ramp_by_count("0:2 6:4 14:8", micro_batch_size=rows,
                                           num_micro_batches=n)
  kx, ky = jax.random.split(jax.random.key(1))
  batch = {"x": jax.random.normal(kx, (n * rows, 3)), "y": jax.random.normal(ky, (n * rows,))}
  w = jnp.array([0.5, -1.0, 2.0])

  def loss(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

  vg = jaxaccum.value_and_grad(loss, num_micro_batches=n)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(w, batch, seen):
    k = ramp(seen)
    return vg(w, batch, active_micro_batches=k), k

  seen, ks = 0, []
  for _ in range(5):
    out, k = step(w, batch, jnp.int32(seen))
    k = int(k)
    ks.append(k)
    part = jax.tree.map(lambda x, k=k: jnp.concatenate([x[i::n] for i in range(k)]), batch)
    chex.assert_trees_all_close(out, jax.value_and_grad(loss)(w, part), rtol=1e-5)
    seen += k * rows
  # seen: 0 -> k 1, 2 -> 1, 4 -> 1, 6 -> 2, 10 -> 2 (then 14 -> 4).
  assert ks == [1, 1, 1, 2, 2]


@pytest.mark.parametrize(("schedule", "kwargs", "error", "match"), [
    ("0:768 250B:1536", {"micro_batch_size": 500}, ValueError,
     "the batch size 768 at threshold 0 is not a multiple of micro_batch_size=500; use batch "
     "sizes that are whole numbers of micro-batches (e.g. 500 or 1000)"),
    ("0:768 250B:3072", {"micro_batch_size": 384, "num_micro_batches": 4}, ValueError,
     "the value at threshold 250000000000 is k=8 micro-batches, more than "
     "num_micro_batches=4"),
    ("10:2 20:4", {}, ValueError, "the first threshold must be 0 (the value at the start of "
     "training), got 10"),
    ("0:2 5:4 5:8", {}, ValueError, "a threshold appears twice"),
    ("0:2 5X:4", {}, ValueError, "cannot read the threshold '5X'"),
    ("0:2 1.2345K:4", {}, ValueError, "the threshold '1.2345K' in schedule '0:2 1.2345K:4' is "
     "1234.5, not a whole number of samples or tokens"),
    ("0:2 100", {}, ValueError, "cannot read '100' in schedule '0:2 100': each entry is "
     "THRESHOLD:VALUE"),
    ("0:two", {}, ValueError, "cannot read '0:two'"),
    ("0:0", {}, ValueError, "the value at threshold 0 must be a positive int (a number of "
     "micro-batches), got 0"),
    ("", {}, ValueError, "the schedule string is empty"),
    ({0: 1, 2**62: 2}, {}, ValueError, "thresholds must be ints in [0, 2**62 - 1]"),
    ({0: 1, 5.0: 2}, {}, ValueError, "thresholds must be ints"),
    ({0: 2.0}, {}, ValueError, "must be a positive int"),
    ([(0, 1)], {}, TypeError, "schedule must be a string of THRESHOLD:VALUE pairs"),
    ("0:4", {"micro_batch_size": 0}, ValueError, "micro_batch_size must be a positive int or "
     "None, got micro_batch_size=0"),
])
def test_count_ramp_bad_schedules_are_rejected(schedule, kwargs, error, match):
  with pytest.raises(error, match=re.escape(match)):
    jaxaccum.batch_size_ramp_by_count(schedule, **kwargs)


def test_count_ramp_bad_counts_are_rejected():
  ramp = jaxaccum.batch_size_ramp_by_count("0:1 10:2")
  with pytest.raises(TypeError, match=r"takes a scalar count, got an array of shape \(2,\)"):
    ramp(jnp.arange(2))
  with pytest.raises(TypeError, match="takes an integer or float count, got dtype bool"):
    ramp(jnp.asarray(True))
  for bad, text in ((float("nan"), "nan"), (float("inf"), "inf"),
                    (np.float32(-np.inf), "-inf")):
    with pytest.raises(ValueError, match=rf"got count={text}: it takes the samples or tokens "
                       r"seen, a finite number; pass the count as an int"):
      ramp(bad)


# A threshold whose high word is the largest (2**62 - 1 = (2**31 - 1) * 2**31 + 2**31 - 1):
# a count of 2**62 or more must reach it, whatever its low bits.
TOP = {0: 1, 2**62 - 2**31: 2, 2**62 - 1: 3}


def _top_reference(count):
  return max(k for t, k in TOP.items() if count >= t) if count >= 0 else 1


def test_count_ramps_are_monotone_at_every_count_up_to_the_dtypes_limit():
  ramp = jaxaccum.batch_size_ramp_by_count(TOP)
  rng = np.random.default_rng(0)
  edges = [2**62 - 2**31 - 1, 2**62 - 2**31, 2**62 - 2, 2**62 - 1, 2**62, 2**62 + 5,
           2**62 + 2**31 - 1, 2**63 - 1]
  # Generated counts on both sides of 2**62 (random low bits: the words wrap there).
  generated = [int(c) for c in rng.integers(2**62 - 2**33, 2**63 - 1, size=200,
                                            dtype=np.int64)]
  counts = sorted(edges + generated)
  expected = [_top_reference(c) for c in counts]
  assert [int(ramp(c)) for c in counts] == expected  # Python ints
  with jax.enable_x64(True):
    run = jax.jit(jax.vmap(ramp))
    got = run(jnp.asarray(counts, jnp.int64))
    np.testing.assert_array_equal(got, expected)
    assert np.all(np.diff(np.asarray(got)) >= 0)
    high = sorted(counts + [int(c) for c in rng.integers(2**63, 2**64 - 1, size=100,
                                                           dtype=np.uint64)] + [2**64 - 1])
    got = run(jnp.asarray(high, jnp.uint64))
    np.testing.assert_array_equal(got, [_top_reference(c) for c in high])
    assert np.all(np.diff(np.asarray(got)) >= 0)


def test_count_ramp_reads_the_controllers_sample_counter():
  # Steps of 2**30 samples push the controller's counter past 2**31 and 2**32: the ramp
  # read from the state equals the ramp of its exact count, and the hand-computed value.
  ab = jaxaccum.contrib.AdaptiveBatch(8)
  ramp = jaxaccum.batch_size_ramp_by_count({0: 1, 2**31: 2, 3 * 2**30 + 1: 3, 2**32: 4})
  info = jaxaccum.AccumInfo(
      num_micro_batches=jnp.int32(2), micro_batch_size=jnp.float32(2.0**29),
      batch_size=jnp.float32(2.0**30), micro_grad_sq_norm=jnp.float32(2.0),
      batch_grad_sq_norm=jnp.float32(1.0), num_samples=jnp.int32(2), skipped=jnp.int32(0))
  step = jax.jit(lambda state: (ab.update(state, info), ramp(state)))
  state, got = ab.init(), []
  for _ in range(6):
    state, k = step(state)
    got.append(int(k))
  # Counts read before each update: 0, 2**30, 2**31, 3 * 2**30, 2**32, 5 * 2**30.
  assert got == [1, 1, 2, 2, 4, 4]
  assert ab.sample_count(state) == 6 * 2**30
  assert int(ramp(state)) == int(ramp(ab.sample_count(state))) == 4
