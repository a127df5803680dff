"""The data-parallel mode (``data_axis=...``): the core's accumulation per data shard.

The whole accumulation runs inside :func:`jax.shard_map`, manual over the data axes (mesh
axes not named stay under the compiler's control). Each device scans over its own rows with
its parameters marked device-varying, so the backward pass of a micro-batch yields a local,
unreduced gradient and no cross-device reduction is emitted inside the loop. After the loop
the core's carry (loss, gradients, denominators, aux, state, statistics) is reduced over the
data axes by :func:`combine`, once: the number of all-reduces per step does not depend on
the number of micro-batches. A parameter sharded over some of the data axes (FSDP, read
from its ``Explicit`` sharding type) is all-gathered, by default once before the loop
(``param_gather="step"``), and its gradient reduce-scattered once per micro-batch into an
accumulator of the shard's size (``grad_scatter="micro_batch"``); only the remaining data
axes are reduced after the loop. The other placements: :func:`_placed_gathers`. Under a
per-example transform (DP-SGD's clip) each example's gradient is taken with respect to the
gathered parameter, in every placement, and the reduce-scatter follows the sum over the
examples.

What each replica does (parameters and state marked varying, PRNG keys checked and folded
with the replica's index, the core's run and :func:`combine`) is :func:`on_replicas`, the one
replica driver: :func:`jaxaccum.local_value_and_grad` runs it with no combine, and Linen's
``make_train_step(axis_name=...)`` inside the user's ``pmap`` or ``shard_map``.

What the mode computes (the rows ``fun`` sees, how the loss, aux, state and PRNG keys
combine over the shards) is described in ``docs/devices.md``, "What ``data_axis``
computes"; each aux reduction's rule is its ``combine`` in :mod:`jaxaccum._core._reduce`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum._core import _reduce, _sharding, _split, _transform
from jaxaccum._core._options import Options, Roles
from jaxaccum._core._types import AxisName, PyTree
from jaxaccum._parallel import _axes
from jaxaccum._parallel._axes import DataParallel


def data_parallel(opts: Options, args: tuple, kwargs: dict, active: Any):
  """Runs the core's accumulation per data shard inside ``shard_map``; one reduction after.

  Batch arguments (positional and keyword) are mapped over ``data_axis`` along their batch
  axes. Other array arguments are mapped with their own sharding over the data axes, read
  from their type (with ``Auto`` axes every one is treated as replicated); those sharded
  over a data axis (FSDP / ZeRO-3) are all-gathered, a parameter's gradient reduce-scattered
  (:func:`_placed_gathers`). Arrays that ``fun`` closes over are replicated when typed
  with ``Auto`` axes; ``shard_map`` cannot close over arrays typed with ``Explicit`` axes,
  so those raise an error that says to pass them as arguments.

  Returns:
    ``(value, extra, grads, info)`` as the core's ``finalize`` returns them, reduced over
    the data axes.
  """
  roles = opts.roles.resolve(len(args), kwargs)
  batches: dict[Any, PyTree] = {opts.label(j): args[j] for j in roles.batch}
  batches.update({f"keyword argument {k!r}": kwargs[k] for k in roles.batch_names})
  leaf_axes = _split.batch_axes(batches, opts.split.batch_axis)
  assert opts.parallel is not None
  if opts.parallel.axis == _axes.AUTO:
    opts = resolve_auto(opts, batches, leaf_axes)
  dp = cast(DataParallel, opts.parallel)
  axes = dp.axis
  assert isinstance(axes, tuple)
  mesh = _axes.resolve_mesh(dp.mesh, axes)
  shards = math.prod(mesh.shape[a] for a in axes)
  n = _split.resolve_count(_split.batch_size(batches, axes=leaf_axes), opts.split.count,
                           opts.split.size,
                           shards=shards, where=_sharding.axes_str(axes, mesh),
                           of=_split.size_note(batches, leaf_axes))
  batch_axes = dict(zip((*roles.batch, *roles.batch_names), leaf_axes.values(), strict=True))
  placed = _place(opts, roles, mesh, args, kwargs, batch_axes)
  grad_axes, grad_specs = _gradient_layout(opts, roles, placed)
  scatters, micro_scatters = _check_placement(opts, roles, placed)
  # A traced count enters as a replicated input (None: no leaves): shard_map cannot close
  # over a tracer typed with Explicit mesh axes.
  act = None if active is None else _transform.check_active(active, n)
  arrays = (*placed.arrays, act)
  in_specs = (*placed.in_specs, PartitionSpec())
  # Each shard runs the core on its rows, the last micro-batch after the loop under
  # overlap_grad_reduce.
  local_opts = dataclasses.replace(opts, split=dataclasses.replace(opts.split, count=n,
                                                                   size=None))
  meta: dict[str, Any] = {}

  def local(*local_arrays):
    *leaves, local_act = local_arrays
    largs, lkwargs = placed.unflatten(leaves, len(args))
    out = on_replicas(local_opts, roles, largs, lkwargs, local_act, axes=axes, n=n,
                      grad_axes=grad_axes, grad_scatters=scatters,
                      micro_scatters=micro_scatters, peel=dp.overlap_grad_reduce,
                      place=functools.partial(_placed_gathers, opts, roles, placed, mesh))
    # Concatenated aux rows stay on their shard: the output spec gathers them in order.
    kept, rows, meta["unsplit"] = _split_rows(opts, out.extra, out.kinds)
    return out.value, kept, rows, out.grads, out.info

  out_specs = (PartitionSpec(), PartitionSpec(), PartitionSpec(axes), tuple(grad_specs),
               PartitionSpec())
  # Under jit so that a call outside jit runs one program instead of shard_map's
  # op-by-op interpretation (seconds for every call).
  mapped = jax.jit(map_replicas(local, mesh=mesh, axes=axes, in_specs=in_specs,
                                out_specs=out_specs))
  try:
    value, kept, rows, grads, info = mapped(*arrays)
  except NotImplementedError as e:
    if "Closing over inputs to shard_map" not in str(e):
      raise
    got = str(e).split("Got input with shape")[-1].strip()
    raise ValueError(
        f"fun closes over an array typed with Explicit mesh axes ({got}): an array placed "
        "on the mesh, or an argument of the enclosing jax.jit. Under data_axis fun runs "
        "inside jax.shard_map, which cannot close over such arrays. Pass it to the "
        "accumulated function as an argument instead: a non-batch positional or keyword "
        "argument is replicated over the data axes (e.g. def loss(params, batch, *, table) "
        "called as step(params, batch, table=table)); or build it inside fun.") from None
  extra = meta["unsplit"](kept, rows)
  # Auto axes: the gradients leave the shard_map replicated over the data axes; tie
  # them to their parameters' shardings (a local slice if those are sharded).
  grads = _sharding.align(grads, tuple(args[j] for j in roles.diff))
  return value, extra, grads, info


class Replica(NamedTuple):
  """One replica's result from :func:`on_replicas`: the core's ``finalize`` output, combined
  over the replicas, and the aux reductions' kinds (``None`` if no combine ran)."""

  value: Any
  extra: Any
  grads: tuple
  info: Any
  kinds: PyTree


