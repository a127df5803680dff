"""The core run of the accumulation: scan -> reduce -> finalize.

The public transforms (:mod:`jaxaccum._api`), the data-parallel driver
(:mod:`jaxaccum._data_parallel`), ``pipeline`` and the adapters all run it. It runs in three
steps, each a function of named values:

1. :func:`scan`: one :func:`jax.lax.scan` over the micro-batches adds each micro-batch's
   loss terms, denominators, gradients, aux and statistics into a :class:`Carry` and
   threads the mutable state;
2. ``reduce``: under ``data_axis``, one cross-device reduction of the carry after the loop
   (:func:`jaxaccum._data_parallel.combine`); nothing otherwise;
3. :func:`finalize`: divides by what the reductions say (micro-batches kept, total
   denominators) and builds :func:`jax.value_and_grad`'s output.

The loss is one or several *terms* (:class:`jaxaccum._reduce.Term`). Terms that share a
divisor share one gradient accumulator (a *group*): a single loss has one group, and so
one backward pass per micro-batch, as :func:`jax.value_and_grad`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum import _ghost, _info, _options, _reduce, _sharding, _split, _stats
from jaxaccum._options import Options
from jaxaccum._split import describe as _describe
from jaxaccum._types import PyTree


class BatchBroadcastWarning(UserWarning):
  """An array with the batch's rows reaches ``fun`` whole, not split into micro-batches.

  Each micro-batch then sees all ``B`` rows of it next to its own ``B / N``, and
  broadcasting the two gives a wrong loss without an error. Emitted once per trace, for
  arrays ``fun`` closes over and for arguments that are neither batch nor differentiated
  nor state. If the array really is a constant that happens to have ``B`` rows (a table),
  silence it with ``warnings.filterwarnings("ignore", category=BatchBroadcastWarning)``.
  """


class Stats(NamedTuple):
  """Per-step counters and the sums behind :class:`jaxaccum.AccumInfo`."""

  kept: jax.Array  # int32: micro-batches added
  skipped: jax.Array  # int32: micro-batches dropped by skip_nonfinite
  sq: jax.Array  # float32: sum over samples of |g_i|^2
  samples: jax.Array  # int32: samples behind sq
  size: jax.Array  # float32: sum over samples of their sizes (rows or denominators)
  inv_size: jax.Array  # float32: sum over samples of 1 / size


class Carry(NamedTuple):
  """What the scan carries from one micro-batch to the next."""

  num: tuple  # per term: the summed value (numerator)
  den: tuple  # per term: the summed denominator (weighted terms), else None
  grads: tuple  # per group: the summed gradients
  aux: PyTree  # per aux leaf: its reduction's carry (None for per-micro-batch kinds)
  state: tuple  # the threaded state arguments
  stats: Stats
  # (rows, N): each example's gradient norm before clipping, column i for micro-batch i
  # (clip_per_example with with_info; NaN for micro-batches not run), else None.
  norms: jax.Array | None = None


class Group(NamedTuple):
  """Loss terms whose gradients share one accumulator and one divisor."""

  terms: tuple[int, ...]
  divisor: tuple  # its divisor_key: (the Divisor, the term whose denominator it is, or None)
  scaled: tuple[bool, ...]  # per term: scaled by 1 / (micro-batches run) in the body


def divisor_key(t: int, term: _reduce.Term) -> tuple:
  """What term ``t`` divides by: its kind's :class:`jaxaccum._reduce.Divisor`, with ``t``
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
                        _reduce.safe_divide(a.astype(dtype or a.dtype), d), acc)
    total = part if total is None else jax.tree.map(jnp.add, total, part)
  return total


def make_groups(opts: Options) -> tuple[Group, ...]:
  if opts.evaluating:  # nothing differentiated: no gradient accumulators
    return ()
  groups: dict[Any, list[int]] = {}
  for t, term in enumerate(opts.terms):
    groups.setdefault(divisor_key(t, term), []).append(t)
  in_body = [k for k in groups if k[0].in_body]
  merge = len(groups) > 1 and bool(in_body) and not opts.skip_nonfinite and not opts.with_info
  out = []
  if merge:  # terms divided by a count known in the body: fold them into the sum group
    one = (_reduce.NO_DIVISOR, None)
    ts = tuple(sorted(sum((groups.pop(k) for k in [one, *in_body] if k in groups), [])))
    out.append(Group(ts, one, tuple(opts.terms[t].kind.divisor.in_body for t in ts)))
  for key, ts in groups.items():
    out.append(Group(tuple(ts), key, (False,) * len(ts)))
  return tuple(out)


# --- What fun returns ------------------------------------------------------------------------


def _check_scalar(name: str, value: Any, what: str, hint: str = "") -> jax.Array:
  shape = getattr(value, "shape", None)
  dtype = getattr(value, "dtype", None)
  if shape is None or dtype is None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return jnp.asarray(value)  # a Python number, e.g. x.shape[0] as a denominator
    raise TypeError(f"{name} must be a scalar array {what}, got {_describe(value)}.{hint}")
  if shape != ():
    raise TypeError(
        f"{name} must be a scalar {what}, got {_describe(value)}. Reduce it over the "
        "micro-batch inside fun (e.g. jnp.mean) before returning it.")
  return value


def _check_real(name: str, value: jax.Array, evaluating: bool = False) -> None:
  if not jnp.issubdtype(value.dtype, jnp.floating):
    why = ("to be reduced as a loss term (means divide it)" if evaluating else
           "to be differentiated")
    hint = (" An integer count belongs in aux (has_aux=True), where it is summed." if
            evaluating else "")
    raise TypeError(
        f"{name} must have a floating dtype {why}, got {_describe(value)}. "
        f"Cast it with .astype(jnp.float32).{hint}")


