"""The table of kinds: how each kind of value combines over micro-batches.

Every reduction is a :class:`Reduction` of four pure functions, applied leaf by leaf:

* ``init(shape)``: the scan carry for a leaf of that shape (``None`` when the reduction
  keeps one entry per micro-batch instead, as ``"stack"`` and ``"concat"`` do);
* ``update(carry, value, weight, index)``: adds micro-batch ``index`` (``weight`` is its
  denominator when the loss has one weighted term, else ``None``);
* ``combine(value, axes, reduce_is_sum)``: the one cross-device reduction after the loop
  under ``data_axis`` (a ``psum``, ``pmax``, ...), of the carry or, for ``"stack"`` and
  ``"concat"``, of the scan's stacked entries;
* ``finalize(carry, stacked, shape, divisor)``: the reduced leaf.

Adding a reduction is one entry in :data:`AUX_REDUCTIONS`. ``aux_reduce`` also takes a
:class:`Reduction` instance, or an ``optax.microbatching.Accumulator`` (:func:`from_accumulator`:
``init(shape)``, ``update(carry, value, index)``, ``finalize(carry)``, as in
``optax.microbatch``), at any leaf of its prefix; one without ``combine`` has no rule across
data shards and is refused under ``data_axis``.

The loss reductions (``"mean"``, ``"sum"``, ``"weighted"``) are the :class:`LossKind`
entries of :data:`LOSS_KINDS`: each carries what fun returns, its :class:`Divisor` (known
only after the loop: nothing, the micro-batches kept, or the term's total denominator), and
what it means for aux means, ``with_info`` sample sizes and the combine across devices.
Each term of the loss (:class:`Term`) has a kind, a weight and a path. Adding a loss kind
is one entry in :data:`LOSS_KINDS`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._core import _split
from jaxaccum._core._types import AxisNames, PyTree


def check_dtype(name: str, dtype: Any) -> np.dtype | None:
  """Validates an optional floating dtype option."""
  if dtype is None:
    return None
  try:
    out = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name} must be a floating dtype such as jnp.float32, got {dtype!r}.") from e
  if not jnp.issubdtype(out, jnp.floating):
    raise TypeError(f"{name} must be a floating dtype such as jnp.float32, got {dtype!r}.")
  return out


def accumulator_dtype_for(dtype: Any, accumulator_dtype: Any) -> np.dtype:
  """The dtype a floating value of ``dtype`` is accumulated in.

  ``accumulator_dtype=None`` (the default) promotes floating types narrower than 32 bits
  (bfloat16, float16) to float32 and keeps wider ones; an explicit dtype applies to every
  floating value. Non-floating dtypes are returned unchanged.
  """
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return dtype
  if accumulator_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
    return jnp.dtype(accumulator_dtype)
  if dtype.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return dtype


def _mean_dtype(dtype: Any, acc: Any) -> np.dtype:
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return accumulator_dtype_for(dtype, acc)
  return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))  # float32 unless x64


def _sum_dtype(dtype: Any, acc: Any) -> np.dtype:
  """Integer and boolean sums are counted in at least int32: they do not wrap."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer):
    return jnp.promote_types(dtype if dtype != jnp.bool_ else jnp.int32, jnp.int32)
  return accumulator_dtype_for(dtype, acc)


def safe_divide(x: jax.Array, d: Any) -> jax.Array:
  """``x / d``, and exactly 0 where ``d == 0`` (no NaN, even if ``x`` is NaN there)."""
  d = jnp.asarray(d, x.dtype)
  zero = d == 0
  return jnp.where(zero, jnp.zeros_like(x), x / jnp.where(zero, jnp.ones_like(d), d))