def on_replicas(opts: Options, roles: Roles, args: Sequence[Any], kwargs: dict,
                active: Any = None, *, axes: tuple[AxisName, ...], n: int | None = None,
                grad_axes: tuple | None = None, grad_scatters: tuple | None = None,
                micro_scatters: tuple | None = None, peel: bool = False,
                place: Callable[[list, dict], tuple[Callable[..., Any], list]] | None = None,
                run: Callable[[tuple, dict], Any] | None = None) -> Any:
  """One replica's run, inside :func:`jax.shard_map` or :func:`jax.pmap` over ``axes``.

  The one rule of every replica driver: ``data_axis`` (:func:`data_parallel`),
  :func:`jaxaccum.local_value_and_grad` and Linen's ``make_train_step(axis_name=...)``.

  1. The differentiated and the state arguments are marked varying over ``axes``, so that
     the backward pass of a micro-batch gives this replica's own gradient, not its sum over
     the replicas.
  2. ``place(args, kwargs)``, if given (``data_axis``'s FSDP all-gathers,
     :func:`_placed_gathers`), updates the argument lists in place and returns the ``fun``
     to run and the arrays it closes over as parameters; the differentiated arguments are
     then marked varying again.
  3. Each PRNG key argument (``rng_argnums``, ``rng_argnames``), checked to hold keys, reaches
     replica ``d`` as ``jax.random.fold_in(key, d)`` (:func:`fold_shard`), so that the
     replicas draw different numbers; the core then folds in the micro-batch's index.
  4. The core's accumulation runs on the replica's rows and :func:`combine` reduces its
     carry over ``axes`` once, after the loop. With ``run``, ``run(args, kwargs)`` runs
     instead and its result, the replica's own piece, is returned unreduced.

  Args:
    opts: the core's options; ``fun`` runs on the replica's rows.
    roles: the roles of this call's arguments (``opts.roles.resolve(...)``).
    args: the replica's positional arguments.
    kwargs: the replica's keyword arguments.
    active: the core's ``active_micro_batches``, or ``None``.
    axes: the manual axes the replicas are laid along.
    n: the number of micro-batches, or ``None`` for the core to read it from the options.
    grad_axes: per gradient leaf, the axes its gradient is still summed over; ``None``:
      all of ``axes`` (replicated parameters).
    grad_scatters: per gradient leaf, the reduce-scatters left to :func:`combine`.
    micro_scatters: per gradient leaf, the reduce-scatters applied to each micro-batch's
      gradient before it is accumulated (the per-example path under
      ``grad_scatter="micro_batch"``: :func:`_check_placement`), or ``None``.
    peel: run the last micro-batch after the loop (``overlap_grad_reduce``).
    place: see step 2.
    run: see step 4.

  Returns:
    A :class:`Replica`, or what ``run`` returns.
  """
  largs, lkwargs = list(args), dict(kwargs)
  for j in (*roles.diff, *roles.state):
    largs[j] = _sharding.vary(largs[j], axes)
  own: Sequence[Any] = ()
  if place is not None:
    fun, own = place(largs, lkwargs)
    opts = dataclasses.replace(opts, fun=fun)
    # After the first vary: a parameter gathered before the loop must vary over every data
    # axis, or its cotangent would be summed over the others inside every micro-batch.
    for j in roles.diff:
      largs[j] = _sharding.vary(largs[j], axes)
  shards = math.prod(lax.axis_size(a) for a in axes)
  if roles.rng or roles.rng_names:
    # The whole batch's size, for the hint on per-example keys: each replica holds 1/shards.
    size = shards * _rows(opts, roles, largs, lkwargs)
    for j in roles.rng:
      _transform.check_keys(opts, j, largs[j], size, roles.batch)
      largs[j] = fold_shard(largs[j], axes)
    for k in roles.rng_names:
      _transform.check_keys(opts, k, lkwargs[k], size, roles.batch, roles.batch_names)
      lkwargs[k] = fold_shard(lkwargs[k], axes)
  if run is not None:
    return run(tuple(largs), lkwargs)
  if grad_axes is None:
    grad_axes = (axes,) * sum(len(jax.tree.leaves(largs[j])) for j in roles.diff)
  seen: dict[str, PyTree] = {}

  def across(carry, stacked, kinds):
    seen["kinds"] = kinds
    return combine(carry, stacked, kinds, axes=axes, grad_axes=grad_axes,
                   reduce_is_sum=_reduce.sums_across_devices(opts.terms),
                   grad_scatters=grad_scatters, rule=_transform.micro_rule(opts))

  each = None
  if micro_scatters is not None and any(micro_scatters):
    each = functools.partial(_scatter_groups, scatters=micro_scatters)
  value, extra, grads, info = _transform.accumulate(
      opts, tuple(largs), lkwargs, active, n=n, shards=shards, combine=across, own=own,
      each_grads=each, peel=peel)
  return Replica(value, extra, grads, info, seen.get("kinds"))


