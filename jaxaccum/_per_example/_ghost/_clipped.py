"""The entry point, :func:`clipped_sum`: its passes over the rewritten program.

The objective is traced and analysed (``_analysis``), the program that holds less is picked
(book-keeping or a second backward pass), the first backward pass gives the norms, and the
clipped sum follows: from the kept factors, or from a second, reweighted backward pass. See
README.md beside this file.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._core import _sharding
from jaxaccum._core._types import PyTree
from jaxaccum._per_example import _norm
from jaxaccum._per_example._ghost import _analysis, _norms, _program, _rules


def _aval_bytes(aval: Any) -> int:
  return math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize


def _held_bytes(vjp: Any, n: int) -> int:
  """Bytes of a VJP's residuals that have a leading axis of ``n`` (the examples')."""
  seen = {id(x): x for x in jax.tree.leaves(vjp)}.values()
  return sum(_aval_bytes(x.aval) for x in seen
             if hasattr(x, "aval") and x.aval.shape[:1] == (n,) and _norms.inexact(x))


def clipped_sum(f: Callable[[tuple, PyTree], tuple[jax.Array, PyTree]], diff: tuple,
                xs: PyTree, in_axes: Any, weigh: Callable[[jax.Array], jax.Array], *,
                strict: bool, norms: bool = False,
                zero_safe: bool = True,
                program: str | None = None,
                groups: Sequence[int] | None = None,
                auto: bool = False) -> tuple[PyTree, tuple, jax.Array] | None:
  """Per-example clipped gradient sum without per-example gradients where possible.

  Args:
    f: ``f(diff, x) -> (objective, out)``: one example's scalar objective and any pytree
      ``out``, where ``x`` is that example's inputs.
    diff: a tuple of the differentiated pytrees (not batched).
    xs: the examples, mapped as ``jax.vmap(f, in_axes=(None, in_axes))(diff, xs)``.
    in_axes: ``xs``'s batch axes, as ``jax.vmap`` takes them.
    weigh: ``(E,)`` float32 per-example squared gradient norms (over all of ``diff``'s
      floating leaves) ``-> (E,)`` float32 factors ``c_e``; called once.
    strict: raise a ``ValueError`` naming the primitive and the leaf for a use without a
      ghost-norm rule, instead of materialising that leaf's per-example gradients (and one
      naming the dtype for a second backward pass narrower than float32:
      :func:`_analysis.narrow_second_pass`).
    norms: pass norms rather than squared norms to ``weigh`` and return them: a norm above
      about 1.8e19, whose square overflows float32, is then still finite.
    zero_safe: whether ``weigh`` may give ``c_e = 0`` to an example whose norm is not finite
      (``nan_safe``, a padding mask): such an example then adds exactly zero. ``False``
      saves a parameter-sized buffer (with sites in a scan body) where ``weigh`` never does
      (it gives NaN instead).
    program: where no site sits in a scan body, ``"book"`` (book-keeping) or ``"second"``
      (a second backward pass) instead of the one that holds less (for tests).
    groups: each leaf of ``diff``'s clip group (per-layer clipping): ``weigh`` then gets
      and gives ``(E, G)`` values, one per group, and a second backward pass runs once per
      group; the norms returned are still each example's whole-gradient norm.
    auto: return ``None`` where ghost norms would save little (:func:`_little_saved`) or
      where the clipped sum would be a second backward pass in a dtype narrower than
      float32 (:func:`_analysis.narrow_second_pass`), for ``method="auto"`` to materialise instead.

  Returns:
    ``(outs, grad_sum, sq_norms)``: the vmapped ``out`` (leading axis ``E``),
    ``sum_e c_e grad_e f(diff, x_e)`` with ``diff``'s structure and dtypes (an example
    with ``c_e = 0`` adds exactly zero, even if its gradient is not finite, with
    ``zero_safe``), and the
    ``(E,)`` float32 squared norms (the norms with ``norms=True``).
  """
  leaves, treedef = jax.tree.flatten(diff)
  closed, out_tree, n = _analysis.trace(f, leaves, treedef, xs, in_axes)
  taps, probes, multi, fallback = _analysis.decide(closed, leaves, _analysis.mapped(xs, in_axes))
  if strict and fallback:
    _refuse_unknown_use(diff, leaves, fallback)
  narrow = _analysis.narrow_dtype(closed.jaxpr)
  refused = _analysis.narrow_second_pass(narrow, taps, probes, program)
  if refused is not None:
    if auto:
      return None
    assert narrow is not None  # (_analysis.narrow_second_pass)
    _refuse_narrow_second_pass(narrow, refused)
  if auto and _little_saved(taps, probes, leaves):
    return None
  t = _traced(f, xs, in_axes, leaves, treedef, closed, out_tree, n, fallback, groups)
  book, plan, (objectives, vjp, outs, acts) = _choose_program(t, taps, probes, program,
                                                              narrow is not None)
  wide, fb_grads, acts, cots = _first_pass(t, plan, taps, multi, book, narrow is not None,
                                           vjp, objectives, acts)
  # A norm above ~1.8e19 overflows its square in float32: the wide form's second part
  # still gives it (and its third, a norm below ~1e-19).
  sq = _norms.wide_norm(wide) if norms else wide[..., 0]  # (n, rows)
  c = jnp.asarray(weigh(sq if groups is not None else sq[:, 0]), jnp.float32)
  c = c if groups is not None else c[:, None]  # (n, rows): each example's factor per group
  if book:
    ghost_grads = _program.kept_sum(plan, closed.jaxpr, [leaves[k] for k in t.ghost_keys],
                            t.ghost_keys, acts, cots, c, zero_safe)
  else:
    ghost_grads = _by_group(vjp, c.astype(objectives.dtype), [t.gid[k] for k in t.ghost_keys])
  # Reweighted backward pass: an example with c = 0 (nan_safe, a padding row) adds exactly
  # zero, even where its own norm is not finite (0 * NaN would poison the sum): only then,
  # the forward and backward passes run again with those examples' inputs replaced by
  # a live one's. The cond costs a parameter-sized buffer: zero_safe=False skips it.
  dead = jnp.all(c == 0, axis=1)
  if t.ghost_keys and zero_safe and not book:
    ghost_grads = jax.lax.cond(jnp.any(dead & ~jnp.all(jnp.isfinite(sq), axis=1)),
                               functools.partial(_again, t, c, objectives.dtype, dead),
                               lambda _: ghost_grads, None)
  grads = list(leaves)
  for k, g in zip(t.ghost_keys, ghost_grads, strict=True):
    grads[k] = g
  for k, g in zip(t.fb_keys, fb_grads, strict=True):
    grads[k] = jnp.sum(_norm.scale_rows(_norms.f32(g), c[:, t.gid[k]]), axis=0).astype(g.dtype)
  if groups is None:
    total = sq[:, 0]
  else:
    total = _norm.norm_of_norms(sq) if norms else jnp.sum(sq, axis=1)
  return outs, jax.tree.unflatten(treedef, grads), total


def _refuse_narrow_second_pass(dtype: np.dtype, why: str) -> None:
  """Raises ``strict``'s ``ValueError`` for a second backward pass in ``dtype``."""
  raise ValueError(
      f"clip_per_example(method='ghost') cannot bound each example's contribution by the "
      f"clip norm in this program: {why}, so the clipped sum would come from a second "
      f"backward pass, and the program computes in {dtype.name}, narrower than float32. A "
      f"backward pass in {dtype.name} does not scale with its cotangent (a difference that "
      "cancels, such as tanh's derivative near saturation, keeps only a few bits), so the "
      "second pass would give an example more than the clip factor times the gradient whose "
      "norm was read (measured up to 1.27 C). Use method='auto' (which materialises each "
      "example's gradient here) or method='materialize', or compute in float32.")


