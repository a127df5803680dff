"""Accumulation for Equinox models: ``filter_value_and_grad``, ``filter_grad``, ``filter_evaluate``.

This module imports :mod:`equinox` (the optional extra ``jaxaccum[eqx]``); ``import
jaxaccum`` does not (the submodule loads on first use of ``jaxaccum.eqx``).

The transforms mirror :func:`equinox.filter_value_and_grad` and :func:`equinox.filter_grad`:
the first argument of ``fun`` (usually an ``eqx.Module``) is split with
``eqx.partition(model, eqx.is_inexact_array)``; its floating and complex array leaves are
differentiated and everything else in it (activation functions, integer arrays, Python
values) is held static. The rest is :func:`jaxaccum.value_and_grad`, built once when the
transform is built, with its options. :func:`filter_evaluate` is the forward-only
counterpart, on :func:`jaxaccum.evaluate`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from jaxaccum import _transforms
from jaxaccum._core import _options, _validate

__all__ = ("filter_evaluate", "filter_grad", "filter_value_and_grad")


def filter_value_and_grad(
    fun: Callable[..., Any] | None = None, *, has_aux: bool = False, **options: Any
) -> Callable[..., Any]:
  """Like :func:`equinox.filter_value_and_grad`, accumulated over micro-batches.

  ``fun(model, batch, ...)`` returns the loss of one micro-batch. The returned function
  takes the same arguments with the full batch and returns ``(value, grads)``, or
  ``((value, aux), grads)`` with ``has_aux=True``, where ``grads`` has the structure of
  ``model`` with the gradient at each inexact array leaf and ``None`` elsewhere. Micro-batch
  ``i`` holds rows ``i, i + N, i + 2N, ...`` of each batch argument. Call it inside
  :func:`equinox.filter_jit`. As with equinox, it can be used as a decorator:
  ``@jaxaccum.eqx.filter_value_and_grad(num_micro_batches=4)``.

  Args:
    fun: the loss, ``fun(model, batch, ...)``; only its first argument is differentiated.
    has_aux: ``fun`` returns ``(value, aux)``; aux is reduced over the micro-batches as
      ``aux_reduce`` says.
    **options: the options of :func:`jaxaccum.value_and_grad` (the split,
      ``num_micro_batches`` or ``micro_batch_size``, is required), passed to it unchanged
      and meaning what they mean there, positions counted in ``fun``'s arguments (the
      model is 0, the batch 1 by default). The adapter sets ``argnums`` itself and refuses
      it. Equinox's usual arguments map onto the core's: an ``eqx.nn.State`` is named by
      ``state_argnums`` (``fun`` then returns ``(value, new_state)``), and a PRNG key by
      ``rng_argnums``, or by ``rng_argnames="key"`` for a ``key=`` keyword (micro-batch
      ``i`` gets ``fold_in(key, i)``).

  Returns:
    A function with ``fun``'s arguments returning what :func:`jaxaccum.value_and_grad`
    returns, with the gradients shaped like the model. It takes the core's call-time
    keyword ``active_micro_batches`` too.

  Raises:
    TypeError: ``argnums`` is given (equinox differentiates the first argument; put
      everything to differentiate there), or an option is wrong (see
      :func:`jaxaccum.value_and_grad`).

  >>> import equinox as eqx, jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> model = eqx.nn.Linear(3, 1, key=jax.random.key(0))
  >>> def loss_fn(model, x, y):
  ...   return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)
  >>> x, y = jnp.arange(24.0).reshape(8, 3) / 24, jnp.arange(8.0) / 8
  >>> step = eqx.filter_jit(jaxaccum.eqx.filter_value_and_grad(
  ...     loss_fn, num_micro_batches=4, batch_argnums=(1, 2)))
  >>> loss, grads = step(model, x, y)
  >>> ref_loss, ref_grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
  >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads.weight, ref_grads.weight))
  (True, True)
  """
  if fun is None:
    return functools.partial(filter_value_and_grad, has_aux=has_aux, **options)
  if "argnums" in options:
    raise TypeError(
        "jaxaccum.eqx.filter_value_and_grad takes no argnums= option: as in equinox, the "
        "inexact arrays of the first argument are differentiated. Put everything to "
        "differentiate in the first argument, e.g. fun((model, extra), batch).")
  _validate.check_callable(fun, "fun(model, batch, ...)")
  return _ValueAndGradWrapper(fun, has_aux, options)


class _Wrapper(_transforms.AdapterWrapper):
  """What :func:`filter_value_and_grad` and :func:`filter_evaluate` return (as equinox's
  ``_ValueAndGradWrapper``).

  It holds ``fun`` and the core transform, whose options are validated once, here. A call
  partitions the model with :attr:`filter_spec`; the core then runs a function built for
  that call, which closes over the model's static part and takes its arrays as argument 0
  (differentiated by :class:`_ValueAndGradWrapper`, passed whole by
  :class:`_EvaluateWrapper`).
  """

  adapter = "eqx"
  filter_spec: Callable[[Any], bool] = staticmethod(eqx.is_inexact_array)

  def __init__(self, fun: Callable[..., Any], has_aux: bool, options: dict[str, Any]):
    self._wrap(fun)  # first: it copies fun.__dict__ into this object
    self.fun, self.has_aux = fun, has_aux
    self.core = self._core(fun, has_aux, options)
    self.check_state = not self.core.options.roles.state_argnums

  def _core(self, fun: Callable[..., Any], has_aux: bool, options: dict[str, Any]) -> Any:
    raise NotImplementedError

  def __call__(self, model: Any, *args: Any, **kwargs: Any) -> Any:
    arrays, static = eqx.partition(model, self.filter_spec)
    return self.core.with_fun(self._inner(static))(arrays, *args, **kwargs)

  def _inner(self, static: Any) -> Callable[..., Any]:
    """``fun`` of the model's arrays, with this call's ``static`` part of the model."""

    @functools.wraps(self.fun)  # the core names arguments by fun's parameter names
    def inner(arrays, *args, **kwargs):
      out = self.fun(eqx.combine(arrays, static), *args, **kwargs)
      if self.check_state:
        _check_no_state(out, args, self.has_aux)
      return out

    return inner



class _ValueAndGradWrapper(_Wrapper):
  """:func:`filter_value_and_grad`'s: the model's inexact arrays differentiated."""

  name = "filter_value_and_grad"

  def _core(self, fun: Callable[..., Any], has_aux: bool, options: dict[str, Any]) -> Any:
    return _transforms.make_value_and_grad(fun, dict(options, argnums=0, has_aux=has_aux))


class _EvaluateWrapper(_Wrapper):
  """:func:`filter_evaluate`'s: the model's arrays (all of them: nothing is differentiated)
  passed whole to every micro-batch."""

  name = "filter_evaluate"
  filter_spec = staticmethod(eqx.is_array)

  def _core(self, fun: Callable[..., Any], has_aux: bool, options: dict[str, Any]) -> Any:
    return _transforms.make_evaluate(fun, dict(options, has_aux=has_aux))


def _check_no_state(out: Any, args: tuple, has_aux: bool) -> None:
  """An ``eqx.nn.State`` returned without ``state_argnums`` gets an error naming it."""
  is_state = lambda x: isinstance(x, eqx.nn.State)  # noqa: E731
  extra = out[1] if isinstance(out, (tuple, list)) and len(out) == 2 else None
  if not any(is_state(x) for x in jax.tree.leaves(extra, is_leaf=is_state)):
    return
  where = [j for j, a in enumerate(args, start=1) if is_state(a)]
  pos = f"state_argnums={where[0]}" if where else "state_argnums=<its position>"
  wants = "(value, (new_state, aux))" if has_aux else "(value, new_state)"
  raise TypeError(
      f"fun returned an eqx.nn.State, but state_argnums is not set: pass the position of the "
      f"state argument, {pos}, and return {wants}. The state is then threaded through the "
      "micro-batches (micro-batch i + 1 sees micro-batch i's) and returned updated.")


def filter_grad(
    fun: Callable[..., Any] | None = None, *, has_aux: bool = False, **options: Any
) -> Callable[..., Any]:
  """Like :func:`equinox.filter_grad`, accumulated over micro-batches.

  Arguments and options as :func:`filter_value_and_grad`. Returns a function giving
  ``grads``, or ``(grads, aux)`` with ``has_aux=True`` (or ``state_argnums``); with
  ``with_info=True`` it gives ``(grads_part, info)`` as :func:`jaxaccum.grad` does.

  >>> import equinox as eqx, jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
  >>> loss_fn = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
  >>> x = jnp.arange(8.0).reshape(4, 2)
  >>> grads = jaxaccum.eqx.filter_grad(loss_fn, micro_batch_size=1)(model, x)
  >>> ref = eqx.filter_grad(loss_fn)(model, x)
  >>> bool(jnp.allclose(grads.weight, ref.weight))
  True
  """
  if fun is None:
    return functools.partial(filter_grad, has_aux=has_aux, **options)
  vg = filter_value_and_grad(fun, has_aux=has_aux, **options)
  return _transforms.Grad(vg, has_extra=vg.core.options.has_extra,
                   with_info=vg.core.options.with_info)


def filter_evaluate(
    fun: Callable[..., Any] | None = None, *, has_aux: bool = False, **options: Any
) -> Callable[..., Any]:
  """:func:`jaxaccum.evaluate` for an Equinox model: ``fun(model, batch, ...)``, forward only.

  The forward-only counterpart of :func:`filter_value_and_grad`, with its argument layout:
  the model's array leaves are passed to every micro-batch as they are and everything
  else in it is held static; ``fun`` runs on one micro-batch at a time inside one
  ``lax.scan`` and its outputs are reduced as :func:`jaxaccum.evaluate` reduces them, so
  the result is ``fun`` on the full batch (``aux_reduce="concat"`` gives per-example rows
  in batch order). An ``eqx.nn.State`` is threaded through the micro-batches with
  ``state_argnums``, and a ``key=`` keyword folded per micro-batch with
  ``rng_argnames="key"``. Like equinox's transforms it can be used as a decorator.

  Args:
    fun: ``fun(model, batch, ...)``, returning a value as ``reduce`` says, or ``(value,
      aux)`` with ``has_aux=True`` (``(value, new_state)`` with ``state_argnums``).
    has_aux: ``fun`` returns ``(value, aux)``.
    **options: the options of :func:`jaxaccum.evaluate`, passed to it unchanged. Options
      about gradients (``argnums``, ``with_info``, ``remat``...) do not exist here: each
      is refused with an error naming it.

  Returns:
    A function with ``fun``'s arguments returning what :func:`jaxaccum.evaluate` returns.

  >>> import equinox as eqx, jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
  >>> def metrics(model, x):
  ...   out = jax.vmap(model)(x)
  ...   return jnp.mean(out ** 2), out
  >>> x = jnp.arange(24.0).reshape(8, 3) / 24
  >>> ev = eqx.filter_jit(jaxaccum.eqx.filter_evaluate(
  ...     metrics, num_micro_batches=4, has_aux=True, aux_reduce="concat"))
  >>> value, out = ev(model, x)
  >>> ref_value, ref_out = metrics(model, x)
  >>> bool(jnp.allclose(value, ref_value)), bool(jnp.allclose(out, ref_out))
  (True, True)
  """
  if fun is None:
    return functools.partial(filter_evaluate, has_aux=has_aux, **options)
  _options.refuse_gradient_options("jaxaccum.eqx.filter_evaluate", options,
                                "jaxaccum.eqx.filter_value_and_grad")
  _validate.check_callable(fun, "fun(model, batch, ...)")
  return _EvaluateWrapper(fun, has_aux, options)
