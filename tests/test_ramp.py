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