def _rows(opts: Options, roles: Roles, args: list, kwargs: dict) -> int:
  """The replica's rows: the size of its first batch leaf along its batch axis (0 if it has
  none; the core then explains what is wrong with the batch)."""
  batches: dict[Any, PyTree] = {opts.label(j): args[j] for j in roles.batch}
  batches.update({f"keyword argument {k!r}": kwargs[k] for k in roles.batch_names})
  leaves = jax.tree.leaves(batches)
  if not leaves:
    return 0
  along = jax.tree.leaves(_split.batch_axes(batches, opts.split.batch_axis))
  shape = np.shape(leaves[0])
  return int(shape[along[0]]) if 0 <= along[0] < len(shape) else 0


def map_replicas(body: Callable[..., Any], *, mesh: Any, axes: tuple[AxisName, ...],
                 in_specs: Any, out_specs: Any) -> Callable[..., Any]:
  """``body`` (which calls :func:`on_replicas`) mapped over the replicas of ``mesh``:
  :func:`jax.shard_map`, manual over ``axes`` only, the mesh's other axes left to the
  compiler."""
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names=frozenset(axes))


class _Placed(NamedTuple):
  """Every argument flattened: the array leaves that cross the shard_map boundary."""

  keys: tuple  # per argument: its position (int) or keyword (str)
  flat: tuple  # per argument: (leaves, treedef)
  arrays: tuple  # the array leaves, in order
  in_specs: tuple  # their specs over the data axes
  gathers: dict  # per argument: per leaf, the all-gathers that undo its data sharding

  def unflatten(self, local_arrays: Sequence[Any], nargs: int) -> tuple[list, dict]:
    """The local positional and keyword arguments, from the mapped array leaves."""
    it = iter(local_arrays)
    values = [jax.tree.unflatten(treedef, [next(it) if _sharding.is_array(x) else x
                                           for x in leaves])
              for leaves, treedef in self.flat]
    return values[:nargs], dict(zip(self.keys[nargs:], values[nargs:], strict=True))


