"""A differential fuzz of ``clip_per_example``: generated models against per-example ``jax.grad``.

:func:`generate` builds a seeded case: a per-example loss made of random compositions of
uses of parameters (dense, transposed, weight on the left, tied, negated, sliced (nested,
strided, reversed, after reshapes), gathered (every mode, ids out of range), scaled,
normalised, divided by a parameter, broadcast, masked, convolved, scanned (and tied outside
the scan), inside ``jit`` or ``checkpoint``, rounded by ``reduce_precision``, complex, a
weight decay inside the loss), several activations, inputs scaled over many orders of
magnitude, positions that nearly cancel, float32 or bfloat16 compute (the parameters stay
float32 and are cast inside the loss). The loss of a batch is the sum of its rows' losses,
so one row alone is one example. :data:`REGRESSIONS` holds named cases written by hand:
each known way the ghost analysis went wrong, and the shapes behind bugs it could have.

:func:`check` runs each ``method`` of ``clip_per_example`` on the case and compares it with
a reference that never goes through jaxaccum: each example's gradient by ``jax.grad`` of the
loss on that example alone (a Python loop over rows), its norm ``sqrt(sum |g|^2)`` in
float64 (complex leaves included), and the clipped sum ``sum_e min(1, C / |g_e|) g_e``.
Three properties, for each method:

- ``norms``: ``info.example_grad_norms`` within :data:`NORM_RTOL` of the reference norms;
- ``sum``: the clipped sum (``reduce="sum"``) within :data:`SUM_RTOL` of the reference sum,
  relative to the sum of the examples' clipped norms;
- ``bound``: the sensitivity bound measured directly: each example alone, as a batch of one
  with ``reduce="sum"``, gives a gradient of norm at most ``C * (1 + ROUNDING_BOUND)``.

A case whose reference is ill-conditioned in its compute dtype (the same per-example
gradients computed under ``jax.vmap`` give norms that differ by more than a quarter of
:data:`NORM_RTOL`, or by forward mode by more than :data:`NORM_RTOL`) is checked on the
bound only.

``method="ghost"`` may refuse a use it cannot analyse with a ``ValueError``; that is
recorded as ``"refused"``, never a failure. Any other exception is a failure (``"crash"``).

FSDP placements (:func:`draw_fsdp`, ``check(..., fsdp=...)``): the same case under
``data_axis=DataParallel("data", param_gather=..., grad_scatter=...,
overlap_grad_reduce=...)`` on a mesh of 2, 4 or 8 devices (``Explicit`` axes), some
parameters sharded over ``"data"`` along a drawn dimension, against the same reference (per-
example ``jax.grad`` on the unsharded, that is gathered, parameters). ``with_info`` is
refused under FSDP, so the norms are not read; the clipped sum is compared as above, and
the bound is measured on each example alone among rows of zero gradient (each example's
loss times a weight that is one-hot over the case's batch, on the compiled step of the
sum): each shard clipping its own slice of an example's gradient shows there as up to
``sqrt(shards) C``. (Padding rows, ``example_mask``, would hide it: their factor of 0
drops the other shards' slices.)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

# The sensitivity bound's rounding allowance: an example alone (batch of one, reduce="sum")
# may contribute a gradient of norm at most C * (1 + ROUNDING_BOUND). The clip factor
# min(1, C / |g|) and the product c * g are each rounded once in float32 (2**-24 relative
# each), the norm's sum a few times more; 1e-5 covers that with room. It is the same for
# bfloat16 compute: the parameters (and so the gradients the clip scales) are float32, so a
# clip applied to them rounds as in float32 (materialize reaches 1.00000 C). Parameters
# stored in bfloat16 are another matter: their clipped gradient is rounded to bfloat16 (the
# ``bf16_parameters`` case). jaxaccum does not publish a bound of its own yet; if it does,
# this constant should read it.
ROUNDING_BOUND = 1e-5
# Where an example's own gradient is a sum of terms that cancel to 1 / kappa of their size,
# float32 resolves it only to about 2^-24 kappa, in the reference (jax.grad) and in every
# method alike: docs/dp-sgd.md ("What the sensitivity bound rests on") documents the bound
# C * (1 + 2^-22 kappa) there. Each case says its kappa (1: no such cancellation).
CANCELLATION_BOUND = 2.0 ** -22
# ... and its norms, against the reference's, to about 2^-20 kappa relative (the reference,
# float32's jax.grad, is itself that uncertain there).
CANCELLATION_NORM_RTOL = 2.0 ** -20

# Norms against the reference, relative. float32 compute: the ghost path's goal (1e-3). In
# bfloat16 compute the reference gradient is itself rounded to bfloat16 at every op (8
# significant bits), and the methods round in other places than a per-example jax.grad
# (a ghost norm reads bf16 activations and cotangents, not the bf16-rounded gradient), so
# they agree only to a few bf16 ulps: 2**-5.
NORM_RTOL = {"float32": 1e-3, "bfloat16": 2.0 ** -5}
# The clipped sum against the reference, relative to sum_e min(|g_e|, C) (the largest the
# sum's norm can be): a norm off by r moves an example's factor by at most r.
SUM_RTOL = {"float32": 1e-3, "bfloat16": 2.0 ** -5}

METHODS = ("auto", "ghost", "materialize")
PROPERTIES = ("norms", "sum", "bound", "crash")

# Generated ops and their weights (the rarer ones are known failures of today's analysis
# that would otherwise dominate the report; --exclude drops any of them).
OP_WEIGHTS = {
    "dense": 1.0, "tied": 0.7, "neg": 0.6, "slice": 1.0, "gather": 1.0, "scale": 0.6,
    "layernorm": 0.6, "div": 0.5, "bcast": 0.6, "conv": 0.7, "scan": 0.7, "rp": 0.25,
    "complex_w": 0.25, "complex_act": 0.25, "tied_vector": 0.5, "penalty": 0.4,
    "scan_tied": 0.4, "masked": 0.4, "wrapped": 0.4, "gather_t": 0.5,
}
ACTIVATIONS = {"tanh": jnp.tanh, "gelu": jax.nn.gelu, "relu": jax.nn.relu, "sin": jnp.sin,
               "id": lambda z: z}


@dataclasses.dataclass
class Case:
  """One fuzz case: ``loss(params, batch)`` is the sum of the rows' losses of ``batch``."""

  name: str
  params: dict
  loss: Callable[..., Any]
  batch: dict
  num_micro_batches: int = 1
  compute: str = "float32"  # or "bfloat16": the dtype the loss computes in
  max_norm: float | None = None  # None: from the reference norms (clip_norm_for)
  ops: tuple[str, ...] = ()  # what the generator put in, for the report
  kappa: float = 1.0  # how far an example's gradient cancels (see CANCELLATION_BOUND)
  # the rounding of the clipped sum's own dtype: bfloat16 parameters round it to 2^-8 under
  # every method (docs/dp-sgd.md); float32 ones as ROUNDING_BOUND says
  rounding: float = ROUNDING_BOUND

  @property
  def rows(self) -> int:
    return int(jax.tree.leaves(self.batch)[0].shape[0])


# --- The generator -----------------------------------------------------------------------


