"""Type aliases shared by jaxaccum's modules."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, TypeAlias

from jax.typing import ArrayLike, DTypeLike

PyTree: TypeAlias = Any
"""A pytree of arrays (as ``optax.Params`` / ``chex.ArrayTree``)."""

ArgNums: TypeAlias = int | Sequence[int]
ArgNames: TypeAlias = str | Sequence[str]
AxisName: TypeAlias = Hashable
AxisNames: TypeAlias = Any  # an axis name or a tuple of them, as jax.lax collectives take

__all__ = ("ArgNames", "ArgNums", "ArrayLike", "AxisName", "AxisNames", "DTypeLike", "PyTree")