def _place(opts: Options, roles: Any, mesh: Any, args: tuple, kwargs: dict,
           batch_axes: dict[Any, PyTree]) -> _Placed:
  """The in_specs and gathers of every array leaf of every argument; a batch argument's
  leaves are mapped along their batch axes (``batch_axes``, per argument a tree of ints)."""
  axes = _data_axes(opts)
  explicit_data = bool(set(getattr(mesh, "explicit_axes", ())) & set(axes))
  all_manual = set(axes) == set(mesh.axis_names)
  named = [(j, args[j]) for j in range(len(args))] + sorted(kwargs.items())
  flat = tuple(jax.tree.flatten(v) for _, v in named)
  arrays, in_specs = [], []
  gathers: dict[Any, list] = {}
  for key, value in named:
    gathers[key] = []
    is_batch = key in roles.batch or key in roles.batch_names
    label = opts.label(key) if isinstance(key, int) else f"keyword argument {key!r}"
    kind = ("state argument" if key in roles.state else
            "PRNG key argument" if key in (*roles.rng, *roles.rng_names) else None)
    along = jax.tree.leaves(batch_axes[key]) if is_batch else None
    for k, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(value)):
      if not _sharding.is_array(x):
        gathers[key].append(())
        continue
      have = _sharding.explicit_spec(x)
      a = along[k] if along is not None else 0
      spec, gather, lead = _local_spec(have, axes, f"{label}{jax.tree_util.keystr(path)}",
                                       is_batch, kind, a)
      if is_batch and explicit_data and all_manual and lead != axes:
        # A fully manual, Explicit shard_map needs its input typed as it maps it.
        entries = list(have or ())
        entries += [None] * (x.ndim - len(entries))
        entries[a] = axes
        full = PartitionSpec(*entries)
        x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, full)
                                 if isinstance(mesh, jax.sharding.Mesh) else full)
      arrays.append(x)
      in_specs.append(spec)
      gathers[key].append(gather)
  return _Placed(tuple(k for k, _ in named), flat, tuple(arrays), tuple(in_specs), gathers)


def _gradient_layout(opts: Options, roles: Any, placed: _Placed) -> tuple[tuple, list]:
  """Per gradient leaf, the data axes it is still summed over, and its out_spec.

  A replicated parameter's gradient is summed over every data axis after the loop; an
  FSDP parameter's only over those it is not sharded over (the backward pass of its
  all-gather already reduce-scattered it), and it leaves with the parameter's own spec.
  """
  axes = _data_axes(opts)
  grad_axes, grad_specs = [], []
  for j in roles.diff:
    specs = []
    for gather in placed.gathers[j]:
      sharded = {a for _, g in gather for a in g}
      grad_axes.append(tuple(a for a in axes if a not in sharded))
      spec = [None] * (max((d for d, _ in gather), default=-1) + 1)
      for d, g in gather:
        spec[d] = g[0] if len(g) == 1 else g
      specs.append(PartitionSpec(*spec))
    grad_specs.append(jax.tree.unflatten(placed.flat[placed.keys.index(j)][1], specs))
  if opts.with_info and any(len(a) != len(axes) for a in grad_axes):
    raise ValueError(
        "with_info=True under data_axis needs parameters replicated over the data axes: a "
        "parameter sharded over a data axis (FSDP) has its micro-batch gradients "
        "reduce-scattered across shards inside the loop, so no shard holds a sample of its "
        "own. Drop with_info, or keep the parameters replicated over data_axis.")
  return tuple(grad_axes), grad_specs


def resolve_auto(opts: Options, batches: dict[Any, PyTree],
                  leaf_axes: dict[Any, PyTree]) -> Options:
  """``data_axis="auto"``: the options with the axes read from the batch (and its mesh,
  when neither ``mesh=`` nor :func:`jax.set_mesh` gives one)."""
  axes, batch_mesh = _axes.batch_data_axes(batches, leaf_axes)
  assert opts.parallel is not None
  mesh = opts.parallel.mesh
  if mesh is None and jax.sharding.get_abstract_mesh().empty:
    mesh = batch_mesh
  return dataclasses.replace(opts, parallel=dataclasses.replace(opts.parallel, axis=axes,
                                                                mesh=mesh))