def _is_key(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _with_bools(op: Callable[[jax.Array, AxisNames], jax.Array]):
  """The collective ``op``, taking booleans too: reduced as int32 and cast back."""
  def reduce(x: jax.Array, axes: AxisNames) -> jax.Array:
    if x.dtype == jnp.bool_:
      return op(x.astype(jnp.int32), axes).astype(jnp.bool_)
    return op(x, axes)
  return reduce


pmax = _with_bools(lax.pmax)  # on booleans an OR
pmin = _with_bools(lax.pmin)  # on booleans an AND
_psum = _with_bools(lax.psum)


def first_shard(x: jax.Array, axes: AxisNames) -> jax.Array:
  """Shard 0's value of ``x`` on every shard (for keys, which cannot be averaged)."""
  key = _is_key(x.dtype)
  data = jax.random.key_data(x) if key else x
  out = _psum(jnp.where(lax.axis_index(axes) == 0, data, jnp.zeros_like(data)), axes)
  return jax.random.wrap_key_data(out, impl=jax.random.key_impl(x)) if key else out


# --- Aux reductions --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reduction:
  """One way of reducing an aux leaf over micro-batches (see the module docstring)."""

  init: Callable[[jax.ShapeDtypeStruct, Any], Any]
  update: Callable[[Any, jax.Array, jax.Array | None, jax.Array], Any]
  # None: no rule across shards (a user reduction), refused under data_axis.
  combine: Callable[[Any, AxisNames, bool], Any] | None
  finalize: Callable[[Any, jax.Array | None, jax.ShapeDtypeStruct, Any], Any]
  per_micro_batch: bool = False  # the scan emits the leaf (stack, concat) instead
  numeric_only: bool = True
  per_example: bool = False  # the leaf has the micro-batch's rows, along ``axis``
  axis: int = 0  # per_example: the leaf's axis of rows (the batch axis, set per leaf)
  bool_only: bool = False  # a logical reduction (all, any): boolean leaves only
  name: str = "a user-defined reduction"  # for messages: the aux_reduce name
  # Under per_example=: (the examples' values stacked on a leading rows axis, their
  # weights or None, accumulator_dtype) -> the micro-batch's value. None: no such value.
  over_rows: Callable[[jax.Array, jax.Array | None, Any], jax.Array] | None = None


def from_accumulator(acc: Any) -> Reduction:
  """An ``optax.microbatching.Accumulator`` as a :class:`Reduction`, as ``optax.microbatch``
  runs it: ``init`` gets one micro-batch's ``ShapeDtypeStruct``, ``update(carry, value,
  index)`` each micro-batch kept, ``finalize(carry)`` the result. It has no rule across data
  shards (``aggregate`` combines one device's per-example values, not shards)."""
  return Reduction(
      init=lambda s, _acc: acc.init(s),
      update=lambda c, v, w, i: acc.update(c, v, i),
      combine=None,
      finalize=lambda c, st, s, d: acc.finalize(c),
      numeric_only=False,
      name=f"the optax Accumulator {acc!r}")


def _is_accumulator(x: Any) -> bool:
  try:
    from optax.microbatching import Accumulator  # noqa: PLC0415 (optional at import)
  except ImportError:  # pragma: no cover - optax is a dependency
    return False
  return isinstance(x, Accumulator)


def _extreme_init(lowest: bool):
  """The carry of a running maximum (``lowest``: start at the dtype's lowest) or minimum."""
  def init(s, acc):
    dtype = jnp.dtype(s.dtype)
    if dtype == jnp.bool_:
      fill = not lowest
    elif jnp.issubdtype(dtype, jnp.inexact):
      fill = -jnp.inf if lowest else jnp.inf
    else:
      info = jnp.iinfo(dtype)
      fill = info.min if lowest else info.max
    return jnp.full(s.shape, fill, dtype)
  return init


def _mean_update(c, v, w, i):
  v = v.astype(c.dtype)
  if w is not None:
    # A micro-batch of weight 0 adds nothing, even if its aux is NaN (a mean over zero
    # tokens): 0 * aux is 0 for every finite aux, so this only removes NaN and inf.
    w = w.astype(c.dtype)
    v = jnp.where(w == 0, jnp.zeros_like(v), v * w)
  return c + v


def _mean_over_rows(v, w, acc):
  """A micro-batch's mean of its examples' values (weighted by their denominators)."""
  dtype = _mean_dtype(v.dtype, acc)
  if w is None:
    out = jnp.mean(v.astype(dtype), axis=0)
  else:
    w = w.astype(dtype).reshape(w.shape + (1,) * (v.ndim - 1))
    total = jnp.sum(jnp.where(w == 0, jnp.zeros_like(v, dtype), v.astype(dtype) * w), axis=0)
    out = safe_divide(total, jnp.sum(w, axis=0))
  return out.astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.inexact) else out


