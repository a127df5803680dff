"""The exact two-word sample counter (jaxaccum._batch_size._counter) against Python ints.

Its users' tests (test_adaptive.py, test_ramp.py, test_seesaw.py) check it through
AdaptiveBatch, batch_size_ramp_by_count and Seesaw; here each function is checked over
generated counts and addends against the same arithmetic on Python ints.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxaccum
from jaxaccum._batch_size import _counter

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
TOP = 2**55 - 1  # the counter's largest count
LO = 2**24

COUNTS = st.one_of(st.integers(0, 2**26), st.integers(0, TOP),
                   st.integers(TOP - 2**32, TOP))
# A step's samples: a float32 integer (every float32 of 2**24 and more is one).
ADDENDS = st.one_of(st.integers(0, 2**24), st.integers(0, 2**54)).map(
    lambda n: int(np.float32(n)))


def _state(count: int) -> jaxaccum.contrib.SeesawState:
  return jaxaccum.contrib.SeesawState(samples_hi=jnp.int32(count // LO),
                                      samples_lo=jnp.int32(count % LO),
                                      max_level=jnp.int32(0), noise=jaxaccum.NoiseScale().init())


ADD = jax.jit(_counter.add_samples)


@SETTINGS
@given(COUNTS, st.lists(ADDENDS, min_size=1, max_size=6))
def test_adding_samples_is_exact_and_saturates_at_the_top(start, addends):
  hi, lo = jnp.int32(start // LO), jnp.int32(start % LO)
  total = start
  for x in addends:
    hi, lo = ADD(hi, lo, jnp.float32(x))
    total = min(total + x, TOP)
    assert 0 <= int(lo) < LO
    assert int(hi) * LO + int(lo) == total, (start, addends)


@SETTINGS
@given(COUNTS)
def test_reading_a_state(count):
  state = _state(count)
  assert _counter.sample_count(state) == count
  assert abs(float(_counter.samples(state)) - count) <= 6e-8 * count
  high, low = jax.jit(_counter.words31)(state)
  assert 0 <= int(low) < 2**31 and int(high) * 2**31 + int(low) == count


def test_states_that_hold_a_counter():
  ab = jaxaccum.contrib.AdaptiveBatch(4)
  rule = jaxaccum.contrib.seesaw(lambda n: 1.0, init_micro_batches=1, max_micro_batches=2, total=10)
  assert _counter.has_counter(ab.init()) and _counter.has_counter(rule.init())
  ms = jaxaccum.MultiSteps(optax.sgd(1.0), 2).init({"w": jnp.zeros(2)})
  for other in (ms, ab.init().noise, jnp.int32(3), 3, (1, 2), None):
    assert not _counter.has_counter(other)


@SETTINGS
@given(COUNTS)
def test_the_count_ramp_reads_every_state_with_a_counter_as_its_count(count):
  ramp = jaxaccum.batch_size_ramp_by_count({0: 1, 2**24: 2, 2**40: 3, 2**55 - 1: 4})
  ab = jaxaccum.contrib.AdaptiveBatch(4).init()
  ab = ab._replace(samples_hi=jnp.int32(count // LO), samples_lo=jnp.int32(count % LO))
  expected = int(ramp(count))
  assert int(ramp(ab)) == int(ramp(_state(count))) == expected
