"""The public transforms, ``jaxaccum.value_and_grad``, ``grad`` and ``evaluate``, as objects.

:func:`value_and_grad` validates its options once (:class:`jaxaccum._core._options.Options`) and
returns a :class:`ValueAndGrad`: a callable object that holds them (as equinox's
``filter_value_and_grad`` returns a Module and flax's ``nnx.grad`` a wrapped function). A
call runs the core (:func:`jaxaccum._core._transform.accumulate`) or, under ``data_axis``, the
data-parallel driver (:func:`jaxaccum._parallel._data_parallel.data_parallel`), and returns what
:func:`jax.value_and_grad` would (:func:`pack`). :class:`Grad` drops the value;
:class:`Evaluate` runs the same core with nothing differentiated; the adapters
(``jaxaccum.nnx``, ``jaxaccum.eqx``, ``jaxaccum.linen``) build on the same two objects.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxaccum._core import _options, _transform
from jaxaccum._core._options import DataParallel, Options, Terms
from jaxaccum._core._types import ArgNames, ArgNums, DTypeLike
from jaxaccum._parallel import _data_parallel
from jaxaccum._per_example import _rule


def value_and_grad(
    fun: Callable[..., Any],
    *,
    num_micro_batches: int | None = None,
    micro_batch_size: int | None = None,
    argnums: ArgNums = 0,
    batch_argnums: ArgNums = _options.BATCH_ARGNUMS,
    batch_argnames: ArgNames | None = None,
    batch_axis: int | tuple[Any, ...] = 0,
    has_aux: bool = False,
    reduce: str | dict[str, Any] | Terms = "mean",
    aux_reduce: Any = None,
    rng_argnums: ArgNums | None = None,
    rng_argnames: ArgNames | None = None,
    state_argnums: ArgNums | None = None,
    accumulator_dtype: DTypeLike | None = None,
    grads_dtype: DTypeLike | None = None,
    remat: bool | Callable[..., bool] = False,
    unroll: int | bool = 1,
    data_axis: str | Sequence[str] | DataParallel | None = None,
    with_info: bool = False,
    skip_nonfinite: bool = False,
    **deprecated: Any,
) -> Callable[..., Any]:
  """Like :func:`jax.value_and_grad`, accumulated over micro-batches in one ``lax.scan``.

  The batch arguments are split into ``N`` micro-batches (micro-batch ``i`` holds rows
  ``i, i + N, i + 2N, ...``, which keeps a sharded batch axis sharded). One
  :func:`jax.lax.scan` runs forward and backward on each micro-batch and sums the
  gradients in a float32 accumulator; the result is the full-batch loss and gradients,
  with :func:`jax.value_and_grad`'s output structure. Peak memory holds one micro-batch of
  activations. Call it inside your jitted train step.

  Args:
    fun: the loss, ``fun(params, batch, ...)``. What it returns depends on ``reduce``.
    num_micro_batches: the number ``N`` of micro-batches; must divide the batch size.
    micro_batch_size: alternatively, the rows per micro-batch. Give exactly one of the two.
    argnums: which positional argument(s) to differentiate, as in :func:`jax.grad`.
    batch_argnums: which positional argument(s) carry the batch: pytrees whose leaves share
      a batch axis (``None`` entries are passed as they are, as :func:`jax.vmap` does).
      Default 1; with ``batch_argnames`` the default applies when argument 1 is passed and
      has no other role, and ``batch_argnums=()`` names none. Other arguments, positional
      or keyword, are passed whole to every micro-batch.
    batch_argnames: keyword argument(s) that carry the batch, split like ``batch_argnums``
      (``loss_fn(params, x, labels=y)`` with ``batch_argnames="labels"``).
    batch_axis: the batch axis, as :func:`jax.vmap`'s ``in_axes``: one int for every leaf
      (default 0), or a tuple with one entry per batch argument (``batch_argnums`` in order,
      then ``batch_argnames``), each an int or a pytree prefix of that argument. Micro-batch
      ``i`` holds indices ``i, i + N, ...`` along it and the split moves no data. See "The
      split" in the guide "What it computes".
    has_aux: ``fun`` returns ``(value, aux)``; aux is reduced as ``aux_reduce`` says.
    reduce: how ``fun``'s value combines across micro-batches: ``"mean"`` (``fun`` returns
      its micro-batch's mean loss; the result is the full-batch mean), ``"sum"`` (a sum),
      ``"weighted"`` (``fun`` returns ``(numerator, denominator)``, e.g. summed token loss
      and token count; the loss is ``sum(numerator) / sum(denominator)``, exact however
      unevenly tokens fall; a total denominator of 0 gives 0), or a dict of these for a
      loss of several terms, or a :class:`jaxaccum.Terms` to weigh them.
    aux_reduce: how each aux leaf is reduced: ``"mean"``, ``"sum"``, ``"max"``, ``"min"``,
      ``"all"``/``"any"``, ``"stack"`` (one entry per micro-batch) or ``"concat"``
      (per-example rows back in batch order), an ``optax.microbatching.Accumulator``, or a
      pytree prefix of aux choosing per subtree. The default (``None``) is ``"mean"`` for
      floating scalars, ``"sum"`` for integer scalars and ``"all"`` for boolean scalars; a
      non-scalar leaf must be named. See "Aux" in the guide "What it computes".
    rng_argnums: positional argument(s) holding a PRNG key (or a pytree of keys);
      micro-batch ``i`` receives ``jax.random.fold_in(key, i)``. Per-example keys are
      batch data: name them in ``batch_argnums``.
    rng_argnames: keyword argument(s) holding a PRNG key, folded as ``rng_argnums`` are.
    state_argnums: positional argument(s) holding mutable state (e.g. Linen
      ``batch_stats``) that ``fun`` returns updated, as ``(value, new_state)`` (or
      ``(value, (new_state, aux))`` with ``has_aux``); micro-batch ``i + 1`` sees
      micro-batch ``i``'s state.
    accumulator_dtype: dtype of the accumulators; ``None`` accumulates bfloat16/float16
      values in float32 and wider ones in their own dtype.
    grads_dtype: dtype of the returned gradients; ``None`` gives each its parameter's dtype.
    remat: ``True`` wraps the per-micro-batch computation in :func:`jax.checkpoint`; a
      :mod:`jax.checkpoint_policies` policy does so with that policy.
    unroll: passed to :func:`jax.lax.scan`.
    data_axis: data-parallel mode: a :class:`jaxaccum.DataParallel`, or the mesh axis name
      (names, or ``"auto"``) the batch is sharded over, meaning ``DataParallel(data_axis)``.
    with_info: also return a :class:`jaxaccum.AccumInfo` (gradient noise statistics,
      counts): the function returns ``(value_part, grads, info)``.
    skip_nonfinite: a micro-batch whose value, denominator or any gradient is not finite
      adds nothing; means divide by the micro-batches kept and ``info.skipped`` counts the
      others. If every micro-batch is skipped the gradients are zeros and the value NaN.
    **deprecated: the keywords folded into records, kept for one release with a
      :class:`DeprecationWarning`: ``mesh``, ``param_gather``, ``grad_scatter`` and
      ``overlap_grad_reduce`` (now fields of :class:`jaxaccum.DataParallel`),
      ``loss_weights`` (:class:`jaxaccum.Terms`), ``remat_policy`` (``remat=policy``) and
      ``per_example_transform`` (:func:`jaxaccum.per_example_value_and_grad`).

  Returns:
    A function with ``fun``'s arguments returning ``(value, grads)``, or
    ``((value, aux), grads)`` when ``has_aux`` or ``state_argnums`` is set (the aux part is
    ``aux``, ``new_state`` or ``(new_state, aux)``), and the :class:`jaxaccum.AccumInfo`
    third with ``with_info``. It takes one more keyword, ``active_micro_batches``: an int or
    int32 scalar ``k`` in ``1..N``; only micro-batches ``0..k-1`` run and the reductions
    divide by what ran, in the same compiled program for every ``k``.

  Raises:
    ValueError, TypeError: at construction for bad options, and at trace time for a batch
      that cannot be split or a ``fun`` whose output does not match ``reduce``/``has_aux``.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> def loss_fn(w, batch):
  ...   x, y = batch
  ...   return jnp.mean((x @ w - y) ** 2)
  >>> w = jnp.ones(3)
  >>> batch = (jnp.arange(24.0).reshape(8, 3), jnp.arange(8.0))
  >>> step = jax.jit(jaxaccum.value_and_grad(loss_fn, num_micro_batches=4))
  >>> loss, grads = step(w, batch)
  >>> ref_loss, ref_grads = jax.value_and_grad(loss_fn)(w, batch)
  >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads, ref_grads))
  (True, True)
  """
  given = dict(
      num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size, argnums=argnums,
      batch_argnums=batch_argnums, batch_argnames=batch_argnames, batch_axis=batch_axis,
      has_aux=has_aux, reduce=reduce, aux_reduce=aux_reduce, rng_argnums=rng_argnums,
      rng_argnames=rng_argnames, state_argnums=state_argnums,
      accumulator_dtype=accumulator_dtype, grads_dtype=grads_dtype, remat=remat,
      unroll=unroll, data_axis=data_axis, with_info=with_info, skip_nonfinite=skip_nonfinite)
  return ValueAndGrad(_options.make_options(fun, given, deprecated=_requests(deprecated)))


def _requests(deprecated: dict[str, Any]) -> dict[str, Any]:
  """The deprecated ``per_example_transform=`` as the per-example wing's request."""
  transform = deprecated.get("per_example_transform")
  if transform is None:
    return deprecated
  return {**deprecated, "per_example_transform": _rule.Request(transform)}


