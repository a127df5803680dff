"""``jaxaccum.batch_size_ramp`` and ``batch_size_ramp_by_count``: schedules of micro-batch
counts, like optax schedules.

A ramp grows (or shrinks) the effective batch by changing how many micro-batches run per
optimizer step, ``k = ramp(step)``, through ``active_micro_batches=k`` or
``MultiSteps(every_k_schedule=ramp)`` (see :func:`batch_size_ramp`), or ``k =
ramp(samples_or_tokens_seen)`` (see :func:`batch_size_ramp_by_count`).

Every ramp is a table of thresholds at which ``k`` changes, built in Python when the ramp
is made. A step ramp is one :func:`jax.numpy.searchsorted`, exact in int32; a count ramp
compares two int32 words (``count = high * 2**31 + low``), exact up to ``2**62`` whatever
the count's dtype. Both are jittable with a traced argument.
"""

from __future__ import annotations

import bisect
import decimal
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._batch_size import _counter
from jaxaccum._core import _validate

_INT32_MAX = _validate.INT32_MAX


_check_int = functools.partial(_validate.check_int32, "batch_size_ramp")


def batch_size_ramp(
    init_value: int,
    end_value: int | None = None,
    transition_steps: int | None = None,
    transition_begin: int = 0,
    *,
    boundaries_and_values: Mapping[int, int] | None = None,
) -> Callable[[jax.typing.ArrayLike], jax.Array]:
  """A schedule ``step -> k``: how many micro-batches to run, rising linearly or in steps.

  Two forms, like :func:`optax.linear_schedule` and
  :func:`optax.piecewise_constant_schedule`:

  * linear: ``batch_size_ramp(init_value, end_value, transition_steps, transition_begin=0)``.
    ``k`` is ``init_value`` until ``transition_begin``, then moves to ``end_value`` in equal
    integer steps, ``k = init_value + floor((end_value - init_value) * t /
    transition_steps)`` (rounded towards ``init_value`` when decreasing) with ``t = step -
    transition_begin``, reaching ``end_value`` at step ``transition_begin +
    transition_steps`` and staying there.
  * stepwise: ``batch_size_ramp(init_value, boundaries_and_values={step: k, ...})``. ``k``
    is ``init_value`` before the first boundary and takes each boundary's value from that
    step on.

  The schedule returns an int32 scalar and works on a Python int or a traced integer step
  (under :func:`jax.jit`, :func:`jax.lax.scan`), with no recompilation as the step moves.
  Use it as ``active_micro_batches=ramp(step)`` in a step built by
  :func:`jaxaccum.value_and_grad` (``k`` must not exceed the ``num_micro_batches`` the
  batch is split into), or as ``jaxaccum.MultiSteps(opt, every_k_schedule=ramp)``, where
  the step is the optimizer step count.

  Args:
    init_value: ``k`` at step 0, a positive int.
    end_value: ``k`` at the end of a linear ramp, a positive int.
    transition_steps: the length of a linear ramp in steps, a positive int.
    transition_begin: the step at which a linear ramp starts, a non-negative int.
    boundaries_and_values: for a stepwise ramp, a mapping from steps (non-negative ints)
      to the ``k`` (positive ints) that holds from that step on.

  Returns:
    A function of the step returning ``k`` as an int32 scalar array.

  Raises:
    TypeError, ValueError: a value is not an int in range, or the arguments mix the two
      forms or give neither.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> ramp = jaxaccum.batch_size_ramp(init_value=1, end_value=8, transition_steps=100)
  >>> [int(ramp(s)) for s in (0, 14, 15, 50, 100, 1000)]
  [1, 1, 2, 4, 8, 8]
  >>> steps = jaxaccum.batch_size_ramp(init_value=2, boundaries_and_values={10: 4, 30: 8})
  >>> jax.jit(jax.vmap(steps))(jnp.array([0, 9, 10, 29, 30]))
  Array([2, 2, 4, 4, 8], dtype=int32)
  """
  init_value = _check_int("init_value", init_value, low=1,
                          what="the number of micro-batches at step 0")
  if boundaries_and_values is not None:
    if end_value is not None or transition_steps is not None or transition_begin != 0:
      raise ValueError(
          "batch_size_ramp takes either end_value and transition_steps (a linear ramp, "
          "optionally with transition_begin) or boundaries_and_values (a stepwise ramp), "
          f"not both; got end_value={end_value!r}, transition_steps={transition_steps!r}, "
          f"transition_begin={transition_begin!r} and boundaries_and_values="
          f"{boundaries_and_values!r}.")
    if not isinstance(boundaries_and_values, Mapping):
      raise TypeError(
          "batch_size_ramp: boundaries_and_values must be a mapping {step: k} (e.g. "
          f"{{1000: 2, 5000: 4}}), got {boundaries_and_values!r} of type "
          f"{type(boundaries_and_values).__name__}.")
    items = []
    for step, k in boundaries_and_values.items():
      step = _check_int("a step in boundaries_and_values", step, low=0,
                        what="the step from which its value holds")
      k = _check_int(f"the value at step {step} in boundaries_and_values", k, low=1,
                     what="a number of micro-batches")
      items.append((step, k))
    items.sort()
    boundaries = [s for s, _ in items]
    values = [init_value] + [k for _, k in items]
  else:
    if end_value is None or transition_steps is None:
      raise ValueError(
          "batch_size_ramp needs end_value and transition_steps for a linear ramp, or "
          f"boundaries_and_values for a stepwise one; got end_value={end_value!r}, "
          f"transition_steps={transition_steps!r}. For a constant k, pass an int to "
          "MultiSteps(every_k_schedule=k) or active_micro_batches=k.")
    end_value = _check_int("end_value", end_value, low=1,
                           what="the number of micro-batches at the end of the ramp")
    transition_steps = _check_int("transition_steps", transition_steps, low=1,
                                  what="the length of the ramp in steps")
    transition_begin = _check_int("transition_begin", transition_begin, low=0,
                                  what="the step at which the ramp starts")
    if transition_begin + transition_steps > _INT32_MAX:
      raise ValueError(
          "batch_size_ramp: transition_begin + transition_steps must fit in int32, got "
          f"transition_begin={transition_begin}, transition_steps={transition_steps}.")
    delta = end_value - init_value
    sign = 1 if delta >= 0 else -1
    # k reaches init_value + sign * j once |delta| * t >= j * transition_steps.
    boundaries = [transition_begin + -(-j * transition_steps // abs(delta))
                  for j in range(1, abs(delta) + 1)]
    values = [init_value + sign * j for j in range(abs(delta) + 1)]

  boundaries_np = np.asarray(boundaries, np.int32)
  values_np = np.asarray(values, np.int32)

  def schedule(step: jax.typing.ArrayLike) -> jax.Array:
    if _validate.is_int(step):
      step = min(max(int(step), -1), _INT32_MAX)
    step = jnp.asarray(step)
    if step.shape != ():
      raise TypeError(
          f"a batch_size_ramp schedule takes a scalar step, got an array of shape "
          f"{tuple(step.shape)}; use jax.vmap for several steps.")
    if jnp.issubdtype(step.dtype, jnp.floating):
      step = jnp.floor(step)
      low, high = -1, _INT32_MAX
    elif jnp.issubdtype(step.dtype, jnp.integer):
      # Bounds the step's own dtype holds: in int8, 2**31 - 1 would wrap to -1.
      info = jnp.iinfo(step.dtype)
      low, high = max(-1, int(info.min)), min(_INT32_MAX, int(info.max))
    else:
      raise TypeError(
          f"a batch_size_ramp schedule takes an integer step, got dtype {step.dtype}.")
    # Clip before the cast so that a huge or negative step cannot wrap.
    step = jnp.clip(step, low, high).astype(jnp.int32)
    index = jnp.searchsorted(jnp.asarray(boundaries_np), step, side="right")
    return jnp.asarray(values_np)[index]

  schedule.__doc__ = (
      f"batch_size_ramp schedule: step -> micro-batches (int32), from {values[0]} to "
      f"{values[-1]}.")
  return schedule


# ----------------------------------------------------------------- ramps by samples or tokens

_WORD = 2**31  # a count is two int32 words, high * 2**31 + low with 0 <= low < 2**31
COUNT_MAX = _WORD * _WORD - 1  # 2**62 - 1: the largest threshold the two words hold
_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_THRESHOLD = re.compile(r"^([0-9]+(?:\.[0-9]*)?)([KMBT]?)$", re.IGNORECASE)


def _parse_threshold(text: str, schedule: str) -> int:
  match = _THRESHOLD.match(text)
  if match is None:
    raise ValueError(
        f"batch_size_ramp_by_count: cannot read the threshold {text!r} in schedule "
        f"{schedule!r}: a threshold is a non-negative number with an optional suffix K "
        "(1e3), M (1e6), B (1e9) or T (1e12), e.g. '0:768 250B:1536 500B:3072'.")
  value = decimal.Decimal(match.group(1)) * _SUFFIXES[match.group(2).upper()]
  if value != value.to_integral_value():
    raise ValueError(
        f"batch_size_ramp_by_count: the threshold {text!r} in schedule {schedule!r} is "
        f"{format(value.normalize(), 'f')}, not a whole number of samples or tokens.")
  return int(value)


def _parse_schedule(schedule: str) -> list[tuple[int, int]]:
  pairs = []
  for item in schedule.replace(",", " ").split():
    threshold, sep, value = item.partition(":")
    if not sep or not value.strip().isdigit():
      raise ValueError(
          f"batch_size_ramp_by_count: cannot read {item!r} in schedule {schedule!r}: each "
          "entry is THRESHOLD:VALUE with an integer VALUE, separated by spaces, e.g. "
          "'0:768 250B:1536 500B:3072'.")
    pairs.append((_parse_threshold(threshold.strip(), schedule), int(value)))
  if not pairs:
    raise ValueError(
        "batch_size_ramp_by_count: the schedule string is empty; write THRESHOLD:VALUE "
        "pairs, e.g. '0:768 250B:1536 500B:3072'.")
  return pairs


def _count_words(count: Any) -> tuple[jax.Array, jax.Array]:
  """A traced count as ``(high, low)`` int32 words (``high * 2**31 + low``), floored and
  clipped to [-1, 2**62 - 1]; -1 is ``(-1, 0)``."""
  if _counter.has_counter(count):  # a controller's exact counter, in our two words
    return _counter.words31(count)
  count = jnp.asarray(count)
  if count.shape != ():
    raise TypeError(
        "a batch_size_ramp_by_count schedule takes a scalar count, got an array of shape "
        f"{tuple(count.shape)}; use jax.vmap for several counts.")
  dtype = count.dtype
  if jnp.issubdtype(dtype, jnp.floating):
    # Exact in the float's own dtype: dividing by a power of two, flooring, and the
    # remainder (a multiple of the count's ulp below 2**31) are all representable.
    if jnp.finfo(dtype).bits < 32:
      count, dtype = count.astype(jnp.float32), jnp.dtype(jnp.float32)  # exact
    # The largest float below 2**62, so that the high word fits in int32.
    cap = np.nextafter(np.asarray(2.0**62, dtype), np.asarray(0, dtype))
    count = jnp.floor(jnp.where(jnp.isnan(count), -1, count))
    count = jnp.clip(count, -1, cap)
    word = np.asarray(_WORD, dtype)  # 2**31, exact in every float dtype
    high = jnp.floor(count / word)
    low = count - high * word
    negative = count < 0
    return (jnp.where(negative, -1, high.astype(jnp.int32)),
            jnp.where(negative, 0, low.astype(jnp.int32)))
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"a batch_size_ramp_by_count schedule takes an integer or float count, got dtype "
        f"{dtype}.")
  info = jnp.iinfo(dtype)
  negative = count < 0 if info.min < 0 else jnp.zeros((), bool)
  if info.bits <= 16 or (info.bits == 32 and info.min < 0):
    high = jnp.zeros((), jnp.int32)
    low = count.astype(jnp.int32)
  else:  # uint32, int64, uint64: shifts in the count's own dtype
    shifted = count >> 31
    top = shifted > _WORD - 1  # at or beyond 2**62: both words saturate, at 2**62 - 1
    high = jnp.where(top, _WORD - 1, shifted).astype(jnp.int32)
    low = jnp.where(top, _WORD - 1, count & (_WORD - 1)).astype(jnp.int32)
  return jnp.where(negative, -1, high), jnp.where(negative, 0, low)


