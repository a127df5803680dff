"""The transform's options: validated once, when the transform is built, and frozen.

:class:`Options` is a frozen dataclass; code that needs a variant (the data-parallel mode
runs the same steps on each shard with a resolved count) uses :func:`dataclasses.replace`.
Adding an option touches two places: its :class:`Options` field with its validator
(:func:`option`), and its line in the signature of :func:`jaxaccum.value_and_grad` (with
its docstring entry), which passes every option here as given. :func:`jaxaccum.evaluate`
fills the options it does not take with ``value_and_grad``'s defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np

from jaxaccum import _reduce, _sharding, _split
from jaxaccum._per_example import check_per_example, masked_terms
from jaxaccum._types import AxisName


class Roles(NamedTuple):
  """Which arguments of one call play which role (positions resolved, names as given)."""

  diff: tuple[int, ...]
  batch: tuple[int, ...]
  rng: tuple[int, ...]
  state: tuple[int, ...]
  batch_names: tuple[str, ...]
  rng_names: tuple[str, ...] = ()


def _check_fun(fun: Any) -> Any:
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r} of type {type(fun).__name__}.")
  return fun


def _check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, bool):
    hint = "; pass a jax.checkpoint policy as remat_policy=..." if name == "remat" else "."
    raise TypeError(f"{name} must be a bool, got {name}={value!r}{hint}")
  return value


def _check_batch_argnums(batch_argnums: Any, names: tuple[str, ...]) -> tuple[int, ...]:
  batch = _split.normalize_argnums("batch_argnums", batch_argnums, allow_empty=bool(names))
  if not batch and not names:
    raise ValueError(
        f"batch_argnums={batch_argnums!r} names no argument and batch_argnames is not given: "
        "name the batch by position (batch_argnums=1) or by keyword (batch_argnames='batch').")
  return batch


def _check_aux_reduce(aux_reduce: Any, has_aux: bool) -> Any:
  if aux_reduce is not None and not has_aux:
    raise ValueError(
        f"aux_reduce={aux_reduce!r} was given but has_aux=False: set has_aux=True and "
        "return (value, aux) from fun, or drop aux_reduce.")
  _reduce.check_aux_reduce(aux_reduce)
  return aux_reduce


def _check_rng_argnames(rng_argnames: Any, batch_names: tuple[str, ...]) -> tuple[str, ...]:
  rng_names = _split.normalize_argnames("rng_argnames", rng_argnames)
  both = sorted(set(rng_names) & set(batch_names))
  if both:
    raise ValueError(
        f"rng_argnames={rng_names!r} and batch_argnames={batch_names!r} both name {both}: an "
        "argument can have only one role. One key for the whole batch, folded per "
        "micro-batch, goes in rng_argnames; per-example keys (one row per example) are batch "
        "data and go in batch_argnames.")
  return rng_names


def _check_roles(done: dict[str, Any], state: tuple[int, ...]) -> tuple[int, ...]:
  """Raises when two roles name one argument by positions of the same sign (``1`` twice,
  or ``-1`` twice), which needs no call; ``-1`` against ``1`` is checked at the call
  (:meth:`Options.roles`), which knows how many arguments there are. Returns ``state``."""
  roles = {"argnums": done["argnums"], "batch_argnums": done["batch_argnums"],
           "rng_argnums": done["rng_argnums"], "state_argnums": state}
  if done["batch_optional"]:  # the default argument 1 is a batch only where it is free
    del roles["batch_argnums"]
  _split.check_disjoint(roles)
  return state


def _check_policy(name: str, policy: Any) -> Callable[..., bool] | None:
  if policy is not None and not callable(policy):
    raise TypeError(
        f"{name} must be a jax.checkpoint policy such as "
        f"jax.checkpoint_policies.dots_saveable, got {policy!r}.")
  # A policy answers whether to save a value (a bool).
  return cast("Callable[..., bool] | None", policy)


def _check_unroll(name: str, unroll: Any) -> int | bool:
  if isinstance(unroll, np.integer):
    unroll = int(unroll)
  if not isinstance(unroll, (bool, numbers.Integral)) or (
      not isinstance(unroll, bool) and unroll < 1):
    raise TypeError(
        f"{name} must be a positive int or a bool (as for jax.lax.scan), got {name}={unroll!r}.")
  return unroll if isinstance(unroll, bool) else int(unroll)


Raw = dict[str, Any]  # the keyword options as given (and ``fun``, ``evaluate``)


def option(check: Callable[[Raw, dict[str, Any]], Any]) -> Any:
  """An :class:`Options` field and its validator: ``check(raw, done)`` reads the options as
  given (``raw``) and the fields validated before it (``done``), raises a clear error for a
  bad value, and returns the field's value."""
  return dataclasses.field(metadata={"check": check})