def _data_axes(opts: Options) -> tuple[AxisName, ...]:
  """The data axes, resolved (a tuple of names: the driver resolved ``"auto"``)."""
  axes = cast(DataParallel, opts.parallel).axis
  assert isinstance(axes, tuple)
  return axes


def _per_example(opts: Options) -> bool:
  """Whether each example's gradient is transformed (``per_example=``, the clip of
  DP-SGD): the transform must see the gradient with respect to the whole (gathered)
  parameter, so the FSDP gathers are differentiated as under ``grad_scatter="step"``
  (:func:`_placed_gathers`) and the reduce-scatter follows the sum over the examples."""
  return _transform.micro_rule(opts).one_row


def _check_placement(opts: Options, roles: Any, placed: _Placed) -> tuple[tuple, tuple]:
  """Checks that ``param_gather`` / ``grad_scatter`` have FSDP parameters to act on.

  Returns ``(after, each)``, per gradient leaf the gathers that reduce-scatters undo:
  ``after`` by :func:`combine` after the loop (``grad_scatter="step"``), ``each`` on each
  micro-batch's gradient before it is accumulated. Under the default
  (``"micro_batch"``) the backward pass of the gather reduce-scatters each micro-batch's
  gradient, and both are ``()``, except under a per-example transform (:func:`_per_example`):
  each example's gradient is then taken with respect to the full-size parameter, and the
  micro-batch's sum of them reduce-scattered (``each``), so that the transform (the clip's
  norm) sees the whole of every example's gradient, never one shard's slice of it.
  """
  gathered = [g for j in roles.diff for g in placed.gathers[j]]
  others = [g for k, gs in placed.gathers.items() if k not in roles.diff
            and k not in roles.batch and k not in roles.batch_names for g in gs]
  for name, needs in (("param_gather", gathered + others), ("grad_scatter", gathered)):
    value = getattr(opts.parallel, name)
    if value != _axes.PLACEMENTS[name][0] and not any(needs):
      raise ValueError(
          f"{name}={value!r} places the all-gathers and reduce-scatters of parameters "
          f"sharded over the data axes {_data_axes(opts)} (FSDP), but no differentiated "
          "argument is sharded over them: every parameter is replicated over the data axes "
          "(or its sharding is not in its type: FSDP needs Explicit mesh axes). Shard the "
          "parameters over a data axis, e.g. jax.sharding.reshard(params, P('data')), or "
          f"drop {name}.")
  none = tuple(() for _ in gathered)
  if cast(DataParallel, opts.parallel).grad_scatter == "step":
    return tuple(gathered), none
  return none, (tuple(gathered) if _per_example(opts) else none)


def _scatter_groups(grads: tuple, *, scatters: tuple) -> tuple:
  """One micro-batch's gradients (per group, full-size local ones) reduce-scattered over
  the FSDP axes, leaf by leaf as ``scatters`` says."""
  out = []
  for g in grads:
    flat, treedef = jax.tree.flatten(g)
    out.append(jax.tree.unflatten(treedef, [
        _scatter(x, sc) if sc else x for x, sc in zip(flat, scatters, strict=True)]))
  return tuple(out)


