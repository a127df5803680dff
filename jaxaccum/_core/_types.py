"""Type aliases shared by jaxaccum's modules (private: import them from here, not from jaxaccum).

As optax (``optax.Params``) and chex (``chex.ArrayTree``) do, a pytree is typed with a small
alias rather than a structural type that a checker could not follow through ``jax.tree.map``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, TypeAlias

from jax.typing import ArrayLike, DTypeLike

PyTree: TypeAlias = Any
"""A pytree of arrays (as ``optax.Params`` / ``chex.ArrayTree``)."""

ArgNums: TypeAlias = int | Sequence[int]
"""One positional argument index, or several (as ``jax.value_and_grad``'s ``argnums``)."""

ArgNames: TypeAlias = str | Sequence[str]
"""One keyword argument name, or several."""

AxisName: TypeAlias = Hashable
"""A mesh axis name (usually a ``str``)."""

AxisNames: TypeAlias = Any  # an axis name or a tuple of them, as jax.lax collectives take


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
