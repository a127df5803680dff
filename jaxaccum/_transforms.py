"""The transform objects every front end returns, below the public functions of ``_api``.

:class:`ValueAndGrad` holds a ``fun`` with its validated options
(:class:`jaxaccum._core._options.Options`; as equinox's ``filter_value_and_grad`` returns a
Module and flax's ``nnx.grad`` a wrapped function). A call runs the core
(:func:`jaxaccum._core._transform.accumulate`) or, under ``data_axis``, the data-parallel
driver (:func:`jaxaccum._parallel._data_parallel.data_parallel`), and returns what
:func:`jax.value_and_grad` would (:func:`jaxaccum._core._outputs.pack`). :class:`Grad` drops
the value; :class:`Evaluate` runs the same core with nothing differentiated.
:func:`make_value_and_grad` and :func:`make_evaluate` build them from a dict of options: the
public functions (``_api``, ``jaxaccum.dp``), the adapters, the planner and the coupled-loss
transform all build through them, so none of them imports the public API's module.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxaccum._core import _options, _transform
from jaxaccum._core._options import Options
from jaxaccum._core._outputs import pack
from jaxaccum._parallel import _axes, _data_parallel


def make_value_and_grad(fun: Callable[..., Any], options: dict[str, Any], *,
                        where: str = "value_and_grad", stacklevel: int = 4) -> ValueAndGrad:
  """``jaxaccum.value_and_grad(fun, **options)``, as every front end builds it. A
  ``per_example`` transform (or the deprecated ``per_example_transform``) loads the
  per-example wing, which makes it the options' micro-batch rule."""
  given = {k: v for k, v in options.items() if k in _options.DEFAULTS}
  old = {k: v for k, v in options.items() if k not in _options.DEFAULTS}
  attach = None
  if given.get("per_example") is not None or old.get("per_example_transform") is not None:
    from jaxaccum._per_example import _rule  # the per-example wing, loaded on first use

    attach = _rule.attach
  return ValueAndGrad(_options.make_options(fun, given, deprecated=old, where=where,
                                            attach_per_example=attach, parallel=_axes.KEYWORDS,
                                            stacklevel=stacklevel))


def make_evaluate(fun: Callable[..., Any], options: dict[str, Any], *,
                  stacklevel: int = 4) -> Evaluate:
  """``jaxaccum.evaluate(fun, **options)``, for the adapters' ``evaluate``."""
  given = {k: v for k, v in options.items()
           if k in _options.DEFAULTS and k not in _options.GRADIENT_OPTIONS}
  old = {k: v for k, v in options.items() if k not in given}
  return Evaluate(_options.make_options(fun, given, deprecated=old, evaluate=True,
                                        where="evaluate", stacklevel=stacklevel,
                                        parallel=_axes.KEYWORDS))


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
    run = _transform.accumulate if opts.parallel is None else _data_parallel.data_parallel
    with jax.named_scope(_transform.call_scope(self.name)):
      return run(opts, args, kwargs, active)

  def __repr__(self) -> str:
    return f"<jaxaccum.{self.name} of {self.options.fun!r}>"

  def with_fun(self, fun: Callable[..., Any]) -> Any:
    """The same validated options around another ``fun``: the adapters build their inner
    function per call (it closes over the call's static parts) and run it through this."""
    return type(self)(dataclasses.replace(self.options, fun=fun))


class Evaluate(_Transform):
  """What :func:`jaxaccum.evaluate` returns: ``fun`` run per micro-batch, with its validated
  options (nothing differentiated).

  Calling it takes ``fun``'s arguments (and ``active_micro_batches``) and returns what
  ``fun`` returns on the full batch.
  """

  name = "evaluate"

  def __call__(self, *args: Any, active_micro_batches: Any = None, **kwargs: Any) -> Any:
    value, extra, _, _ = self.run(args, kwargs, active_micro_batches)
    return (value, extra) if self.options.has_extra else value


class ValueAndGrad(_Transform):
  """What :func:`jaxaccum.value_and_grad` returns: ``fun`` accumulated, with its validated
  options.

  Calling it takes ``fun``'s arguments (and ``active_micro_batches``) and returns
  ``(value, grads)`` as :func:`jaxaccum.value_and_grad` documents.
  """

  name = "value_and_grad"

  def __call__(self, *args: Any, active_micro_batches: Any = None, **kwargs: Any) -> Any:
    opts = self.options
    value, extra, grads, info = self.run(args, kwargs, active_micro_batches)
    grads = grads[0] if opts.roles.argnums_is_int else grads
    return pack(value, extra, grads, info, has_extra=opts.has_extra, with_info=opts.with_info)


class Grad:
  """The ``grad`` of a function that returns :func:`jaxaccum._core._outputs.pack`'s output:
  ``grads``, or ``(grads, extra)`` with ``has_extra``; with ``with_info``,
  ``(grads_part, info)``."""

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


class AdapterWrapper:
  """The base of the adapters' transformed functions (:mod:`jaxaccum.nnx`,
  :mod:`jaxaccum.eqx`): ``fun``'s metadata copied onto the object (:meth:`_wrap`, to call
  first: it copies ``fun.__dict__``), a repr naming the adapter's function, and binding as a
  method (the instance is ``fun``'s first argument, as for a plain function)."""

  adapter = ""  # the adapter's module, "nnx" or "eqx"
  name = ""  # the public function, in messages
  fun: Callable[..., Any]

  def _wrap(self, fun: Callable[..., Any]) -> None:
    functools.update_wrapper(self, fun)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError

  def __repr__(self) -> str:
    return f"<jaxaccum.{self.adapter}.{self.name} of {self.fun!r}>"

  def __get__(self, instance: Any, owner: Any = None) -> Any:
    return self if instance is None else functools.partial(self, instance)