def _refuse_unknown_use(diff: tuple, leaves: Sequence[Any], fallback: dict[int, str]) -> None:
  """Raises ``strict``'s ``ValueError`` for the first leaf without a rule."""
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(diff)[0]]
  k, what = next(iter(fallback.items()))
  raise ValueError(
      f"clip_per_example(method='ghost') has no per-example norm rule for how the loss uses "
      f"the parameter at {paths[k] or '(root)'} (shape {np.shape(leaves[k])}): it reaches "
      f"{what}. Ghost norms cover matrix products, bias adds, elementwise scales, row "
      "gathers, slices and convolutions, inside jit, checkpoint and lax.scan (a stacked "
      "parameter entering the scan as xs). Use method='auto' to materialise the "
      "per-example gradient of such parameters only, or method='materialize'.")


@dataclasses.dataclass(frozen=True)
class _Traced:
  """The objective traced on one example, and what every pass over it shares."""

  f: Callable[..., Any]
  xs: PyTree
  in_axes: Any
  leaves: list
  treedef: Any
  closed: Any  # the ClosedJaxpr of f on one example
  out_tree: Any
  n: int  # examples
  ghost_keys: list[int]  # the leaves whose norms the analysis gives
  fb_keys: list[int]  # the leaves whose per-example gradients are materialised
  gid: list[int]  # each leaf's clip group
  rows: int  # clip groups
  axes: tuple  # the shard_map axes the per-example inputs vary over
  fb0: list  # the materialised leaves, one copy per example
  acc0: jax.Array  # zero wide squared norms, (n, rows, parts)


