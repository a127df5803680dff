"""Scalar validators: the checks of ints, floats, bools and choices that raise the package's
``TypeError``/``ValueError`` messages, written once.

Each takes the argument's name and, where its message says which function it is about,
``where`` (``"AdaptiveBatch"``, ``"seesaw"``, ...); the messages name the argument, the value
and, where there is one, an example of a good value. This module imports nothing from
jaxaccum, so that every other module may use it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)


def describe(x: Any) -> str:
  """A short description of a value for error messages."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
  text = repr(x)
  return f"{type(x).__name__} {text}" if len(text) < 80 else type(x).__name__


def is_bool(x: Any) -> TypeGuard[bool | np.bool_]:
  """Whether ``x`` is a Python or NumPy bool."""
  return isinstance(x, (bool, np.bool_))


def is_int(x: Any) -> TypeGuard[int | np.integer]:
  """Whether ``x`` is a Python or NumPy integer (a ``numbers.Integral``), bools excluded."""
  return isinstance(x, numbers.Integral) and not is_bool(x)


def is_real(x: Any) -> TypeGuard[float | np.integer | np.floating]:
  """Whether ``x`` is a Python or NumPy real number (a ``numbers.Real``), bools excluded."""
  return isinstance(x, numbers.Real) and not is_bool(x)


def check_bool(name: str, value: Any, *, what: str = "a bool") -> bool:
  """``value`` as a bool; raises ``TypeError`` unless it is a Python or NumPy bool (``what``
  says what the option takes, where it takes more than a bool)."""
  if not is_bool(value):
    raise TypeError(f"{name} must be {what}, got {name}={value!r}.")
  return bool(value)


def check_int(where: str, name: str, value: Any, *, low: int, what: str, example: str,
              high: int | None = None) -> int:
  """``value`` as a Python int in ``[low, high]`` (no upper bound when ``high`` is None).

  Raises:
    TypeError: ``value`` is not an int (a bool is not one).
    ValueError: it is out of range; the message says ``>= low`` and gives ``example``.
  """
  if not is_int(value):
    raise TypeError(
        f"{where}: {name} must be a Python int ({what}), got {describe(value)}. For "
        f"example {name}={example}.")
  if value < low or (high is not None and value > high):
    raise ValueError(
        f"{where}: {name} must be an int >= {low} ({what}), got {name}={value}. For example "
        f"{name}={example}.")
  return int(value)


def check_int32(where: str, name: str, value: Any, *, low: int, what: str) -> int:
  """``value`` as a Python int in ``[low, 2**31 - 1]``; the messages give the bounds."""
  if not is_int(value):
    raise TypeError(
        f"{where}: {name} must be a Python int ({what}), got {value!r} of type "
        f"{type(value).__name__}.")
  if not low <= int(value) <= INT32_MAX:
    raise ValueError(
        f"{where}: {name} must be an int in [{low}, 2**31 - 1] ({what}), got "
        f"{name}={value}.")
  return int(value)


def check_float(where: str, name: str, value: Any, *, low: float, strict: bool, what: str,
                example: str) -> float:
  """``value`` as a finite Python float ``> low`` (``strict``) or ``>= low``.

  Raises:
    TypeError: ``value`` is not a real number (a bool is not one).
    ValueError: it is not finite or out of range.
  """
  if not is_real(value):
    raise TypeError(
        f"{where}: {name} must be a float ({what}), got {describe(value)}. For "
        f"example {name}={example}.")
  number = float(value)
  ok = (number > low if strict else number >= low) and math.isfinite(number)
  if not ok:
    bound = f"> {low}" if strict else f">= {low}"
    raise ValueError(
        f"{where}: {name} must be a finite float {bound} ({what}), got "
        f"{name}={value}. For example {name}={example}.")
  return number


def check_choice(where: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
  """``value``, which must be one of ``choices`` (``ValueError`` listing them otherwise)."""
  if not isinstance(value, str) or value not in choices:
    raise ValueError(
        f"{where}: {name} must be one of {', '.join(map(repr, choices))}, got "
        f"{name}={value!r}.")
  return value


def check_host_count(name: str, value: Any, *, high: int | None = None, hint: str = "") -> int:
  """A concrete positive int (Python, NumPy or a concrete JAX integer scalar), at most
  ``high``; ``hint`` ends the messages. A traced value is refused (``TypeError``): the
  count is read on the host, outside :func:`jax.jit`."""
  if isinstance(value, (np.ndarray, jax.Array)) and value.shape == () and (
      jnp.issubdtype(value.dtype, jnp.integer)):
    try:
      value = int(value)
    except jax.errors.ConcretizationTypeError:
      raise TypeError(
          f"{name} must be a concrete int on the host, got a traced value. The loader runs "
          "outside jit: read k once per step, e.g. k = int(controller.micro_batches(state))."
      ) from None
  if not is_int(value):
    raise TypeError(f"{name} must be a positive int, got {describe(value)}.{hint}")
  if value < 1 or (high is not None and value > high):
    bound = f" and at most num_micro_batches={high}" if high is not None else ""
    raise ValueError(f"{name} must be at least 1{bound}, got {name}={value}.{hint}")
  return int(value)


def check_callable(fun: Any, signature: str) -> None:
  """An adapter's ``fun`` must be callable, as ``signature`` says (``fun(model, batch, ...)``)."""
  if not callable(fun):
    raise TypeError(
        f"fun must be a callable {signature}, got {fun!r} of type {type(fun).__name__}.")