class _Builder:
  """Collects parameters and ops for one generated case."""

  def __init__(self, rng: np.random.Generator, d: int, t: int, v: int, cdt: Any,
               oob: bool):
    self.rng, self.d, self.t, self.v, self.cdt, self.oob = rng, d, t, v, cdt, oob
    self.params: dict[str, np.ndarray] = {}
    self.squares: list[str] = []  # (D, D) weights, for tied uses
    self.tables: list[str] = []  # (V, D) embeddings, for a tied head
    self.fns: list[Callable[..., Any]] = []
    self.desc: list[str] = []

  def param(self, kind: str, shape: tuple[int, ...], scale: float | None = None,
            offset: float = 0.0, complex_: bool = False) -> str:
    name = f"{len(self.params):02d}_{kind}"
    s = 1.0 / math.sqrt(shape[-1]) if scale is None else scale
    w = offset + s * self.rng.standard_normal(shape)
    if complex_:
      w = w + 1j * s * self.rng.standard_normal(shape)
      self.params[name] = w.astype(np.complex64)
    else:
      self.params[name] = w.astype(np.float32)
    return name

  def act(self) -> tuple[str, Callable[..., Any]]:
    name = str(self.rng.choice(list(ACTIVATIONS)))
    return name, ACTIVATIONS[name]

  def choice(self, options: list[str]) -> str:
    return str(options[int(self.rng.integers(len(options)))])

  def add(self, desc: str, fn: Callable[..., Any]) -> None:
    self.desc.append(desc)
    self.fns.append(fn)


def _dense(b: _Builder) -> None:
  w = b.param("w", (b.d, b.d))
  b.squares.append(w)
  bias = b.param("b", (b.d,), 0.1) if b.rng.random() < 0.5 else None
  variant = b.choice(["x@W", "x@W.T", "W@x"])
  an, act = b.act()

  def fn(p, h, data):
    if variant == "x@W":
      z = h @ p[w]
    elif variant == "x@W.T":
      z = h @ p[w].T
    else:  # the weight on the left, as equinox's Linear under vmap
      z = jnp.einsum("de,bte->btd", p[w], h)
    return act(z if bias is None else z + p[bias])

  b.add(f"dense({variant}{'+b' if bias else ''},{an})", fn)


def _tied(b: _Builder) -> None:
  if not b.squares:
    _dense(b)
  w = b.choice(b.squares)
  variant = b.choice(["x@W", "x@W.T"])
  an, act = b.act()

  def fn(p, h, data):
    return act(h @ (p[w] if variant == "x@W" else p[w].T))

  b.add(f"tied({w},{variant},{an})", fn)


def _neg(b: _Builder) -> None:
  w = b.param("w", (b.d, b.d))
  variant = b.choice(["x@W+a(x)@(-W)", "x@(W-W.T)", "x@(-W)", "x*s+a(x)*(-s)"])
  an, act = b.act()
  s = b.param("s", (b.d,), 1.0) if variant.startswith("x*s") else None

  def fn(p, h, data):
    if variant == "x@W+a(x)@(-W)":
      return act(h @ p[w] + jnp.tanh(h) @ (-p[w]))
    if variant == "x@(W-W.T)":
      return act(h @ (p[w] - p[w].T))
    if variant == "x@(-W)":
      return act(h @ (-p[w]))
    return act(h * p[s] + jnp.tanh(h) * (-p[s]))

  b.add(f"neg({variant},{an})", fn)


def _row_slices(d: int) -> dict[str, Callable[[Any], Any]]:
  """Static slices of a (4D, ...) weight, each selecting D rows, some nested and strided."""
  return {
      "[:D]": lambda w: w[:d], "[D:2D]": lambda w: w[d:2 * d], "[1:D+1]": lambda w: w[1:d + 1],
      "[::4]": lambda w: w[::4], "[1::4]": lambda w: w[1::4], "[2::4]": lambda w: w[2::4],
      "[::2][::2]": lambda w: w[::2][::2], "[::2][1::2]": lambda w: w[::2][1::2],
      "[1::2][::2]": lambda w: w[1::2][::2], "[1::2][1::2]": lambda w: w[1::2][1::2],
      "[2D:][::2]": lambda w: w[2 * d:][::2], "[::2][:D]": lambda w: w[::2][:d],
      "[1:][::2][:D]": lambda w: w[1:][::2][:d], "[D:][::3]": lambda w: w[d:][::3][:d],
      # After reshapes: (4, D, .)[1] holds rows D:2D; (D, 4 .)[:, :k] holds rows 4i (and
      # [:, k:2k] rows 4i + 1); (2, 2D, .)[1, ::2] rows 2D, 2D + 2, ...
      "r(4,D)[1]": lambda w: w.reshape(4, d, -1)[1],
      "r(D,4.)[:,:k]": lambda w: w.reshape(d, -1)[:, :w.shape[1]].reshape(d, w.shape[1]),
      "r(D,4.)[:,k:2k]": lambda w: w.reshape(d, -1)[:, w.shape[1]:2 * w.shape[1]],
      "r(2,2D)[1,::2]": lambda w: w.reshape(2, 2 * d, -1)[1, ::2],
      # Reversed: rows 4D-1 down to 3D, and 4D-1, 4D-5, ...
      "[::-1][:D]": lambda w: w[::-1][:d], "[::-2][::2]": lambda w: w[::-2][::2],
  }


def _slice(b: _Builder) -> None:
  cols = b.rng.random() < 0.3  # slice the columns of a (D, 4D) weight instead
  w = b.param("w", (b.d, 4 * b.d) if cols else (4 * b.d, b.d), 1.0 / math.sqrt(b.d))
  table = _row_slices(b.d)
  picks = [b.choice(list(table)) for _ in range(int(b.rng.integers(1, 4)))]
  acts = [b.act() for _ in picks]

  def fn(p, h, data):
    out = 0.0
    for k, (pick, (_, act)) in enumerate(zip(picks, acts, strict=True)):
      m = table[pick](p[w].T).T if cols else table[pick](p[w])
      z = h if k == 0 else jnp.tanh(h * (k + 1))
      out = out + act(z @ m)
    return out

  b.add(f"slice({'cols' if cols else 'rows'}:{','.join(picks)})", fn)


def _gather(b: _Builder) -> None:
  e = b.param("emb", (b.v, b.d), 1.0)
  b.tables.append(e)
  variant = b.choice(["E[ids]", "take", "take_clip", "at_get_fill"])
  shift = int(b.rng.integers(0, b.v))

  def fn(p, h, data):
    ids = data["ids"] + shift if b.oob else (data["ids"] + shift) % b.v
    table = p[e]
    if variant == "E[ids]":
      g = table[ids]
    elif variant == "take":  # jnp.take's default mode, "fill" (its NaN fill replaced by 0)
      g = jnp.take(table, ids, axis=0, fill_value=0)
    elif variant == "take_clip":
      g = jnp.take(table, ids, axis=0, mode="clip")
    else:
      g = table.at[ids].get(mode="fill", fill_value=0)
    return h + g

  b.add(f"gather({variant}{',oob' if b.oob else ''})", fn)


def _scale(b: _Builder) -> None:
  s = b.param("s", (b.d,), 0.3, offset=1.0)
  bias = b.param("b", (b.d,), 0.1)
  an, act = b.act()
  b.add(f"scale({an})", lambda p, h, data: act(h * p[s] + p[bias]))


def _layernorm(b: _Builder) -> None:
  s = b.param("ln", (b.d,), 0.1, offset=1.0)
  bias = b.param("lnb", (b.d,), 0.1) if b.rng.random() < 0.6 else None

  def fn(p, h, data):
    m = h.mean(-1, keepdims=True)
    v = ((h - m) ** 2).mean(-1, keepdims=True)
    y = (h - m) * jax.lax.rsqrt(v + 1e-6) * p[s]
    return y if bias is None else y + p[bias]

  b.add(f"layernorm({'bias' if bias else ''})", fn)