def _given(name: str, check: Callable[[str, Any], Any] | None = None) -> Any:
  """A field that holds option ``name`` as given, checked by ``check(name, value)``."""
  return option(lambda raw, done: raw[name] if check is None else check(name, raw[name]))


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything fixed when the transform is built, each field with its validator.

  The fields are validated in order by :func:`make_options`: a field's validator may read
  the fields above it.
  """

  fun: Callable[..., Any] = option(lambda raw, done: _check_fun(raw["fun"]))
  count: int | None = option(lambda raw, done: _split.check_counts(
      raw["num_micro_batches"], raw["micro_batch_size"])[0])
  size: int | None = option(lambda raw, done: _split.check_counts(
      raw["num_micro_batches"], raw["micro_batch_size"])[1])
  argnums: tuple[int, ...] = option(lambda raw, done: _split.normalize_argnums(
      "argnums", raw["argnums"], allow_empty=raw["evaluate"]))
  argnums_is_int: bool = option(lambda raw, done: not isinstance(raw["argnums"], (tuple, list)))
  batch_argnames: tuple[str, ...] = _given("batch_argnames", _split.normalize_argnames)
  batch_argnums: tuple[int, ...] = option(lambda raw, done: _check_batch_argnums(
      raw["batch_argnums"], done["batch_argnames"]))
  # The default batch_argnums=1 with batch_argnames: only where argument 1 exists.
  batch_optional: bool = option(lambda raw, done: raw["batch_argnums"] is BATCH_ARGNUMS
                                and bool(done["batch_argnames"]))
  # One int, or one entry per batch argument (_split.batch_axes).
  batch_axis: int | tuple = option(lambda raw, done: _check_batch_axis(
      raw["batch_axis"], done["batch_argnums"], done["batch_argnames"], done["batch_optional"]))
  has_aux: bool = _given("has_aux", _check_bool)
  reduce: Any = option(lambda raw, done: _reduce.check_reduce(raw["reduce"]))
  terms: tuple[_reduce.Term, ...] = option(lambda raw, done: masked_terms(
      _reduce.make_terms(done["reduce"], raw["loss_weights"]), raw["per_example_transform"]))
  aux_reduce: Any = option(lambda raw, done: _check_aux_reduce(raw["aux_reduce"],
                                                               done["has_aux"]))
  rng_argnums: tuple[int, ...] = option(lambda raw, done: _split.normalize_argnums(
      "rng_argnums", raw["rng_argnums"], allow_empty=True))
  rng_argnames: tuple[str, ...] = option(lambda raw, done: _check_rng_argnames(
      raw["rng_argnames"], done["batch_argnames"]))
  state_argnums: tuple[int, ...] = option(lambda raw, done: _check_roles(
      done, _split.normalize_argnums("state_argnums", raw["state_argnums"], allow_empty=True)))
  state_is_tuple: bool = option(lambda raw, done: isinstance(raw["state_argnums"],
                                                             (tuple, list)))
  accumulator_dtype: np.dtype | None = _given("accumulator_dtype", _reduce.check_dtype)
  grads_dtype: np.dtype | None = _given("grads_dtype", _reduce.check_dtype)
  remat_policy: Callable[..., bool] | None = _given("remat_policy", _check_policy)
  remat: bool = option(lambda raw, done: _check_bool("remat", raw["remat"])
                       or done["remat_policy"] is not None)
  unroll: int | bool = _given("unroll", _check_unroll)
  # A tuple of axes, "auto" or None.
  data_axis: tuple[AxisName, ...] | str | None = option(
      lambda raw, done: _sharding.check_data_axis_option(raw["data_axis"]))
  mesh: Any = option(lambda raw, done: _sharding.check_mesh(raw["mesh"], done["data_axis"]))
  with_info: bool = _given("with_info", _check_bool)
  skip_nonfinite: bool = _given("skip_nonfinite", _check_bool)
  per_example_transform: Callable[[Any], Any] | None = option(
      lambda raw, done: check_per_example(raw["per_example_transform"], done["reduce"],
                                          done["terms"], done["batch_argnames"]))
  # The last micro-batch runs after the scan (data_axis).
  overlap_grad_reduce: bool = option(
      lambda raw, done: check_overlap(raw["overlap_grad_reduce"], done["data_axis"]))
  param_gather: str = option(lambda raw, done: _sharding.check_placement(
      "param_gather", raw["param_gather"], done["data_axis"]))
  grad_scatter: str = option(lambda raw, done: _sharding.check_placement(
      "grad_scatter", raw["grad_scatter"], done["data_axis"]))

  @property
  def has_extra(self) -> bool:
    """Whether ``fun`` returns ``(value, extra)`` (aux and/or new state)."""
    return self.has_aux or bool(self.state_argnums)

  @property
  def evaluating(self) -> bool:
    """Evaluation (:func:`jaxaccum.evaluate`): no argument is differentiated."""
    return not self.argnums

  @property
  def single_term(self) -> bool:
    return isinstance(self.reduce, str)

  def label(self, j: int) -> str:
    """``argument j ('name')``: an argument named as ``fun``'s signature names it."""
    return arg_label(self.fun, j)

  def roles(self, nargs: int, kwargs: dict[str, Any]) -> Roles:
    """Resolves the role argnums against one call's arguments and checks them."""
    def res(name, argnums):
      return _split.resolve_argnums(name, argnums, nargs, kwargs)
    diff, rng, state = (res("argnums", self.argnums), res("rng_argnums", self.rng_argnums),
                        res("state_argnums", self.state_argnums))
    if self.batch_optional:  # f(params, x, *, labels) splits x; f(params, *, batch) nothing
      batch = (1,) if nargs > 1 and 1 not in diff + rng + state else ()
    else:
      batch = res("batch_argnums", self.batch_argnums)
    roles = Roles(diff, batch, rng, state, self.batch_argnames, self.rng_argnames)
    _split.check_disjoint({"argnums": roles.diff, "batch_argnums": roles.batch,
                           "rng_argnums": roles.rng, "state_argnums": roles.state})
    for option, names, example, positional in (
        ("batch_argnames", self.batch_argnames, "f(params, {k}=batch)", "batch_argnums"),
        ("rng_argnames", self.rng_argnames, "f(params, batch, {k}=key)", "rng_argnums")):
      missing = [k for k in names if k not in kwargs]
      if missing:
        raise ValueError(
            f"{option}={names!r} names keyword argument(s) {missing}, but the function was "
            f"called with keyword arguments {sorted(kwargs) or 'none'}. Pass it by keyword, "
            f"e.g. {example.format(k=missing[0])}, or name it by position with {positional}.")
    return roles


