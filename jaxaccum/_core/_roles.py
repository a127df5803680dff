"""Argument roles: the argnums and argnames options, normalised, resolved and disjoint.

Which arguments are differentiated, split as a batch, folded as PRNG keys or threaded as
state is named by position (``argnums``, ``batch_argnums``, ``rng_argnums``,
``state_argnums``: :func:`normalize_argnums`, negative positions resolved against a call by
:func:`resolve_argnums`) or by keyword (``batch_argnames``, ``rng_argnames``:
:func:`normalize_argnames`); no argument has two roles (:func:`check_disjoint`).
:class:`jaxaccum._core._options.RoleSpec` holds them.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from typing import Any

from jaxaccum._core._validate import is_int


def normalize_argnums(name: str, value: Any, *, allow_empty: bool) -> tuple[int, ...]:
  """Turns an int or a sequence of ints into a tuple, with a clear error otherwise."""
  if value is None:
    if allow_empty:
      return ()
    raise TypeError(f"{name} must be an int or a tuple of ints, got None.")
  if is_int(value):
    return (int(value),)
  if isinstance(value, Sequence) and not isinstance(value, str):
    if not all(is_int(v) for v in value):
      raise TypeError(f"{name} must be an int or a tuple of ints, got {value!r}.")
    out = [int(v) for v in value]
    if not out and not allow_empty:
      raise ValueError(f"{name} must name at least one argument, got {value!r}.")
    if len(set(out)) != len(out):
      raise ValueError(f"{name} names an argument twice: {value!r}.")
    return tuple(out)
  raise TypeError(f"{name} must be an int or a tuple of ints, got {value!r}.")


def normalize_argnames(name: str, value: Any) -> tuple[str, ...]:
  """Turns a string or a sequence of strings into a tuple, with a clear error otherwise."""
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
    if len(set(value)) != len(value):
      raise ValueError(f"{name} names an argument twice: {name}={value!r}.")
    return tuple(value)
  raise TypeError(
      f"{name} must be a keyword argument's name or a tuple of names (as jax.jit's "
      f"static_argnames), got {name}={value!r}.")


def resolve_argnums(name: str, argnums: tuple[int, ...], nargs: int,
                    kwargs: Any = ()) -> tuple[int, ...]:
  """Resolves negative argnums against ``nargs`` positional arguments."""
  out = []
  for a in argnums:
    if not -nargs <= a < nargs:
      hint = ("Pass the argument positionally or fix the index.")
      if name == "batch_argnums":
        passed = f" (keyword arguments: {', '.join(sorted(kwargs))})" if kwargs else ""
        hint = (
            "The two usual causes: the loss closes over the batch (def loss_fn(params): "
            "... batch ...), which cannot be split: take it as an argument, "
            "loss_fn(params, batch); or the batch is passed by keyword"
            f"{passed}: name it with batch_argnames='batch' (and batch_argnums=() if no "
            "positional argument is a batch).")
      called = (f"the function was called with {nargs} positional argument(s), so valid "
                f"indices are 0..{nargs - 1}" if nargs else
                "the function was called with no positional arguments")
      raise ValueError(f"{name}={a} is out of range: {called}. {hint}")
    out.append(a % nargs)
  return tuple(out)


def short_signature(fun: Any, num_positional: int) -> str | None:
  """``fun``'s signature as text if it cannot take ``num_positional`` positional arguments.

  Returns None when it can, or when the signature cannot be read (builtins, some C
  callables), so callers only raise on a signature they have actually seen.
  """
  try:
    sig = inspect.signature(fun)
  except (TypeError, ValueError):
    return None
  kinds = [p.kind for p in sig.parameters.values()]
  positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY,
                         inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
  if positional >= num_positional or inspect.Parameter.VAR_POSITIONAL in kinds:
    return None
  params = ", ".join(map(str, sig.parameters.values()))
  return f"{getattr(fun, '__name__', fun)!r} has signature ({params})"


def check_disjoint(named: dict[str, tuple[int, ...]]) -> None:
  """Raises if two roles (differentiated, batch, rng, state) share an argument."""
  for a, b in itertools.combinations(named, 2):
    both = sorted(set(named[a]) & set(named[b]))
    if both:
      raise ValueError(
          f"{a}={named[a]} and {b}={named[b]} overlap at argument(s) {both}: an argument "
          f"can have only one role. Give each of {a} and {b} different positions."
      )
