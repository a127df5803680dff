"""The transform's options: validated once, when the transform is built, and frozen.

The schema is data: :data:`DEFAULTS` lists the keyword options of
:func:`jaxaccum.value_and_grad` with their defaults, :data:`GRADIENT_OPTIONS` those that
:func:`jaxaccum.evaluate` does not take, and :data:`DEPRECATED` the keywords folded into a
record (:class:`jaxaccum.DataParallel`, :class:`Terms`, a policy ``remat``, or
``per_example``).

:class:`Options` is a record of records, each a frozen dataclass that validates (and
normalises) its own fields in ``__post_init__``: :class:`Split` (the micro-batch count or
size and the batch axis), :class:`RoleSpec` (which arguments are differentiated, batch,
keys or state, resolved per call by :meth:`RoleSpec.resolve`), :class:`Numerics` (dtypes,
remat, unroll) and :class:`jaxaccum.DataParallel` (the data-parallel mode, ``None`` without
it: its record and checks are :mod:`jaxaccum._parallel._axes`, the core never reads it);
``Options.__post_init__`` checks what joins two of them. :func:`make_options` folds the
deprecated keywords into their records and builds them. Code that needs a variant (the
data-parallel mode runs the same steps on each shard with a resolved count) uses
:func:`dataclasses.replace` on the record and on ``Options``.

Adding an option touches its record (a field and its check in ``__post_init__``), its entry
in :data:`DEFAULTS`, and its line in the signature and docstring of
:func:`jaxaccum.value_and_grad` (a test checks that the signature and the table agree); an
option of a new kind gets its own :class:`Options` field, of which there are at most 12
(``tests/test_architecture.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np

from jaxaccum._core import _reduce, _roles, _split, _validate


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


def _check_batch_argnums(batch_argnums: Any, names: tuple[str, ...]) -> tuple[int, ...]:
  batch = _roles.normalize_argnums("batch_argnums", batch_argnums, allow_empty=bool(names))
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
  rng_names = _roles.normalize_argnames("rng_argnames", rng_argnames)
  both = sorted(set(rng_names) & set(batch_names))
  if both:
    raise ValueError(
        f"rng_argnames={rng_names!r} and batch_argnames={batch_names!r} both name {both}: an "
        "argument can have only one role. One key for the whole batch, folded per "
        "micro-batch, goes in rng_argnames; per-example keys (one row per example) are batch "
        "data and go in batch_argnames.")
  return rng_names


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


def _is_policy(remat: Any) -> bool:
  """Whether ``remat`` is a :func:`jax.checkpoint` policy (any callable but a bool)."""
  return callable(remat) and not isinstance(remat, bool)


def _set(record: Any, **values: Any) -> None:
  """Stores a frozen record's normalised fields (from its ``__post_init__``)."""
  for name, value in values.items():
    object.__setattr__(record, name, value)


class _DefaultArgnum(int):
  """The default ``batch_argnums=1`` (it prints as ``1``), told apart from a given ``1``.

  With ``batch_argnames`` the default applies only where argument 1 exists and has no
  other role; a ``batch_argnums=1`` that the caller gave always applies.
  """


BATCH_ARGNUMS = _DefaultArgnum(1)


@dataclasses.dataclass(frozen=True)
class Split:
  """How the batch is split: into ``count`` micro-batches or ones of ``size`` rows (exactly
  one is given: ``num_micro_batches`` and ``micro_batch_size``), along ``batch_axis`` (one
  int, or one entry per batch argument, :func:`jaxaccum._core._split.batch_axes`)."""

  count: int | None = None
  size: int | None = None
  batch_axis: int | tuple = 0

  def __post_init__(self):
    count, size = _split.check_counts(self.count, self.size)
    _set(self, count=count, size=size, batch_axis=_split.check_batch_axis(self.batch_axis))


