"""Accumulation for Flax NNX models: ``jaxaccum.nnx.value_and_grad``, ``grad``, ``evaluate``.

This module imports :mod:`flax.nnx`; ``import jaxaccum`` does not (the submodule loads on
first use of ``jaxaccum.nnx``).

The transforms mirror :func:`flax.nnx.value_and_grad` for a loss ``fun(model, batch, ...)``
and run on top of :func:`jaxaccum.value_and_grad`, built once when the transform is built:

1. the model (and every NNX object found in the other arguments, at any depth) is split
   with ``nnx.split`` into the model's ``wrt`` variables and everything else (BatchNorm
   ``BatchStat``, the keys and counters of ``nnx.Rngs`` streams, other ``Variable``\\ s, and
   all variables of the NNX objects in other arguments);
2. one ``lax.scan`` runs ``fun`` on each micro-batch, differentiating the ``wrt`` variables
   and threading the rest from micro-batch ``i`` into micro-batch ``i + 1`` (a value that
   ``fun`` writes to a ``wrt`` variable too, as ``nnx.value_and_grad`` keeps it);
3. the NNX objects are updated in place with ``nnx.update`` and the gradients come back as
   the ``wrt`` state, ready for ``nnx.Optimizer(model, tx, wrt=...).update(model, grads)``.

So **Dropout** (any ``nnx.Rngs`` stream) draws a fresh mask per micro-batch (and per
example under ``per_example=``, which folds the example's index into the keys), and
**BatchNorm** in training mode normalises each micro-batch with its own statistics (a
"ghost batch") and updates its running averages once per micro-batch: its result differs
from one full-batch step (in eval mode, and for LayerNorm, GroupNorm and RMSNorm, it is the
full batch's). See "State: BatchNorm, Dropout, nnx.Rngs, nested objects" in the Flax guide.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx

from jaxaccum import _transforms
from jaxaccum._core import _options, _outputs, _roles, _split, _validate

__all__ = ("evaluate", "grad", "value_and_grad")

# Options that the adapter sets itself: the model's wrt variables are differentiated
# (argnums) and its other variables threaded (state_argnums).
_RESERVED = {
    "argnums": "the model's variables chosen by wrt= are differentiated; pass wrt=nnx.Param "
               "(or another NNX filter) instead",
    "state_argnums": "the model's other variables (and those of NNX objects in the other "
                     "arguments) are threaded through the micro-batches already",
}


def _is_node(x: Any) -> bool:
  return isinstance(x, (nnx.Pytree, nnx.Variable))


def _has_node(tree: Any) -> bool:
  return any(_is_node(x) for x in jax.tree.leaves(tree, is_leaf=_is_node))


def _param_names(fun: Any) -> list[str]:
  """Names of ``fun``'s positional parameters, for messages; empty if unreadable."""
  try:
    params = inspect.signature(fun).parameters.values()
  except (TypeError, ValueError):
    return []
  return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _ordinal(j: int) -> str:
  words = ("first", "second", "third", "fourth", "fifth", "sixth")
  return words[j] if j < len(words) else f"{j + 1}th"


def _arg_label(names: list[str], j: int) -> str:
  return names[j] if j < len(names) else f"args[{j}]"


def _inner_signature(fun: Any, positional: list[str]) -> inspect.Signature | None:
  """``fun``'s signature with the threaded variables added after its ``positional``
  parameters (:func:`_param_names`).

  The core names arguments in its messages by position and by the parameter names of the
  function it transforms; the threaded variables are passed last, so both stay ``fun``'s
  (``argument 1 ('batch')``).
  """
  if not positional:  # none, or an unreadable signature
    return None
  sig = inspect.signature(fun)
  params = list(sig.parameters.values())
  k = len(positional)
  extra = "nnx_variables"
  while extra in sig.parameters:
    extra += "_"
  threaded = inspect.Parameter(extra, params[k - 1].kind)
  try:
    return sig.replace(parameters=[*params[:k], threaded, *params[k:]])
  except ValueError:
    return None


