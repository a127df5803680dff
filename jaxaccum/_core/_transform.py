"""The accumulation run: scan -> reduce -> finalize.

The public transforms (:mod:`jaxaccum._api`), the data-parallel driver
(:mod:`jaxaccum._parallel._data_parallel`), ``pipeline`` and the adapters all run it. It
runs in three steps, each a map over the carry's entries (:data:`CARRY`: loss numerators and
denominators, gradient groups, aux, state, the ``with_info`` statistics, and the entries a
micro-batch rule brings, :meth:`MicroRule.carry`), each entry a record of ``init``,
``update``, ``combine`` and ``finalize`` in the manner of the aux reductions
(:class:`jaxaccum._core._reduce.Reduction`):

1. :func:`run_micro_batches`: one :func:`jax.lax.scan` over the micro-batches (scheduled by
   :func:`schedule`) adds each micro-batch's contribution to every entry of a
   :class:`Carry` and threads the mutable state;
2. ``reduce``: under ``data_axis``, one cross-device reduction of the carry after the loop
   (:func:`combine_carry`, called by :func:`jaxaccum._parallel._data_parallel.combine`); nothing
   otherwise;
3. :func:`finalize_carry`: divides by what the reductions say (micro-batches kept, total
   denominators) and builds :func:`jax.value_and_grad`'s output.

How one micro-batch contributes is a :class:`MicroRule`: forward only (``evaluate``), one
VJP per gradient group, or a wing's rule (per-example gradients,
:mod:`jaxaccum._per_example._rule`, which the core does not import). What ``fun`` returns is
checked in :mod:`jaxaccum._core._outputs`.

The loss is one or several *terms* (:class:`jaxaccum._core._reduce.Term`). Terms that share a
divisor share one gradient accumulator (a *group*, :func:`jaxaccum._core._reduce.make_groups`):
a single loss has one group, and so one backward pass per micro-batch, as
:func:`jax.value_and_grad`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._core import _info, _outputs, _reduce, _sharding, _split, _stats
from jaxaccum._core._options import Options, Roles
from jaxaccum._core._types import PyTree
from jaxaccum._core._validate import describe as _describe


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
  # A micro-batch rule's own quantities, by the name of its carry entry (MicroRule.carry).
  extra: dict = {}  # noqa: RUF012 (never mutated: a new dict each step)


def check_keys(opts: Options, argnum: int | str, tree: PyTree, size: int,
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


# --- The per-micro-batch computation --------------------------------------------------------


class Micro(NamedTuple):
  """One micro-batch's contribution."""

  nums: tuple
  dens: tuple
  state: tuple
  aux: PyTree
  grads: tuple  # per group
  # The rule's own quantities, by the name of its carry entry (see MicroRule.carry).
  extra: dict = {}  # noqa: RUF012 (never mutated)


class MicroCall(NamedTuple):
  """What a :class:`MicroRule` gets for one micro-batch: ``inner(kw, diff, rest)`` runs
  ``fun`` and returns ``(objectives, (nums, dens, new_state, aux))``, one objective per
  gradient group; ``diff`` are the differentiated arguments' values, ``rest`` the other
  role arguments' (at positions ``rest_pos``), ``kw`` the keyword batch, ``kw_keys`` the
  keyword keys folded for the micro-batch, ``axis`` each batch argument's batch axes."""

  opts: Options
  groups: tuple[_reduce.Group, ...]
  inner: Callable[[dict, Sequence[Any], Sequence[Any]], Any]
  diff: list
  rest: list
  rest_pos: tuple[int, ...]
  kw: dict
  kw_keys: dict
  roles: Roles
  axis: dict


