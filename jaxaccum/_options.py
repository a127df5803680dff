"""The transform's options: validated once, when the transform is built, and frozen.

:class:`Options` is a frozen dataclass; code that needs a variant (the data-parallel mode
runs the same steps on each shard with a resolved count) uses :func:`dataclasses.replace`.
Adding an option touches the signature of :func:`jaxaccum.value_and_grad` (which passes
its arguments here as they are), :func:`make_options` and the field list, nothing else.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np

from jaxaccum import _reduce, _sharding, _split
from jaxaccum._types import AxisName


class Roles(NamedTuple):
  """Which arguments of one call play which role (positions resolved, names as given)."""

  diff: tuple[int, ...]
  batch: tuple[int, ...]
  rng: tuple[int, ...]
  state: tuple[int, ...]
  batch_names: tuple[str, ...]
  rng_names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything fixed when the transform is built."""

  fun: Callable[..., Any]
  count: int | None
  size: int | None
  argnums: tuple[int, ...]
  argnums_is_int: bool
  batch_argnums: tuple[int, ...]
  batch_argnames: tuple[str, ...]
  batch_optional: bool  # the default batch_argnums=1 with batch_argnames: only if it exists
  batch_axis: int | tuple  # one int, or one entry per batch argument (_split.batch_axes)
  has_aux: bool
  reduce: Any
  terms: tuple[_reduce.Term, ...]
  aux_reduce: Any
  rng_argnums: tuple[int, ...]
  rng_argnames: tuple[str, ...]
  state_argnums: tuple[int, ...]
  state_is_tuple: bool
  accumulator_dtype: np.dtype | None
  grads_dtype: np.dtype | None
  remat: bool
  remat_policy: Callable[..., bool] | None
  unroll: int | bool
  data_axis: tuple[AxisName, ...] | str | None  # a tuple of axes, "auto" or None
  mesh: Any
  with_info: bool
  skip_nonfinite: bool
  per_example_transform: Callable[[Any], Any] | None
  overlap_grad_reduce: bool  # the last micro-batch runs after the scan (data_axis)
  param_gather: str = "step"
  grad_scatter: str = "micro_batch"

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