def _div(b: _Builder) -> None:
  w = b.param("div", (b.d,), 0.3, offset=1.5)
  an, act = b.act()
  b.add(f"div(x/w,{an})", lambda p, h, data: act(h / p[w]))


def _bcast(b: _Builder) -> None:
  w = b.param("bw", (b.d,), 1.0 / math.sqrt(b.d))
  variant = b.choice(["x@bcast(w[:,None])", "x@bcast(w)", "x*bcast(w)"])
  an, act = b.act()

  def fn(p, h, data):
    if variant == "x@bcast(w[:,None])":
      return act(h @ jnp.broadcast_to(p[w][:, None], (b.d, b.d)))
    if variant == "x@bcast(w)":
      return act(h @ jnp.broadcast_to(p[w], (b.d, b.d)))
    return act(h * jnp.broadcast_to(p[w], h.shape))

  b.add(f"bcast({variant},{an})", fn)


def _conv(b: _Builder) -> None:
  k = int(b.rng.integers(1, 4))
  dil = int(b.rng.integers(1, 3))
  w = b.param("conv", (k, b.d, b.d), 1.0 / math.sqrt(k * b.d))
  an, act = b.act()

  def fn(p, h, data):
    return act(jax.lax.conv_general_dilated(
        h, p[w], (1,), "SAME", rhs_dilation=(dil,), dimension_numbers=("NWC", "WIO", "NWC")))

  b.add(f"conv(k={k},dil={dil},{an})", fn)


def _scan(b: _Builder) -> None:
  layers = int(b.rng.integers(1, 4))
  w = b.param("stack", (layers, b.d, b.d), 1.0 / math.sqrt(b.d))
  bias = b.param("stackb", (layers, b.d), 0.1)
  transposed = b.rng.random() < 0.3
  an, act = b.act()

  def fn(p, h, data):
    def layer(c, wb):
      m, v = wb
      return act(c @ (m.T if transposed else m) + v), None

    return jax.lax.scan(layer, h, (p[w], p[bias]))[0]

  b.add(f"scan(L={layers},{'W.T' if transposed else 'W'},{an})", fn)


def _rp(b: _Builder) -> None:
  w = b.param("w", (b.d, b.d))
  an, act = b.act()
  b.add(f"reduce_precision({an})", lambda p, h, data: act(
      h @ jax.lax.reduce_precision(p[w], exponent_bits=5, mantissa_bits=3)))


def _complex_w(b: _Builder) -> None:
  w = b.param("cw", (b.d, b.d), complex_=True)

  def fn(p, h, data):
    z = h.astype(jnp.complex64) @ p[w]
    return jnp.tanh(jnp.real(z) + 0.5 * jnp.imag(z))

  b.add("complex_w", fn)


def _complex_act(b: _Builder) -> None:
  w = b.param("w", (b.d, b.d))

  def fn(p, h, data):
    z = (h + 1j * jnp.tanh(h)) @ p[w]
    return jnp.tanh(jnp.real(z) - 0.7 * jnp.imag(z))

  b.add("complex_act", fn)


def _tied_vector(b: _Builder) -> None:
  s = b.param("tv", (b.d,), 0.3, offset=1.0)
  variant = b.choice(["x*s+a(x)*s", "x*s*s", "x*s+s"])
  an, act = b.act()

  def fn(p, h, data):
    if variant == "x*s+a(x)*s":
      return act(h * p[s] + jnp.tanh(h) * p[s])
    if variant == "x*s*s":
      return act(h * p[s] * p[s])
    return act(h * p[s] + p[s])

  b.add(f"tied_vector({variant},{an})", fn)


def _penalty(b: _Builder) -> None:
  # A weight decay written into the per-example loss: every example's gradient holds 2 c W.
  w = b.param("w", (b.d, b.d))
  an, act = b.act()
  b.add(f"penalty(x@W + 0.1*|W|^2,{an})",
        lambda p, h, data: act(h @ p[w]) + 0.1 * jnp.sum(p[w] ** 2))


def _scan_tied(b: _Builder) -> None:
  # A stacked weight scanned over and also used outside the scan (its first layer).
  layers = int(b.rng.integers(2, 4))
  w = b.param("stack", (layers, b.d, b.d), 1.0 / math.sqrt(b.d))
  an, act = b.act()

  def fn(p, h, data):
    h = jax.lax.scan(lambda c, m: (act(c @ m), None), h, p[w])[0]
    return jnp.tanh(h @ p[w][0].T)

  b.add(f"scan_tied(L={layers},{an})", fn)


def _masked(b: _Builder) -> None:
  # A weight under a fixed mask (jnp.where: select_n), as in pruning.
  w = b.param("w", (b.d, b.d))
  mask = b.rng.random((b.d, b.d)) < 0.6
  an, act = b.act()
  b.add(f"masked(where(m,W,0),{an})",
        lambda p, h, data: act(h @ jnp.where(mask, p[w], 0.0).astype(h.dtype)))


def _wrapped(b: _Builder) -> None:
  # A dense layer inside jax.checkpoint or a nested jit.
  w = b.param("w", (b.d, b.d))
  variant = b.choice(["checkpoint", "jit"])
  an, act = b.act()

  def layer(h, m):
    return act(h @ m)

  wrapped = jax.checkpoint(layer) if variant == "checkpoint" else jax.jit(layer)
  b.add(f"wrapped({variant},{an})", lambda p, h, data: wrapped(h, p[w]))


def _gather_t(b: _Builder) -> None:
  # A gather from a transposed table (columns of a (D, V) weight), then its tied head use.
  e = b.param("embT", (b.d, b.v), 1.0)
  tied = b.rng.random() < 0.5

  def fn(p, h, data):
    ids = data["ids"] + 0 if b.oob else data["ids"] % b.v
    g = jnp.take(p[e].T, ids, axis=0, mode="clip")
    h = h + g
    return jnp.tanh(h + (jax.nn.softmax(h @ p[e]) @ p[e].T if tied else 0.0))

  b.add(f"gather_t(take(E.T,clip){',tied' if tied else ''}{',oob' if b.oob else ''})", fn)


_OPS = {"dense": _dense, "tied": _tied, "neg": _neg, "slice": _slice, "gather": _gather,
        "scale": _scale, "layernorm": _layernorm, "div": _div, "bcast": _bcast, "conv": _conv,
        "scan": _scan, "rp": _rp, "complex_w": _complex_w, "complex_act": _complex_act,
        "tied_vector": _tied_vector, "penalty": _penalty, "scan_tied": _scan_tied,
        "masked": _masked, "wrapped": _wrapped, "gather_t": _gather_t}


def _cast(tree: Any, cdt: Any) -> Any:
  def one(a):
    return a.astype(cdt) if jnp.issubdtype(a.dtype, jnp.floating) else a
  return jax.tree.map(one, tree)