@dataclasses.dataclass(frozen=True)
class RoleSpec:
  """Which arguments play which role, as the options name them (resolved against each
  call's arguments by :meth:`resolve`).

  ``argnums``, ``batch_argnums``, ``rng_argnums`` and ``state_argnums`` are normalised to
  tuples, the names to tuples of strings. ``argnums_is_int`` (the gradients of one argument,
  not a tuple), ``batch_optional`` (the default ``batch_argnums=1`` with ``batch_argnames``:
  argument 1 is a batch only where it exists) and ``state_is_tuple`` are derived from the
  values as given when left ``None``. ``argnums=()`` (nothing differentiated) is
  :func:`jaxaccum.evaluate`'s; :func:`make_options` refuses it elsewhere.
  """

  argnums: Any = 0
  batch_argnums: Any = BATCH_ARGNUMS
  batch_argnames: Any = None
  rng_argnums: Any = None
  rng_argnames: Any = None
  state_argnums: Any = None
  argnums_is_int: bool | None = None
  batch_optional: bool | None = None
  state_is_tuple: bool | None = None

  def __post_init__(self):
    names = _roles.normalize_argnames("batch_argnames", self.batch_argnames)
    optional = self.batch_optional
    if optional is None:
      optional = self.batch_argnums is BATCH_ARGNUMS and bool(names)
    _set(self,
         argnums=_roles.normalize_argnums("argnums", self.argnums, allow_empty=True),
         argnums_is_int=(not isinstance(self.argnums, (tuple, list))
                         if self.argnums_is_int is None else self.argnums_is_int),
         batch_argnames=names,
         batch_argnums=_check_batch_argnums(self.batch_argnums, names),
         batch_optional=optional,
         rng_argnums=_roles.normalize_argnums("rng_argnums", self.rng_argnums,
                                              allow_empty=True),
         rng_argnames=_check_rng_argnames(self.rng_argnames, names),
         state_is_tuple=(isinstance(self.state_argnums, (tuple, list))
                         if self.state_is_tuple is None else self.state_is_tuple),
         state_argnums=_roles.normalize_argnums("state_argnums", self.state_argnums,
                                                allow_empty=True))
    # Two roles naming one argument by positions of the same sign (``1`` twice, or ``-1``
    # twice) need no call; ``-1`` against ``1`` is checked at the call (:meth:`resolve`).
    roles = {"argnums": self.argnums, "batch_argnums": self.batch_argnums,
             "rng_argnums": self.rng_argnums, "state_argnums": self.state_argnums}
    if self.batch_optional:  # the default argument 1 is a batch only where it is free
      del roles["batch_argnums"]
    _roles.check_disjoint(roles)

  def resolve(self, nargs: int, kwargs: dict[str, Any]) -> Roles:
    """Resolves the role argnums against one call's arguments and checks them."""
    def res(name, argnums):
      return _roles.resolve_argnums(name, argnums, nargs, kwargs)
    diff, rng, state = (res("argnums", self.argnums), res("rng_argnums", self.rng_argnums),
                        res("state_argnums", self.state_argnums))
    if self.batch_optional:  # f(params, x, *, labels) splits x; f(params, *, batch) nothing
      batch = (1,) if nargs > 1 and 1 not in diff + rng + state else ()
    else:
      batch = res("batch_argnums", self.batch_argnums)
    roles = Roles(diff, batch, rng, state, self.batch_argnames, self.rng_argnames)
    _roles.check_disjoint({"argnums": roles.diff, "batch_argnums": roles.batch,
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

  def with_appended_state(self) -> RoleSpec:
    """These roles for a call given one more positional argument, the state, last: the
    negative positions move one further from the end and ``state_argnums`` is ``-1``."""
    def shift(argnums: tuple[int, ...]) -> tuple[int, ...]:
      return tuple(j - 1 if j < 0 else j for j in argnums)
    return dataclasses.replace(
        self, argnums=shift(self.argnums), batch_argnums=shift(self.batch_argnums),
        rng_argnums=shift(self.rng_argnums), state_argnums=(-1,), state_is_tuple=False)


@dataclasses.dataclass(frozen=True)
class Numerics:
  """How the loop computes: the accumulator's and the gradients' dtypes, rematerialisation
  of each micro-batch (``remat``: a bool, or a :func:`jax.checkpoint` policy, stored as
  ``remat=True`` and ``remat_policy``) and the scan's ``unroll``.

  Adding a numerics option touches this record, the signature of
  :func:`jaxaccum.value_and_grad` and its docstring (and :data:`DEFAULTS`, which a test
  checks against the signature).
  """

  accumulator_dtype: np.dtype | None = None
  grads_dtype: np.dtype | None = None
  remat: Any = False
  remat_policy: Callable[..., bool] | None = None
  unroll: int | bool = 1

  def __post_init__(self):
    remat, policy = self.remat, self.remat_policy
    if _is_policy(remat):
      if policy is not None:
        raise TypeError(
            f"remat={remat!r} is a policy and remat_policy={policy!r} is given too: give the "
            "policy as remat only (remat_policy is deprecated).")
      remat, policy = True, remat
    policy = _check_policy("remat_policy", policy)
    hint = " or a jax.checkpoint policy such as jax.checkpoint_policies.dots_saveable"
    _set(self,
         accumulator_dtype=_reduce.check_dtype("accumulator_dtype", self.accumulator_dtype),
         grads_dtype=_reduce.check_dtype("grads_dtype", self.grads_dtype),
         remat_policy=policy,
         remat=_validate.check_bool("remat", remat, what=f"a bool{hint}") or policy is not None,
         unroll=_check_unroll("unroll", self.unroll))


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything fixed when the transform is built, in records that validate themselves.

  :func:`make_options` builds it from the public keyword options; ``__post_init__`` checks
  what joins two records (``batch_axis`` against the batch arguments, ``aux_reduce``
  against ``has_aux``). ``terms`` are ``reduce``'s loss terms with their weights (as a
  per-example transform changes them), ``parallel`` the data-parallel mode (``None``:
  none) and ``per_example`` the per-example wing's micro-batch rule
  (:class:`jaxaccum._per_example._rule.PerExampleRule`) or ``None``.
  """

  fun: Callable[..., Any]
  split: Split
  roles: RoleSpec
  reduce: Any = "mean"
  terms: tuple[_reduce.Term, ...] = ()
  aux_reduce: Any = None
  numerics: Numerics = Numerics()
  has_aux: bool = False
  with_info: bool = False
  skip_nonfinite: bool = False
  parallel: Any = None  # the data-parallel wing's DataParallel: held here, never read
  per_example: Any = None

  def __post_init__(self):
    _check_fun(self.fun)
    _set(self, has_aux=_validate.check_bool("has_aux", self.has_aux),
         with_info=_validate.check_bool("with_info", self.with_info),
         skip_nonfinite=_validate.check_bool("skip_nonfinite", self.skip_nonfinite))
    roles = self.roles
    _check_batch_axis(self.split.batch_axis, roles.batch_argnums, roles.batch_argnames,
                      bool(roles.batch_optional))
    _check_aux_reduce(self.aux_reduce, self.has_aux)

  @property
  def has_extra(self) -> bool:
    """Whether ``fun`` returns ``(value, extra)`` (aux and/or new state)."""
    return self.has_aux or bool(self.roles.state_argnums)

  @property
  def evaluating(self) -> bool:
    """Evaluation (:func:`jaxaccum.evaluate`): no argument is differentiated."""
    return not self.roles.argnums

  @property
  def single_term(self) -> bool:
    return isinstance(self.reduce, str)

  def label(self, j: int) -> str:
    """``argument j ('name')``: an argument named as ``fun``'s signature names it."""
    return arg_label(self.fun, j)

  def with_appended_state(self) -> Options:
    """These options for a call given one more positional argument, the state, last.

    An adapter (:mod:`jaxaccum.nnx`) validates the options in its caller's positions and
    resolves each call's roles with :meth:`RoleSpec.resolve` there; the core it runs is
    passed the caller's arguments and the threaded state after them, so the caller's
    negative positions move one further from the end and ``state_argnums`` is ``-1``. Both
    resolve a call to the same roles (``tests/adapters/test_roles.py``).
    """
    return dataclasses.replace(self, roles=self.roles.with_appended_state())


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


# The keyword options of :func:`jaxaccum.value_and_grad`, with their defaults: its signature
# lists these (tests/core/test_options.py checks that they agree).
DEFAULTS: dict[str, Any] = {
    "num_micro_batches": None, "micro_batch_size": None, "argnums": 0,
    "batch_argnums": BATCH_ARGNUMS, "batch_argnames": None, "batch_axis": 0,
    "has_aux": False, "reduce": "mean", "aux_reduce": None, "rng_argnums": None,
    "rng_argnames": None, "state_argnums": None, "accumulator_dtype": None,
    "grads_dtype": None, "remat": False, "unroll": 1, "data_axis": None,
    "with_info": False, "skip_nonfinite": False, "per_example": None,
}

# The options about gradients: :func:`jaxaccum.evaluate` has the others.
GRADIENT_OPTIONS = frozenset({"argnums", "grads_dtype", "remat", "with_info", "per_example"})


class Folded(NamedTuple):
  """A keyword option folded into a record: its default (``None`` for the placements, whose
  defaults :class:`jaxaccum.DataParallel` holds) and the replacement named in its
  :class:`DeprecationWarning`."""

  default: Any
  instead: str
  gradient: bool = True  # an option about gradients (evaluate never took it)


# Deprecated keywords (kept for one release), each folded into the option its
# replacement names.
DEPRECATED: dict[str, Folded] = {
    "mesh": Folded(None, "data_axis=jaxaccum.DataParallel(axis, mesh=mesh)", gradient=False),
    "param_gather": Folded(None, "data_axis=jaxaccum.DataParallel(axis, param_gather=...)"),
    "grad_scatter": Folded(None, "data_axis=jaxaccum.DataParallel(axis, grad_scatter=...)"),
    "overlap_grad_reduce": Folded(
        False, "data_axis=jaxaccum.DataParallel(axis, overlap_grad_reduce=True)"),
    "loss_weights": Folded(None, "reduce=jaxaccum.Terms(kinds, weights=...)"),
    "remat_policy": Folded(None, "remat=policy (remat takes the policy itself)"),
    "per_example_transform": Folded(None, "per_example=transform"),
}


@dataclasses.dataclass(frozen=True)
class Terms:
  """A loss of several terms, each normalised by its own rule, and their weights.

  Pass it as ``reduce=`` (a plain dict ``kinds`` means ``Terms(kinds)``): ``fun`` returns a
  dict with the same keys (``(numerator, denominator)`` for ``"weighted"`` terms); the value
  is the weighted total of the terms, each normalised over the whole batch, and the
  gradients are its gradients. Terms with different divisors cost one backward pass each per
  micro-batch.

  Attributes:
    kinds: a dict from term name to ``"mean"``, ``"sum"`` or ``"weighted"``.
    weights: the weight of each term, a dict from term name to a number (default 1 each).

  Raises:
    TypeError, ValueError: ``kinds`` not a dict of known kinds, or ``weights`` naming an
      unknown term or holding a non-number.

  >>> import jaxaccum
  >>> jaxaccum.Terms({"ce": "weighted", "aux": "mean"}, weights={"aux": 0.01}).weights
  {'aux': 0.01}
  """

  kinds: dict[str, Any]
  weights: dict[str, float] | None = None

  def __post_init__(self):
    if not isinstance(self.kinds, dict):
      raise TypeError(
          f"Terms takes a dict of loss terms, e.g. Terms({{'ce': 'weighted', 'aux': 'mean'}}), "
          f"got kinds={self.kinds!r}; a single loss is reduce={self.kinds!r}.")
    _reduce.make_terms(_reduce.check_reduce(self.kinds), self.weights, name="weights")

  __hash__ = None  # type: ignore[assignment]  # holds dicts


class ParallelKeywords(NamedTuple):
  """How a front end's ``data_axis`` keyword becomes ``Options.parallel``, which the core
  holds and never reads (:data:`jaxaccum._parallel._axes.KEYWORDS`): ``fold(data_axis,
  old, clash)`` folds the keyword and the deprecated keywords given (``old``; ``clash(record,
  name)`` raises for one given beside its record), ``check_evaluate(data_axis, where)``
  refuses what :func:`jaxaccum.evaluate` does not take."""

  fold: Callable[[Any, dict[str, Any], Callable[[str, str], None]], Any]
  check_evaluate: Callable[[Any, str], None]


def _fold(given: dict[str, Any], old: dict[str, Any], where: str,
          parallel: ParallelKeywords) -> dict[str, Any]:
  """The public options with the deprecated keywords given (``old``) folded into the
  records they now belong to: ``mesh``, the placements and ``overlap_grad_reduce`` into
  ``data_axis`` (by ``parallel.fold``), ``loss_weights`` into ``reduce``,
  ``remat_policy`` into ``remat`` and ``per_example_transform`` into ``per_example``. A
  keyword given beside its record is a ``TypeError``."""
  options = {**DEFAULTS, **given}

  def clash(record: str, name: str) -> None:
    raise TypeError(
        f"{where} got {name}= and {record} both: give {name} inside {record} only "
        f"({DEPRECATED[name].instead}).")

  options["data_axis"] = parallel.fold(options["data_axis"], old, clash)
  if "loss_weights" in old:
    if isinstance(options["reduce"], Terms):
      clash("reduce=Terms(...)", "loss_weights")
    options["reduce"] = _Weighted(options["reduce"], old["loss_weights"])
  if "remat_policy" in old:
    if _is_policy(options["remat"]):
      clash("a policy remat", "remat_policy")
    options["remat_policy"] = old["remat_policy"]
  if "per_example_transform" in old:
    if options["per_example"] is not None:
      raise TypeError(f"{where} got per_example_transform= and per_example= both: give the "
                      "transform once, as per_example= (per_example_transform is deprecated).")
    options["per_example"] = old["per_example_transform"]
  return options


class _Weighted(NamedTuple):
  """A ``reduce`` given with the deprecated ``loss_weights``."""

  kinds: Any
  weights: Any


def _terms(reduce: Any) -> tuple[Any, tuple[_reduce.Term, ...]]:
  """``(reduce, terms)``: the checked reduction (a kind or a dict of them) and its terms."""
  kinds, weights = (reduce.kinds, reduce.weights) if isinstance(reduce, (Terms, _Weighted)) \
      else (reduce, None)
  kinds = _reduce.check_reduce(kinds)
  return kinds, _reduce.make_terms(kinds, weights)


def _record(cls: type, options: dict[str, Any]) -> Any:
  """A record of the options named as its fields (a field that no option names, as the
  derived ones of :class:`RoleSpec`, keeps its default)."""
  return cls(**{f.name: options[f.name] for f in dataclasses.fields(cls) if f.name in options})


def make_options(fun: Any, given: dict[str, Any], *, deprecated: dict[str, Any] | None = None,
                 evaluate: bool = False, attach_per_example: AttachPerExample | None = None,
                 where: str = "value_and_grad", stacklevel: int = 3,
                 parallel: ParallelKeywords) -> Options:
  """Validates every option eagerly and returns the frozen :class:`Options`.

  ``parallel`` (:data:`jaxaccum._parallel._axes.KEYWORDS`, from the front end) folds the
  ``data_axis`` keyword and the deprecated keywords it replaces into ``Options.parallel``.

  ``given`` holds keyword options of :func:`jaxaccum.value_and_grad` (:data:`DEFAULTS`
  fills the others), ``deprecated`` the other keywords a caller received: each known one
  (:data:`DEPRECATED`) warns and is folded into its record, an unknown one is a
  ``TypeError``. Each record validates its own fields. ``evaluate=True`` is
  :func:`jaxaccum.evaluate`'s mode: ``argnums=()`` (nothing is differentiated) is allowed
  only there, and the options about gradients are refused. ``per_example`` (or the
  deprecated ``per_example_transform``) belongs to the per-example wing, which the core
  does not import: ``attach_per_example`` (the wing's
  :func:`jaxaccum._per_example._rule.attach`) turns it into the options' micro-batch rule;
  a caller that gives none refuses it.
  """
  old = dict(deprecated or {})
  if evaluate:
    refuse_gradient_options(where, old, "jaxaccum.value_and_grad")
  unknown = [k for k in given if k not in DEFAULTS] + [
      k for k in old if k not in DEPRECATED or evaluate and DEPRECATED[k].gradient]
  if unknown:
    raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}.")
  for name in old:
    warn_deprecated(where, name, stacklevel + 1)
  if evaluate:
    reduce = given.get("reduce")
    parallel.check_evaluate(given.get("data_axis"), where)
    if isinstance(reduce, Terms) and reduce.weights is not None:
      raise TypeError(
          f"{where} returns each term of a Terms reduce normalised on its own (no weighted "
          f"total), so it takes no weights: got {reduce!r}. Pass Terms(kinds) or the dict.")
    given = {**given, "argnums": ()}
  _check_fun(fun)
  given = _fold(given, old, where, parallel)
  split = Split(given["num_micro_batches"], given["micro_batch_size"], given["batch_axis"])
  if not evaluate:  # only evaluate differentiates nothing
    _roles.normalize_argnums("argnums", given["argnums"], allow_empty=False)
  roles = _record(RoleSpec, given)
  reduce, terms = _terms(given["reduce"])
  opts = Options(fun, split, roles, reduce, terms, given["aux_reduce"], _record(Numerics, given),
                 given["has_aux"], given["with_info"], given["skip_nonfinite"],
                 given["data_axis"])
  transform = given["per_example"]
  if transform is None:
    return opts
  keyword = "per_example_transform" if "per_example_transform" in old else "per_example"
  if attach_per_example is None:
    raise TypeError(
        f"{where}() takes no {keyword}= option: a per-example transform runs through "
        "jaxaccum.value_and_grad(fun, per_example=...), jaxaccum.grad or an adapter.")
  return attach_per_example(opts, transform, keyword, where)


