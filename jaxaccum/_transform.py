"""``jaxaccum.value_and_grad`` and ``jaxaccum.grad``: validate, split, one scan, finalize."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum import _reduce, _sharding, _split
from jaxaccum._split import describe as _describe

PyTree = Any


class _Options:
  """Everything fixed when the transform is built (validated eagerly)."""

  def __init__(self, *, fun, num_micro_batches, micro_batch_size, argnums, batch_argnums,
               has_aux, reduce, aux_reduce, rng_argnums, state_argnums, accumulator_dtype,
               grads_dtype, remat, remat_policy, unroll, data_axis=None, mesh=None):
    if not callable(fun):
      raise TypeError(f"fun must be callable, got {fun!r} of type {type(fun).__name__}.")
    self.fun = fun
    self.count, self.size = _split.check_counts(num_micro_batches, micro_batch_size)
    self.argnums = _split.normalize_argnums("argnums", argnums, allow_empty=False)
    self.argnums_is_int = not isinstance(argnums, Sequence)
    self.batch_argnums = _split.normalize_argnums("batch_argnums", batch_argnums,
                                                  allow_empty=False)
    self.rng_argnums = _split.normalize_argnums("rng_argnums", rng_argnums, allow_empty=True)
    self.state_argnums = _split.normalize_argnums("state_argnums", state_argnums,
                                                  allow_empty=True)
    self.state_is_tuple = isinstance(state_argnums, Sequence)
    if not isinstance(has_aux, bool):
      raise TypeError(f"has_aux must be a bool, got has_aux={has_aux!r}.")
    self.has_aux = has_aux
    self.reduce = _reduce.check_reduce(reduce)
    if aux_reduce is not None and not has_aux:
      raise ValueError(
          f"aux_reduce={aux_reduce!r} was given but has_aux=False: set has_aux=True and "
          "return (value, aux) from fun, or drop aux_reduce."
      )
    if isinstance(aux_reduce, str) and aux_reduce not in _reduce.AUX_REDUCTIONS:
      raise ValueError(
          f"aux_reduce must be one of {', '.join(map(repr, _reduce.AUX_REDUCTIONS))} or a "
          f"pytree prefix of aux with those names, got aux_reduce={aux_reduce!r}."
      )
    self.aux_reduce = aux_reduce
    self.accumulator_dtype = _reduce.check_dtype("accumulator_dtype", accumulator_dtype)
    self.grads_dtype = _reduce.check_dtype("grads_dtype", grads_dtype)
    if not isinstance(remat, bool):
      raise TypeError(
          f"remat must be a bool, got remat={remat!r}; pass a jax.checkpoint policy as "
          "remat_policy=..."
      )
    if remat_policy is not None and not callable(remat_policy):
      raise TypeError(
          "remat_policy must be a jax.checkpoint policy such as "
          f"jax.checkpoint_policies.dots_saveable, got {remat_policy!r}."
      )
    self.remat = remat or remat_policy is not None
    self.remat_policy = remat_policy
    if not isinstance(unroll, (bool, int)) or (not isinstance(unroll, bool) and unroll < 1):
      raise TypeError(
          f"unroll must be a positive int or a bool (as for jax.lax.scan), got unroll={unroll!r}.")
    self.unroll = unroll
    self.data_axis = _sharding.check_data_axis(data_axis)
    self.mesh = _sharding.check_mesh(mesh, self.data_axis)

  def roles(self, nargs: int) -> dict[str, tuple[int, ...]]:
    roles = {
        "argnums": _split.resolve_argnums("argnums", self.argnums, nargs),
        "batch_argnums": _split.resolve_argnums("batch_argnums", self.batch_argnums, nargs),
        "rng_argnums": _split.resolve_argnums("rng_argnums", self.rng_argnums, nargs),
        "state_argnums": _split.resolve_argnums("state_argnums", self.state_argnums, nargs),
    }
    _split.check_disjoint(roles)
    return roles


def _check_scalar(name: str, value: Any, what: str) -> jax.Array:
  shape = getattr(value, "shape", None)
  dtype = getattr(value, "dtype", None)
  if shape is None or dtype is None:
    raise TypeError(f"{name} must be a scalar array {what}, got {_describe(value)}.")
  if shape != ():
    raise TypeError(
        f"{name} must be a scalar {what}, got {_describe(value)}. Reduce it over the "
        "micro-batch inside fun (e.g. jnp.mean) before returning it."
    )
  return value


def _check_real(name: str, value: jax.Array) -> None:
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
        f"{name} must have a floating dtype to be differentiated, got {_describe(value)}. "
        "Cast it with .astype(jnp.float32)."
    )


def _unpack(opts: _Options, out: Any):
  """Splits fun's output into (objective, weight, new_state, aux)."""
  has_extra = opts.has_aux or bool(opts.state_argnums)
  if has_extra:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      wants = ("(value, aux)" if opts.has_aux and not opts.state_argnums else
               "(value, new_state)" if not opts.has_aux else "(value, (new_state, aux))")
      raise TypeError(
          f"fun must return {wants} because "
          f"{'has_aux=True' if opts.has_aux else 'state_argnums is set'}, got {_describe(out)}."
      )
    value, extra = out
  else:
    value, extra = out, None
  if opts.reduce == "weighted":
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
      raise TypeError(
          "reduce='weighted' needs fun to return its value as (numerator, denominator), "
          "e.g. (summed token loss, number of real tokens)"
          f"{' with aux as ((numerator, denominator), aux)' if has_extra else ''}; "
          f"got {_describe(value)}."
      )
    num = _check_scalar("the numerator of reduce='weighted'", value[0], "(the summed loss)")
    _check_real("the numerator of reduce='weighted'", num)
    den = _check_scalar("the denominator of reduce='weighted'", value[1],
                        "(the count or total weight)")
    den = lax.stop_gradient(den)
  else:
    num = _check_scalar("the value returned by fun", value,
                        f"(the loss {'mean' if opts.reduce == 'mean' else 'sum'})")
    _check_real("the value returned by fun", num)
    den = None
  if opts.state_argnums:
    if opts.has_aux:
      if not (isinstance(extra, (tuple, list)) and len(extra) == 2):
        raise TypeError(
            "with state_argnums and has_aux=True, fun must return (value, (new_state, aux)); "
            f"got aux part {_describe(extra)}."
        )
      new_state, aux = extra
    else:
      new_state, aux = extra, None
  else:
    new_state, aux = None, extra
  return num, den, new_state, aux


