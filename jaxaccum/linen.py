"""Gradient accumulation for Flax Linen train steps: mutable collections and dropout RNGs.

Linen threads its mutable collections (``batch_stats``) and its RNG keys by hand, which
maps directly onto the core's options: :func:`value_and_grad` fixes the argument layout
``fun(params, batch, model_state, rngs)`` and builds :func:`jaxaccum.value_and_grad` with
``argnums=0, batch_argnums=1, state_argnums=2, rng_argnums=3``; :func:`make_train_step`
wraps it into a whole ``flax.training.train_state.TrainState`` step (with ``axis_name``
under ``jax.pmap``), and :func:`apply_gradients` drives a ``TrainState`` whose optimizer is
a :class:`jaxaccum.MultiSteps`, passing ``weight=`` and counting optimizer steps.

``model_state`` (the mutable collections, e.g. ``{"batch_stats": ...}``) is threaded from
micro-batch ``i`` into ``i + 1``, and each key of ``rngs`` (e.g. ``{"dropout": key}``) is
folded with the micro-batch index, so every micro-batch draws its own dropout mask; pass a
new key each step (e.g. ``jax.random.fold_in(key, state.step)``) so that steps differ too.
BatchNorm in training mode normalises each micro-batch with its own statistics (a "ghost
batch"), so its gradients differ from one full-batch step; LayerNorm and GroupNorm give
exactly the full-batch result.

This module does not import flax itself: it works on any ``TrainState``-like object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum import _transforms
from jaxaccum._batch_size import MultiStepsState
from jaxaccum._core import _options, _outputs, _reduce, _roles, _validate
from jaxaccum._core._types import AxisNames, PyTree
from jaxaccum._parallel import _axes, _data_parallel

__all__ = ("apply_gradients", "evaluate", "make_train_step", "value_and_grad")


def _check_fun(fun: Any) -> None:
  _validate.check_callable(fun, "fun(params, batch, model_state, rngs)")
  found = _roles.short_signature(fun, 4)
  if found:
    raise TypeError(
        "fun must take four positional arguments, fun(params, batch, model_state, rngs), "
        f"but {found}. model_state is "
        "the dict of mutable collections (e.g. {'batch_stats': ...}, or {} without "
        "BatchNorm) and rngs the dict of PRNG keys (e.g. {'dropout': key}, or {}).")


def _refuse_layout_options(where: str, options: dict[str, Any], roles: str) -> None:
  """The layout fixes ``argnums``, ``state_argnums`` and ``rng_argnums``; ``roles`` says
  what it does with the parameters, in messages."""
  for name in ("argnums", "state_argnums", "rng_argnums"):
    if name in options:
      raise TypeError(
          f"jaxaccum.linen.{where} takes no {name}= option: the argument layout is fixed, "
          f"fun(params, batch, model_state, rngs, ...), with {roles}model_state threaded "
          "and the keys of rngs folded per micro-batch.")


def _like(template: Any, new: Any) -> Any:
  """``new`` with the mapping types of ``template`` (``FrozenDict`` stays ``FrozenDict``).

  ``model.apply(..., mutable=[...])`` returns plain dicts whatever container the state came
  in; the scan's carry must keep one type, and callers get back what they passed in.
  """
  if not (isinstance(template, Mapping) and isinstance(new, Mapping)):
    return new
  if set(template) != set(new):
    return new  # a structural change: the core reports it with both structures
  items = {k: _like(template[k], new[k]) for k in template}
  container: Any = type(template)
  return items if container is dict else container(items)


def _match_state(fun: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
  """Wraps ``fun`` so that the state it returns has ``model_state``'s container types."""

  @functools.wraps(fun)
  def wrapped(params, batch, model_state, rngs, *args, **kwargs):
    out = fun(params, batch, model_state, rngs, *args, **kwargs)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      return out  # the core explains what fun must return
    value, extra = out
    if has_aux:
      if not (isinstance(extra, (tuple, list)) and len(extra) == 2):
        return out
      return value, (_like(model_state, extra[0]), extra[1])
    return value, _like(model_state, extra)

  return wrapped