class MicroRule(Protocol):
  """How one micro-batch contributes: forward only (:data:`FORWARD`, ``evaluate``), one
  VJP per gradient group (:data:`VJP`), or a wing's rule such as the per-example one
  (:class:`jaxaccum._per_example._rule.PerExampleRule`, held by ``Options.per_example``).
  """

  @property
  def differentiates(self) -> bool:
    """Whether it returns gradients (the groups' accumulators)."""
    ...

  @property
  def one_row(self) -> bool:
    """Whether ``fun`` sees one example at a time."""
    ...

  @property
  def reads(self) -> tuple[str, ...]:
    """Keyword batch arguments the rule reads and ``fun`` does not get."""
    ...

  def call(self, call: Callable[..., Any], kw_batch: dict, role_vals: tuple,
           held: list[int]) -> tuple:
    """Runs ``call(kw_batch, role_vals)``: fun and the check of its output, traced inside
    ``remat``'s checkpoint."""
    ...

  def contribute(self, m: MicroCall) -> Micro:
    """One micro-batch's contribution (``grads``: per group; ``extra``: one value per entry
    of :meth:`carry`)."""
    ...

  def carry(self) -> dict[str, CarryEntry]:
    """The rule's own carry entries (records like :data:`CARRY`'s), each fed by
    ``Micro.extra[name]``; its ``finalize`` returns :class:`jaxaccum.AccumInfo` fields (a
    dict) or ``None``."""
    ...


class _CoreRule(NamedTuple):
  differentiates: bool
  one_row: bool = False
  reads: tuple[str, ...] = ()

  def call(self, call: Callable[..., Any], kw_batch: dict, role_vals: tuple,
           held: list[int]) -> tuple:
    return call(kw_batch, role_vals)

  def carry(self) -> dict[str, CarryEntry]:
    return {}

  def contribute(self, m: MicroCall) -> Micro:
    kw = {**m.kw, **m.kw_keys}
    if not self.differentiates:  # forward only: no jax.vjp, no gradients
      _, (nums, dens, new_state, aux) = m.inner(kw, m.diff, m.rest)
      return Micro(nums, dens, new_state, aux, ())
    objectives, vjp, (nums, dens, new_state, aux) = jax.vjp(
        lambda *d: m.inner(kw, d, m.rest), *m.diff, has_aux=True)
    grads = []
    for k in range(len(m.groups)):
      cot = tuple(jnp.ones_like(o) if h == k else jnp.zeros_like(o)
                  for h, o in enumerate(objectives))
      grads.append(vjp(cot))
    return Micro(nums, dens, new_state, aux, tuple(grads))


FORWARD: MicroRule = _CoreRule(differentiates=False)
VJP: MicroRule = _CoreRule(differentiates=True)


def micro_rule(opts: Options) -> MicroRule:
  """The rule by which a micro-batch contributes under ``opts``."""
  if opts.per_example is not None:
    # The wing's rule that check_per_example made of the user's transform.
    return cast(MicroRule, opts.per_example)
  return FORWARD if opts.evaluating else VJP


class Problem(NamedTuple):
  """A call of the transformed function, split and ready to scan."""

  n: int  # micro-batches
  rows: int  # rows per micro-batch (per data shard)
  params: tuple
  state0: tuple
  micro: Callable[[jax.Array, tuple, Any], Micro]  # (i, state, count) -> Micro
  groups: tuple[_reduce.Group, ...]
  # Array leaves of the call by role, for the check of whole-batch arrays: (label, leaf)
  # of the arguments passed whole, and the leaves of parameters, state and keys.
  whole: tuple = ()
  own: tuple = ()
  batch: tuple[int, ...] = ()
  rule: MicroRule = VJP


