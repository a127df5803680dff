"""``jaxaccum.MultiSteps``: accumulate gradients across calls, with token weighting.

A drop-in replacement for :class:`optax.MultiSteps` whose ``update`` also takes ``weight=``
(see :class:`MultiSteps`).

How a window's mode is tracked: whether a call is weighted is a trace-time property of
that call (``weight`` given or not), but which calls share a window depends on the
run-time counter ``mini_step``. The state therefore records the mode of the open window
(``MultiStepsState.weighted``), and each call compares it with its own mode inside the
compiled step (:func:`_fail`), like the other checks on run-time values (a negative
weight, a schedule returning ``k < 1``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxaccum._core import _info, _reduce, _sharding, _stats, _validate
from jaxaccum._core._types import PyTree
from jaxaccum._parallel import _axes

# The defaults' leaves below (the empty AccumInfo's too, jax.Array in its fields) are numpy
# scalars, so that importing jaxaccum does not start a JAX backend.
_I0 = cast(jax.Array, np.int32(0))
_F0 = cast(jax.Array, np.float32(0))


class MultiStepsState(NamedTuple):
  """State of :class:`jaxaccum.MultiSteps`: :class:`optax.MultiStepsState`'s fields, then more.

  The first five fields are :class:`optax.MultiStepsState`'s, in its order; the others
  are appended, so code that reads optax's fields by name or position keeps working.

  Attributes:
    mini_step: micro-steps accumulated in the open window (int32); reset to 0 when the
      window is emitted.
    gradient_step: optimizer steps taken so far (int32): the count the inner optimizer's
      schedules see.
    inner_opt_state: the wrapped optimizer's state.
    acc_grads: the running (weighted) mean of the window's gradients, or their
      (weighted) sum with ``use_grad_mean=False``, in ``accumulator_dtype``; with
      ``data_axis``, of their per-device pieces (a leading axis of the data shards).
    skip_state: what ``should_skip_update_fn`` returned on the last call (``()`` without
      one).
    acc_weight: the total weight of the open window: the sum of ``weight`` over its
      calls, or the number of calls when they pass no weight (float32).
    weighted: whether the open window's calls pass ``weight`` (bool).
    skipped: calls dropped by ``skip_nonfinite=True`` since :meth:`MultiSteps.init`
      (int32, saturating).
    acc_grad_sq_norm: with ``with_info=True``, the sum of ``|g_i|^2`` over the open
      window's samples (float32); 0 otherwise.
    acc_inv_size: with ``with_info=True``, the sum of ``1 / b_i`` over the open window's
      samples (float32); 0 otherwise.
    num_samples: with ``with_info=True``, the open window's samples (int32): its calls,
      less those of weight 0; 0 otherwise.
    window_skipped: the open window's calls dropped by ``skip_nonfinite=True`` (int32).
    info: with ``with_info=True``, the :class:`jaxaccum.AccumInfo` of the window that
      this call completed; on a call that completes none, and without ``with_info``, an
      empty one (``num_micro_batches == 0``, NaN estimates).
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: Any
  acc_grads: Any
  skip_state: Any = ()
  acc_weight: Any = np.float32(0)
  weighted: Any = np.bool_(False)
  skipped: Any = np.int32(0)
  acc_grad_sq_norm: Any = np.float32(0)
  acc_inv_size: Any = np.float32(0)
  num_samples: Any = np.int32(0)
  window_skipped: Any = np.int32(0)
  info: Any = _info.AccumInfo(
      num_micro_batches=_I0, micro_batch_size=_F0, batch_size=_F0, micro_grad_sq_norm=_F0,
      batch_grad_sq_norm=_F0, num_samples=_I0, skipped=_I0)


_REFUSED = "MultiSteps: refused when the compiled step ran: "


def _quiet_refusals(record: logging.LogRecord) -> bool:
  """Drops JAX's log of a failed callback when the failure is one of our refusals: the
  refusal reaches the caller as the step's error, and a second traceback on stderr,
  before it, buried the message."""
  error = record.exc_info[1] if record.exc_info else None
  return not (isinstance(error, ValueError) and str(error).startswith(_REFUSED))


# jax.debug.callback logs the exception of a failing callback on this logger, then fails
# the step; only our own refusals are filtered out.
logging.getLogger("jax._src.debugging").addFilter(_quiet_refusals)