def _traced(f: Callable[..., Any], xs: PyTree, in_axes: Any, leaves: list, treedef: Any,
            closed: Any, out_tree: Any, n: int, fallback: dict[int, str],
            groups: Sequence[int] | None) -> _Traced:
  """The :class:`_Traced` of a call of :func:`clipped_sum` (``fallback``: the leaves to
  materialise; ``groups``: each leaf's clip group, ``None``: one for all)."""
  fb_keys = list(fallback)
  ghost_keys = [k for k in range(len(leaves)) if k not in fallback]
  # Under shard_map: the per-example inputs vary over the axes any input varies over.
  axes = tuple(sorted(set().union(*(_sharding.varying(x) for x in jax.tree.leaves(
      (leaves, xs, closed.consts)) if isinstance(x, (jax.Array, np.ndarray, np.generic)))),
      key=str))
  fb0 = _sharding.vary([jnp.broadcast_to(leaves[k], (n, *np.shape(leaves[k])))
                         for k in fb_keys], axes)
  gid = list(groups) if groups is not None else [0] * len(leaves)
  rows = max(gid, default=0) + 1
  # wide squared norms, one row per clip group
  acc0 = _sharding.vary(jnp.zeros((n, rows, _norms.WIDE_PARTS), jnp.float32), axes)
  return _Traced(f, xs, in_axes, leaves, treedef, closed, out_tree, n, ghost_keys, fb_keys,
                 gid, rows, axes, fb0, acc0)


def _forward(t: _Traced, plan: _program.Plan) -> tuple[jax.Array, Any, Any, list]:
  """The forward pass with ``plan``'s taps and probes: ``(objectives, vjp, outs, acts)``."""
  keys = list(plan.probes)

  def example(ghost, fb, acc, pv, x):
    ls = list(t.leaves)
    for k, v in (*zip(t.ghost_keys, ghost, strict=True), *zip(t.fb_keys, fb, strict=True)):
      ls[k] = v
    acts: dict = {}
    outs = _program.Run(plan, acc, dict(zip(keys, pv, strict=True)), acts).walk(
        t.closed.jaxpr, [*ls, *jax.tree.leaves(x)], (), t.closed.consts)
    objective, out = jax.tree.unflatten(t.out_tree, outs)
    return objective, (out, [acts[k] for k in keys])

  def batched(ghost, fb, acc, pv):
    return jax.vmap(example, in_axes=(None, 0, 0, 0, t.in_axes), axis_name=_norms.EXAMPLES)(
        ghost, fb, acc, pv, t.xs)

  pv0 = []
  for key in keys:
    aval = plan.probes[key].eqn.outvars[0].aval
    pv0.append(_sharding.vary(jnp.zeros((t.n, *aval.shape), aval.dtype), t.axes))
  objectives, vjp, (outs, acts) = jax.vjp(batched, [t.leaves[k] for k in t.ghost_keys], t.fb0,
                                          t.acc0, pv0, has_aux=True)
  return objectives, vjp, outs, acts


