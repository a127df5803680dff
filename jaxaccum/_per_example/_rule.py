"""Per-example gradients: the wing that plugs a per-example rule into the core.

Under ``per_example=`` each micro-batch's contribution is computed one example at a
time (``jax.vmap`` over its rows), each example's gradient transformed (or clipped, with
:func:`jaxaccum.dp.clip_per_example`) before the examples are summed. The core
(:mod:`jaxaccum._core._transform`) knows nothing of it: :func:`attach` validates the
user's transform (:func:`check_per_example`) and puts its :class:`PerExampleRule` in
:class:`jaxaccum._core._options.Options` as ``per_example``; the core's
micro-batch body calls that rule as it calls its own forward-only and VJP rules
(:class:`jaxaccum._core._transform.MicroRule`).

The clip's norms, factors and ghost-norm program live in :mod:`jaxaccum._core._stats` and
:mod:`jaxaccum._per_example._ghost`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._core import _options, _reduce, _split
from jaxaccum._core._options import Options
from jaxaccum._core._reduce import Group
from jaxaccum._core._transform import (
  Across,
  CarryEntry,
  Micro,
  MicroCall,
  Scan,
  Update,
  vary_as,
)
from jaxaccum._core._validate import describe as _describe
from jaxaccum._per_example import _clip, _ghost, _norm

# --- The options: what per_example= accepts ----------------------------------------


def masked_terms(terms: tuple[_reduce.Term, ...], transform: Any) -> tuple[_reduce.Term, ...]:
  """Under ``clip_per_example(example_mask=)`` a mean divides by the real examples: its
  kind becomes :data:`jaxaccum._core._reduce.MASKED_MEAN`."""
  if not (isinstance(transform, _clip.ClipPerExample) and transform.example_mask):
    return terms
  return tuple(dataclasses.replace(t, kind=_reduce.MASKED_MEAN) if t.kind.rows_mean else t
               for t in terms)


def attach(opts: Options, transform: Any, keyword: str, where: str) -> Options:
  """``opts`` with ``transform`` (given as ``keyword=`` to ``where``) as their micro-batch
  rule, :class:`PerExampleRule`, and the loss terms it changes (:func:`masked_terms`): the
  hook :func:`jaxaccum._core._options.make_options` calls, so that the core never imports
  this wing. Raises for a transform the rule cannot run, naming what the caller typed."""
  given_as = ("per_example_value_and_grad's transform" if where == "per_example_value_and_grad"
              else f"{keyword}=")
  terms = masked_terms(opts.terms, transform)
  rule = check_per_example(transform, opts.reduce, terms, opts.roles.batch_argnames, given_as)
  return dataclasses.replace(opts, terms=terms, per_example=rule)


def check_per_example(transform: Any, reduce: Any, terms: tuple[_reduce.Term, ...],
                      batch_names: tuple[str, ...], given_as: str) -> PerExampleRule:
  """A per-example transform (``given_as``: how the caller gave it): a callable, and a loss
  whose terms share one normalisation (the transform sees each example's whole gradient, so
  there is one divisor to apply). Returns the core's micro-batch rule for it."""
  mask = getattr(transform, "example_mask", None) if isinstance(
      transform, _clip.ClipPerExample) else None
  if mask is not None and mask not in batch_names:
    raise ValueError(
        f"clip_per_example(example_mask={mask!r}) names the keyword argument holding one "
        f"bool per example, but batch_argnames={batch_names!r} does not name it, so it "
        f"would not be split with the batch. Add it: batch_argnames=({mask!r},), and call "
        f"the step with {mask}=mask.")
  if mask is not None and not isinstance(reduce, str):
    raise ValueError(
        f"clip_per_example(example_mask={mask!r}) takes a single loss (reduce='mean', "
        f"'sum' or 'weighted'), got reduce={reduce!r}: return the total of the terms as "
        "one loss.")
  if not callable(transform):
    raise TypeError(
        f"{given_as} must be a function from one example's gradient to a gradient of the "
        f"same structure (e.g. jaxaccum.dp.clip_per_example(1.0)), got {transform!r}.")
  kinds = sorted({t.kind.name for t in terms})
  pairs = [t for t in terms if t.kind.divisor.own_denominator]
  if len(kinds) > 1 or len(pairs) > 1:
    what = (f"mixes the kinds {kinds}" if len(kinds) > 1 else
            f"has {len(pairs)} weighted terms, each divided by its own total denominator")
    raise ValueError(
        f"{given_as} is given, but reduce={reduce!r} {what}: the transform sees each "
        "example's whole gradient, so every term must be normalised the same way. Use one "
        "kind for all terms (all 'mean' or all 'sum'), or a single 'weighted' term; or "
        "accumulate the terms with separate transforms.")
  return PerExampleRule(transform, given_as)