def _mean_finalize(c, _, s, divisor):
  out = safe_divide(c, divisor)
  return out.astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact) else out


def _sum_finalize(c, _, s, divisor):
  # Floats come back in their own dtype, counts in the wider one.
  return c.astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact) else c


# Reductions with a carry (init gives an array) finalize it; per-micro-batch ones (init gives
# None) finalize the scan's stacked entries instead.
def _carry_finalize(c: jax.Array | None, st: jax.Array | None, s: Any, d: Any) -> jax.Array:
  assert c is not None, "max, min, all and any keep a carry"
  return c


def _stack_finalize(c: jax.Array | None, st: jax.Array | None, s: Any, d: Any) -> jax.Array:
  assert st is not None, "stack is a per-micro-batch reduction"
  return st


def _concat_finalize(c: jax.Array | None, st: jax.Array | None, s: Any, d: Any,
                     axis: int = 0) -> jax.Array:
  assert st is not None, "concat is a per-micro-batch reduction"
  return _split.merge(st, axis)


def _concat_over_rows(v: jax.Array, w: Any, acc: Any, axis: int = 0) -> jax.Array:
  """A micro-batch's examples, each a batch of one (rows along ``axis``), as its rows."""
  return _split.merge(v, axis)


def _rows_along(red: Reduction, axis: int) -> Reduction:
  """A per-example reduction whose rows lie along ``axis`` of the leaf."""
  if axis == red.axis:
    return red
  if red.finalize is _concat_finalize:
    return dataclasses.replace(red, axis=axis,
                               finalize=functools.partial(_concat_finalize, axis=axis),
                               over_rows=functools.partial(_concat_over_rows, axis=axis))
  return dataclasses.replace(red, axis=axis)


def _combine_stack(s: jax.Array, axes: AxisNames, reduce_is_sum: bool) -> jax.Array:
  """How a ``"stack"`` entry combines over data shards.

  Stacked entries are averaged over shards (summed under ``reduce="sum"`` and for
  integer leaves; OR-ed for booleans; keys are shard 0's).
  """
  if _is_key(s.dtype):
    return first_shard(s, axes)
  if s.dtype == jnp.bool_:
    return pmax(s, axes)
  if reduce_is_sum or not jnp.issubdtype(s.dtype, jnp.inexact):
    return lax.psum(s, axes)
  return lax.pmean(s, axes)