def _fail(pred: jax.typing.ArrayLike, message: str, *values: Any) -> None:
  """Raises ``ValueError(message.format(*values))`` when ``pred`` holds, even under jit.

  A concrete ``pred`` raises now. A traced one adds a :func:`jax.lax.cond` whose taken
  branch calls back to Python to raise: nothing runs on the host while checks pass. JAX
  reports an exception raised inside a compiled step as a
  :class:`jax.errors.JaxRuntimeError` whose message ends with the ``ValueError`` and its
  text (``MultiSteps: refused when the compiled step ran: ...``); the log of the failed
  callback that JAX would print before it is left out.
  """
  try:
    failed = bool(pred)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError):
    pass
  else:
    if failed:
      raise ValueError(message.format(*(np.asarray(v) for v in values)))
    return

  def callback(pred, *values):
    # Under vmap the predicate is batched and both branches may run: check it again.
    if np.any(pred):
      bad = np.asarray(pred)
      values = [np.asarray(v)[bad] if np.ndim(v) else v for v in values] if bad.ndim else values
      raise ValueError(_REFUSED + message.format(*values))

  lax.cond(pred, lambda: jax.debug.callback(callback, pred, *values), lambda: None)


def _check_weight(weight: Any, dtype: Any, *, allow_nonfinite: bool = False) -> jax.Array:
  """Validates ``weight`` (a non-negative real scalar) and returns it in ``dtype``.

  Python numbers, numpy values and concrete arrays are checked now; a traced weight's
  sign is checked when the compiled step runs. With ``allow_nonfinite`` a NaN or infinite
  weight passes (the caller skips the call).
  """
  what = ("the number of items (e.g. real tokens) that this micro-batch's mean loss was "
          "taken over")
  if _validate.is_bool(weight):
    raise TypeError(f"weight must be a non-negative number, {what}; got weight={weight!r}.")
  try:
    concrete = np.asarray(weight)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    concrete = None
  shape, dtype_in = ((concrete.shape, concrete.dtype) if concrete is not None
                     else (weight.shape, weight.dtype))
  if shape != ():
    raise TypeError(
        f"weight must be a scalar, {what}; got weight as {_validate.describe(weight)} (shape "
        f"{tuple(shape)}). Reduce it first, e.g. weight=jnp.sum(mask)."
    )
  if not (jnp.issubdtype(dtype_in, jnp.integer) or jnp.issubdtype(dtype_in, jnp.floating)):
    raise TypeError(
        f"weight must have an integer or floating dtype, {what}; got {_validate.describe(weight)}.")
  negative = ("weight must be non-negative (" + what + "), got weight={}. Pass the count of "
              "real items, 0 for a micro-batch that has none.")
  if concrete is not None:
    _fail(not concrete >= 0 and not (allow_nonfinite and not np.isfinite(concrete)), negative,
          concrete)
    return jnp.asarray(concrete, dtype)
  w = weight.astype(dtype)
  _fail((w < 0) & jnp.isfinite(w) if allow_nonfinite else ~(w >= 0), negative, w)
  return w


class _Step(NamedTuple):
  """The open window after one call's gradients are added (:class:`MultiStepsState`'s
  fields of the same names), and the call itself: whether it passes ``weight``, its size
  ``b_i`` for the statistics, and whether ``skip_nonfinite`` drops it."""

  acc_grads: Any
  acc_weight: jax.Array
  acc_grad_sq_norm: jax.Array
  acc_inv_size: jax.Array
  num_samples: jax.Array
  weighted: bool
  size: jax.Array
  nonfinite: jax.Array


def _zeros_like(x: Any) -> jax.Array:
  """Zeros of ``x``'s shape, dtype and ``Explicit`` sharding (an array or a
  :class:`jax.ShapeDtypeStruct`): both branches of the step's ``cond`` must type them alike."""
  return _sharding.conform(jnp.zeros(x.shape, x.dtype), x)


def _increment(x: jax.Array) -> jax.Array:
  """``x + 1``, saturating at the largest int32 (as :func:`optax.safe_increment`)."""
  return jnp.where(x < jnp.iinfo(x.dtype).max, x + 1, x)