def generate(seed: int, exclude: tuple[str, ...] = (), small: bool = False) -> Case:
  """The seeded case ``seed``: a random model, data, compute dtype and micro-batch count.

  ``exclude`` removes ops by name (see :data:`OP_WEIGHTS`), e.g. known failures. ``small``:
  at most two ops and 8 rows (cheaper to compile, for the suite's short budget).
  """
  rng = np.random.default_rng(seed)
  d = int(rng.choice([2, 3, 4, 6, 8]))
  t = int(rng.choice([1, 2, 3, 4, 6]))
  v = int(rng.choice([3, 5, 12]))
  rows = int(rng.choice([4, 6, 8] if small else [4, 6, 8, 12, 16]))
  n = int(rng.choice([k for k in range(1, rows + 1) if rows % k == 0]))
  bf16 = rng.random() < 0.25
  cdt = jnp.bfloat16 if bf16 else jnp.float32
  oob = rng.random() < 0.4
  b = _Builder(rng, d, t, v, cdt, oob)
  names = [k for k in OP_WEIGHTS if k not in exclude and not (bf16 and k.startswith("complex"))]
  weights = np.array([OP_WEIGHTS[k] for k in names])
  for _ in range(int(rng.integers(1, 3 if small else 5))):
    _OPS[str(rng.choice(names, p=weights / weights.sum()))](b)

  # Data: inputs over many orders of magnitude, positions that (nearly) cancel sometimes.
  scale = 10.0 ** (rng.uniform(-1, 1) if rng.random() < 0.5 else rng.uniform(-20, 8))
  x = rng.standard_normal((rows, t, d))
  cancel = t >= 2 and rng.random() < 0.2
  if cancel:  # position 2k+1 is minus position 2k, up to a small relative difference
    eps = 10.0 ** rng.uniform(-7, -2)
    x[:, 1::2] = -x[:, 0::2][:, :x[:, 1::2].shape[1]] * (1 + eps * rng.standard_normal())
  x = (scale * x).astype(np.float32)
  lo, hi = (-v - 3, v + 3) if oob else (0, v)
  ids = rng.integers(lo, hi, (rows, t)).astype(np.int32)
  y = rng.standard_normal((rows, t, d)).astype(np.float32)
  tgt = rng.integers(0, v, (rows, t)).astype(np.int32)
  loss_scale = (min(1.0 / scale, 1e30) if rng.random() < 0.2
                else 10.0 ** rng.uniform(-2, 3))

  heads = ["sq", "linear", "xent"] + (["tied_xent"] if b.tables else [])
  head = str(rng.choice(heads))
  hw = None
  if head == "linear":
    hw = b.param("head", (d,), 1.0)
  elif head == "xent":
    hw = b.param("head", (d, v))
  tied = str(rng.choice(b.tables)) if head == "tied_xent" else None
  fns = tuple(b.fns)

  def loss(params, batch):
    p = _cast(params, cdt)
    h = batch["x"].astype(cdt)
    for fn in fns:
      h = fn(p, h, batch)
    if head == "sq":
      out = (h - batch["y"].astype(cdt)) ** 2
    elif head == "linear":
      out = h @ p[hw]
    else:
      logits = h @ (p[hw] if head == "xent" else p[tied].T)
      logits = logits.astype(jnp.float32)
      out = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
          logits, batch["tgt"][..., None], -1)[..., 0]
    return jnp.sum(jnp.real(out).astype(jnp.float32)) * loss_scale

  batch = {"x": x, "ids": ids, "y": y, "tgt": tgt}
  desc = (*b.desc, f"head={head}" + (f"({tied})" if tied else ""),
          f"scale={scale:.1e}", f"loss_scale={loss_scale:.1e}") + (("cancel",) if cancel else ())
  return Case(f"seed{seed}{'-small' if small else ''}", dict(b.params), loss, batch, n,
              "bfloat16" if bf16 else "float32", None, desc)


# --- The reference and the checker ---------------------------------------------------------


def norm64(tree: Any) -> float:
  """The L2 norm of a gradient, in float64: ``sqrt(sum |g|^2)`` over every inexact leaf."""
  total = 0.0
  for x in jax.tree.leaves(tree):
    a = np.asarray(x)
    if jnp.issubdtype(a.dtype, jnp.inexact):  # bfloat16 is not a NumPy inexact type
      total += float(np.sum(np.abs(_wide(a)) ** 2))
  return math.sqrt(total)


def _wide(a: Any) -> np.ndarray:
  """``a`` in complex128 if complex, else float64 (bfloat16 included)."""
  a = np.asarray(a)
  return a.astype(np.complex128) if np.iscomplexobj(a) else a.astype(np.float64)


def _row(batch: dict, j: int) -> dict:
  return jax.tree.map(lambda a: np.asarray(a)[j:j + 1], batch)


def _forward_norms(case: Case) -> np.ndarray:
  """Each example's gradient norm from forward mode, in float64: ``sqrt(sum_k d_k^2)`` over
  the directional derivatives ``d_k`` (``jax.jvp``, in the case's own dtypes) along every
  real direction of the parameters (a complex entry's real and imaginary ones), one row at
  a time under ``jax.vmap``. The same derivative as ``jax.grad``'s, by other arithmetic:
  the products and sums are formed in another order, so where float32 does not resolve the
  gradient the two read different norms."""
  leaves, treedef = jax.tree.flatten(case.params)
  bases = []  # per leaf: (its index, one tangent per real direction)
  for k, x in enumerate(leaves):
    x = np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    eye = np.eye(x.size).reshape(x.size, *x.shape)
    dirs = [eye, 1j * eye] if np.iscomplexobj(x) else [eye]
    bases.append((k, jnp.asarray(np.concatenate(dirs).astype(x.dtype))))

  def zero(x):
    x = np.asarray(x)
    return (np.zeros(x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact)
            else np.zeros(x.shape, jax.dtypes.float0))

  def per_row(row):
    def along(k, t):
      tangents = [zero(x) for x in leaves]
      tangents[k] = t
      return jax.jvp(lambda *q: case.loss(jax.tree.unflatten(treedef, q), row), leaves,
                     tangents)[1]
    return [jax.vmap(lambda t, k=k: along(k, t))(ts) for k, ts in bases]

  rows = jax.tree.map(lambda a: np.asarray(a)[:, None], case.batch)
  derivs = jax.device_get(jax.jit(jax.vmap(per_row))(rows))
  return np.sqrt(sum(np.sum(np.asarray(d, np.float64) ** 2, axis=1) for d in derivs))


def reference(case: Case) -> tuple[list[Any], np.ndarray, float, float]:
  """Each example's gradient (``jax.grad`` on the example alone) and its float64 norm; and
  how far the norms move when the same gradients are computed another way: under
  ``jax.vmap``, and by forward mode (:func:`_forward_norms`; 0 where the loss holds a
  ``reduce_precision``, whose forward mode rounds the tangent and whose reverse mode the
  cotangent, two derivatives by design). Each the largest relative difference.

  Where a loss is ill-conditioned in float32, no method can be compared with the reference
  there. Batching alone moves a gradient where its last bits depend on the order of a dot
  product's sums (``sin`` of an argument of 1e5). Forward mode moves it where the gradient
  cancels to far below float32's resolution of its terms, which batching leaves alone (the
  same products in the same order): ``act(h @ W + tanh(h) @ (-W))`` at ``|h|`` near 1e-5
  has a gradient ``(h - tanh h)``-sized, about ``h^2 / 3`` (3e-11) of its terms, so float32
  reads only its rounding: seed 3008's norms were 17x the float64 ones (5.2e-10 for 3.0e-11)
  under ``jax.grad``, 11x under forward mode, and ghost norms read a third value, 3.8e-10.
  """
  g = jax.jit(jax.grad(case.loss))
  grads = [jax.device_get(g(case.params, _row(case.batch, j))) for j in range(case.rows)]
  norms = np.array([norm64(x) for x in grads])
  rows = jax.tree.map(lambda a: np.asarray(a)[:, None], case.batch)
  batched = jax.device_get(jax.jit(jax.vmap(jax.grad(case.loss), in_axes=(None, 0)))(
      case.params, rows))
  again = np.array([norm64(jax.tree.map(lambda a, j=j: a[j], batched))
                    for j in range(case.rows)])
  rounds = "reduce_precision" in str(jax.make_jaxpr(case.loss)(case.params,
                                                               _row(case.batch, 0)))
  forward = norms if rounds else _forward_norms(case)

  def moved(other):
    with np.errstate(invalid="ignore", divide="ignore"):
      rel = np.abs(other - norms) / np.maximum(norms, 1e-30)
    return float(np.max(np.where(np.isnan(rel), np.inf, rel)))

  return grads, norms, moved(again), moved(forward)