def _placed_gathers(opts: Options, roles: Any, placed: _Placed, mesh: Any, largs: list,
                    lkwargs: dict) -> tuple[Callable[..., Any], list]:
  """All-gathers the data-sharded non-batch arguments where the placement options say.

  Updates the core's local arguments ``largs`` and ``lkwargs`` in place and returns the
  ``fun`` the core runs and the arrays it closes over (parameters, for the core's check of
  unsplit batch arrays). ``param_gather="step"`` gathers before the loop, once (the full
  arrays stay live across it); ``"micro_batch"`` gathers inside ``fun``, in every
  iteration, tied to the micro-batch (:func:`_tie`) so that XLA cannot hoist the gather out
  of the loop. For a differentiated argument, ``grad_scatter="micro_batch"``
  differentiates with respect to the shard, so the transpose of the gather reduce-scatters
  each micro-batch's gradient into a shard-sized accumulator (with a gather before the loop,
  :func:`_gathered_once` gives the shard that transpose); ``"step"`` differentiates with
  respect to full-size values (the gathered arrays, or full-size zeros added to the
  per-micro-batch gather), so each device accumulates its full-size local gradients and
  :func:`combine` reduce-scatters them once. Under a per-example transform the
  differentiated values are full-size whatever ``grad_scatter`` says, so that each
  example's gradient (the clip's norm and factor) is the whole parameter's; under
  ``"micro_batch"`` the micro-batch's sum is then reduce-scattered before it is
  accumulated (:func:`_check_placement`).
  """
  dp = cast(DataParallel, opts.parallel)
  per_micro_batch = dp.param_gather == "micro_batch"
  # A per-example transform differentiates with respect to full-size values whatever the
  # placement; under "micro_batch" its micro-batch sum is reduce-scattered by the core
  # (_check_placement's ``each``).
  step_scatter = dp.grad_scatter == "step" or _per_example(opts)
  # Per argument: (value, its shards) -> the value fun sees; and the shards to gather where
  # they are not the argument's own leaves (the shards behind full-size zeros).
  in_fun: dict[Any, Callable[[Any, list], Any]] = {}
  own: dict[Any, list] = {}
  closed: list = []
  for k, gs in placed.gathers.items():
    if k in roles.batch or k in roles.batch_names or not any(gs):
      continue
    where = largs if isinstance(k, int) else lkwargs
    value = where[k]
    leaves, treedef = jax.tree.flatten(value)
    diff = k in roles.diff
    if not per_micro_batch:
      full = [_gather(x, g) if g else x for x, g in zip(leaves, gs, strict=True)]
      if diff and not step_scatter:
        in_fun[k] = functools.partial(_use_full, gathers=gs, full=full)
        closed += full
      else:
        value = jax.tree.unflatten(treedef, full)
    elif diff and step_scatter:
      in_fun[k] = functools.partial(_gather_into, gathers=gs, add=True)
      own[k] = leaves
      closed += leaves
      value = jax.tree.unflatten(treedef, [
          jnp.zeros(_gathered_shape(x.shape, g, mesh), x.dtype) if g else x
          for x, g in zip(leaves, gs, strict=True)])
    else:
      in_fun[k] = functools.partial(_gather_into, gathers=gs, add=False)
    where[k] = value
  if not in_fun:
    return opts.fun, closed
  batch_keys = (*roles.batch, *roles.batch_names)

  def fun_local(*call_args, **call_kwargs):
    call_args = list(call_args)

    def get(k):
      return call_args[k] if isinstance(k, int) else call_kwargs[k]

    if per_micro_batch:
      shards = {k: own[k] if k in own else jax.tree.leaves(get(k)) for k in in_fun}
      shards = _tie(shards, {k: placed.gathers[k] for k in in_fun}, call_args, call_kwargs,
                    batch_keys)
    else:
      shards = {k: [] for k in in_fun}
    for k, make in in_fun.items():
      if isinstance(k, int):
        call_args[k] = make(call_args[k], shards[k])
      else:
        call_kwargs[k] = make(call_kwargs[k], shards[k])
    return opts.fun(*call_args, **call_kwargs)

  return fun_local, closed


def _use_full(value: Any, shards: list, *, gathers: tuple, full: list) -> Any:
  """``value`` (shards) replaced by the arrays gathered before the loop, differentiably."""
  del shards
  leaves, treedef = jax.tree.flatten(value)
  return jax.tree.unflatten(treedef, [
      _gathered_once(x, f, g, tuple(sorted(_sharding.varying(x), key=str))) if g else x
      for x, f, g in zip(leaves, full, gathers, strict=True)])


def _gather_into(value: Any, shards: list, *, gathers: tuple, add: bool) -> Any:
  """``shards`` (tied to the micro-batch by :func:`_tie`) all-gathered in this iteration:
  ``value``'s leaves replaced by them, or (``add``: ``value`` holds full-size zeros, the
  arguments differentiated under ``grad_scatter="step"``) added to them."""
  leaves, treedef = jax.tree.flatten(value)
  full = [_gather(x, g) if g else x for x, g in zip(shards, gathers, strict=True)]
  if add:
    full = [f + d if g else d for f, d, g in zip(full, leaves, gathers, strict=True)]
  return jax.tree.unflatten(treedef, full)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gathered_once(shard: jax.Array, full: jax.Array, gathers: tuple,
                   varying: tuple) -> jax.Array:
  """``full`` (``shard`` all-gathered before the loop) whose cotangent goes to ``shard``,
  reduce-scattered: what the gather's own transpose gives, without gathering again.
  ``varying`` holds the manual axes ``shard`` varies over, which its cotangent must too."""
  del shard, gathers, varying
  return full


def _gathered_once_fwd(shard, full, gathers, varying):
  del shard, gathers, varying
  return full, None


def _gathered_once_bwd(gathers, varying, _, ct):
  return _sharding.vary(_scatter(ct, gathers), varying), None


_gathered_once.defvjp(_gathered_once_fwd, _gathered_once_bwd)


def fold_shard(keys: PyTree, axes: tuple) -> PyTree:
  """Inside ``shard_map`` over ``axes``: each key of ``keys`` folded with this device's shard
  index, ``fold_in(key, d)``, so that the data shards draw different numbers."""
  shard = lax.axis_index(axes)
  return jax.tree.map(lambda k: jax.random.fold_in(k, shard), _sharding.vary(keys, axes))


