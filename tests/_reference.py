"""A reference model of ``jaxaccum.value_and_grad``, written from its documented rules.

:func:`reference` computes what ``jaxaccum.value_and_grad(fun, ...)(*args)`` must return
with a plain Python loop over the micro-batches, in float64 NumPy, without any of
jaxaccum's helpers: micro-batch ``i`` of ``N`` is taken by explicit slicing (``x[i::N]``
holds rows ``i, i + N, i + 2N, ...``), and each rule is applied as the docstring of
``jaxaccum.value_and_grad``, ``docs/computes.md``, ``docs/robust.md``,
``docs/devices.md`` and ``docs/noise-scale.md`` state it:

* loss terms: ``"mean"`` divides by the micro-batches kept, ``"sum"`` by nothing,
  ``"weighted"`` by its own total denominator (0 gives 0); a dict ``reduce`` gives
  ``sum_t weight_t * value_t`` and the gradients of that total;
* aux: ``"mean"`` (weighted by the denominator when the loss has exactly one weighted term,
  a micro-batch of weight 0 adding nothing), ``"sum"`` (integers counted in int32),
  ``"max"``, ``"min"``, ``"all"``/``"any"`` (logical AND / OR of boolean leaves over the
  micro-batches kept, a bool), ``"stack"`` (one entry per micro-batch) and ``"concat"`` (rows
  back in batch order); the default is ``"mean"`` for a float scalar, ``"sum"`` for an
  integer scalar and ``"all"`` for a boolean scalar; a user-defined reduction (an object with
  ``init``, ``update`` and ``finalize``, as ``optax.microbatching.Accumulator``) gets
  ``init(ShapeDtypeStruct of one micro-batch's value)``, then ``update(carry, value, i)`` for
  each kept micro-batch ``i`` in order, and returns ``finalize(carry)`` (one shard only);
* state (``state_argnum``) threaded in micro-batch order; PRNG keys (``rng_argnums``)
  folded as ``fold_in(key, i)``;
* ``skip_nonfinite``: a micro-batch whose value, denominator or any gradient is not finite
  adds nothing (nor its state update); means divide by the micro-batches kept; all skipped:
  NaN value and zero gradients; stacked and concatenated entries stay as returned;
* ``active``: only micro-batches ``0..k-1`` run; the others leave zeros in stacked and
  concatenated aux and count nowhere;
* ``shards=D`` (``data_axis`` on ``D`` devices): shard ``d`` holds the contiguous block
  ``d`` of ``B / D`` rows and runs the same loop on it with keys
  ``fold_in(fold_in(key, d), i)`` and its own state; sums and counts are over every shard's
  micro-batches; stacked aux entries are averaged over shards (summed for integers and
  under ``reduce="sum"``); concatenated rows come back in batch order; float state is
  averaged over shards, integer state takes the maximum; ``info.num_micro_batches`` counts
  the micro-batches run on every shard (``k * D``);
* ``with_info``: the :class:`jaxaccum.AccumInfo` fields from the samples (each kept
  micro-batch of each shard whose weighted denominators are all positive) and ``G_B``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxaccum


@dataclasses.dataclass(frozen=True)
class Rules:
  """The options the reference applies (names as in ``jaxaccum.value_and_grad``)."""

  num_micro_batches: int
  reduce: Any = "mean"
  loss_weights: dict | None = None
  has_aux: bool = False
  aux_reduce: Any = None  # a dict of kinds (or None) with aux's top-level keys, or None
  argnums: int = 0
  batch_argnums: tuple[int, ...] = (1,)
  rng_argnums: tuple[int, ...] = ()
  state_argnum: int | None = None
  skip_nonfinite: bool = False
  with_info: bool = False
  active: int | None = None
  shards: int = 1


def _f64(x):
  return np.asarray(x, np.float64)


def _is_int(x) -> bool:
  return np.issubdtype(np.asarray(x).dtype, np.integer)


def _terms(rules: Rules) -> list[tuple[Any, str, float]]:
  """(name or None, kind, weight) per term, in the dict's key order."""
  if isinstance(rules.reduce, str):
    return [(None, rules.reduce, 1.0)]
  weights = rules.loss_weights or {}
  return [(k, kind, float(weights.get(k, 1.0))) for k, kind in sorted(rules.reduce.items())]