def per_example_value_and_grad(fun: Callable[..., Any], transform: Callable[[Any], Any],
                               **options: Any) -> Callable[..., Any]:
  """:func:`value_and_grad` with ``transform`` applied to each example's gradient.

  ``transform(grads) -> grads`` sees one example's gradient (one row's, with
  :func:`jax.grad`'s structure) and returns one of the same shapes, e.g.
  :func:`jaxaccum.clip_per_example` for DP-SGD; the transformed gradients are then summed.
  Each micro-batch's examples are differentiated under :func:`jax.vmap`, ``fun`` seeing
  one row as a batch of one, so the micro-batch size is the vmap width and bounds the
  memory. The gradients are the mean over all examples of the transformed gradients (their
  sum under ``reduce="sum"``; under ``"weighted"`` the sum of the transformed gradients of
  each example's numerator divided by the total denominator); the value is the mean (sum)
  of the examples' values. A dict ``reduce`` needs all its terms of one kind. Aux leaves
  are reduced over a micro-batch's examples as their ``aux_reduce`` says (not ``"stack"``
  or user reductions); state must come back the same from each example; example ``r`` of
  micro-batch ``i`` gets ``fold_in(fold_in(key, i), r)``. ``skip_nonfinite`` and
  ``with_info`` see each micro-batch's sum of transformed gradients. See the DP-SGD guide.

  Args:
    fun: the loss, as for :func:`value_and_grad`.
    transform: the function applied to each example's gradient.
    **options: the options of :func:`value_and_grad`.

  Returns:
    A function as :func:`value_and_grad` returns.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
  >>> w, x = jnp.ones(2), jnp.arange(8.0).reshape(4, 2)
  >>> step = jaxaccum.per_example_value_and_grad(
  ...     loss_fn, jaxaccum.clip_per_example(1.0), num_micro_batches=2)
  >>> loss, grads = step(w, x)
  >>> bool(jnp.linalg.norm(grads) <= 1.0)
  True
  """
  if "per_example_transform" in options:
    raise TypeError(
        "per_example_value_and_grad takes the transform as its second argument, "
        "per_example_value_and_grad(fun, transform, ...); drop per_example_transform=.")
  if transform is None:
    raise TypeError(
        "per_example_value_and_grad needs a transform of each example's gradient, e.g. "
        "jaxaccum.clip_per_example(1.0); for no transform use jaxaccum.value_and_grad.")
  given = {k: v for k, v in options.items() if k in _options.DEFAULTS}
  old = {k: v for k, v in options.items() if k not in _options.DEFAULTS}
  return ValueAndGrad(_options.make_options(fun, given, deprecated=old,
                                            transform=_rule.Request(transform),
                                            where="per_example_value_and_grad"))