def prepare(opts: Options, args: tuple, kwargs: dict, n: int | None = None) -> Problem:
  """Resolves the roles, splits the batch and builds the per-micro-batch function."""
  roles = opts.roles.resolve(len(args), kwargs)
  rule = micro_rule(opts)
  batches: dict[Any, PyTree] = {opts.label(j): args[j] for j in roles.batch}
  batches.update({f"keyword argument {k!r}": kwargs[k] for k in roles.batch_names})
  hint = (" The batch is argument 1 by default (batch_argnums=1) when it is passed: pass "
          "batch_argnums=() if only batch_argnames name the batch." if opts.roles.batch_optional
          else "")
  axes = _split.batch_axes(batches, opts.split.batch_axis)
  size = _split.batch_size(batches, hint, axes)
  if n is None:
    n = _split.resolve_count(size, opts.split.count, opts.split.size,
                             of=_split.size_note(batches, axes))
  _check_roles(opts, roles, args, kwargs, size)
  _sharding.check_split_sharding(batches, n, axes)
  axis = dict(zip((*roles.batch, *roles.batch_names), axes.values(), strict=True))
  split = {j: _split.split(args[j], n, axis[j]) for j in roles.batch}
  split_kw = {k: _split.split(kwargs[k], n, axis[k]) for k in roles.batch_names}
  groups = (_reduce.make_groups(opts.terms, merge=not (opts.skip_nonfinite or opts.with_info))
            if rule.differentiates else ())

  # The differentiated function takes only the arguments that have a role and closes over
  # the others, so those may be anything (a static flag, a string) even under remat.
  role_pos = tuple(dict.fromkeys(roles.diff + roles.batch + roles.rng + roles.state))
  nd = len(roles.diff)
  fun_kwargs = {k: v for k, v in kwargs.items() if k not in rule.reads}
  held = [k for k, j in enumerate(role_pos) if j in roles.state]

  def call(kw_batch, role_vals):
    call_args = list(args)
    for j, v in zip(role_pos, role_vals, strict=True):
      call_args[j] = v
    return _outputs.unpack(opts, opts.fun(*call_args, **{**fun_kwargs, **kw_batch}))

  def inner(count, kw_batch, *role_vals):
    nums, dens, new_state, aux = rule.call(call, kw_batch, role_vals, held)
    objectives = []
    for g in groups:
      total = 0.0
      for t, scaled in zip(g.terms, g.scaled, strict=True):
        w = opts.terms[t].weight
        v = nums[t] * w if w != 1.0 else nums[t]
        total = total + (v / count.astype(v.dtype) if scaled else v)
      objectives.append(total)
    return tuple(objectives), (nums, dens, new_state, aux)

  if opts.numerics.remat:
    # prevent_cse=True: the recomputation sits in the same scan iteration as the forward
    # pass it repeats, and without the barrier XLA merges the two, saving nothing.
    inner = jax.checkpoint(inner, policy=opts.numerics.remat_policy, prevent_cse=True)

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
    out = rule.contribute(MicroCall(
        opts, groups, lambda kw1, d, r: inner(count, kw1, *d, *r), vals[:nd], vals[nd:],
        tuple(role_pos[nd:]), kw, kw_keys, roles, axis))
    if roles.state:
      state = _outputs.check_state(opts, roles.state, state, out.state)
    return out._replace(state=state)

  whole, own = _by_role(opts, rule, roles, args, kwargs)
  own += jax.tree.leaves((split, split_kw))  # the split batch: (B, 1, ...) when N = 1
  return Problem(n, size // n, tuple(args[j] for j in roles.diff),
                 tuple(args[j] for j in roles.state), micro, groups, tuple(whole), tuple(own),
                 roles.batch, rule)


def _check_roles(opts: Options, roles: Roles, args: tuple, kwargs: dict, size: int) -> None:
  """Checks the key and differentiated arguments of one call (before the split)."""
  for j in roles.rng:
    check_keys(opts, j, args[j], size, roles.batch)
  for k in roles.rng_names:
    check_keys(opts, k, kwargs[k], size, roles.batch, roles.batch_names)
  for j in roles.diff:
    _check_inexact(opts, j, args[j])


def _by_role(opts: Options, rule: MicroRule, roles: Roles, args: tuple,
             kwargs: dict) -> tuple[list, list]:
  """The call's array leaves for :func:`warn_whole_batch`: ``(whole, own)``, the labelled
  leaves of arguments passed whole, and the leaves of parameters, state and keys."""
  whole, own = [], []
  for key, tree in [*enumerate(args), *kwargs.items()]:
    if key in roles.batch or key in roles.batch_names:
      continue
    # Under evaluate nothing is differentiated: positional arguments passed whole are the
    # parameters, which never warn.
    if (key in roles.diff or key in roles.state or key in roles.rng
        or key in roles.rng_names or (not rule.differentiates and isinstance(key, int))):
      own += jax.tree.leaves(tree)
      continue
    label = opts.label(key) if isinstance(key, int) else f"keyword argument {key!r}"
    whole += [(label + jax.tree_util.keystr(p), x)
              for p, x in jax.tree_util.tree_leaves_with_path(tree)]
  return whole, own