AUX_REDUCTIONS: dict[str, Reduction] = {
    "mean": Reduction(
        init=lambda s, acc: jnp.zeros(s.shape, _mean_dtype(s.dtype, acc)),
        update=_mean_update,
        combine=lambda c, axes, is_sum: lax.psum(c, axes),
        finalize=_mean_finalize, over_rows=_mean_over_rows),
    "sum": Reduction(
        init=lambda s, acc: jnp.zeros(s.shape, _sum_dtype(s.dtype, acc)),
        update=lambda c, v, w, i: c + v.astype(c.dtype),
        combine=lambda c, axes, is_sum: lax.psum(c, axes),
        finalize=_sum_finalize,
        over_rows=lambda v, w, acc: jnp.sum(v.astype(_sum_dtype(v.dtype, acc)), axis=0)),
    "max": Reduction(
        init=_extreme_init(lowest=True),
        update=lambda c, v, w, i: jnp.maximum(c, v),
        combine=lambda c, axes, is_sum: pmax(c, axes),
        finalize=_carry_finalize, over_rows=lambda v, w, acc: jnp.max(v, axis=0)),
    "min": Reduction(
        init=_extreme_init(lowest=False),
        update=lambda c, v, w, i: jnp.minimum(c, v),
        combine=lambda c, axes, is_sum: pmin(c, axes),
        finalize=_carry_finalize, over_rows=lambda v, w, acc: jnp.min(v, axis=0)),
    "all": Reduction(
        init=lambda s, acc: jnp.ones(s.shape, jnp.bool_),
        update=lambda c, v, w, i: c & v,
        combine=lambda c, axes, is_sum: pmin(c, axes),
        finalize=_carry_finalize, bool_only=True,
        over_rows=lambda v, w, acc: jnp.all(v, axis=0)),
    "any": Reduction(
        init=lambda s, acc: jnp.zeros(s.shape, jnp.bool_),
        update=lambda c, v, w, i: c | v,
        combine=lambda c, axes, is_sum: pmax(c, axes),
        finalize=_carry_finalize, bool_only=True,
        over_rows=lambda v, w, acc: jnp.any(v, axis=0)),
    "stack": Reduction(
        init=lambda s, acc: None,
        update=lambda c, v, w, i: c,
        combine=_combine_stack,
        finalize=_stack_finalize,
        per_micro_batch=True, numeric_only=False),
    "concat": Reduction(
        init=lambda s, acc: None,
        update=lambda c, v, w, i: c,
        combine=lambda st, axes, is_sum: st,  # rows stay on their shard, gathered in order
        finalize=_concat_finalize,
        per_micro_batch=True, numeric_only=False, per_example=True,
        over_rows=_concat_over_rows),
}
AUX_REDUCTIONS = {k: dataclasses.replace(r, name=repr(k)) for k, r in AUX_REDUCTIONS.items()}


def combine_state(s: jax.Array, axes: AxisNames) -> jax.Array:
  """Mutable state over data shards: floats averaged, counters the maximum, keys shard 0's."""
  if _is_key(s.dtype):
    return first_shard(s, axes)
  if jnp.issubdtype(s.dtype, jnp.inexact):
    return lax.pmean(s, axes)
  return pmax(s, axes)


def _default_kind(path: str, s: jax.ShapeDtypeStruct) -> str:
  """The default reduction of an aux leaf: scalars only; counts sum, floats average, flags
  are AND-ed (a bool such as ``jnp.all(jnp.isfinite(x))`` keeps its full-batch value)."""
  if s.shape != ():
    raise ValueError(
        f"aux leaf {path} has shape {tuple(s.shape)}, and the default aux "
        "reduction only applies to scalars (averaging per-example rows across micro-batches "
        "would mix unrelated examples). Say what it is with aux_reduce: 'concat' for "
        "per-example outputs such as logits (rows come back in batch order, as on the full "
        "batch), 'mean' or 'sum' for values already reduced over the micro-batch, 'stack' "
        "for one entry per micro-batch; e.g. aux_reduce={'logits': 'concat', "
        "'accuracy': None}.")
  if _is_key(s.dtype):
    return "mean"  # rejected below: keys can only be stacked
  dtype = jnp.dtype(s.dtype)
  if dtype == jnp.bool_:
    return "all"
  if jnp.issubdtype(dtype, jnp.integer):
    return "sum"
  return "mean"


def _is_spec_leaf(x: Any) -> bool:
  return x is None or isinstance(x, (str, Reduction)) or _is_accumulator(x)


def _entry(x: Any) -> Reduction | None:
  """One ``aux_reduce`` entry as a :class:`Reduction` (``None``: the leaf's default)."""
  if x is None or isinstance(x, Reduction):
    return x
  if isinstance(x, str) and x in AUX_REDUCTIONS:
    return AUX_REDUCTIONS[x]
  if _is_accumulator(x):
    return from_accumulator(x)
  raise ValueError(
      f"aux_reduce entries must be one of {', '.join(map(repr, AUX_REDUCTIONS))}, None (the "
      "default), an optax.microbatching.Accumulator or a jaxaccum Reduction, got "
      f"{x!r}." + (" An optax AccumulationType names optax's own kinds: pass the matching "
                   "name ('mean', 'sum' or 'concat') instead."
                   if type(x).__name__ == "AccumulationType" else ""))


