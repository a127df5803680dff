"""Per-example clipped gradient sums from ghost norms: the program analysis behind them.

:func:`clipped_sum` computes ``sum_e c_e grad_e`` (``c_e`` from each example's gradient norm)
without forming the examples' gradients where it can. It traces the objective on one
example and reads the jaxpr: each differentiated leaf is followed through layout-only
operations (converts, reshapes, transposes, broadcasts) to its *sites*, the operations that
use it, and a leaf whose every use has a rule below gets its per-example squared norm in
closed form from the site's other operand and the site output's cotangent:

===================================  ==========================================================
site                                 per-example squared norm
===================================  ==========================================================
``dot_general`` (dense, attention,   ``sum_h |A_h^T G_h|^2`` (A: the activation's rows, G: the
output head)                         output cotangent's, h: shared batch dims), as the Gram
                                     form ``<A A^T, G G^T>`` or directly, whichever is cheaper
``gather`` of rows (embeddings)      ``sum_t |s_t|^2 / n_t`` (``s_t``: the summed ``g_u`` with
                                     ``i_u = i_t``, ``n_t`` of them), or the rows' segment
                                     sums, whichever is cheaper
``dynamic_slice`` (and a ``slice``     ``|g|^2`` (one window: no two entries overlap)
after a reshape)
``add``/``sub``/``mul``/``div`` with  ``|vjp(g)|^2``, the leaf-sized gradient formed in the
a broadcast leaf (biases, scales),   backward pass and reduced at once
``conv_general_dilated`` kernels
===================================  ==========================================================

The rule that holds DP-SGD's sensitivity bound: an operation enters the analysis only where
its rule is exact; anything else (a rounding such as ``reduce_precision`` or a widening
convert, a complex value, a gather mode it does not follow, a custom rule that is not the
identity) falls back for that leaf, to its materialised per-example gradient. A sign
(``neg``) is carried with the view into the cross terms. Every numerical form that could
read a norm too small is guarded: a Gram form whose terms cancel is replaced by the direct
form (``_GRAM_TRUST``), squared norms are carried wide in three parts scaled by exact powers
of two (no overflow, no underflow), book-keeping forms the clipped sum in float32 from the
values the norms were read from, and a second backward pass in a dtype narrower than float32,
which does not scale with its cotangent, is never run (``_narrow_second_pass``: the program is
materialised, or refused under ``strict``). docs/dp-sgd.md, "What the sensitivity bound rests
on", gives the bound that results, as measured by the differential fuzz.

Where no site sits in a ``lax.scan`` body, the clipped sum is formed by book-keeping (Bu et
al. 2023): one backward pass gives every site's output cotangent (a zero added to the site's
output is differentiated), the norms follow from the cotangents and the sites' other
operands, and each leaf's ``sum_e c_e grad_e`` is its sites' transposes at the cotangents
times ``c_e`` over the whole batch (``A^T diag(c) G`` for a dense layer), with no second
backward pass through the model. Inside a scan body, each single-use leaf's norm is computed
*inside* the backward pass instead: the site's output goes through an identity with a custom
VJP whose backward rule adds the site's norm to the cotangent of a per-example scalar, so no
cotangent is stacked over the iterations. A leaf used at several sites (tied input and
output embeddings) whose sites are all row gathers and matrix products gets its cross terms
``2 <G_s, G_t>`` from the sites' stored activations and cotangents. A static
``slice`` is followed like a layout operation, keeping the region of the leaf it holds: a leaf
whose sites use pairwise disjoint regions (a stacked weight indexed in a Python loop, a matrix
split into halves) needs no cross terms, as the sites' gradients have disjoint supports. Sites
inside ``jit``, ``checkpoint`` (remat) and ``lax.scan`` bodies count (a stacked leaf entering a
scan as ``xs`` gives each iteration its own slice, so the iterations' norms add). A
``custom_jvp`` whose derivative is the identity in the leaf (its tangent rule returns the
leaf's tangent as one output and uses it nowhere else, whatever its primal value) is seen
through: that output is the leaf for the analysis (the Flax NNX adapter passes every
parameter through such a call). Anything else (a leaf under ``sin``, entering a scan as a
constant or a carry, inside another ``custom_jvp``) either gets its per-example gradient
materialised, that leaf only, or, with ``strict=True``, raises an error naming the primitive
and the leaf.

With sites in a scan body, the clipped sum is one more backward pass over the same forward
pass: the first call of the VJP gives the norms (the weights' cotangents it would give are
dead code), the second, with cotangents ``c_e``, gives ``sum_e c_e grad_e``. Both passes read
the forward pass's residuals; inside the scan body, cheap elementwise values among them are
recomputed per iteration (a ``jax.checkpoint`` policy) rather than stacked over the
iterations.

Inside, every pass over the traced program (the analysis, the forward pass with its taps and
probes, book-keeping's leaf operands) is a :class:`_Walk`, which alone follows ``jit``,
``checkpoint`` and ``scan`` bodies (:func:`_body`); each kind of site above is one
:class:`_SiteRule` record of :data:`_SITE_RULES` (which uses it matches, its norm, its factor
form for cross terms).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxaccum._core import _reduce, _sharding, _stats
from jaxaccum._core._types import PyTree

_HIGHEST = jax.lax.Precision.HIGHEST

# Operations that only move or relabel a leaf's entries, or flip their signs: the leaf's
# gradient through them is the gradient with respect to their output, moved back (and its
# signs flipped back: ``neg``, which a view carries as its ``sign``, so that two uses' cross
# term keeps its sign). ``convert_element_type`` is one of them only where the cotangent's
# conversion back is exact (:func:`_exact_convert`); a rounding (``reduce_precision``, a
# widening convert, whose transpose rounds the cotangent) is not, and falls back.
_LAYOUT = frozenset({"convert_element_type", "reshape", "transpose", "squeeze", "copy",
                     "copy_p", "neg"})
# The gather modes whose transpose :func:`_gather_rows` follows (any other: the site's own
# transpose, ``"direct"``).
_ROW_GATHER_MODES = (jax.lax.GatherScatterMode.CLIP, jax.lax.GatherScatterMode.FILL_OR_DROP,
                     jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
_REMATS = frozenset({"remat2", "checkpoint", "remat"})
_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "add_any"})
# Cheap elementwise results that a backward pass reads (tanh's ``1 - y``, a LayerNorm's
# normalised rows, a residual stream's sums). Inside a scan body with sites, the policy
# :func:`_saved` recomputes them in each iteration's backward pass rather than stacking them
# over the iterations for the two backward passes to read.
_RECOMPUTED = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "square",
    "integer_pow", "one_minus_square", "select_n", "convert_element_type", "broadcast_in_dim",
    "reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p"})


def _saved(prim: Any, *_: Any, **__: Any) -> bool:
  """The ``jax.checkpoint`` policy of a scan body with sites (see ``_RECOMPUTED``)."""
  return prim.name not in _RECOMPUTED


@dataclasses.dataclass(frozen=True)
class _View:
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
class _Site:
  """One use of a leaf with a norm rule: the equation at ``path``, how it uses the leaf, and
  the rule of its kind (one of :data:`_SITE_RULES`)."""

  leaf: int
  path: tuple[int, ...]
  rule: _SiteRule
  eqn: Any
  pos: int  # which operand of eqn is the leaf's view
  view: _View
  batched: bool  # whether an operand other than the view depends on the example


@dataclasses.dataclass
class _Analysis:
  sites: dict[int, list[_Site]] = dataclasses.field(default_factory=dict)
  bad: dict[int, str] = dataclasses.field(default_factory=dict)  # leaf -> primitive

  def use(self, site: _Site) -> None:
    self.sites.setdefault(site.leaf, []).append(site)

  def unknown(self, leaf: int, what: str) -> None:
    self.bad.setdefault(leaf, what)


@jax.custom_jvp
def _tanh(x: jax.Array) -> jax.Array:
  """``tanh`` whose derivative ``(1 - y)(1 + y)`` (``y = tanh(x)``) is read as ``1 - y``.

  The ghost step's forward pass runs a loss's ``tanh`` through this. Its two backward passes
  then read ``y`` (the next layer's input, kept anyway) and ``1 - y``, which XLA recomputes
  in each of them. jax 0.12's own rule reads ``one_minus_square(y)``, which XLA keeps in a
  buffer of its own when two backward passes read it: on a six-layer tanh MLP (256 rows in 4
  micro-batches) the whole step held 437 KB with it and 339 KB with this rule (jax 0.10:
  340 KB with either; plain accumulation 315 KB).
  Same values: jax 0.12 evaluates ``1 - y^2`` as ``(1 + y)(1 - y)`` too. Only a second
  derivative differs, by float32 round-off of terms of order 1 near ``x = 0`` (jax 0.12 forms
  ``-2 y y'`` directly; jax 0.10 as here).
  """
  return jax.lax.tanh(x)


@_tanh.defjvp
def _tanh_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
  (x,), (t,) = primals, tangents
  y = jax.lax.tanh(x)
  u = t * (1 - y)
  return y, u + u * y


def _bind(eqn: Any, args: Sequence[Any]) -> Any:
  return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))


def _is_row_gather(eqn: Any) -> bool:
  """``operand[indices]`` along axis 0: the form of ``jnp.take(table, ids, axis=0)``."""
  dn = eqn.params["dimension_numbers"]
  op, idx = (v.aval for v in eqn.invars)
  return (tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
          and not tuple(dn.operand_batching_dims) and idx.shape[-1:] == (1,)
          and tuple(eqn.params["slice_sizes"]) == (1, *op.shape[1:])
          and tuple(dn.offset_dims) == tuple(range(idx.ndim - 1, idx.ndim - 2 + op.ndim)))


def _extend(v: _View, eqn: Any) -> _View:
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


def _sliced(v: _View, eqn: Any) -> _View | None:
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


def _disjoint(a: tuple, b: tuple) -> bool:
  """Whether two regions share no entry: along some dimension, no index."""
  return any(np.intersect1d(np.arange(*x), np.arange(*y)).size == 0
             for x, y in zip(a, b, strict=True))


def _scan_counts(eqn: Any) -> tuple[int, int]:
  """A ``scan`` equation's numbers of constants and carries (jax 0.10; 0.12's ``ft_in``)."""
  params = eqn.params
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].update(list(eqn.invars)).unpack()
  return len(consts), len(carry)


# --- sub-programs: the one walk into jit, checkpoint and scan bodies -----------------------------


@dataclasses.dataclass(frozen=True)
class _Body:
  """The program a ``jit`` (``pjit``, ``closed_call``), ``checkpoint`` (remat) or ``scan``
  equation runs: its inputs and outputs are the equation's, in order (a scan's inputs: its
  ``num_consts`` constants, ``num_carry`` carries and one iteration's slices of its ``xs``;
  its outputs: the carries, then one iteration's ``ys``)."""

  kind: str  # "call", "remat" or "scan"
  jaxpr: Any  # jax.extend.core.Jaxpr
  consts: tuple  # the values of jaxpr's constvars
  num_consts: int = 0
  num_carry: int = 0


def _body(eqn: Any) -> _Body | None:
  """The program ``eqn`` runs, where it is a ``jit``, ``checkpoint`` or ``scan``; else ``None``
  (other control flow and custom rules are not followed: see each pass)."""
  name = eqn.primitive.name
  if name in _CALLS:
    sub = eqn.params["jaxpr"]
    return _Body("call", sub.jaxpr, tuple(sub.consts))
  if name in _REMATS:
    return _Body("remat", eqn.params["jaxpr"], ())
  if name == "scan":
    sub = eqn.params["jaxpr"]
    return _Body("scan", sub.jaxpr, tuple(sub.consts), *_scan_counts(eqn))
  return None


def _programs(eqn: Any) -> Iterator[Any]:
  """Every program ``eqn`` holds in its params, followed or not (jit, remat, scan, cond and
  while bodies, custom rules' primal programs), as open jaxprs."""
  for v in eqn.params.values():
    for sub in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(sub, jcore.ClosedJaxpr):
        yield sub.jaxpr
      elif isinstance(sub, jcore.Jaxpr):
        yield sub


class _Walk:
  """A pass over a program, equation by equation, into the bodies :func:`_body` reads: the
  recursion every pass here shares.

  Each variable holds what the pass computes for it (``missing`` where nothing was written;
  a literal reads as :meth:`literal` says). A pass gives :meth:`visit`, the outputs of an
  equation it does not enter, and may override :meth:`enter`, the outputs of one it does
  (by default its body walked on its inputs, its path the equation's).
  """

  missing: Any = None

  def literal(self, a: Any) -> Any:
    del a
    return self.missing

  def visit(self, eqn: Any, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    raise NotImplementedError

  def enter(self, eqn: Any, body: _Body, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    del eqn
    return self.walk(body.jaxpr, ins, here)

  def read(self, env: dict, a: Any) -> Any:
    return self.literal(a) if isinstance(a, jcore.Literal) else env.get(a, self.missing)

  def walk(self, jaxpr: Any, args: Sequence[Any], path: tuple[int, ...] = (),
           consts: Sequence[Any] | None = None) -> list[Any]:
    """``jaxpr``'s outputs from its inputs ``args`` (and constants ``consts``, where the pass
    reads them); ``path``: the indices of the equations that hold it, outermost first."""
    env: dict[Any, Any] = {}
    if consts is not None:
      env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for i, eqn in enumerate(jaxpr.eqns):
      here = (*path, i)
      ins = [self.read(env, a) for a in eqn.invars]
      body = _body(eqn)
      outs = self.visit(eqn, ins, here) if body is None else self.enter(eqn, body, ins, here)
      env.update(zip(eqn.outvars, outs, strict=True))
    return [self.read(env, a) for a in jaxpr.outvars]


def _first_order_deps(eqn: Any, deps: Sequence[bool]) -> list[bool]:
  """Which outputs of an equation the walk does not enter depend on the example (``deps``:
  which inputs do): all of them where an input does, except for an equation that holds a
  program directly among its params (``while``, a custom rule), which says no (a ``cond``'s
  branches, a tuple, are not seen there: its outputs count as dependent, as they are under
  ``jax.vmap``). Where unsure this says no: the one use of the answer (:class:`_Run` making
  a tapped output batched) is safe then."""
  if not any(deps):
    return [False] * len(eqn.outvars)
  if any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in eqn.params.values()):
    return [False] * len(eqn.outvars)
  return [True] * len(eqn.outvars)


def _identity_output(eqn: Any, k: int) -> int | None:
  """The output of the ``custom_jvp_call`` ``eqn`` whose derivative is the identity in input
  ``k`` (and that alone depends on it), or ``None``.

  Read from the call's own tangent rule, traced on ``eqn``'s avals with input ``k``'s tangent
  alone: an output that *is* that tangent, every other output independent of it.
  """
  args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]

  def tangents(args, t):
    def one(x):
      return _bind(eqn, [*args[:k], x, *args[k + 1:]])

    return jax.jvp(one, (args[k],), (t,))[1]

  try:
    jaxpr = jax.make_jaxpr(tangents)(args, args[k]).jaxpr
  except (TypeError, ValueError, NotImplementedError):
    return None
  t = jaxpr.invars[-1]
  dep = {t}  # what depends on t, conservatively: every output of an eqn that reads it
  for e in jaxpr.eqns:
    if any(not isinstance(a, jcore.Literal) and a in dep for a in e.invars):
      dep.update(e.outvars)
  outs = [not isinstance(a, jcore.Literal) and a in dep for a in jaxpr.outvars]
  same = [j for j, a in enumerate(jaxpr.outvars) if a is t]
  return same[0] if len(same) == 1 and sum(outs) == 1 else None


class _Analyse(_Walk):
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

  def enter(self, eqn: Any, body: _Body, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
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
        v = _View(v.leaf, tuple(range(aval.ndim)), aval, (), here)
      inner.append((v, d))
    outs = self.walk(body.jaxpr, inner, here)
    for v, _ in outs:
      if v is not None:
        self.result.unknown(v.leaf, "scan (returned from the body)")
    carries = [d and o for (_, d), (_, o) in zip(ins[nc:nc + nk], outs[:nk], strict=True)]
    return [(None, d) for d in (*carries, *(o for _, o in outs[nk:]))]

  def _views(self, eqn: Any, vs: list[Any], ds: list[bool],
             here: tuple[int, ...]) -> list[_View | None]:
    """The views of an equation's outputs (a use followed, a site recorded, or the leaves'
    uses marked unknown)."""
    result, name = self.result, eqn.primitive.name
    outs: list[_View | None] = [None] * len(eqn.outvars)
    hit = [k for k, v in enumerate(vs) if v is not None]
    leaves = {vs[k].leaf for k in hit}
    first = vs[hit[0]]
    if _complex(eqn):
      for leaf in leaves:
        result.unknown(leaf, f"{name} (complex values)")
      return outs
    if name in _LAYOUT or name == "broadcast_in_dim":
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
      j = _identity_output(eqn, hit[0])
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
      rule = _rule_for(eqn, k, first)
      if rule is not None:
        batched = any(d for j, d in enumerate(ds) if j != k)
        result.use(_Site(first.leaf, here, rule, eqn, k, first, batched))
        return outs
    for leaf in leaves:
      result.unknown(leaf, name)
    return outs


def _analyse(jaxpr: Any, views: Sequence[_View | None], deps: Sequence[bool]) -> _Analysis:
  """The sites of the leaves whose views enter ``jaxpr`` (the traced function), and the uses
  without a rule. ``deps``: which inputs depend on the example."""
  result = _Analysis()
  for v, _ in _Analyse(result).walk(jaxpr, list(zip(views, deps, strict=True))):
    if v is not None:
      result.unknown(v.leaf, "the function's output")
  return result


# --- norms ------------------------------------------------------------------------------------


def _f32(x: jax.Array) -> jax.Array:
  """``x`` in float32 (complex64 where complex: a cast to float32 would drop the imaginary
  part)."""
  x = jnp.asarray(x)
  return x.astype(jnp.complex64 if jnp.iscomplexobj(x) else jnp.float32)


# A squared norm is carried *wide*: ``[q, q * 2^-128, q * 2^128]`` in float32 (sums of
# squares of the entries, and of the entries times 2^-64 and 2^64; products formed from
# operands divided by their largest entry, then scaled back by exact powers of two), so that
# the second part stays finite where ``q`` overflows (a norm above about 1.8e19), the third
# keeps full precision where ``q`` underflows or is subnormal (a norm below about 1e-19),
# and the first keeps full precision between. Wide values add; :func:`_wide_norm` reads the
# norm back: no second pass and no branch, which would hold the forward pass's residuals in
# buffers of their own.
_WIDE_SHIFT = 128
_WIDE_PARTS = 3
# The parts' shifts, as powers of two: q = part_k * 2^-shift_k.
_WIDE_SHIFTS = (0, -_WIDE_SHIFT, _WIDE_SHIFT)


def _peak(x: jax.Array) -> jax.Array:
  """``x``'s largest absolute entry, or 1 where that is 0 or not finite."""
  return _stats.divisor(jnp.max(jnp.abs(x), initial=0.0))


def _pow2(k: jax.Array) -> jax.Array:
  """``2^k`` in float32, exactly, for integers ``-126 <= k <= 127``."""
  return jax.lax.bitcast_convert_type((k + 127).astype(jnp.int32) << 23, jnp.float32)


def _ldexp(m: jax.Array, e: jax.Array) -> jax.Array:
  """``m * 2^e`` in float32 with ``e`` any int32 (a few hundred at most): applied in steps
  of at most 2^120 towards ``e``, so that no step under- or overflows before the result
  does (a product of several factors in another order can underflow to 0 where the result
  is of order 1)."""
  for _ in range(7):  # |e| <= 840: four peaks' exponents and a shift
    step = jnp.clip(e, -120, 120)
    m = m * _pow2(step)
    e = e - step
  return m


def _split(*factors: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(m, e)`` with ``prod(factors) = m * 2^e``, ``m`` in [2^-k, 1) for ``k`` factors: the
  factors' mantissas multiplied, their exponents added (no product of them formed)."""
  m, e = jnp.ones((), jnp.float32), jnp.zeros((), jnp.int32)
  for f in factors:
    mf, ef = jnp.frexp(jnp.asarray(f, jnp.float32))
    m, e = m * mf, e + ef.astype(jnp.int32)
  return m, e


def _wide_exp(s: jax.Array, e: jax.Array) -> jax.Array:
  """The wide value of ``s * 2^e`` (``e``: an int32 exponent)."""
  return jnp.stack([_ldexp(s, e + k) for k in _WIDE_SHIFTS])


def _wide(s: jax.Array, *factors: jax.Array) -> jax.Array:
  """The wide value of ``s * prod(factors)`` (``s``: computed from operands divided by the
  ``factors``, so that it is finite). The factors' mantissas multiply ``s`` (each in
  [0.5, 1)) and their exponents add, so the scaling cannot underflow or overflow before the
  value itself does."""
  m, e = _split(*factors)
  return _wide_exp(s * m, e)


def _wide_sum_sq(x: jax.Array) -> jax.Array:
  """The wide squared norm of ``x``'s entries: three sums of squares (one pass, no peak)."""
  x = _stats.magnitude(x)  # a complex entry adds |x|^2 = re^2 + im^2
  parts = []
  for k in _WIDE_SHIFTS:
    # behind a barrier: XLA would otherwise form the scaled copies broadcast, in memory
    scale = jax.lax.optimization_barrier(jnp.float32(2.0 ** (k // 2)))
    parts.append(jnp.sum(jnp.square(x * scale)) if k else jnp.sum(jnp.square(x)))
  return jnp.stack(parts)


def _wide_norm(w: jax.Array) -> jax.Array:
  """The norm of wide squared norms ``w`` (``(..., 3)``): NaN or inf where the norm is."""
  q, lo, up = w[..., 0], w[..., 1], w[..., 2]
  half = _WIDE_SHIFT // 2
  return jnp.where(jnp.isfinite(q),
                   jnp.where(q < 2.0 ** -half, jnp.sqrt(up) * 2.0 ** -half, jnp.sqrt(q)),
                   jnp.sqrt(lo) * 2.0 ** half)


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


def _gram_cheaper(t: int, p: int, q: int) -> bool:
  """Whether ``<A A^T, B B^T>`` (``T^2 (P + Q)`` products) beats ``|A^T B|^2`` (``T P Q``)."""
  return t * (p + q) <= p * q


# The Gram forms below sum products that can cancel: ``sum_{t,u} (a_t . a_u)(b_t . b_u)`` is
# ``|A^T B|^2`` as a difference of terms up to ``S = (sum_t |a_t| |b_t|)^2``, so float32
# rounding costs it about ``S * 2^-24`` (``|A^T B|^2`` read as 0.79 where it is 9, or as a
# negative number). Where ``S`` exceeds ``|A^T B|^2`` (as read) by more than this factor, the
# Gram form's value is not trusted: the micro-batch's norms through that site are formed
# directly instead (``|A^T B|^2`` entry by entry, whose rounding is about ``sqrt(S) * 2^-24``
# in the norm), in chunks so that they hold no more than the Gram form's operands. At this
# factor the Gram form's rounding stays below about 1e-4 of the norm.
_GRAM_TRUST = 1e3
# The ``jax.vmap`` axis of the examples, which the guard's decision is taken over (one
# branch for the whole micro-batch, so that the direct form runs only where it is needed).
_EXAMPLES = "_jaxaccum_ghost_examples"


def _guarded(lost: jax.Array, direct: Callable[..., jax.Array], value: jax.Array,
             *operands: Any) -> jax.Array:
  """``direct(*operands)`` where ``lost`` holds for any example of the micro-batch (one
  branch for all, decided over the vmap axis ``_EXAMPLES``), else ``value``. Under
  ``shard_map`` (whose varying axes refuse a collective over a vmap axis) or outside that
  vmap, each example takes its own form, both computed."""
  if _sharding.varying(lost):
    return jnp.where(lost, direct(*operands), value)
  try:
    lost = jax.lax.psum(lost.astype(jnp.int32), _EXAMPLES) > 0
  except NameError:
    pass
  return jax.lax.cond(lost, direct, lambda *_: value, *operands)


def _untrusted(s: jax.Array, q: jax.Array) -> jax.Array:
  """Whether a Gram sum ``q`` whose terms' magnitudes add up to ``s`` may have lost its
  digits (also where it reads negative or not finite, so the direct form shows that)."""
  return ~(s <= _GRAM_TRUST * q) & jnp.isfinite(s)


def _chunked_sq(pairs: Sequence[tuple[str, jax.Array, jax.Array]], m: int,
                budget: int) -> jax.Array:
  """``sum_h |sum_j X_jh^T Y_jh|^2`` formed directly, over chunks of ``X``'s ``m`` columns.

  ``pairs``: ``("dense", X (H, T, m), Y (H, T, n))`` or ``("index", i (H, T), Y)`` (``X``'s
  row ``t`` is one-hot at ``i_t``; ``-1``: none). A chunk holds about ``budget`` entries.
  """
  h, n = pairs[0][2].shape[0], pairs[0][2].shape[2]
  k = max(1, min(m, budget // max(1, h * n)))
  chunks = -(-m // k)
  padded = [(kind, jnp.pad(x, ((0, 0), (0, 0), (0, chunks * k - m))) if kind == "dense" else x,
             y) for kind, x, y in pairs]

  def body(c, total):
    start = c * k
    block = jnp.zeros((h, k, n), jnp.float32)
    for kind, x, y in padded:
      if kind == "dense":
        xc = jax.lax.dynamic_slice_in_dim(x, start, k, axis=2)
      else:
        xc = (x[..., None] == start + jnp.arange(k)).astype(jnp.float32)
      block = block + jnp.einsum("htk,htn->hkn", xc, y, precision=_HIGHEST)
    return total + jnp.sum(jnp.square(block))

  axes = tuple(set().union(*(_sharding.varying(a) for _, x, y in pairs for a in (x, y))))
  return jax.lax.fori_loop(0, chunks, body, _sharding.vary(jnp.zeros((), jnp.float32), axes))


def _sq_outer(a: jax.Array, b: jax.Array) -> jax.Array:
  """Wide ``sum_h |A_h^T B_h|^2``, by the Gram form or directly, whichever is cheaper (the
  Gram form guarded: see ``_GRAM_TRUST``)."""
  h, t, p = a.shape
  q = b.shape[2]
  a, b = _f32(a), _f32(b)
  pa, pb = _peak(a), _peak(b)
  a, b = a / pa, b / pb
  if t == 1:  # one position: |a|^2 |b|^2, a product of sums of squares, nothing cancels
    return _wide(jnp.sum(jnp.sum(jnp.square(a), (1, 2)) * jnp.sum(jnp.square(b), (1, 2))),
                 pa, pa, pb, pb)
  if _gram_cheaper(t, p, q):
    ga = jnp.einsum("htp,hup->htu", a, a, precision=_HIGHEST)
    gb = jnp.einsum("htq,huq->htu", b, b, precision=_HIGHEST)
    gram = jnp.sum(ga * gb)
    terms = jnp.sum(jnp.square(jnp.sum(jnp.sqrt(jnp.sum(jnp.square(a), -1)
                                                 * jnp.sum(jnp.square(b), -1)), -1)))
    s = _guarded(_untrusted(terms, gram),
                 lambda a, b: _chunked_sq([("dense", a, b)], p, h * t * (p + q)), gram, a, b)
    return _wide(s, pa, pa, pb, pb)
  return _wide(jnp.sum(jnp.square(jnp.einsum("htp,htq->hpq", a, b, precision=_HIGHEST))),
               pa, pa, pb, pb)


def _gather_rows(eqn: Any, idx: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(i, rows)``: the row each cotangent row ``rows[t]`` adds to (-1: dropped)."""
  rows_of = eqn.invars[0].aval.shape[0]
  i = idx.reshape(-1)
  rows = _f32(g).reshape(i.shape[0], -1)
  if eqn.params["mode"] == jax.lax.GatherScatterMode.CLIP:
    i = jnp.clip(i, 0, rows_of - 1)
  else:  # FILL_OR_DROP, and PROMISE_IN_BOUNDS (jnp's default): the forward pass clamps an
    # index out of range, but the transpose (a scatter-add) drops its row
    i = jnp.where((i >= 0) & (i < rows_of), i, -1)
  return i, rows


def _index_gram_cheaper(t: int, d: int, rows: int) -> bool:
  """Whether the index-equality Gram (``T^2 (D + 1)``) beats segment sums (``(V + T) D``)."""
  return t * t * (d + 1) <= (rows + t) * d


def _sq_gather(eqn: Any, idx: jax.Array, g: jax.Array) -> jax.Array:
  """Wide squared norm of a row gather's gradient (rows ``idx``, cotangent ``g``).

  The gradient's row ``r`` is ``S_r``, the sum of the cotangent rows ``g_t`` with
  ``i_t = r``. Where the table has many rows, each position's ``s_t = S_{i_t}`` is formed
  from the index-equality matrix (``T^2 D`` products) and ``sum_r |S_r|^2`` is
  ``sum_t |s_t|^2 / n_t`` (``n_t``: how many positions share ``i_t``), a sum of positive
  terms; else the rows' segment sums.
  """
  i, rows = _gather_rows(eqn, idx, g)
  peak = _peak(rows)
  rows = rows / peak
  t, d = rows.shape
  rows_of = eqn.invars[0].aval.shape[0]
  if _index_gram_cheaper(t, d, rows_of):
    same = ((i[:, None] == i[None, :]) & (i[:, None] >= 0)).astype(jnp.float32)
    sums = jnp.einsum("tu,ud->td", same, rows, precision=_HIGHEST)
    counts = jnp.maximum(jnp.sum(same, axis=1), 1.0)
    return _wide(jnp.sum(jnp.sum(jnp.square(sums), axis=1) / counts), peak, peak)
  sums = jax.ops.segment_sum(jnp.where((i >= 0)[:, None], rows, 0.0), jnp.maximum(i, 0),
                             num_segments=rows_of)
  return _wide(jnp.sum(jnp.square(sums)), peak, peak)


def _site_fn(site: _Site, others: Sequence[Any]) -> Callable[[jax.Array], jax.Array]:
  """The site's output as a function of its leaf view's anchor (linear in it), in float32
  or wider (:func:`_bind_wide`), as book-keeping forms the clipped sum through it."""
  def fn(w):
    for e in site.view.post:
      w = _bind_wide(e, [w])
    args = list(others)
    args.insert(site.pos, w)
    return _bind_wide(site.eqn, args)
  return fn


def _zero_cotangent(x: Any) -> Any:
  if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact):
    return _sharding.vary(jnp.zeros_like(x), tuple(_sharding.varying(x)))
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _tap(site: _Site, axes: tuple, leaf_axes: tuple, row: int,
         rows: int) -> Callable[..., Any]:
  """``tap(y, saved, acc) = y``, whose backward rule adds ``site``'s norm to ``acc``'s cotangent
  (its row ``row`` of ``rows``: the leaf's clip group).

  ``axes``, ``leaf_axes``: the ``shard_map`` axes ``acc`` and the leaf vary over.
  """

  @jax.custom_vjp
  def tap(y, saved, acc):
    del saved, acc
    return y

  def fwd(y, saved, acc):
    del acc
    return y, saved

  def bwd(saved, g):
    sq = _sharding.vary(site.rule.sq_norm(site, saved, g, leaf_axes), axes)
    return g, jax.tree.map(_zero_cotangent, saved), _in_row(sq, row, rows)

  tap.defvjp(fwd, bwd)
  return tap


def _in_row(sq: jax.Array, row: int, rows: int) -> jax.Array:
  """Wide squared norms ``sq`` (``(..., parts)``) placed in row ``row`` of ``rows`` groups
  (``(..., rows, parts)``, zeros elsewhere)."""
  out = jnp.zeros((*sq.shape[:-1], rows, sq.shape[-1]), sq.dtype)
  return out.at[..., row, :].set(sq)


# --- a leaf used at several sites: cross terms from stored factors -----------------------------


def _sides(site: _Site) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """The leaf dimensions on the site's two factors, or ``None`` if it has no factor form."""
  v = site.view
  if site.rule.sides is None or v.post or v.in_scan or v.region is not None or v.perm is None:
    return None
  return site.rule.sides(site)


def _apart(sites: Sequence[_Site]) -> bool:
  """Whether the sites use pairwise disjoint static slices of one base: no cross terms."""
  views = [s.view for s in sites]
  return (all(v.region is not None and v.base == views[0].base for v in views)
          and all(_disjoint(a.region, b.region)  # type: ignore[arg-type]
                  for i, a in enumerate(views) for b in views[i + 1:]))


def _cross_ok(sites: Sequence[_Site]) -> bool:
  sides = [_sides(s) for s in sites]
  if any(s is None for s in sides):
    return False
  first = sides[0]
  assert first is not None
  return all(s in (first, first[::-1]) for s in sides)


def _factor(site: _Site, other: jax.Array, g: jax.Array, flip: bool) -> tuple[Any, Any]:
  """One example's ``(A, B)`` with the leaf's gradient through ``site`` equal to ``A^T B``.

  Each side is ``("dense", M)`` (rows ``T``, the side's leaf dimensions flattened in leaf
  order) or ``("index", i)`` (a one-hot row per entry of ``i``; ``-1``: no row).
  """
  assert site.rule.factor is not None  # a site with sides (_cross_ok) has a factor form
  x, y = site.rule.factor(site, other, g)
  return (y, x) if flip else (x, y)


def _gram(s: Any, t: Any) -> jax.Array:
  """``S T^T`` of two factor sides, ``(T_s, T_t)``."""
  (ks, ms), (kt, mt) = s, t
  if ks == "dense" and kt == "dense":
    return jnp.einsum("tp,up->tu", ms, mt, precision=_HIGHEST)
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
  peak = _peak(m)
  return (kind, m / peak), peak


def _side_norms(side: Any) -> jax.Array:
  """Each row's L2 norm of a factor side (1 for an index side's rows that hold one)."""
  kind, m = side
  if kind == "index":
    return (m >= 0).astype(jnp.float32)
  return jnp.sqrt(jnp.sum(jnp.square(m), axis=-1))


def _multi_sq_norm(sites: Sequence[_Site], others: Sequence[Any],
                   cots: Sequence[Any]) -> jax.Array:
  """One example's wide squared norm of a leaf's gradient summed over its sites, cross
  terms included.

  The sites' terms are brought to one scale (each site's factors' peaks, relative to the
  largest product of them, as exact powers of two) and summed in Gram form, with the
  guard of ``_GRAM_TRUST``: where the terms cancel, the leaf's gradient is formed directly
  in chunks (its rows from the first factor side).
  """
  first = _sides(sites[0])
  factors = [tuple(map(_unit, _factor(s, o, g, _sides(s) != first)))
             for s, o, g in zip(sites, others, cots, strict=True)]
  split = [_split(pa, pb) for (_, pa), (_, pb) in factors]
  top = functools.reduce(jnp.maximum, [e for _, e in split])
  rel = [_ldexp(m, e - top) for m, e in split]  # each site's scale over 2^top, at most 1
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
    return _chunked_sq([(k, x, y) for k, (x, y) in zip(kinds, arrays, strict=True)], m, budget)

  s = _guarded(_untrusted(terms, total), direct, total, arrays)
  return _wide_exp(s, 2 * top)


# --- the site rules: one record per kind of site ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SiteRule:
  """How one kind of site gets its leaf's per-example squared norm.

  ``match(eqn, pos, view)``: whether leaf view ``view``, operand ``pos`` of ``eqn``, is used
  at a site of this kind (:data:`_SITE_RULES` is tried in order: the first match wins).
  ``sq_norm(site, saved, g, axes)``: one example's wide squared norm of the leaf's gradient
  through the site, from its other operands ``saved`` and its output's cotangent ``g``
  (``axes``: the ``shard_map`` axes the leaf varies over). ``sides(site)``: the leaf
  dimensions on the two factors of its factor form ``A^T B`` (``None``: none at this site),
  and ``factor(site, other, g)``: one example's ``(A, B)`` (:func:`_factor`), both ``None``
  for a kind without a factor form (no cross terms with another site). ``saves_operands``:
  whether a tapped site keeps its other operands for its backward rule. ``forms_gradient``:
  whether the norm is read from the leaf-sized per-example gradient (:func:`_little_saved`).
  """

  name: str
  match: Callable[[Any, int, _View], bool]
  sq_norm: Callable[[_Site, Sequence[Any], jax.Array, tuple], jax.Array]
  sides: Callable[[_Site], tuple[tuple[int, ...], tuple[int, ...]] | None] | None = None
  factor: Callable[[_Site, Any, jax.Array], tuple[Any, Any]] | None = None
  saves_operands: bool = True
  forms_gradient: bool = False


def _is_dot(eqn: Any, pos: int, view: _View) -> bool:
  """A matrix product (dense, attention, output head) of the leaf's view itself."""
  del pos
  return eqn.primitive.name == "dot_general" and not view.post


def _dot_sq_norm(site: _Site, saved: Sequence[Any], g: jax.Array, axes: tuple) -> jax.Array:
  del axes
  a, b, _, _ = _dot_factors(site.eqn, site.pos, saved[0], g)
  return _sq_outer(a, b)


def _dot_sides(site: _Site) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  perm = site.view.perm
  assert perm is not None  # (_sides)
  (lc, rc), (lb, rb) = site.eqn.params["dimension_numbers"]
  pc, pb = (rc, rb) if site.pos == 1 else (lc, lb)
  if tuple(pb):
    return None
  pf = [d for d in range(len(perm)) if d not in tuple(pc)]
  return tuple(sorted(perm[d] for d in pc)), tuple(sorted(perm[d] for d in pf))


def _dot_factor(site: _Site, other: jax.Array, g: jax.Array) -> tuple[Any, Any]:
  perm = site.view.perm
  assert perm is not None  # (_sides)
  a, b, pc, pf = _dot_factors(site.eqn, site.pos, other, g)
  shape = site.eqn.invars[site.pos].aval.shape

  def order(m, dims):
    m = m.reshape(m.shape[1], *(shape[d] for d in dims))
    ranks = np.argsort([perm[d] for d in dims])
    return _f32(jnp.transpose(m, (0, *(1 + ranks))).reshape(m.shape[0], -1))

  return ("dense", order(a, pc)), ("dense", order(b, pf))


def _is_row_gather_site(eqn: Any, pos: int, view: _View) -> bool:
  """Rows of the leaf's view gathered (an embedding), in a mode :func:`_gather_rows` follows."""
  return (eqn.primitive.name == "gather" and pos == 0 and not view.post
          and _is_row_gather(eqn) and eqn.params["mode"] in _ROW_GATHER_MODES)


def _gather_sq_norm(site: _Site, saved: Sequence[Any], g: jax.Array, axes: tuple) -> jax.Array:
  del axes
  return _sq_gather(site.eqn, saved[0], g)


def _gather_sides(site: _Site) -> tuple[tuple[int, ...], tuple[int, ...]]:
  perm = site.view.perm
  assert perm is not None  # (_sides)
  return (perm[0],), tuple(sorted(perm[1:]))


def _gather_factor(site: _Site, other: jax.Array, g: jax.Array) -> tuple[Any, Any]:
  perm = site.view.perm
  assert perm is not None  # (_sides)
  i, rows = _gather_rows(site.eqn, other, g)
  rest = site.eqn.invars[0].aval.shape[1:]
  ranks = np.argsort([perm[d] for d in range(1, len(perm))])
  rows = jnp.transpose(rows.reshape(-1, *rest), (0, *(1 + ranks))).reshape(rows.shape[0], -1)
  return ("index", i), ("dense", rows)


def _is_window(eqn: Any, pos: int, view: _View) -> bool:
  """One window of the leaf's view (``dynamic_slice``; a ``slice`` after a reshape)."""
  return eqn.primitive.name in ("slice", "dynamic_slice") and pos == 0 and not view.post


def _window_sq_norm(site: _Site, saved: Sequence[Any], g: jax.Array, axes: tuple) -> jax.Array:
  del site, saved, axes  # no two entries of a window overlap: the cotangent's norm
  return _wide_sum_sq(g)


def _is_linear_use(eqn: Any, pos: int, view: _View) -> bool:
  """Any other use whose transpose this module forms: a product (also of a broadcast view),
  a gather or window of a broadcast view, a convolution's kernel, a bias add or a scale."""
  del view
  name = eqn.primitive.name
  return (name == "dot_general" or (name in ("gather", "slice", "dynamic_slice") and pos == 0)
          or (name == "conv_general_dilated" and pos == 1)
          or (name in _ELEMENTWISE and not (name == "div" and pos == 1)))


def _direct_sq_norm(site: _Site, saved: Sequence[Any], g: jax.Array,
                    axes: tuple) -> jax.Array:
  """The norm of the leaf-sized gradient, the site's transpose at ``g`` (in float32)."""
  anchor = site.view.anchor
  zero = _sharding.vary(_widened(jnp.zeros(anchor.shape, anchor.dtype)), axes)
  _, vjp = jax.vjp(_site_fn(site, saved), zero)
  return _wide_sum_sq(vjp(_widened(g))[0])


# The kinds of site, in the order they are tried (see the module's table); a use that none
# matches has no rule, and its leaf falls back.
_SITE_RULES = (
    _SiteRule("dot", _is_dot, _dot_sq_norm, _dot_sides, _dot_factor),
    _SiteRule("gather", _is_row_gather_site, _gather_sq_norm, _gather_sides, _gather_factor),
    _SiteRule("slice", _is_window, _window_sq_norm, saves_operands=False),
    _SiteRule("direct", _is_linear_use, _direct_sq_norm, forms_gradient=True),
)


def _rule_for(eqn: Any, pos: int, view: _View) -> _SiteRule | None:
  """The rule of the site where ``view`` is operand ``pos`` of ``eqn`` (``None``: no rule)."""
  return next((r for r in _SITE_RULES if r.match(eqn, pos, view)), None)


# --- the rewritten program --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  taps: dict[tuple[int, ...], _Site]
  probes: dict[tuple[int, ...], _Site]
  inside: frozenset[tuple[int, ...]]  # every proper prefix of a tap's or a probe's path
  groups: tuple[int, ...]  # each leaf's clip group (its row of the norms accumulator)

  @staticmethod
  def of(taps: dict, probes: dict, groups: Sequence[int]) -> _Plan:
    inside = {p[:k] for p in (*taps, *probes) for k in range(1, len(p))}
    return _Plan(taps, probes, frozenset(inside), tuple(groups))


class _Run(_Walk):
  """Evaluates a program with each tap's output tapped and each probe's output probed:
  ``probes``: each probe's path -> the zero added to its output (differentiated, it gives
  the output's cotangent); ``acts``: each probe's path -> its other operands (written)."""

  def __init__(self, plan: _Plan, acc: jax.Array, probes: dict, acts: dict):
    self.plan, self.acc, self.probes, self.acts = plan, acc, probes, acts

  def literal(self, a: Any) -> Any:
    return a.val

  def visit(self, eqn: Any, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    plan = self.plan
    if here in plan.taps:
      return [self._tapped(eqn, ins, plan.taps[here])]
    if here in plan.probes:
      site = plan.probes[here]
      self.acts[here] = tuple(jnp.asarray(v) for k, v in enumerate(ins) if k != site.pos)
      return [_bind(eqn, ins) + self.probes[here]]
    if eqn.primitive.name == "tanh" and not eqn.params.get("accuracy"):
      return [_tanh(ins[0])]
    out = _bind(eqn, ins)
    return out if eqn.primitive.multiple_results else [out]

  def _tapped(self, eqn: Any, vals: list[Any], site: _Site) -> Any:
    acc = self.acc
    others = tuple(jnp.asarray(v) for k, v in enumerate(vals) if k != site.pos)
    saved = others if site.rule.saves_operands else ()
    y = _bind(eqn, vals)
    if not site.batched:  # e.g. a static slice: make it per example, for its cotangent
      y = y + jnp.zeros((), y.dtype) * acc.reshape(-1)[0].astype(y.dtype)
    tap = _tap(site, tuple(_sharding.varying(acc)), tuple(_sharding.varying(vals[site.pos])),
               self.plan.groups[site.leaf], acc.shape[0])
    return tap(y, saved, acc)

  def enter(self, eqn: Any, body: _Body, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    if here not in self.plan.inside:  # no site inside: the equation as it is
      return self.visit(eqn, ins, here)
    if body.kind == "call":
      return self.walk(body.jaxpr, ins, here, body.consts)
    if body.kind == "remat":
      return self._remat(eqn, body, ins, here)
    return self._scan(eqn, body, ins, here)

  def _remat(self, eqn: Any, body: _Body, vals: list[Any], here: tuple[int, ...]) -> list[Any]:
    """A ``checkpoint`` body with sites, run under ``jax.checkpoint`` with its own policy."""
    plan = self.plan
    keys = [k for k in plan.probes if k[:len(here)] == here]

    def run(vals, acc, pv):
      sub = _Run(plan, acc, dict(zip(keys, pv, strict=True)), {})
      outs = sub.walk(body.jaxpr, vals, here, body.consts)
      return outs, [sub.acts[k] for k in keys]

    outs, got = jax.checkpoint(run, policy=eqn.params["policy"],
                               prevent_cse=eqn.params["prevent_cse"])(
                                   vals, self.acc, [self.probes[k] for k in keys])
    self.acts.update(zip(keys, got, strict=True))
    return outs

  def _scan(self, eqn: Any, body: _Body, vals: list[Any], here: tuple[int, ...]) -> list[Any]:
    """A ``scan`` body with sites (taps only), its cheap residuals recomputed (``_saved``)."""
    p, nc, nk = eqn.params, body.num_consts, body.num_carry
    plan, acc, consts = self.plan, self.acc, vals[:nc]

    def step(carry, x):
      outs = _Run(plan, acc, {}, {}).walk(body.jaxpr, [*consts, *carry, *x], here, body.consts)
      return outs[:nk], outs[nk:]

    carry, ys = jax.lax.scan(jax.checkpoint(step, policy=_saved), vals[nc:nc + nk],
                             vals[nc + nk:], length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
    return [*carry, *ys]


def _widened(x: Any) -> Any:
  """``x`` in the dtype the core accumulates it in (float32 for a narrower floating value,
  else as is: :func:`jaxaccum._core._reduce.accumulator_dtype_for`)."""
  x = jnp.asarray(x)
  return x.astype(_reduce.accumulator_dtype_for(x.dtype, None))


def _bind_wide(eqn: Any, args: Sequence[Any]) -> Any:
  """``eqn`` on its operands widened to float32 (:func:`_widened`), its result in float32: a
  floating ``convert_element_type`` passes its operand on, a product its result type."""
  args = [_widened(a) for a in args]
  if eqn.primitive.name == "convert_element_type" and jnp.issubdtype(
      eqn.outvars[0].aval.dtype, jnp.floating):
    return args[0]
  params = dict(eqn.params)
  if params.get("preferred_element_type") is not None:
    params["preferred_element_type"] = _widened(
        jnp.zeros((), params["preferred_element_type"])).dtype
  return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))


class _Operands(_Walk):
  """Each probe's leaf operand (into ``out``, by path), evaluated from the leaves alone.

  A variable holds its value where it is a leaf's view (``None`` elsewhere). Only the
  operations the analysis follows from a leaf to its sites run (layout operations,
  broadcasts, static slices, the calls they pass through); a ``custom_jvp`` that is the
  identity in the leaf passes it on as is, which is what the gradient needs (every site is
  linear in its leaf operand, so its transpose does not read that operand's value).
  """

  def __init__(self, plan: _Plan, out: dict):
    self.plan, self.out = plan, out

  def visit(self, eqn: Any, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    outs: list[Any] = [None] * len(eqn.outvars)
    if here in self.plan.probes:
      self.out[here] = ins[self.plan.probes[here].pos]
      return outs
    hit = [k for k, v in enumerate(ins) if v is not None]
    if not hit:
      return outs
    name = eqn.primitive.name
    if (name in _LAYOUT or name in ("broadcast_in_dim", "slice")) and len(eqn.invars) == 1:
      outs = [_bind_wide(eqn, ins)]
    elif name == "custom_jvp_call" and len(hit) == 1:
      j = _identity_output(eqn, hit[0])
      if j is not None:
        outs[j] = ins[hit[0]]
    return outs

  def enter(self, eqn: Any, body: _Body, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    if body.kind == "scan" or all(v is None for v in ins):  # no probe in a scan body
      return [None] * len(eqn.outvars)
    return self.walk(body.jaxpr, ins, here)  # sites inside, or views that leave it


def _kept_sum(plan: _Plan, jaxpr: Any, ghost: Sequence[Any], ghost_keys: Sequence[int],
              acts: Sequence[tuple], cots: Sequence[jax.Array], c: jax.Array,
              zero_safe: bool) -> list[Any]:
  """``sum_e c_e grad_e`` of the leaves ``ghost`` (``ghost_keys``: their indices in ``jaxpr``'s
  inputs) from every probed site's kept other operands ``acts`` and output cotangents ``cots``.

  Each site is linear in its leaf operand, so the sum through it is the site's transpose at
  the cotangents times ``c``, over the whole batch at once (a dense layer's
  ``A^T diag(c) G``; ``c``: ``(E, groups)``, a site's factors those of its leaf's clip
  group); a leaf's sites' sums add. With ``zero_safe``, an example with ``c_e = 0``
  has its kept operands zeroed too: it adds ``0 * 0`` even where its activations are not
  finite.
  """
  used = {s.leaf for s in plan.probes.values()}
  cs = [c[:, plan.groups[s.leaf]] for s in plan.probes.values()]  # each site's factors
  if zero_safe:
    acts = [tuple(jnp.where((ci == 0).reshape(ci.shape + (1,) * (o.ndim - 1)),
                            jnp.zeros_like(o), o) if _inexact(o) else o for o in others)
            for ci, others in zip(cs, acts, strict=True)]

  def chain(ghost):  # the sites' leaf operands from the leaves (layout ops, slices)
    ls: list[Any] = [None] * len(jaxpr.invars)
    for k, v in zip(ghost_keys, ghost, strict=True):
      if k in used:
        ls[k] = v
    ops: dict = {}
    _Operands(plan, ops).walk(jaxpr, ls)
    return [ops[key] for key in plan.probes]

  # In float32 (or wider) throughout: the leaves, the layout operations to the sites (a
  # narrowing convert's transpose is exact, so it is left out), the sites' transposes and
  # the factors. In the model's own narrower dtype, the product with c_e would be rounded
  # after the clip: a clipped example could add more than C.
  ops, chain_t = jax.vjp(chain, [_widened(v) for v in ghost])
  # One site at a time, the last first (as a backward pass would): each site's sum waits for
  # the previous one's, so XLA holds one weight-sized sum at a time, not all of them.
  sites = list(plan.probes.values())
  sums: list[Any] = [None] * len(ops)
  prev = None
  for j in reversed(range(len(ops))):
    site = sites[j]
    others, g = acts[j], cots[j]
    if prev is not None:
      prev, (others, g) = jax.lax.optimization_barrier((prev, (others, g)))
      sums[j + 1] = prev

    def one(w, o, site=site):
      args = list(o)
      args.insert(site.pos, w)
      return _bind_wide(site.eqn, args)

    _, t = jax.vjp(lambda w, one=one, others=others: jax.vmap(one, in_axes=(None, 0))(w, others),
                   ops[j])
    g = _widened(g)
    prev = t(_stats.scale_rows(g, cs[j]).astype(g.dtype))[0]
  if prev is not None:
    sums[0] = prev
  return [s.astype(v.dtype) for s, v in zip(chain_t(sums)[0], ghost, strict=True)]


# --- the entry point --------------------------------------------------------------------------


def _trace(f: Callable[..., Any], leaves: list, treedef: Any, xs: PyTree,
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


def _leaf_axes(xs: PyTree, in_axes: Any) -> list[int | None]:
  """Per leaf of ``xs``: its batch axis (``in_axes`` is a prefix tree, as ``jax.vmap`` takes)."""
  per = jax.tree.map(lambda a, sub: [a] * len(jax.tree.leaves(sub)), in_axes, xs,
                     is_leaf=lambda a: a is None)
  return [m for ms in jax.tree.leaves(per, is_leaf=lambda m: isinstance(m, list)) for m in ms]


def _mapped(xs: PyTree, in_axes: Any) -> list[bool]:
  return [a is not None for a in _leaf_axes(xs, in_axes)]


def _inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                        jnp.inexact)


def _decide(closed: Any, leaves: Sequence[Any],
            mapped: Sequence[bool]) -> tuple[dict, dict, dict, dict[int, str]]:
  """Each floating leaf's rule: ``(taps, probes, multi, fallback)``.

  ``taps``: path -> the site of a leaf used once; ``probes``: path -> each site of a leaf used
  several times in factor forms, whose sites ``multi`` lists per leaf; ``fallback``: leaf ->
  the use without a rule.
  """
  floating = [k for k, x in enumerate(leaves) if _inexact(x)]
  views: list[_View | None] = [None] * len(closed.jaxpr.invars)
  for k in floating:
    aval = closed.jaxpr.invars[k].aval
    views[k] = _View(k, tuple(range(aval.ndim)), aval)
  found = _analyse(closed.jaxpr, views, [False] * len(leaves) + list(mapped))
  fallback: dict[int, str] = {}
  taps: dict[tuple[int, ...], _Site] = {}
  probes: dict[tuple[int, ...], _Site] = {}
  multi: dict[int, list[_Site]] = {}
  for k in floating:
    sites = found.sites.get(k, [])
    if jnp.issubdtype(jnp.asarray(leaves[k]).dtype, jnp.complexfloating):
      fallback[k] = "a complex parameter (the rules are for real values)"
    elif k in found.bad:
      fallback[k] = found.bad[k]
    elif len(sites) == 1 or _apart(sites):
      taps.update({s.path: s for s in sites})
    elif sites and _cross_ok(sites):
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
  (:func:`_narrow_second_pass`: ``"auto"`` materialises the program, ``"ghost"`` refuses it).
  """
  leaves = jax.tree.leaves(diff)
  treedef = jax.tree.structure(diff)
  closed, _, _ = _trace(f, leaves, treedef, xs, in_axes)
  taps, probes, multi, fallback = _decide(closed, leaves, _mapped(xs, in_axes))
  narrow = _narrow(closed.jaxpr)
  refused = _narrow_second_pass(narrow, taps, probes, None)
  tapped = {s.leaf for s in taps.values()}
  out = {}
  for k, (p, x) in enumerate(jax.tree_util.tree_flatten_with_path(diff)[0]):
    if not _inexact(x):
      continue
    label = ("ghost" if k in tapped else "cross" if k in multi else
             f"materialize: {fallback[k]}" if k in fallback else "none")
    if refused is not None and label in ("ghost", "cross"):
      assert narrow is not None  # (_narrow_second_pass)
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
# (:func:`_narrow_second_pass`); book-keeping, which forms the sum in float32 from the very
# values the norms were read from, is exact in any dtype. See docs/dp-sgd.md, "What the
# sensitivity bound rests on".


def _eqns(jaxpr: Any) -> Any:
  """Every equation of ``jaxpr`` and of the programs its equations hold (jit, remat, scan
  and cond bodies, custom rules' primal programs), depth first."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _programs(eqn):
      yield from _eqns(sub)


def _narrow(jaxpr: Any) -> np.dtype | None:
  """The narrowest floating dtype narrower than float32 among ``jaxpr``'s values (``None``:
  every floating value is float32 or wider). A cotangent rounds wherever the backward pass
  computes in it, not only at the sites."""
  narrow = [np.dtype(v.aval.dtype) for e in _eqns(jaxpr) for v in (*e.invars, *e.outvars)
            if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating)
            and jnp.finfo(v.aval.dtype).bits < 32]
  return min(narrow, key=lambda d: (jnp.finfo(d).nmant, d.name), default=None)


def _narrow_second_pass(narrow: np.dtype | None, taps: dict, probes: dict,
                        program: str | None) -> str | None:
  """Why the clipped sum of ``taps`` and ``probes`` would be a second backward pass (sites in
  a ``lax.scan`` body, or ``program="second"``) over a program that computes in ``narrow``
  (:func:`_narrow`), a dtype narrower than float32 (see above); ``None`` where it is not."""
  sites = (*taps.values(), *probes.values())
  if narrow is None or not sites:
    return None
  if any(s.view.in_scan for s in sites):
    return "its parameters are used inside a lax.scan body"
  return "program='second' was asked for" if program == "second" else None


def _aval_bytes(aval: Any) -> int:
  return math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize


def _held_bytes(vjp: Any, n: int) -> int:
  """Bytes of a VJP's residuals that have a leading axis of ``n`` (the examples')."""
  seen = {id(x): x for x in jax.tree.leaves(vjp)}.values()
  return sum(_aval_bytes(x.aval) for x in seen
             if hasattr(x, "aval") and x.aval.shape[:1] == (n,) and _inexact(x))


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
      :func:`_narrow_second_pass`).
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
      float32 (:func:`_narrow_second_pass`), for ``method="auto"`` to materialise instead.

  Returns:
    ``(outs, grad_sum, sq_norms)``: the vmapped ``out`` (leading axis ``E``),
    ``sum_e c_e grad_e f(diff, x_e)`` with ``diff``'s structure and dtypes (an example
    with ``c_e = 0`` adds exactly zero, even if its gradient is not finite, with
    ``zero_safe``), and the
    ``(E,)`` float32 squared norms (the norms with ``norms=True``).
  """
  leaves, treedef = jax.tree.flatten(diff)
  closed, out_tree, n = _trace(f, leaves, treedef, xs, in_axes)
  taps, probes, multi, fallback = _decide(closed, leaves, _mapped(xs, in_axes))
  if strict and fallback:
    _refuse_unknown_use(diff, leaves, fallback)
  narrow = _narrow(closed.jaxpr)
  refused = _narrow_second_pass(narrow, taps, probes, program)
  if refused is not None:
    if auto:
      return None
    assert narrow is not None  # (_narrow_second_pass)
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
  sq = _wide_norm(wide) if norms else wide[..., 0]  # (n, rows)
  c = jnp.asarray(weigh(sq if groups is not None else sq[:, 0]), jnp.float32)
  c = c if groups is not None else c[:, None]  # (n, rows): each example's factor per group
  if book:
    ghost_grads = _kept_sum(plan, closed.jaxpr, [leaves[k] for k in t.ghost_keys],
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
    grads[k] = jnp.sum(_stats.scale_rows(_f32(g), c[:, t.gid[k]]), axis=0).astype(g.dtype)
  if groups is None:
    total = sq[:, 0]
  else:
    total = _stats.combine(sq) if norms else jnp.sum(sq, axis=1)
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
  acc0 = _sharding.vary(jnp.zeros((n, rows, _WIDE_PARTS), jnp.float32), axes)
  return _Traced(f, xs, in_axes, leaves, treedef, closed, out_tree, n, ghost_keys, fb_keys,
                 gid, rows, axes, fb0, acc0)


def _forward(t: _Traced, plan: _Plan) -> tuple[jax.Array, Any, Any, list]:
  """The forward pass with ``plan``'s taps and probes: ``(objectives, vjp, outs, acts)``."""
  keys = list(plan.probes)

  def example(ghost, fb, acc, pv, x):
    ls = list(t.leaves)
    for k, v in (*zip(t.ghost_keys, ghost, strict=True), *zip(t.fb_keys, fb, strict=True)):
      ls[k] = v
    acts: dict = {}
    outs = _Run(plan, acc, dict(zip(keys, pv, strict=True)), acts).walk(
        t.closed.jaxpr, [*ls, *jax.tree.leaves(x)], (), t.closed.consts)
    objective, out = jax.tree.unflatten(t.out_tree, outs)
    return objective, (out, [acts[k] for k in keys])

  def batched(ghost, fb, acc, pv):
    return jax.vmap(example, in_axes=(None, 0, 0, 0, t.in_axes), axis_name=_EXAMPLES)(
        ghost, fb, acc, pv, t.xs)

  pv0 = []
  for key in keys:
    aval = plan.probes[key].eqn.outvars[0].aval
    pv0.append(_sharding.vary(jnp.zeros((t.n, *aval.shape), aval.dtype), t.axes))
  objectives, vjp, (outs, acts) = jax.vjp(batched, [t.leaves[k] for k in t.ghost_keys], t.fb0,
                                          t.acc0, pv0, has_aux=True)
  return objectives, vjp, outs, acts


def _choose_program(t: _Traced, taps: dict, probes: dict, program: str | None,
                    narrow: bool) -> tuple[bool, _Plan, tuple[jax.Array, Any, Any, list]]:
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
  cheap elementwise residuals (the policy ``_saved``).
  """
  sites = {**taps, **probes}
  plan = _Plan.of(taps, probes, t.gid)
  passed = _forward(t, plan)
  if sites and not any(s.view.in_scan for s in sites.values()):
    kept = sum(t.n * (_aval_bytes(s.eqn.outvars[0].aval) + sum(
        _aval_bytes(v.aval) for k, v in enumerate(s.eqn.invars) if k != s.pos))
        for s in sites.values())
    held = _held_bytes(passed[1], t.n)
    # Book-keeping forms the clipped sum in float32 from the kept factors; a second pass
    # runs in the model's own dtypes, which do not scale with the clip factor: in a
    # narrower dtype than float32 (``narrow``: bfloat16 compute), book-keeping is taken
    # whatever it holds (see _narrow_second_pass).
    if program == "book" or (program is None and (kept <= held or narrow)):
      plan = _Plan.of({}, sites, t.gid)
      return True, plan, _forward(t, plan)
  return False, plan, passed


def _first_pass(t: _Traced, plan: _Plan, taps: dict, multi: dict, book: bool, narrow: bool,
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
    wide = wide + _in_row(jax.vmap(_wide_sum_sq)(g), t.gid[k], t.rows)
  if book:
    for key in taps:
      site, j = taps[key], where[key]
      leaf_axes = tuple(_sharding.varying(t.leaves[site.leaf]))
      wide = wide + _in_row(_sharding.vary(jax.vmap(
          lambda o, g, site=site, ax=leaf_axes: site.rule.sq_norm(site, o, g, ax),
          axis_name=_EXAMPLES)(acts[j], cots[j]), t.axes), t.gid[site.leaf], t.rows)
  for k, uses in multi.items():
    js = [where[s.path] for s in uses]
    wide = wide + _in_row(jax.vmap(lambda o, g, uses=uses: _multi_sq_norm(uses, o, g),
                                   axis_name=_EXAMPLES)(
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
      for x, a in zip(jax.tree.leaves(t.xs), _leaf_axes(t.xs, t.in_axes), strict=True)])

  def plain(ghost, x):
    ls = list(t.leaves)
    for k, v in zip(ghost_keys, ghost, strict=True):
      ls[k] = v
    return t.f(jax.tree.unflatten(t.treedef, ls), x)[0]

  _, vjp2 = jax.vjp(lambda g: jax.vmap(plain, in_axes=(None, t.in_axes))(g, xs2),
                    [t.leaves[k] for k in ghost_keys])
  redo = _by_group(vjp2, c.astype(dtype), [t.gid[k] for k in ghost_keys])
  return jax.tree.map(lambda g: jnp.where(jnp.all(dead), jnp.zeros_like(g), g)
                      if _inexact(g) else g, redo)


def _little_saved(taps: dict, probes: dict, leaves: Sequence[Any]) -> bool:
  """Whether ghost norms would save little over materialising: a third or more of the
  parameters (by bytes) are used at ``"direct"`` sites (convolution kernels, elementwise
  scales), whose norm is formed from the leaf-sized per-example gradient, so that the ghost
  step holds about as much as materialising and runs another pass besides: a small CNN,
  half its parameters in kernels, took 1.5x the plain step's time with ghost norms, 0.65x
  materialised, with the same temporaries. Leaves without a rule are materialised by both
  programs and weigh on neither side."""
  size = {k: math.prod(np.shape(leaves[k])) * jnp.dtype(jnp.asarray(leaves[k]).dtype).itemsize
          for k in range(len(leaves)) if _inexact(leaves[k])}
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