def arg_label(fun: Any, j: int) -> str:
  """``argument j ('name')`` when ``fun``'s signature names position ``j``."""
  try:
    params = [p for p in inspect.signature(fun).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  except (TypeError, ValueError):
    params = []
  if 0 <= j < len(params):
    return f"argument {j} ({params[j].name!r})"
  return f"argument {j}"


class _DefaultArgnum(int):
  """The default ``batch_argnums=1`` (it prints as ``1``), told apart from a given ``1``.

  With ``batch_argnames`` the default applies only where argument 1 exists and has no
  other role; a ``batch_argnums=1`` that the caller gave always applies.
  """


BATCH_ARGNUMS = _DefaultArgnum(1)


def _check_batch_axis(batch_axis: Any, batch: tuple[int, ...], names: tuple[str, ...],
                      optional: bool) -> int | tuple:
  """Validates ``batch_axis`` against the batch arguments named when the transform is built."""
  if optional and isinstance(batch_axis, tuple):
    raise ValueError(
        f"batch_axis={batch_axis!r} has one entry per batch argument, but batch_argnums is "
        f"left at its default with batch_argnames={names!r}, so whether argument 1 is a batch "
        "depends on the call. Pass batch_argnums explicitly (batch_argnums=1, or () when only "
        "batch_argnames name the batch), or one int batch_axis for all of them.")
  return _split.check_batch_axis(batch_axis, None if optional else len(batch) + len(names))


def make_options(fun: Any, *, evaluate: bool = False, **options: Any) -> Options:
  """Validates every option eagerly and returns the frozen :class:`Options`.

  ``options`` are :func:`jaxaccum.value_and_grad`'s keyword options, all of them, as given;
  each :class:`Options` field validates its own (:func:`option`). ``evaluate=True`` is
  :func:`jaxaccum.evaluate`'s mode: ``argnums=()`` (nothing is differentiated) is allowed
  only there.
  """
  raw = {"fun": fun, "evaluate": evaluate, **options}
  done: dict[str, Any] = {}
  for field in dataclasses.fields(Options):
    done[field.name] = field.metadata["check"](raw, done)
  return Options(**done)


def check_overlap(overlap: Any, axes: Any) -> bool:
  """``overlap_grad_reduce``: a bool, and only with ``data_axis``, the one mode whose
  cross-device reduction runs after the loop (without it there is none to overlap)."""
  if not isinstance(overlap, bool):
    raise TypeError(f"overlap_grad_reduce must be a bool, got overlap_grad_reduce={overlap!r}.")
  if overlap and axes is None:
    raise ValueError(
        "overlap_grad_reduce=True overlaps the cross-device gradient reduction that "
        "data_axis runs once after the micro-batch loop with the last micro-batch's backward "
        "pass, but data_axis is not set, so there is no such reduction: without data_axis "
        "the compiler reduces gradients inside every micro-batch. Pass "
        "data_axis='data' (the mesh axis the batch is sharded over), or drop "
        "overlap_grad_reduce.")
  return overlap