def _diff_norm(a: Any, b: Any) -> float:
  return norm64(jax.tree.map(lambda x, y: _wide(x) - _wide(y), a, b))


def _clipped_reference(grads: list[Any], norms: np.ndarray, c: float) -> Any:
  factors = [min(1.0, c / n) if n > 0 else 1.0 for n in norms]
  return jax.tree.map(lambda *g: sum(f * _wide(x) for f, x in zip(factors, g, strict=True)),
                      *grads)


def _over_c(grad: Any, c: float | dict) -> float:
  """An example's contribution over its clip norm: ``|g| / C``, or with per-layer norms
  (``c`` a dict over the parameters' leaves) the largest ``|g_l| / C_l``."""
  if not isinstance(c, dict):
    return norm64(grad) / c
  return max(norm64(grad[k]) / c[k] for k in c)


def _raised(out: dict[str, Any], method: str, e: Exception) -> dict[str, Any]:
  """``out`` for a run that raised: a ``ValueError`` under ``method="ghost"`` is its
  documented refusal; anything else is a crash (a finding)."""
  if method == "ghost" and isinstance(e, ValueError):
    out["status"] = "refused"
    out["notes"].append(str(e).split("\n")[0][:300])
  else:
    out.update(status="fail", failed=["crash"], error=f"{type(e).__name__}: {e}"[:500])
  return out