# --- The micro-batch rule ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PerExampleRule:
  """The core's micro-batch rule (:class:`jaxaccum._core._transform.MicroRule`) for a
  per-example transform: one micro-batch's contribution from its examples' transformed
  gradients (:func:`per_example`). ``transform`` is the user's transform as given,
  ``given_as`` how it was given (``"per_example="``), for the errors raised while tracing."""

  transform: Callable[[Any], Any]
  given_as: str = dataclasses.field(default="per_example=", compare=False)
  differentiates: bool = dataclasses.field(default=True, init=False)
  one_row: bool = dataclasses.field(default=True, init=False)  # fun sees one example

  @property
  def clip(self) -> _clip.ClipPerExample | None:
    t = self.transform
    return t if isinstance(t, _clip.ClipPerExample) else None

  @property
  def reads(self) -> tuple[str, ...]:
    """Keyword batch arguments that the rule reads and ``fun`` does not get: the clip's
    ``example_mask``."""
    clip = self.clip
    return () if clip is None or clip.example_mask is None else (clip.example_mask,)

  def call(self, call: Callable[..., Any], kw_batch: dict, role_vals: tuple,
           held: list[int]) -> tuple:
    """Runs ``call(kw_batch, role_vals)`` (``fun`` and the check of what it returns) on
    example ``r`` of :data:`EXAMPLE_INDEX`, with the typed keys of its state folded with
    ``r`` (:func:`_fold_state_keys`); inside ``remat``'s checkpoint too."""
    folded = None
    if EXAMPLE_INDEX in kw_batch:
      kw_batch = dict(kw_batch)
      role_vals, folded = _fold_state_keys(role_vals, held, kw_batch.pop(EXAMPLE_INDEX))
    nums, dens, new_state, aux = call(kw_batch, role_vals)
    if folded:
      new_state = _unfold_state_keys(new_state, folded)
    return nums, dens, new_state, aux

  def contribute(self, m: MicroCall) -> Micro:
    """One micro-batch's contribution; ``extra["norms"]``: each example's gradient norm
    (the clip with ``with_info``), else ``None``."""
    nums, dens, new_state, aux, example_grads, norms = per_example(m, self.transform)
    return Micro(nums, dens, new_state, aux, (example_grads,),
                 {"norms": norms if m.opts.with_info else None})

  def carry(self) -> dict[str, CarryEntry]:
    """The per-example norms: ``(rows, N)``, column ``i`` for micro-batch ``i`` (NaN for
    micro-batches not run), gathered over the data shards; ``AccumInfo.example_grad_norms``."""
    return {"norms": NORMS}


def _norms0(s: Scan) -> jax.Array | None:
  like = s.shapes.extra["norms"]
  if like is None:
    return None
  return vary_as(jnp.full((s.problem.rows, s.problem.n), jnp.nan, jnp.float32), like)


def _norms_update(c: jax.Array | None, u: Update, s: Scan) -> jax.Array | None:
  del s
  new = u.out.extra["norms"]
  if c is None or new is None:  # written whether the micro-batch is kept or skipped
    return c
  return lax.dynamic_update_index_in_dim(c, new.astype(c.dtype), u.i, 1)


def gather_norms(norms: jax.Array | None, a: Across) -> jax.Array | None:
  """Under ``data_axis``: every shard's ``(rows, N)`` norms in one ``(D * rows, N)`` array,
  the same on every shard (shard ``s`` holds the batch's ``s``-th block of rows)."""
  if norms is None:
    return None
  shard, shards = lax.axis_index(a.axes), lax.psum(1, a.axes)
  rows = norms.shape[0]
  full = jnp.zeros((rows * shards,) + norms.shape[1:], norms.dtype)
  return lax.psum(lax.dynamic_update_slice_in_dim(full, norms, shard * rows, 0), a.axes)