def warn_whole_batch(opts: Options, problem: Problem, consts: Sequence[Any],
                     shards: int = 1) -> None:
  """Warns once if ``fun`` gets an array with the batch's rows that is not split.

  ``consts`` are the values that one traced micro-batch call closes over: the arguments
  passed whole and the arrays ``fun`` closes over (the split batch has ``B / N`` rows).
  Parameters, state and keys never warn, whatever their shape. Only one-row micro-batches
  are checked: with ``b > 1`` rows, an unsplit array of ``B`` rows that meets the micro-batch
  elementwise is a shape error, not a silent broadcast, while arrays that merely have ``B``
  rows (a ``(T, T)`` causal mask with ``T == B``) are common and correct. Under
  ``per_example=`` every call sees one row, so it is always checked.
  """
  per_example = problem.rule.one_row  # fun sees one row at a time
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


# --- The carry: one record per entry ----------------------------------------------------------


class Scan(NamedTuple):
  """What the carry entries read: the options, the problem, one micro-batch's traced
  shapes and the aux reductions. ``keep_like``: under ``skip_nonfinite``,
  ``where(keep, new, carry)`` varies wherever ``keep`` does (a shard's own verdict), even
  for an aux leaf that does not vary across shards, so the carry must vary as these do."""

  opts: Options
  problem: Problem
  shapes: Micro
  kinds: PyTree
  keep_like: list

  def acc_dtype(self, dtype: Any) -> Any:
    return _reduce.accumulator_dtype_for(dtype, self.opts.numerics.accumulator_dtype)


class Update(NamedTuple):
  """One micro-batch as the carry entries' ``update`` sees it: its contribution ``out``,
  whether it is added (``keep``, under ``skip_nonfinite``; else ``None``) and its index."""

  out: Micro
  keep: jax.Array | None
  i: jax.Array

  def add(self, c: jax.Array, v: jax.Array) -> jax.Array:
    v = v.astype(c.dtype)
    return c + (v if self.keep is None else jnp.where(self.keep, v, jnp.zeros_like(v)))

  def select(self, new: Any, old: Any) -> Any:  # a skipped micro-batch leaves it as it was
    if self.keep is None:
      return new
    return jax.tree.map(functools.partial(jnp.where, self.keep), new, old)


class Across(NamedTuple):
  """How the carry is reduced over the data axes ``axes`` after the loop (see
  :func:`jaxaccum._parallel._data_parallel.combine`): ``reduce_grads`` reduces the leaves of
  one gradient accumulator (a list, in their flattened order), as the driver places them."""

  axes: tuple
  reduce_grads: Callable[[list], list]
  reduce_is_sum: bool
  kinds: PyTree


class CarryEntry(NamedTuple):
  """One field of the :class:`Carry`, in the manner of the aux
  :class:`jaxaccum._core._reduce.Reduction`: its value before the loop (``init``), what one
  micro-batch adds (``update``), its reduction across data shards (``combine``) and what
  it gives the output after them (``finalize``; ``None`` for an entry that others read).
  """

  init: Callable[[Scan], Any]
  update: Callable[[Any, Update, Scan], Any]
  combine: Callable[[Any, Across], Any]
  finalize: Callable[[Any, Final], Any]


def _zero(s: Scan, x: Any, dtype: Any) -> jax.Array:
  return _sharding.conform(jnp.zeros((), dtype), x)


def _den_dtype(s: Scan, x: Any) -> Any:
  return (jnp.promote_types(x.dtype, jnp.int32) if jnp.issubdtype(x.dtype, jnp.integer)
          else s.acc_dtype(x.dtype))


def _grads0(s: Scan) -> tuple:
  return tuple(_sharding.align(jax.tree.map(
      lambda g: _sharding.conform(jnp.zeros(g.shape, s.acc_dtype(g.dtype)), g), gs),
      s.problem.params) for gs in s.shapes.grads)


def _combine_grads(c: tuple, a: Across) -> tuple:
  out = []
  for acc in c:
    flat, treedef = jax.tree.flatten(acc)
    out.append(jax.tree.unflatten(treedef, a.reduce_grads(flat)))
  return tuple(out)


def _aux0(s: Scan) -> PyTree:
  def leaf(red, x):
    # Per-micro-batch reductions (stack, concat) keep no carry: the scan emits the leaf.
    init = None if red.per_micro_batch else red.init(x, s.opts.numerics.accumulator_dtype)
    if init is None:
      return None
    # A user reduction's carry may be a pytree of any shapes: it varies as the leaf does.
    return jax.tree.map(lambda v: vary_as(
        _sharding.conform(v, x) if jnp.shape(v) == x.shape else jnp.asarray(v), x,
        *s.keep_like), init)
  return jax.tree.map(leaf, s.kinds, s.shapes.aux)