class _Slots(NamedTuple):
  """Where the NNX objects of one argument were: the argument's treedef and node indices."""

  treedef: Any
  where: tuple[int, ...]  # leaf positions that held NNX objects
  first: int  # index of the first of them among the threaded nodes


class _Hole:
  """Stands where an NNX object was in an argument handed to the core (a static leaf)."""

  def __repr__(self) -> str:
    return "<NNX object, threaded>"


_HOLE = _Hole()


def _strip(tree: Any, first: int, name: str) -> tuple[Any, _Slots | None, list[Any], list[str]]:
  """Replaces the NNX objects in ``tree`` by holes; returns what :func:`_fill` needs, the
  objects and a label for each (``name`` and its path, e.g. ``extra['teacher']``)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_node)
  index = tuple(k for k, (_, x) in enumerate(flat) if _is_node(x))
  if not index:
    return tree, None, [], []
  nodes = [flat[k][1] for k in index]
  labels = [name + jax.tree_util.keystr(flat[k][0]) for k in index]
  leaves = [_HOLE if k in index else x for k, (_, x) in enumerate(flat)]
  return jax.tree.unflatten(treedef, leaves), _Slots(treedef, index, first), nodes, labels


def _fill(stripped: Any, slots: _Slots | None, nodes: Sequence[Any]) -> Any:
  """Inverse of :func:`_strip`, with ``nodes`` the (merged) threaded objects."""
  if slots is None:
    return stripped
  leaves = jax.tree.leaves(stripped)
  for k, i in enumerate(slots.where):
    leaves[i] = nodes[slots.first + k]
  return jax.tree.unflatten(slots.treedef, leaves)


@jax.custom_jvp
def _rebase(x: Any, at: Any) -> Any:
  """``at``'s value with ``x``'s derivative (an identity in ``x``).

  Micro-batch ``i`` differentiates the ``wrt`` variables (the core's argument 0, the same
  in every micro-batch) at the values that micro-batch ``i - 1`` wrote to them (carried in
  the threaded state), as one ``nnx.value_and_grad`` per micro-batch would. Where nothing
  writes, ``at`` is ``x``'s value, carried through the scan unchanged.
  """
  del x
  return at


@_rebase.defjvp
def _rebase_jvp(primals: tuple, tangents: tuple) -> tuple:
  return primals[1], tangents[0]


class _Call(NamedTuple):
  """What one call closes over in the function the core runs (never traced itself)."""

  graphdef: Any
  old: dict[tuple, Any]  # path -> Variable, of every split variable, for the checks
  slots: dict[int | str, _Slots]  # positional index or keyword name -> slots
  labels: tuple[str, ...]  # a name for each threaded node, for messages
  written: set[int]  # leaves of the wrt state that fun wrote (filled while tracing)


def _node_path(labels: Sequence[str], path: Sequence[Any]) -> str:
  """``(1, 'block', 0, 'ema')`` as ``extra['teacher'].block[0].ema`` (node 1's label)."""
  attrs = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[1:])
  return str(labels[path[0]]) + attrs


def _check_variables(call: _Call, new_graphdef: Any, *new_states: Any) -> None:
  """The variables after ``fun`` must match those before, path by path."""
  new = {tuple(p): v for s in new_states for p, v in nnx.to_flat_state(s)}
  old = call.old
  added = [p for p in new if p not in old]
  removed = [p for p in old if p not in new]
  if added or removed or new_graphdef != call.graphdef:
    what = (f"added {_node_path(call.labels, added[0])}" if added else
            f"removed {_node_path(call.labels, removed[0])}" if removed else
            "added, removed or replaced a Variable or submodule")
    raise ValueError(
        f"fun changed the structure of the model ({what}). Under accumulation fun runs once "
        "per micro-batch and may only update existing Variables' values; create new state "
        "before the step.")
  for p, v_old in old.items():
    v_new = new[p]
    if type(v_new) is not type(v_old):
      raise ValueError(
          f"fun replaced {_node_path(call.labels, p)}, a {type(v_old).__name__}, by a "
          f"{type(v_new).__name__}. Assign to its value instead (var[...] = new_value).")
    for a, b in zip(jax.tree.leaves(v_old), jax.tree.leaves(v_new), strict=True):
      if a.shape != b.shape or a.dtype != b.dtype:
        raise TypeError(
            f"fun changed {_node_path(call.labels, p)} ({type(v_old).__name__}) from "
            f"{_split.describe(a)} to {_split.describe(b)}. Its value is carried from one "
            "micro-batch into the next, so it must keep its shape and dtype: cast the new "
            f"value back, e.g. var[...] = new_value.astype({a.dtype}).")


