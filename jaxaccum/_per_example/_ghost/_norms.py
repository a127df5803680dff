"""Norm numerics: squared norms carried wide, the Gram forms and their guard, row gathers.

Nothing here reads a program's structure beyond one equation's parameters: these are the
numerical forms the site rules (``_rules``) compose. Every form that could read a norm too
small is guarded: a Gram form whose terms cancel is replaced by the direct form
(``_GRAM_TRUST``), and squared norms are carried wide, in three parts scaled by exact powers
of two (no overflow, no underflow). See README.md beside this file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._core import _reduce, _sharding, _stats
from jaxaccum._per_example import _norm

HIGHEST = jax.lax.Precision.HIGHEST


def f32(x: jax.Array) -> jax.Array:
  """``x`` in float32 (complex64 where complex: a cast to float32 would drop the imaginary
  part)."""
  x = jnp.asarray(x)
  return x.astype(jnp.complex64 if jnp.iscomplexobj(x) else jnp.float32)


# A squared norm is carried *wide*: ``[q, q * 2^-128, q * 2^128]`` in float32 (sums of
# squares of the entries, and of the entries times 2^-64 and 2^64; products formed from
# operands divided by their largest entry, then scaled back by exact powers of two), so that
# the second part stays finite where ``q`` overflows (a norm above about 1.8e19), the third
# keeps full precision where ``q`` underflows or is subnormal (a norm below about 1e-19),
# and the first keeps full precision between. Wide values add; :func:`wide_norm` reads the
# norm back: no second pass and no branch, which would hold the forward pass's residuals in
# buffers of their own.
#
# An exact zero is read as zero in every part, whatever order XLA multiplies constants in:
# where an operand is a compile-time constant (the cotangent of a site whose output the
# objective does not use, which JAX instantiates as zeros), XLA's simplifier gathers the
# constant factors into one (``(0 * 2^64)^2`` as ``0 * 2^128``, ``0 * 2^120 * 2^12`` as
# ``0 * 2^132``), which overflows to ``inf``, and the part reads ``0 * inf = NaN``
# (an ``optimization_barrier`` on the scale does not survive XLA's pipeline). So
# :func:`wide_exp` and :func:`wide_sum_sq` select zero where the value is zero.
_WIDE_SHIFT = 128
WIDE_PARTS = 3
# The parts' shifts, as powers of two: q = part_k * 2^-shift_k.
_WIDE_SHIFTS = (0, -_WIDE_SHIFT, _WIDE_SHIFT)


def peak(x: jax.Array) -> jax.Array:
  """``x``'s largest absolute entry, or 1 where that is 0 or not finite."""
  return _norm.scale_divisor(jnp.max(jnp.abs(x), initial=0.0))


def _pow2(k: jax.Array) -> jax.Array:
  """``2^k`` in float32, exactly, for integers ``-126 <= k <= 127``."""
  return jax.lax.bitcast_convert_type((k + 127).astype(jnp.int32) << 23, jnp.float32)


def ldexp(m: jax.Array, e: jax.Array) -> jax.Array:
  """``m * 2^e`` in float32 with ``e`` any int32 (a few hundred at most): applied in steps
  of at most 2^120 towards ``e``, so that no step under- or overflows before the result
  does (a product of several factors in another order can underflow to 0 where the result
  is of order 1)."""
  for _ in range(7):  # |e| <= 840: four peaks' exponents and a shift
    step = jnp.clip(e, -120, 120)
    m = m * _pow2(step)
    e = e - step
  return m