def grad(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
  """Like :func:`jax.grad`, accumulated over micro-batches; options as :func:`value_and_grad`.

  ``per_example_transform=transform`` makes it the gradient of
  :func:`per_example_value_and_grad` with that transform. Returns a function giving
  ``grads``, or ``(grads, aux)`` when ``has_aux`` or ``state_argnums`` is set (the aux part
  as in :func:`value_and_grad`); with ``with_info=True``, ``(grads_part, info)``.

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> loss_fn = lambda w, x: jnp.mean((x * w) ** 2)
  >>> jaxaccum.grad(loss_fn, micro_batch_size=2)(jnp.array(2.0), jnp.arange(4.0))
  Array(14., dtype=float32)
  """
  vg = with_transform(value_and_grad, fun, options)
  return Grad(vg, has_extra=vg.options.has_extra, with_info=vg.options.with_info)


def with_transform(make: Callable[..., Any], fun: Callable[..., Any], options: dict[str, Any]
                   ) -> Any:
  """``make(fun, **options)``, or :func:`per_example_value_and_grad` when ``options`` hold a
  ``per_example_transform``: :func:`grad` and the adapters, which have no per-example entry
  of their own, take it as an option (not deprecated there)."""
  rest = dict(options)
  transform = rest.pop("per_example_transform", None)
  if transform is None:
    return make(fun, **rest)
  return per_example_value_and_grad(fun, transform, **rest)


def evaluate(
    fun: Callable[..., Any],
    *,
    num_micro_batches: int | None = None,
    micro_batch_size: int | None = None,
    has_aux: bool = False,
    reduce: str | dict[str, Any] | Terms = "mean",
    aux_reduce: Any = None,
    batch_argnums: ArgNums = _options.BATCH_ARGNUMS,
    batch_argnames: ArgNames | None = None,
    batch_axis: int | tuple[Any, ...] = 0,
    rng_argnums: ArgNums | None = None,
    rng_argnames: ArgNames | None = None,
    state_argnums: ArgNums | None = None,
    accumulator_dtype: DTypeLike | None = None,
    unroll: int | bool = 1,
    data_axis: str | Sequence[str] | DataParallel | None = None,
    skip_nonfinite: bool = False,
    **deprecated: Any,
) -> Callable[..., Any]:
  """``fun`` on the full batch, computed one micro-batch at a time in one ``lax.scan``.

  The forward-only counterpart of :func:`value_and_grad`, for evaluation over a batch whose
  activations do not fit at once (eval loss and metrics of a large validation batch,
  per-example scores, a distillation teacher's logits). The batch is split as
  :func:`value_and_grad` splits it, ``fun`` runs on each micro-batch without a backward
  pass, and its outputs are reduced by the same rules, so the result is what ``fun``
  returns on the full batch: the compiled program holds one micro-batch's activations.

  Every option means what it means for :func:`value_and_grad`; those about gradients
  (``argnums``, ``grads_dtype``, ``remat``, ``with_info``, a :class:`jaxaccum.Terms`'s
  ``weights``, :class:`jaxaccum.DataParallel`'s placements) do not exist here. Two
  differences: with a dict ``reduce`` the value is the dict of terms, each
  normalised over the whole batch by its own rule (no weighted total), and integer counts
  go in aux (summed by default), not in the value.

  Args:
    fun: the function to evaluate, ``fun(params, batch, ...)``, returning a value as
      ``reduce`` says (a mean, a sum, ``(numerator, denominator)`` or a dict of terms),
      or ``(value, aux)`` with ``has_aux``.
    num_micro_batches: the number ``N`` of micro-batches.
    micro_batch_size: alternatively, the rows per micro-batch; give exactly one of the two.
    has_aux: ``fun`` returns ``(value, aux)``.
    reduce: how the value combines, as for :func:`value_and_grad`.
    aux_reduce: how aux leaves combine, as for :func:`value_and_grad`
      (``"concat"`` returns per-example rows in batch order).
    batch_argnums: the positional batch arguments, as for :func:`value_and_grad`.
    batch_argnames: the keyword batch arguments.
    batch_axis: the batch axis of the batch arguments.
    rng_argnums: positional PRNG keys, folded per micro-batch.
    rng_argnames: keyword PRNG keys, folded per micro-batch.
    state_argnums: state threaded from one micro-batch to the next.
    accumulator_dtype: dtype of the accumulators.
    unroll: passed to :func:`jax.lax.scan`.
    data_axis: the data-parallel mode's mesh axes, or a :class:`jaxaccum.DataParallel`
      with its ``mesh``, as for :func:`value_and_grad`.
    skip_nonfinite: drop micro-batches whose value or denominator is not finite.
    **deprecated: ``mesh``, kept for one release with a :class:`DeprecationWarning`: pass
      ``data_axis=jaxaccum.DataParallel(axis, mesh=mesh)``.

  Returns:
    A function with ``fun``'s arguments returning ``value``, or ``(value, aux)`` with
    ``has_aux``; with ``state_argnums``, ``(value, new_state)`` or ``(value, (new_state,
    aux))``. It takes the optional keyword ``active_micro_batches``, as
    :func:`value_and_grad` does.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> def metrics(w, batch):
  ...   x, y = batch
  ...   err = (x @ w - y) ** 2
  ...   return jnp.mean(err), err
  >>> w = jnp.ones(3)
  >>> batch = (jnp.arange(24.0).reshape(8, 3), jnp.arange(8.0))
  >>> ev = jax.jit(jaxaccum.evaluate(metrics, num_micro_batches=4, has_aux=True,
  ...                                aux_reduce="concat"))
  >>> loss, per_row = ev(w, batch)
  >>> ref_loss, ref_rows = metrics(w, batch)
  >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(per_row, ref_rows))
  (True, True)
  """
  given = dict(
      num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size, has_aux=has_aux,
      reduce=reduce, aux_reduce=aux_reduce, batch_argnums=batch_argnums,
      batch_argnames=batch_argnames, batch_axis=batch_axis, rng_argnums=rng_argnums,
      rng_argnames=rng_argnames, state_argnums=state_argnums,
      accumulator_dtype=accumulator_dtype, unroll=unroll, data_axis=data_axis,
      skip_nonfinite=skip_nonfinite)
  return Evaluate(_options.make_options(fun, given, deprecated=deprecated, evaluate=True,
                                        where="evaluate"))


class _Transform:
  """A transformed ``fun`` holding its validated options (the frozen
  :class:`jaxaccum._core._options.Options`); ``__wrapped__`` is ``fun``, so ``inspect.signature``
  and ``functools`` see ``fun``'s name, docstring and parameters."""

  name = ""

  def __init__(self, options: Options):
    self.options = options
    functools.update_wrapper(self, options.fun)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError

  def run(self, args: tuple, kwargs: dict, active: Any) -> tuple:
    """The core (or, under ``data_axis``, the data-parallel driver) on one call:
    ``(value, extra, grads, info)``."""
    opts = self.options
    run = _transform.accumulate if opts.data_axis is None else _data_parallel.data_parallel
    with jax.named_scope(_transform.call_scope(self.name)):
      return run(opts, args, kwargs, active)

  def __repr__(self) -> str:
    return f"<jaxaccum.{self.name} of {self.options.fun!r}>"

  def with_fun(self, fun: Callable[..., Any]) -> Any:
    """The same validated options around another ``fun``: the adapters build their inner
    function per call (it closes over the call's static parts) and run it through this."""
    return type(self)(dataclasses.replace(self.options, fun=fun))


class Evaluate(_Transform):
  """What :func:`evaluate` returns: ``fun`` run per micro-batch, with its validated options
  (nothing differentiated).

  Calling it takes ``fun``'s arguments (and ``active_micro_batches``) and returns what
  ``fun`` returns on the full batch.
  """

  name = "evaluate"

  def __call__(self, *args: Any, active_micro_batches: Any = None, **kwargs: Any) -> Any:
    value, extra, _, _ = self.run(args, kwargs, active_micro_batches)
    return (value, extra) if self.options.has_extra else value


def check_callable(fun: Any, signature: str) -> None:
  """An adapter's ``fun`` must be callable, as ``signature`` says (``fun(model, batch, ...)``)."""
  if not callable(fun):
    raise TypeError(
        f"fun must be a callable {signature}, got {fun!r} of type {type(fun).__name__}.")


def refuse_gradient_options(where: str, options: dict[str, Any], instead: str) -> None:
  """An adapter's ``evaluate`` given an option about gradients (one that
  :func:`value_and_grad` has and :func:`evaluate` has not) gets a ``TypeError`` naming it
  and ``instead``, the adapter's transform that takes it."""
  gradient = _options.GRADIENT_OPTIONS | {
      k for k, f in _options.DEPRECATED.items() if f.gradient}
  given = sorted(k for k in options if k in gradient)
  if given:
    raise TypeError(
        f"{where} takes no {given[0]}= option: it is about gradients, and {where} "
        f"differentiates nothing. Drop it, or use {instead} for gradients.")


class ValueAndGrad(_Transform):
  """What :func:`value_and_grad` returns: ``fun`` accumulated, with its validated options.

  Calling it takes ``fun``'s arguments (and ``active_micro_batches``) and returns
  ``(value, grads)`` as :func:`value_and_grad` documents.
  """

  name = "value_and_grad"

  def __call__(self, *args: Any, active_micro_batches: Any = None, **kwargs: Any) -> Any:
    opts = self.options
    value, extra, grads, info = self.run(args, kwargs, active_micro_batches)
    grads = grads[0] if opts.argnums_is_int else grads
    return pack(value, extra, grads, info, has_extra=opts.has_extra, with_info=opts.with_info)


class Grad:
  """The ``grad`` of a function that returns :func:`pack`'s output: ``grads``, or
  ``(grads, extra)`` with ``has_extra``; with ``with_info``, ``(grads_part, info)``."""

  def __init__(self, value_and_grad: Callable[..., Any], *, has_extra: bool, with_info: bool):
    self.value_and_grad = value_and_grad
    self.has_extra, self.with_info = has_extra, with_info
    functools.update_wrapper(self, value_and_grad)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    out = self.value_and_grad(*args, **kwargs)
    part = (out[1], out[0][1]) if self.has_extra else out[1]
    return (part, out[2]) if self.with_info else part

  def __repr__(self) -> str:
    return f"<jaxaccum.grad of {self.value_and_grad!r}>"


def pack(value: Any, extra: Any, grads: Any, info: Any, *, has_extra: bool,
         with_info: bool) -> tuple:
  """:func:`value_and_grad`'s output: ``(value, grads)``, ``((value, extra), grads)``, and
  ``info`` last with ``with_info``. The adapters return theirs through it too."""
  out = ((value, extra), grads) if has_extra else (value, grads)
  return (*out, info) if with_info else out