def _term_value(opts: Options, term: _reduce.Term, value: Any):
  """One term's (numerator, denominator-or-None) from fun's value."""
  where = "the value returned by fun" if not term.path else f"loss term {term.label}"
  if term.kind.pair:
    what = f"reduce={term.kind!r}" if not term.path else f"loss term {term.label}"
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
      raise TypeError(
          f"{what} needs fun to return "
          f"{'its value' if not term.path else 'the term'} as (numerator, denominator), "
          "e.g. (summed token loss, number of real tokens)"
          f"{' with aux as ((numerator, denominator), aux)' if opts.has_extra else ''}; "
          f"got {_describe(value)}.")
    num = _check_scalar(f"the numerator of {what}", value[0], "(the summed loss)")
    _check_real(f"the numerator of {what}", num, opts.evaluating)
    den = _check_scalar(f"the denominator of {what}", value[1], "(the count or total weight)")
    if not (jnp.issubdtype(den.dtype, jnp.integer) or jnp.issubdtype(den.dtype, jnp.floating)):
      raise TypeError(
          f"the denominator of {what} must be a number, got dtype {den.dtype}.")
    return num, lax.stop_gradient(den)
  hint = ""
  if isinstance(value, (tuple, list)):
    hint = (
        f" It is a {type(value).__name__} of {len(value)}: if fun returns (loss, aux), pass "
        "has_aux=True; if it returns (numerator, denominator) such as (summed token loss, "
        "token count), pass reduce='weighted'.")
  num = _check_scalar(where, value, term.kind.returns, hint)
  _check_real(where, num, opts.evaluating)
  return num, None


def _check_unnamed_terms(reduce: dict, value: dict, path: tuple = (), top: Any = None) -> None:
  """Raises if ``value`` holds a loss term that the dict ``reduce`` does not name."""
  top = reduce if top is None else top
  for key in value:
    if key not in reduce:
      label = "".join(f"[{k!r}]" for k in (*path, key)) if path else repr(key)
      example = (f"reduce={{{', '.join(f'{k!r}: {v!r}' for k, v in top.items())}, "
                 f"{key!r}: ...}}" if not path else f"reduce{label[:-len(repr(key)) - 2]}"
                 f"[{key!r}] = ...")
      raise TypeError(
          f"fun returned loss term {label}, which reduce={top!r} does not name, so it "
          f"would be dropped. Name it in reduce ({example}), or drop it from the returned "
          "dict; a value to report but not train on goes in aux (has_aux=True).")
    if isinstance(reduce[key], dict) and isinstance(value[key], dict):
      _check_unnamed_terms(reduce[key], value[key], (*path, key), top)


def unpack(opts: Options, out: Any):
  """Splits fun's output into (term numerators, term denominators, new_state, aux)."""
  if opts.has_extra:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      wants = ("(value, aux)" if opts.has_aux and not opts.state_argnums else
               "(value, new_state)" if not opts.has_aux else "(value, (new_state, aux))")
      raise TypeError(
          f"fun must return {wants} because "
          f"{'has_aux=True' if opts.has_aux else 'state_argnums is set'}, got {_describe(out)}.")
    value, extra = out
  else:
    value, extra = out, None
  if opts.single_term:
    pairs = [_term_value(opts, opts.terms[0], value)]
  else:
    if not isinstance(value, dict):
      raise TypeError(
          f"reduce={opts.reduce!r} is a dict of loss terms, so fun must return its value as a "
          f"dict with the same keys, got {_describe(value)}.")
    pairs = []
    for term in opts.terms:
      try:
        v = _reduce.get_path(value, term.path)
      except (KeyError, IndexError, TypeError):
        raise TypeError(
            f"reduce names loss term {term.label}, but the value fun returned has keys "
            f"{sorted(value)}. Return every term that reduce names.") from None
      pairs.append(_term_value(opts, term, v))
    _check_unnamed_terms(opts.reduce, value)
  nums, dens = zip(*pairs, strict=True)
  if opts.state_argnums:
    if opts.has_aux:
      if not (isinstance(extra, (tuple, list)) and len(extra) == 2):
        got = _describe(extra) if hasattr(extra, "shape") else type(extra).__name__
        raise TypeError(
            "with state_argnums and has_aux=True, fun must return (value, (new_state, aux)), "
            f"got (value, {got}). If fun returns (value, new_state) with no aux, drop "
            "has_aux=True.")
      new_state, aux = extra
    else:
      new_state, aux = extra, None
  else:
    new_state, aux = None, extra
  for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) and not isinstance(
        leaf, (int, float, complex, np.generic)):
      raise TypeError(
          f"aux leaf {jax.tree_util.keystr(path) or '(root)'} is {_describe(leaf)}, not an "
          "array: every leaf of aux must be a JAX array (a string or other Python object "
          "cannot leave the compiled loop). Return it outside the accumulated function, or "
          "as an array.")
  return nums, dens, new_state, aux


def _check_keys(opts: Options, argnum: int | str, tree: PyTree, size: int,
                batch: tuple[int, ...], batch_names: tuple[str, ...] = ()) -> None:
  """Every leaf of a key argument (``argnum`` a position, or a keyword's name) is one key."""
  if isinstance(argnum, str):
    option, label = "rng_argnames", f"keyword argument {argnum!r}"
    as_batch = f"batch_argnames={tuple(sorted((*batch_names, argnum)))}"
  else:
    option, label = "rng_argnums", opts.label(argnum)
    as_batch = f"batch_argnums={tuple(sorted((*batch, argnum)))}"
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not _split.is_key(leaf):
      # Rows of keys: is each row one key? Shape and dtype only, never leaf[0], which on
      # an array sharded over an Explicit mesh is a gather JAX refuses outside jit.
      shape, dtype = np.shape(leaf), getattr(leaf, "dtype", None)
      per_example = (shape[:1] == (size,) and dtype is not None
                     and _split.is_key(jax.ShapeDtypeStruct(shape[1:], dtype)))
      hint = (
          f" Its leading axis of size {size} is the batch's: per-example keys are "
          f"per-example data. Pass them as a batch argument ({as_batch}) instead of "
          f"{option}, and each micro-batch gets its own rows of keys." if per_example else
          " Pass one key from jax.random.key(seed) (or jax.random.PRNGKey), or a pytree "
          "of them; micro-batch i gets fold_in(key, i), so there is no need to split it.")
      raise TypeError(
          f"{option} names {label}, but its leaf "
          f"{jax.tree_util.keystr(path) or '(root)'} is {_describe(leaf)}, not a single PRNG "
          f"key.{hint}")


