"""jaxaccum._core._validate: the scalar validators, over generated values of every kind.

Each check's reference is how the value was generated (an int, a bool, a float, ...) and
plain Python comparisons on it; the wording of each message is matched by the tests of the
modules that use the check (test_adaptive.py, test_ramp.py, test_seesaw.py, ...).
"""

import ast
import decimal
import fractions
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxaccum._core import _validate

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)
INT32_MAX = 2**31 - 1

_NP_INTS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
_NP_FLOATS = (np.float16, np.float32, np.float64)


def _np_int(draw_value: int, dtype) -> np.integer:
  info = np.iinfo(dtype)
  return dtype(min(max(draw_value, int(info.min)), int(info.max)))


# (kind, value): the kind is what the value was made as, the reference for the predicates.
KINDS = st.one_of(
    st.tuples(st.just("int"), st.integers(-2**70, 2**70)),
    st.tuples(st.just("int"), st.builds(_np_int, st.integers(-2**63, 2**64),
                                        st.sampled_from(_NP_INTS))),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("bool"), st.builds(np.bool_, st.booleans())),
    st.tuples(st.just("real"), st.floats(allow_nan=True, allow_infinity=True)),
    st.tuples(st.just("real"), st.builds(lambda x, t: t(x), st.floats(-1e4, 1e4),
                                         st.sampled_from(_NP_FLOATS))),
    st.tuples(st.just("real"), st.builds(fractions.Fraction, st.integers(), st.integers(1))),
    st.tuples(st.just("other"), st.sampled_from(
        [None, "3", "norm_test", 1j, decimal.Decimal(2), [1], (1,), {"a": 1}, object()])),
    st.tuples(st.just("other"), st.builds(np.asarray, st.integers(-5, 5))),  # 0-d array
    st.tuples(st.just("other"), st.builds(lambda n: np.zeros((n, 2)), st.integers(0, 3))),
)


@SETTINGS
@given(KINDS)
def test_the_predicates_follow_the_kind_of_value(case):
  kind, value = case
  assert _validate.is_int(value) == (kind == "int")
  assert _validate.is_real(value) == (kind in ("int", "real"))
  assert _validate.is_bool(value) == (kind == "bool")


@SETTINGS
@given(KINDS)
def test_describe_names_the_type_and_a_short_repr(case):
  value = case[1]
  text = repr(value)
  want = (f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
          if hasattr(value, "shape") and hasattr(value, "dtype") else
          f"{type(value).__name__} {text}" if len(text) < 80 else type(value).__name__)
  assert _validate.describe(value) == want
  assert _validate.describe(jnp.zeros((2, 3), jnp.int8)) == (
      "an array of shape (2, 3) and dtype int8")
  assert _validate.describe("x" * 100) == "str"


@SETTINGS
@given(KINDS)
def test_check_bool_takes_python_and_numpy_bools_only(case):
  kind, value = case
  if kind == "bool":
    out = _validate.check_bool("flag", value)
    assert type(out) is bool and out == bool(value)
  else:
    with pytest.raises(TypeError, match=r"^flag must be a bool, got flag="):
      _validate.check_bool("flag", value)


@SETTINGS
@given(st.integers(-5, 5), st.one_of(st.none(), st.integers(-5, 40)), KINDS)
def test_check_int_takes_ints_in_range(low, high, case):
  kind, value = case
  kwargs = dict(low=low, high=high, what="a count", example="4")
  if kind != "int":
    with pytest.raises(TypeError, match=r"^f: n must be a Python int \(a count\), got .*\. "
                       r"For example n=4\.$"):
      _validate.check_int("f", "n", value, **kwargs)
  elif low <= int(value) and (high is None or int(value) <= high):
    out = _validate.check_int("f", "n", value, **kwargs)
    assert type(out) is int and out == int(value)
  else:
    with pytest.raises(ValueError) as err:
      _validate.check_int("f", "n", value, **kwargs)
    assert str(err.value) == (f"f: n must be an int >= {low} (a count), got n={value}. For "
                              "example n=4.")


@SETTINGS
@given(st.integers(-3, 3), KINDS)
def test_check_int32_takes_ints_up_to_int32(low, case):
  kind, value = case
  if kind != "int":
    with pytest.raises(TypeError, match=r"(?s)^g: n must be a Python int \(a step\), got .* of "
                       rf"type {type(value).__name__}\.$"):
      _validate.check_int32("g", "n", value, low=low, what="a step")
  elif low <= int(value) <= INT32_MAX:
    out = _validate.check_int32("g", "n", value, low=low, what="a step")
    assert type(out) is int and out == int(value)
  else:
    with pytest.raises(ValueError) as err:
      _validate.check_int32("g", "n", value, low=low, what="a step")
    assert str(err.value) == f"g: n must be an int in [{low}, 2**31 - 1] (a step), got n={value}."


