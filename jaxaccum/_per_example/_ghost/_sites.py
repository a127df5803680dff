"""The records of the ghost analysis: a leaf's :class:`View`, its :class:`Site` (a use with a
norm rule) and the :class:`SiteRule` of a kind of site, below the modules that make and read
them (``_analysis``, ``_rules``, ``_program``). See README.md beside this file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class View:
  """A value derived from differentiated leaf ``leaf`` by layout operations.

  ``perm[d]`` is the leaf dimension of the value's dimension ``d`` while only transposes and
  converts were applied (``None`` after a reshape); ``post`` holds the broadcasts (and what
  followed them) after the last norm-preserving value, whose aval is ``anchor``; ``base``,
  where not empty, is the path of the scan of whose ``xs`` the value is one iteration's
  slice (see ``in_scan``). ``region``: after static slices, the entries of the base (the leaf, or
  the iteration's slice) the value holds, ``(start, limit, stride)`` per base dimension; two
  sites whose regions are disjoint have gradients with disjoint supports, so their norms add.
  """

  leaf: int
  perm: tuple[int, ...] | None
  anchor: Any  # jax.core.ShapedArray of the last norm-preserving value
  post: tuple[Any, ...] = ()  # JaxprEqns applied after the anchor (broadcast_in_dim ...)
  base: tuple[int, ...] = ()
  region: tuple[tuple[int, int, int], ...] | None = None
  sign: int = 1  # -1 after an odd number of ``neg``: the leaf's gradient is minus the view's

  @property
  def in_scan(self) -> bool:
    """Whether the value is one iteration's slice of a leaf stacked along a scan's ``xs``."""
    return bool(self.base)


@dataclasses.dataclass(frozen=True)
class Site:
  """One use of a leaf with a norm rule: the equation at ``path``, how it uses the leaf, and
  the rule of its kind (one of :data:`_rules.SITE_RULES`)."""

  leaf: int
  path: tuple[int, ...]
  rule: SiteRule
  eqn: Any
  pos: int  # which operand of eqn is the leaf's view
  view: View
  batched: bool  # whether an operand other than the view depends on the example


@dataclasses.dataclass(frozen=True)
class SiteRule:
  """How one kind of site gets its leaf's per-example squared norm.

  ``match(eqn, pos, view)``: whether leaf view ``view``, operand ``pos`` of ``eqn``, is used
  at a site of this kind (:data:`SITE_RULES` is tried in order: the first match wins).
  ``sq_norm(site, saved, g, axes)``: one example's wide squared norm of the leaf's gradient
  through the site, from its other operands ``saved`` and its output's cotangent ``g``
  (``axes``: the ``shard_map`` axes the leaf varies over). ``sides(site)``: the leaf
  dimensions on the two factors of its factor form ``A^T B`` (``None``: none at this site),
  and ``factor(site, other, g)``: one example's ``(A, B)`` (:func:`_factor`), both ``None``
  for a kind without a factor form (no cross terms with another site). ``saves_operands``:
  whether a tapped site keeps its other operands for its backward rule. ``forms_gradient``:
  whether the norm is read from the leaf-sized per-example gradient
  (``_clipped._little_saved``).
  """

  name: str
  match: Callable[[Any, int, View], bool]
  sq_norm: Callable[[Site, Sequence[Any], jax.Array, tuple], jax.Array]
  sides: Callable[[Site], tuple[tuple[int, ...], tuple[int, ...]] | None] | None = None
  factor: Callable[[Site, Any, jax.Array], tuple[Any, Any]] | None = None
  saves_operands: bool = True
  forms_gradient: bool = False
