"""The site rules: one :class:`SiteRule` record per kind of site, and the cross terms of a
leaf used at several sites.

A kind of site is how an equation uses a leaf's view (a matrix product, a row gather, a
window, any other linear use); its record says which uses it matches, how one example's
squared norm through it is read, and its factor form ``A^T B`` for the cross terms between
sites (:func:`multi_sq_norm`). :data:`SITE_RULES` is tried in order. See README.md beside
this file.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._core import _sharding
from jaxaccum._per_example._ghost import _norms
from jaxaccum._per_example._ghost._sites import Site, SiteRule, View

# The gather modes whose transpose :func:`_norms.gather_rows` follows (any other: the site's own
# transpose, ``"direct"``).
_ROW_GATHER_MODES = (jax.lax.GatherScatterMode.CLIP, jax.lax.GatherScatterMode.FILL_OR_DROP,
                     jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "add_any"})


def _is_row_gather(eqn: Any) -> bool:
  """``operand[indices]`` along axis 0: the form of ``jnp.take(table, ids, axis=0)``."""
  dn = eqn.params["dimension_numbers"]
  op, idx = (v.aval for v in eqn.invars)
  return (tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
          and not tuple(dn.operand_batching_dims) and idx.shape[-1:] == (1,)
          and tuple(eqn.params["slice_sizes"]) == (1, *op.shape[1:])
          and tuple(dn.offset_dims) == tuple(range(idx.ndim - 1, idx.ndim - 2 + op.ndim)))


def _disjoint(a: tuple, b: tuple) -> bool:
  """Whether two regions share no entry: along some dimension, no index."""
  return any(np.intersect1d(np.arange(*x), np.arange(*y)).size == 0
             for x, y in zip(a, b, strict=True))


def _dot_factors(eqn: Any, pos: int, act: jax.Array,
                 g: jax.Array) -> tuple[jax.Array, jax.Array, tuple[int, ...], tuple[int, ...]]:
  """``(A, B, pc, pf)`` with the leaf view's gradient ``G[h] = A[h]^T B[h]``.

  ``A``: ``(H, T, P)`` the activation over (shared batch dims, its free dims, the contracted
  dims), ``B``: ``(H, T, Q)`` the cotangent over (batch, the activation's free dims, the view's
  free dims); ``pc``/``pf``: the view's contracted and free dimensions, in ``A``'s and
  ``B``'s order.
  """
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  ac, pc, ab, pb = (lc, rc, lb, rb) if pos == 1 else (rc, lc, rb, lb)
  ac, pc, ab, pb = map(tuple, (ac, pc, ab, pb))
  a_free = tuple(d for d in range(act.ndim) if d not in ac and d not in ab)
  p_ndim = eqn.invars[pos].aval.ndim
  pf = tuple(d for d in range(p_ndim) if d not in pc and d not in pb)
  nb, na, npf = len(ab), len(a_free), len(pf)
  a = jnp.transpose(act, (*ab, *a_free, *ac))
  h = math.prod(a.shape[:nb])
  t = math.prod(a.shape[nb:nb + na])
  a = a.reshape(h, t, math.prod(a.shape[nb + na:]))
  if pos == 1:  # output: batch, activation's free dims, view's free dims
    gperm = tuple(range(g.ndim))
  else:  # output: batch, view's free dims, activation's free dims
    gperm = (*range(nb), *range(nb + npf, g.ndim), *range(nb, nb + npf))
  b = jnp.transpose(g, gperm).reshape(h, t, -1 if g.size else 0)
  return a, b, pc, pf


def _site_fn(site: Site, others: Sequence[Any]) -> Callable[[jax.Array], jax.Array]:
  """The site's output as a function of its leaf view's anchor (linear in it), in float32
  or wider (:func:`_norms.bind_wide`), as book-keeping forms the clipped sum through it."""
  def fn(w):
    for e in site.view.post:
      w = _norms.bind_wide(e, [w])
    args = list(others)
    args.insert(site.pos, w)
    return _norms.bind_wide(site.eqn, args)
  return fn


def _sides(site: Site) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """The leaf dimensions on the site's two factors, or ``None`` if it has no factor form."""
  v = site.view
  if site.rule.sides is None or v.post or v.in_scan or v.region is not None or v.perm is None:
    return None
  return site.rule.sides(site)


def apart(sites: Sequence[Site]) -> bool:
  """Whether the sites use pairwise disjoint static slices of one base: no cross terms."""
  views = [s.view for s in sites]
  return (all(v.region is not None and v.base == views[0].base for v in views)
          and all(_disjoint(a.region, b.region)  # type: ignore[arg-type]
                  for i, a in enumerate(views) for b in views[i + 1:]))


def cross_ok(sites: Sequence[Site]) -> bool:
  sides = [_sides(s) for s in sites]
  if any(s is None for s in sides):
    return False
  first = sides[0]
  assert first is not None
  return all(s in (first, first[::-1]) for s in sides)