def _check_inexact(opts: Options, argnum: int, tree: PyTree) -> None:
  """Every differentiated leaf must be real or complex, as :func:`jax.grad` requires."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      try:
        dtype = jnp.asarray(leaf).dtype
      except TypeError:
        continue  # not an array: jax.vjp names it
    if not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
          f"argnums names {opts.label(argnum)}, but its leaf "
          f"{jax.tree_util.keystr(path) or '(root)'} has dtype {dtype}: jax.grad requires "
          "real- or complex-valued inputs (input dtype that is a sub-dtype of np.inexact). "
          "Cast it to a floating dtype (e.g. .astype(jnp.float32)), or pass it as an "
          "argument that is not differentiated.")


def _check_state(opts: Options, positions: tuple[int, ...], state_in: tuple,
                 new_state: Any) -> tuple:
  """Checks that fun returned state shaped like its state arguments; returns it as a tuple."""
  if opts.state_is_tuple and (not isinstance(new_state, (tuple, list))
                              or len(new_state) != len(state_in)):
    raise TypeError(
        f"state_argnums={opts.state_argnums} is a tuple, so fun must return the new states "
        f"as a tuple of {len(state_in)}, got {_describe(new_state)}.")
  got = tuple(new_state) if opts.state_is_tuple else (new_state,)
  out = []
  for j, old, new in zip(positions, state_in, got, strict=True):
    s_old, s_new = jax.tree.structure(old), jax.tree.structure(new)
    if s_old != s_new:
      # A FrozenDict passed in comes back as a plain dict from Linen's apply: same leaves.
      if [p for p, _ in jax.tree_util.tree_leaves_with_path(old)] == \
          [p for p, _ in jax.tree_util.tree_leaves_with_path(new)]:
        new = jax.tree.unflatten(s_old, jax.tree.leaves(new))
      else:
        raise TypeError(
            f"the new state returned by fun for state {opts.label(j)} has structure "
            f"{s_new}, but the state passed in has structure {s_old}. Return the updated "
            "state with the same structure as the input.")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new),
                            strict=True):
      if a.shape != b.shape or a.dtype != b.dtype:  # jnp.dtype() rejects PRNG key dtypes
        raise TypeError(
            f"the new state leaf {jax.tree_util.keystr(path)} of state {opts.label(j)} is "
            f"{_describe(b)}, but the input is {_describe(a)}. Keep each state leaf's shape "
            "and dtype.")
    out.append(new)
  return tuple(out)


# --- The per-micro-batch computation --------------------------------------------------------


class Micro(NamedTuple):
  """One micro-batch's contribution."""

  nums: tuple
  dens: tuple
  state: tuple
  aux: PyTree
  grads: tuple  # per group
  norms: jax.Array | None = None  # (rows,): each example's gradient norm (the clip path)


class Problem(NamedTuple):
  """A call of the transformed function, split and ready to scan."""

  n: int  # micro-batches
  rows: int  # rows per micro-batch (per data shard)
  params: tuple
  state0: tuple
  micro: Callable[[jax.Array, tuple, Any], Micro]  # (i, state, count) -> Micro
  groups: tuple[Group, ...]
  # Array leaves of the call by role, for the check of whole-batch arrays: (label, leaf)
  # of the arguments passed whole, and the leaves of parameters, state and keys.
  whole: tuple = ()
  own: tuple = ()
  batch: tuple[int, ...] = ()