def _host(x):
  """An array leaf on the host, so that slicing it runs no device op (PRNG keys stay)."""
  if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
    return x
  return np.asarray(x)


def _slice(tree, i: int, n: int):
  return jax.tree.map(lambda x: _host(x)[i::n], tree)


def _block(tree, d: int, shards: int):
  def take(x):
    rows = x.shape[0] // shards
    return _host(x)[d * rows:(d + 1) * rows]
  return jax.tree.map(take, tree)


def _finite(tree) -> bool:
  return all(np.all(np.isfinite(_f64(x))) for x in jax.tree.leaves(tree)
             if np.issubdtype(np.asarray(x).dtype, np.inexact))


@dataclasses.dataclass
class _Micro:
  nums: list  # per term: float
  dens: list  # per term: float or None
  grads: list  # per term: the gradient of its numerator (float64 pytree)
  state: Any
  aux: Any
  kept: bool
  rows: int


def _run_micro(fun, rules: Rules, args: tuple, terms) -> _Micro:
  has_extra = rules.has_aux or rules.state_argnum is not None

  def f(p):
    call = list(args)
    call[rules.argnums] = p
    out = fun(*call)
    value, extra = out if has_extra else (out, None)
    nums, dens = [], []
    for name, kind, _ in terms:
      v = value if name is None else value[name]
      if kind == "weighted":
        nums.append(v[0])
        dens.append(v[1])
      else:
        nums.append(v)
        dens.append(None)
    return tuple(nums), (dens, extra)

  nums, vjp, (dens, extra) = jax.vjp(f, args[rules.argnums], has_aux=True)
  grads = []
  for t in range(len(terms)):
    cot = tuple(jnp.ones_like(v) if s == t else jnp.zeros_like(v) for s, v in enumerate(nums))
    grads.append(jax.tree.map(_f64, vjp(cot)[0]))
  if rules.state_argnum is not None:
    new_state, aux = extra if rules.has_aux else (extra, None)
  else:
    new_state, aux = None, extra
  dens_f = [None if d is None else float(d) for d in dens]
  kept = True
  if rules.skip_nonfinite:
    kept = (_finite(list(nums)) and _finite([d for d in dens if d is not None])
            and _finite(grads))
  return _Micro([float(x) for x in nums], dens_f, grads, new_state, aux, kept, 0)


def _tree_sum(trees):
  return jax.tree.map(lambda *xs: sum(xs), *trees)


def _scale(tree, c):
  return jax.tree.map(lambda x: x * c, tree)


def _safe_div(x, d):
  return 0.0 * x if d == 0 else x / d


def _aux_kind(kind, leaf) -> Any:
  if kind is not None:
    return kind
  assert np.shape(leaf) == (), "the default aux reduction applies to scalars"
  if np.asarray(leaf).dtype == np.bool_:
    return "all"
  return "sum" if _is_int(leaf) else "mean"