def frexp_split(*factors: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(m, e)`` with ``prod(factors) = m * 2^e``, ``m`` in [2^-k, 1) for ``k`` factors: the
  factors' mantissas multiplied, their exponents added (no product of them formed)."""
  m, e = jnp.ones((), jnp.float32), jnp.zeros((), jnp.int32)
  for f in factors:
    mf, ef = jnp.frexp(jnp.asarray(f, jnp.float32))
    m, e = m * mf, e + ef.astype(jnp.int32)
  return m, e


def wide_exp(s: jax.Array, e: jax.Array) -> jax.Array:
  """The wide value of ``s * 2^e`` (``e``: an int32 exponent); zeros where ``s`` is 0."""
  return jnp.where(s == 0, jnp.zeros((), jnp.float32),
                   jnp.stack([ldexp(s, e + k) for k in _WIDE_SHIFTS]))


def wide(s: jax.Array, *factors: jax.Array) -> jax.Array:
  """The wide value of ``s * prod(factors)`` (``s``: computed from operands divided by the
  ``factors``, so that it is finite). The factors' mantissas multiply ``s`` (each in
  [0.5, 1)) and their exponents add, so the scaling cannot underflow or overflow before the
  value itself does."""
  m, e = frexp_split(*factors)
  return wide_exp(s * m, e)


def wide_sum_sq(x: jax.Array) -> jax.Array:
  """The wide squared norm of ``x``'s entries: three sums of squares (one pass, no peak);
  zeros where every entry is 0."""
  x = _stats.magnitude(x)  # a complex entry adds |x|^2 = re^2 + im^2
  parts = []
  for k in _WIDE_SHIFTS:
    # behind a barrier: XLA would otherwise form the scaled copies broadcast, in memory
    scale = jax.lax.optimization_barrier(jnp.float32(2.0 ** (k // 2)))
    parts.append(jnp.sum(jnp.square(x * scale)) if k else jnp.sum(jnp.square(x)))
  # a NaN entry is not 0: it stays NaN in every part
  return jnp.where(jnp.any(x != 0), jnp.stack(parts), jnp.zeros((), jnp.float32))


def wide_norm(w: jax.Array) -> jax.Array:
  """The norm of wide squared norms ``w`` (``(..., 3)``): NaN or inf where the norm is."""
  q, lo, up = w[..., 0], w[..., 1], w[..., 2]
  half = _WIDE_SHIFT // 2
  return jnp.where(jnp.isfinite(q),
                   jnp.where(q < 2.0 ** -half, jnp.sqrt(up) * 2.0 ** -half, jnp.sqrt(q)),
                   jnp.sqrt(lo) * 2.0 ** half)


def gram_cheaper(t: int, p: int, q: int) -> bool:
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
EXAMPLES = "_jaxaccum_ghost_examples"


def guarded(lost: jax.Array, direct: Callable[..., jax.Array], value: jax.Array,
             *operands: Any) -> jax.Array:
  """``direct(*operands)`` where ``lost`` holds for any example of the micro-batch (one
  branch for all, decided over the vmap axis ``EXAMPLES``), else ``value``. Under
  ``shard_map`` (whose varying axes refuse a collective over a vmap axis) or outside that
  vmap, each example takes its own form, both computed."""
  if _sharding.varying(lost):
    return jnp.where(lost, direct(*operands), value)
  try:
    lost = jax.lax.psum(lost.astype(jnp.int32), EXAMPLES) > 0
  except NameError:
    pass
  return jax.lax.cond(lost, direct, lambda *_: value, *operands)


def untrusted(s: jax.Array, q: jax.Array) -> jax.Array:
  """Whether a Gram sum ``q`` whose terms' magnitudes add up to ``s`` may have lost its
  digits (also where it reads negative or not finite, so the direct form shows that)."""
  return ~(s <= _GRAM_TRUST * q) & jnp.isfinite(s)


def chunked_sq(pairs: Sequence[tuple[str, jax.Array, jax.Array]], m: int,
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
      block = block + jnp.einsum("htk,htn->hkn", xc, y, precision=HIGHEST)
    return total + jnp.sum(jnp.square(block))

  axes = tuple(set().union(*(_sharding.varying(a) for _, x, y in pairs for a in (x, y))))
  return jax.lax.fori_loop(0, chunks, body, _sharding.vary(jnp.zeros((), jnp.float32), axes))


def sq_outer(a: jax.Array, b: jax.Array) -> jax.Array:
  """Wide ``sum_h |A_h^T B_h|^2``, by the Gram form or directly, whichever is cheaper (the
  Gram form guarded: see ``_GRAM_TRUST``)."""
  h, t, p = a.shape
  q = b.shape[2]
  a, b = f32(a), f32(b)
  pa, pb = peak(a), peak(b)
  a, b = a / pa, b / pb
  if t == 1:  # one position: |a|^2 |b|^2, a product of sums of squares, nothing cancels
    return wide(jnp.sum(jnp.sum(jnp.square(a), (1, 2)) * jnp.sum(jnp.square(b), (1, 2))),
                 pa, pa, pb, pb)
  if gram_cheaper(t, p, q):
    ga = jnp.einsum("htp,hup->htu", a, a, precision=HIGHEST)
    gb = jnp.einsum("htq,huq->htu", b, b, precision=HIGHEST)
    gram = jnp.sum(ga * gb)
    terms = jnp.sum(jnp.square(jnp.sum(jnp.sqrt(jnp.sum(jnp.square(a), -1)
                                                 * jnp.sum(jnp.square(b), -1)), -1)))
    s = guarded(untrusted(terms, gram),
                 lambda a, b: chunked_sq([("dense", a, b)], p, h * t * (p + q)), gram, a, b)
    return wide(s, pa, pa, pb, pb)
  return wide(jnp.sum(jnp.square(jnp.einsum("htp,htq->hpq", a, b, precision=HIGHEST))),
               pa, pa, pb, pb)


def gather_rows(eqn: Any, idx: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(i, rows)``: the row each cotangent row ``rows[t]`` adds to (-1: dropped)."""
  rows_of = eqn.invars[0].aval.shape[0]
  i = idx.reshape(-1)
  rows = f32(g).reshape(i.shape[0], -1)
  if eqn.params["mode"] == jax.lax.GatherScatterMode.CLIP:
    i = jnp.clip(i, 0, rows_of - 1)
  else:  # FILL_OR_DROP, and PROMISE_IN_BOUNDS (jnp's default): the forward pass clamps an
    # index out of range, but the transpose (a scatter-add) drops its row
    i = jnp.where((i >= 0) & (i < rows_of), i, -1)
  return i, rows


def index_gram_cheaper(t: int, d: int, rows: int) -> bool:
  """Whether the index-equality Gram (``T^2 (D + 1)``) beats segment sums (``(V + T) D``)."""
  return t * t * (d + 1) <= (rows + t) * d


def sq_gather(eqn: Any, idx: jax.Array, g: jax.Array) -> jax.Array:
  """Wide squared norm of a row gather's gradient (rows ``idx``, cotangent ``g``).

  The gradient's row ``r`` is ``S_r``, the sum of the cotangent rows ``g_t`` with
  ``i_t = r``. Where the table has many rows, each position's ``s_t = S_{i_t}`` is formed
  from the index-equality matrix (``T^2 D`` products) and ``sum_r |S_r|^2`` is
  ``sum_t |s_t|^2 / n_t`` (``n_t``: how many positions share ``i_t``), a sum of positive
  terms; else the rows' segment sums.
  """
  i, rows = gather_rows(eqn, idx, g)
  top = peak(rows)
  rows = rows / top
  t, d = rows.shape
  rows_of = eqn.invars[0].aval.shape[0]
  if index_gram_cheaper(t, d, rows_of):
    same = ((i[:, None] == i[None, :]) & (i[:, None] >= 0)).astype(jnp.float32)
    sums = jnp.einsum("tu,ud->td", same, rows, precision=HIGHEST)
    counts = jnp.maximum(jnp.sum(same, axis=1), 1.0)
    return wide(jnp.sum(jnp.sum(jnp.square(sums), axis=1) / counts), top, top)
  sums = jax.ops.segment_sum(jnp.where((i >= 0)[:, None], rows, 0.0), jnp.maximum(i, 0),
                             num_segments=rows_of)
  return wide(jnp.sum(jnp.square(sums)), top, top)


def in_row(sq: jax.Array, row: int, rows: int) -> jax.Array:
  """Wide squared norms ``sq`` (``(..., parts)``) placed in row ``row`` of ``rows`` groups
  (``(..., rows, parts)``, zeros elsewhere)."""
  out = jnp.zeros((*sq.shape[:-1], rows, sq.shape[-1]), sq.dtype)
  return out.at[..., row, :].set(sq)


def widened(x: Any) -> Any:
  """``x`` in the dtype the core accumulates it in (float32 for a narrower floating value,
  else as is: :func:`jaxaccum._core._reduce.accumulator_dtype_for`)."""
  x = jnp.asarray(x)
  return x.astype(_reduce.accumulator_dtype_for(x.dtype, None))


def bind_wide(eqn: Any, args: Sequence[Any]) -> Any:
  """``eqn`` on its operands widened to float32 (:func:`widened`), its result in float32: a
  floating ``convert_element_type`` passes its operand on, a product its result type."""
  args = [widened(a) for a in args]
  if eqn.primitive.name == "convert_element_type" and jnp.issubdtype(
      eqn.outvars[0].aval.dtype, jnp.floating):
    return args[0]
  params = dict(eqn.params)
  if params.get("preferred_element_type") is not None:
    params["preferred_element_type"] = widened(
        jnp.zeros((), params["preferred_element_type"])).dtype
  return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))


def inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                        jnp.inexact)