class MultiSteps:
  """Accumulates gradients over ``k`` calls, then applies the inner optimizer once.

  A drop-in replacement for :class:`optax.MultiSteps`: the same arguments, methods
  (:meth:`init`, :meth:`update`, :meth:`has_updated`, :meth:`gradient_transformation`,
  :attr:`inner_opt`) and state fields, and the same behaviour. Calls that do not complete
  the window return zero updates; the call that does passes the window's mean gradient
  to the inner optimizer and returns its updates. The inner optimizer (its step count,
  schedules, clipping, weight decay) therefore sees one step per window, exactly as if
  it received the gradient of the whole effective batch.

  What it adds is ``update(grads, state, params, weight=w)``: when ``grads`` is the
  gradient of a micro-batch's *mean* loss over ``w`` items (real tokens, say), the
  emitted gradient is ``sum_i(w_i * g_i) / sum_i(w_i)``, the gradient of the mean over all
  the window's items. :class:`optax.MultiSteps` takes the plain mean of the ``g_i``,
  which is wrong for token-level losses when micro-batches hold different numbers of
  tokens. A call with ``w == 0`` contributes nothing, even if its gradient is NaN (the
  mean over zero tokens); a window whose total weight is 0 emits a zero gradient.

  Every call of a window must pass ``weight`` or none must: mixing is an error (checked
  under jit, see below). Consecutive windows may differ.

  Memory: the state holds ``acc_grads``, a parameter-sized buffer in ``accumulator_dtype``
  that persists between calls. :func:`jaxaccum.value_and_grad` instead accumulates
  inside one step and frees its accumulator when the step ends.

  Args:
    opt: the wrapped optimizer (an :class:`optax.GradientTransformation`).
    every_k_schedule: the number ``k >= 1`` of calls per optimizer step, as an int, or a
      function of the optimizer step count (``state.gradient_step``) returning it, which
      can vary the effective batch size over training.
    use_grad_mean: if ``True`` (the default) the window's gradients are averaged
      (weighted by ``weight`` when given). If ``False`` they are summed, each multiplied
      by its ``weight`` when given.
    should_skip_update_fn: optional ``fn(updates, gradient_step, params) -> (skip,
      skip_state)`` as in :class:`optax.MultiSteps` (e.g. :func:`optax.skip_not_finite`):
      a call for which ``skip`` is true leaves the state unchanged (but for
      ``skip_state``) and returns zero updates, as if it never happened.
    accumulator_dtype: dtype of ``acc_grads``; float32 by default, ``None`` for the
      parameters' dtypes.
    with_info: if ``True``, keep the window's gradient-noise statistics and store them
      in ``state.info`` (below). It costs one squared-norm reduction over each call's
      gradients; without it ``state.info`` stays empty.
    micro_batch_size: the size ``b`` behind each unweighted call's gradient (rows, say),
      used only by the statistics (``with_info=True``); ``None`` (the default) counts
      sizes in calls. Weighted calls use their ``weight`` instead.
    skip_nonfinite: if ``True``, a call whose gradients hold a NaN or an infinity (only
      counted when its ``weight`` is positive), or whose ``weight`` is NaN or infinite, is
      dropped: it returns zero updates, leaves the open window as it was (the next good
      call continues it) and adds 1 to ``state.skipped`` (and, with ``with_info=True``,
      to the window's ``info.skipped``). It costs one ``isfinite`` reduction per call.
    data_axis: the mesh axis name (or names) of a data-parallel mesh, for gradients that
      are per-device pieces: each ``updates`` leaf has a leading axis of the ``D`` data
      shards, sharded over ``data_axis``, and the gradient is its sum over that axis, as
      :func:`jaxaccum.local_value_and_grad` returns them. The calls add the pieces into a
      ``(D, *param.shape)`` accumulator on each device without communicating; the call
      that completes the window sums them over the devices, once (one all-reduce of the
      whole gradient, in float32 or the wider ``accumulator_dtype``), then applies the
      inner optimizer. ``should_skip_update_fn`` sees the pieces, and ``skip_nonfinite``
      costs one boolean all-reduce per call; ``with_info`` is not available.
      ``data_axis=jaxaccum.DataParallel(axis, mesh=mesh)`` names the mesh holding the axes
      (a ``DataParallel`` with a placement is refused: the pieces come reduced by
      nothing); without a mesh, the one set with :func:`jax.set_mesh` when :meth:`init`
      runs.
    mesh: deprecated (kept for one release with a :class:`DeprecationWarning`): pass
      ``data_axis=jaxaccum.DataParallel(axis, mesh=mesh)``.

  Raises:
    ValueError, TypeError: ``every_k_schedule`` is not a positive int or a callable,
      ``accumulator_dtype`` is not a floating dtype, ``micro_batch_size`` or
      ``skip_nonfinite`` is of the wrong type or value, ``data_axis`` or ``mesh`` is bad,
      or ``with_info`` is combined with ``data_axis``.

  Statistics (``with_info=True``): each call's gradient ``g_i`` is one sample of its
  window, of size ``b_i`` (its ``weight``, else ``micro_batch_size``); the emitted
  (weighted) mean is ``G_B`` over ``B = sum_i b_i``. The call that completes a window
  stores in ``state.info`` a :class:`jaxaccum.AccumInfo` with the mean of ``|g_i|^2``,
  ``|G_B|^2``, ``B`` and ``b`` (the harmonic mean of the ``b_i``), from which
  ``info.grad_sq_norm_estimate()``, ``info.trace_cov_estimate()`` and ``info.b_simple()``
  follow, exactly as for :func:`jaxaccum.value_and_grad` with ``with_info=True``; feed it
  to :class:`jaxaccum.NoiseScale`. Other calls store an empty one (no samples, NaN
  estimates). ``|g_i|^2`` is taken on ``updates`` as passed, so pass the gradient of a
  *mean* loss; gradients of sums scale both estimates by ``b**2`` and leave their ratio
  unchanged. ``info.num_micro_batches`` counts the window's calls, skipped ones included.

  Checks on values only known when the compiled step runs (a negative weight, mixed
  weighted and unweighted calls in one window, ``every_k_schedule`` returning a value
  below 1) raise a ``ValueError`` from a :func:`jax.debug.callback` that only runs when
  the check fails; under :func:`jax.jit` it reaches you as a
  :class:`jax.errors.JaxRuntimeError` whose message names the argument. Python values
  and concrete arrays are checked at once.

  >>> import jax, jax.numpy as jnp, optax
  >>> import jaxaccum
  >>> opt = jaxaccum.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
  >>> params = jnp.zeros(2)
  >>> state = opt.init(params)
  >>> # Micro-batch 1: mean gradient over 1 real token; micro-batch 2: over 3 tokens.
  >>> updates, state = opt.update(jnp.array([4.0, 0.0]), state, params, weight=1)
  >>> updates, bool(opt.has_updated(state))
  (Array([0., 0.], dtype=float32), False)
  >>> updates, state = opt.update(jnp.array([0.0, 4.0]), state, params, weight=3)
  >>> updates, bool(opt.has_updated(state))  # -(1 * g1 + 3 * g2) / 4
  (Array([-1., -3.], dtype=float32), True)
  """

  def __init__(
      self,
      opt: optax.GradientTransformation,
      every_k_schedule: int | Callable[[jax.Array], jax.typing.ArrayLike],
      use_grad_mean: bool = True,
      should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
      accumulator_dtype: jax.typing.DTypeLike | None = jnp.float32,
      *,
      with_info: bool = False,
      micro_batch_size: float | None = None,
      skip_nonfinite: bool = False,
      data_axis: str | Sequence[str] | _axes.DataParallel | None = None,
      mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  ):
    if not (hasattr(opt, "init") and hasattr(opt, "update")):
      raise TypeError(
          f"opt must be an optax.GradientTransformation (with init and update), got "
          f"{_validate.describe(opt)}.")
    self._opt = optax.with_extra_args_support(opt)
    want = ("every_k_schedule must be a positive int (micro-steps per optimizer step) or a "
            "function of the optimizer step returning one, got every_k_schedule=")
    if _validate.is_int(every_k_schedule):
      if every_k_schedule < 1:
        raise ValueError(f"{want}{every_k_schedule}. Use 1 to update on every call.")
      k = int(every_k_schedule)
      self._every_k_schedule = lambda step: k
    elif callable(every_k_schedule):
      self._every_k_schedule = every_k_schedule
    else:
      raise TypeError(
          f"{want}{every_k_schedule!r} of type {type(every_k_schedule).__name__}.")
    self._use_grad_mean = _validate.check_bool("use_grad_mean", use_grad_mean)
    if should_skip_update_fn is not None and not callable(should_skip_update_fn):
      raise TypeError(
          "should_skip_update_fn must be a function (updates, gradient_step, params) -> "
          f"(skip, skip_state), such as optax.skip_not_finite; got {should_skip_update_fn!r}.")
    self._should_skip_update_fn = should_skip_update_fn or _never_skip
    dtype = _reduce.check_dtype("accumulator_dtype", accumulator_dtype)
    self._accumulator_dtype = None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)
    # The total weight: float32, or wider if the accumulator is.
    self._weight_dtype = jnp.promote_types(jnp.float32, self._accumulator_dtype or jnp.float32)
    what = ("a positive number (the rows or items behind each unweighted call's gradient, "
            "used only for the noise-scale statistics); leave it None to count sizes in calls")
    if micro_batch_size is None:
      micro_batch_size = 1
    elif not _validate.is_real(micro_batch_size):
      raise TypeError(f"micro_batch_size must be {what}; got {micro_batch_size!r}.")
    elif not 0 < micro_batch_size < np.inf:
      raise ValueError(
          f"micro_batch_size must be {what}; got micro_batch_size={micro_batch_size}.")
    self._micro_batch_size = float(micro_batch_size)
    self._with_info = _validate.check_bool("with_info", with_info)
    if not self._with_info and self._micro_batch_size != 1:
      raise ValueError(
          f"micro_batch_size={micro_batch_size} is used only by the statistics; pass "
          "with_info=True as well, or leave micro_batch_size unset.")
    self._skip_nonfinite = _validate.check_bool("skip_nonfinite", skip_nonfinite)
    axis, mesh = _axes.unreduced_axes(
        "MultiSteps", data_axis, {} if mesh is None else {"mesh": mesh})
    self._data_axis = _axes.check_data_axis(axis)
    self._mesh = _axes.check_mesh(mesh, self._data_axis)
    if self._data_axis is not None and self._with_info:
      raise ValueError(
          f"with_info=True cannot be combined with data_axis={data_axis!r}: the statistics "
          "need each call's reduced gradient, one all-reduce per call, which is what "
          "data_axis avoids. Drop with_info, or data_axis (and pass reduced gradients).")

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer (with extra-argument support, as in optax)."""
    return self._opt

  def init(self, params: optax.Params) -> MultiStepsState:
    """The initial state: an empty window and the inner optimizer's initial state."""
    gradient_step = jnp.zeros([], jnp.int32)
    _, skip_state = self._should_skip_update_fn(
        optax.tree.zeros_like(params), gradient_step, params)
    return MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=gradient_step,
        inner_opt_state=self._opt.init(params),
        acc_grads=(optax.tree.zeros_like(params, dtype=self._accumulator_dtype)
                   if self._data_axis is None else self._shard_zeros(params)),
        skip_state=skip_state,
        acc_weight=jnp.zeros([], self._weight_dtype),
        weighted=jnp.zeros([], jnp.bool_),
        skipped=jnp.zeros([], jnp.int32),
        acc_grad_sq_norm=jnp.zeros([], jnp.float32),
        acc_inv_size=jnp.zeros([], jnp.float32),
        num_samples=jnp.zeros([], jnp.int32),
        window_skipped=jnp.zeros([], jnp.int32),
        info=_empty_info(),
    )

  def _every_k(self, gradient_step: jax.Array) -> jax.Array:
    k = jnp.asarray(self._every_k_schedule(gradient_step))
    if k.shape != ():
      raise TypeError(f"every_k_schedule must return a scalar, got {_validate.describe(k)}.")
    if not jnp.issubdtype(k.dtype, jnp.integer):
      k = jnp.round(k)
    k = k.astype(jnp.int32)
    _fail(k < 1, "every_k_schedule returned {} at gradient_step={}; it must return a "
          "positive integer (micro-steps per optimizer step).", k, gradient_step)
    return k

  def update(
      self,
      updates: optax.Updates,
      state: MultiStepsState,
      params: optax.Params | None = None,
      *,
      weight: jax.typing.ArrayLike | None = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, MultiStepsState]:
    """Adds one micro-batch's gradients; every ``k``-th call applies the inner optimizer.

    Args:
      updates: the gradients of the micro-batch's loss (its mean over ``weight`` items
        when ``weight`` is given).
      state: the state from :meth:`init` or the previous call.
      params: the current parameters, passed to the inner optimizer.
      weight: optional non-negative scalar: the number of items (e.g. real tokens) that
        the micro-batch's mean loss was taken over. Give it on every call of a window or
        on none.
      **extra_args: passed to the inner optimizer's ``update`` on the call that completes
        the window.

    Returns:
      ``(updates, new_state)``: zeros until the window completes, then the inner
      optimizer's updates for the window's (weighted) mean gradient.

    Raises:
      TypeError: ``weight`` is not a real scalar, or ``should_skip_update_fn`` does not
        return a boolean scalar.
      ValueError: ``weight`` is negative, the window mixes weighted and unweighted
        calls, or ``every_k_schedule`` returns a value below 1. These depend on values
        that are traced under :func:`jax.jit`; there they are checked when the step
        runs, and JAX reports them as a :class:`jax.errors.JaxRuntimeError` whose last
        line is ``ValueError: MultiSteps: refused when the compiled step ran: `` and the
        same message (called outside jit, the ``ValueError`` itself).
    """
    w, k = self._check_call(state, weight)
    if self._data_axis is not None:
      self._check_pieces(updates, state)
    skip, skip_state = self._should_skip(updates, state, params)
    window = self._accumulate(updates, state, w)
    skip = skip | window.nonfinite
    emit = jnp.logical_and(~skip, jnp.asarray(state.mini_step) >= k - 1)

    def final_step():
      return self._final_step(updates, state, params, window, extra_args)

    def mid_step():
      return self._mid_step(state, window, skip, jax.eval_shape(final_step)[0])

    # Only the call that completes a window runs the inner optimizer.
    new_updates, new_state = lax.cond(emit, final_step, mid_step)
    return new_updates, new_state._replace(skip_state=skip_state)

  def _check_call(self, state: MultiStepsState,
                  weight: jax.typing.ArrayLike | None) -> tuple[jax.Array | None, jax.Array]:
    """Checks ``weight`` and the window's mode; returns the weight and the window's ``k``."""
    weighted = weight is not None
    w = (_check_weight(weight, self._weight_dtype, allow_nonfinite=self._skip_nonfinite)
         if weighted else None)
    k = self._every_k(state.gradient_step)
    mini_step = jnp.asarray(state.mini_step)
    _fail((mini_step > 0) & (jnp.asarray(state.weighted) != weighted),
          "MultiSteps.update was called " + ("with" if weighted else "without") +
          " weight= after {} call(s) " + ("without" if weighted else "with") +
          " it in the same window: weighted and unweighted calls cannot be mixed in one "
          "accumulation window. Pass weight= on every call of the window, or on none.",
          mini_step)
    return w, k

  def _should_skip(self, updates: optax.Updates, state: MultiStepsState,
                   params: optax.Params | None) -> tuple[jax.Array, Any]:
    """``should_skip_update_fn``'s ``(skip, skip_state)``, its ``skip`` checked."""
    skip, skip_state = self._should_skip_update_fn(updates, state.gradient_step, params)
    skip = jnp.asarray(skip)
    if (skip.dtype, skip.shape) != (jnp.bool_, ()):
      raise ValueError(  # optax.MultiSteps raises ValueError here too
          "should_skip_update_fn must return a boolean scalar array as its first output, "
          f"got {_validate.describe(skip)}.")
    return skip, skip_state

  def _accumulate(self, updates: optax.Updates, state: MultiStepsState,
                  w: jax.Array | None) -> _Step:
    """The open window with this call's gradients added, its statistics, and whether
    ``skip_nonfinite`` drops the call."""
    mini_step = jnp.asarray(state.mini_step)
    first = mini_step == 0
    # Whether this call is a sample of the window (a call of weight 0 adds nothing), and
    # its size b_i for the statistics.
    use = (w > 0) if w is not None else jnp.ones([], jnp.bool_)
    size = w if w is not None else jnp.asarray(self._micro_batch_size, self._weight_dtype)
    nonfinite = jnp.zeros([], jnp.bool_)
    if self._skip_nonfinite:
      nonfinite = use & ~_stats.all_finite(updates)
      if w is not None:
        nonfinite = nonfinite | ~jnp.isfinite(w)
    acc, total = self._add(updates, state, w, use)

    # The window's statistics after this call (used if it emits).
    num_samples = jnp.asarray(state.num_samples, jnp.int32)
    acc_sq = jnp.asarray(state.acc_grad_sq_norm, jnp.float32)
    acc_inv = jnp.asarray(state.acc_inv_size, jnp.float32)
    if self._with_info:  # one more pass over the gradients: their squared norm
      num_samples = jnp.where(first, 0, num_samples) + use
      acc_sq = jnp.where(first, 0, acc_sq) + jnp.where(use, _stats.sq_norm(updates), 0)
      acc_inv = jnp.where(first, 0, acc_inv) + jnp.where(
          use, 1 / jnp.where(use, size, 1), 0).astype(jnp.float32)
    return _Step(acc_grads=acc, acc_weight=total, acc_grad_sq_norm=acc_sq,
                 acc_inv_size=acc_inv, num_samples=num_samples, weighted=w is not None,
                 size=size, nonfinite=nonfinite)

  def _add(self, updates: optax.Updates, state: MultiStepsState, w: jax.Array | None,
           use: jax.Array) -> tuple[Any, jax.Array]:
    """``acc_grads`` and ``acc_weight`` with this call's gradients added: the (weighted)
    running mean, or the (weighted) sum with ``use_grad_mean=False``."""
    first = jnp.asarray(state.mini_step) == 0
    if w is not None:
      total = jnp.where(first, jnp.zeros_like(w), jnp.asarray(state.acc_weight, w.dtype)) + w
      if self._use_grad_mean:
        frac = jnp.where(use, w / jnp.where(use, total, 1), 0)
        add = lambda g, a: jnp.where(use, a + (g - a) * frac, a)  # noqa: E731
      else:
        add = lambda g, a: jnp.where(use, a + g * w, a)  # noqa: E731
    else:
      mini_step = jnp.asarray(state.mini_step)
      total = (mini_step + 1).astype(self._weight_dtype)
      if self._use_grad_mean:
        # Welford's running mean, exactly as optax.MultiSteps.
        add = lambda g, a: a + (g - a) / (mini_step + 1)  # noqa: E731
      else:
        add = lambda g, a: g + a  # noqa: E731
    return jax.tree.map(add, updates, state.acc_grads), total

  def _final_step(self, updates: optax.Updates, state: MultiStepsState,
                  params: optax.Params | None, window: _Step,
                  extra_args: dict[str, Any]) -> tuple[optax.Updates, MultiStepsState]:
    """The call that completes the window: the inner update on the window's (weighted) mean
    gradient, the window's statistics, and a new, empty window."""
    new_updates, new_inner = self._opt.update(
        optax.tree.cast_like(self._reduce_pieces(window.acc_grads), updates),
        state.inner_opt_state, params=params, **extra_args)
    new_inner = jax.tree.map(lambda new, old: jnp.astype(new, jnp.asarray(old).dtype),
                             new_inner, state.inner_opt_state)
    return new_updates, MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=_increment(jnp.asarray(state.gradient_step)).astype(jnp.int32),
        inner_opt_state=new_inner,
        acc_grads=jax.tree.map(lambda old: _zeros_like(jnp.asarray(old)), state.acc_grads),
        skip_state=(),  # update's own: it does not pass through the cond
        acc_weight=jnp.zeros([], self._weight_dtype),
        weighted=jnp.asarray(window.weighted, jnp.bool_),
        skipped=jnp.asarray(state.skipped, jnp.int32),
        acc_grad_sq_norm=jnp.zeros([], jnp.float32),
        acc_inv_size=jnp.zeros([], jnp.float32),
        num_samples=jnp.zeros([], jnp.int32),
        window_skipped=jnp.zeros([], jnp.int32),
        info=self._window_info(state, window) if self._with_info else _empty_info(),
    )

  def _window_info(self, state: MultiStepsState, window: _Step) -> _info.AccumInfo:
    """The statistics of the window completed by the call that gave ``window``."""
    num_samples, total = window.num_samples, window.acc_weight
    has = num_samples > 0
    mean = window.acc_grads if self._use_grad_mean else jax.tree.map(
        lambda a: a / jnp.where(total > 0, total, 1), window.acc_grads)
    batch_size = total if window.weighted else total * window.size
    window_skipped = jnp.asarray(state.window_skipped, jnp.int32)
    return _info.AccumInfo(
        num_micro_batches=(jnp.asarray(state.mini_step) + 1 + window_skipped).astype(jnp.int32),
        micro_batch_size=jnp.where(
            has, num_samples / jnp.where(has, window.acc_inv_size, 1), 0).astype(jnp.float32),
        batch_size=jnp.asarray(batch_size, jnp.float32),
        micro_grad_sq_norm=jnp.where(
            has, window.acc_grad_sq_norm / jnp.maximum(num_samples, 1), 0).astype(jnp.float32),
        batch_grad_sq_norm=_stats.sq_norm(mean),
        num_samples=num_samples.astype(jnp.int32),
        skipped=window_skipped.astype(jnp.int32),
    )

  def _mid_step(self, state: MultiStepsState, window: _Step, skip: jax.Array,
                update_shapes: Any) -> tuple[optax.Updates, MultiStepsState]:
    """A call inside the window: zero updates and the window with this call added, or as it
    was when the call is skipped."""

    def keep_or(old, new):
      old = jnp.asarray(old)
      return jnp.where(skip, old, new).astype(old.dtype)

    mini_step = jnp.asarray(state.mini_step)
    window_skipped = jnp.asarray(state.window_skipped, jnp.int32)
    return jax.tree.map(_zeros_like, update_shapes), MultiStepsState(
        mini_step=keep_or(mini_step, _increment(mini_step)).astype(jnp.int32),
        gradient_step=jnp.asarray(state.gradient_step).astype(jnp.int32),
        inner_opt_state=jax.tree.map(lambda old: jnp.astype(old, jnp.asarray(old).dtype),
                                     state.inner_opt_state),
        acc_grads=jax.tree.map(keep_or, state.acc_grads, window.acc_grads),
        skip_state=(),  # update's own: it does not pass through the cond
        acc_weight=keep_or(jnp.asarray(state.acc_weight, self._weight_dtype), window.acc_weight),
        weighted=keep_or(state.weighted, window.weighted).astype(jnp.bool_),
        skipped=jnp.where(window.nonfinite, _increment(jnp.asarray(state.skipped, jnp.int32)),
                          state.skipped).astype(jnp.int32),
        acc_grad_sq_norm=keep_or(jnp.asarray(state.acc_grad_sq_norm, jnp.float32),
                                 window.acc_grad_sq_norm),
        acc_inv_size=keep_or(jnp.asarray(state.acc_inv_size, jnp.float32),
                             window.acc_inv_size),
        num_samples=keep_or(jnp.asarray(state.num_samples, jnp.int32), window.num_samples),
        window_skipped=jnp.where(window.nonfinite, _increment(window_skipped),
                                 window_skipped).astype(jnp.int32),
        info=_empty_info(),
    )

  # --- data_axis: per-device gradient pieces, summed once per window ---------------------

  def _shard_zeros(self, params: optax.Params) -> Any:
    """The accumulator of per-device pieces: zeros of shape ``(D, *p.shape)`` per leaf, for
    the ``D`` data shards, the leading axis sharded over ``data_axis``."""
    assert self._data_axis is not None
    mesh = _axes.resolve_mesh(self._mesh, self._data_axis)
    shards = int(np.prod([mesh.shape[a] for a in self._data_axis]))
    zeros = jax.tree.map(lambda p: jnp.zeros(
        (shards, *jnp.shape(p)), self._accumulator_dtype or jnp.result_type(p)), params)
    spec = jax.sharding.PartitionSpec(self._data_axis)
    if isinstance(mesh, jax.sharding.Mesh):
      return jax.device_put(zeros, jax.sharding.NamedSharding(mesh, spec))
    if set(getattr(mesh, "explicit_axes", ())) & set(self._data_axis):
      return jax.tree.map(lambda x: jax.sharding.reshard(x, spec), zeros)
    return lax.with_sharding_constraint(zeros, spec)

  def _check_pieces(self, updates: optax.Updates, state: MultiStepsState) -> None:
    """Raises unless ``updates`` are per-device pieces shaped like the accumulator."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    acc_flat, acc_def = jax.tree.flatten(state.acc_grads)
    if treedef != acc_def:
      raise TypeError(
          f"updates have the structure {treedef}, but the parameters given to init have "
          f"{acc_def}.")
    for (path, g), a in zip(flat, acc_flat, strict=True):
      if jnp.shape(g) != jnp.shape(a):
        raise ValueError(
            f"MultiSteps(data_axis={self._data_axis!r}) accumulates per-device gradient "
            f"pieces with a leading axis of the {jnp.shape(a)[0]} data shards, shaped "
            f"{jnp.shape(a)} for updates{jax.tree_util.keystr(path)}, got "
            f"{_validate.describe(g)}. Compute the gradients with jaxaccum.local_value_and_grad"
            f"(loss, data_axis={self._data_axis!r}), or drop data_axis to pass reduced "
            "gradients.")

  def _reduce_pieces(self, acc: Any) -> Any:
    """The window's gradient: without ``data_axis`` the accumulator itself; with it the
    sum of the per-device pieces over their leading axis, in float32 or wider (one
    all-reduce over the data axes)."""
    if self._data_axis is None:
      return acc
    return jax.tree.map(
        lambda a: jnp.sum(a, axis=0, dtype=jnp.promote_types(a.dtype, jnp.float32)), acc)

  def has_updated(self, state: MultiStepsState | PyTree) -> jax.Array:
    """Whether the last call applied the inner optimizer (completed a window)."""
    return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This wrapper as an optax transformation, for :func:`optax.chain` and friends.

    It is a :class:`optax.GradientTransformationExtraArgs`, so ``weight=`` and other
    keyword arguments pass through :func:`optax.chain` and
    :func:`optax.inject_hyperparams` to :meth:`update`.
    """
    # update takes only a MultiStepsState, where optax's protocol names any optimizer state.
    update = cast(optax.TransformUpdateExtraArgsFn, self.update)
    return optax.GradientTransformationExtraArgs(init=self.init, update=update)


def _never_skip(updates: Any, gradient_step: Any, params: Any) -> tuple[jax.Array, tuple]:
  del updates, gradient_step, params
  return jnp.zeros([], jnp.bool_), ()


def _empty_info() -> _info.AccumInfo:
  """The statistics of a call that completes no window: no samples, NaN estimates."""
  return jax.tree.map(jnp.asarray, MultiStepsState._field_defaults["info"])