def _aux_update(c: PyTree, u: Update, s: Scan) -> PyTree:
  wt = _reduce.aux_weight_term(s.opts.terms)
  weight = None if wt is None else u.out.dens[wt]
  return jax.tree.map(lambda k, ci, v: None if ci is None else u.select(
      k.update(ci, jnp.asarray(v), weight, u.i), ci), s.kinds, c, u.out.aux)


def _combine_aux(c: PyTree, a: Across) -> PyTree:
  return jax.tree.map(lambda k, ci: ci if ci is None else k.combine(ci, a.axes, a.reduce_is_sum),
                      a.kinds, c)


def _stats0(s: Scan) -> Stats:
  zero_f, zero_i = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
  return jax.tree.map(lambda z: _sharding.conform(z, s.shapes.nums[0]),
                      Stats(zero_i, zero_i, zero_f, zero_i, zero_f, zero_f))


def _stats_update(c: Stats, u: Update, s: Scan) -> Stats:
  k_i = jnp.int32(1) if u.keep is None else u.keep.astype(jnp.int32)
  c = c._replace(kept=c.kept + k_i, skipped=c.skipped + (1 - k_i))
  return _sample_stats(s.opts, s.problem, u.out, c, u.keep) if s.opts.with_info else c


class Final(NamedTuple):
  """What the carry entries' ``finalize`` reads: the micro-batches kept (``kept``: what a
  mean divides by), the whole carry (for the denominators) and the per-micro-batch rows."""

  opts: Options
  problem: Problem
  shapes: Micro
  kinds: PyTree
  kept: jax.Array
  carry: Carry
  stacked: PyTree


def _final_values(c: tuple, f: Final) -> tuple[Any, Any]:
  """``(value, terms)``: each term divided as its kind says, and the weighted total (the
  terms as fun returns them under evaluate); ``terms`` is ``None`` for a single loss."""
  opts = f.opts
  values = []
  for t, (ci, x) in enumerate(zip(c, f.shapes.nums, strict=True)):
    d = _reduce.divisor(_reduce.divisor_key(t, opts.terms[t]), f.kept, f.carry.den)
    values.append((ci if d is None else _reduce.safe_divide(ci, d)).astype(x.dtype))
  if opts.skip_nonfinite:  # every micro-batch skipped: nothing to average
    values = [jnp.where(f.carry.stats.kept > 0, v, jnp.nan).astype(v.dtype) for v in values]
  if opts.single_term:
    return values[0], None
  value = functools.reduce(jnp.add, [v * opts.terms[t].weight for t, v in enumerate(values)])
  terms = jax.tree.unflatten(jax.tree.structure(opts.reduce), values)
  # evaluate returns each term, as fun returns them
  return (value if f.problem.rule.differentiates else terms), terms


def _final_grads(c: tuple, f: Final) -> PyTree:
  if not f.problem.groups:  # nothing differentiated (evaluate): no gradients
    return ()
  grads = _reduce.divide_groups(f.problem.groups, c, f.kept, f.carry.den)
  dtype = f.opts.numerics.grads_dtype
  grads = jax.tree.map(lambda a, x: a.astype(dtype if dtype is not None else x.dtype),
                       grads, f.shapes.grads[0])
  return _sharding.align(grads, f.problem.params)


def _final_aux(c: PyTree, f: Final) -> PyTree:
  wt = _reduce.aux_weight_term(f.opts.terms)
  div = f.carry.den[wt] if wt is not None else f.kept
  return jax.tree.map(lambda k, ci, st, x: k.finalize(ci, st, x, div),
                      f.kinds, c, f.stacked, f.shapes.aux)


def _final_info(st: Stats, f: Final) -> _info.AccumInfo | None:
  """:class:`jaxaccum.AccumInfo` from the statistics and the gradients."""
  if not f.opts.with_info:
    return None
  problem, carry, kept = f.problem, f.carry, f.kept
  # G_B as a mean: sum terms divide by the rows kept, so that samples and batch share units.
  rows_total = jnp.float32(problem.rows) * kept.astype(jnp.float32)
  gb = _reduce.divide_groups(problem.groups, carry.grads, kept, carry.den, rows_total,
                             jnp.float32)
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
  )


