"""Gradient accumulation for Flax NNX models: ``jaxaccum.nnx.value_and_grad`` and ``grad``.

This module imports :mod:`flax.nnx`; ``import jaxaccum`` does not (the submodule loads on
first use of ``jaxaccum.nnx``).

The transforms mirror :func:`flax.nnx.value_and_grad` for a loss ``fun(model, batch, ...)``
and run on top of :func:`jaxaccum.value_and_grad`:

1. the model is split with ``nnx.split(model, wrt, ...)`` into the differentiated state and
   everything else (BatchNorm ``BatchStat``, the keys and counters of ``nnx.Rngs``
   streams, other ``Variable``\\ s);
2. one ``lax.scan`` runs ``fun`` on each micro-batch, differentiating the ``wrt`` state
   and threading the rest from micro-batch ``i`` into micro-batch ``i + 1``;
3. the model is updated in place with ``nnx.update`` and the gradients come back as the
   ``wrt`` state, ready for ``nnx.Optimizer(model, tx, wrt=...).update(model, grads)``.

What this means for common layers:

* **Dropout** (and anything drawing from an ``nnx.Rngs`` stream) draws a fresh mask for
  every micro-batch, because the stream's counter advances inside the scan; after the step
  the stream has advanced by the number of draws of all micro-batches, so the next step
  draws new masks again. The same seed gives the same result.
* **BatchNorm** in training mode normalises each micro-batch with that micro-batch's own
  statistics (a "ghost batch" of the micro-batch size) and updates its running averages
  once per micro-batch, in micro-batch order (micro-batch ``i`` holds rows
  ``i, i + N, i + 2N, ...``). Its loss and gradients therefore differ from one full-batch
  step; LayerNorm, GroupNorm and RMSNorm act per example and give exactly the full-batch
  result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxaccum import _split, _transform

PyTree = Any

__all__ = ("grad", "value_and_grad")


def _check_fun(fun: Any) -> None:
  """``fun`` must be callable with ``(model, batch)`` positionally."""
  if not callable(fun):
    raise TypeError(
        f"fun must be a callable fun(model, batch, ...), got {fun!r} of type "
        f"{type(fun).__name__}.")
  found = _split.short_signature(fun, 2)
  if found:
    raise TypeError(
        "fun must take the model and the batch as its first two positional arguments, "
        f"fun(model, batch, ...), but {found}. Pack the inputs and targets into one batch "
        "pytree such as (x, y) and put other inputs after it.")


def _check_rng_argnums(rng_argnums: Any) -> tuple[int, ...]:
  argnums = _split.normalize_argnums("rng_argnums", rng_argnums, allow_empty=True)
  for j in argnums:
    if j in (0, 1):
      raise ValueError(
          f"rng_argnums={rng_argnums!r} names argument {j}, which is the "
          f"{'model' if j == 0 else 'batch'}. rng_argnums must point at PRNG-key arguments "
          "after the batch: fun(model, batch, key, ...) with rng_argnums=2. Keys inside "
          "the model (nnx.Rngs) need no option: they are threaded and advance by themselves.")
    if j < 0:
      raise ValueError(
          f"rng_argnums={rng_argnums!r} holds a negative index {j}; count positional "
          "arguments of fun(model, batch, ...) from 0 (the first key is usually 2).")
  return argnums


def _model_filter(wrt: Any):
  """``wrt`` restricted to the model (element 0 of the split tuple)."""
  return nnx.All(wrt, lambda path, _: bool(path) and path[0] == 0)


def value_and_grad(
    fun: Callable[..., Any],
    *,
    num_micro_batches: int | None = None,
    micro_batch_size: int | None = None,
    has_aux: bool = False,
    reduce: str = "mean",
    wrt: Any = nnx.Param,
    aux_reduce: Any = None,
    rng_argnums: int | Sequence[int] | None = None,
    accumulator_dtype: Any = None,
    grads_dtype: Any = None,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    unroll: int | bool = 1,
    data_axis: str | Sequence[str] | None = None,
    mesh: Any = None,
) -> Callable[..., Any]:
  """Like :func:`flax.nnx.value_and_grad`, accumulated over micro-batches in one scan.

  ``fun(model, batch, *args, **kwargs)`` takes an NNX model and one micro-batch. The
  returned function takes the same arguments with the full batch, returns the full-batch
  value and the gradients with respect to the model's ``wrt`` variables, and updates the
  model's other state (BatchNorm statistics, RNG stream counters, any ``Variable`` that
  ``fun`` writes) in place, as :func:`flax.nnx.value_and_grad` does. Micro-batch ``i``
  holds rows ``i, i + N, i + 2N, ...`` of every leaf of ``batch`` and sees the state left
  by micro-batch ``i - 1``. Call it inside :func:`flax.nnx.jit` (or split the model
  yourself and use :func:`jax.jit`); ``fun`` is traced a constant number of times,
  whatever ``N`` is, and a second step with the same shapes does not retrace.

  Extra positional arguments that are NNX objects (for example an ``nnx.Rngs`` passed at
  call time, ``fun(model, batch, rngs)``) are threaded through the micro-batches like the
  model's own state and updated in place; other extra arguments are passed unchanged to
  every micro-batch, except those named by ``rng_argnums``.

  Args:
    fun: the loss, ``fun(model, batch, ...)``. It returns what ``reduce`` asks for, or
      ``(value, aux)`` with ``has_aux=True``.
    num_micro_batches: the number ``N`` of micro-batches; must divide the batch size.
    micro_batch_size: alternatively, the rows per micro-batch. Give exactly one of the two.
    has_aux: ``fun`` returns ``(value, aux)``; aux is reduced over the micro-batches as
      ``aux_reduce`` says (the mean by default).
    reduce: ``"mean"`` (``fun`` returns its micro-batch mean), ``"sum"``, or
      ``"weighted"`` (``fun`` returns ``(numerator, denominator)``, e.g. the summed token
      loss and the number of real tokens); see :func:`jaxaccum.value_and_grad`.
    wrt: an NNX filter choosing the differentiated variables of ``model``, as in
      :class:`flax.nnx.DiffState` and ``nnx.Optimizer(..., wrt=...)``. Default
      ``nnx.Param``.
    aux_reduce: how aux is reduced; see :func:`jaxaccum.value_and_grad`.
    rng_argnums: positions in ``fun``'s arguments (2 or more) of plain PRNG keys; micro-batch
      ``i`` gets ``jax.random.fold_in(key, i)``. Not needed for ``nnx.Rngs``.
    accumulator_dtype: dtype of the gradient and loss accumulators (float32 for
      bfloat16/float16 values by default).
    grads_dtype: dtype of the returned gradients; default each parameter's dtype.
    remat: recompute each micro-batch's forward pass in the backward pass
      (:func:`jax.checkpoint`).
    remat_policy: a :mod:`jax.checkpoint_policies` policy; implies ``remat=True``.
    unroll: passed to :func:`jax.lax.scan`.
    data_axis, mesh: the data-parallel mode of :func:`jaxaccum.value_and_grad`: each device
      accumulates its own rows and the gradients are reduced once per step. The model's
      other state is threaded per shard and combined at the end (floating leaves averaged,
      counters the maximum, keys shard 0's), so ``nnx.Rngs`` streams draw the same masks
      on every shard.

  Returns:
    A function with ``fun``'s arguments returning ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux=True``, where ``grads`` is an
    :class:`flax.nnx.State` shaped like ``nnx.state(model, wrt)``.

  Raises:
    TypeError: ``fun`` cannot be called as ``fun(model, batch, ...)``, its first argument
      is not an NNX object, or its output does not match ``has_aux``/``reduce``.
    ValueError: the model has no variables matching ``wrt``, the batch leaves do not share
      a leading axis, the batch size is not divisible, or ``fun`` changed the model's
      structure.

  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import jaxaccum
  >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  >>> def loss_fn(model, batch):
  ...   x, y = batch
  ...   return jnp.mean((model(x)[:, 0] - y) ** 2)
  >>> @nnx.jit
  ... def train_step(model, optimizer, batch):
  ...   step = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=4)
  ...   loss, grads = step(model, batch)
  ...   optimizer.update(model, grads)
  ...   return loss
  >>> batch = (jnp.arange(24.0).reshape(8, 3) / 24, jnp.arange(8.0) / 8)
  >>> ref_loss, ref_grads = nnx.value_and_grad(loss_fn)(model, batch)
  >>> loss = train_step(model, optimizer, batch)
  >>> bool(jnp.allclose(loss, ref_loss))
  True
  """
  _check_fun(fun)
  rng_argnums_t = _check_rng_argnums(rng_argnums)
  core_options = dict(
      num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size,
      has_aux=has_aux, reduce=reduce, aux_reduce=aux_reduce,
      accumulator_dtype=accumulator_dtype, grads_dtype=grads_dtype, remat=remat,
      remat_policy=remat_policy, unroll=unroll, data_axis=data_axis, mesh=mesh)
  # Validate every option now, not at the first call.
  _transform.value_and_grad(fun, argnums=0, batch_argnums=1, state_argnums=2,
                            rng_argnums=tuple(j + 1 for j in rng_argnums_t), **core_options)
  try:
    model_filter = _model_filter(wrt)
    nnx.filterlib.to_predicate(model_filter)
  except (TypeError, ValueError):
    raise TypeError(
        f"wrt must be an NNX filter such as nnx.Param, a Variable type, a tuple of filters or "
        f"nnx.All(...), got wrt={wrt!r}.") from None

  @functools.wraps(fun)
  def value_and_grad_fn(*args, **kwargs):
    if len(args) < 2:
      raise TypeError(
          f"the accumulated {getattr(fun, '__name__', 'fun')} must be called as "
          f"(model, batch, ...) with the model and batch positionally, got {len(args)} "
          "positional argument(s).")
    model, batch = args[0], args[1]
    if not isinstance(model, nnx.Pytree):
      raise TypeError(
          f"the first argument (model) must be an NNX object such as an nnx.Module, got "
          f"{_split.describe(model)}. For plain pytrees of parameters use jaxaccum.value_and_grad.")
    if isinstance(batch, nnx.Pytree):
      raise TypeError(
          f"the second argument (batch) must be a pytree of arrays, got the NNX object "
          f"{type(batch).__name__}. Call it as fun(model, batch, ...).")
    _split.batch_size({"batch": batch})
    for j in rng_argnums_t:
      if j >= len(args):
        raise ValueError(
            f"rng_argnums names argument {j}, but only {len(args)} positional arguments "
            "were passed.")
      if isinstance(args[j], nnx.Pytree):
        raise ValueError(
            f"rng_argnums names argument {j}, which is an NNX object "
            f"({type(args[j]).__name__}); NNX objects are threaded through the "
            "micro-batches already. Drop it from rng_argnums.")

    for name, value in kwargs.items():
      if any(isinstance(x, nnx.Pytree) for x in jax.tree.leaves(
          value, is_leaf=lambda x: isinstance(x, nnx.Pytree))):
        raise TypeError(
            f"keyword argument {name}={type(value).__name__}(...) holds an NNX object; "
            "NNX objects (nnx.Rngs, modules) are threaded through the micro-batches only when "
            f"passed positionally after the batch: call it as fun(model, batch, {name}).")
    node_pos = tuple(j for j in range(2, len(args)) if isinstance(args[j], nnx.Pytree))
    nodes = (model, *(args[j] for j in node_pos))
    graphdef, diff, rest = nnx.split(nodes, model_filter, ...)
    if not jax.tree.leaves(diff):
      raise ValueError(
          f"the model {type(model).__name__} has no variables matching wrt={wrt!r}, so "
          "there is nothing to differentiate. Pass the filter of the variables to train, "
          "e.g. wrt=nnx.Param, and check that the model was built with them.")
    rest_structure = jax.tree.structure(rest)
    plain = tuple(None if j in node_pos else args[j] for j in range(2, len(args)))

    def inner(diff, batch, rest, *plain):
      # Fresh Variable objects, owned by this trace, so that fun may write to them.
      diff, rest = jax.tree.map(lambda x: x, (diff, rest))
      nodes = nnx.merge(graphdef, diff, rest)
      call_args = [nodes[0], batch, *plain]
      for k, j in enumerate(node_pos):
        call_args[j] = nodes[k + 1]
      out = fun(*call_args, **kwargs)
      if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
          raise TypeError(
              f"fun must return (value, aux) because has_aux=True, got {_split.describe(out)}.")
        value, aux = out
      else:
        value, aux = out, None
      new_graphdef, _, new_rest = nnx.split(nodes, model_filter, ...)
      if new_graphdef != graphdef or jax.tree.structure(new_rest) != rest_structure:
        raise ValueError(
            "fun changed the structure of the model (added, removed or replaced a Variable "
            "or submodule). Under accumulation fun runs once per micro-batch and may only "
            "update existing Variables' values; create new state before the step.")
      return (value, (new_rest, aux)) if has_aux else (value, new_rest)

    core = _transform.value_and_grad(
        inner, argnums=0, batch_argnums=1, state_argnums=2,
        rng_argnums=tuple(j + 1 for j in rng_argnums_t), **core_options)
    (value, extra), grads = core(diff, batch, rest, *plain)
    new_rest, aux = extra if has_aux else (extra, None)
    nnx.update(nodes, new_rest)
    grads = grads[0]
    return ((value, aux), grads) if has_aux else (value, grads)

  return value_and_grad_fn


def grad(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
  """Like :func:`flax.nnx.grad`, accumulated over micro-batches.

  Options as :func:`value_and_grad`. Returns a function giving ``grads``, or
  ``(grads, aux)`` with ``has_aux=True``; the model's non-differentiated state is updated in
  place.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import jaxaccum
  >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
  >>> x = jnp.arange(8.0).reshape(4, 2)
  >>> grads = jaxaccum.nnx.grad(loss_fn, micro_batch_size=1)(model, x)
  >>> ref = nnx.grad(loss_fn)(model, x)
  >>> bool(jnp.allclose(grads["kernel"][...], ref["kernel"][...]))
  True
  """
  vg = value_and_grad(fun, **options)
  has_aux = bool(options.get("has_aux", False))

  @functools.wraps(fun)
  def grad_fn(*args, **kwargs):
    value, grads = vg(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return grad_fn