def _choose_program(t: _Traced, taps: dict, probes: dict, program: str | None,
                    narrow: bool) -> tuple[bool, _program.Plan, tuple[jax.Array, Any, Any, list]]:
  """``(book, plan, forward pass)``: whether the clipped sum is formed by book-keeping.

  Where no site sits in a scan body, the clipped sum is formed by whichever of two programs
  holds less for it (bytes per micro-batch, read from the traced program):
  - book-keeping: every site is probed, its output cotangent and other operands kept; the
    norms follow from them and each leaf's clipped sum is formed from them (the sites'
    transposes at c times the cotangents), with no second backward pass. It holds every
    site's operands and cotangents at once: a gelu MLP's pick, whose residuals (three per
    layer) outweigh them;
  - a second, reweighted backward pass over the same forward pass, which holds the forward
    pass's residuals for it: a tanh MLP's pick, whose residuals are the sites' inputs alone.
  A scan body's sites are tapped (norms computed inside the backward pass, no cotangent
  kept across the iterations), with a second backward pass; the scan body recomputes its
  cheap elementwise residuals (the policy ``_program._saved``).
  """
  sites = {**taps, **probes}
  plan = _program.Plan.of(taps, probes, t.gid)
  passed = _forward(t, plan)
  if sites and not any(s.view.in_scan for s in sites.values()):
    kept = sum(t.n * (_aval_bytes(s.eqn.outvars[0].aval) + sum(
        _aval_bytes(v.aval) for k, v in enumerate(s.eqn.invars) if k != s.pos))
        for s in sites.values())
    held = _held_bytes(passed[1], t.n)
    # Book-keeping forms the clipped sum in float32 from the kept factors; a second pass
    # runs in the model's own dtypes, which do not scale with the clip factor: in a
    # narrower dtype than float32 (``narrow``: bfloat16 compute), book-keeping is taken
    # whatever it holds (see _analysis.narrow_second_pass).
    if program == "book" or (program is None and (kept <= held or narrow)):
      plan = _program.Plan.of({}, sites, t.gid)
      return True, plan, _forward(t, plan)
  return False, plan, passed


def _first_pass(t: _Traced, plan: _program.Plan, taps: dict, multi: dict, book: bool, narrow: bool,
                vjp: Any, objectives: jax.Array,
                acts: list) -> tuple[jax.Array, list, list, list]:
  """The first backward pass: ``(wide, fb_grads, acts, cots)``, each example's wide squared
  norms ``(E, rows, parts)``, the materialised leaves' per-example gradients, and the
  probes' kept operands and output cotangents (the weights' cotangents it would give are
  dead code)."""
  where = {key: j for j, key in enumerate(plan.probes)}
  _, fb_grads, wide, cots = vjp(jnp.ones_like(objectives))
  if book and narrow:
    # The norms and the clipped sum read the same kept values: XLA may otherwise give one
    # of them a narrow value's excess precision (a bfloat16 product read before rounding)
    # and the other the rounded value, and the clipped example's norm is then not the one
    # its factor was computed from. (In float32 there is no excess precision to give.)
    acts, cots = jax.lax.optimization_barrier((acts, cots))
  for k, g in zip(t.fb_keys, fb_grads, strict=True):
    wide = wide + _norms.in_row(jax.vmap(_norms.wide_sum_sq)(g), t.gid[k], t.rows)
  if book:
    for key in taps:
      site, j = taps[key], where[key]
      leaf_axes = tuple(_sharding.varying(t.leaves[site.leaf]))
      wide = wide + _norms.in_row(_sharding.vary(jax.vmap(
          lambda o, g, site=site, ax=leaf_axes: site.rule.sq_norm(site, o, g, ax),
          axis_name=_norms.EXAMPLES)(acts[j], cots[j]), t.axes), t.gid[site.leaf], t.rows)
  for k, uses in multi.items():
    js = [where[s.path] for s in uses]
    wide = wide + _norms.in_row(jax.vmap(lambda o, g, uses=uses: _rules.multi_sq_norm(uses, o, g),
                                   axis_name=_norms.EXAMPLES)(
        [acts[j][0] for j in js], [cots[j] for j in js]), t.gid[k], t.rows)
  return wide, fb_grads, acts, cots