def check_aux_reduce(spec: Any) -> None:
  """Checks every entry of an ``aux_reduce`` spec eagerly (its structure is checked against
  aux at trace time)."""
  if isinstance(spec, str) and spec not in AUX_REDUCTIONS:
    raise ValueError(
        f"aux_reduce must be one of {', '.join(map(repr, AUX_REDUCTIONS))} or a pytree prefix "
        "of aux with those names (or None, an optax.microbatching.Accumulator, a jaxaccum "
        f"Reduction), got aux_reduce={spec!r}.")
  for x in jax.tree.leaves(spec, is_leaf=_is_spec_leaf):
    _entry(x)


def resolve_aux_reduce(spec: Any, aux_shapes: PyTree, rows: int, axis: int = 0,
                       one_example: str | None = None) -> PyTree:
  """Expands ``spec`` (an entry, or a pytree prefix of aux with entries or None) to aux.

  An entry is a name of :data:`AUX_REDUCTIONS`, a :class:`Reduction` or an optax
  ``Accumulator``. Returns a pytree with the structure of ``aux_shapes`` whose leaves are
  :class:`Reduction` s; ``None`` becomes each leaf's default (:func:`_default_kind`). Checks
  that every leaf can be reduced as asked; ``rows``, the rows of one micro-batch, is the
  size that a per-example (``"concat"``) leaf must have along ``axis`` (the batch axis,
  :func:`jaxaccum._core._split.common_axis`; negative counts from the end of the leaf).
  ``one_example`` says that ``aux_shapes`` are one example's, under
  ``per_example=``: ``"batch_of_one"`` (``rows`` is 1; a scalar leaf is that
  example's row) or ``"row"`` (``fun`` saw the row without a batch axis: every leaf is
  the example's row, stacked along the batch axis).
  """
  if _is_spec_leaf(spec):
    red = _entry(spec)
    reds = jax.tree.map(lambda _: red, aux_shapes)
  else:
    try:
      reds = jax.tree.map(
          lambda entry, sub: jax.tree.map(lambda _: _entry(entry), sub),
          spec, aux_shapes, is_leaf=_is_spec_leaf,
      )
    except ValueError as e:
      if "aux_reduce entries" in str(e):
        raise
      raise ValueError(
          "aux_reduce must be a string or a pytree prefix of the aux that fun returns, with "
          f"a reduction name or None at each leaf. Got aux_reduce={spec!r} for aux of "
          f"structure {jax.tree.structure(aux_shapes)}."
      ) from e
  out = []
  treedef = jax.tree.structure(aux_shapes)
  for (path, s), red in zip(jax.tree_util.tree_leaves_with_path(aux_shapes),
                            treedef.flatten_up_to(reds), strict=True):
    where = jax.tree_util.keystr(path) or "(root)"
    if red is None:
      red = AUX_REDUCTIONS[_default_kind(where, s)]
    kind = red.name
    dtype = jnp.dtype(s.dtype) if not _is_key(s.dtype) else s.dtype
    numeric = not _is_key(dtype) and (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.number))
    if red.bool_only and dtype != jnp.bool_:
      raise TypeError(
          f"aux leaf {where} has dtype {dtype}, but aux_reduce {kind} is a "
          "logical reduction of booleans. Return a bool (e.g. x != 0) or choose 'max', "
          "'min', 'sum' or 'mean'.")
    if red.numeric_only and not numeric:
      raise TypeError(
          f"aux leaf {where} has dtype {dtype}, which cannot be reduced with aux_reduce "
          f"{kind}. Mark it aux_reduce='stack' (one entry per micro-batch) or return it "
          "outside aux.")
    if red.per_example and one_example is not None and (one_example == "row"
                                                        or s.shape == ()):
      a = axis % (len(s.shape) + 1) if axis and s.shape else 0
      out.append(dataclasses.replace(
          red, over_rows=lambda v, w, acc, a=a: jnp.moveaxis(v, 0, a)))
      continue
    if red.per_example and s.shape == ():
      raise ValueError(
          f"aux leaf {where} is a scalar, so aux_reduce {kind} has no "
          "per-example rows to put back in batch order. Use 'stack' for one entry per "
          "micro-batch, or 'mean'/'sum'.")
    if red.per_example and axis and not -len(s.shape) <= axis < len(s.shape):
      raise ValueError(
          f"aux leaf {where} has shape {tuple(s.shape)}, but aux_reduce {kind} "
          f"puts per-example rows back along the batch axis, batch_axis={axis}, which is out "
          f"of range for its rank {len(s.shape)}. Return the leaf with its rows along axis "
          f"{axis}, or use aux_reduce 'stack' for one entry per micro-batch.")
    if red.per_example and axis:
      red = _rows_along(red, axis % len(s.shape))
      if s.shape[red.axis] != rows:
        raise ValueError(
            f"aux leaf {where} has shape {tuple(s.shape)}, but aux_reduce {kind} "
            f"puts per-example rows back in batch order along the batch axis "
            f"(batch_axis={axis}), so its axis {red.axis} must be the micro-batch's {rows} "
            f"rows, not {s.shape[red.axis]}. Return the rows along that axis, as the batch "
            "holds them, or use aux_reduce 'stack' for one entry per micro-batch.")
    if red.per_example and not axis and s.shape[0] != rows:
      raise ValueError(
          f"aux leaf {where} has shape {tuple(s.shape)}, but aux_reduce "
          f"{kind} puts per-example rows back in batch order, so its leading axis must be "
          f"the micro-batch's {rows} rows (a leading axis of another size, such as per-token "
          "values flattened to (rows * tokens,) or a (tokens,) vector, would be interleaved "
          "as if it were rows). Keep the rows axis first, e.g. return shape (rows, tokens) "
          "instead of the flattened (rows * tokens,), or use aux_reduce 'stack' for one entry "
          "per micro-batch.")
    out.append(red)
  return jax.tree.unflatten(treedef, out)