def prepare(opts: Options, args: tuple, kwargs: dict, n: int | None = None) -> Problem:
  """Resolves the roles, splits the batch and builds the per-micro-batch function."""
  roles = opts.roles(len(args), kwargs)
  batches: dict[Any, PyTree] = {opts.label(j): args[j] for j in roles.batch}
  batches.update({f"keyword argument {k!r}": kwargs[k] for k in roles.batch_names})
  hint = (" The batch is argument 1 by default (batch_argnums=1) when it is passed: pass "
          "batch_argnums=() if only batch_argnames name the batch." if opts.batch_optional
          else "")
  axes = _split.batch_axes(batches, opts.batch_axis)
  size = _split.batch_size(batches, hint, axes)
  if n is None:
    n = _split.resolve_count(size, opts.count, opts.size, of=_split.size_note(batches, axes))
  for j in roles.rng:
    _check_keys(opts, j, args[j], size, roles.batch)
  for k in roles.rng_names:
    _check_keys(opts, k, kwargs[k], size, roles.batch, roles.batch_names)
  for j in roles.diff:
    _check_inexact(opts, j, args[j])
  _sharding.check_split_sharding(batches, n, axes)
  axis = dict(zip((*roles.batch, *roles.batch_names), axes.values(), strict=True))
  split = {j: _split.split(args[j], n, axis[j]) for j in roles.batch}
  split_kw = {k: _split.split(kwargs[k], n, axis[k]) for k in roles.batch_names}
  state0 = tuple(args[j] for j in roles.state)
  params = tuple(args[j] for j in roles.diff)
  groups = make_groups(opts)

  # The differentiated function takes only the arguments that have a role and closes over
  # the others, so those may be anything (a static flag, a string) even under remat.
  role_pos = tuple(dict.fromkeys(roles.diff + roles.batch + roles.rng + roles.state))
  nd = len(roles.diff)
  # clip_per_example(example_mask=) names a batch argument that the core reads, not fun.
  clip = opts.per_example_transform
  mask = clip.example_mask if isinstance(clip, _stats.ClipPerExample) else None
  fun_kwargs = {k: v for k, v in kwargs.items() if k != mask}

  held = [k for k, j in enumerate(role_pos) if j in roles.state]

  def inner(count, kw_batch, *role_vals):
    folded = None
    if EXAMPLE_INDEX in kw_batch:  # per_example: example r's state keys (under remat too)
      kw_batch = dict(kw_batch)
      role_vals, folded = _fold_state_keys(role_vals, held, kw_batch.pop(EXAMPLE_INDEX))
    call_args = list(args)
    for j, v in zip(role_pos, role_vals, strict=True):
      call_args[j] = v
    nums, dens, new_state, aux = unpack(opts, opts.fun(*call_args, **{**fun_kwargs,
                                                                       **kw_batch}))
    if folded:
      new_state = _unfold_state_keys(new_state, folded)
    objectives = []
    for g in groups:
      total = 0.0
      for t, scaled in zip(g.terms, g.scaled, strict=True):
        w = opts.terms[t].weight
        v = nums[t] * w if w != 1.0 else nums[t]
        total = total + (v / count.astype(v.dtype) if scaled else v)
      objectives.append(total)
    return tuple(objectives), (nums, dens, new_state, aux)

  if opts.remat:
    # prevent_cse=True: the recomputation sits in the same scan iteration as the forward
    # pass it repeats, and without the barrier XLA merges the two, saving nothing.
    inner = jax.checkpoint(inner, policy=opts.remat_policy, prevent_cse=True)

  def micro(i, state, count):
    call_args = list(args)
    for j in roles.batch:
      call_args[j] = _split.take(split[j], i, axis[j])
    for j in roles.rng:
      call_args[j] = jax.tree.map(lambda k: jax.random.fold_in(k, i), args[j])
    for j, s in zip(roles.state, state, strict=True):
      call_args[j] = s
    kw = {k: _split.take(split_kw[k], i, axis[k]) for k in roles.batch_names}
    kw_keys = {k: jax.tree.map(lambda key: jax.random.fold_in(key, i), kwargs[k])
               for k in roles.rng_names}
    vals = [call_args[j] for j in role_pos]
    diff, rest = vals[:nd], vals[nd:]
    grads = []
    norms = None
    if opts.evaluating:  # forward only: no jax.vjp, no gradients
      _, (nums, dens, new_state, aux) = inner(count, {**kw, **kw_keys}, *vals)
    elif opts.per_example_transform is not None:
      nums, dens, new_state, aux, example_grads, norms = per_example(
          opts, groups, lambda kw1, d, r: inner(count, kw1, *d, *r), diff, kw, kw_keys, rest,
          tuple(role_pos[nd:]), roles, axis)
      grads = [example_grads]
    else:
      kw = {**kw, **kw_keys}
      objectives, vjp, (nums, dens, new_state, aux) = jax.vjp(
          lambda *d: inner(count, kw, *d, *rest), *diff, has_aux=True)
      for k in range(len(groups)):
        cot = tuple(jnp.ones_like(o) if h == k else jnp.zeros_like(o)
                    for h, o in enumerate(objectives))
        grads.append(vjp(cot))
    if roles.state:
      state = _check_state(opts, roles.state, state, new_state)
    return Micro(nums, dens, state, aux, tuple(grads), norms if opts.with_info else None)

  whole, own = [], []
  for key, tree in [*enumerate(args), *kwargs.items()]:
    if key in roles.batch or key in roles.batch_names:
      continue
    # Under evaluate nothing is differentiated: positional arguments passed whole are the
    # parameters, which never warn.
    if (key in roles.diff or key in roles.state or key in roles.rng
        or key in roles.rng_names or (opts.evaluating and isinstance(key, int))):
      own += jax.tree.leaves(tree)
      continue
    label = opts.label(key) if isinstance(key, int) else f"keyword argument {key!r}"
    whole += [(label + jax.tree_util.keystr(p), x)
              for p, x in jax.tree_util.tree_leaves_with_path(tree)]
  own += jax.tree.leaves((split, split_kw))  # the split batch: (B, 1, ...) when N = 1
  return Problem(n, size // n, params, state0, micro, groups, tuple(whole), tuple(own),
                 roles.batch)


def per_example(opts: Options, groups: tuple[Group, ...], f: Callable[..., Any], diff: list,
                kw: dict, kw_keys: dict, rest: list, rest_pos: tuple[int, ...],
                roles: _options.Roles, axis: dict):
  """One micro-batch's contribution under ``per_example_transform``.

  ``jax.vmap`` over the micro-batch's rows runs ``f(kw, diff, rest)`` (``inner``) on each
  example as a batch of one (``clip_per_example(keep_batch_dim=False)``: on the row itself),
  transforms each example's gradient, and reduces the examples to the micro-batch's values
  as the loss kind says (mean or sum; a weighted term sums numerators and denominators) and
  each aux leaf as its reduction says. A :class:`jaxaccum._stats.ClipPerExample` takes the
  clip path instead (:func:`clipped_sum`): norms, factors, one weighted sum. Example ``r``
  gets ``fold_in(key, r)`` of the micro-batch's key (``kw_keys``: the keyword keys, already
  folded per micro-batch); state is shared by the examples and must come back the same from
  each, except that example ``r`` sees each typed key of the state folded with ``r``
  (:func:`_fold_state_keys`: ``nnx.Rngs`` streams draw per example). ``axis`` holds each
  batch argument's per-leaf batch axes (``batch_axis``). Returns ``(nums, dens, new_state,
  aux, grads, norms)``, ``norms`` each example's gradient norm before clipping (the clip
  path; else ``None``).
  """
  assert len(groups) == 1, "check_per_example allows one normalisation"
  transform = opts.per_example_transform
  assert transform is not None
  clip = transform if isinstance(transform, _stats.ClipPerExample) else None
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
  with _example_rank_hint(keep_dim, batch):
    if clip is None:
      (nums, dens, new_state, aux), grads = _transformed(opts, objective, diff, xs, in_axes,
                                                         transform, roles)
    else:
      (nums, dens, new_state, aux), grads, norms = _clipped(
          opts, objective, diff, xs, in_axes, clip, mask, roles)

  acc = opts.accumulator_dtype
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
  wt = aux_weight_term(opts)
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
                                     _split.common_axis(opts.batch_axis),
                                     one_example="batch_of_one" if keep_dim else "row")

  def aux_rows(path, red, x):
    if red.over_rows is None:
      raise ValueError(
          f"aux leaf {jax.tree_util.keystr(path) or '(root)'} is reduced with {red.name}, "
          "which has no per-example rule: per_example_transform runs fun on one example at a "
          "time, so there is no micro-batch value to reduce. Use 'concat' for per-example "
          "rows (a scalar per example becomes one row), or 'mean', 'sum', 'max', 'min', "
          "'all', 'any' for values reduced over the rows, or return that value from a "
          "separate, plain accumulation.")
    return red.over_rows(x, weight, acc)

  aux = jax.tree_util.tree_map_with_path(aux_rows, kinds, aux)
  return nums, dens, new_state, aux, tuple(grads), norms


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

  def __init__(self, keep_dim: bool, batch: list):
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
        f"per_example_transform calls fun on each example as a batch of one, so a batch leaf "
        f"whose rows have shape {row} reaches fun as {row[:a] + (1,) + row[a:]}: the axis of "
        "size 1 after the batch axis looks like an extra example axis added for a "
        "per-example vmap of one's own (as in JAX's DP-SGD example, dummy_dim=True). Drop it "
        f"(rows of shape {row[:a] + row[a + 1:]}), or pass clip_per_example(..., "
        "keep_batch_dim=False) so that fun sees each row as it is. The error "
        f"while tracing fun was: {type(err).__name__}: {msg}") from err