def _reduce_aux(rules: Rules, terms, shards: list[list[_Micro]], n: int):
  """aux reduced over every shard's micro-batches as its kinds say."""
  sample = next(m.aux for ms in shards for m in ms if m is not None)
  weighted = [t for t, (_, kind, _) in enumerate(terms) if kind == "weighted"]
  wt = weighted[0] if len(weighted) == 1 else None
  spec = rules.aux_reduce
  kinds = (jax.tree.map(lambda _: spec, sample) if spec is None or isinstance(spec, str) else
           {k: jax.tree.map(lambda _, kind=kind: kind, v)
            for k, v, kind in ((k, v, spec.get(k)) for k, v in sample.items())})
  kept = [m for ms in shards for m in ms if m is not None and m.kept]

  def leaf(path, kind, proto):
    kind = _aux_kind(kind, proto)
    get = lambda m: _getpath(m.aux, path)  # noqa: E731
    dtype = np.asarray(proto).dtype
    if not isinstance(kind, str):  # a user-defined reduction, on one shard
      assert len(shards) == 1, "a user reduction has no rule across shards"
      carry = kind.init(jax.ShapeDtypeStruct(np.shape(proto), dtype))
      for i, m in enumerate(shards[0]):
        if m is not None and m.kept:
          carry = kind.update(carry, jnp.asarray(get(m)), jnp.int32(i))
      return kind.finalize(carry)
    if kind in ("all", "any"):
      vals = [bool(get(m)) for m in kept]
      return np.bool_(all(vals) if kind == "all" else any(vals))
    if kind == "mean":
      if wt is not None:
        total = sum((np.zeros(np.shape(proto)) if m.dens[wt] == 0 else _f64(get(m)) * m.dens[wt])
                    for m in kept) if kept else np.zeros(np.shape(proto))
        out = _safe_div(total, sum(m.dens[wt] for m in kept))
      else:
        total = sum(_f64(get(m)) for m in kept) if kept else np.zeros(np.shape(proto))
        out = _safe_div(total, len(kept))
      return np.asarray(out, np.float32 if _is_int(proto) else dtype)
    if kind == "sum":
      total = sum(_f64(get(m)) for m in kept) if kept else np.zeros(np.shape(proto))
      return np.asarray(total, np.int32 if _is_int(proto) else dtype)
    if kind in ("max", "min"):
      if _is_int(proto):
        info = np.iinfo(dtype)
        fill = info.min if kind == "max" else info.max
      else:
        fill = -np.inf if kind == "max" else np.inf
      out = np.full(np.shape(proto), fill, np.float64)
      for m in kept:
        out = np.maximum(out, _f64(get(m))) if kind == "max" else np.minimum(out, _f64(get(m)))
      return np.asarray(out, dtype)
    # Per-micro-batch kinds: entries of the micro-batches that ran, as returned; zeros else.
    per_shard = [np.stack([_f64(get(m)) if m is not None else np.zeros(np.shape(proto))
                           for m in ms]) for ms in shards]
    if kind == "stack":
      total = sum(per_shard)
      sums = _is_int(proto) or rules.reduce == "sum"
      return np.asarray(total if sums else total / len(shards), dtype)
    assert kind == "concat", kind
    rows = [s.swapaxes(0, 1).reshape((-1,) + s.shape[2:]) for s in per_shard]
    return np.asarray(np.concatenate(rows), dtype)

  paths = jax.tree_util.tree_flatten_with_path(sample)[0]
  kind_leaves = jax.tree.structure(sample).flatten_up_to(kinds)
  out = [leaf(p, k, v) for (p, v), k in zip(paths, kind_leaves, strict=True)]
  return jax.tree.unflatten(jax.tree.structure(sample), out)


def _getpath(tree, path):
  for k in path:
    tree = tree[getattr(k, "key", getattr(k, "idx", None))]
  return tree


def _sq_norm(tree) -> float:
  return float(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree)))


