"""Which sites, which rule: the analysis of the objective traced on one example.

Each differentiated leaf is followed through layout-only operations (a :class:`View`) to
its sites (:class:`Site`), the uses that have a rule (``_rules``); :func:`decide` gives each
floating leaf its rule (tapped, probed with cross terms, or materialised), and
:func:`rules` says so per leaf path. A program computing in a dtype narrower than float32
is never given a second backward pass (:func:`narrow_second_pass`). See README.md beside
this file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxaccum._core._types import PyTree
from jaxaccum._per_example._ghost import _norms, _rules, _walk
from jaxaccum._per_example._ghost._sites import Site, View


@dataclasses.dataclass
class _Analysis:
  sites: dict[int, list[Site]] = dataclasses.field(default_factory=dict)
  bad: dict[int, str] = dataclasses.field(default_factory=dict)  # leaf -> primitive

  def use(self, site: Site) -> None:
    self.sites.setdefault(site.leaf, []).append(site)

  def unknown(self, leaf: int, what: str) -> None:
    self.bad.setdefault(leaf, what)


def _extend(v: View, eqn: Any) -> View:
  """The view after a layout operation or a broadcast."""
  name = eqn.primitive.name
  sign = -v.sign if name == "neg" else v.sign
  if v.post or name == "broadcast_in_dim":
    return dataclasses.replace(v, post=(*v.post, eqn), sign=sign)
  perm = v.perm
  if name == "transpose" and perm is not None:
    perm = tuple(perm[d] for d in eqn.params["permutation"])
  elif name not in ("convert_element_type", "copy", "copy_p", "neg"):
    perm = None
  return dataclasses.replace(v, perm=perm, anchor=eqn.outvars[0].aval, sign=sign)


def _exact_convert(eqn: Any) -> bool:
  """Whether a ``convert_element_type``'s transpose (the cotangent converted back to the
  input's dtype) is exact: both real floating, every value of the output's dtype one of the
  input's (a narrowing convert, float32 -> bfloat16; not a widening one, whose transpose
  rounds the cotangent, nor one to or from a complex or integer dtype)."""
  src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
  if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
    return False
  a, b = jnp.finfo(src), jnp.finfo(dst)
  return a.nmant >= b.nmant and a.maxexp >= b.maxexp and a.minexp <= b.minexp


def _complex(eqn: Any) -> bool:
  """Whether an equation reads or makes a complex value: the rules here are for real
  values (a real weight times complex activations has a gradient of the real part of a
  complex product, which a norm of the real parts alone reads too small)."""
  return any(jnp.issubdtype(v.aval.dtype, jnp.complexfloating)
             for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "dtype"))


def _sliced(v: View, eqn: Any) -> View | None:
  """The view after a static ``slice``, with its region (``None`` where the slice's dims do
  not map to the base's: after a reshape or a broadcast)."""
  perm = v.perm
  if perm is None or v.post:
    return None
  ndim = len(perm)
  if v.region is None:  # the whole base (its dims permuted by perm)
    region = [(0, 0, 1)] * ndim
    for d, b in enumerate(perm):
      region[b] = (0, v.anchor.shape[d], 1)
  else:
    region = list(v.region)
  strides = eqn.params["strides"] or (1,) * ndim
  for d, (lo, hi, st) in enumerate(zip(eqn.params["start_indices"], eqn.params["limit_indices"],
                                       strides, strict=True)):
    b = perm[d]
    s0, _, t0 = region[b]
    region[b] = (s0 + lo * t0, s0 + hi * t0, t0 * st)
  return dataclasses.replace(v, anchor=eqn.outvars[0].aval, region=tuple(region))


def _first_order_deps(eqn: Any, deps: Sequence[bool]) -> list[bool]:
  """Which outputs of an equation the walk does not enter depend on the example (``deps``:
  which inputs do): all of them where an input does, except for an equation that holds a
  program directly among its params (``while``, a custom rule), which says no (a ``cond``'s
  branches, a tuple, are not seen there: its outputs count as dependent, as they are under
  ``jax.vmap``). Where unsure this says no: the one use of the answer (:class:`_program.Run` making
  a tapped output batched) is safe then."""
  if not any(deps):
    return [False] * len(eqn.outvars)
  if any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in eqn.params.values()):
    return [False] * len(eqn.outvars)
  return [True] * len(eqn.outvars)