def _state_error(opts: Options) -> TypeError:
  return TypeError(
      f"per_example_transform runs fun on one example at a time, and the new state it "
      f"returns for state_argnums={opts.state_argnums} depends on the example (e.g. "
      "BatchNorm statistics of its rows): per-example state has no single value to thread "
      "to the next micro-batch. Per-example gradients need a model without batch "
      "statistics (GroupNorm, LayerNorm); state that every example leaves the same (an "
      "unchanged collection, a step counter) is fine. A PRNG key held in the state is "
      "folded with each example's index, so that examples draw their own random numbers: "
      "return it unchanged (draw from fold_in(key, counter) and advance a counter, as "
      "nnx.Rngs does) rather than a key split from it.")


def _transformed(opts: Options, objective: Callable[..., Any], diff: list, xs: tuple,
                 in_axes: tuple, transform: Callable[[Any], Any], roles: _options.Roles):
  """Any ``per_example_transform``: each example's gradient transformed, under vmap.
  Returns ``(outs, grads)``, both with a leading axis of examples (state: shared)."""

  def example(x):
    grads, out = jax.grad(objective, has_aux=True)(tuple(diff), x)
    given = grads[0] if opts.argnums_is_int else grads
    new = transform(given)
    if jax.tree.structure(new) != jax.tree.structure(given) or any(
        np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(new),
                                                   jax.tree.leaves(given), strict=True)):
      raise TypeError(
          "per_example_transform must return a gradient with the structure and shapes of "
          f"the one it gets (one example's gradient, as jax.grad returns it): it got "
          f"{jax.tree.map(_describe, given)} and returned {jax.tree.map(_describe, new)}.")
    new = (new,) if opts.argnums_is_int else tuple(new)
    new = jax.tree.map(lambda a, g: jnp.asarray(a).astype(g.dtype), new, grads)
    return out, new

  try:
    return jax.vmap(example, in_axes=(in_axes,), out_axes=((0, 0, None, 0), 0))(xs)
  except ValueError as e:
    if not (roles.state and "out_axes" in str(e)):
      raise
    raise _state_error(opts) from None