def _factor(site: Site, other: jax.Array, g: jax.Array, flip: bool) -> tuple[Any, Any]:
  """One example's ``(A, B)`` with the leaf's gradient through ``site`` equal to ``A^T B``.

  Each side is ``("dense", M)`` (rows ``T``, the side's leaf dimensions flattened in leaf
  order) or ``("index", i)`` (a one-hot row per entry of ``i``; ``-1``: no row).
  """
  assert site.rule.factor is not None  # a site with sides (cross_ok) has a factor form
  x, y = site.rule.factor(site, other, g)
  return (y, x) if flip else (x, y)


def _gram(s: Any, t: Any) -> jax.Array:
  """``S T^T`` of two factor sides, ``(T_s, T_t)``."""
  (ks, ms), (kt, mt) = s, t
  if ks == "dense" and kt == "dense":
    return jnp.einsum("tp,up->tu", ms, mt, precision=_norms.HIGHEST)
  if ks == "index" and kt == "index":
    return ((ms[:, None] == mt[None, :]) & (ms[:, None] >= 0)).astype(jnp.float32)
  if ks == "dense":
    return _gram(t, s).T
  return jnp.where((ms >= 0)[:, None], mt[:, jnp.maximum(ms, 0)].T, 0.0)


def _unit(side: Any) -> tuple[Any, jax.Array]:
  """A factor side divided by its largest entry, and that entry (1 for an index side)."""
  kind, m = side
  if kind == "index":
    return side, jnp.ones((), jnp.float32)
  peak = _norms.peak(m)
  return (kind, m / peak), peak


def _side_norms(side: Any) -> jax.Array:
  """Each row's L2 norm of a factor side (1 for an index side's rows that hold one)."""
  kind, m = side
  if kind == "index":
    return (m >= 0).astype(jnp.float32)
  return jnp.sqrt(jnp.sum(jnp.square(m), axis=-1))


def multi_sq_norm(sites: Sequence[Site], others: Sequence[Any],
                   cots: Sequence[Any]) -> jax.Array:
  """One example's wide squared norm of a leaf's gradient summed over its sites, cross
  terms included.

  The sites' terms are brought to one scale (each site's factors' peaks, relative to the
  largest product of them, as exact powers of two) and summed in Gram form, with the
  guard of ``_norms._GRAM_TRUST``: where the terms cancel, the leaf's gradient is formed directly
  in chunks (its rows from the first factor side).
  """
  first = _sides(sites[0])
  factors = [tuple(map(_unit, _factor(s, o, g, _sides(s) != first)))
             for s, o, g in zip(sites, others, cots, strict=True)]
  split = [_norms.frexp_split(pa, pb) for (_, pa), (_, pb) in factors]
  top = functools.reduce(jnp.maximum, [e for _, e in split])
  rel = [_norms.ldexp(m, e - top) for m, e in split]  # each site's scale over 2^top, at most 1
  weights = [r * s.view.sign for r, s in zip(rel, sites, strict=True)]
  total = jnp.zeros((), jnp.float32)
  for j, ((aj, _), (bj, _)) in enumerate(factors):
    for k in range(j, len(factors)):
      (ak, _), (bk, _) = factors[k]
      term = weights[j] * weights[k] * jnp.sum(_gram(aj, ak) * _gram(bj, bk))
      total = total + (term if j == k else 2.0 * term)
  terms = jnp.square(sum(r * jnp.sum(_side_norms(a) * _side_norms(b))
                         for r, ((a, _), (b, _)) in zip(rel, factors, strict=True)))
  # the direct form, over chunks of the rows of a side; the other side is dense at every
  # site (an index side is a gathered table's rows), and carries the site's weight
  pairs = [(a, b, w) for ((a, _), (b, _)), w in zip(factors, weights, strict=True)]
  if any(b[0] == "index" for _, b, _ in pairs):
    pairs = [(b, a, w) for a, b, w in pairs]
  m = next((x[1].shape[-1] for x, _, _ in pairs if x[0] == "dense"), None)
  if m is None:  # every side an index side: every site a row gather, of one table
    m = sites[0].eqn.invars[0].aval.shape[0]
  kinds = [x[0] for x, _, _ in pairs]
  arrays = [(x[1][None], (y[1] * w)[None]) for x, y, w in pairs]
  budget = sum(y[1].shape[0] * (m + y[1].shape[-1]) for _, y, _ in pairs)

  def direct(arrays):
    return _norms.chunked_sq([(k, x, y) for k, (x, y) in zip(kinds, arrays, strict=True)], m,
                             budget)

  s = _norms.guarded(_norms.untrusted(terms, total), direct, total, arrays)
  return _norms.wide_exp(s, 2 * top)


def _is_dot(eqn: Any, pos: int, view: View) -> bool:
  """A matrix product (dense, attention, output head) of the leaf's view itself."""
  del pos
  return eqn.primitive.name == "dot_general" and not view.post


def _dot_sq_norm(site: Site, saved: Sequence[Any], g: jax.Array, axes: tuple) -> jax.Array:
  del axes
  a, b, _, _ = _dot_factors(site.eqn, site.pos, saved[0], g)
  return _norms.sq_outer(a, b)


