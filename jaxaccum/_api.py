"""The public transforms: ``jaxaccum.value_and_grad``, ``grad`` and ``evaluate``.

:func:`value_and_grad` validates its options once (:class:`jaxaccum._core._options.Options`) and
returns a :class:`jaxaccum._transforms.ValueAndGrad`, a callable object that holds them; a call
runs the core or, under ``data_axis``, the data-parallel driver. :func:`grad` drops the value;
:func:`evaluate` runs the same core with nothing differentiated. The objects, and the builders
the adapters, ``jaxaccum.dp`` and the planner use, are ``jaxaccum._transforms``'s: nothing
imports this module but the package's top level.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxaccum._core import _options
from jaxaccum._core._options import Terms
from jaxaccum._core._types import ArgNames, ArgNums, DTypeLike
from jaxaccum._parallel import _axes
from jaxaccum._parallel._axes import DataParallel
from jaxaccum._transforms import Evaluate, Grad, make_value_and_grad


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
    per_example: Callable[[Any], Any] | None = None,
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
    per_example: a function applied to each example's gradient before the examples are
      summed, typically the DP-SGD clip :func:`jaxaccum.dp.clip_per_example` (each example
      alone, as a batch of one; the loss must be a mean or sum of per-row losses, as
      :func:`jaxaccum.dp.check_per_example_loss` checks). The value is unchanged; the
      gradient is the transformed examples' mean (or sum), and ``with_info`` sees each
      micro-batch's sum of transformed gradients. See the DP-SGD guide.
    **deprecated: the keywords folded into records, kept for one release with a
      :class:`DeprecationWarning`: ``mesh``, ``param_gather``, ``grad_scatter`` and
      ``overlap_grad_reduce`` (now fields of :class:`jaxaccum.DataParallel`),
      ``loss_weights`` (:class:`jaxaccum.Terms`), ``remat_policy`` (``remat=policy``) and
      ``per_example_transform`` (``per_example=``).

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
      unroll=unroll, data_axis=data_axis, with_info=with_info, skip_nonfinite=skip_nonfinite,
      per_example=per_example)
  return make_value_and_grad(fun, {**given, **deprecated})


def grad(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
  """Like :func:`jax.grad`, accumulated over micro-batches; options as :func:`value_and_grad`.

  ``per_example=transform`` transforms each example's gradient, as in
  :func:`value_and_grad`. Returns a function giving
  ``grads``, or ``(grads, aux)`` when ``has_aux`` or ``state_argnums`` is set (the aux part
  as in :func:`value_and_grad`); with ``with_info=True``, ``(grads_part, info)``.

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> loss_fn = lambda w, x: jnp.mean((x * w) ** 2)
  >>> jaxaccum.grad(loss_fn, micro_batch_size=2)(jnp.array(2.0), jnp.arange(4.0))
  Array(14., dtype=float32)
  """
  vg = make_value_and_grad(fun, options)
  return Grad(vg, has_extra=vg.options.has_extra, with_info=vg.options.with_info)


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
                                        where="evaluate", parallel=_axes.KEYWORDS))