def _check_keys(argnum: int, tree: PyTree) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not _split.is_key(leaf):
      raise TypeError(
          f"rng_argnums names argument {argnum}, but its leaf "
          f"{jax.tree_util.keystr(path) or '(root)'} is {_describe(leaf)}, not a single PRNG key. "
          "Pass one key from jax.random.key(seed) (or jax.random.PRNGKey), or a pytree of "
          "them; micro-batch i gets fold_in(key, i), so there is no need to split it."
      )


def _check_state(opts: _Options, state_in: tuple, new_state: Any) -> tuple:
  """Checks that fun returned state shaped like its state arguments; returns it as a tuple."""
  got = tuple(new_state) if opts.state_is_tuple else (new_state,)
  if opts.state_is_tuple and (not isinstance(new_state, (tuple, list))
                              or len(new_state) != len(state_in)):
    raise TypeError(
        f"state_argnums={opts.state_argnums} is a tuple, so fun must return the new states "
        f"as a tuple of {len(state_in)}, got {_describe(new_state)}."
    )
  for k, (old, new) in enumerate(zip(state_in, got, strict=True)):
    s_old, s_new = jax.tree.structure(old), jax.tree.structure(new)
    if s_old != s_new:
      raise TypeError(
          f"the new state returned by fun for state argument {opts.state_argnums[k]} has "
          f"structure {s_new}, but the state passed in has structure {s_old}. Return the "
          "updated state with the same structure as the input."
      )
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new),
                            strict=True):
      if a.shape != b.shape or a.dtype != b.dtype:  # jnp.dtype() rejects PRNG key dtypes
        raise TypeError(
            f"the new state leaf {jax.tree_util.keystr(path)} of state argument "
            f"{opts.state_argnums[k]} is {_describe(b)}, but the input is {_describe(a)}. "
            "Keep each state leaf's shape and dtype."
        )
  return got