def check_combinable(reds: PyTree) -> None:
  """Under ``data_axis`` (or Linen's ``axis_name``): every aux reduction needs a rule across
  data shards; a user reduction without one is refused, naming its leaf."""
  for path, red in jax.tree_util.tree_leaves_with_path(reds):
    if red.combine is None:
      raise ValueError(
          f"aux leaf {jax.tree_util.keystr(path) or '(root)'} is reduced with {red.name}, "
          "which has no rule for combining data shards, and the accumulation runs on several "
          "(data_axis, or Linen's axis_name). Return that value reduced outside the "
          "accumulated function, use a built-in aux_reduce name ('mean', 'sum', 'max', ...), "
          "or pass a jaxaccum Reduction with a combine(value, axes, reduce_is_sum) such as "
          "jax.lax.psum.")


# --- Loss terms ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Divisor:
  """What a loss term's sum over micro-batches is divided by, after the loop."""

  name: str
  # (micro-batches kept, the term's total denominator, rows) -> the divisor, or None for
  # none. ``rows`` is what a sum is divided by where it must read as a mean (with_info's
  # samples and G_B); None elsewhere.
  of: Callable[[Any, Any, Any], Any]
  own_denominator: bool = False  # each term its own: fun's denominators (a group per term)
  in_body: bool = False  # known in the loop body: may fold into the no-divisor group

  def __repr__(self) -> str:
    return self.name


NO_DIVISOR = Divisor("one", lambda count, den, rows: rows)
COUNT = Divisor("count", lambda count, den, rows: count, in_body=True)
DENOMINATOR = Divisor("denominator", lambda count, den, rows: den, own_denominator=True)


@dataclasses.dataclass(frozen=True)
class LossKind:
  """One loss reduction: everything the transform needs to know about it."""

  name: str
  pair: bool  # fun returns (numerator, denominator) for it, else a scalar
  returns: str  # what fun returns, for messages
  divisor: Divisor
  # Aux means are weighted by its denominators (when it is the loss's only such term), and
  # with_info's sample sizes are its denominators (a single term), not rows.
  weighs: bool = False
  # A single term of this kind: aux means and stacked aux combine as sums across devices.
  sums_across_devices: bool = False
  # fun returns a mean over its rows: under per_example= a micro-batch's value and
  # gradient are the mean of its examples' (else their sum).
  rows_mean: bool = False

  def __repr__(self) -> str:
    return repr(self.name)