def _check_not_model(name: str, positions: Sequence[int], names: list[str]) -> None:
  """Argument 0 is the model: it is threaded, never split nor folded."""
  if 0 in positions:
    raise ValueError(
        f"{name} names argument 0 ({_arg_label(names, 0)}), which is the model. Point it "
        "at the arguments after the model.")


def value_and_grad(
    fun: Callable[..., Any],
    *,
    wrt: Any = nnx.Param,
    batch_argnums: int | Sequence[int] | None = _options.BATCH_ARGNUMS,
    batch_argnames: str | Sequence[str] | None = None,
    rng_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    **options: Any,
) -> Callable[..., Any]:
  """Like :func:`flax.nnx.value_and_grad`, accumulated over micro-batches in one scan.

  ``fun(model, batch, ...)`` takes an NNX model and one micro-batch. The returned
  function takes the same arguments with the full batch, returns the full-batch value and
  the gradients with respect to the model's ``wrt`` variables, and updates the model's
  other state (BatchNorm statistics, RNG stream counters, any ``Variable`` that ``fun``
  writes, a ``wrt`` variable included) in place, as :func:`flax.nnx.value_and_grad` does.
  Micro-batch ``i`` holds rows ``i, i + N, i + 2N, ...`` of every leaf of the batch arguments
  and sees the state (and ``wrt`` values) left by micro-batch ``i - 1``. Call it inside
  :func:`flax.nnx.jit`; ``fun`` is traced a constant number of times, whatever ``N`` is,
  and a second step with the same shapes does not retrace.

  Every NNX object in the arguments that are not split, at any depth (an ``nnx.Rngs``
  passed at call time, ``extra["teacher"]``, a module passed by keyword), is threaded
  through the micro-batches like the model's own non-``wrt`` state and updated in place;
  its variables are not differentiated. Other arguments are passed unchanged to every
  micro-batch, except PRNG keys named by ``rng_argnums``.

  Args:
    fun: the loss, ``fun(model, batch, ...)``. It returns what ``reduce`` asks for, or
      ``(value, aux)`` with ``has_aux=True``.
    wrt: an NNX filter choosing the differentiated variables of ``model``, as in
      :class:`flax.nnx.DiffState` and ``nnx.Optimizer(..., wrt=...)``. Path filters see
      paths from the model's root, as with :func:`flax.nnx.value_and_grad`. Default
      ``nnx.Param``.
    batch_argnums: position(s) in ``fun``'s arguments (the model is 0) of the batch
      arguments; ``loss_fn(model, x, y)`` takes ``batch_argnums=(1, 2)``. Default ``1``;
      with ``batch_argnames`` the default applies when argument 1 is passed, and
      ``batch_argnums=()`` names none.
    batch_argnames: name(s) of keyword arguments that are split like ``batch_argnums``,
      e.g. ``batch_argnames="labels"`` for ``fun(model, x, labels=y)``.
    rng_argnums: position(s) (1 or more) of plain PRNG keys; micro-batch ``i`` gets
      ``jax.random.fold_in(key, i)``. Not needed for ``nnx.Rngs``.
    has_aux: ``fun`` returns ``(value, aux)``; aux is reduced over the micro-batches as
      ``aux_reduce`` says.
    **options: the other options of :func:`jaxaccum.value_and_grad` (the split,
      ``num_micro_batches`` or ``micro_batch_size``, is required), passed to it unchanged
      and meaning what they mean there, positions counted in ``fun``'s arguments. The
      adapter sets ``argnums`` and ``state_argnums`` itself and refuses them. Under
      ``data_axis`` the model's other state is threaded per shard and combined at the end
      (floating leaves averaged, counters the maximum, keys shard 0's), so ``nnx.Rngs``
      streams draw the same masks on every shard.

  Returns:
    A function with ``fun``'s arguments returning ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux=True``, where ``grads`` is an
    :class:`flax.nnx.State` shaped like ``nnx.state(model, wrt)``; with
    ``with_info=True`` a third element, the :class:`jaxaccum.AccumInfo`. It takes the
    core's call-time keyword ``active_micro_batches`` too.

  Raises:
    TypeError: ``fun`` cannot take the model and its positional batch arguments, the
      first argument is not an NNX object, a batch argument holds an NNX object, ``fun``
      changed the shape or dtype of a variable (named by its path, e.g. ``model.ema``), or
      ``argnums``/``state_argnums`` is given.
    ValueError: the model has no variables matching ``wrt``, a batch argument is the
      model, a batch argument is missing from the call (resolved as
      :func:`jaxaccum.value_and_grad` resolves it; the message names the usual causes: a
      loss that closes over the batch, a batch passed by keyword), or ``fun`` changed the
      model's structure. Other options and batches are checked by
      :func:`jaxaccum.value_and_grad`, whose messages name ``fun``'s parameters.

  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import jaxaccum
  >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  >>> def loss_fn(model, x, y):
  ...   return jnp.mean((model(x)[:, 0] - y) ** 2)
  >>> @nnx.jit
  ... def train_step(model, optimizer, x, y):
  ...   step = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=4, batch_argnums=(1, 2))
  ...   loss, grads = step(model, x, y)
  ...   optimizer.update(model, grads)
  ...   return loss
  >>> x, y = jnp.arange(24.0).reshape(8, 3) / 24, jnp.arange(8.0) / 8
  >>> ref_loss, ref_grads = nnx.value_and_grad(loss_fn)(model, x, y)
  >>> loss = train_step(model, optimizer, x, y)
  >>> bool(jnp.allclose(loss, ref_loss))
  True
  """
  return _ValueAndGradWrapper(fun, wrt, batch_argnums, batch_argnames, rng_argnums, has_aux,
                              options)