def value_and_grad(
    fun: Callable[..., Any],
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    **options: Any,
) -> Callable[..., Any]:
  """Accumulated value and gradients of a Linen loss with mutable collections and RNGs.

  ``fun(params, batch, model_state, rngs, ...)`` computes the loss of one micro-batch,
  usually by calling ``model.apply({"params": params, **model_state}, x,
  mutable=list(model_state), rngs=rngs)``, and returns ``(loss, new_model_state)``, or
  ``(loss, (new_model_state, aux))`` with ``has_aux=True``. The returned function takes the
  same arguments with the full batch; ``new_model_state`` has been threaded through the
  micro-batches in order and micro-batch ``i`` used ``jax.random.fold_in(key, i)`` for each
  key of ``rngs``. ``model_state`` may be a ``dict`` or a ``FrozenDict`` (at any depth):
  the new state comes back in the same container types, whatever ``apply`` returns.

  Which arguments are split: ``batch`` (argument 1), or the positions in
  ``batch_argnums``, and the keyword arguments named in ``batch_argnames`` (e.g.
  ``fun(params, batch, model_state, rngs, *, labels)`` with ``batch_argnames="labels"``).
  Other arguments after ``rngs`` and other keyword arguments are passed unchanged.

  Args:
    fun: the loss, ``fun(params, batch, model_state, rngs, ...)``.
    batch_argnums: position(s) of the batch arguments; default ``1``. Positions 0, 2 and
      3 are the parameters, the mutable collections and the keys.
    has_aux: ``fun`` returns ``(loss, (new_model_state, aux))``; aux is reduced over the
      micro-batches as ``aux_reduce`` says.
    **options: the other options of :func:`jaxaccum.value_and_grad` (the split,
      ``num_micro_batches`` or ``micro_batch_size``, is required), passed to it unchanged
      and meaning what they mean there. The layout fixes ``argnums=0``,
      ``state_argnums=2`` and ``rng_argnums=3``; those three are refused.

  Returns:
    A function ``(params, batch, model_state, rngs, ...) -> ((loss, new_model_state),
    grads)``, or ``((loss, (new_model_state, aux)), grads)`` with ``has_aux=True``; with
    ``with_info=True`` a third element, the :class:`jaxaccum.AccumInfo`.

  Raises:
    TypeError: ``fun`` does not take four positional arguments, ``rngs`` holds something
      other than PRNG keys, ``fun`` returns the wrong structure, or an option the adapter
      sets itself (``argnums``, ``state_argnums``, ``rng_argnums``) is given.
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
  _refuse_layout_options("value_and_grad", options, "params differentiated, ")
  _check_fun(fun)
  return _transforms.make_value_and_grad(_match_state(fun, has_aux), dict(
      options, argnums=0, batch_argnums=batch_argnums, state_argnums=2, rng_argnums=3,
      has_aux=has_aux))


def evaluate(
    fun: Callable[..., Any],
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    **options: Any,
) -> Callable[..., Any]:
  """:func:`jaxaccum.evaluate` for a Linen ``fun(params, batch, model_state, rngs, ...)``.

  The forward-only counterpart of :func:`value_and_grad`, with its argument layout and its
  rules: ``model_state`` is threaded through the micro-batches in order (``{}`` for a model
  evaluated with ``use_running_average=True``), each key of ``rngs`` is folded per
  micro-batch (``{}`` without dropout), and ``fun`` returns ``(value, new_model_state)``,
  or ``(value, (new_model_state, aux))`` with ``has_aux=True``. The returned function
  takes the same arguments with the full batch and returns the same structure, reduced
  over the micro-batches as :func:`jaxaccum.evaluate` documents; ``**options`` are
  :func:`jaxaccum.evaluate`'s but the three the layout fixes (``argnums``,
  ``state_argnums``, ``rng_argnums``), and options about gradients are refused by name.

  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> import jaxaccum
  >>> model = nn.Dense(2)
  >>> x = jnp.ones((8, 3))
  >>> params = model.init(jax.random.key(0), x)["params"]
  >>> def eval_fn(params, x, model_state, rngs):
  ...   return jnp.mean(model.apply({"params": params}, x) ** 2), model_state
  >>> loss, _ = jaxaccum.linen.evaluate(eval_fn, num_micro_batches=4)(params, x, {}, {})
  >>> bool(jnp.allclose(loss, eval_fn(params, x, {}, {})[0]))
  True
  """
  _refuse_layout_options("evaluate", options, "")
  _options.refuse_gradient_options("jaxaccum.linen.evaluate", options,
                               "jaxaccum.linen.value_and_grad")
  _check_fun(fun)
  return _transforms.make_evaluate(_match_state(fun, has_aux), dict(
      options, batch_argnums=batch_argnums, state_argnums=2, rng_argnums=3, has_aux=has_aux))


def make_train_step(
    fun: Callable[..., Any],
    *,
    collections: Sequence[str] = ("batch_stats",),
    axis_name: AxisNames | None = None,
    has_aux: bool = False,
    **options: Any,
) -> Callable[..., Any]:
  """A ``TrainState`` step that accumulates gradients over micro-batches.

  ``fun`` is as in :func:`value_and_grad`. The returned ``train_step(state, batch, rngs)``
  reads ``params`` and each collection named in ``collections`` from ``state`` (a
  ``flax.training.train_state.TrainState`` subclass with a field per collection, e.g.
  ``batch_stats``), accumulates the loss and gradients, and returns
  ``(state.apply_gradients(grads=grads, **new_collections), loss)``, or
  ``(new_state, (loss, aux))`` with ``has_aux=True``. Wrap it in :func:`jax.jit` (or
  :func:`jax.pmap` with ``axis_name``).

  Under :func:`jax.pmap` or :func:`jax.shard_map` each replica accumulates its own rows.
  With ``axis_name`` set, the replicas' accumulators are combined over that axis once per
  step, after the micro-batch loop, by the rules of ``data_axis`` ("What data_axis
  computes" in the devices guide), the replicas playing the data shards: the loss,
  gradients, aux (but ``"concat"`` rows stay on their replica), collections
  (``batch_stats``: floating leaves averaged, integer leaves the maximum) and
  :class:`jaxaccum.AccumInfo` are reduced as there, so every replica applies the same
  update and the replicas stay identical. PRNG keys follow the ``data_axis`` rule too:
  each key of ``rngs`` reaches replica ``d`` as ``jax.random.fold_in(key, d)``, ``d`` its
  index along ``axis_name`` (``jax.lax.axis_index(axis_name)``), so the replicas draw
  different dropout masks from one key passed to all of them, and micro-batch ``i`` of
  replica ``d`` uses ``fold_in(fold_in(key, d), i)``. Without ``axis_name`` nothing is
  exchanged and nothing folded per replica: under ``pmap`` each replica applies the
  gradient of its own rows only, and the replicas drift apart.

  Args:
    fun: the loss, ``fun(params, batch, model_state, rngs)``.
    collections: the mutable collections kept as fields of the train state and passed to
      ``fun`` as ``model_state``; ``()`` for a model without BatchNorm.
    axis_name: the ``pmap``/``shard_map`` axis (or tuple of axes) to combine the replicas
      over; ``None`` (default) exchanges nothing.
    has_aux: ``fun`` returns ``(loss, (new_model_state, aux))``.
    **options: passed to :func:`value_and_grad`, hence the options of
      :func:`jaxaccum.value_and_grad` but the three its layout fixes. With ``axis_name``,
      ``reduce`` must be ``"mean"``, ``"sum"`` or ``"weighted"`` and ``data_axis`` is
      refused.

  Returns:
    ``train_step(state, batch, rngs) -> (new_state, loss)`` (``(loss, aux)`` with
    ``has_aux=True``, and the :class:`jaxaccum.AccumInfo` as a third element with
    ``with_info=True``), where ``rngs`` is a dict of PRNG keys such as
    ``{"dropout": key}``.

  Raises:
    TypeError: ``collections`` is not a sequence of names, ``state`` lacks one of them, or
      ``batch_argnames``/``rng_argnames`` is given (``train_step`` takes no keywords).
    ValueError: ``axis_name`` with a ``reduce`` other than ``"mean"``, ``"sum"`` or
      ``"weighted"``, or with ``data_axis``.

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
  vg = value_and_grad(fun, has_aux=has_aux, **options)
  opts = vg.options
  if axis_name is not None and not (isinstance(opts.reduce, str)
                                    and opts.reduce in _reduce.LOSS_KINDS):
    raise ValueError(
        f"axis_name={axis_name!r} combines replicas for reduce='mean', 'sum' or 'weighted', "
        f"got reduce={opts.reduce!r}. Combine the results yourself with jax.lax.pmean/psum, "
        "or use one of those reductions.")
  if axis_name is not None and opts.parallel is not None:
    raise ValueError(
        f"axis_name={axis_name!r} and data_axis={opts.parallel.axis!r} were both given: "
        "axis_name combines the replicas of an enclosing jax.pmap or jax.shard_map, "
        "data_axis maps over the mesh itself. Pass one of them.")
  for name, given in (("batch_argnames", opts.roles.batch_argnames),
                      ("rng_argnames", opts.roles.rng_argnames)):
    if given:
      raise TypeError(
          f"jaxaccum.linen.make_train_step takes no {name}= option: train_step(state, batch, "
          "rngs) passes no keyword arguments to fun. Put the whole batch in batch and the "
          "PRNG keys in rngs (each folded per micro-batch), or build the step on "
          "jaxaccum.linen.value_and_grad to pass keyword arguments.")
  if axis_name is None:
    accumulated = vg
  else:
    axes = _axes.check_data_axis(axis_name)
    assert axes is not None
    accumulated = _across_replicas(vg.options, axes)

  def train_step(state, batch, rngs):
    missing = [c for c in collections if not hasattr(state, c)]
    if missing:
      raise TypeError(
          f"the train state {type(state).__name__} has no field {missing[0]!r}, named in "
          f"collections={collections!r}. Subclass TrainState with a field per mutable "
          "collection (class TrainState(train_state.TrainState): batch_stats: Any), or "
          "pass collections=() for a model without mutable collections.")
    model_state = {c: getattr(state, c) for c in collections}
    (loss, extra), grads, *info = accumulated(state.params, batch, model_state, rngs)
    new_model_state, aux = extra if has_aux else (extra, None)
    state = state.apply_gradients(grads=grads, **new_model_state)
    return (state, ((loss, aux) if has_aux else loss), *info)

  return train_step


def _across_replicas(opts: _options.Options, axes: tuple[str, ...]) -> Callable[..., Any]:
  """The core run of ``opts`` on one replica, its carry combined over ``axes`` after the loop.

  The replica driver of ``data_axis`` (:func:`jaxaccum._parallel._data_parallel.on_replicas`),
  with the replicas made by the enclosing ``pmap`` or ``shard_map``: the parameters and the
  collections are marked varying over ``axes``, each key of ``rngs`` is folded with the
  replica's index, and the accumulators are combined once after the loop.
  """

  def run(params, batch, model_state, rngs):
    args = (params, batch, model_state, rngs)
    out = _data_parallel.on_replicas(opts, opts.roles.resolve(len(args), {}), args, {}, axes=axes)
    (grads,) = out.grads  # argnums=0: the parameters' gradients
    return _outputs.pack(out.value, out.extra, grads, out.info, has_extra=True,
                     with_info=opts.with_info)

  return run


def apply_gradients(state: Any, *, grads: PyTree, weight: Any = None, **kwargs: Any) -> Any:
  """``state.apply_gradients`` for a ``TrainState`` whose ``tx`` is a :class:`jaxaccum.MultiSteps`.

  ``TrainState.apply_gradients`` cannot pass ``weight=`` to the optimizer and adds 1 to
  ``state.step`` on every call, so with :class:`jaxaccum.MultiSteps` its ``step`` counts
  micro-steps. This function passes ``weight`` (the number of items, e.g. real tokens,
  behind the micro-batch's mean gradient) to ``MultiSteps.update`` and advances
  ``state.step`` only when a window completes: ``state.step`` counts optimizer steps,
  equal to ``MultiStepsState.gradient_step`` and to the count that the inner optimizer's
  schedules see (optax schedules inside ``MultiSteps`` are called once per window).

  ``state.tx`` is a :class:`jaxaccum.MultiSteps` or its ``gradient_transformation()``
  (possibly inside :func:`optax.chain`); its state must hold exactly one
  :class:`jaxaccum.MultiStepsState`.

  Args:
    state: a ``flax.training.train_state.TrainState`` (or anything with ``step``,
      ``params``, ``tx``, ``opt_state`` and ``replace``).
    grads: the micro-batch's gradients.
    weight: optional, passed to ``MultiSteps.update(weight=...)``.
    **kwargs: other fields to replace, e.g. ``batch_stats=...``.

  Returns:
    The new state: parameters updated when the window completes (zero updates
    otherwise), ``opt_state`` advanced, ``step`` advanced by one per optimizer step.

  Raises:
    TypeError: ``state.opt_state`` holds no ``MultiStepsState`` or more than one.

  >>> import jax, jax.numpy as jnp, optax
  >>> from flax.training import train_state
  >>> import jaxaccum
  >>> tx = jaxaccum.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
  >>> state = train_state.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
  >>> state = jaxaccum.linen.apply_gradients(state, grads=jnp.array([4.0, 0.0]), weight=1)
  >>> int(state.step), state.params
  (0, Array([0., 0.], dtype=float32))
  >>> state = jaxaccum.linen.apply_gradients(state, grads=jnp.array([0.0, 4.0]), weight=3)
  >>> int(state.step), state.params  # -(1 * g1 + 3 * g2) / 4
  (1, Array([-1., -3.], dtype=float32))
  """
  old = _multisteps_state(state.opt_state)
  extra = {} if weight is None else {"weight": weight}
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params, **extra)
  new = _multisteps_state(opt_state)
  params = optax.apply_updates(state.params, updates)
  step = state.step + (new.gradient_step - old.gradient_step).astype(jnp.asarray(state.step).dtype)
  return state.replace(step=step, params=params, opt_state=opt_state, **kwargs)


def _multisteps_state(opt_state: PyTree) -> MultiStepsState:
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MultiStepsState))
           if isinstance(x, MultiStepsState)]
  if len(found) != 1:
    raise TypeError(
        "jaxaccum.linen.apply_gradients needs a train state whose tx is a jaxaccum.MultiSteps "
        "(or its gradient_transformation(), possibly inside optax.chain), so that its "
        f"opt_state holds exactly one MultiStepsState; found {len(found)}. For another "
        "optimizer use state.apply_gradients(grads=grads).")
  return found[0]