class _Analyse(_walk.Walk):
  """Finds the sites of the leaves whose views enter a program (into ``result``). Each
  variable holds ``(view, dep)``: the leaf view it is (``None``: none) and whether it depends
  on the example (under ``jax.vmap`` over the examples: whether it is batched; a scan's carry
  only where it enters so too)."""

  missing = (None, False)

  def __init__(self, result: _Analysis):
    self.result = result

  def visit(self, eqn: Any, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    vs, ds = [v for v, _ in ins], [d for _, d in ins]
    deps = _first_order_deps(eqn, ds)
    views = self._views(eqn, vs, ds, here) if any(vs) else [None] * len(eqn.outvars)
    return list(zip(views, deps, strict=True))

  def enter(self, eqn: Any, body: _walk.Body, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    if body.kind != "scan":
      return self.walk(body.jaxpr, ins, here)
    nc, nk = body.num_consts, body.num_carry
    inner: list[Any] = []
    for k, (v, d) in enumerate(ins):
      if v is not None and (k < nc + nk or v.post):
        self.result.unknown(v.leaf, "scan (as a constant)" if k < nc else
                            "scan (as a carry)" if k < nc + nk else "scan (broadcast into xs)")
        v = None
      elif v is not None:  # one iteration's slice of a stacked leaf
        aval = body.jaxpr.invars[k].aval
        v = View(v.leaf, tuple(range(aval.ndim)), aval, (), here)
      inner.append((v, d))
    outs = self.walk(body.jaxpr, inner, here)
    for v, _ in outs:
      if v is not None:
        self.result.unknown(v.leaf, "scan (returned from the body)")
    carries = [d and o for (_, d), (_, o) in zip(ins[nc:nc + nk], outs[:nk], strict=True)]
    return [(None, d) for d in (*carries, *(o for _, o in outs[nk:]))]

  def _views(self, eqn: Any, vs: list[Any], ds: list[bool],
             here: tuple[int, ...]) -> list[View | None]:
    """The views of an equation's outputs (a use followed, a site recorded, or the leaves'
    uses marked unknown)."""
    result, name = self.result, eqn.primitive.name
    outs: list[View | None] = [None] * len(eqn.outvars)
    hit = [k for k, v in enumerate(vs) if v is not None]
    leaves = {vs[k].leaf for k in hit}
    first = vs[hit[0]]
    if _complex(eqn):
      for leaf in leaves:
        result.unknown(leaf, f"{name} (complex values)")
      return outs
    if name in _walk.LAYOUT or name == "broadcast_in_dim":
      if name == "convert_element_type" and not _exact_convert(eqn):
        result.unknown(first.leaf, f"{name} ({eqn.invars[0].aval.dtype} -> "
                       f"{eqn.outvars[0].aval.dtype}, whose transpose rounds or drops part "
                       "of the cotangent)")
      elif len(eqn.invars) == 1:
        outs[0] = _extend(first, eqn)
      else:
        result.unknown(first.leaf, name)
      return outs
    if name == "custom_jvp_call" and len(hit) == 1:
      j = _walk.identity_output(eqn, hit[0])
      if j is not None:
        outs[j] = first
        return outs
    if name == "slice" and hit == [0]:
      sliced = _sliced(first, eqn)
      if sliced is not None:
        outs[0] = sliced
        return outs
    if len(leaves) == 1 and len(hit) == 1:
      k = hit[0]
      rule = _rules.rule_for(eqn, k, first)
      if rule is not None:
        batched = any(d for j, d in enumerate(ds) if j != k)
        result.use(Site(first.leaf, here, rule, eqn, k, first, batched))
        return outs
    for leaf in leaves:
      result.unknown(leaf, name)
    return outs


def _analyse(jaxpr: Any, views: Sequence[View | None], deps: Sequence[bool]) -> _Analysis:
  """The sites of the leaves whose views enter ``jaxpr`` (the traced function), and the uses
  without a rule. ``deps``: which inputs depend on the example."""
  result = _Analysis()
  for v, _ in _Analyse(result).walk(jaxpr, list(zip(views, deps, strict=True))):
    if v is not None:
      result.unknown(v.leaf, "the function's output")
  return result


def trace(f: Callable[..., Any], leaves: list, treedef: Any, xs: PyTree,
           in_axes: Any) -> tuple[Any, Any, int]:
  """``(jaxpr of f on one example, its output tree, the number of examples)``.

  The example is traced as ``jax.vmap`` passes it (inside the vmap, so that its type keeps
  what the caller's context gives it, e.g. the varying axes of a ``shard_map``).
  """
  got = {}

  def grab(x):
    got["jaxpr"], shape = jax.make_jaxpr(
        lambda ls, x: f(jax.tree.unflatten(treedef, ls), x), return_shape=True)(leaves, x)
    got["tree"] = jax.tree.structure(shape)
    return jnp.zeros(())

  n = jax.eval_shape(jax.vmap(grab, in_axes=(in_axes,)), xs).shape[0]
  return got["jaxpr"], got["tree"], n


def leaf_axes(xs: PyTree, in_axes: Any) -> list[int | None]:
  """Per leaf of ``xs``: its batch axis (``in_axes`` is a prefix tree, as ``jax.vmap`` takes)."""
  per = jax.tree.map(lambda a, sub: [a] * len(jax.tree.leaves(sub)), in_axes, xs,
                     is_leaf=lambda a: a is None)
  return [m for ms in jax.tree.leaves(per, is_leaf=lambda m: isinstance(m, list)) for m in ms]


def mapped(xs: PyTree, in_axes: Any) -> list[bool]:
  return [a is not None for a in leaf_axes(xs, in_axes)]


def decide(closed: Any, leaves: Sequence[Any],
            mapped: Sequence[bool]) -> tuple[dict, dict, dict, dict[int, str]]:
  """Each floating leaf's rule: ``(taps, probes, multi, fallback)``.

  ``taps``: path -> the site of a leaf used once; ``probes``: path -> each site of a leaf used
  several times in factor forms, whose sites ``multi`` lists per leaf; ``fallback``: leaf ->
  the use without a rule.
  """
  floating = [k for k, x in enumerate(leaves) if _norms.inexact(x)]
  views: list[View | None] = [None] * len(closed.jaxpr.invars)
  for k in floating:
    aval = closed.jaxpr.invars[k].aval
    views[k] = View(k, tuple(range(aval.ndim)), aval)
  found = _analyse(closed.jaxpr, views, [False] * len(leaves) + list(mapped))
  fallback: dict[int, str] = {}
  taps: dict[tuple[int, ...], Site] = {}
  probes: dict[tuple[int, ...], Site] = {}
  multi: dict[int, list[Site]] = {}
  for k in floating:
    sites = found.sites.get(k, [])
    if jnp.issubdtype(jnp.asarray(leaves[k]).dtype, jnp.complexfloating):
      fallback[k] = "a complex parameter (the rules are for real values)"
    elif k in found.bad:
      fallback[k] = found.bad[k]
    elif len(sites) == 1 or _rules.apart(sites):
      taps.update({s.path: s for s in sites})
    elif sites and _rules.cross_ok(sites):
      multi[k] = sites
      probes.update({s.path: s for s in sites})
    elif sites:
      fallback[k] = (f"{len(sites)} uses ({', '.join(s.eqn.primitive.name for s in sites)}) "
                     "whose cross terms have no rule")
  return taps, probes, multi, fallback


def rules(f: Callable[[tuple, PyTree], tuple[jax.Array, PyTree]], diff: tuple, xs: PyTree,
          in_axes: Any) -> dict[str, str]:
  """Each floating leaf's path -> how :func:`clipped_sum` gets its norm (for tests and debugging).

  ``"ghost"`` (one site with a rule), ``"cross"`` (several factor-form sites, cross terms
  included), ``"none"`` (unused) or ``"materialize: <the use without a rule>"``; every
  leaf with a rule reads ``"materialize: a second backward pass in <dtype>"`` where its
  clipped sum would need a second backward pass in a dtype narrower than float32
  (:func:`narrow_second_pass`: ``"auto"`` materialises the program, ``"ghost"`` refuses it).
  """
  leaves = jax.tree.leaves(diff)
  treedef = jax.tree.structure(diff)
  closed, _, _ = trace(f, leaves, treedef, xs, in_axes)
  taps, probes, multi, fallback = decide(closed, leaves, mapped(xs, in_axes))
  narrow = narrow_dtype(closed.jaxpr)
  refused = narrow_second_pass(narrow, taps, probes, None)
  tapped = {s.leaf for s in taps.values()}
  out = {}
  for k, (p, x) in enumerate(jax.tree_util.tree_flatten_with_path(diff)[0]):
    if not _norms.inexact(x):
      continue
    label = ("ghost" if k in tapped else "cross" if k in multi else
             f"materialize: {fallback[k]}" if k in fallback else "none")
    if refused is not None and label in ("ghost", "cross"):
      assert narrow is not None  # (narrow_second_pass)
      label = f"materialize: a second backward pass in {narrow.name}"
    out[jax.tree_util.keystr(p)] = label
  return out


# A backward pass in a floating dtype narrower than float32 is not linear in its cotangent:
# it rounds wherever it computes, and where a difference cancels (tanh's derivative near
# y = -1, ``u + u y``, holds a few bits of ``u``) the rounding is relative to the terms, not
# to the result. A second, reweighted pass with cotangents ``c_e`` then gives each example
# a gradient other than ``c_e`` times the one whose norm the first pass read: in bfloat16,
# with tanh layers in a scan body, up to 1.27 C (no margin on the factors covers it). Such a
# program is not given a second pass: "auto" materialises it, "ghost" refuses it
# (:func:`narrow_second_pass`); book-keeping, which forms the sum in float32 from the very
# values the norms were read from, is exact in any dtype. See docs/dp-sgd.md, "What the
# sensitivity bound rests on".


def narrow_dtype(jaxpr: Any) -> np.dtype | None:
  """The narrowest floating dtype narrower than float32 among ``jaxpr``'s values (``None``:
  every floating value is float32 or wider). A cotangent rounds wherever the backward pass
  computes in it, not only at the sites."""
  narrow = [np.dtype(v.aval.dtype) for e in _walk.eqns(jaxpr) for v in (*e.invars, *e.outvars)
            if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating)
            and jnp.finfo(v.aval.dtype).bits < 32]
  return min(narrow, key=lambda d: (jnp.finfo(d).nmant, d.name), default=None)


def narrow_second_pass(narrow: np.dtype | None, taps: dict, probes: dict,
                        program: str | None) -> str | None:
  """Why the clipped sum of ``taps`` and ``probes`` would be a second backward pass (sites in
  a ``lax.scan`` body, or ``program="second"``) over a program that computes in ``narrow``
  (:func:`narrow_dtype`), a dtype narrower than float32 (see above); ``None`` where it is not."""
  sites = (*taps.values(), *probes.values())
  if narrow is None or not sites:
    return None
  if any(s.view.in_scan for s in sites):
    return "its parameters are used inside a lax.scan body"
  return "program='second' was asked for" if program == "second" else None
