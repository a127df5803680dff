"""Type aliases shared by jaxaccum's modules (private: import them from here, not from jaxaccum).

These follow what optax (``optax.Params``) and chex (``chex.ArrayTree``) do: a pytree is typed
with a small alias rather than a structural type that a checker could not follow through
``jax.tree.map``.
"""

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, TypeAlias

import jax

PyTree: TypeAlias = Any
"""A pytree of arrays (nested tuples, lists, dicts, dataclasses, ``None`` leaves...)."""

DTypeLike: TypeAlias = jax.typing.DTypeLike
"""Anything ``jnp.dtype`` accepts: ``jnp.float32``, ``"bfloat16"``, ``np.dtype(...)``."""

ArrayLike: TypeAlias = jax.typing.ArrayLike
"""A jax or numpy array, or a Python / numpy scalar."""

ArgNums: TypeAlias = int | Sequence[int]
"""One positional argument index, or several (as ``jax.value_and_grad``'s ``argnums``)."""

ArgNames: TypeAlias = str | Sequence[str]
"""One keyword argument name, or several."""

AxisName: TypeAlias = Hashable
"""A mesh axis name (usually a ``str``)."""

AxisNames: TypeAlias = AxisName | Sequence[AxisName]
"""One mesh axis name, or a tuple of them (``data_axis=("data", "fsdp")``)."""


class LossFn(Protocol):
  """A loss function: takes the parameters, the batch and any other arguments, returns the loss.

  With ``has_aux=True`` it returns ``(loss, aux)``; with ``reduce="weighted"`` the loss is a
  ``(numerator, denominator)`` pair.
  """

  def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


StepFactory: TypeAlias = Callable[[int], Callable[..., Any]]
"""``make_step(num_micro_batches)`` returning a jitted train step (``jaxaccum.plan_step``)."""

__all__ = (
    "ArgNames",
    "ArgNums",
    "ArrayLike",
    "AxisName",
    "AxisNames",
    "DTypeLike",
    "LossFn",
    "PyTree",
    "StepFactory",
)