LOSS_KINDS: dict[str, LossKind] = {
    "mean": LossKind("mean", pair=False, returns="(the loss mean)", divisor=COUNT,
                     rows_mean=True),
    "sum": LossKind("sum", pair=False, returns="(the loss sum)", divisor=NO_DIVISOR,
                    sums_across_devices=True),
    "weighted": LossKind("weighted", pair=True, returns="(numerator, denominator)",
                         divisor=DENOMINATOR, weighs=True),
}


def count_across(count: Any, shards: int) -> Any:
  """The micro-batches behind a mean (:data:`COUNT`) when ``shards`` data shards each run
  ``count`` of them: a mean over ``D`` shards of ``N`` micro-batches divides by ``N x D``.
  The in-loop scale of mean terms folded into a sum group and the static count that
  finalize divides by both read it; the run-time count is the kept micro-batches summed
  across the shards (the ``stats`` carry entry's ``combine``), the same number."""
  return count * shards


# A "mean" over the real rows only (a micro-batch rule that marks padding rows): fun returns
# the mean as usual; the rule sums the real rows' values and counts them as the
# denominator, so the mean divides by the real rows of the whole batch.
MASKED_MEAN = dataclasses.replace(LOSS_KINDS["mean"], divisor=DENOMINATOR, weighs=True,
                                  rows_mean=False)


@dataclasses.dataclass(frozen=True)
class Term:
  """One term of the loss: its name (a key path, or ``()`` for a single loss), its
  :class:`LossKind` and its weight in the total."""

  path: tuple
  kind: LossKind
  weight: float = 1.0

  @property
  def label(self) -> str:
    return jax.tree_util.keystr(self.path) if self.path else "the value"


def sums_across_devices(terms: tuple[Term, ...]) -> bool:
  """Whether aux means and stacked aux combine as sums across devices (the ``reduce_is_sum``
  flag of :attr:`Reduction.combine`)."""
  return len(terms) == 1 and terms[0].kind.sums_across_devices


def aux_weight_term(terms: tuple[Term, ...]) -> int | None:
  """The weighted term whose denominators weigh aux means (only when there is one)."""
  weighted = [t for t, term in enumerate(terms) if term.kind.weighs]
  return weighted[0] if len(weighted) == 1 else None


# --- Gradient groups: terms that share a divisor share one accumulator ----------------------


class Group(NamedTuple):
  """Loss terms whose gradients share one accumulator and one divisor."""

  terms: tuple[int, ...]
  divisor: tuple  # its divisor_key: (the Divisor, the term whose denominator it is, or None)
  scaled: tuple[bool, ...]  # per term: scaled by 1 / (micro-batches run) in the body


def divisor_key(t: int, term: Term) -> tuple:
  """What term ``t`` divides by: its kind's :class:`jaxaccum.Divisor`, with ``t``
  when that is the term's own total denominator."""
  d = term.kind.divisor
  return (d, t if d.own_denominator else None)


def divisor(key: tuple, count: Any, dens: tuple, one: Any = None) -> Any:
  """The divisor that :func:`divisor_key` names, given the micro-batches kept and the
  denominators; ``None`` for no division (a sum's, unless ``one`` says what to divide by)."""
  d, t = key
  return d.of(count, None if t is None else dens[t], one)


def divide_groups(groups: tuple[Group, ...], accs: tuple, count: Any, dens: tuple,
                  one: Any = None, dtype: Any = None) -> PyTree:
  """The sum over groups of each group's accumulated gradients divided by its
  :func:`divisor` (of ``count``, ``dens`` and ``one``), each cast to ``dtype`` if given."""
  total = None
  for g, acc in zip(groups, accs, strict=True):
    d = divisor(g.divisor, count, dens, one)
    part = jax.tree.map(lambda a, d=d: a.astype(dtype or a.dtype) if d is None else
                        safe_divide(a.astype(dtype or a.dtype), d), acc)
    total = part if total is None else jax.tree.map(jnp.add, total, part)
  return total