# The per-example wing's hook: ``(options, transform, keyword typed, where) -> options``, the
# transform's micro-batch rule.
AttachPerExample = Callable[[Options, Any, str, str], Options]


def warn_deprecated(where: str, name: str, stacklevel: int = 3) -> None:
  """The :class:`DeprecationWarning` of keyword ``name`` (:data:`DEPRECATED`) given to
  ``where``, naming its replacement; ``stacklevel`` counts from the caller."""
  warnings.warn(
      f"{where}({name}=...) is deprecated and will be removed in the next release: use "
      f"{DEPRECATED[name].instead}.", DeprecationWarning, stacklevel=stacklevel)


def refuse_gradient_options(where: str, options: dict[str, Any], instead: str) -> None:
  """An ``evaluate`` (the public one or an adapter's) given an option about gradients (one
  that :func:`jaxaccum.value_and_grad` has and :func:`jaxaccum.evaluate` has not) gets a
  ``TypeError`` naming it and ``instead``, the transform that takes it."""
  gradient = GRADIENT_OPTIONS | {k for k, f in DEPRECATED.items() if f.gradient}
  given = sorted(k for k in options if k in gradient)
  if given:
    raise TypeError(
        f"{where} takes no {given[0]}= option: it is about gradients, and {where} "
        f"differentiates nothing. Drop it, or use {instead} for gradients.")