def _wrt_predicate(wrt: Any) -> Callable[[Any, Any], bool]:
  try:
    return nnx.filterlib.to_predicate(wrt)
  except (TypeError, ValueError):
    raise TypeError(
        f"wrt must be an NNX filter such as nnx.Param, a Variable type, a tuple of filters or "
        f"nnx.All(...), got wrt={wrt!r}.") from None


class _Threaded(NamedTuple):
  """One call's NNX objects, threaded, and its arguments with holes where they were."""

  nodes: tuple[Any, ...]  # the model first, then the NNX objects of the other arguments
  labels: tuple[str, ...]
  args: tuple[Any, ...]  # the positional arguments after the model
  kwargs: dict[str, Any]
  slots: dict[int | str, _Slots]  # positional index or keyword name -> slots


def _thread(names: list[str], args: tuple, kwargs: dict[str, Any], split: tuple[int, ...]
            ) -> _Threaded:
  """Takes every NNX object out of the arguments not in ``split`` (batch and key arguments)."""
  nodes: list[Any] = [args[0]]
  labels: list[str] = [_arg_label(names, 0)]
  all_slots: dict[int | str, _Slots] = {}

  def strip(tree: Any, key: int | str, name: str) -> Any:
    stripped, slots, found, found_labels = _strip(tree, len(nodes), name)
    if slots is not None:
      all_slots[key] = slots
      nodes.extend(found)
      labels.extend(found_labels)
    return stripped

  core_args = tuple(a if j in split else strip(a, j, _arg_label(names, j))
                    for j, a in enumerate(args[1:], start=1))
  core_kwargs = {name: strip(v, name, name) for name, v in kwargs.items()}
  return _Threaded(tuple(nodes), tuple(labels), core_args, core_kwargs, all_slots)