def make_options(
    fun: Any, *, num_micro_batches: Any, micro_batch_size: Any, argnums: Any,
    batch_argnums: Any, batch_argnames: Any, has_aux: Any, reduce: Any, loss_weights: Any,
    aux_reduce: Any, rng_argnums: Any, rng_argnames: Any, state_argnums: Any,
    accumulator_dtype: Any, grads_dtype: Any, remat: Any, remat_policy: Any, unroll: Any,
    data_axis: Any, mesh: Any, with_info: Any, skip_nonfinite: Any,
    per_example_transform: Any, batch_axis: Any, param_gather: Any, grad_scatter: Any,
    overlap_grad_reduce: Any,
    evaluate: bool = False) -> Options:
  """Validates every option eagerly and returns the frozen :class:`Options`.

  ``evaluate=True`` is :func:`jaxaccum.evaluate`'s mode: ``argnums=()`` (nothing is
  differentiated) is allowed only there.
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r} of type {type(fun).__name__}.")
  count, size = _split.check_counts(num_micro_batches, micro_batch_size)
  names = _split.normalize_argnames("batch_argnames", batch_argnames)
  optional = batch_argnums is BATCH_ARGNUMS and bool(names)
  batch = _split.normalize_argnums("batch_argnums", batch_argnums, allow_empty=bool(names))
  axis = _check_batch_axis(batch_axis, batch, names, optional)
  if not batch and not names:
    raise ValueError(
        f"batch_argnums={batch_argnums!r} names no argument and batch_argnames is not given: "
        "name the batch by position (batch_argnums=1) or by keyword (batch_argnames='batch').")
  for flag, value in (("has_aux", has_aux), ("remat", remat), ("with_info", with_info),
                      ("skip_nonfinite", skip_nonfinite)):
    if not isinstance(value, bool):
      hint = "; pass a jax.checkpoint policy as remat_policy=..." if flag == "remat" else "."
      raise TypeError(f"{flag} must be a bool, got {flag}={value!r}{hint}")
  reduce = _reduce.check_reduce(reduce)
  terms = _reduce.make_terms(reduce, loss_weights)
  if aux_reduce is not None and not has_aux:
    raise ValueError(
        f"aux_reduce={aux_reduce!r} was given but has_aux=False: set has_aux=True and "
        "return (value, aux) from fun, or drop aux_reduce.")
  _reduce.check_aux_reduce(aux_reduce)
  if remat_policy is not None and not callable(remat_policy):
    raise TypeError(
        "remat_policy must be a jax.checkpoint policy such as "
        f"jax.checkpoint_policies.dots_saveable, got {remat_policy!r}.")
  # Checked callable just above; a policy answers whether to save a value (a bool).
  policy = cast("Callable[..., bool] | None", remat_policy)
  if isinstance(unroll, np.integer):
    unroll = int(unroll)
  if not isinstance(unroll, (bool, numbers.Integral)) or (
      not isinstance(unroll, bool) and unroll < 1):
    raise TypeError(
        f"unroll must be a positive int or a bool (as for jax.lax.scan), got unroll={unroll!r}.")
  axes = _sharding.check_data_axis_option(data_axis)
  check_overlap(overlap_grad_reduce, axes)
  state = _split.normalize_argnums("state_argnums", state_argnums, allow_empty=True)
  check_per_example(per_example_transform, reduce, terms)
  rng_names = _split.normalize_argnames("rng_argnames", rng_argnames)
  both = sorted(set(rng_names) & set(names))
  if both:
    raise ValueError(
        f"rng_argnames={rng_names!r} and batch_argnames={names!r} both name {both}: an "
        "argument can have only one role. One key for the whole batch, folded per "
        "micro-batch, goes in rng_argnames; per-example keys (one row per example) are batch "
        "data and go in batch_argnames.")
  return Options(
      fun=fun, count=count, size=size,
      argnums=_split.normalize_argnums("argnums", argnums, allow_empty=evaluate),
      argnums_is_int=not isinstance(argnums, (tuple, list)),
      batch_argnums=batch, batch_argnames=names, batch_optional=optional, batch_axis=axis,
      has_aux=has_aux,
      reduce=reduce, terms=terms, aux_reduce=aux_reduce,
      rng_argnums=_split.normalize_argnums("rng_argnums", rng_argnums, allow_empty=True),
      rng_argnames=rng_names,
      state_argnums=state, state_is_tuple=isinstance(state_argnums, (tuple, list)),
      accumulator_dtype=_reduce.check_dtype("accumulator_dtype", accumulator_dtype),
      grads_dtype=_reduce.check_dtype("grads_dtype", grads_dtype),
      remat=remat or policy is not None, remat_policy=policy,
      unroll=unroll if isinstance(unroll, bool) else int(unroll),
      data_axis=axes, mesh=_sharding.check_mesh(mesh, axes), with_info=with_info,
      skip_nonfinite=skip_nonfinite, per_example_transform=per_example_transform,
      param_gather=_sharding.check_placement("param_gather", param_gather, axes),
      grad_scatter=_sharding.check_placement("grad_scatter", grad_scatter, axes),
      overlap_grad_reduce=overlap_grad_reduce)


def check_overlap(overlap: Any, axes: Any) -> None:
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


def check_per_example(transform: Any, reduce: Any, terms: tuple[_reduce.Term, ...]) -> None:
  """``per_example_transform``: a callable, and a loss whose terms share one normalisation
  (the transform sees each example's whole gradient, so there is one divisor to apply)."""
  if transform is None:
    return
  if not callable(transform):
    raise TypeError(
        "per_example_transform must be a function from one example's gradient to a gradient "
        f"of the same structure (e.g. jaxaccum.clip_per_example(1.0)), got {transform!r}.")
  kinds = sorted({t.kind.name for t in terms})
  pairs = [t for t in terms if t.kind.divisor.own_denominator]
  if len(kinds) > 1 or len(pairs) > 1:
    what = (f"mixes the kinds {kinds}" if len(kinds) > 1 else
            f"has {len(pairs)} weighted terms, each divided by its own total denominator")
    raise ValueError(
        f"per_example_transform is given, but reduce={reduce!r} {what}: the transform sees "
        "each example's whole gradient, so every term must be normalised the same way. Use "
        "one kind for all terms (all 'mean' or all 'sum'), or a single 'weighted' term; or "
        "accumulate the terms with separate transforms.")