def _dot_sides(site: Site) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  perm = site.view.perm
  assert perm is not None  # (_sides)
  (lc, rc), (lb, rb) = site.eqn.params["dimension_numbers"]
  pc, pb = (rc, rb) if site.pos == 1 else (lc, lb)
  if tuple(pb):
    return None
  pf = [d for d in range(len(perm)) if d not in tuple(pc)]
  return tuple(sorted(perm[d] for d in pc)), tuple(sorted(perm[d] for d in pf))


def _dot_factor(site: Site, other: jax.Array, g: jax.Array) -> tuple[Any, Any]:
  perm = site.view.perm
  assert perm is not None  # (_sides)
  a, b, pc, pf = _dot_factors(site.eqn, site.pos, other, g)
  shape = site.eqn.invars[site.pos].aval.shape

  def order(m, dims):
    m = m.reshape(m.shape[1], *(shape[d] for d in dims))
    ranks = np.argsort([perm[d] for d in dims])
    return _norms.f32(jnp.transpose(m, (0, *(1 + ranks))).reshape(m.shape[0], -1))

  return ("dense", order(a, pc)), ("dense", order(b, pf))


def _is_row_gather_site(eqn: Any, pos: int, view: View) -> bool:
  """Rows of the leaf's view gathered (an embedding), in a mode that
  :func:`_norms.gather_rows` follows."""
  return (eqn.primitive.name == "gather" and pos == 0 and not view.post
          and _is_row_gather(eqn) and eqn.params["mode"] in _ROW_GATHER_MODES)


def _gather_sq_norm(site: Site, saved: Sequence[Any], g: jax.Array, axes: tuple) -> jax.Array:
  del axes
  return _norms.sq_gather(site.eqn, saved[0], g)


def _gather_sides(site: Site) -> tuple[tuple[int, ...], tuple[int, ...]]:
  perm = site.view.perm
  assert perm is not None  # (_sides)
  return (perm[0],), tuple(sorted(perm[1:]))


def _gather_factor(site: Site, other: jax.Array, g: jax.Array) -> tuple[Any, Any]:
  perm = site.view.perm
  assert perm is not None  # (_sides)
  i, rows = _norms.gather_rows(site.eqn, other, g)
  rest = site.eqn.invars[0].aval.shape[1:]
  ranks = np.argsort([perm[d] for d in range(1, len(perm))])
  rows = jnp.transpose(rows.reshape(-1, *rest), (0, *(1 + ranks))).reshape(rows.shape[0], -1)
  return ("index", i), ("dense", rows)


def _is_window(eqn: Any, pos: int, view: View) -> bool:
  """One window of the leaf's view (``dynamic_slice``; a ``slice`` after a reshape)."""
  return eqn.primitive.name in ("slice", "dynamic_slice") and pos == 0 and not view.post


def _window_sq_norm(site: Site, saved: Sequence[Any], g: jax.Array, axes: tuple) -> jax.Array:
  del site, saved, axes  # no two entries of a window overlap: the cotangent's norm
  return _norms.wide_sum_sq(g)


def _is_linear_use(eqn: Any, pos: int, view: View) -> bool:
  """Any other use whose transpose this module forms: a product (also of a broadcast view),
  a gather or window of a broadcast view, a convolution's kernel, a bias add or a scale."""
  del view
  name = eqn.primitive.name
  return (name == "dot_general" or (name in ("gather", "slice", "dynamic_slice") and pos == 0)
          or (name == "conv_general_dilated" and pos == 1)
          or (name in _ELEMENTWISE and not (name == "div" and pos == 1)))


def _direct_sq_norm(site: Site, saved: Sequence[Any], g: jax.Array,
                    axes: tuple) -> jax.Array:
  """The norm of the leaf-sized gradient, the site's transpose at ``g`` (in float32)."""
  anchor = site.view.anchor
  zero = _sharding.vary(_norms.widened(jnp.zeros(anchor.shape, anchor.dtype)), axes)
  _, vjp = jax.vjp(_site_fn(site, saved), zero)
  return _norms.wide_sum_sq(vjp(_norms.widened(g))[0])


# The kinds of site, in the order they are tried (see the module's table); a use that none
# matches has no rule, and its leaf falls back.
SITE_RULES = (
    SiteRule("dot", _is_dot, _dot_sq_norm, _dot_sides, _dot_factor),
    SiteRule("gather", _is_row_gather_site, _gather_sq_norm, _gather_sides, _gather_factor),
    SiteRule("slice", _is_window, _window_sq_norm, saves_operands=False),
    SiteRule("direct", _is_linear_use, _direct_sq_norm, forms_gradient=True),
)


def rule_for(eqn: Any, pos: int, view: View) -> SiteRule | None:
  """The rule of the site where ``view`` is operand ``pos`` of ``eqn`` (``None``: no rule)."""
  return next((r for r in SITE_RULES if r.match(eqn, pos, view)), None)