def _accumulate(opts: _Options, args: tuple, kwargs: dict, combine=None):
  """The accumulated (value, aux-part, grads) of ``opts.fun`` over the micro-batches.

  ``combine``, if given, reduces the accumulators across devices once after the loop
  (see ``_sharding.data_parallel``) and returns the micro-batch count to divide by.
  """
  roles = opts.roles(len(args))
  argnums, batch_argnums = roles["argnums"], roles["batch_argnums"]
  rng_argnums, state_argnums = roles["rng_argnums"], roles["state_argnums"]
  batches = {j: args[j] for j in batch_argnums}
  n = _split.resolve_count(_split.batch_size(batches), opts.count, opts.size)
  for j in rng_argnums:
    _check_keys(j, args[j])
  _sharding.check_split_sharding(batches, n)
  split = {j: _split.split(b, n) for j, b in batches.items()}
  state0 = tuple(args[j] for j in state_argnums)
  params = tuple(args[j] for j in argnums)

  # The differentiated function takes only the arguments that have a role (differentiated,
  # batch, key, state) and closes over the others, so those may be anything (a static
  # flag, a string) even under jax.checkpoint.
  role_pos = tuple(dict.fromkeys(argnums + batch_argnums + rng_argnums + state_argnums))

  def inner(*role_vals):
    call_args = list(args)
    for j, v in zip(role_pos, role_vals, strict=True):
      call_args[j] = v
    num, den, new_state, aux = _unpack(opts, opts.fun(*call_args, **kwargs))
    return num, (den, new_state, aux)

  if opts.remat:
    # prevent_cse=True: the recomputation sits in the same scan iteration as the forward
    # pass it repeats, and without the barrier XLA merges the two, saving nothing.
    inner = jax.checkpoint(inner, policy=opts.remat_policy, prevent_cse=True)
  vg = jax.value_and_grad(inner, argnums=tuple(range(len(argnums))), has_aux=True)

  def call(i, state):
    call_args = list(args)
    for j in batch_argnums:
      call_args[j] = _split.take(split[j], i)
    for j in rng_argnums:
      call_args[j] = jax.tree.map(lambda k: jax.random.fold_in(k, i), args[j])
    for j, s in zip(state_argnums, state, strict=True):
      call_args[j] = s
    (num, (den, new_state, aux)), grads = vg(*(call_args[j] for j in role_pos))
    if state_argnums:
      new_state = _check_state(opts, state, new_state)
    return num, den, new_state, aux, grads

  # One abstract evaluation gives the shapes of everything the scan carries.
  num_s, den_s, state_s, aux_s, grads_s = jax.eval_shape(call, jnp.int32(0), state0)
  weighted = opts.reduce == "weighted"
  if weighted and not (jnp.issubdtype(den_s.dtype, jnp.integer)
                       or jnp.issubdtype(den_s.dtype, jnp.floating)):
    raise TypeError(
        f"the denominator of reduce='weighted' must be a number, got dtype {den_s.dtype}.")
  kinds = _reduce.resolve_aux_reduce(opts.aux_reduce, aux_s, "mean")
  for (path, kind), shape in zip(jax.tree_util.tree_leaves_with_path(kinds),
                                 jax.tree.leaves(aux_s), strict=True):
    _reduce.check_aux_leaf(jax.tree_util.keystr(path), kind, shape)
  acc_dtype = functools.partial(_reduce.accumulator_dtype_for,
                                accumulator_dtype=opts.accumulator_dtype)
  den_dtype = None
  if weighted:
    den_dtype = (jnp.promote_types(den_s.dtype, jnp.int32)
                 if jnp.issubdtype(den_s.dtype, jnp.integer) else acc_dtype(den_s.dtype))

  # The accumulators take the sharding / device-varying type of what is added to them.
  carry0 = (
      _sharding.conform(jnp.zeros((), acc_dtype(num_s.dtype)), num_s),
      _sharding.conform(jnp.zeros((), den_dtype), den_s) if weighted else None,
      _sharding.align(jax.tree.map(
          lambda g: _sharding.conform(jnp.zeros(g.shape, acc_dtype(g.dtype)), g), grads_s),
          params),
      jax.tree.map(
          lambda k, s: None if k == "stack" else _sharding.conform(
              _reduce.aux_init(k, s, opts.accumulator_dtype), s), kinds, aux_s),
      jax.tree.map(_sharding.conform, state0, state_s) if state_argnums else state0,
  )

  def body(carry, i):
    num_acc, den_acc, grad_acc, aux_acc, state = carry
    num, den, new_state, aux, grads = call(i, state)
    grad_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_acc, grads)
    grad_acc = _sharding.align(grad_acc, params)
    num_acc = num_acc + num.astype(num_acc.dtype)
    if weighted:
      den_acc = den_acc + den.astype(den_dtype)
    aux_acc = jax.tree.map(
        lambda k, c, v: _reduce.aux_update(k, c, jnp.asarray(v), den if weighted else None),
        kinds, aux_acc, aux)
    stacked = jax.tree.map(lambda k, v: v if k == "stack" else None, kinds, aux)
    new_carry = (num_acc, den_acc, grad_acc, aux_acc, new_state if state_argnums else state)
    return new_carry, stacked

  carry, stacked = lax.scan(body, carry0, jnp.arange(n, dtype=jnp.int32), unroll=opts.unroll)
  count = n
  if combine is not None:
    carry, stacked, count = combine(carry, stacked, kinds, n)
  num_acc, den_acc, grad_acc, aux_acc, state = carry

  divisor = den_acc if weighted else jnp.asarray(count if opts.reduce == "mean" else 1)
  aux_divisor = den_acc if weighted else jnp.asarray(count)
  value = _reduce.safe_divide(num_acc, divisor).astype(num_s.dtype)

  def finish_grad(a, g):
    out = _reduce.safe_divide(a, divisor)
    return out.astype(opts.grads_dtype if opts.grads_dtype is not None else g.dtype)

  grads = _sharding.align(jax.tree.map(finish_grad, grad_acc, grads_s), params)
  aux = jax.tree.map(
      lambda k, c, st, s: _reduce.aux_finalize(k, c, st, s, aux_divisor),
      kinds, aux_acc, stacked, aux_s)
  if state_argnums:
    new_state = state if opts.state_is_tuple else state[0]
    extra = (new_state, aux) if opts.has_aux else new_state
  else:
    extra = aux
  return value, extra, grads