class _Wrapper(_transforms.AdapterWrapper):
  """The steps that :func:`value_and_grad` and :func:`evaluate` share.

  It holds ``fun``, the checked argument roles and the core transform, whose options are
  validated once, here. A call checks its arguments (:meth:`_check_call`), splits the NNX
  objects into the model's ``wrt`` state (the core's argument 0) and the threaded state
  (the core's last argument: the other variables and the values the ``wrt`` variables
  hold), runs the core on a function built for that call (:meth:`_inner`), and writes the
  threaded state back (:meth:`_update`). The subclasses choose the core (:meth:`_core`)
  and what a call returns (:meth:`_write_back`).
  """

  adapter = "nnx"

  def __init__(self, fun: Callable[..., Any], wrt: Any, batch_argnums: Any, batch_argnames: Any,
               rng_argnums: Any, has_aux: bool, options: dict[str, Any]):
    self._wrap(fun)  # first: it copies fun.__dict__ into this object
    for name, why in _RESERVED.items():
      if name in options:
        raise TypeError(f"jaxaccum.nnx.{self.name} takes no {name}= option: {why}.")
    _validate.check_callable(fun, "fun(model, batch, ...)")
    self.fun, self.wrt, self.has_aux = fun, wrt, has_aux
    self.names, self.fun_name = _param_names(fun), getattr(fun, "__name__", "fun")
    self.default_batch = batch_argnums is None or batch_argnums is _options.BATCH_ARGNUMS
    self.wrt_pred = _wrt_predicate(wrt)
    for name, value in (("batch_argnums", batch_argnums), ("rng_argnums", rng_argnums)):
      _check_not_model(name, _roles.normalize_argnums(name, value, allow_empty=True),
                       self.names)
    # The core validates the options in fun's positions, self.options resolves each call's
    # roles there (without argnums, so that a position landing on the model gets the model's
    # message), and the core runs with the threaded state appended after fun's arguments.
    core = self._core(fun, dict(
        options, has_aux=has_aux, batch_argnames=batch_argnames, rng_argnums=rng_argnums,
        batch_argnums=_options.BATCH_ARGNUMS if self.default_batch else batch_argnums))
    self.options = dataclasses.replace(
        core.options, roles=dataclasses.replace(core.options.roles, argnums=()))
    self.core = type(core)(core.options.with_appended_state())
    self._check_signature()
    self.signature = _inner_signature(fun, self.names)

  def _check_signature(self) -> None:
    """``fun`` takes the model and the positional batch and key arguments."""
    opts = self.options
    roles = opts.roles
    positions = (() if roles.batch_optional else roles.batch_argnums) + roles.rng_argnums
    needed = 1 + max((j for j in positions if j >= 0), default=0)
    found = _roles.short_signature(self.fun, needed)
    if found:
      raise TypeError(
          f"fun must take the model and the batch as its first "
          f"{'two' if needed == 2 else needed} positional arguments, fun(model, batch, ...), "
          f"but {found}. If fun closes over the batch (def loss_fn(model): ... batch ...), it "
          "cannot be split: take it as an argument, fun(model, batch), and call the "
          "accumulated function with the full batch. Pack the inputs and targets into one "
          "batch pytree such as (x, y), or name keyword batch arguments with "
          "batch_argnames=('batch',).")

  def _core(self, fun: Callable[..., Any], options: dict[str, Any]) -> Any:
    raise NotImplementedError


  def model_pred(self, path: Sequence[Any], value: Any) -> bool:
    """The ``wrt`` filter on the threaded nodes: node 0 is the model, whose root the user's
    filter sees paths from."""
    return bool(path) and path[0] == 0 and self.wrt_pred(tuple(path[1:]), value)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    split = self._check_call(args, kwargs)
    threaded = _thread(self.names, args, kwargs, split)
    graphdef, diff, rest = nnx.split(threaded.nodes, self.model_pred, ...)
    self._check_wrt(args[0], diff)
    old = {tuple(p): v for s in (diff, rest) for p, v in nnx.to_flat_state(s)}
    call = _Call(graphdef, old, threaded.slots, threaded.labels, set())
    core = self.core.with_fun(self._inner(call))
    out = core(diff, *threaded.args, (rest, diff), **threaded.kwargs)
    return self._write_back(call, threaded.nodes, out)

  def _check_wrt(self, model: Any, diff: Any) -> None:
    """Checks the model's ``wrt`` state; any state will do where nothing is differentiated."""

  def _check_call(self, args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...]:
    """Checks the model and the split arguments; returns the batch and key positions."""
    if not args:
      raise TypeError(
          f"the accumulated {self.fun_name} must be called with the model as its first "
          "positional argument, fun(model, batch, ...); got no positional arguments.")
    if not isinstance(args[0], nnx.Pytree):
      raise TypeError(
          f"the first argument ({_arg_label(self.names, 0)}) must be an NNX object such as "
          f"an nnx.Module, got {_split.describe(args[0])}. For plain pytrees of parameters "
          f"use jaxaccum.{self.name}.")
    roles = self.options.roles.resolve(len(args), kwargs)  # the core's resolver, in fun's positions
    _check_not_model("batch_argnums", roles.batch, self.names)
    _check_not_model("rng_argnums", roles.rng, self.names)
    batch_pos, rng_pos = roles.batch, roles.rng
    for j in batch_pos + rng_pos:
      if _has_node(args[j]):
        _raise_node_in_batch(args, j, "batch_argnums" if j in batch_pos else "rng_argnums",
                             self.default_batch, self.names)
    for name in roles.batch_names:
      if name in kwargs and _has_node(kwargs[name]):
        raise TypeError(
            f"batch_argnames names {name!r}, which holds an NNX object; NNX objects are "
            f"threaded through the micro-batches, never split: drop {name!r} from "
            "batch_argnames.")
    return batch_pos + rng_pos

  def _inner(self, call: _Call) -> Callable[..., Any]:
    """The function the core runs for this call: ``inner(diff, *args, (rest, at), **kw)``,
    named like ``fun`` and with its signature (the threaded state added), for messages."""

    def inner(diff, *args, **kwargs):
      return self._micro_batch(call, diff, args, kwargs)

    if self.signature is not None:
      inner.__signature__ = self.signature  # type: ignore[attr-defined]
    inner.__name__ = self.fun_name
    inner.__qualname__ = getattr(self.fun, "__qualname__", inner.__name__)
    return inner

  def _micro_batch(self, call: _Call, diff: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``fun`` on one micro-batch, on the NNX objects rebuilt from ``diff`` and the state."""
    args, (rest, at) = args[:-1], args[-1]
    # Fresh Variable objects, owned by this trace, so that fun may write to them.
    seen = jax.tree.map(_rebase, diff, at)
    rest = jax.tree.map(lambda x: x, rest)
    # The merged Variables are seen's own, and fun may write to them: note what they hold.
    given = [tuple(jax.tree.leaves(v)) for _, v in nnx.to_flat_state(seen)]
    nodes = nnx.merge(call.graphdef, seen, rest)
    call_args = [nodes[0]] + [_fill(a, call.slots.get(j), nodes)
                              for j, a in enumerate(args, start=1)]
    call_kwargs = {name: _fill(v, call.slots.get(name), nodes) for name, v in kwargs.items()}
    out = self.fun(*call_args, **call_kwargs)
    if self.has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
          f"fun must return (value, aux) because has_aux=True, got {_split.describe(out)}.")
    value, aux = out if self.has_aux else (out, None)
    new_graphdef, new_diff, new_rest = nnx.split(nodes, self.model_pred, ...)
    _check_variables(call, new_graphdef, new_diff, new_rest)
    state = (new_rest, _carry_writes(call, given, new_diff, at))
    return (value, (state, aux)) if self.has_aux else (value, state)

  def _write_back(self, call: _Call, nodes: tuple, out: Any) -> Any:
    raise NotImplementedError

  def _update(self, call: _Call, nodes: tuple, extra: Any) -> Any:
    """Updates the NNX objects in place from the core's threaded state; returns the aux."""
    (new_rest, new_at), aux = extra if self.has_aux else (extra, None)
    nnx.update(nodes, new_rest)
    if call.written:
      flat = list(nnx.to_flat_state(new_at))
      nnx.update(nodes, nnx.from_flat_state([flat[k] for k in sorted(call.written)]))
    return aux


class _ValueAndGradWrapper(_Wrapper):
  """What :func:`value_and_grad` returns (as flax's ``nnx.value_and_grad`` wraps ``fun``):
  the core's :func:`jaxaccum.value_and_grad`, differentiating the ``wrt`` state."""

  name = "value_and_grad"

  def _core(self, fun: Callable[..., Any], options: dict[str, Any]) -> Any:
    return _transforms.make_value_and_grad(fun, dict(options, argnums=0))

  def _check_wrt(self, model: Any, diff: Any) -> None:
    if not jax.tree.leaves(diff):
      raise ValueError(
          f"the model {type(model).__name__} has no variables matching wrt={self.wrt!r}, "
          "so there is nothing to differentiate. Pass the filter of the variables to train, "
          "e.g. wrt=nnx.Param, and check that the model was built with them.")

  def _write_back(self, call: _Call, nodes: tuple, out: tuple) -> Any:
    """Updates the NNX objects in place and returns the core's output without the state."""
    (value, extra), grads, *info = out
    aux = self._update(call, nodes, extra)
    return _outputs.pack(value, aux, grads[0], info[0] if info else None, has_extra=self.has_aux,
                     with_info=bool(info))


class _EvaluateWrapper(_Wrapper):
  """What :func:`evaluate` returns: the core's :func:`jaxaccum.evaluate`, the ``nnx.Param``
  state passed whole to every micro-batch and the other variables threaded."""

  name = "evaluate"

  def _core(self, fun: Callable[..., Any], options: dict[str, Any]) -> Any:
    return _transforms.make_evaluate(fun, options)

  def _write_back(self, call: _Call, nodes: tuple, out: tuple) -> Any:
    value, extra = out
    aux = self._update(call, nodes, extra)
    return (value, aux) if self.has_aux else value


def _carry_writes(call: _Call, given: list[tuple], new_diff: Any, at: Any) -> Any:
  """The ``wrt`` values for the next micro-batch: what ``fun`` wrote, else ``at`` itself.

  A variable is written when its value after ``fun`` is another array than the one it was
  given (``given``: per ``wrt`` variable, the leaves that ``fun`` was called on); its index
  is recorded in ``call.written`` so that the call writes it back. An unwritten value is
  ``at`` itself, so that the scan's carry passes it through unchanged (and
  :func:`jax.lax.scan` moves it out of the loop).
  """
  flat_new, flat_at = list(nnx.to_flat_state(new_diff)), list(nnx.to_flat_state(at))
  out = []
  for k, ((path, v_new), (_, v_at), leaves) in enumerate(
      zip(flat_new, flat_at, given, strict=True)):
    if any(a is not b for a, b in zip(jax.tree.leaves(v_new), leaves, strict=True)):
      call.written.add(k)
      out.append((path, v_new))
    else:
      out.append((path, v_at))
  return nnx.from_flat_state(out)


def _raise_node_in_batch(args: tuple, j: int, role: str, default: bool, names: list[str]):
  what = f"the {_ordinal(j)} argument ({_arg_label(names, j)})"
  node = type(args[j]).__name__
  if default and role == "batch_argnums":
    raise TypeError(
        f"{what} is the batch by default (batch_argnums=1), but it holds the NNX object "
        f"{node}, which cannot be split. If fun closes over the batch (def loss_fn(model, "
        "...): ... batch ...), take it as an argument instead, fun(model, batch, ...), and "
        "call the accumulated function with the full batch; if the batch is at another "
        "position or passed by keyword, name it with batch_argnums or batch_argnames.")
  raise TypeError(
      f"{what}, named by {role}, must be a pytree of arrays, got the NNX object {node} in "
      "it. NNX objects are threaded through the micro-batches, never split: call it as "
      f"fun(model, batch, ...), or drop the argument from {role}.")


def grad(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
  """Like :func:`flax.nnx.grad`, accumulated over micro-batches.

  Arguments and options as :func:`value_and_grad`. Returns a function giving ``grads``, or
  ``(grads, aux)`` with ``has_aux=True``; with ``with_info=True`` it gives
  ``(grads_part, info)`` as :func:`jaxaccum.grad` does. The model's non-differentiated
  state is updated in place.

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
  return _transforms.Grad(vg, has_extra=vg.has_aux, with_info=vg.core.options.with_info)


def evaluate(
    fun: Callable[..., Any],
    *,
    batch_argnums: int | Sequence[int] | None = _options.BATCH_ARGNUMS,
    batch_argnames: str | Sequence[str] | None = None,
    rng_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    **options: Any,
) -> Callable[..., Any]:
  """:func:`jaxaccum.evaluate` for an NNX model: ``fun(model, batch, ...)``, forward only.

  The forward-only counterpart of :func:`value_and_grad`, with its argument layout and its
  state rules, in one ``lax.scan``: the model's ``nnx.Param`` variables are passed to every
  micro-batch as they are; its other variables (and any ``Variable`` that ``fun`` writes, a
  ``Param`` included), and those of the NNX objects in the other arguments, are threaded
  from micro-batch ``i`` into ``i + 1`` and written back in place. The value (and aux) is
  reduced as :func:`jaxaccum.evaluate` reduces it, so for a model in eval mode (after
  ``model.eval()``) the result is ``fun`` on the full batch; in train mode each micro-batch
  draws its own dropout masks and normalises with its own batch statistics.

  Args:
    fun: ``fun(model, batch, ...)``, returning a value as ``reduce`` says, or ``(value,
      aux)`` with ``has_aux=True``.
    batch_argnums: as for :func:`value_and_grad` (default: argument 1).
    batch_argnames: as for :func:`value_and_grad`.
    rng_argnums: as for :func:`value_and_grad`.
    has_aux: ``fun`` returns ``(value, aux)``.
    **options: the other options of :func:`jaxaccum.evaluate`, passed to it unchanged.
      ``state_argnums`` is set by the adapter (the model's variables are the state), and
      options about gradients (``wrt``, ``argnums``, ``with_info``, ``remat``...) do not
      exist here: each is refused with an error naming it.

  Returns:
    A function with ``fun``'s arguments returning ``value``, or ``(value, aux)`` with
    ``has_aux=True``. It takes the core's call-time keyword ``active_micro_batches`` too.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import jaxaccum
  >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  >>> def metrics(model, x):
  ...   out = model(x)
  ...   return jnp.mean(out ** 2), out
  >>> x = jnp.arange(24.0).reshape(8, 3) / 24
  >>> ev = nnx.jit(jaxaccum.nnx.evaluate(metrics, num_micro_batches=4, has_aux=True,
  ...                                    aux_reduce="concat"))
  >>> value, out = ev(model, x)
  >>> ref_value, ref_out = metrics(model, x)
  >>> bool(jnp.allclose(value, ref_value)), bool(jnp.allclose(out, ref_out))
  (True, True)
  """
  if "wrt" in options:
    raise TypeError(
        "jaxaccum.nnx.evaluate takes no wrt= option: nothing is differentiated. The model's "
        "nnx.Param variables are passed to every micro-batch and its other variables "
        "threaded; use jaxaccum.nnx.value_and_grad(wrt=...) for gradients.")
  _options.refuse_gradient_options("jaxaccum.nnx.evaluate", options,
                                "jaxaccum.nnx.value_and_grad")
  return _EvaluateWrapper(fun, nnx.Param, batch_argnums, batch_argnames, rng_argnums, has_aux,
                          options)