def reference(fun, args: tuple, rules: Rules):
  """What ``jaxaccum.value_and_grad(fun, **options)(*args)`` returns, by the rules above."""
  n, shards = rules.num_micro_batches, rules.shards
  k = n if rules.active is None else rules.active
  terms = _terms(rules)
  batch_size = jax.tree.leaves(args[rules.batch_argnums[0]])[0].shape[0]
  rows = batch_size // (n * shards)
  state0 = None if rules.state_argnum is None else args[rules.state_argnum]

  runs: list[list[_Micro | None]] = []  # per shard, per micro-batch (None: did not run)
  states = []
  for d in range(shards):
    state = state0
    ms: list[_Micro | None] = []
    for i in range(n):
      if i >= k:
        ms.append(None)
        continue
      call = list(args)
      for j in rules.batch_argnums:
        call[j] = _slice(_block(args[j], d, shards), i, n)
      for j in rules.rng_argnums:
        call[j] = jax.tree.map(lambda key, d=d, i=i: jax.random.fold_in(
            key if shards == 1 else jax.random.fold_in(key, d), i), args[j])
      if rules.state_argnum is not None:
        call[rules.state_argnum] = state
      m = _run_micro(fun, rules, tuple(call), terms)
      m.rows = rows
      if m.kept and rules.state_argnum is not None:
        state = m.state
      ms.append(m)
    runs.append(ms)
    states.append(state)

  ran = [m for ms in runs for m in ms if m is not None]
  kept = [m for m in ran if m.kept]
  count = len(kept)
  params = args[rules.argnums]
  zeros = jax.tree.map(lambda p: np.zeros(np.shape(p)), params)

  def divisor(t, kind):
    if kind == "mean":
      return count
    if kind == "sum":
      return 1
    return sum(m.dens[t] for m in kept)

  values, grads = [], zeros
  for t, (_, kind, w) in enumerate(terms):
    d = divisor(t, kind)
    num = sum(m.nums[t] for m in kept)
    value = _safe_div(num, d)
    if rules.skip_nonfinite and count == 0:
      value = np.nan
    values.append(value)
    g = _tree_sum([m.grads[t] for m in kept]) if kept else zeros
    grads = jax.tree.map(lambda a, b, d=d, w=w: a + w * _safe_div(b, d), grads, g)
  value_dtype = np.float32
  if isinstance(rules.reduce, str):
    value = np.float32(values[0])
  else:
    value = np.float32(sum(w * v for (_, _, w), v in zip(terms, values, strict=True)))
  grads = jax.tree.map(lambda g, p: np.asarray(g, np.asarray(p).dtype), grads, params)

  aux = _reduce_aux(rules, terms, runs, n) if rules.has_aux else None
  state = None
  if rules.state_argnum is not None:
    if shards == 1:
      state = states[0]
    else:
      state = jax.tree.map(
          lambda *s: np.asarray(np.max(np.stack(s), 0) if _is_int(s[0]) else
                                np.mean(np.stack([_f64(x) for x in s]), 0),
                                np.asarray(s[0]).dtype), *states)

  if rules.state_argnum is not None:
    extra = (state, aux) if rules.has_aux else state
  else:
    extra = aux
  has_extra = rules.has_aux or rules.state_argnum is not None
  out = ((value, extra), grads) if has_extra else (value, grads)
  if not rules.with_info:
    return out

  # Samples: kept micro-batches whose weighted denominators are all positive, each
  # normalised by its own micro-batch (rows for sums, 1 for means, its own denominators).
  sq, sizes = [], []
  single_weighted = isinstance(rules.reduce, str) and rules.reduce == "weighted"
  for m in kept:
    if any(kind == "weighted" and m.dens[t] <= 0 for t, (_, kind, _) in enumerate(terms)):
      continue
    g = zeros
    for t, (_, kind, w) in enumerate(terms):
      own = 1.0 if kind == "mean" else m.rows if kind == "sum" else m.dens[t]
      g = jax.tree.map(lambda a, b, own=own, w=w: a + w * b / own, g, m.grads[t])
    sq.append(_sq_norm(g))
    sizes.append(m.dens[0] if single_weighted else float(m.rows))
  gb = zeros
  for t, (_, kind, w) in enumerate(terms):
    d = rows * count if kind == "sum" else divisor(t, kind)
    g = _tree_sum([m.grads[t] for m in kept]) if kept else zeros
    gb = jax.tree.map(lambda a, b, d=d, w=w: a + w * _safe_div(b, d), gb, g)
  samples = len(sq)
  info = jaxaccum.AccumInfo(
      num_micro_batches=np.int32(len(ran)),
      micro_batch_size=np.float32(_safe_div(samples, sum(1.0 / s for s in sizes))),
      batch_size=np.float32(sum(sizes)),
      micro_grad_sq_norm=np.float32(_safe_div(sum(sq), samples)),
      batch_grad_sq_norm=np.float32(_sq_norm(gb)),
      num_samples=np.int32(samples),
      skipped=np.int32(len(ran) - count),
      terms=None if isinstance(rules.reduce, str) else {
          name: np.asarray(v, value_dtype) for (name, _, _), v in zip(terms, values,
                                                                       strict=True)},
  )
  return (*out, info)
