"""The rewritten program: the forward pass with its taps and probes, and book-keeping's sum.

:class:`Run` evaluates the traced program with each tapped site's output passed through an
identity whose backward rule adds the site's norm to a per-example accumulator, and each
probed site's output plus a zero whose cotangent is the output's; :func:`kept_sum` forms
book-keeping's clipped sum from the probes' kept operands and cotangents, in float32. See
README.md beside this file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._core import _sharding
from jaxaccum._per_example import _norm
from jaxaccum._per_example._ghost import _norms, _walk
from jaxaccum._per_example._ghost._sites import Site

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


@jax.custom_jvp
def tanh(x: jax.Array) -> jax.Array:
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


@tanh.defjvp
def _tanh_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
  (x,), (t,) = primals, tangents
  y = jax.lax.tanh(x)
  u = t * (1 - y)
  return y, u + u * y


def _zero_cotangent(x: Any) -> Any:
  if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact):
    return _sharding.vary(jnp.zeros_like(x), tuple(_sharding.varying(x)))
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _tap(site: Site, axes: tuple, leaf_axes: tuple, row: int,
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
    return g, jax.tree.map(_zero_cotangent, saved), _norms.in_row(sq, row, rows)

  tap.defvjp(fwd, bwd)
  return tap


@dataclasses.dataclass(frozen=True)
class Plan:
  taps: dict[tuple[int, ...], Site]
  probes: dict[tuple[int, ...], Site]
  inside: frozenset[tuple[int, ...]]  # every proper prefix of a tap's or a probe's path
  groups: tuple[int, ...]  # each leaf's clip group (its row of the norms accumulator)

  @staticmethod
  def of(taps: dict, probes: dict, groups: Sequence[int]) -> Plan:
    inside = {p[:k] for p in (*taps, *probes) for k in range(1, len(p))}
    return Plan(taps, probes, frozenset(inside), tuple(groups))


class Run(_walk.Walk):
  """Evaluates a program with each tap's output tapped and each probe's output probed:
  ``probes``: each probe's path -> the zero added to its output (differentiated, it gives
  the output's cotangent); ``acts``: each probe's path -> its other operands (written)."""

  def __init__(self, plan: Plan, acc: jax.Array, probes: dict, acts: dict):
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
      return [_walk.bind(eqn, ins) + self.probes[here]]
    if eqn.primitive.name == "tanh" and not eqn.params.get("accuracy"):
      return [tanh(ins[0])]
    out = _walk.bind(eqn, ins)
    return out if eqn.primitive.multiple_results else [out]

  def _tapped(self, eqn: Any, vals: list[Any], site: Site) -> Any:
    acc = self.acc
    others = tuple(jnp.asarray(v) for k, v in enumerate(vals) if k != site.pos)
    saved = others if site.rule.saves_operands else ()
    y = _walk.bind(eqn, vals)
    if not site.batched:  # e.g. a static slice: make it per example, for its cotangent
      y = y + jnp.zeros((), y.dtype) * acc.reshape(-1)[0].astype(y.dtype)
    tap = _tap(site, tuple(_sharding.varying(acc)), tuple(_sharding.varying(vals[site.pos])),
               self.plan.groups[site.leaf], acc.shape[0])
    return tap(y, saved, acc)

  def enter(self, eqn: Any, body: _walk.Body, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    if here not in self.plan.inside:  # no site inside: the equation as it is
      return self.visit(eqn, ins, here)
    if body.kind == "call":
      return self.walk(body.jaxpr, ins, here, body.consts)
    if body.kind == "remat":
      return self._remat(eqn, body, ins, here)
    return self._scan(eqn, body, ins, here)

  def _remat(self, eqn: Any, body: _walk.Body, vals: list[Any], here: tuple[int, ...]) -> list[Any]:
    """A ``checkpoint`` body with sites, run under ``jax.checkpoint`` with its own policy."""
    plan = self.plan
    keys = [k for k in plan.probes if k[:len(here)] == here]

    def run(vals, acc, pv):
      sub = Run(plan, acc, dict(zip(keys, pv, strict=True)), {})
      outs = sub.walk(body.jaxpr, vals, here, body.consts)
      return outs, [sub.acts[k] for k in keys]

    outs, got = jax.checkpoint(run, policy=eqn.params["policy"],
                               prevent_cse=eqn.params["prevent_cse"])(
                                   vals, self.acc, [self.probes[k] for k in keys])
    self.acts.update(zip(keys, got, strict=True))
    return outs

  def _scan(self, eqn: Any, body: _walk.Body, vals: list[Any], here: tuple[int, ...]) -> list[Any]:
    """A ``scan`` body with sites (taps only), its cheap residuals recomputed (``_saved``)."""
    p, nc, nk = eqn.params, body.num_consts, body.num_carry
    plan, acc, consts = self.plan, self.acc, vals[:nc]

    def step(carry, x):
      outs = Run(plan, acc, {}, {}).walk(body.jaxpr, [*consts, *carry, *x], here, body.consts)
      return outs[:nk], outs[nk:]

    carry, ys = jax.lax.scan(jax.checkpoint(step, policy=_saved), vals[nc:nc + nk],
                             vals[nc + nk:], length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
    return [*carry, *ys]


class _Operands(_walk.Walk):
  """Each probe's leaf operand (into ``out``, by path), evaluated from the leaves alone.

  A variable holds its value where it is a leaf's view (``None`` elsewhere). Only the
  operations the analysis follows from a leaf to its sites run (layout operations,
  broadcasts, static slices, the calls they pass through); a ``custom_jvp`` that is the
  identity in the leaf passes it on as is, which is what the gradient needs (every site is
  linear in its leaf operand, so its transpose does not read that operand's value).
  """

  def __init__(self, plan: Plan, out: dict):
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
    if (name in _walk.LAYOUT or name in ("broadcast_in_dim", "slice")) and len(eqn.invars) == 1:
      outs = [_norms.bind_wide(eqn, ins)]
    elif name == "custom_jvp_call" and len(hit) == 1:
      j = _walk.identity_output(eqn, hit[0])
      if j is not None:
        outs[j] = ins[hit[0]]
    return outs

  def enter(self, eqn: Any, body: _walk.Body, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
    if body.kind == "scan" or all(v is None for v in ins):  # no probe in a scan body
      return [None] * len(eqn.outvars)
    return self.walk(body.jaxpr, ins, here)  # sites inside, or views that leave it


def kept_sum(plan: Plan, jaxpr: Any, ghost: Sequence[Any], ghost_keys: Sequence[int],
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
                            jnp.zeros_like(o), o) if _norms.inexact(o) else o for o in others)
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
  ops, chain_t = jax.vjp(chain, [_norms.widened(v) for v in ghost])
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
      return _norms.bind_wide(site.eqn, args)

    _, t = jax.vjp(lambda w, one=one, others=others: jax.vmap(one, in_axes=(None, 0))(w, others),
                   ops[j])
    g = _norms.widened(g)
    prev = t(_norm.scale_rows(g, cs[j]).astype(g.dtype))[0]
  if prev is not None:
    sums[0] = prev
  return [s.astype(v.dtype) for s, v in zip(chain_t(sums)[0], ghost, strict=True)]