def _run_method(case: Case, method: str, c: float | dict, ref_norms: np.ndarray, ref_sum: Any,
                scale: float, ill_conditioned: bool) -> dict:
  """One method on one case: its status, the measured errors and the failed properties."""
  clip = jaxaccum.dp.clip_per_example(c, method)
  out: dict[str, Any] = {"method": method, "status": "ok", "failed": [], "notes": []}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      step = jax.jit(jaxaccum.grad(case.loss, num_micro_batches=case.num_micro_batches,
                                   reduce="sum", with_info=True, per_example=clip))
      grads, info = step(case.params, case.batch)
      one = jax.jit(jaxaccum.grad(case.loss, num_micro_batches=1, reduce="sum",
                                  per_example=clip))
      alone = [_over_c(one(case.params, _row(case.batch, j)), c) for j in range(case.rows)]
    except Exception as e:  # noqa: BLE001 - any exception is a finding, or ghost's refusal
      return _raised(out, method, e)
  out["notes"] += sorted({str(w.message).split(":")[0][:200] for w in caught})
  norms = np.asarray(info.example_grad_norms, np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    rel = np.abs(norms - ref_norms) / np.maximum(ref_norms, 1e-30)
  rel = np.where(np.isfinite(norms), rel, np.inf)
  out["norm_rel_err"] = float(rel.max())
  out["worst_norm"] = {"example": int(rel.argmax()), "true": float(ref_norms[rel.argmax()]),
                       "reported": float(norms[rel.argmax()])}
  out["sum_rel_err"] = _diff_norm(grads, ref_sum) / scale if scale > 0 else 0.0
  ratio = np.array(alone)
  out["contribution_over_c"] = float(np.nanmax(np.where(np.isfinite(ratio), ratio, np.inf)))
  out["worst_contribution"] = {"example": int(np.nanargmax(ratio)),
                               "true_norm": float(ref_norms[int(np.nanargmax(ratio))])}
  norm_rtol = max(NORM_RTOL[case.compute], CANCELLATION_NORM_RTOL * case.kappa)
  if not ill_conditioned and not out["norm_rel_err"] <= norm_rtol:
    out["failed"].append("norms")
  return _verdict(out, case, ill_conditioned)


def _verdict(out: dict, case: Case, ill_conditioned: bool) -> dict:
  """``out`` with the clipped sum and the sensitivity bound judged (``failed``, ``status``):
  the sum within its tolerance unless the reference is ill-conditioned, and no example's
  contribution above C beyond rounding."""
  sum_rtol = max(SUM_RTOL[case.compute], CANCELLATION_NORM_RTOL * case.kappa)
  if not ill_conditioned and not out["sum_rel_err"] <= sum_rtol:
    out["failed"].append("sum")
  if not out["contribution_over_c"] <= 1 + case.rounding + CANCELLATION_BOUND * case.kappa:
    out["failed"].append("bound")
  if out["failed"]:
    out["status"] = "fail"
  return out


def clip_norm_for(norms: np.ndarray) -> float:
  """A clip norm that clips about two thirds of the examples and leaves the others.

  The geometric mean of two consecutive nonzero norms (in sorted order) that differ by more
  than 0.1%, the pair nearest the first third, so that some examples are clipped and some
  not, and no norm lies within rounding of ``C``. Half the smallest norm where all are
  within 0.1% of their neighbours; 0 if every norm is 0.
  """
  s = np.sort(norms[norms > 0])
  if s.size == 0:
    return 0.0
  gaps = [k for k in range(1, s.size) if s[k] > s[k - 1] * 1.001]
  if not gaps:
    return float(s[0]) / 2
  k = min(gaps, key=lambda k: abs(k - s.size / 3))
  return float(np.sqrt(s[k - 1] * s[k]))


def check(case: Case, methods: tuple[str, ...] = METHODS, per_layer: bool = False,
          fsdp: Fsdp | None = None) -> dict:
  """Runs ``methods`` on ``case`` against the reference; returns a JSON-able report.

  ``report["methods"][m]["failed"]`` lists the properties that method broke
  (``"norms"``, ``"sum"``, ``"bound"``, ``"crash"``); ``report["skipped"]`` says why a case
  was not checked (a reference norm that is not finite, or every norm 0). ``fsdp``: run
  under that FSDP placement (:func:`draw_fsdp`) instead, the sum and the bound only;
  ``report["fsdp"]`` describes it.
  """
  grads, ref_norms, moved, forward = reference(case)
  report: dict[str, Any] = {"case": case.name, "ops": list(case.ops), "compute": case.compute,
                            "rows": case.rows, "num_micro_batches": case.num_micro_batches,
                            "reference_moved": moved, "reference_forward": forward,
                            "methods": {}}
  if not np.all(np.isfinite(ref_norms)):
    report["skipped"] = "a reference norm is not finite"
    return report
  # Ill-conditioned: the norms and the sum are not compared, the bound (which needs no
  # reference) still is. Forward mode rounds at every operation, not only in the order of
  # a sum, so it is held to the whole tolerance: a reference uncertain by more than the
  # tolerance the methods are held to cannot judge them (forward mode moved well-resolved
  # bfloat16 cases by up to 1.3e-2, under NORM_RTOL's 2^-5; seed 3008 by 2.2).
  report["ill_conditioned"] = not (moved <= NORM_RTOL[case.compute] / 4
                                   and forward <= NORM_RTOL[case.compute])
  c = float(case.max_norm) if case.max_norm is not None else clip_norm_for(ref_norms)
  if not c > 0:
    report["skipped"] = "every reference norm is 0"
    return report
  c = float(np.float32(c))  # the clip norm jaxaccum sees, so the reference clips at the same
  ref_sum = _clipped_reference(grads, ref_norms, c)
  scale = float(np.sum(np.minimum(ref_norms, c)))
  report.update(max_norm=c, clipped=int(np.sum(ref_norms > c)),
                ref_norms=[float(n) for n in ref_norms])
  if per_layer:  # each leaf its own clip norm (clip_per_example with a pytree of norms)
    leaf = {k: np.array([norm64(g[k]) for g in grads]) for k in case.params}
    c = {k: float(np.float32(clip_norm_for(n) or 1.0)) for k, n in leaf.items()}
    factors = [{k: min(1.0, c[k] / leaf[k][e]) if leaf[k][e] > 0 else 1.0 for k in c}
               for e in range(case.rows)]
    ref_sum = {k: sum(f[k] * _wide(g[k]) for f, g in zip(factors, grads, strict=True))
               for k in c}
    scale = float(sum(np.sqrt(sum(min(leaf[k][e], c[k]) ** 2 for k in c))
                      for e in range(case.rows)))
    report.update(max_norm=c, clipped=int(sum(np.sum(n > c[k]) for k, n in leaf.items())))
  if fsdp is not None:
    report["fsdp"] = fsdp.describe()
  for m in methods:
    report["methods"][m] = (
        _run_method(case, m, c, ref_norms, ref_sum, scale, report["ill_conditioned"])
        if fsdp is None else
        _run_fsdp(case, fsdp, m, c, ref_sum, scale, report["ill_conditioned"]))
  return report


# --- FSDP placements -----------------------------------------------------------------------

# (param_gather, grad_scatter): every DataParallel placement of FSDP parameters; each also
# drawn with overlap_grad_reduce.
FSDP_PLACEMENTS = tuple((g, s) for g in ("step", "micro_batch") for s in ("step", "micro_batch"))


@dataclasses.dataclass(frozen=True)
class Fsdp:
  """One FSDP placement of a case: ``shards`` devices on one ``"data"`` axis, each
  parameter in ``specs`` sharded along that dimension (``None``: replicated)."""

  shards: int
  param_gather: str
  grad_scatter: str
  overlap: bool
  specs: tuple[tuple[str, int | None], ...]
  num_micro_batches: int

  @property
  def name(self) -> str:
    return (f"{self.param_gather}/{self.grad_scatter}"
            + ("+overlap" if self.overlap else ""))

  def describe(self) -> dict:
    return {"placement": self.name, "shards": self.shards,
            "sharded": {k: d for k, d in self.specs if d is not None},
            "num_micro_batches": self.num_micro_batches}


def draw_fsdp(case: Case, rng: np.random.Generator,
              placement: tuple[str, str, bool] | None = None) -> Fsdp | None:
  """A drawn FSDP placement for ``case`` (``placement``: ``(param_gather, grad_scatter,
  overlap)``, else drawn too), or ``None`` if no shard count in 2, 4, 8 divides both the
  rows and a dimension of some parameter. At least one parameter is sharded; the
  micro-batch count is the case's, reduced to one that divides each shard's rows."""
  counts = [k for k in (2, 4, 8) if k <= len(jax.devices()) and case.rows % k == 0
            and any(any(n % k == 0 for n in np.shape(v)) for v in case.params.values())]
  if not counts:
    return None
  shards = int(rng.choice(counts))
  if placement is None:
    g, s = FSDP_PLACEMENTS[int(rng.integers(len(FSDP_PLACEMENTS)))]
    placement = (g, s, bool(rng.random() < 0.5))
  dims = {k: [d for d, n in enumerate(np.shape(v)) if n % shards == 0]
          for k, v in case.params.items()}
  specs = {k: (None if not ds or rng.random() < 0.4 else int(rng.choice(ds)))
           for k, ds in dims.items()}
  if all(d is None for d in specs.values()):
    k = str(rng.choice([k for k, ds in dims.items() if ds]))
    specs[k] = int(rng.choice(dims[k]))
  n = math.gcd(case.num_micro_batches, case.rows // shards)
  return Fsdp(shards, *placement, tuple(sorted(specs.items())), n)


def _fsdp_step(case: Case, f: Fsdp, clip: Any) -> tuple[Callable[..., Any], Any, Any]:
  """The case's clipped sum under ``f``: ``(step, params, batch)``, the parameters and the
  batch placed on the mesh; ``step(params, batch, weights)``, each example's loss times its
  weight (``fun`` sees one example at a time, so a weight of 0 gives a zero gradient)."""
  mesh = jax.make_mesh((f.shards,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:f.shards])
  specs = dict(f.specs)

  def spec(k, v):
    d = specs[k]
    return P() if d is None else P(*[("data" if j == d else None) for j in range(np.ndim(v))])

  params = {k: jax.device_put(v, NamedSharding(mesh, spec(k, v))) for k, v in case.params.items()}
  batch = jax.device_put(case.batch, NamedSharding(mesh, P("data")))
  dp = jaxaccum.DataParallel("data", mesh=mesh, param_gather=f.param_gather,
                             grad_scatter=f.grad_scatter, overlap_grad_reduce=f.overlap)

  def weighted(p, b, weight):
    return case.loss(p, b) * jnp.sum(weight)  # one example: its weight

  step = jax.jit(jaxaccum.grad(weighted, num_micro_batches=f.num_micro_batches,
                               reduce="sum", batch_argnums=(1, 2), data_axis=dp,
                               per_example=clip))
  sharding = NamedSharding(mesh, P("data"))

  def run(p, b, weights):
    return step(p, b, jax.device_put(jnp.asarray(weights, jnp.float32), sharding))

  return run, params, batch


def _run_fsdp(case: Case, f: Fsdp, method: str, c: float | dict, ref_sum: Any,
              scale: float, ill_conditioned: bool) -> dict:
  """One method on one case under the FSDP placement ``f``: the clipped sum against the
  reference, and each example alone among padding rows (the bound)."""
  clip = jaxaccum.dp.clip_per_example(c, method)
  out: dict[str, Any] = {"method": method, "status": "ok", "failed": [], "notes": []}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      step, params, batch = _fsdp_step(case, f, clip)
      grads = step(params, batch, np.ones(case.rows))
      alone = [_over_c(jax.device_get(step(params, batch, np.arange(case.rows) == j)), c)
               for j in range(case.rows)]
    except Exception as e:  # noqa: BLE001 - any exception is a finding, or ghost's refusal
      return _raised(out, method, e)
  out["notes"] += sorted({str(w.message).split(":")[0][:200] for w in caught})
  out["sum_rel_err"] = _diff_norm(jax.device_get(grads), ref_sum) / scale if scale > 0 else 0.0
  ratio = np.where(np.isfinite(alone), alone, np.inf)  # a NaN contribution breaks the bound
  out["contribution_over_c"] = float(np.max(ratio))
  out["worst_contribution"] = {"example": int(np.argmax(ratio))}
  return _verdict(out, case, ill_conditioned)


def failures(report: dict) -> dict[str, list[str]]:
  """``{method: failed properties}`` for the methods of ``report`` that failed."""
  return {m: r["failed"] for m, r in report.get("methods", {}).items() if r["failed"]}


def describe(report: dict) -> str:
  """One paragraph about a failed case, for an assertion message or the CLI."""
  where = f", FSDP {report['fsdp']}" if "fsdp" in report else ""
  lines = [f"{report['case']}{where} ({report['compute']}, {report['rows']} rows, "
           + ("ill-conditioned: bound only, " if report.get("ill_conditioned") else "")
           + f"{report['num_micro_batches']} micro-batches, C={report.get('max_norm')}): "
           + " ; ".join(report["ops"])]
  for m, r in report.get("methods", {}).items():
    if not r["failed"]:
      continue
    if "error" in r:
      lines.append(f"  {m}: {r['error']}")
      continue
    w = r.get("worst_norm")
    norms = ("" if w is None else
             f"worst norm rel err {r['norm_rel_err']:.3g} (example {w['example']}: true "
             f"{w['true']:.6g}, reported {w['reported']:.6g}), ")
    lines.append(f"  {m}: failed {r['failed']}: {norms}sum rel err {r['sum_rel_err']:.3g}, "
                 f"max contribution {r['contribution_over_c']:.6f} C")
  return "\n".join(lines)


# --- Known cases, as explicit regression cases -------------------------------------------


def _normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
  return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _negation() -> Case:
  # W at two sites, one through a negation: the cross term of the two uses changes sign
  # (ghost norms throughout: "ghost" runs, and "auto" takes it).
  def loss(p, b):
    h = b["x"] @ p["w"] + jnp.tanh(b["x"]) @ (-p["w"])
    return jnp.sum(jnp.sin(h) * b["y"])

  return Case("negation", {"w": _normal(0, (4, 4))}, loss,
              {"x": _normal(2, (8, 3, 4)), "y": _normal(3, (8, 3, 4))}, 2,
              ops=("x@W+tanh(x)@(-W)",))


def _negation_of_a_difference() -> Case:
  # V - V.T: two uses of V in one subtraction, which the analysis does not follow ("ghost"
  # refuses it, "auto" materialises V).
  def loss(p, b):
    h = b["x"] @ p["w"] + b["x"] @ (p["v"] - p["v"].T)
    return jnp.sum(jnp.sin(h) * b["y"])

  return Case("negation_of_a_difference", {"w": _normal(0, (4, 4)), "v": _normal(1, (4, 4))},
              loss, {"x": _normal(2, (8, 3, 4)), "y": _normal(3, (8, 3, 4))}, 2,
              ops=("x@W", "x@(V-V.T)"))


def _gram_cancellation() -> Case:
  # Two positions with opposite activations and the same cotangent: a_0 g^T + a_1 g^T is
  # tiny, but the Gram form <A A^T, G G^T> sums four large terms (T = 2, D = 8: Gram form).
  x = _normal(0, (8, 1, 8), 1e3)
  x = np.concatenate([x, -x * (1 + 1e-4 * _normal(1, (8, 1, 1)))], axis=1)

  def loss(p, b):
    return jnp.sum((b["x"] @ p["w"]) @ p["v"])

  return Case("gram_cancellation", {"w": _normal(2, (8, 8)), "v": _normal(3, (8,))}, loss,
              {"x": x.astype(np.float32)}, 2, ops=("positions x, -x(1+1e-4)", "x@W@v"),
              kappa=1e4)


def _cancelling(rows: int, d: int, scale: float = 1e3,
                eps: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
  """``a`` and ``-a (1 + eps r)``: two activations whose sum is about ``eps`` of either."""
  a = _normal(10, (rows, 1, d), scale)
  return a, (-a * (1 + eps * _normal(11, (rows, 1, 1)))).astype(np.float32)


def _gram_cancellation_gather() -> Case:
  # The index Gram of a gather (50 rows, 3 tokens): the same id at two positions whose
  # cotangents nearly cancel, so sum_{t,u} [i_t = i_u] <g_t, g_u> is a difference of large
  # terms.
  a, b = _cancelling(8, 2)
  ids = np.stack([np.arange(8), np.arange(8), 20 + np.arange(8)], 1).astype(np.int32)

  def loss(p, bt):
    return jnp.sum(p["emb"][bt["ids"]] * bt["y"])

  y = np.concatenate([a, b, _normal(12, (8, 1, 2))], 1)
  return Case("gram_cancellation_gather", {"emb": _normal(0, (50, 2))}, loss,
              {"ids": ids, "y": y}, 2, ops=("E[ids] . y, y_1 = -y_0 (1 + 1e-4)",), kappa=1e4)


def _gram_cancellation_scan() -> Case:
  # The Gram form inside a scan body (stacked weights as xs), positions x and -x (1 + 1e-3)
  # (closer, and float32 no longer gives the reference's gradient to 1e-3 either).
  a, b = _cancelling(8, 8, eps=1e-3)

  def loss(p, bt):
    h = jax.lax.scan(lambda c, w: (c @ w, None), bt["x"], p["w"])[0]
    return jnp.sum(h @ p["v"])

  return Case("gram_cancellation_scan", {"w": _normal(0, (2, 8, 8), 0.4), "v": _normal(1, (8,))},
              loss, {"x": np.concatenate([a, b], 1)}, 2,
              ops=("scan(x @ W_l), x_1 = -x_0 (1 + 1e-3)",), kappa=1e3)


def _gram_cancellation_tied() -> Case:
  # One weight at two sites whose gradients nearly cancel: the cross term 2 <G_s, G_t> is
  # minus the sum of the two squares to 1e-4.
  a, b = _cancelling(8, 8)

  def loss(p, bt):
    return jnp.sum((bt["x"] @ p["w"] + bt["x2"] @ p["w"]) @ p["v"])

  return Case("gram_cancellation_tied", {"w": _normal(0, (8, 8)), "v": _normal(1, (8,))}, loss,
              {"x": np.concatenate([a, a], 1), "x2": np.concatenate([b, b], 1)}, 2,
              ops=("x @ W + x2 @ W, x2 = -x (1 + 1e-4)",), kappa=1e4)


def _promise_in_bounds_gather() -> Case:
  # E[ids] (PROMISE_IN_BOUNDS) with an id past the end: the forward pass clamps it, the
  # backward pass drops it.
  ids = np.array([[0, 6, 2], [1, 1, 9], [5, 3, 4], [7, 0, 2]], np.int32)

  def loss(p, b):
    return jnp.sum(jnp.tanh(p["emb"][b["ids"]]) * b["y"])

  return Case("promise_in_bounds_gather", {"emb": _normal(0, (6, 3))}, loss,
              {"ids": ids, "y": _normal(1, (4, 3, 3))}, 2, ops=("E[ids], ids >= 6",))


def _underflow() -> Case:
  # Activations of about 1e-25 times an output gradient of about 1e26.
  def loss(p, b):
    return 1e26 * jnp.sum(jnp.tanh(b["x"] @ p["w"]) * b["y"])

  return Case("underflow", {"w": _normal(0, (4, 4))}, loss,
              {"x": _normal(1, (4, 2, 4), 1e-25), "y": _normal(2, (4, 2, 4))}, 1,
              ops=("1e26 * tanh(1e-25 x @ W)",))


def _tiny_norms() -> Case:
  # Every gradient norm about 1e-21: reported as it is, not as 0.
  def loss(p, b):
    return jnp.sum(jnp.tanh(b["x"] @ p["w"]) * b["y"])

  return Case("tiny_norms", {"w": _normal(0, (4, 4))}, loss,
              {"x": _normal(1, (4, 2, 4), 1e-21), "y": _normal(2, (4, 2, 4))}, 2,
              ops=("tanh(1e-21 x @ W)",))


def _complex_params() -> Case:
  # A complex weight whose gradient is mostly imaginary: |g|^2 sums |g_ij|^2.
  def loss(p, b):
    z = b["x"].astype(jnp.complex64) @ p["w"]
    return jnp.sum(jnp.imag(z) * b["y"]) + 0.1 * jnp.sum(jnp.real(z) * b["y"])

  w = (_normal(0, (3, 3)) + 1j * _normal(1, (3, 3))).astype(np.complex64)
  return Case("complex_params", {"w": w}, loss,
              {"x": _normal(2, (4, 2, 3)), "y": _normal(3, (4, 2, 3))}, 2,
              ops=("imag(x @ W_complex)",))


def _complex_activations() -> Case:
  # A real weight times complex activations: the imaginary parts' products count too.
  def loss(p, b):
    z = (b["x"] + 1j * b["x2"]) @ p["w"]
    return jnp.sum(jnp.imag(z) * b["y"])

  return Case("complex_activations", {"w": _normal(0, (3, 3))}, loss,
              {"x": _normal(1, (4, 2, 3)), "x2": _normal(2, (4, 2, 3), 4.0),
               "y": _normal(3, (4, 2, 3))}, 2, ops=("imag((x + i x2) @ W)",))


def _reduce_precision() -> Case:
  # reduce_precision on a weight rounds its cotangent too: not norm-preserving.
  def loss(p, b):
    w = jax.lax.reduce_precision(p["w"], exponent_bits=4, mantissa_bits=3)
    return jnp.sum(jnp.tanh(b["x"] @ w) * b["y"])

  return Case("reduce_precision", {"w": _normal(0, (4, 4))}, loss,
              {"x": _normal(1, (8, 2, 4)), "y": _normal(2, (8, 2, 4))}, 2,
              ops=("x @ reduce_precision(W, 4, 3)",))


def _bf16_compute() -> Case:
  # float32 parameters cast to bfloat16 inside the loss: the clipped examples must stay
  # within C * (1 + ROUNDING_BOUND).
  def loss(p, b):
    q = _cast(p, jnp.bfloat16)
    h = jnp.tanh(b["x"].astype(jnp.bfloat16) @ q["w1"] + q["b1"])
    out = h @ q["w2"]
    return jnp.sum(((out - b["y"].astype(jnp.bfloat16)) ** 2).astype(jnp.float32))

  return Case("bf16_compute", {"w1": _normal(0, (6, 8), 0.5), "b1": _normal(1, (8,), 0.1),
                               "w2": _normal(2, (8, 3), 0.5)}, loss,
              {"x": _normal(3, (16, 4, 6)), "y": _normal(4, (16, 4, 3))}, 4, "bfloat16",
              ops=("bf16 MLP",))


def _bf16_parameters() -> Case:
  # Parameters stored in bfloat16 (not cast): the gradient comes back in bfloat16, so the
  # clipped gradient is rounded after the clip; the bound must hold all the same (or the
  # documented bound must say how far bfloat16 leaves may go past C).
  def loss(p, b):
    h = jnp.sin(b["x"].astype(jnp.bfloat16) @ p["w"])
    return jnp.sum((h * b["y"].astype(jnp.bfloat16)).astype(jnp.float32))

  return Case("bf16_parameters", {"w": _normal(0, (4, 4)).astype(jnp.bfloat16)}, loss,
              {"x": _normal(1, (6, 3, 4)), "y": _normal(2, (6, 3, 4))}, 2, "bfloat16",
              ops=("bf16 leaf: sin(x @ W_bf16)",), rounding=2.0 ** -8)


def _fill_drops_index() -> Case:
  # mode="fill" with ids past the end and below -rows: those positions add no gradient.
  ids = np.array([[0, 9, 2, 9], [-9, 1, 1, 3], [4, 4, 12, 0], [2, -1, 5, 5]], np.int32)

  def loss(p, b):
    e = jnp.take(p["emb"], b["ids"], axis=0, mode="fill", fill_value=0)
    return jnp.sum(jnp.tanh(e @ p["w"]) * b["y"])

  return Case("fill_drops_index", {"emb": _normal(0, (6, 3)), "w": _normal(1, (3, 3))}, loss,
              {"ids": ids, "y": _normal(2, (4, 4, 3))}, 2, ops=("take(mode=fill), ids out",))


def _broadcast_weight() -> Case:
  # A product with a broadcast copy of a weight: every column of the matrix is w.
  def loss(p, b):
    m = jnp.broadcast_to(p["w"][:, None], (4, 4))
    return jnp.sum(jnp.tanh(b["x"] @ m) * b["y"])

  return Case("broadcast_weight", {"w": _normal(0, (4,))}, loss,
              {"x": _normal(1, (6, 3, 4)), "y": _normal(2, (6, 3, 4))}, 3,
              ops=("x @ broadcast(w[:, None])",))


def _divide_by_parameter() -> Case:
  # x / w: the gradient is -x g / w^2, not the linear rule's x g.
  def loss(p, b):
    return jnp.sum(jnp.tanh(b["x"] / p["w"]) * b["y"])

  return Case("divide_by_parameter", {"w": 1.5 + _normal(0, (4,), 0.3)}, loss,
              {"x": _normal(1, (6, 3, 4)), "y": _normal(2, (6, 3, 4))}, 2, ops=("x / w",))


def _nested_strided_slices() -> Case:
  # W[::2][1::2] holds rows 2, 6, 10, 14 and W[2::4] the same rows: the uses overlap.
  def loss(p, b):
    h = b["x"] @ p["w"][::2][1::2] + jnp.tanh(b["x"]) @ p["w"][2::4]
    return jnp.sum(jnp.sin(h) * b["y"])

  return Case("nested_strided_slices", {"w": _normal(0, (16, 4))}, loss,
              {"x": _normal(1, (6, 3, 4)), "y": _normal(2, (6, 3, 4))}, 2,
              ops=("x @ W[::2][1::2] + tanh(x) @ W[2::4]",))


REGRESSIONS: dict[str, Callable[[], Case]] = {
    "negation": _negation, "negation_of_a_difference": _negation_of_a_difference,
    "gram_cancellation": _gram_cancellation,
    "gram_cancellation_gather": _gram_cancellation_gather,
    "gram_cancellation_scan": _gram_cancellation_scan,
    "gram_cancellation_tied": _gram_cancellation_tied,
    "promise_in_bounds_gather": _promise_in_bounds_gather, "underflow": _underflow,
    "tiny_norms": _tiny_norms, "complex_params": _complex_params,
    "complex_activations": _complex_activations, "reduce_precision": _reduce_precision,
    "bf16_compute": _bf16_compute, "bf16_parameters": _bf16_parameters,
    "fill_drops_index": _fill_drops_index,
    "broadcast_weight": _broadcast_weight, "divide_by_parameter": _divide_by_parameter,
    "nested_strided_slices": _nested_strided_slices,
}