def _read_schedule(schedule: Any) -> tuple[str, list[tuple[Any, Any]]]:
  """``(text for messages, [(threshold, value), ...])`` of a schedule string or mapping."""
  if isinstance(schedule, str):
    return schedule, _parse_schedule(schedule)
  if isinstance(schedule, Mapping):
    return repr(dict(schedule)), list(schedule.items())
  raise TypeError(
      "batch_size_ramp_by_count: schedule must be a string of THRESHOLD:VALUE pairs "
      "(e.g. '0:768 250B:1536') or a mapping {threshold: value}, got "
      f"{schedule!r} of type {type(schedule).__name__}.")


def _micro_batches_at(threshold: Any, value: Any, text: str, micro_batch_size: int | None,
                      num_micro_batches: int | None) -> int:
  """The ``k`` of one checked ``threshold: value`` entry (``value // micro_batch_size``
  when the values are batch sizes in rows)."""
  if not _validate.is_int(threshold) or not 0 <= int(threshold) <= COUNT_MAX:
    raise ValueError(
        f"batch_size_ramp_by_count: thresholds must be ints in [0, 2**62 - 1] (samples "
        f"or tokens seen), got {threshold!r} in schedule {text}.")
  if not _validate.is_int(value) or not 1 <= int(value) <= _INT32_MAX:
    raise ValueError(
        f"batch_size_ramp_by_count: the value at threshold {threshold} must be a positive "
        f"int (a {'batch size in rows' if micro_batch_size else 'number of micro-batches'}"
        f"), got {value!r} in schedule {text}.")
  k = value = int(value)
  if micro_batch_size is not None:
    micro_batch_size = int(micro_batch_size)
    if value % micro_batch_size:
      below = max(value // micro_batch_size, 1) * micro_batch_size
      above = (value // micro_batch_size + 1) * micro_batch_size
      raise ValueError(
          f"batch_size_ramp_by_count: the batch size {value} at threshold {threshold} is "
          f"not a multiple of micro_batch_size={micro_batch_size}; use batch sizes that "
          f"are whole numbers of micro-batches (e.g. {below} or {above}).")
    k = value // micro_batch_size
  if num_micro_batches is not None and k > int(num_micro_batches):
    raise ValueError(
        f"batch_size_ramp_by_count: the value at threshold {threshold} is k={k} "
        f"micro-batches, more than num_micro_batches={num_micro_batches}; split the "
        f"batch into at least {k} micro-batches or lower the schedule.")
  return k


def _table(pairs: list[tuple[Any, Any]], text: str, micro_batch_size: int | None,
           num_micro_batches: int | None) -> tuple[list[int], list[int]]:
  """The schedule's sorted ``(thresholds, ks)``, each entry checked; the first threshold
  must be 0 and none may repeat."""
  checked = []
  for threshold, value in pairs:
    k = _micro_batches_at(threshold, value, text, micro_batch_size, num_micro_batches)
    checked.append((int(threshold), k))
  checked.sort()
  thresholds = [t for t, _ in checked]
  if len(set(thresholds)) != len(thresholds):
    raise ValueError(
        f"batch_size_ramp_by_count: a threshold appears twice in schedule {text}.")
  if thresholds[0] != 0:
    raise ValueError(
        f"batch_size_ramp_by_count: the first threshold must be 0 (the value at the start "
        f"of training), got {thresholds[0]} in schedule {text}; add '0:VALUE'.")
  return thresholds, [k for _, k in checked]


def _python_count(count: float | np.floating) -> int:
  """A Python or NumPy float count as the int it is compared as: floored, negative counts
  -1, at most ``2**62 - 1``; NaN and infinities refused."""
  if not math.isfinite(count):
    raise ValueError(
        f"a batch_size_ramp_by_count schedule got count={count}: it takes the samples "
        "or tokens seen, a finite number; pass the count as an int (e.g. "
        "AdaptiveBatch.sample_count(state), or the controller's state itself), or "
        "check the float that produced it.")
  return -1 if count < 0 else min(math.floor(count), COUNT_MAX)


def batch_size_ramp_by_count(
    schedule: str | Mapping[int, int],
    *,
    micro_batch_size: int | None = None,
    num_micro_batches: int | None = None,
) -> Callable[[Any], jax.Array]:
  """A schedule ``samples or tokens seen -> k``, stepwise, in Megatron-LM's format.

  ``schedule`` maps thresholds to values: each value holds once the count reaches its
  threshold, until the next one. The first threshold must be 0. The thresholds are in
  whatever unit the count you pass is: samples (rows) seen, or tokens seen (e.g. the
  controller's sample counter under ``reduce="weighted"``, or ``samples * seq_len`` for
  fixed-length sequences, which is how Megatron-LM reads its token thresholds).

  Two forms:

  * a string of ``THRESHOLD:VALUE`` pairs separated by spaces, as Megatron-LM's
    ``--step-batch-size-schedule "0:768 250B:1536 500B:3072"``: thresholds take the
    suffixes K (1e3), M (1e6), B (1e9) and T (1e12), decimals allowed where the result is
    whole (``1.5M``);
  * a mapping ``{threshold: value}`` of Python ints.

  The values are micro-batch counts ``k``, or, with ``micro_batch_size``, batch sizes in
  rows (Megatron's global batch size), each of which must be a multiple of
  ``micro_batch_size``: ``k = value // micro_batch_size``. With ``num_micro_batches``,
  each ``k`` is checked against the ``N`` the batch is split into.

  The returned function takes the count as a Python or NumPy int of any size, a float
  (floored: the float32 counters of optax schedules), a JAX integer or float scalar
  (traced or not; int64 under ``jax_enable_x64``), or the
  :class:`jaxaccum.contrib.AdaptiveBatchState` of a controller, whose exact two-word sample counter
  it reads (rows seen, or tokens under ``reduce="weighted"``). The comparison is exact for
  every count below ``2**62`` in each of these forms (a float is compared by its exact
  value), never wraps, and compiles once however the count moves; counts of ``2**62``
  and more give the last value, so ``k`` never goes backwards as the count grows.
  Negative counts give the first value. A Python or NumPy float that is NaN or infinite
  is refused (``ValueError``); a JAX float cannot be checked under :func:`jax.jit`: NaN
  there gives the first value and ``+inf`` the last.

  Args:
    schedule: ``"THRESHOLD:VALUE ..."`` or ``{threshold: value}``; thresholds are distinct
      non-negative ints below ``2**62``, the first one 0; values positive ints.
    micro_batch_size: rows per micro-batch, to read the values as batch sizes in rows;
      ``None`` (the default) reads them as micro-batch counts.
    num_micro_batches: the ``N`` the batch is split into, to check that no ``k`` exceeds
      it (optional).

  Returns:
    A function of the count returning ``k`` as an int32 scalar array.

  Raises:
    TypeError, ValueError: a schedule that cannot be read, a threshold or value out of
      range, a value that ``micro_batch_size`` does not divide, or a ``k`` above
      ``num_micro_batches``; the returned function raises ``ValueError`` on a NaN or
      infinite Python or NumPy float count.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> ramp = jaxaccum.batch_size_ramp_by_count("0:768 250B:1536 500B:3072",
  ...                                          micro_batch_size=384)
  >>> [int(ramp(t)) for t in (0, 249_999_999_999, 250 * 10**9, 10**12)]
  [2, 2, 4, 8]
  >>> tokens = jnp.array([0.0, 2.6e11, 6e11])  # float32: compared by its exact value
  >>> jax.jit(jax.vmap(ramp))(tokens)
  Array([2, 4, 8], dtype=int32)
  """
  text, pairs = _read_schedule(schedule)
  for name, size in (("micro_batch_size", micro_batch_size),
                     ("num_micro_batches", num_micro_batches)):
    if size is not None and (not _validate.is_int(size) or size < 1):
      raise ValueError(
          f"batch_size_ramp_by_count: {name} must be a positive int or None, got "
          f"{name}={size!r}.")
  thresholds, values = _table(pairs, text, micro_batch_size, num_micro_batches)
  high_np = np.asarray([t // _WORD for t in thresholds], np.int32)
  low_np = np.asarray([t % _WORD for t in thresholds], np.int32)
  values_np = np.asarray(values, np.int32)

  def ramp(count: Any) -> jax.Array:
    if isinstance(count, np.ndarray) and count.shape == ():
      count = count[()]
    if isinstance(count, (float, np.floating)):
      count = _python_count(count)
    if _validate.is_int(count):  # exact in Python, whatever its size
      return jnp.asarray(values_np[max(bisect.bisect_right(thresholds, int(count)) - 1, 0)])
    high, low = _count_words(count)
    reached = (high > high_np) | ((high == high_np) & (low >= low_np))
    index = jnp.maximum(jnp.sum(reached, dtype=jnp.int32) - 1, 0)
    return jnp.asarray(values_np)[index]

  ramp.__doc__ = (
      f"batch_size_ramp_by_count schedule: samples or tokens seen -> micro-batches (int32), "
      f"from {values[0]} to {values[-1]}.")
  return ramp