def _tie(shards: dict[Any, list], gathers: dict[Any, tuple], call_args: list,
         call_kwargs: dict, batch_keys: tuple) -> dict[Any, list]:
  """The ``shards`` to gather (per argument, its leaves; those with ``gathers``) tied to the
  micro-batch, so that XLA cannot hoist their gathers out of the micro-batch loop.

  The shards and every numeric array leaf of the micro-batch (the batch arguments of
  ``call_args`` and ``call_kwargs``, replaced in place) go through one
  :func:`_after_micro_batch`: an optimization barrier whose outputs change in every
  iteration and which ``fun`` reads, so XLA can neither drop the micro-batch from it nor
  move it, or the gathers that read its outputs, out of the loop. The barrier computes
  nothing (every value comes out bit for bit as it went in) and its derivative is the
  identity, so no value and no gradient of the user's changes. Only if ``fun`` reads none
  of the micro-batch's numeric leaves can XLA still hoist the gathers. What this replaced
  and what was measured: ``docs/devices.md``, "Placing FSDP's gathers and reduce-scatters".
  """
  batch = {k: jax.tree.flatten(call_args[k] if isinstance(k, int) else call_kwargs.get(k))
           for k in batch_keys}
  at = [(k, i) for k, (flat, _) in batch.items() for i, x in enumerate(flat)
        if isinstance(x, jax.Array) and _numeric(x)]
  if not at:
    return shards
  # Lists, not dicts: the keys mix positions and keywords, which a pytree cannot sort.
  tied = [[x for x, g in zip(xs, gathers[k], strict=True) if g] for k, xs in shards.items()]
  rows = [batch[k][0][i] for k, i in at]
  # The barrier's operands must vary over the same manual axes: a batch leaf varies over
  # every data axis, a shard of a non-differentiated argument perhaps over fewer (HSDP).
  axes = tuple(sorted(set().union(*map(_sharding.varying, jax.tree.leaves((tied, rows)))),
                      key=str))
  tied, rows = _after_micro_batch(_sharding.vary(tied, axes), _sharding.vary(rows, axes))
  for (k, i), row in zip(at, rows, strict=True):
    batch[k][0][i] = row
  for k in dict.fromkeys(k for k, _ in at):
    flat, treedef = batch[k]
    if isinstance(k, int):
      call_args[k] = jax.tree.unflatten(treedef, flat)
    else:
      call_kwargs[k] = jax.tree.unflatten(treedef, flat)
  out = {}
  for (k, xs), done in zip(shards.items(), tied, strict=True):
    it = iter(done)
    out[k] = [next(it) if g else x for x, g in zip(xs, gathers[k], strict=True)]
  return out


@jax.custom_jvp
def _after_micro_batch(shards: Any, rows: list) -> tuple[Any, list]:
  """``(shards, rows)`` unchanged, behind one :func:`jax.lax.optimization_barrier`; the
  tangents (and so the cotangents) pass straight through, outside the barrier."""
  return lax.optimization_barrier((shards, rows))


@_after_micro_batch.defjvp
def _after_micro_batch_jvp(primals, tangents):
  return _after_micro_batch(*primals), tangents