# The carry's entries, in the order of the Carry's fields.
CARRY: dict[str, CarryEntry] = {
    "num": CarryEntry(  # per term: the summed value (numerator)
        lambda s: tuple(_zero(s, x, s.acc_dtype(x.dtype)) for x in s.shapes.nums),
        lambda c, u, s: tuple(u.add(ci, v) for ci, v in zip(c, u.out.nums, strict=True)),
        lambda c, a: tuple(lax.psum(ci, a.axes) for ci in c),
        _final_values),
    "den": CarryEntry(  # per term: the summed denominator (weighted terms), else None
        lambda s: tuple(None if x is None else _zero(s, x, _den_dtype(s, x))
                        for x in s.shapes.dens),
        lambda c, u, s: tuple(None if ci is None else u.add(ci, v)
                              for ci, v in zip(c, u.out.dens, strict=True)),
        lambda c, a: tuple(None if ci is None else lax.psum(ci, a.axes) for ci in c),
        lambda c, f: None),  # read by the others' finalize
    "grads": CarryEntry(  # per group: the summed gradients (reduced as the driver says)
        _grads0,
        lambda c, u, s: tuple(_sharding.align(jax.tree.map(u.add, ci, g), s.problem.params)
                              for ci, g in zip(c, u.out.grads, strict=True)),
        _combine_grads, _final_grads),
    # each leaf as its reduction says
    "aux": CarryEntry(_aux0, _aux_update, _combine_aux, _final_aux),
    "state": CarryEntry(  # threaded; the last kept micro-batch's
        lambda s: jax.tree.map(_sharding.conform, s.problem.state0, s.shapes.state),
        lambda c, u, s: u.select(u.out.state, c),
        lambda c, a: jax.tree.map(lambda x: _reduce.combine_state(x, a.axes), c),
        lambda c, f: c if f.opts.roles.state_is_tuple or not c else c[0]),
    "stats": CarryEntry(_stats0, _stats_update, lambda c, a: lax.psum(c, a.axes), _final_info),
}


def combine_carry(carry: Carry, stacked: PyTree, a: Across, rule: MicroRule
                  ) -> tuple[Carry, PyTree]:
  """Step 2 (under ``data_axis``): each carry entry (the core's and ``rule``'s), and the
  per-micro-batch aux rows, reduced across the data shards as its record says."""
  _reduce.check_combinable(a.kinds)
  extra = {k: e.combine(carry.extra[k], a) for k, e in rule.carry().items()}
  carry = Carry(**{k: e.combine(getattr(carry, k), a) for k, e in CARRY.items()}, extra=extra)
  return carry, _combine_aux(stacked, a)


# --- Step 1: the loop over the micro-batches --------------------------------------------------


def _zeros_like_struct(s: Any) -> jax.Array:
  if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
    impl = s.dtype._impl  # a key dtype's PRNG implementation (key_shape, wrap_key_data's impl)
    data = jnp.zeros(s.shape + tuple(impl.key_shape), jnp.uint32)
    return _sharding.conform(jax.random.wrap_key_data(data, impl=impl), s)
  return _sharding.conform(jnp.zeros(s.shape, s.dtype), s)


def vary_as(x: jax.Array, *likes: Any) -> jax.Array:
  """``x``, varying over every manual axis that ``x`` or any of ``likes`` varies over."""
  want = frozenset().union(*(_sharding.varying(like) for like in likes))
  return _sharding.vary(x, tuple(sorted(want, key=str)))


def info_sizes(opts: Options):
  """Which term's denominator measures a sample's size (None: rows)."""
  return 0 if opts.single_term and opts.terms[0].kind.weighs else None


