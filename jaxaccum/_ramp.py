"""``jaxaccum.batch_size_ramp``: a schedule of micro-batch counts, like an optax schedule.

A ramp grows (or shrinks) the effective batch by changing how many micro-batches run per
optimizer step, ``k = ramp(step)``, through ``active_micro_batches=k`` or
``MultiSteps(every_k_schedule=ramp)`` (see :func:`batch_size_ramp`).

Every ramp is a table of steps at which ``k`` changes, built in Python when the ramp is
made; calling it is one :func:`jax.numpy.searchsorted`, exact in int32 and jittable with a
traced ``step``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

_INT32_MAX = int(np.iinfo(np.int32).max)


def _is_int(value: Any) -> TypeGuard[numbers.Integral]:
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_int(name: str, value: Any, *, low: int, what: str) -> int:
  if not _is_int(value):
    raise TypeError(
        f"batch_size_ramp: {name} must be a Python int ({what}), got {value!r} of type "
        f"{type(value).__name__}.")
  if not low <= int(value) <= _INT32_MAX:
    raise ValueError(
        f"batch_size_ramp: {name} must be an int in [{low}, 2**31 - 1] ({what}), got "
        f"{name}={value}.")
  return int(value)


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
    if _is_int(step):
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