def make_groups(terms: tuple[Term, ...], *, merge: bool = True) -> tuple[Group, ...]:
  """The gradient groups of a differentiated loss of ``terms`` (see :class:`Group`).
  ``merge``: terms divided by a count known in the loop body may fold into the sum group
  (not under ``skip_nonfinite`` or ``with_info``, which need each group's own sum)."""
  groups: dict[Any, list[int]] = {}
  for t, term in enumerate(terms):
    groups.setdefault(divisor_key(t, term), []).append(t)
  in_body = [k for k in groups if k[0].in_body]
  merge = merge and len(groups) > 1 and bool(in_body)
  out = []
  if merge:  # terms divided by a count known in the body: fold them into the sum group
    one = (NO_DIVISOR, None)
    ts = tuple(sorted(sum((groups.pop(k) for k in [one, *in_body] if k in groups), [])))
    out.append(Group(ts, one, tuple(terms[t].kind.divisor.in_body for t in ts)))
  for key, ts in groups.items():
    out.append(Group(tuple(ts), key, (False,) * len(ts)))
  return tuple(out)


def check_reduce(reduce: Any) -> Any:
  """Validates ``reduce``: a name, or a dict (pytree) of names for several loss terms."""
  leaves = jax.tree.leaves(reduce) if isinstance(reduce, (str, dict)) else []
  if not leaves or any(not isinstance(x, str) or x not in LOSS_KINDS for x in leaves):
    raise ValueError(
        f"reduce must be one of {', '.join(map(repr, LOSS_KINDS))}, or a dict of them "
        f"for a loss of several terms, got reduce={reduce!r}. Use 'mean' when fun returns "
        "the mean over its micro-batch, 'sum' when it returns a sum, 'weighted' when it "
        "returns (numerator, denominator).")
  return reduce


def make_terms(reduce: Any, loss_weights: Any, *, name: str = "loss_weights"
               ) -> tuple[Term, ...]:
  """The loss terms for ``reduce`` (a name or a dict of names) and ``loss_weights``; errors
  call the weights ``name`` (``"weights"`` for :class:`jaxaccum.Terms`)."""
  example = ("jaxaccum.Terms({'ce': 'weighted', 'aux': 'mean'}, weights={'aux': 0.01})"
             if name == "weights" else
             "reduce={'ce': 'weighted', 'aux': 'mean'}, loss_weights={'aux': 0.01}")
  if isinstance(reduce, str):
    if loss_weights is not None:
      raise ValueError(
          f"{name}={loss_weights!r} was given but reduce={reduce!r} is a single "
          f"reduction: {name} weighs the terms of a dict reduce, e.g. {example}.")
    return (Term((), LOSS_KINDS[reduce]),)
  flat = jax.tree_util.tree_leaves_with_path(reduce)
  if loss_weights is not None and not isinstance(loss_weights, dict):
    raise TypeError(
        f"{name} must be a dict from term name to a float, got {loss_weights!r}.")
  weights = dict(loss_weights or {})
  keys = [jax.tree_util.keystr(p)[2:-2] if len(p) == 1 else None for p, _ in flat]
  unknown = [k for k in weights if k not in keys]
  if unknown:
    raise ValueError(
        f"{name} names {unknown}, which are not terms of reduce={reduce!r}. Name "
        "top-level terms of the dict that fun returns.")
  terms = []
  for (path, kind), key in zip(flat, keys, strict=True):
    w = weights.get(key, 1.0)
    if isinstance(w, bool) or not isinstance(w, (int, float, np.floating, np.integer)):
      raise TypeError(
          f"{name}[{key!r}] must be a Python or NumPy number, got {w!r}.")
    terms.append(Term(tuple(path), LOSS_KINDS[kind], float(w)))
  return tuple(terms)


def get_path(tree: Any, path: tuple) -> Any:
  for k in path:
    tree = tree[getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))]
  return tree