NORMS = CarryEntry(
    _norms0, _norms_update, gather_norms,
    lambda c, f: None if c is None else {"example_grad_norms": c.reshape(-1)})


# --- One micro-batch, one example at a time ---------------------------------------------------


def per_example(m: MicroCall, transform: Callable[[Any], Any]):
  """One micro-batch's contribution under a per-example transform (``transform``).

  ``jax.vmap`` over the micro-batch's rows runs ``f(kw, diff, rest)`` (``inner``) on each
  example as a batch of one (``clip_per_example(keep_batch_dim=False)``: on the row itself),
  transforms each example's gradient, and reduces the examples to the micro-batch's values
  as the loss kind says (mean or sum; a weighted term sums numerators and denominators) and
  each aux leaf as its reduction says. A :class:`jaxaccum._per_example._clip.ClipPerExample`
  takes the clip path instead (:func:`materialized_clipped_sum`, or the ghost norms'):
  norms, factors, one weighted sum. Example ``r`` gets ``fold_in(key, r)`` of the
  micro-batch's key (``kw_keys``: the keyword keys, already folded per micro-batch); state
  is shared by the examples and must come back the same from each, except that example
  ``r`` sees each typed key of the state folded with ``r`` (:func:`_fold_state_keys`:
  ``nnx.Rngs`` streams draw per example). ``axis`` holds each batch argument's per-leaf
  batch axes (``batch_axis``). Returns ``(nums, dens, new_state, aux, grads, norms)``,
  ``norms`` each example's gradient norm before clipping (the clip
  path; else ``None``).
  """
  opts, groups, f, diff, rest, rest_pos = m.opts, m.groups, m.inner, m.diff, m.rest, m.rest_pos
  kw, kw_keys, roles, axis = m.kw, m.kw_keys, m.roles, m.axis
  assert len(groups) == 1, "check_per_example allows one normalisation"
  clip = transform if isinstance(transform, _clip.ClipPerExample) else None
  keep_dim = clip is None or clip.keep_batch_dim
  kw = dict(kw)
  mask = None
  if clip is not None and clip.example_mask is not None:
    mask = _example_mask(clip.example_mask, kw.pop(clip.example_mask), axis[clip.example_mask])
  batch = [(v, axis[j]) for v, j in zip(rest, rest_pos, strict=True) if j in roles.batch]
  batch += [(kw[k], axis[k]) for k in kw]
  leaf, along = next((x, a) for v, ax in batch
                     for x, a in zip(jax.tree.leaves(v), jax.tree.leaves(ax), strict=True))
  rows = leaf.shape[along]
  if clip is not None and mask is not None and mask.shape != (rows,):
    raise ValueError(
        f"clip_per_example(example_mask={clip.example_mask!r}): the mask must hold one bool "
        f"per example (shape (batch,)), but a micro-batch of {rows} rows gets a mask of "
        f"shape {tuple(mask.shape)}.")

  def one_row(tree, axes):
    # (.., b, ..) -> (.., b, 1, ..), mapped over the batch axis: each example a batch of one.
    if not keep_dim:
      return tree
    return jax.tree.map(lambda x, a: jnp.expand_dims(x, a + 1), tree, axes)

  def keys(tree):
    return jax.tree.map(
        lambda k: jax.vmap(lambda r: jax.random.fold_in(k, r))(jnp.arange(rows)), tree)

  mapped, axes = [], []
  for v, j in zip(rest, rest_pos, strict=True):
    if j in roles.batch:
      mapped.append(one_row(v, axis[j]))
      axes.append(axis[j])
    elif j in roles.rng:
      mapped.append(keys(v))
      axes.append(0)
    else:
      mapped.append(v)
      axes.append(None)
  # Example r's index, folded into the typed keys that the state holds (nnx.Rngs streams)
  # by ``inner`` (:data:`EXAMPLE_INDEX`).
  xs = ({k: one_row(v, axis[k]) for k, v in kw.items()}, keys(kw_keys), tuple(mapped),
        jnp.arange(rows, dtype=jnp.uint32))
  in_axes = ({k: axis[k] for k in kw}, 0, tuple(axes), 0)

  def objective(d, x):
    kw1, keys1, rest1, r = x
    objectives, out = f({**kw1, **keys1, EXAMPLE_INDEX: r}, d, rest1)
    return objectives[0], out

  norms = None
  with _example_rank_hint(keep_dim, batch, _given_as(opts)):
    if clip is None:
      (nums, dens, new_state, aux), grads = _transformed(opts, objective, diff, xs, in_axes,
                                                         transform, roles)
    else:
      (nums, dens, new_state, aux), grads, norms = _clipped(
          opts, objective, diff, xs, in_axes, clip, mask, roles)

  nums, dens, aux, grads = _over_examples(opts, groups, clip, mask, keep_dim, rows,
                                          (nums, dens, aux), grads, norms)
  return nums, dens, new_state, aux, tuple(grads), norms