def value_and_grad(
    fun: Callable[..., Any],
    *,
    num_micro_batches: int | None = None,
    micro_batch_size: int | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    reduce: str = "mean",
    aux_reduce: Any = None,
    rng_argnums: int | Sequence[int] | None = None,
    state_argnums: int | Sequence[int] | None = None,
    accumulator_dtype: Any = None,
    grads_dtype: Any = None,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    unroll: int | bool = 1,
    data_axis: str | Sequence[str] | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> Callable[..., Any]:
  """Like :func:`jax.value_and_grad`, accumulated over micro-batches in one ``lax.scan``.

  The batch arguments are split into ``N`` micro-batches (micro-batch ``i`` holds rows
  ``i, i + N, i + 2N, ...``, which keeps a sharded batch axis sharded). One
  :func:`jax.lax.scan` runs forward and backward on each micro-batch and sums the
  gradients in a float32 accumulator; the result is the full-batch loss and gradients,
  with :func:`jax.value_and_grad`'s output structure. Peak memory holds one micro-batch of
  activations. Call it inside your jitted train step; ``fun`` is traced a constant number
  of times, whatever ``N`` is.

  Args:
    fun: the loss, ``fun(params, batch, ...)``. What it returns depends on ``reduce``.
    num_micro_batches: the number ``N`` of micro-batches; must divide the batch size.
    micro_batch_size: alternatively, the rows per micro-batch. Give exactly one of the two.
    argnums: which positional argument(s) to differentiate, as in :func:`jax.grad`.
    batch_argnums: which positional argument(s) carry the batch: pytrees whose leaves share
      a leading batch axis. Other arguments, keyword arguments included, are passed
      unchanged to every micro-batch (a keyword argument is never split).
    has_aux: ``fun`` returns ``(value, aux)``; aux is reduced over micro-batches
      (see ``aux_reduce``).
    reduce: how ``fun``'s value combines across micro-batches.

      * ``"mean"``: ``fun`` returns the mean loss over its micro-batch; the result is the
        full-batch mean (micro-batches have equal sizes, so the mean of means is exact).
      * ``"sum"``: ``fun`` returns a sum; the result is the full-batch sum.
      * ``"weighted"``: ``fun`` returns ``(numerator, denominator)``, e.g. the summed token
        loss and the number of real tokens. The loss is ``sum(numerator) /
        sum(denominator)`` and the gradients ``sum(grad numerator) / sum(denominator)``:
        the exact full-batch token mean however unevenly tokens fall across micro-batches.
        A total denominator of 0 gives loss 0 and zero gradients.
    aux_reduce: how each aux leaf is reduced: ``"mean"`` (the default; weighted by the
      denominator under ``reduce="weighted"``), ``"sum"``, ``"max"``, ``"min"``, or
      ``"stack"`` (a leading axis of size ``N``, one entry per micro-batch). A string
      applies to all of aux; a pytree prefix of aux with names (or ``None`` for the
      default) at its leaves chooses per subtree, e.g. ``{"loss": None, "count": "sum"}``.
    rng_argnums: positional argument(s) holding a PRNG key (or a pytree of keys).
      Micro-batch ``i`` receives ``jax.random.fold_in(key, i)``: distinct per micro-batch,
      deterministic, and independent of how the other arguments are split.
    state_argnums: positional argument(s) holding mutable state (e.g. Linen
      ``batch_stats``) that ``fun`` returns updated: ``fun`` then returns
      ``(value, new_state)``, or ``(value, (new_state, aux))`` with ``has_aux=True``.
      Micro-batch ``i + 1`` sees micro-batch ``i``'s state; the final state comes back in
      the same place of the output. With a tuple of argnums, ``new_state`` is a tuple.
    accumulator_dtype: dtype of the gradient and loss accumulators. ``None`` (default)
      accumulates bfloat16/float16 values in float32 and wider ones in their own dtype.
    grads_dtype: dtype of the returned gradients; ``None`` (default) gives each gradient
      its parameter's dtype, as :func:`jax.grad` does.
    remat: wrap the per-micro-batch computation in :func:`jax.checkpoint`, trading
      recomputation in the backward pass for activation memory.
    remat_policy: a :mod:`jax.checkpoint_policies` policy; implies ``remat=True``.
    unroll: passed to :func:`jax.lax.scan`.
    data_axis: data-parallel mode: the mesh axis name (or tuple of names) that the batch
      axis is sharded over. Each device accumulates the gradients of its own rows and
      they are reduced over these axes once per step, after the loop, instead of once per
      micro-batch: the number of all-reduces per step does not depend on ``N``. ``fun``
      then sees ``B / (N * D)`` rows per call on each of the ``D`` data shards, so ``B``
      must be divisible by ``D * N``. Parameters are replicated over these axes, or, on
      ``Explicit`` mesh axes, sharded over some of them (FSDP): such a parameter is
      all-gathered inside ``fun`` and its gradient reduce-scattered once per
      micro-batch into an accumulator of the shard's size. Mesh axes not named here are
      left to the compiler. Without ``data_axis``, sharded inputs under :func:`jax.jit`
      work too (the split moves no data), but XLA may all-reduce the gradients inside the
      loop. See ``jaxaccum/_sharding.py`` for how aux, state and keys are reduced.
    mesh: the :class:`jax.sharding.Mesh` holding ``data_axis``; ``None`` (default) uses
      the mesh set with :func:`jax.set_mesh`.

  Returns:
    A function with ``fun``'s arguments returning ``(value, grads)``, or
    ``((value, aux), grads)`` when ``has_aux`` or ``state_argnums`` is set, where the aux
    part is ``aux``, ``new_state`` or ``(new_state, aux)``.

  Raises:
    ValueError, TypeError: at construction for bad options, and at trace time for a batch
    that cannot be split or a ``fun`` whose output does not match ``reduce``/``has_aux``.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> def loss_fn(w, batch):
  ...   x, y = batch
  ...   return jnp.mean((x @ w - y) ** 2)
  >>> w = jnp.ones(3)
  >>> batch = (jnp.arange(24.0).reshape(8, 3), jnp.arange(8.0))
  >>> step = jax.jit(jaxaccum.value_and_grad(loss_fn, num_micro_batches=4))
  >>> loss, grads = step(w, batch)
  >>> ref_loss, ref_grads = jax.value_and_grad(loss_fn)(w, batch)
  >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads, ref_grads))
  (True, True)
  """
  opts = _Options(
      fun=fun, num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size,
      argnums=argnums, batch_argnums=batch_argnums, has_aux=has_aux, reduce=reduce,
      aux_reduce=aux_reduce, rng_argnums=rng_argnums, state_argnums=state_argnums,
      accumulator_dtype=accumulator_dtype, grads_dtype=grads_dtype, remat=remat,
      remat_policy=remat_policy, unroll=unroll, data_axis=data_axis, mesh=mesh)

  @functools.wraps(fun)
  def value_and_grad_fn(*args, **kwargs):
    if opts.data_axis is not None:
      value, extra, grads = _sharding.data_parallel(opts, _accumulate, args, kwargs)
    else:
      value, extra, grads = _accumulate(opts, args, kwargs)
    grads = grads[0] if opts.argnums_is_int else grads
    has_extra = opts.has_aux or bool(opts.state_argnums)
    return ((value, extra), grads) if has_extra else (value, grads)

  return value_and_grad_fn


def grad(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
  """Like :func:`jax.grad`, accumulated over micro-batches; options as :func:`value_and_grad`.

  Returns a function giving ``grads``, or ``(grads, aux)`` when ``has_aux`` or
  ``state_argnums`` is set (the aux part as in :func:`value_and_grad`).

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> loss_fn = lambda w, x: jnp.mean((x * w) ** 2)
  >>> jaxaccum.grad(loss_fn, micro_batch_size=2)(jnp.array(2.0), jnp.arange(4.0))
  Array(14., dtype=float32)
  """
  vg = value_and_grad(fun, **options)
  has_extra = bool(options.get("has_aux")) or bool(_split.normalize_argnums(
      "state_argnums", options.get("state_argnums"), allow_empty=True))

  @functools.wraps(fun)
  def grad_fn(*args, **kwargs):
    (value, grads) = vg(*args, **kwargs)
    if has_extra:
      return grads, value[1]
    return grads

  return grad_fn