def run_micro_batches(opts: Options, problem: Problem, active: jax.Array | None,
                      shards: int = 1, *, peel: bool = False):
  """Step 1: one ``lax.scan`` over the micro-batches, each adding to every entry of the
  carry (:data:`CARRY`). Returns ``(carry, stacked, shapes, kinds)``.

  ``shards`` is the number of data shards running the same scan (under ``data_axis``):
  mean terms folded into a sum group divide by the micro-batches run on all of them.
  ``peel``: the last micro-batch runs after the loop (:func:`schedule`).
  """
  count = _reduce.count_across(
      jnp.asarray(problem.n if active is None else active, jnp.int32), shards)
  traced, shapes = jax.make_jaxpr(problem.micro, return_shape=True)(
      jnp.int32(0), problem.state0, count)
  warn_whole_batch(opts, problem, traced.consts, shards)
  kinds = _reduce.resolve_aux_reduce(opts.aux_reduce, shapes.aux, problem.rows,
                                     _split.common_axis(opts.split.batch_axis))
  keep_like = (jax.tree.leaves((shapes.nums, shapes.dens, shapes.grads))
               if opts.skip_nonfinite else [])
  s = Scan(opts, problem, shapes, kinds, keep_like)
  entries = problem.rule.carry()
  carry0 = Carry(**{k: e.init(s) for k, e in CARRY.items()},
                 extra={k: e.init(s) for k, e in entries.items()})

  def run(carry: Carry, i):
    out = problem.micro(i, carry.state, count)
    finite = (out.nums, [d for d in out.dens if d is not None], out.grads)
    u = Update(out, _stats.all_finite(finite) if opts.skip_nonfinite else None, i)
    new = Carry(**{k: e.update(getattr(carry, k), u, s) for k, e in CARRY.items()},
                extra={k: e.update(carry.extra[k], u, s) for k, e in entries.items()})
    return new, jax.tree.map(lambda k, v: v if k.per_micro_batch else None, kinds, out.aux)

  per_mb = jax.tree.map(lambda k, x: x if k.per_micro_batch else None, kinds, shapes.aux)
  carry, stacked = schedule(run, carry0, problem.n, active, per_mb, peel=peel,
                            unroll=opts.numerics.unroll)
  return carry, stacked, shapes, kinds


def schedule(run: Callable[[Any, jax.Array], tuple], carry0: Any, n: int,
             active: jax.Array | None, per_mb: PyTree, *, peel: bool,
             unroll: int | bool) -> tuple[Any, PyTree]:
  """Runs ``run(carry, i) -> (carry, row)`` for the micro-batches ``i`` in order; returns
  the last carry and the stacked rows (``per_mb``: their shapes, ``None`` for none).

  A traced ``active`` count runs the first ``active`` of ``n`` (the others under a
  ``lax.cond`` that leaves the carry and gives zero rows). ``peel``: the last micro-batch
  that runs (``n - 1``, or ``active - 1``) runs after the loop, so each of its gradients
  is final as soon as it is added.
  """
  limit = None if active is None else active - 1 if peel else active

  def body(carry, i):
    if limit is None:
      return run(carry, i)
    zeros = jax.tree.map(_zeros_like_struct, per_mb)
    return lax.cond(i < limit, run, lambda c, _: (c, zeros), carry, i)

  if not peel:
    return lax.scan(body, carry0, jnp.arange(n, dtype=jnp.int32), unroll=unroll)
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
                                       jnp.arange(n - 1, dtype=jnp.int32), unroll=unroll)
    last = after if active is None else jnp.minimum(after, last)
  carry, ys = run(carry, last)
  if stacked is None:  # N = 1: no loop, the one micro-batch is the last
    return carry, jax.tree.map(lambda y: y[None], ys)
  at = None if active is None else last
  return carry, jax.tree.map(lambda r, y, x: _insert_row(r, y, x, at), stacked, ys, per_mb)


def _insert_row(rows: jax.Array, row: jax.Array, like: Any, at: jax.Array | None) -> jax.Array:
  """The peeled micro-batch's per-micro-batch aux ``row`` put back among the loop's
  ``rows``: appended (the last of ``N``), or at ``at`` (the last of a count ``k``, the rows
  from ``k`` on staying zeros as the skipped micro-batches' rows do)."""
  if at is None:
    return jnp.concatenate([rows, row[None]])
  full = jnp.concatenate([rows, _zeros_like_struct(like)[None]])
  return lax.dynamic_update_index_in_dim(full, row, at, axis=0)