def _over_examples(opts: Options, groups: tuple[Group, ...],
                   clip: _clip.ClipPerExample | None, mask: jax.Array | None, keep_dim: bool,
                   rows: int, outs: tuple, grads: Any, norms: jax.Array | None):
  """The micro-batch's ``(nums, dens, aux, grads)`` from its examples' (``outs``: their
  numerators, denominators and aux, each with a leading axis of examples): reduced as the
  loss kind says (mean or sum; a weighted term sums numerators and denominators), each aux
  leaf as its reduction says; padding (``mask``) and, under ``nan_safe``, non-finite
  examples add nothing. ``grads``: the examples' transformed gradients, or the clip path's
  sum."""
  nums, dens, aux = outs
  acc = opts.numerics.accumulator_dtype
  # An example that adds nothing: padding (the mask), or a non-finite one under nan_safe.
  keep = None if mask is None else mask
  if clip is not None and clip.nan_safe and norms is not None:
    fin = jnp.isfinite(norms)
    keep = fin if keep is None else keep & fin

  def over_rows(x, mean):
    y = x.astype(_reduce.accumulator_dtype_for(x.dtype, acc))
    if keep is not None:
      y = jnp.where(keep.reshape(keep.shape + (1,) * (y.ndim - 1)), y, jnp.zeros_like(y))
    return (jnp.mean(y, axis=0) if mean else jnp.sum(y, axis=0)).astype(x.dtype)

  if mask is not None:  # a masked mean's denominator: its real examples
    dens = tuple(mask.astype(jnp.float32) if t.kind is _reduce.MASKED_MEAN else
                 None if d is None else jnp.where(mask, d, jnp.zeros_like(d))
                 for d, t in zip(dens, opts.terms, strict=True))
  wt = _reduce.aux_weight_term(opts.terms)
  weight = None if wt is None else dens[wt]  # each example's, before the sum
  nums = tuple(over_rows(v, t.kind.rows_mean) for v, t in zip(nums, opts.terms, strict=True))
  dens = tuple(None if d is None else jnp.sum(d, axis=0) for d in dens)
  mean = opts.terms[groups[0].terms[0]].kind.rows_mean
  if clip is None:
    grads = jax.tree.map(lambda g: over_rows(g, mean), grads)
  elif mean:  # the clip path's sum, as a mean over the micro-batch's examples
    grads = jax.tree.map(lambda g: (g / rows).astype(g.dtype), grads)

  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), aux)
  kinds = _reduce.resolve_aux_reduce(opts.aux_reduce, shapes, 1,
                                     _split.common_axis(opts.split.batch_axis),
                                     one_example="batch_of_one" if keep_dim else "row")

  def aux_rows(path, red, x):
    if red.over_rows is None:
      raise ValueError(
          f"aux leaf {jax.tree_util.keystr(path) or '(root)'} is reduced with {red.name}, "
          f"which has no per-example rule: {_given_as(opts)} runs fun on one example at a "
          "time, so there is no micro-batch value to reduce. Use 'concat' for per-example "
          "rows (a scalar per example becomes one row), or 'mean', 'sum', 'max', 'min', "
          "'all', 'any' for values reduced over the rows, or return that value from a "
          "separate, plain accumulation.")
    return red.over_rows(x, weight, acc)

  aux = jax.tree_util.tree_map_with_path(aux_rows, kinds, aux)
  return nums, dens, aux, grads