@pytest.mark.parametrize("value", [INT32_MAX, INT32_MAX + 1, np.uint32(2**31), 0])
def test_check_int32_at_its_bounds(value):
  if 0 <= int(value) <= INT32_MAX:
    assert _validate.check_int32("g", "n", value, low=0, what="a step") == int(value)
  else:
    with pytest.raises(ValueError, match=r"in \[0, 2\*\*31 - 1\]"):
      _validate.check_int32("g", "n", value, low=0, what="a step")


@SETTINGS
@given(st.sampled_from([0.0, 1.0, -2.5]), st.booleans(), KINDS)
def test_check_float_takes_finite_reals_past_the_bound(low, strict, case):
  kind, value = case
  kwargs = dict(low=low, strict=strict, what="a margin", example="0.5")
  if kind not in ("int", "real"):
    with pytest.raises(TypeError, match=r"^f: x must be a float \(a margin\), got .*\. For "
                       r"example x=0\.5\.$"):
      _validate.check_float("f", "x", value, **kwargs)
    return
  number = float(value)
  if math.isfinite(number) and (number > low or (not strict and number == low)):
    out = _validate.check_float("f", "x", value, **kwargs)
    assert type(out) is float and out == number
  else:
    with pytest.raises(ValueError) as err:
      _validate.check_float("f", "x", value, **kwargs)
    bound = f"> {low}" if strict else f">= {low}"
    assert str(err.value) == (f"f: x must be a finite float {bound} (a margin), got "
                              f"x={value}. For example x=0.5.")


@SETTINGS
@given(st.one_of(st.sampled_from(["none", "sqrt", "linear", "adam", ""]), KINDS.map(
    lambda c: c[1]).filter(lambda v: not isinstance(v, np.ndarray))))
def test_check_choice_takes_one_of_the_choices(value):
  choices = ("none", "sqrt", "linear")
  if isinstance(value, str) and value in choices:
    assert _validate.check_choice("f", "mode", value, choices) == value
  else:
    with pytest.raises(ValueError) as err:
      _validate.check_choice("f", "mode", value, choices)
    assert str(err.value) == (f"f: mode must be one of 'none', 'sqrt', 'linear', got "
                              f"mode={value!r}.")


@SETTINGS
@given(st.one_of(st.none(), st.integers(1, 10)), KINDS)
def test_check_host_count_takes_positive_ints(high, case):
  kind, value = case
  if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iu":
    kind = "int"  # a concrete 0-d integer array is read as its int
  if kind != "int":
    with pytest.raises(TypeError, match=r"^k must be a positive int, got .*\. Hint\.$"):
      _validate.check_host_count("k", value, high=high, hint=" Hint.")
  elif 1 <= int(value) and (high is None or int(value) <= high):
    out = _validate.check_host_count("k", value, high=high, hint=" Hint.")
    assert type(out) is int and out == int(value)
  else:
    with pytest.raises(ValueError, match=rf"^k must be at least 1.*, got k={value}\. Hint\.$"):
      _validate.check_host_count("k", value, high=high, hint=" Hint.")


def test_check_host_count_reads_concrete_jax_scalars_and_refuses_traced_ones():
  assert _validate.check_host_count("k", jnp.int32(3)) == 3
  assert _validate.check_host_count("k", np.asarray(5, np.int64), high=5) == 5
  with pytest.raises(ValueError, match="at most num_micro_batches=2, got k=3"):
    _validate.check_host_count("k", jnp.int32(3), high=2)
  with pytest.raises(TypeError, match="got an array of shape \\(\\) and dtype float32"):
    _validate.check_host_count("k", jnp.float32(3))

  @jax.jit
  def traced(k):
    return _validate.check_host_count("k", k)

  with pytest.raises(TypeError, match="k must be a concrete int on the host, got a traced"):
    traced(jnp.int32(3))


def test_validate_imports_nothing_from_jaxaccum():
  tree = ast.parse(pathlib.Path(_validate.__file__).read_text())
  names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
  assert names and not [n for n in names if n.split(".")[0] == "jaxaccum"], names