def _sample_stats(opts: Options, problem: Problem, out: Micro, stats: Stats, keep):
  """Adds one micro-batch gradient, normalised as its reduction says, as a sample."""
  rows = jnp.float32(problem.rows)
  valid = jnp.bool_(True) if keep is None else keep
  for g in problem.groups:  # a micro-batch without tokens is no sample
    d, t = g.divisor
    if d.own_denominator:
      valid = valid & (out.dens[t] > 0)
  # This micro-batch's own normalisation: its rows for sums, 1 for means, its denominators.
  sample = _reduce.divide_groups(problem.groups, out.grads, None, out.dens, rows, jnp.float32)
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


def finalize_carry(opts: Options, problem: Problem, carry: Carry, stacked: PyTree,
                   shapes: Micro, kinds: PyTree, *, kept_static: int | None):
  """Step 3: each carry entry finalized as its record says (divided by what the
  reductions say: micro-batches kept, total denominators); returns ``(value, extra,
  grads, info)``, :func:`jax.value_and_grad`'s output with aux, state and the info."""
  kept = carry.stats.kept if kept_static is None else jnp.asarray(kept_static, jnp.int32)
  f = Final(opts, problem, shapes, kinds, kept, carry, stacked)
  out = {k: e.finalize(getattr(carry, k), f) for k, e in CARRY.items()}
  (value, terms), info = out["num"], out["stats"]
  if info is not None and terms is not None:
    info = info._replace(terms=terms)
  for k, e in problem.rule.carry().items():  # the rule's own entries fill info fields
    fields = e.finalize(carry.extra[k], f)
    if info is not None and fields:
      info = info._replace(**fields)
  extra = out["aux"]
  if problem.state0:
    extra = (out["state"], extra) if opts.has_aux else out["state"]
  return value, extra, out["grads"], info


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
               combine: Callable[..., Any] | None = None, own: Sequence[Any] = (),
               each_grads: Callable[[tuple], tuple] | None = None, peel: bool = False):
  """scan -> reduce -> finalize. Returns ``(value, extra, grads, info)``.

  ``shards`` devices run the same accumulation on their own rows (the data-parallel mode,
  or ``pmap`` replicas); ``combine(carry, stacked, kinds)`` reduces the carry across them
  once after the loop and returns ``(carry, stacked)``. ``own`` are arrays that ``fun``
  closes over as parameters (a driver's gathered parameters), never reported as unsplit
  batch arrays. ``each_grads(grads)``, if given, maps each micro-batch's gradients (per
  group) before they are added to the carry. ``peel``: the last micro-batch runs after the
  loop (:func:`schedule`). Each step runs under its :func:`jax.named_scope`
  (:data:`SCOPES`), so its ops carry the name in the compiled program's ``op_name``
  metadata and in profiler traces.
  """
  problem = prepare(opts, args, kwargs, n)
  if own:
    problem = problem._replace(own=problem.own + tuple(own))
  if each_grads is not None:
    micro = problem.micro

    def mapped(i, state, count):
      out = micro(i, state, count)
      return out._replace(grads=each_grads(out.grads))

    problem = problem._replace(micro=mapped)
  if active is not None:
    active = check_active(active, problem.n)
  with jax.named_scope(SCOPES["scan"]):
    carry, stacked, shapes, kinds = run_micro_batches(opts, problem, active, shards, peel=peel)
  if combine is not None:
    with jax.named_scope(SCOPES["combine"]):
      carry, stacked = combine(carry, stacked, kinds)
  static = (None if (opts.skip_nonfinite or active is not None)
            else _reduce.count_across(problem.n, shards))
  with jax.named_scope(SCOPES["finalize"]):
    return finalize_carry(opts, problem, carry, stacked, shapes, kinds, kept_static=static)


def check_active(active: Any, n: int) -> jax.Array:
  """Validates ``active_micro_batches``; returns it as an int32 in ``1..n``.

  A concrete value (a Python or NumPy int, a concrete array) outside ``1..n`` raises a
  ``ValueError`` here, at trace time. A traced value cannot be checked without a host
  round trip, so it is clamped to ``1..n`` without a word: ``0`` (or less) runs one micro-batch and
  anything above ``n`` runs all ``n``. The step's ``AccumInfo.num_micro_batches`` says
  what ran, and :meth:`jaxaccum.contrib.AdaptiveBatch.update` and ``check`` use it to catch a
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
  return jnp.minimum(jnp.maximum(jnp.asarray(active, jnp.int32), 1), n)