# The key of ``inner``'s keyword batch under which per_example passes the example's index
# (not an identifier, so never one of fun's keyword arguments; popped before fun is called).
EXAMPLE_INDEX = " example index"


def _fold_state_keys(rest: tuple, held: list[int], r: jax.Array) -> tuple[tuple, dict]:
  """Example ``r``'s state: each typed PRNG key in the state arguments (``held``:
  their places in ``rest``) replaced by ``fold_in(key, r)``. Returns the new ``rest`` and
  ``{id(folded): (folded, key)}``, for :func:`_unfold_state_keys`, which runs in the same
  trace as ``fun`` (inside ``remat``'s checkpoint), where a key returned as given is the
  same object.

  The keys of an ``nnx.Rngs`` stream are state, shared by the examples of a micro-batch;
  without the fold every example would draw the same dropout mask. A raw ``uint32`` key
  in the state cannot be told from integer state, and is not folded.
  """
  folded: dict[int, tuple] = {}

  def fold(leaf):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jax.dtypes.prng_key):
      return leaf
    # A stack of keys (one per scanned layer: nnx.split_rngs) folds each of them.
    flat = jnp.reshape(leaf, (-1,))
    new = jnp.reshape(jax.vmap(lambda k: jax.random.fold_in(k, r))(flat), jnp.shape(leaf))
    folded[id(new)] = (new, leaf)
    return new

  out = list(rest)
  for k in held:
    out[k] = jax.tree.map(fold, rest[k])
  return tuple(out), folded


def _unfold_state_keys(new_state: Any, folded: dict) -> Any:
  """``fun``'s new state with each folded key that ``fun`` returned as it got it put back
  to the key before the fold: the state stays the same for every example (an
  ``nnx.Rngs`` stream advances its counter, not its key). A key that ``fun`` replaced is
  left as returned; if it depends on the example, the state check names it."""
  def unfold(leaf):
    hit = folded.get(id(leaf))
    return hit[1] if hit is not None and hit[0] is leaf else leaf

  return jax.tree.map(unfold, new_state)


def _example_mask(name: str, mask: Any, axes: Any) -> jax.Array:
  """The micro-batch's rows of ``clip_per_example(example_mask=)``, as bools."""
  if not hasattr(mask, "dtype") or not (jnp.issubdtype(mask.dtype, jnp.bool_)
                                        or jnp.issubdtype(mask.dtype, jnp.number)):
    raise TypeError(
        f"clip_per_example(example_mask={name!r}): keyword argument {name!r} must be an "
        f"array of one bool per example (True: a real example), got {_describe(mask)}.")
  if axes not in (0, None) and jax.tree.leaves(axes) != [0]:
    raise ValueError(
        f"clip_per_example(example_mask={name!r}): the mask has one entry per example along "
        f"axis 0, but batch_axis gives it axis {axes}. Give the mask batch axis 0.")
  return jnp.asarray(mask) != 0