def _again(t: _Traced, c: jax.Array, dtype: Any, dead: jax.Array, _: Any) -> list[Any]:
  """The ghost leaves' clipped sum by a forward and a second backward pass again (``c``: its
  factors, cast to the objective's ``dtype``), each dead example's inputs (``c_e = 0`` in
  every group) replaced by a live one's; all zero where every example is dead."""
  n, ghost_keys = t.n, t.ghost_keys
  src = jnp.where(dead, jnp.argmax(jnp.max(c, axis=1)), jnp.arange(n))
  xs2 = jax.tree.unflatten(jax.tree.structure(t.xs), [
      x if a is None else jnp.take(x, src, axis=a)
      for x, a in zip(jax.tree.leaves(t.xs), _analysis.leaf_axes(t.xs, t.in_axes), strict=True)])

  def plain(ghost, x):
    ls = list(t.leaves)
    for k, v in zip(ghost_keys, ghost, strict=True):
      ls[k] = v
    return t.f(jax.tree.unflatten(t.treedef, ls), x)[0]

  _, vjp2 = jax.vjp(lambda g: jax.vmap(plain, in_axes=(None, t.in_axes))(g, xs2),
                    [t.leaves[k] for k in ghost_keys])
  redo = _by_group(vjp2, c.astype(dtype), [t.gid[k] for k in ghost_keys])
  return jax.tree.map(lambda g: jnp.where(jnp.all(dead), jnp.zeros_like(g), g)
                      if _norms.inexact(g) else g, redo)


def _little_saved(taps: dict, probes: dict, leaves: Sequence[Any]) -> bool:
  """Whether ghost norms would save little over materialising: a third or more of the
  parameters (by bytes) are used at ``"direct"`` sites (convolution kernels, elementwise
  scales), whose norm is formed from the leaf-sized per-example gradient, so that the ghost
  step holds about as much as materialising and runs another pass besides: a small CNN,
  half its parameters in kernels, took 1.5x the plain step's time with ghost norms, 0.65x
  materialised, with the same temporaries. Leaves without a rule are materialised by both
  programs and weigh on neither side."""
  size = {k: math.prod(np.shape(leaves[k])) * jnp.dtype(jnp.asarray(leaves[k]).dtype).itemsize
          for k in range(len(leaves)) if _norms.inexact(leaves[k])}
  formed = {s.leaf for s in (*taps.values(), *probes.values()) if s.rule.forms_gradient}
  total = sum(size.values())
  return total > 0 and 3 * sum(size[k] for k in formed if k in size) >= total


def _by_group(vjp: Callable[..., Any], c: jax.Array, gid: Sequence[int]) -> list[Any]:
  """The first output of ``vjp`` at per-example cotangents ``c[:, g]``: one backward pass
  per clip group ``g`` that the leaves (``gid``: each one's group) belong to, each leaf
  taken from its group's pass."""
  out: list[Any] = [None] * len(gid)
  for g in sorted(set(gid)):
    got = vjp(c[:, g])[0]
    for k, row in enumerate(gid):
      if row == g:
        out[k] = got[k]
  return out