def _numeric(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and (jnp.issubdtype(dtype, np.number)
                                or jnp.issubdtype(dtype, np.bool_))


def _gathered_shape(shape: tuple, gathers: tuple, mesh: Any) -> tuple:
  out = list(shape)
  for dim, names in gathers:
    out[dim] *= math.prod(mesh.shape[a] for a in names)
  return tuple(out)


def _split_rows(opts: Options, extra: Any, kinds: PyTree):
  """Separates per-example ("concat") aux leaves, which leave shard_map row-sharded.

  Returns ``(kept, rows, unsplit)``: the other leaves, the per-example ones, and the
  function that puts both back into ``extra``'s structure.
  """
  rows_mask = jax.tree.map(lambda k: k.per_example, kinds)
  if opts.roles.state_argnums:
    no_rows = jax.tree.map(lambda _: False, extra[0] if opts.has_aux else extra)
    mask = (no_rows, rows_mask) if opts.has_aux else no_rows
  else:
    mask = rows_mask
  leaves, treedef = jax.tree.flatten(extra)
  mflat = jax.tree.leaves(mask)
  # Rows leave along the leading axis (out_specs are fixed before fun is traced), and go
  # back to their batch axis outside.
  along = [k.axis for k in jax.tree.leaves(kinds) if k.per_example]
  kept = [x for x, m in zip(leaves, mflat, strict=True) if not m]
  rows = [x for x, m in zip(leaves, mflat, strict=True) if m]
  rows = [jnp.moveaxis(x, a, 0) for x, a in zip(rows, along, strict=True)]

  def unsplit(kept, rows):
    it_kept = iter(kept)
    it_rows = iter(jnp.moveaxis(x, 0, a) for x, a in zip(rows, along, strict=True))
    return jax.tree.unflatten(treedef, [next(it_rows) if m else next(it_kept) for m in mflat])

  return kept, rows, unsplit


def _manual_part(spec: PartitionSpec | None, axes: tuple[AxisName, ...]):
  """Splits a leaf's spec into its part over the data axes and the gathers that undo it.

  Returns ``(in_spec, gathers)``: the spec restricted to ``axes`` (what ``shard_map``
  maps) and ``((dim, axes_of_dim), ...)`` for the dimensions sharded over data axes.
  """
  if spec is None:
    return PartitionSpec(), ()
  entries, gathers = [], []
  for dim in range(len(spec)):
    mine = tuple(a for a in _sharding.dim_axes(spec, dim) if a in axes)
    entries.append(None if not mine else mine[0] if len(mine) == 1 else mine)
    if mine:
      gathers.append((dim, mine))
  return PartitionSpec(*entries), tuple(gathers)


def _gather(x: jax.Array, gathers: tuple) -> jax.Array:
  for dim, names in gathers:
    x = lax.all_gather(x, names if len(names) > 1 else names[0], axis=dim, tiled=True)
  return x


def _scatter(x: jax.Array, gathers: tuple) -> jax.Array:
  """Sums ``x`` over the devices of ``gathers`` and keeps this device's shard: the
  transpose of :func:`_gather`."""
  for dim, names in reversed(gathers):
    x = lax.psum_scatter(x, names if len(names) > 1 else names[0], scatter_dimension=dim,
                         tiled=True)
  return x


def combine(carry: Any, stacked: PyTree, kinds: PyTree, *, axes: tuple[AxisName, ...],
            grad_axes: tuple, reduce_is_sum: bool, grad_scatters: tuple | None = None,
            rule: Any = _transform.VJP):
  """Step 2 of the core: reduces the scan's carry over the data axes, once, after the loop,
  each entry as its record says (:data:`jaxaccum._core._transform.CARRY`).

  ``grad_axes`` gives, per gradient leaf, the data axes it still has to be summed over:
  all of them for a replicated parameter; those it is not sharded over for an FSDP
  parameter, whose gradient the backward pass already reduce-scattered. ``grad_scatters``
  (``grad_scatter="step"``) gives, per gradient leaf, the gathers whose reduce-scatter is
  still to be done: the accumulator then holds a full-size local gradient, reduce-scattered
  here first (over the FSDP axes), then summed over ``grad_axes`` at the shard's size.
  ``rule`` is the micro-batch rule, whose own carry entries are reduced too.
  """
  scatters = grad_scatters or tuple(() for _ in grad_axes)

  def reduce_grads(flat: list) -> list:
    flat = [_scatter(g, sc) for g, sc in zip(flat, scatters, strict=True)]
    return [lax.psum(g, ax) if ax else g for g, ax in zip(flat, grad_axes, strict=True)]

  across = _transform.Across(axes, reduce_grads, reduce_is_sum, kinds)
  return _transform.combine_carry(carry, stacked, across, rule)


def _local_spec(have: PartitionSpec | None, axes: tuple[AxisName, ...], where: str,
                batch: bool, replicated_only: str | None, batch_axis: int = 0):
  """in_spec and gathers of one array argument leaf (a batch leaf's along ``batch_axis``)."""
  if batch:
    lead = _sharding.dim_axes(have, batch_axis)
    if set(lead) - set(axes):
      raise ValueError(
          f"batch leaf {where} is sharded over {lead} (spec {have}), but data_axis={axes} "
          f"leaves out {tuple(a for a in lead if a not in axes)}. Name every mesh axis the "
          f"batch is sharded over: data_axis={lead}; parameters may stay sharded over any "
          "of them (FSDP).")
    return PartitionSpec(*([None] * batch_axis), axes), (), lead
  spec, gather = _manual_part(have, axes)
  if gather and replicated_only:
    raise ValueError(
        f"{where} is a {replicated_only} sharded over data axis "
        f"{sorted({a for _, g in gather for a in g})} (spec {have}); under data_axis, "
        f"{replicated_only}s must be replicated over the data axes. Reshard it with "
        "jax.sharding.reshard(x, P()) first.")
  return spec, gather, None