class _example_rank_hint:  # noqa: N801 (a context manager used like a function)
  """Re-raises a rank error from tracing ``fun`` on one example with what to drop.

  Porting code that vmaps over examples itself (JAX's DP-SGD example reshapes its images to
  ``(B, 1, 28, 28, 1)``, a batch of one per example) gives each example a second axis of
  one here, which a convolution reports as a raw rank error.
  """

  def __init__(self, keep_dim: bool, batch: list, given_as: str):
    self.given_as = given_as
    self.shapes = [] if not keep_dim else [
        (tuple(x.shape), a) for v, ax in batch
        for x, a in zip(jax.tree.leaves(v), jax.tree.leaves(ax), strict=True)
        if x.ndim > a + 1 and x.shape[a + 1] == 1]

  def __enter__(self):
    return self

  def __exit__(self, kind, err, tb):
    if err is None or not self.shapes or not isinstance(err, (TypeError, ValueError)):
      return False
    msg = str(err)
    if not any(w in msg for w in ("ndim", "rank", "dimension")):
      return False
    shape, a = self.shapes[0]
    row = shape[:a] + shape[a + 1:]  # one example, as the batch holds it
    raise type(err)(
        f"{self.given_as} calls fun on each example as a batch of one, so a batch leaf "
        f"whose rows have shape {row} reaches fun as {row[:a] + (1,) + row[a:]}: the axis of "
        "size 1 after the batch axis looks like an extra example axis added for a "
        "per-example vmap of one's own (as in JAX's DP-SGD example, dummy_dim=True). Drop it "
        f"(rows of shape {row[:a] + row[a + 1:]}), or pass clip_per_example(..., "
        "keep_batch_dim=False) so that fun sees each row as it is. The error "
        f"while tracing fun was: {type(err).__name__}: {msg}") from err


def _given_as(opts: Options) -> str:
  """How the caller gave the per-example transform (``per_example=``), for errors."""
  return opts.per_example.given_as


def _state_error(opts: Options) -> TypeError:
  return TypeError(
      f"{_given_as(opts)} runs fun on one example at a time, and the new state it "
      f"returns for state_argnums={opts.roles.state_argnums} depends on the example (e.g. "
      "BatchNorm statistics of its rows): per-example state has no single value to thread "
      "to the next micro-batch. Per-example gradients need a model without batch "
      "statistics (GroupNorm, LayerNorm); state that every example leaves the same (an "
      "unchanged collection, a step counter) is fine. A PRNG key held in the state is "
      "folded with each example's index, so that examples draw their own random numbers: "
      "return it unchanged (draw from fold_in(key, counter) and advance a counter, as "
      "nnx.Rngs does) rather than a key split from it.")


def _transformed(opts: Options, objective: Callable[..., Any], diff: list, xs: tuple,
                 in_axes: tuple, transform: Callable[[Any], Any], roles: _options.Roles):
  """Any per-example transform but the clip: each example's gradient transformed, under vmap.
  Returns ``(outs, grads)``, both with a leading axis of examples (state: shared)."""

  def example(x):
    grads, out = jax.grad(objective, has_aux=True)(tuple(diff), x)
    given = grads[0] if opts.roles.argnums_is_int else grads
    new = transform(given)
    if jax.tree.structure(new) != jax.tree.structure(given) or any(
        np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(new),
                                                   jax.tree.leaves(given), strict=True)):
      raise TypeError(
          f"{_given_as(opts)} must return a gradient with the structure and shapes of "
          f"the one it gets (one example's gradient, as jax.grad returns it): it got "
          f"{jax.tree.map(_describe, given)} and returned {jax.tree.map(_describe, new)}.")
    new = (new,) if opts.roles.argnums_is_int else tuple(new)
    new = jax.tree.map(lambda a, g: jnp.asarray(a).astype(g.dtype), new, grads)
    return out, new

  try:
    return jax.vmap(example, in_axes=(in_axes,), out_axes=((0, 0, None, 0), 0))(xs)
  except ValueError as e:
    if not (roles.state and "out_axes" in str(e)):
      raise
    raise _state_error(opts) from None