def _clipped(opts: Options, objective: Callable[..., Any], diff: list, xs: tuple,
             in_axes: tuple, clip: _stats.ClipPerExample, mask: jax.Array | None,
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

  given = diff[0] if opts.argnums_is_int else tuple(diff)  # the gradient fun's user sees
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
    outs, grads, norms = clipped_sum(objective, tuple(diff), xs, in_axes, factors,
                                     opts.accumulator_dtype, groups)
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


def clipped_sum(f: Callable[..., Any], diff: tuple, xs: Any, in_axes: Any,
                weigh: Callable[[jax.Array], jax.Array], accumulator_dtype: Any = None,
                groups: Sequence[int] | None = None):
  """The clipped sum with each example's gradient materialised (``method="materialize"``).

  ``f(diff, x) -> (objective, out)`` is one example's objective; ``xs`` the examples,
  mapped as ``jax.vmap(f, in_axes=(None, in_axes))``. Each example's gradient ``g_e`` is
  formed under vmap, its norm taken (:func:`jaxaccum._stats.norm`), ``weigh(norms)`` gives
  the factors ``c_e``, and the result is ``sum_e c_e g_e`` (an example with ``c_e = 0``
  adds exactly zero). Returns ``(outs, grad_sum, norms)``: the vmapped ``out``, the sum
  with ``diff``'s structure and dtypes, and the ``(E,)`` float32 norms. The ghost-norm
  path (``jaxaccum._ghost.clipped_sum``) computes the same without the per-example
  gradients, from squared norms. ``groups``: each leaf of ``diff``'s clip group (per-layer
  clipping): ``weigh`` then gets ``(E, G)`` norms, one per group, and gives a factor per
  group; the norms returned are each example's whole-gradient norm.
  """
  count = 1 if groups is None else max(groups, default=0) + 1

  def one(x):
    g, out = jax.grad(f, has_aux=True)(diff, x)
    if groups is None:
      return out, g, _stats.norm(g)
    return out, g, _stats.group_norms(jax.tree.leaves(g), list(groups), count)

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
    return jnp.sum(_stats.scale_rows(g, ck).astype(acc), axis=0).astype(g.dtype)

  summed = jax.tree.unflatten(treedef, [total(g, k) for k, g in enumerate(leaves)])
  return outs, summed, norms if groups is None else _stats.combine(norms)


def warn_whole_batch(opts: Options, problem: Problem, consts: Sequence[Any],
                     shards: int = 1) -> None:
  """Warns once if ``fun`` gets an array with the batch's rows that is not split.

  ``consts`` are the values that one traced micro-batch call closes over: the arguments
  passed whole and the arrays ``fun`` closes over (the split batch has ``B / N`` rows).
  Parameters, state and keys never warn, whatever their shape. Only one-row micro-batches
  are checked: with ``b > 1`` rows, an unsplit array of ``B`` rows that meets the micro-batch
  elementwise is a shape error, not a silent broadcast, while arrays that merely have ``B``
  rows (a ``(T, T)`` causal mask with ``T == B``) are common and correct. Under
  ``per_example_transform`` every call sees one row, so it is always checked.
  """
  per_example = opts.per_example_transform is not None  # fun sees one row at a time
  if problem.rows != 1 and not per_example:
    return
  size = problem.n * problem.rows
  rows = {size} if problem.n > 1 or per_example else set()
  if shards > 1:
    rows.add(size * shards)  # under data_axis: the global batch, closed over whole

  def same(c, x):  # NumPy arguments reach the trace as copies
    return c is x or (isinstance(x, np.ndarray) and np.shape(c) == x.shape
                      and getattr(c, "dtype", None) == x.dtype)

  found = []
  for c in consts:
    shape = tuple(np.shape(c))
    if not shape or shape[0] not in rows or any(same(c, x) for x in problem.own):
      continue
    label = next((lab for lab, x in problem.whole if same(c, x)), None)
    if label is None:
      found.append(f"an array of shape {shape} that fun closes over has the batch's "
                   f"{shape[0]} rows")
    else:
      found.append(f"{label}, an array of shape {shape}, has the batch's {shape[0]} rows")
  if not found:
    return
  pos = sorted({int(f.split(" ")[1]) for f in found if f.startswith("argument ")})
  hint = (f" (batch_argnums={tuple(sorted({*problem.batch, *pos}))})" if pos else "")
  warnings.warn(
      f"{'; '.join(dict.fromkeys(found))}, but it is not split into micro-batches: each "
      f"micro-batch of {problem.rows} row(s) sees all of it, and broadcasting it against "
      "the micro-batch's rows gives a wrong loss without an error. Pass it as a batch "
      f"argument{hint}: take it as an argument of fun and name it in batch_argnums (or "
      "batch_argnames). If it is a constant that happens to have this many rows, silence "
      "this with warnings.filterwarnings('ignore', category=jaxaccum.BatchBroadcastWarning).",
      BatchBroadcastWarning, stacklevel=2)


# --- Step 1: scan -----------------------------------------------------------------------------


def _zeros_like_struct(s: Any) -> jax.Array:
  if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
    impl = s.dtype._impl  # a key dtype's PRNG implementation (key_shape, wrap_key_data's impl)
    data = jnp.zeros(s.shape + tuple(impl.key_shape), jnp.uint32)
    return _sharding.conform(jax.random.wrap_key_data(data, impl=impl), s)
  return _sharding.conform(jnp.zeros(s.shape, s.dtype), s)


def _vary_as(x: jax.Array, *likes: Any) -> jax.Array:
  """``x``, varying over every manual axis that ``x`` or any of ``likes`` varies over."""
  want = frozenset().union(*(_sharding._varying(like) for like in likes))
  return _sharding._vary(x, tuple(sorted(want, key=str)))


def info_sizes(opts: Options):
  """Which term's denominator measures a sample's size (None: rows)."""
  return 0 if opts.single_term and opts.terms[0].kind.weighs else None


def scan(opts: Options, problem: Problem, active: jax.Array | None, shards: int = 1):
  """Step 1: one ``lax.scan`` over the micro-batches. Returns ``(carry, stacked, shapes)``.

  ``shards`` is the number of data shards running the same scan (under ``data_axis``):
  mean terms folded into a sum group divide by the micro-batches run on all of them.
  """
  n = problem.n
  count = jnp.asarray(n if active is None else active, jnp.int32) * shards
  traced, shapes = jax.make_jaxpr(problem.micro, return_shape=True)(
      jnp.int32(0), problem.state0, count)
  warn_whole_batch(opts, problem, traced.consts, shards)
  kinds = _reduce.resolve_aux_reduce(opts.aux_reduce, shapes.aux, problem.rows,
                                     _split.common_axis(opts.batch_axis))
  acc = opts.accumulator_dtype
  acc_dtype = functools.partial(_reduce.accumulator_dtype_for, accumulator_dtype=acc)

  def den_dtype(s):
    return (jnp.promote_types(s.dtype, jnp.int32) if jnp.issubdtype(s.dtype, jnp.integer)
            else acc_dtype(s.dtype))

  # Under skip_nonfinite, where(keep, new, carry) varies wherever keep does (a shard's own
  # verdict), even for an aux leaf that does not vary across shards: so must the carry.
  keep_like = (jax.tree.leaves((shapes.nums, shapes.dens, shapes.grads))
               if opts.skip_nonfinite else [])

  def aux_carry0(red, s):
    # Per-micro-batch reductions (stack, concat) keep no carry: the scan emits the leaf.
    init = None if red.per_micro_batch else red.init(s, acc)
    if init is None:
      return None
    # A user reduction's carry may be a pytree of any shapes: it varies as the leaf does.
    return jax.tree.map(lambda x: _vary_as(
        _sharding.conform(x, s) if jnp.shape(x) == s.shape else jnp.asarray(x), s, *keep_like),
        init)

  weight_term = aux_weight_term(opts)
  zero_f = jnp.zeros((), jnp.float32)
  zero_i = jnp.zeros((), jnp.int32)
  carry0 = Carry(
      num=tuple(_sharding.conform(jnp.zeros((), acc_dtype(s.dtype)), s) for s in shapes.nums),
      den=tuple(None if s is None else _sharding.conform(jnp.zeros((), den_dtype(s)), s)
                for s in shapes.dens),
      grads=tuple(_sharding.align(jax.tree.map(
          lambda g: _sharding.conform(jnp.zeros(g.shape, acc_dtype(g.dtype)), g), gs),
          problem.params) for gs in shapes.grads),
      aux=jax.tree.map(aux_carry0, kinds, shapes.aux),
      state=jax.tree.map(_sharding.conform, problem.state0, shapes.state),
      stats=jax.tree.map(lambda z: _sharding.conform(z, shapes.nums[0]),
                         Stats(zero_i, zero_i, zero_f, zero_i, zero_f, zero_f)),
      norms=None if shapes.norms is None else _vary_as(
          jnp.full((problem.rows, n), jnp.nan, jnp.float32), shapes.norms),
  )
  per_mb = jax.tree.map(lambda k, s: s if k.per_micro_batch else None, kinds, shapes.aux)

  def run(carry: Carry, i):
    out = problem.micro(i, carry.state, count)
    finite = (out.nums, [d for d in out.dens if d is not None], out.grads)
    keep = _stats.all_finite(finite) if opts.skip_nonfinite else None

    def select(new, old):  # a skipped micro-batch leaves the carry as it was
      if keep is None:
        return new
      return jax.tree.map(functools.partial(jnp.where, keep), new, old)

    def add(c, v):
      v = v.astype(c.dtype)
      return c + (v if keep is None else jnp.where(keep, v, jnp.zeros_like(v)))

    num = tuple(add(c, v) for c, v in zip(carry.num, out.nums, strict=True))
    den = tuple(None if c is None else add(c, v)
                for c, v in zip(carry.den, out.dens, strict=True))
    grads = tuple(_sharding.align(jax.tree.map(add, c, g), problem.params)
                  for c, g in zip(carry.grads, out.grads, strict=True))
    weight = None if weight_term is None else out.dens[weight_term]

    def aux_add(k, c, v):
      return None if c is None else select(k.update(c, jnp.asarray(v), weight, i), c)

    aux = jax.tree.map(aux_add, kinds, carry.aux, out.aux)
    state = select(out.state, carry.state)
    stats = carry.stats
    k_i = jnp.int32(1) if keep is None else keep.astype(jnp.int32)
    stats = stats._replace(kept=stats.kept + k_i, skipped=stats.skipped + (1 - k_i))
    if opts.with_info:
      stats = _sample_stats(opts, problem, out, stats, keep)
    ys = jax.tree.map(lambda k, v: v if k.per_micro_batch else None, kinds, out.aux)
    norms = carry.norms
    if norms is not None and out.norms is not None:  # kept or skipped by skip_nonfinite
      norms = lax.dynamic_update_index_in_dim(norms, out.norms.astype(norms.dtype), i, 1)
    return Carry(num, den, grads, aux, state, stats, norms), ys

  # overlap_grad_reduce: the last micro-batch that runs (N - 1, or k - 1 for a count k)
  # runs after the loop, so each of its gradients is final as soon as it is added.
  peel = opts.overlap_grad_reduce
  limit = None if active is None else active - 1 if peel else active

  def body(carry, i):
    if limit is None:
      return run(carry, i)
    zeros = jax.tree.map(_zeros_like_struct, per_mb)
    return lax.cond(i < limit, run, lambda c, _: (c, zeros), carry, i)

  if not peel:
    return (*lax.scan(body, carry0, jnp.arange(n, dtype=jnp.int32), unroll=opts.unroll),
            shapes, kinds)
  carry, stacked = carry0, None
  last = jnp.int32(n - 1) if active is None else active - 1
  if n > 1:
    # The loop counts its micro-batches and the last one's index is read from that count:
    # without the dependence the compiler may run the last forward pass before the loop and
    # keep its activations live through it.
    def counted(c, i):
      new, ys = body(c[0], i)
      return (new, i + 1), ys

    (carry, after), stacked = lax.scan(counted, (carry0, jnp.int32(0)),
                                       jnp.arange(n - 1, dtype=jnp.int32), unroll=opts.unroll)
    last = after if active is None else jnp.minimum(after, last)
  carry, ys = run(carry, last)
  if stacked is None:  # N = 1: no loop, the one micro-batch is the last
    return carry, jax.tree.map(lambda y: y[None], ys), shapes, kinds
  at = None if active is None else last
  return carry, jax.tree.map(lambda r, y, s: _insert_row(r, y, s, at), stacked, ys, per_mb), \
      shapes, kinds


def _insert_row(rows: jax.Array, row: jax.Array, like: Any, at: jax.Array | None) -> jax.Array:
  """The peeled micro-batch's per-micro-batch aux ``row`` put back among the loop's
  ``rows``: appended (the last of ``N``), or at ``at`` (the last of a count ``k``, the rows
  from ``k`` on staying zeros as the skipped micro-batches' rows do)."""
  if at is None:
    return jnp.concatenate([rows, row[None]])
  full = jnp.concatenate([rows, _zeros_like_struct(like)[None]])
  return lax.dynamic_update_index_in_dim(full, row, at, axis=0)


def aux_weight_term(opts: Options) -> int | None:
  """The weighted term whose denominators weigh aux means (only when there is one)."""
  weighted = [t for t, term in enumerate(opts.terms) if term.kind.weighs]
  return weighted[0] if len(weighted) == 1 else None


def _sample_stats(opts: Options, problem: Problem, out: Micro, stats: Stats, keep):
  """Adds one micro-batch gradient, normalised as its reduction says, as a sample."""
  rows = jnp.float32(problem.rows)
  valid = jnp.bool_(True) if keep is None else keep
  for g in problem.groups:  # a micro-batch without tokens is no sample
    d, t = g.divisor
    if d.own_denominator:
      valid = valid & (out.dens[t] > 0)
  # This micro-batch's own normalisation: its rows for sums, 1 for means, its denominators.
  sample = divide_groups(problem.groups, out.grads, None, out.dens, rows, jnp.float32)
  sq = _stats.sq_norm(sample)
  st = info_sizes(opts)
  size = rows if st is None else out.dens[st].astype(jnp.float32)
  size = jnp.where(valid, size, 1.0)
  v = valid.astype(jnp.float32)
  return stats._replace(
      sq=stats.sq + jnp.where(valid, sq, 0.0),
      samples=stats.samples + valid.astype(jnp.int32),
      size=stats.size + v * size,
      inv_size=stats.inv_size + v / size)


# --- Step 3: finalize ------------------------------------------------------------------------


def finalize(opts: Options, problem: Problem, carry: Carry, stacked: PyTree, shapes: Micro,
             kinds: PyTree, *, kept_static: int | None):
  """Divides what the scan summed and builds ``(value, extra, grads, info)``."""
  kept = carry.stats.kept
  if kept_static is not None:
    kept = jnp.asarray(kept_static, jnp.int32)

  values = []
  for t, (c, s) in enumerate(zip(carry.num, shapes.nums, strict=True)):
    d = divisor(divisor_key(t, opts.terms[t]), kept, carry.den)
    values.append((c if d is None else _reduce.safe_divide(c, d)).astype(s.dtype))
  if opts.skip_nonfinite:  # every micro-batch skipped: nothing to average
    values = [jnp.where(carry.stats.kept > 0, v, jnp.nan).astype(v.dtype) for v in values]
  if opts.single_term:
    value = values[0]
    terms_out = None
  else:
    value = functools.reduce(
        jnp.add, [v * opts.terms[t].weight for t, v in enumerate(values)])
    terms_out = jax.tree.unflatten(jax.tree.structure(opts.reduce), values)
    if opts.evaluating:  # evaluate returns each term, as fun returns them
      value = terms_out

  grads: PyTree = ()  # nothing differentiated (evaluate): no gradients
  if problem.groups:
    grads = divide_groups(problem.groups, carry.grads, kept, carry.den)
    grads = jax.tree.map(
        lambda a, s: a.astype(opts.grads_dtype if opts.grads_dtype is not None else s.dtype),
        grads, shapes.grads[0])
    grads = _sharding.align(grads, problem.params)

  wt = aux_weight_term(opts)
  aux_div = carry.den[wt] if wt is not None else kept
  aux = jax.tree.map(
      lambda k, c, st, s: k.finalize(c, st, s, aux_div),
      kinds, carry.aux, stacked, shapes.aux)

  info = None
  if opts.with_info:
    info = _make_info(opts, problem, carry, kept)
    if terms_out is not None:
      info = info._replace(terms=terms_out)

  if problem.state0:
    new_state = carry.state if opts.state_is_tuple else carry.state[0]
    extra = (new_state, aux) if opts.has_aux else new_state
  else:
    extra = aux
  return value, extra, grads, info


def _make_info(opts: Options, problem: Problem, carry: Carry, kept) -> _info.AccumInfo:
  st = carry.stats
  # G_B as a mean: sum terms divide by the rows kept, so that samples and batch share units.
  rows_total = jnp.float32(problem.rows) * kept.astype(jnp.float32)
  gb = divide_groups(problem.groups, carry.grads, kept, carry.den, rows_total, jnp.float32)
  samples = st.samples
  micro_sq = _reduce.safe_divide(st.sq, samples.astype(jnp.float32))
  b = _reduce.safe_divide(samples.astype(jnp.float32), st.inv_size)
  return _info.AccumInfo(
      num_micro_batches=st.kept + st.skipped,
      micro_batch_size=b,
      batch_size=st.size,
      micro_grad_sq_norm=micro_sq,
      batch_grad_sq_norm=_stats.sq_norm(gb),
      num_samples=samples,
      skipped=st.skipped,
      example_grad_norms=None if carry.norms is None else carry.norms.reshape(-1),
  )


def gather_norms(norms: jax.Array | None, axes: tuple) -> jax.Array | None:
  """Under ``data_axis``: every shard's ``(rows, N)`` norms in one ``(D * rows, N)`` array,
  the same on every shard (shard ``s`` holds the batch's ``s``-th block of rows)."""
  if norms is None:
    return None
  shard, shards = lax.axis_index(axes), lax.psum(1, axes)
  rows = norms.shape[0]
  full = jnp.zeros((rows * shards,) + norms.shape[1:], norms.dtype)
  return lax.psum(lax.dynamic_update_slice_in_dim(full, norms, shard * rows, 0), axes)


# The names of the three steps in the compiled program's op_name metadata and in profiles.
# A step that computes nothing leaves no op to carry its name: "reduce" runs only with a
# cross-device combine, and "finalize" under reduce="sum" only where it casts.
SCOPES = {"scan": "jaxaccum/micro_batches", "combine": "jaxaccum/reduce",
          "finalize": "jaxaccum/finalize"}


def call_scope(name: str) -> str:
  """The scope around a whole call of the public transform ``name`` (``"value_and_grad"``):
  the three steps' scopes sit inside it, with the split and the data-parallel placement."""
  return f"jaxaccum.{name}"


def accumulate(opts: Options, args: tuple, kwargs: dict, active: Any = None, *,
               n: int | None = None, shards: int = 1,
               combine: Callable[..., Any] | None = None, own: Sequence[Any] = ()):
  """scan -> reduce -> finalize. Returns ``(value, extra, grads, info)``.

  ``shards`` devices run the same accumulation on their own rows (the data-parallel mode,
  or ``pmap`` replicas); ``combine(carry, stacked, kinds)`` reduces the carry across them
  once after the loop and returns ``(carry, stacked)``. ``own`` are arrays that ``fun``
  closes over as parameters (the data-parallel driver's gathered FSDP parameters), never
  reported as unsplit batch arrays. Each step runs under its
  :func:`jax.named_scope` (:data:`SCOPES`), so its ops carry the name in the compiled
  program's ``op_name`` metadata and in profiler traces.
  """
  problem = prepare(opts, args, kwargs, n)
  if own:
    problem = problem._replace(own=problem.own + tuple(own))
  if active is not None:
    active = check_active(active, problem.n)
  with jax.named_scope(SCOPES["scan"]):
    carry, stacked, shapes, kinds = scan(opts, problem, active, shards)
  if combine is not None:
    with jax.named_scope(SCOPES["combine"]):
      carry, stacked = combine(carry, stacked, kinds)
  static = None if (opts.skip_nonfinite or active is not None) else problem.n * shards
  with jax.named_scope(SCOPES["finalize"]):
    return finalize(opts, problem, carry, stacked, shapes, kinds, kept_static=static)


def check_active(active: Any, n: int) -> jax.Array:
  """Validates ``active_micro_batches``; returns it as an int32 in ``1..n``.

  A concrete value (a Python or NumPy int, a concrete array) outside ``1..n`` raises a
  ``ValueError`` here, at trace time. A traced value cannot be checked without a host
  round trip, so it is clipped without a word: ``0`` (or less) runs one micro-batch and
  anything above ``n`` runs all ``n``. The step's ``AccumInfo.num_micro_batches`` says
  what ran, and :meth:`jaxaccum.AdaptiveBatch.update` and ``check`` use it to catch a
  ``k`` above ``n`` (see the adaptive-batch guide).
  """
  if isinstance(active, (bool, np.bool_)) or not (
      isinstance(active, (int, np.integer)) or hasattr(active, "dtype")):
    raise TypeError(
        f"active_micro_batches must be an int or an int32 scalar array, got {_describe(active)}.")
  dtype = getattr(active, "dtype", None)
  if dtype is not None and (np.shape(active) != () or not jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(
        f"active_micro_batches must be a scalar integer, got {_describe(active)}.")
  try:
    concrete = int(active)
  except (jax.errors.ConcretizationTypeError, TypeError):
    concrete = None
  if concrete is not None and not 1 <= concrete <= n:
    raise ValueError(
        f"active_micro_batches={concrete} is out of range: it counts the micro-batches to "
        f"run, from 1 to num_micro_batches={n}.")
  return jnp.clip(jnp.asarray(active, jnp.int32), 1, n)
