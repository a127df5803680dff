"""Gradient accumulation for Flax Linen train steps: mutable collections and dropout RNGs.

Linen threads its mutable collections (``batch_stats``) and its RNG keys by hand, which
maps directly onto the core's options: :func:`value_and_grad` fixes the argument layout
``fun(params, batch, model_state, rngs)`` and builds :func:`jaxaccum.value_and_grad` with
``argnums=0, batch_argnums=1, state_argnums=2, rng_argnums=3``; :func:`make_train_step`
wraps it into a whole ``flax.training.train_state.TrainState`` step.

* ``model_state`` is a dict of the mutable collections, e.g. ``{"batch_stats": ...}``, the
  form in which ``apply(..., mutable=[...])`` returns them. Micro-batch ``i + 1`` sees the
  collections left by micro-batch ``i``; the final ones are returned.
* ``rngs`` is a dict of PRNG keys, e.g. ``{"dropout": key}``, as ``apply(..., rngs=...)``
  takes it. Micro-batch ``i`` receives ``jax.random.fold_in(key, i)`` for each key, so every
  micro-batch draws its own dropout mask; pass a new key each step (e.g.
  ``jax.random.fold_in(key, state.step)``) so that steps differ too.
* BatchNorm in training mode normalises each micro-batch with its own statistics (a "ghost
  batch" of the micro-batch size) and updates ``batch_stats`` once per micro-batch, in
  micro-batch order (micro-batch ``i`` holds rows ``i, i + N, ...``). Its gradients differ
  from one full-batch step; LayerNorm and GroupNorm give exactly the full-batch result.

This module does not import flax itself: it works on any ``TrainState``-like object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxaccum import _split, _transform

PyTree = Any

__all__ = ("make_train_step", "value_and_grad")


def _check_fun(fun: Any) -> None:
  if not callable(fun):
    raise TypeError(
        "fun must be a callable fun(params, batch, model_state, rngs), got "
        f"{fun!r} of type {type(fun).__name__}.")
  found = _split.short_signature(fun, 4)
  if found:
    raise TypeError(
        "fun must take four positional arguments, fun(params, batch, model_state, rngs), "
        f"but {found}. model_state is "
        "the dict of mutable collections (e.g. {'batch_stats': ...}, or {} without "
        "BatchNorm) and rngs the dict of PRNG keys (e.g. {'dropout': key}, or {}).")


def _check_rngs(rngs: PyTree) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(rngs):
    if not _split.is_key(leaf):
      raise TypeError(
          f"rngs must be a dict of PRNG keys such as {{'dropout': jax.random.key(0)}}, but "
          f"rngs{jax.tree_util.keystr(path)} is {_split.describe(leaf)}.")


def value_and_grad(
    fun: Callable[..., Any],
    *,
    num_micro_batches: int | None = None,
    micro_batch_size: int | None = None,
    has_aux: bool = False,
    reduce: str = "mean",
    aux_reduce: Any = None,
    accumulator_dtype: Any = None,
    grads_dtype: Any = None,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    unroll: int | bool = 1,
    data_axis: str | Sequence[str] | None = None,
    mesh: Any = None,
) -> Callable[..., Any]:
  """Accumulated value and gradients of a Linen loss with mutable collections and RNGs.

  ``fun(params, batch, model_state, rngs)`` computes the loss of one micro-batch, usually by
  calling ``model.apply({"params": params, **model_state}, x, mutable=list(model_state),
  rngs=rngs)``, and returns ``(loss, new_model_state)``, or ``(loss, (new_model_state,
  aux))`` with ``has_aux=True``. The returned function takes the same arguments with the
  full batch; ``new_model_state`` has been threaded through the micro-batches in order and
  micro-batch ``i`` used ``jax.random.fold_in(key, i)`` for each key of ``rngs``.

  Args:
    fun: the loss, ``fun(params, batch, model_state, rngs)``.
    num_micro_batches: the number ``N`` of micro-batches; must divide the batch size.
    micro_batch_size: alternatively, the rows per micro-batch. Give exactly one of the two.
    has_aux: ``fun`` returns ``(loss, (new_model_state, aux))``; aux is reduced over the
      micro-batches as ``aux_reduce`` says (the mean by default).
    reduce: ``"mean"``, ``"sum"`` or ``"weighted"``; see :func:`jaxaccum.value_and_grad`.
    aux_reduce, accumulator_dtype, grads_dtype, remat, remat_policy, unroll, data_axis,
      mesh: as in :func:`jaxaccum.value_and_grad`.

  Returns:
    A function ``(params, batch, model_state, rngs) -> ((loss, new_model_state), grads)``,
    or ``((loss, (new_model_state, aux)), grads)`` with ``has_aux=True``.

  Raises:
    TypeError: ``fun`` does not take four positional arguments, ``rngs`` holds something
      other than PRNG keys, or ``fun`` returns the wrong structure.
    ValueError: bad options, or a batch that cannot be split.

  >>> import jax, jax.numpy as jnp, optax
  >>> import flax.linen as nn
  >>> import jaxaccum
  >>> class Net(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x, train):
  ...     x = nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(x))
  ...     return nn.Dense(2)(nn.Dropout(0.5, deterministic=not train)(x))
  >>> model = Net()
  >>> x, y = jnp.ones((8, 3)), jnp.zeros(8, jnp.int32)
  >>> variables = model.init(jax.random.key(0), x, train=False)
  >>> def loss_fn(params, batch, model_state, rngs):
  ...   x, y = batch
  ...   logits, new_state = model.apply({"params": params, **model_state}, x, train=True,
  ...                                   mutable=list(model_state), rngs=rngs)
  ...   loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  ...   return loss, new_state
  >>> step = jax.jit(jaxaccum.linen.value_and_grad(loss_fn, num_micro_batches=4))
  >>> (loss, new_state), grads = step(
  ...     variables["params"], (x, y), {"batch_stats": variables["batch_stats"]},
  ...     {"dropout": jax.random.key(1)})
  >>> sorted(new_state), sorted(grads)
  (['batch_stats'], ['BatchNorm_0', 'Dense_0', 'Dense_1'])
  """
  _check_fun(fun)
  core = _transform.value_and_grad(
      fun, num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size,
      argnums=0, batch_argnums=1, state_argnums=2, rng_argnums=3, has_aux=has_aux,
      reduce=reduce, aux_reduce=aux_reduce, accumulator_dtype=accumulator_dtype,
      grads_dtype=grads_dtype, remat=remat, remat_policy=remat_policy, unroll=unroll,
      data_axis=data_axis, mesh=mesh)

  @functools.wraps(fun)
  def value_and_grad_fn(params, batch, model_state, rngs, *args, **kwargs):
    _split.batch_size({"batch": batch})
    _check_rngs(rngs)
    return core(params, batch, model_state, rngs, *args, **kwargs)

  return value_and_grad_fn


def make_train_step(
    fun: Callable[..., Any],
    *,
    num_micro_batches: int | None = None,
    micro_batch_size: int | None = None,
    collections: Sequence[str] = ("batch_stats",),
    has_aux: bool = False,
    **options: Any,
) -> Callable[..., Any]:
  """A ``TrainState`` step that accumulates gradients over micro-batches.

  ``fun`` is as in :func:`value_and_grad`. The returned ``train_step(state, batch, rngs)``
  reads ``params`` and each collection named in ``collections`` from ``state`` (a
  ``flax.training.train_state.TrainState`` subclass with a field per collection, e.g.
  ``batch_stats``), accumulates the loss and gradients, and returns
  ``(state.apply_gradients(grads=grads, **new_collections), loss)``, or
  ``(new_state, (loss, aux))`` with ``has_aux=True``. Wrap it in :func:`jax.jit`.

  Args:
    fun: the loss, ``fun(params, batch, model_state, rngs)``.
    num_micro_batches: the number ``N`` of micro-batches; must divide the batch size.
    micro_batch_size: alternatively, the rows per micro-batch.
    collections: the mutable collections kept as fields of the train state and passed to
      ``fun`` as ``model_state``; ``()`` for a model without BatchNorm.
    has_aux: ``fun`` returns ``(loss, (new_model_state, aux))``.
    **options: passed to :func:`value_and_grad` (``reduce``, ``aux_reduce``, ...).

  Returns:
    ``train_step(state, batch, rngs) -> (new_state, loss)`` (``(loss, aux)`` with
    ``has_aux=True``), where ``rngs`` is a dict of PRNG keys such as ``{"dropout": key}``.

  Raises:
    TypeError: ``collections`` is not a sequence of names, or ``state`` lacks one of them.

  >>> import jax, jax.numpy as jnp, optax
  >>> import flax.linen as nn
  >>> from flax.training import train_state
  >>> import jaxaccum
  >>> model = nn.Dense(1)
  >>> x, y = jnp.ones((8, 3)), jnp.zeros(8)
  >>> state = train_state.TrainState.create(
  ...     apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
  ...     tx=optax.sgd(0.1))
  >>> def loss_fn(params, batch, model_state, rngs):
  ...   x, y = batch
  ...   return jnp.mean((model.apply({"params": params}, x)[:, 0] - y) ** 2), model_state
  >>> train_step = jax.jit(jaxaccum.linen.make_train_step(
  ...     loss_fn, num_micro_batches=2, collections=()))
  >>> state, loss = train_step(state, (x, y), {})
  >>> int(state.step)
  1
  """
  if isinstance(collections, str) or not all(isinstance(c, str) for c in collections):
    raise TypeError(
        f"collections must be a sequence of collection names such as ('batch_stats',), got "
        f"collections={collections!r}.")
  collections = tuple(collections)
  vg = value_and_grad(fun, num_micro_batches=num_micro_batches,
                      micro_batch_size=micro_batch_size, has_aux=has_aux, **options)

  def train_step(state, batch, rngs):
    missing = [c for c in collections if not hasattr(state, c)]
    if missing:
      raise TypeError(
          f"the train state {type(state).__name__} has no field {missing[0]!r}, named in "
          f"collections={collections!r}. Subclass TrainState with a field per mutable "
          "collection (class TrainState(train_state.TrainState): batch_stats: Any), or "
          "pass collections=() for a model without mutable collections.")
    model_state = {c: getattr(state, c) for c in collections}
    (loss, extra), grads = vg(state.params, batch, model_state, rngs)
    new_model_state, aux = extra if has_aux else (extra, None)
    state = state.apply_gradients(grads=grads, **new_model_state)
    return state, ((loss, aux) if has_aux else loss)

  return train_step