def _clipped(opts: Options, objective: Callable[..., Any], diff: list, xs: tuple,
             in_axes: tuple, clip: _clip.ClipPerExample, mask: jax.Array | None,
             roles: _options.Roles):
  """The clip path: ``(outs, clipped gradient sum, norms)``, by ``clip.method``."""
  if roles.state:  # shared state: the same from every example, checked on shapes only
    try:
      jax.eval_shape(jax.vmap(lambda x: objective(tuple(diff), x)[1][2], in_axes=(in_axes,),
                              out_axes=None), xs)
    except ValueError as e:
      if "out_axes" not in str(e):
        raise
      raise _state_error(opts) from None

  given = diff[0] if opts.roles.argnums_is_int else tuple(diff)  # the gradient fun's user sees
  groups = clip.leaf_groups(given) if clip.grouped else None

  def factors(norms):  # (E,) norms, or (E, G) with a pytree of clip norms
    c = clip.factors(norms)
    return c if mask is None else jnp.where(mask.reshape(mask.shape + (1,) * (c.ndim - 1)),
                                             c, 0.0)

  ghost, failed = None, None
  if clip.method != "materialize":
    try:  # norms=True: the norms themselves, finite even where their squares overflow;
      # only nan_safe and a mask give a factor of 0 that must stop a non-finite example
      # (zero_safe costs a parameter-sized buffer when sites sit in a scan body).
      ghost = _ghost.clipped_sum(objective, tuple(diff), xs, in_axes, factors,
                                 strict=clip.method == "ghost", norms=True,
                                 zero_safe=clip.nan_safe or mask is not None, groups=groups,
                                 auto=clip.method == "auto")
    except (TypeError, ValueError, NotImplementedError) as e:
      if clip.method == "ghost":  # "ghost" says why
        raise
      failed = e  # "auto": materialised below, where an error of fun's own is raised again
  if ghost is None:
    outs, grads, norms = materialized_clipped_sum(objective, tuple(diff), xs, in_axes, factors,
                                     opts.numerics.accumulator_dtype, groups)
  else:
    outs, grads, norms = ghost
  if failed is not None:
    warnings.warn(
        "clip_per_example(method='auto') materialises every example's gradient: the "
        f"ghost-norm analysis failed on this program with {type(failed).__name__}: {failed}",
        UserWarning, stacklevel=2)
  nums, dens, new_state, aux = outs
  new_state = jax.tree.map(lambda s: s[0], new_state)
  return (nums, dens, new_state, aux), grads, norms


def materialized_clipped_sum(f: Callable[..., Any], diff: tuple, xs: Any, in_axes: Any,
                weigh: Callable[[jax.Array], jax.Array], accumulator_dtype: Any = None,
                groups: Sequence[int] | None = None):
  """The clipped sum with each example's gradient materialised (``method="materialize"``).

  ``f(diff, x) -> (objective, out)`` is one example's objective; ``xs`` the examples,
  mapped as ``jax.vmap(f, in_axes=(None, in_axes))``. Each example's gradient ``g_e`` is
  formed under vmap, its norm taken (:func:`jaxaccum._per_example._norm.norm`), ``weigh``
  gives the factors ``c_e``, and the result is ``sum_e c_e g_e`` (an example with ``c_e = 0``
  adds exactly zero). Returns ``(outs, grad_sum, norms)``: the vmapped ``out``, the sum
  with ``diff``'s structure and dtypes, and the ``(E,)`` float32 norms. The ghost-norm
  path (``jaxaccum._per_example._ghost.clipped_sum``) computes the same without the per-example
  gradients, from squared norms. ``groups``: each leaf of ``diff``'s clip group (per-layer
  clipping): ``weigh`` then gets ``(E, G)`` norms, one per group, and gives a factor per
  group; the norms returned are each example's whole-gradient norm.
  """
  count = 1 if groups is None else max(groups, default=0) + 1

  def one(x):
    g, out = jax.grad(f, has_aux=True)(diff, x)
    if groups is None:
      return out, g, _norm.norm(g)
    return out, g, _norm.group_norms(jax.tree.leaves(g), list(groups), count)

  outs, grads, norms = jax.vmap(one, in_axes=(in_axes,))(xs)
  c = weigh(norms)
  leaves, treedef = jax.tree.flatten(grads)

  def total(g, k):
    acc = _reduce.accumulator_dtype_for(g.dtype, accumulator_dtype)
    # An example with c = 0 adds exactly zero even where its entries are not finite: the
    # select is fused into the sum (measured against testing each example's norm first
    # and cleaning only a micro-batch that needs it, a lax.cond, which stops that fusion:
    # see docs/dp-sgd.md, "NaN-safe clipping: what it costs").
    ck = c if groups is None else c[:, groups[k]]
    return jnp.sum(_norm.scale_rows(g, ck).astype(acc), axis=0).astype(g.dtype)

  summed = jax.tree.unflatten(treedef, [total(g, k) for k, g in enumerate(leaves)])
  return outs, summed, norms if groups is None else _norm.norm_of_norms(norms)


