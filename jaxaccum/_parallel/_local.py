"""``jaxaccum.local_value_and_grad``: per-device, unreduced gradients on a data-parallel mesh.

Under :func:`jax.jit` a gradient with respect to replicated parameters of a loss over a
sharded batch is reduced across devices as soon as it is computed, in every call. When the
gradients of several calls are added up before they are used (:class:`jaxaccum.MultiSteps`
across calls), those reductions can wait: this transform runs the loss inside
:func:`jax.shard_map` over the data axes with the parameters marked device-varying, so each
device's backward pass yields the gradient of its own rows and nothing is communicated. The
result is *unreduced*, in the sense of JAX's sharding types: every leaf gains a leading axis
of size ``D`` (the data shards), sharded over the data axes, and its sum over that axis is
the gradient of the whole batch. ``MultiSteps(..., data_axis=...)`` accumulates such
gradients and sums them over the leading axis once, on the window's last call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxaccum._core import _options, _outputs, _sharding, _transform
from jaxaccum._core._types import ArgNames, ArgNums
from jaxaccum._parallel import _axes, _data_parallel


def local_value_and_grad(
    fun: Callable[..., Any],
    *,
    data_axis: str | Sequence[str] | _axes.DataParallel,
    argnums: ArgNums = 0,
    batch_argnums: ArgNums = _options.BATCH_ARGNUMS,
    batch_argnames: ArgNames | None = None,
    has_aux: bool = False,
    reduce: str = "mean",
    rng_argnums: ArgNums | None = None,
    rng_argnames: ArgNames | None = None,
    **accumulate: Any,
) -> Callable[..., Any]:
  """Like :func:`jax.value_and_grad`, per data shard and unreduced: no cross-device reduction.

  The batch arguments are split over the ``D`` data shards of ``data_axis`` along their
  leading axis; every other argument must be replicated over the data axes (plain data
  parallelism). Each device computes ``fun`` and its gradients on its own rows, with no
  collective, and every output leaf comes back with a new leading axis of size ``D``,
  sharded over ``data_axis``: entry ``d`` is shard ``d``'s piece. The pieces of the value
  and of the gradients *sum* to the full batch's value and gradients: under
  ``reduce="mean"`` (``fun`` returns a mean over its rows) each shard's result is divided by
  ``D``, under ``reduce="sum"`` it is kept as it is. So ``value.sum()`` is the batch's loss
  (taking it costs a scalar all-reduce) and ``jax.tree.map(lambda g: g.sum(0), grads)`` its
  gradients, which is what :class:`jaxaccum.MultiSteps` with ``data_axis`` does once per
  window. ``aux`` keeps each shard's value, stacked along the leading axis.

  Arguments play the roles they play in :func:`jaxaccum.value_and_grad`, by position or by
  keyword (``batch_argnames``, ``rng_argnames``). A PRNG key reaches shard ``d`` as
  ``jax.random.fold_in(key, d)``, so that the shards draw different numbers (dropout masks),
  as under ``value_and_grad(..., data_axis=...)``; with micro-batches, micro-batch ``i`` of
  the shard gets ``fold_in(fold_in(key, d), i)``.

  A loss that is a mean or a sum over rows gives exactly the full batch's gradient. A loss
  that is not (a statistic of the batch such as BatchNorm's, the in-batch negatives of a
  contrastive loss) is computed on each shard's ``B / D`` rows, a different loss: see the
  devices guide, "What data_axis computes". ``reduce="weighted"`` (a token mean) would need
  the total token count of every shard, a collective: give such calls their ``weight`` in
  :meth:`jaxaccum.MultiSteps.update` and return from ``fun`` the sum of token losses
  divided by that count, under ``reduce="sum"``.

  Args:
    fun: the loss, ``fun(params, batch, ...)``: a mean over its rows (``reduce="mean"``)
      or a sum (``reduce="sum"``); ``(loss, aux)`` with ``has_aux``.
    data_axis: the mesh axis name (or names) the batch is sharded over, or a
      :class:`jaxaccum.DataParallel` with its ``mesh`` (``None``, the default, uses the mesh
      set with :func:`jax.set_mesh`); its placements are not used here (nothing is reduced).
    argnums: the positional argument(s) to differentiate, as in :func:`jax.grad`.
    batch_argnums: the positional argument(s) that carry the batch (leading axis split
      over the data shards); argument 1 by default, as in :func:`jaxaccum.value_and_grad`.
    batch_argnames: keyword argument(s) that carry the batch.
    has_aux: ``fun`` returns ``(value, aux)``.
    reduce: ``"mean"`` or ``"sum"``: what ``fun``'s value is over its rows.
    rng_argnums: positional argument(s) holding a PRNG key (or a pytree of keys), folded
      per shard (and per micro-batch).
    rng_argnames: keyword argument(s) holding a PRNG key, likewise.
    **accumulate: options of :func:`jaxaccum.value_and_grad` (``num_micro_batches``,
      ``micro_batch_size``, ``remat``, ...) to also accumulate over micro-batches within
      each device's rows in this call; without them the gradient is taken in one pass.
      ``mesh=`` is kept for one release with a :class:`DeprecationWarning`: pass
      ``data_axis=jaxaccum.DataParallel(axis, mesh=mesh)``.

  Returns:
    A function with ``fun``'s arguments (positional and keyword) returning ``(value, grads)`` (or
    ``((value, aux), grads)``), each leaf with the leading axis of the ``D`` shards.

  Raises:
    ValueError, TypeError: a bad ``data_axis``, ``mesh`` or ``reduce``, or two roles
      naming one argument (as :func:`jaxaccum.value_and_grad`); at trace time, a batch
      whose size is not a multiple of ``D``, a key argument that is not a key, or an
      overlap seen only once negative positions are resolved.

  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> import jaxaccum
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
  >>> w0, x0 = jnp.ones(3), jnp.arange(48.0).reshape(16, 3) / 48
  >>> w = jax.device_put(w0, NamedSharding(mesh, P()))
  >>> x = jax.device_put(x0, NamedSharding(mesh, P("data")))
  >>> fn = jax.jit(jaxaccum.local_value_and_grad(
  ...     loss, data_axis=jaxaccum.DataParallel("data", mesh=mesh)))
  >>> value, grads = fn(w, x)
  >>> grads.shape                  # one unreduced piece per device
  (8, 3)
  >>> jaxaccum.planning.collectives(fn, w, x).count()
  0
  >>> full_value, full_grads = jax.value_and_grad(loss)(w0, x0)
  >>> bool(jnp.allclose(value.sum(), full_value)), bool(jnp.allclose(grads.sum(0), full_grads))
  (True, True)
  """
  accumulate = dict(accumulate)
  data_axis, mesh = _axes.unreduced_axes("local_value_and_grad", data_axis, accumulate)
  axes = _axes.check_data_axis(data_axis)
  if axes is None:
    raise TypeError(
        "local_value_and_grad needs data_axis, the mesh axis name (or names) the batch is "
        "sharded over; for a gradient reduced over the devices use jaxaccum.value_and_grad.")
  mesh = _axes.check_mesh(mesh, axes)
  if reduce not in ("mean", "sum"):
    raise ValueError(
        f"reduce must be 'mean' or 'sum' for local_value_and_grad (what fun returns over its "
        f"rows), got reduce={reduce!r}. A token mean needs the total count over every shard, "
        "a collective: return the sum of token losses divided by the call's total count under "
        "reduce='sum' (the count known from the data, or passed in).")
  # The core's options, validated once (roles, names and their overlaps); they run the
  # micro-batches when accumulating, and resolve each call's roles as the core does.
  # state_argnums is validated with the other roles (their overlaps first), then refused.
  state = accumulate.pop("state_argnums", None)
  given = dict(argnums=argnums, batch_argnums=batch_argnums, batch_argnames=batch_argnames,
               has_aux=has_aux, reduce=reduce, rng_argnums=rng_argnums,
               rng_argnames=rng_argnames, state_argnums=state,
               **(accumulate or {"num_micro_batches": 1}))
  opts = _options.make_options(
      fun, {k: v for k, v in given.items() if k in _options.DEFAULTS},
      deprecated={k: v for k, v in given.items() if k not in _options.DEFAULTS},
      where="local_value_and_grad", parallel=_axes.KEYWORDS)
  _refuse_state(state)
  if opts.split.batch_axis != 0:
    raise ValueError(
        f"local_value_and_grad shards each batch leaf's leading axis over the data axes, so "
        f"the batch axis must be the leading one, got batch_axis={opts.split.batch_axis!r}. "
        "Move the batch axis first (e.g. jnp.moveaxis(x, 1, 0)), or use "
        "jaxaccum.value_and_grad(..., batch_axis=..., data_axis=...).")

  def inner(a: tuple, k: dict) -> Any:
    if not accumulate:
      return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*a, **k)
    with jax.named_scope(_transform.call_scope("value_and_grad")):
      value, extra, grads, info = _transform.accumulate(opts, a, k, None)
    grads = grads[0] if opts.roles.argnums_is_int else grads
    return _outputs.pack(value, extra, grads, info, has_extra=opts.has_extra,
                         with_info=opts.with_info)

  def local_fn(*args: Any, **kwargs: Any) -> Any:
    with jax.named_scope(_transform.call_scope("local_value_and_grad")):
      return run(args, kwargs)

  def run(args: tuple, kwargs: dict) -> Any:
    m = _axes.resolve_mesh(mesh, axes)
    shards = math.prod(m.shape[a] for a in axes)
    roles = opts.roles.resolve(len(args), kwargs)
    explicit = bool(set(getattr(m, "explicit_axes", ())) & set(axes))
    arrays, kw_arrays = list(args), dict(kwargs)
    for key in (*roles.batch, *roles.batch_names):
      where: Any = arrays if isinstance(key, int) else kw_arrays
      label = opts.label(key) if isinstance(key, int) else f"keyword argument {key!r}"
      for path, leaf in jax.tree_util.tree_leaves_with_path(where[key]):
        if not jnp.ndim(leaf) or jnp.shape(leaf)[0] % shards:
          raise ValueError(
              f"batch leaf {label}{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}; "
              f"its leading axis must be a multiple of the {shards} data shards of "
              f"{_sharding.axes_str(axes, m)}.")
      if explicit:  # a manual Explicit shard_map needs its input typed as it maps it
        where[key] = jax.tree.map(lambda x, m=m: _reshard_rows(x, m, axes), where[key])
    spec = lambda batch: PartitionSpec(axes) if batch else PartitionSpec()  # noqa: E731
    in_specs = (tuple(spec(j in roles.batch) for j in range(len(args))),
                {k: spec(k in roles.batch_names) for k in kwargs})
    piece = 1 / shards if reduce == "mean" else 1  # the pieces sum to the batch's mean

    def per_shard(largs, lkwargs):
      # Unreduced: the driver marks the parameters varying and folds the keys, then runs
      # inner on the shard's rows, with no combine.
      out, grads = _data_parallel.on_replicas(
          opts, roles, largs, lkwargs, axes=axes, run=inner)
      value, aux = out if has_aux else (out, None)
      lead = lambda x: (x * piece if piece != 1 else x)[None]  # noqa: E731
      value, grads = lead(value), jax.tree.map(lead, grads)
      aux = jax.tree.map(lambda x: _sharding.vary(x, axes)[None], aux)
      return ((value, aux) if has_aux else value), grads

    mapped = _data_parallel.map_replicas(per_shard, mesh=m, axes=axes, in_specs=in_specs,
                                         out_specs=PartitionSpec(axes))
    return mapped(tuple(arrays), kw_arrays)

  local_fn.__doc__ = fun.__doc__
  return local_fn


def _refuse_state(state: Any) -> None:
  """``state_argnums``: each shard would thread its own state, with no rule for joining the
  ``D`` states after the call, so it is refused with the way out."""
  if state is not None:
    raise ValueError(
        f"local_value_and_grad takes no state_argnums (got state_argnums={state!r}): each "
        "data shard would update its own copy of the state and nothing joins the copies. "
        "Drop state_argnums and return the state in aux (it comes back stacked, one entry "
        "per shard), or use jaxaccum.value_and_grad(..., state_argnums=..., data_axis=...).")


def _reshard_rows(x: jax.Array, mesh: Any, axes: tuple[str, ...]) -> jax.Array:
  """``x`` with its leading axis sharded over ``axes`` (its other dimensions kept)."""
  have = _sharding.explicit_spec(x)
  spec = PartitionSpec(axes, *(tuple(have[1:]) if have is not None else ()))
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec)
                              if isinstance(mesh, jax.sharding.Mesh) else spec)
