"""The one walk into sub-programs: ``jit``, ``checkpoint`` (remat) and ``scan`` bodies.

Every pass over the traced program (the analysis, the forward pass with its taps and probes,
book-keeping's leaf operands) is a :class:`Walk`, which alone follows the bodies
:func:`body` reads; :func:`eqns` lists every equation of a program and of the programs its
equations hold, followed or not (for questions about the whole program, such as its
narrowest dtype). Here too the program's vocabulary that more than one pass reads: the
layout operations a leaf's view is followed through (:data:`LAYOUT`) and a ``custom_jvp``
that is the identity in an input (:func:`identity_output`). See README.md beside this file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
_REMATS = frozenset({"remat2", "checkpoint", "remat"})

# Operations that only move or relabel a leaf's entries, or flip their signs: the leaf's
# gradient through them is the gradient with respect to their output, moved back (and its
# signs flipped back: ``neg``, which a view carries as its ``sign``, so that two uses' cross
# term keeps its sign). ``convert_element_type`` is one of them only where the cotangent's
# conversion back is exact (``_analysis._exact_convert``); a rounding (``reduce_precision``,
# a widening convert, whose transpose rounds the cotangent) is not, and falls back.
LAYOUT = frozenset({"convert_element_type", "reshape", "transpose", "squeeze", "copy",
                     "copy_p", "neg"})


def bind(eqn: Any, args: Sequence[Any]) -> Any:
  return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))


def _scan_counts(eqn: Any) -> tuple[int, int]:
  """A ``scan`` equation's numbers of constants and carries (jax 0.10; 0.12's ``ft_in``)."""
  params = eqn.params
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].update(list(eqn.invars)).unpack()
  return len(consts), len(carry)


@dataclasses.dataclass(frozen=True)
class Body:
  """The program a ``jit`` (``pjit``, ``closed_call``), ``checkpoint`` (remat) or ``scan``
  equation runs: its inputs and outputs are the equation's, in order (a scan's inputs: its
  ``num_consts`` constants, ``num_carry`` carries and one iteration's slices of its ``xs``;
  its outputs: the carries, then one iteration's ``ys``)."""

  kind: str  # "call", "remat" or "scan"
  jaxpr: Any  # jax.extend.core.Jaxpr
  consts: tuple  # the values of jaxpr's constvars
  num_consts: int = 0
  num_carry: int = 0


def body(eqn: Any) -> Body | None:
  """The program ``eqn`` runs, where it is a ``jit``, ``checkpoint`` or ``scan``; else ``None``
  (other control flow and custom rules are not followed: see each pass)."""
  name = eqn.primitive.name
  if name in _CALLS:
    sub = eqn.params["jaxpr"]
    return Body("call", sub.jaxpr, tuple(sub.consts))
  if name in _REMATS:
    return Body("remat", eqn.params["jaxpr"], ())
  if name == "scan":
    sub = eqn.params["jaxpr"]
    return Body("scan", sub.jaxpr, tuple(sub.consts), *_scan_counts(eqn))
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


class Walk:
  """A pass over a program, equation by equation, into the bodies :func:`body` reads: the
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

  def enter(self, eqn: Any, body: Body, ins: list[Any], here: tuple[int, ...]) -> list[Any]:
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
      sub = body(eqn)
      outs = self.visit(eqn, ins, here) if sub is None else self.enter(eqn, sub, ins, here)
      env.update(zip(eqn.outvars, outs, strict=True))
    return [self.read(env, a) for a in jaxpr.outvars]


def eqns(jaxpr: Any) -> Any:
  """Every equation of ``jaxpr`` and of the programs its equations hold (jit, remat, scan
  and cond bodies, custom rules' primal programs), depth first."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _programs(eqn):
      yield from eqns(sub)


def identity_output(eqn: Any, k: int) -> int | None:
  """The output of the ``custom_jvp_call`` ``eqn`` whose derivative is the identity in input
  ``k`` (and that alone depends on it), or ``None``.

  Read from the call's own tangent rule, traced on ``eqn``'s avals with input ``k``'s tangent
  alone: an output that *is* that tangent, every other output independent of it.
  """
  args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]

  def tangents(args, t):
    def one(x):
      return bind(eqn, [*args[:k], x, *args[k + 1:]])

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
