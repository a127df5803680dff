"""``jaxaccum.contrib.AdaptiveBatch``: a micro-batch count that follows the measured gradient noise.

Every accumulated step measures, for free, the two quantities that say how large a batch
pays (:class:`jaxaccum.AccumInfo`: unbiased ``|G|^2`` and ``tr(Sigma)``).
:class:`AdaptiveBatch` closes the loop: it smooths them (:class:`jaxaccum.NoiseScale`),
derives a target batch from a rule, and moves ``k``, the micro-batches to run
(``active_micro_batches=k``, or the window of :class:`jaxaccum.MultiSteps`), towards it
with a warm-up, hysteresis, a minimum number of steps between changes and a growth limit.

The state is a ``NamedTuple`` of arrays (:class:`AdaptiveBatchState`): everything is pure
and jittable, one compiled program serves every ``k``, and the state checkpoints with the
rest of a run. It counts the samples seen (rows, or tokens under ``reduce="weighted"``)
exactly in two int32 words, so that learning-rate schedules can count samples.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum._batch_size import _counter, _multisteps
from jaxaccum._batch_size._noise import NoiseScale, NoiseScaleState
from jaxaccum._core import _split, _validate
from jaxaccum._core._info import AccumInfo

_INT32_MAX = _validate.INT32_MAX
_RULES = ("norm_test", "b_simple")
_LR_SCALINGS = ("none", "sqrt", "linear", "adascale")


# AdaptiveBatch's counts are ints up to int32's largest; its messages start "AdaptiveBatch:".
_check_int = functools.partial(_validate.check_int, "AdaptiveBatch", high=_INT32_MAX)
_check_float = functools.partial(_validate.check_float, "AdaptiveBatch")


class AdaptiveBatchState(NamedTuple):
  """State of :class:`jaxaccum.contrib.AdaptiveBatch`: ``k``, the smoothed noise, and counters.
  Experimental, as :class:`jaxaccum.contrib.AdaptiveBatch` is (measured, it did not beat a
  fixed ramp on the character LM).

  Attributes:
    micro_batches: int32, ``k``: the micro-batches the next step runs.
    noise: the :class:`jaxaccum.NoiseScaleState` of the smoothed ``|G|^2`` and
      ``tr(Sigma)`` (its ``count``: the steps whose estimates were finite).
    steps: int32, the completed steps seen (calls whose ``info`` has samples; a
      :class:`jaxaccum.MultiSteps` call that completes no window is not one), saturating.
    since_change: int32, completed steps since ``k`` last changed (saturating).
    samples_hi: int32, the high word of the sample count (units of ``2**24``).
    samples_lo: int32, the low word of the sample count, in ``[0, 2**24)``: the count is
      ``samples_hi * 2**24 + samples_lo`` (:meth:`AdaptiveBatch.samples`,
      :meth:`AdaptiveBatch.sample_count`), saturating at ``2**55 - 1`` (about
      ``3.6e16``). Each step adds its ``info.batch_size``, a float32, rounded to an
      integer: the count is exact while every step's samples are below ``2**24`` (float32
      holds every integer up to there); a step of more counts them as float32 holds them,
      within ``2**-24`` of their number (at most 1 off up to ``2**25``, 2 up to ``2**26``).
    micro_batch_samples: float32, the samples (rows or tokens) per micro-batch of the last
      completed step, all data shards together: ``info.batch_size`` over the micro-batches
      that ran and were not skipped (0 before any).
    progress: float32, the sum over completed steps of the learning-rate scale each ran
      with (:meth:`AdaptiveBatch.lr_scale`): steps at ``lr_scaling="none"``, AdaScale's
      scale-invariant iterations at ``"adascale"``; a clock for schedules. A compensated
      (Kahan) sum: within a few float32 roundings of the result (relative ``2e-7``),
      however many steps, where a plain float32 sum of a million steps of ``sqrt(1.5)``
      ends 1% high.
    progress_error: float32, the Kahan compensation of ``progress``: the exact sum is
      ``progress - progress_error`` to float32 round-off of ``progress_error``.
  """

  micro_batches: jax.Array
  noise: NoiseScaleState
  steps: jax.Array
  since_change: jax.Array
  samples_hi: jax.Array
  samples_lo: jax.Array
  micro_batch_samples: jax.Array
  progress: jax.Array
  progress_error: jax.Array


class _DefaultFloat(float):
  """A threshold that :class:`AdaptiveBatch` filled in because none was given.

  It reads as the float it holds, but ``dataclasses.replace`` passes it back to
  ``__init__``, where it counts as not given: ``replace(ab, rule="b_simple")`` then takes
  ``fraction``'s default instead of refusing the ``theta`` the user never passed.
  """

  __slots__ = ()


class _DefaultInt(int):
  """``init_micro_batches`` filled in by :class:`AdaptiveBatch` (see ``_DefaultFloat``)."""

  __slots__ = ()


def _kahan_add(total: jax.Array, error: jax.Array,
               x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``total + x`` with Kahan's compensation: ``total - error`` is the running sum to a few
  float32 rounding errors of the result, however many terms it has."""
  y = x - error
  new = total + y
  return new, (new - total) - y


def _refuse_if_concrete(short: jax.Array, k: jax.Array, pieces: jax.Array) -> None:
  """Raises when a concrete step ran fewer micro-batches than the ``k`` it was given."""
  try:
    refuse = bool(short)
  except jax.errors.ConcretizationTypeError:  # traced: update clamps k instead
    return
  if refuse:
    raise ValueError(
        f"AdaptiveBatch.update: the step ran info.num_micro_batches={int(pieces)} "
        f"micro-batches, fewer than the k={int(k)} the controller set: its "
        f"active_micro_batches exceeds the transform's num_micro_batches, which clips it. "
        f"Lower max_micro_batches to at most the transform's num_micro_batches "
        f"(AdaptiveBatch.check(transform, batch_size=...) verifies it).")


@dataclasses.dataclass(frozen=True)
class AdaptiveBatch:
  """Grows the micro-batch count ``k`` as the gradient noise says a larger batch pays.
  Experimental (:mod:`jaxaccum.contrib`): measured, it did not beat a fixed ramp. On the
  character LM a fixed ramp reached the target loss in fewer steps and fewer tokens (595 steps
  and 416,532 tokens against 1,142 and 429,165), and against the most token-efficient fixed
  batch it took x0.39 the steps at x1.14 the tokens (goal x0.75 and x1.10: not met;
  ``benchmarks/results/adaptive_lm.md``); it met that goal on linear regression at its defaults
  (x1.09 steps, x1.21 samples; ``adaptive_linreg.md``).

  Each step: ``k = ab.micro_batches(state)`` sets ``active_micro_batches=k`` (or the
  :class:`jaxaccum.MultiSteps` window), the step returns its :class:`jaxaccum.AccumInfo`
  (``with_info=True``), and ``state = ab.update(state, info)`` smooths the step's
  estimates of ``|G|^2`` and ``tr(Sigma)`` (:class:`jaxaccum.NoiseScale`, EMAs with
  ``decay``) and decides the next ``k``. All of it runs inside the one compiled step.

  Rules (``rule=``), both on the smoothed estimates, both asking for a target batch of
  ``B* = tr(Sigma) / (c |G|^2)`` samples:

  * ``"norm_test"`` (the default): the norm test of Byrd et al. (2012, "Sample size
    selection in optimization methods for machine learning") as used by Lau et al. (2024,
    arXiv 2412.21124) to grow the batch of language models: the batch ``B`` suffices
    while ``tr(Sigma) / B <= theta**2 |G|^2`` (the gradient's noise is small against the
    gradient); when the test fails the batch grows to the smallest that passes,
    ``B* = B_simple / theta**2``. Larger ``theta`` tolerates more noise: smaller batches,
    fewer samples, more steps.
  * ``"b_simple"``: the batch follows the simple noise scale, ``B* = fraction *
    B_simple``, the estimate of the critical batch size of McCandlish et al. (2018, "An
    Empirical Model of Large-Batch Training"); at ``B = B_noise`` their model spends twice
    the fewest steps and twice the fewest samples. Merrill et al. (2025, arXiv 2505.23971)
    grow the batch as the measured critical batch size grows. ``fraction=1`` is about the
    fewest steps; smaller fractions trade steps for samples.

  Both are the same family (``theta**2 = 1 / fraction``); what differs is the scale of
  their parameter and its default. The benchmark ``benchmarks/bench_adaptive.py``
  measures them against a sweep of fixed batches (see the adaptive-batch guide).

  How ``k`` moves: ``k* = B* / m`` with ``m`` the samples per micro-batch of the last
  step. Nothing changes during the first ``warmup_steps`` steps with finite estimates,
  within ``cooldown_steps`` completed steps of the last change, or on a step whose own
  estimates are not finite (one sample, or a :class:`jaxaccum.MultiSteps` call that
  completes no window). ``k`` grows when ``k* > (1 + hysteresis) k``, to ``ceil(k*)`` but
  at most ``max_growth`` times (and at least 1 more than) the current ``k``; with
  ``allow_decrease=True`` it shrinks when ``k* < k / (1 + hysteresis)``, symmetrically.
  It stays in ``[min_micro_batches, max_micro_batches]``. When ``|G|^2`` averages to a
  non-positive value while ``tr(Sigma)`` is positive, the noise dominates: ``k* = inf``.

  A step of one micro-batch on one device (or a :class:`jaxaccum.MultiSteps` window of one
  call) has no spread to measure: its estimates are NaN. So ``k`` starts at
  ``init_micro_batches``, 2 by default (or ``min_micro_batches`` when larger); on one
  device ``k`` never shrinks to 1, whatever ``min_micro_batches``; and a step that ran one
  micro-batch on one device (``init_micro_batches=1``) moves ``k`` to 2 at once, without
  waiting for warm-up or cooldown. Under ``data_axis`` each data shard's piece is a
  sample, and ``k = 1`` is fine. (The controller reads the shards per micro-batch from
  ``info.num_micro_batches``, ``k`` times the data shards.)

  A traced ``active_micro_batches`` above the transform's ``num_micro_batches`` is clipped
  to it. :meth:`check` refuses such a ``max_micro_batches`` where both are built; should
  a step still run fewer micro-batches than ``k`` (``info.num_micro_batches < k``),
  :meth:`update` raises when ``info`` is concrete and, under :func:`jax.jit`, takes the
  ``k`` that ran as the current one, so that :meth:`lr_scale` and the sample counts
  follow what ran. (With several data shards a clipped step can look like one that ran
  ``k``: :meth:`check` is the guard there.)

  Learning rate (``lr_scaling=``): :meth:`lr_scale` is the factor for the base learning
  rate (the one tuned at ``k0 = init_micro_batches``), ``S = k / k0``: ``"none"`` (1, the
  default), ``"sqrt"`` (``sqrt(S)``), ``"linear"`` (``S``) or ``"adascale"``: AdaScale's
  gain (Johnson et al. 2020) ``r = (tr(Sigma)/B0 + |G|^2) / (tr(Sigma)/B + |G|^2)`` with
  ``B = S B0``, from the smoothed estimates, between 1 and ``S`` (1 before any estimate).
  ``state.progress`` sums it over steps, AdaScale's scale-invariant clock;
  :meth:`samples` counts samples: both can drive an optax schedule in place of the
  step count.

  Args:
    max_micro_batches: the largest ``k``, at most the ``num_micro_batches`` of the
      transform whose ``active_micro_batches`` it sets (:meth:`check` verifies it).
    min_micro_batches: the smallest ``k``.
    init_micro_batches: ``k`` at :meth:`init`; ``None`` for ``max(min_micro_batches, 2)``
      (capped at ``max_micro_batches``).
    rule: ``"norm_test"`` or ``"b_simple"`` (above).
    theta: the norm test's tolerance (``rule="norm_test"`` only); ``None`` for 3.
    fraction: the fraction of ``B_simple`` to follow (``rule="b_simple"`` only); ``None``
      for 0.25.
    decay: the decay of the EMAs (:class:`jaxaccum.NoiseScale`), in ``[0, 1)``.
    warmup_steps: steps with finite estimates before ``k`` may change.
    cooldown_steps: the fewest completed steps between two changes of ``k``.
    hysteresis: the relative margin ``k*`` must clear before ``k`` moves.
    max_growth: the largest factor of one change (> 1).
    allow_decrease: whether ``k`` may shrink (monotone by default).
    lr_scaling: ``"none"``, ``"sqrt"``, ``"linear"`` or ``"adascale"`` (above).

  Raises:
    TypeError, ValueError: a count is not a Python int in range, ``min_micro_batches >
      max_micro_batches``, ``init_micro_batches`` outside them, an unknown ``rule`` or
      ``lr_scaling``, a threshold given for the other rule or out of range.

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> ab = jaxaccum.contrib.AdaptiveBatch(16, warmup_steps=1, cooldown_steps=0)
  >>> state = ab.init()
  >>> int(ab.micro_batches(state))
  2
  >>> # One step of 2 micro-batches of 4 rows: |G|^2 = 1 and tr(Sigma) = 288 (B_simple 288).
  >>> info = jaxaccum.AccumInfo(
  ...     num_micro_batches=jnp.int32(2), micro_batch_size=jnp.float32(4),
  ...     batch_size=jnp.float32(8), micro_grad_sq_norm=jnp.float32(73.0),
  ...     batch_grad_sq_norm=jnp.float32(37.0), num_samples=jnp.int32(2),
  ...     skipped=jnp.int32(0))
  >>> state = ab.update(state, info)
  >>> # B* = 288 / 3**2 = 32 rows = 8 micro-batches, limited to 2 * 2 = 4 in one change.
  >>> int(ab.micro_batches(state)), ab.sample_count(state)
  (4, 8)
  """

  max_micro_batches: int
  min_micro_batches: int = 1
  init_micro_batches: int | None = None
  rule: str = "norm_test"
  theta: float | None = None
  fraction: float | None = None
  decay: float = 0.95
  warmup_steps: int = 10
  cooldown_steps: int = 5
  hysteresis: float = 0.25
  max_growth: float = 2.0
  allow_decrease: bool = False
  lr_scaling: str = "none"

  def __post_init__(self):
    kmax = _check_int("max_micro_batches", self.max_micro_batches, low=1,
                      what="the largest number of micro-batches to run", example="64")
    kmin = _check_int("min_micro_batches", self.min_micro_batches, low=1,
                      what="the smallest number of micro-batches to run", example="1")
    if kmin > kmax:
      raise ValueError(
          f"AdaptiveBatch: min_micro_batches={kmin} is larger than max_micro_batches={kmax}; "
          "lower min_micro_batches or raise max_micro_batches.")
    k0 = self.init_micro_batches
    if k0 is None or isinstance(k0, _DefaultInt):
      k0 = _DefaultInt(min(max(kmin, 2), kmax))
    else:
      k0 = _check_int("init_micro_batches", k0, low=1,
                      what="the micro-batches of the first step", example="2")
      if not kmin <= k0 <= kmax:
        raise ValueError(
            f"AdaptiveBatch: init_micro_batches={k0} must lie in [min_micro_batches, "
            f"max_micro_batches] = [{kmin}, {kmax}]; pass an init_micro_batches in that "
            "range, or init_micro_batches=None for the default max(min_micro_batches, 2).")
    rule = _validate.check_choice("AdaptiveBatch", "rule", self.rule, _RULES)
    theta, fraction = self.theta, self.fraction
    # Values filled in by an earlier __post_init__ (dataclasses.replace) count as not given.
    theta = None if isinstance(theta, _DefaultFloat) else theta
    fraction = None if isinstance(fraction, _DefaultFloat) else fraction
    if rule == "norm_test":
      if fraction is not None:
        raise ValueError(
            f"AdaptiveBatch: fraction={fraction!r} is the parameter of rule='b_simple'; "
            "rule='norm_test' takes theta (e.g. theta=3.0). Drop fraction (fraction=None "
            "in dataclasses.replace) or pass rule='b_simple'.")
      theta = _check_float("theta", 3.0 if theta is None else theta, low=0.0, strict=True,
                           what="the norm test's tolerance on the gradient noise",
                           example="3.0")
      theta = _DefaultFloat(theta) if self.theta is None or isinstance(
          self.theta, _DefaultFloat) else theta
    else:
      if theta is not None:
        raise ValueError(
            f"AdaptiveBatch: theta={theta!r} is the parameter of rule='norm_test'; "
            "rule='b_simple' takes fraction (e.g. fraction=0.25). Drop theta (theta=None in "
            "dataclasses.replace) or pass rule='norm_test'.")
      fraction = _check_float("fraction", 0.25 if fraction is None else fraction, low=0.0,
                              strict=True, what="the fraction of B_simple to follow",
                              example="0.25")
      fraction = _DefaultFloat(fraction) if self.fraction is None or isinstance(
          self.fraction, _DefaultFloat) else fraction
    noise = NoiseScale(decay=self.decay)  # validates decay
    warmup = _check_int("warmup_steps", self.warmup_steps, low=0,
                        what="steps with finite estimates before k may change", example="10")
    cooldown = _check_int("cooldown_steps", self.cooldown_steps, low=0,
                          what="the fewest completed steps between two changes of k",
                          example="5")
    hysteresis = _check_float("hysteresis", self.hysteresis, low=0.0, strict=False,
                              what="the relative margin the target must clear",
                              example="0.25")
    growth = _check_float("max_growth", self.max_growth, low=1.0, strict=True,
                          what="the largest factor of one change", example="2.0")
    if not _validate.is_bool(self.allow_decrease):
      raise TypeError(
          f"AdaptiveBatch: allow_decrease must be a bool, got "
          f"{_validate.describe(self.allow_decrease)}.")
    lr_scaling = _validate.check_choice("AdaptiveBatch", "lr_scaling", self.lr_scaling,
                                        _LR_SCALINGS)
    for name, value in (("max_micro_batches", kmax), ("min_micro_batches", kmin),
                        ("init_micro_batches", k0), ("theta", theta), ("fraction", fraction),
                        ("decay", noise.decay), ("warmup_steps", warmup),
                        ("cooldown_steps", cooldown), ("hysteresis", hysteresis),
                        ("max_growth", growth), ("allow_decrease", bool(self.allow_decrease)),
                        ("lr_scaling", lr_scaling)):
      object.__setattr__(self, name, value)

  # --- configuration -------------------------------------------------------------------

  @property
  def noise_scale(self) -> NoiseScale:
    """The :class:`jaxaccum.NoiseScale` that smooths the estimates (``state.noise``)."""
    return NoiseScale(decay=self.decay)

  @property
  def _c(self) -> float:
    """``B* = tr(Sigma) / (c |G|^2)``: ``theta**2`` or ``1 / fraction``."""
    if self.rule == "norm_test":
      assert self.theta is not None
      return self.theta ** 2
    assert self.fraction is not None
    return 1.0 / self.fraction

  @property
  def _k0(self) -> int:
    assert self.init_micro_batches is not None  # set by __post_init__
    return self.init_micro_batches

  def check(self, transform: Any, *, batch_size: int | None = None) -> AdaptiveBatch:
    """Checks that this controller can drive ``transform``; returns ``self``.

    Under :func:`jax.jit` an ``active_micro_batches`` above the transform's
    ``num_micro_batches`` is clipped, not refused, and a transform built without
    ``with_info=True`` gives no statistics to adapt on (a :class:`jaxaccum.MultiSteps`
    without it reports empty windows: the controller would hold ``k`` forever). Call this
    once where both are built.

    A transform built with ``micro_batch_size=`` splits each batch into ``N =
    batch_size // micro_batch_size`` micro-batches, so ``N`` depends on the batch: pass
    the rows of a step as ``batch_size=``. (:meth:`update` also notices a step that ran
    fewer micro-batches than ``k``, from ``info.num_micro_batches``; see there.)

    Args:
      transform: what :func:`jaxaccum.value_and_grad` or :func:`jaxaccum.grad` returned
        (the object itself, not a jitted wrapper), or a :class:`jaxaccum.MultiSteps`.
      batch_size: the rows of each step's batch (all data shards together); needed, and
        used, only when ``transform`` was built with ``micro_batch_size=``.

    Raises:
      ValueError: ``transform`` has no statistics (``with_info=False``), its
        ``num_micro_batches`` is below ``max_micro_batches``, or it was built with
        ``micro_batch_size=`` and ``batch_size`` is missing or not a multiple of it.
      TypeError: ``transform`` is neither.
    """
    if isinstance(transform, _multisteps.MultiSteps):
      if not transform._with_info:  # noqa: SLF001 -- same package
        raise ValueError(
            "AdaptiveBatch needs the window statistics: build the MultiSteps with "
            "with_info=True (and micro_batch_size= the rows per call, to count samples "
            "in rows); with with_info=False its state.info is always empty.")
      return self
    vg = getattr(transform, "value_and_grad", transform)  # a Grad wraps a ValueAndGrad
    # A ValueAndGrad, known by what it holds (the wing sits below the API): its class runs
    # the core (a jitted wrapper's does not) and its options differentiate (an Evaluate's
    # do not).
    opts = getattr(vg, "options", None)
    if not (callable(getattr(type(vg), "run", None)) and opts is not None
            and not opts.evaluating):
      raise TypeError(
          "AdaptiveBatch.check takes what jaxaccum.value_and_grad or jaxaccum.grad "
          "returned (not a jitted wrapper), or a jaxaccum.MultiSteps; got "
          f"{_validate.describe(transform)}.")
    if not opts.with_info:
      raise ValueError(
          "AdaptiveBatch needs the step's statistics: build the transform with "
          "with_info=True, which returns the AccumInfo to pass to AdaptiveBatch.update.")
    count, how = opts.split.count, ""
    if count is None:  # built with micro_batch_size=: N follows from the batch
      assert opts.split.size is not None  # one of the two is set (make_options)
      if batch_size is None:
        raise ValueError(
            f"AdaptiveBatch.check: the transform splits each batch into micro-batches of "
            f"micro_batch_size={opts.split.size} rows, so its num_micro_batches depends on the "
            f"batch; pass the rows of a step, check(transform, batch_size=...), so that "
            f"max_micro_batches={self.max_micro_batches} can be checked against it.")
      size = _check_int("batch_size", batch_size, low=1, what="the rows of each step's batch",
                        example=str(opts.split.size * self.max_micro_batches))
      count = _split.resolve_count(size, None, opts.split.size)
      how = f" (batch_size={size} / micro_batch_size={opts.split.size})"
    if count < self.max_micro_batches:
      raise ValueError(
          f"AdaptiveBatch(max_micro_batches={self.max_micro_batches}) exceeds the "
          f"transform's num_micro_batches={count}{how}: active_micro_batches must lie in "
          f"1..{count}. Lower max_micro_batches to {count} or split the batch "
          f"into more micro-batches.")
    return self

  # --- state ---------------------------------------------------------------------------

  def init(self) -> AdaptiveBatchState:
    """The initial state: ``k = init_micro_batches``, no steps, no samples."""
    zero = jnp.zeros([], jnp.int32)
    return AdaptiveBatchState(
        micro_batches=jnp.asarray(self._k0, jnp.int32),
        noise=self.noise_scale.init(),
        steps=zero, since_change=zero, samples_hi=zero, samples_lo=zero,
        micro_batch_samples=jnp.zeros([], jnp.float32),
        progress=jnp.zeros([], jnp.float32), progress_error=jnp.zeros([], jnp.float32))

  def micro_batches(self, state: AdaptiveBatchState) -> jax.Array:
    """``k``, the int32 to pass as ``active_micro_batches`` (or a MultiSteps window)."""
    return jnp.asarray(state.micro_batches, jnp.int32)

  def every_k_schedule(self, state: AdaptiveBatchState) -> Callable[[Any], jax.Array]:
    """A :class:`jaxaccum.MultiSteps` ``every_k_schedule`` that returns this state's ``k``.

    Build the ``MultiSteps`` inside the jitted call, around this schedule of the
    controller's current state (its state's structure does not depend on ``k``, so
    :meth:`jaxaccum.MultiSteps.init` may use any schedule), then feed the call's
    ``state.info`` to :meth:`update`. ``k`` changes only on a call that completes a
    window (the others carry no samples), so every window runs the ``k`` chosen when it
    opened. See the adaptive-batch guide for the whole recipe.
    """
    k = self.micro_batches(state)
    return lambda gradient_step: k

  def update(self, state: AdaptiveBatchState, info: AccumInfo) -> AdaptiveBatchState:
    """Folds one step's statistics in, counts its samples and decides the next ``k``.

    Args:
      state: from :meth:`init` or the previous :meth:`update`.
      info: the :class:`jaxaccum.AccumInfo` of the step that ran with
        ``k = micro_batches(state)`` (``with_info=True``; a :class:`jaxaccum.MultiSteps`
        state's ``info`` on every call: calls that complete no window change nothing).

    Returns:
      The new state.

    Raises:
      TypeError: ``info`` is missing or not an :class:`jaxaccum.AccumInfo` of one step.
    """
    if info is None:
      raise TypeError(
          "AdaptiveBatch.update got info=None: it needs the step's jaxaccum.AccumInfo. "
          "Build the step with with_info=True (value_and_grad/grad/MultiSteps) and pass "
          "its info (a MultiSteps state's .info).")
    if not isinstance(info, AccumInfo):
      raise TypeError(
          "AdaptiveBatch.update takes the step's jaxaccum.AccumInfo (the third output of "
          "value_and_grad(..., with_info=True), or a MultiStepsState's .info), got "
          f"{_validate.describe(info)}. Build the step with with_info=True.")
    if not isinstance(state, AdaptiveBatchState):
      raise TypeError(
          "AdaptiveBatch.update takes the AdaptiveBatchState from init() or the previous "
          f"update, got {_validate.describe(state)}.")
    big = jnp.asarray(info.batch_size, jnp.float32)
    if big.shape != ():
      raise TypeError(
          f"AdaptiveBatch.update takes the AccumInfo of one step (scalar fields), got "
          f"batch_size of shape {tuple(big.shape)}; use jax.lax.scan over steps.")
    k = jnp.asarray(state.micro_batches, jnp.int32)
    ran = jnp.isfinite(big) & (big > 0)
    big = jnp.where(ran, big, 0.0)
    pieces = jnp.asarray(info.num_micro_batches, jnp.int32)
    # The micro-batches that ran: k, or the transform's N when k exceeded it (a traced
    # active_micro_batches above N runs N). Each ran as pieces / k_ran data-shard pieces.
    short = ran & (pieces < k)
    _refuse_if_concrete(short, k, pieces)
    k_ran = jnp.where(short, jnp.maximum(pieces, 1), k)
    shards = pieces.astype(jnp.float32) / k_ran.astype(jnp.float32)
    # Rows (or tokens) per micro-batch: batch_size counts the pieces that were not skipped.
    used = (pieces - jnp.asarray(info.skipped, jnp.int32)).astype(jnp.float32)
    fresh = ran & (used > 0)
    per_micro = jnp.where(fresh, big * shards / jnp.where(fresh, used, 1.0),
                          jnp.asarray(state.micro_batch_samples, jnp.float32))
    ok = jnp.isfinite(info.grad_sq_norm_estimate()) & jnp.isfinite(info.trace_cov_estimate())
    noise_state = self.noise_scale.update(state.noise, info)

    # Counters.
    hi, lo = _counter.add_samples(jnp.asarray(state.samples_hi, jnp.int32),
                                  jnp.asarray(state.samples_lo, jnp.int32), jnp.round(big))
    steps = jnp.asarray(state.steps, jnp.int32)
    steps = jnp.where(ran & (steps < _INT32_MAX), steps + 1, steps)
    progress, progress_error = _kahan_add(
        jnp.asarray(state.progress, jnp.float32),
        jnp.asarray(state.progress_error, jnp.float32),
        jnp.where(ran, self.lr_scale(state), 0.0))

    # The decision. One micro-batch on one device (a single sample) measures nothing: k
    # never shrinks to it there, and a step that ran it moves to 2 at once.
    alone = shards < 1.5
    new_k = self._decide(k_ran, noise_state, per_micro, floor=jnp.where(alone, 2, 1))
    since = jnp.asarray(state.since_change, jnp.int32)
    since = jnp.where(ran & (since < _INT32_MAX), since + 1, since)
    allowed = (ok & ran & (noise_state.count >= self.warmup_steps)
               & (since >= self.cooldown_steps))
    new_k = jnp.where(allowed, new_k, k_ran)
    stuck = ran & alone & (k_ran == 1) & (self.max_micro_batches >= 2)
    new_k = jnp.where(stuck, 2, new_k).astype(jnp.int32)
    changed = new_k != k
    return AdaptiveBatchState(
        micro_batches=new_k, noise=noise_state, steps=steps,
        since_change=jnp.where(changed, 0, since).astype(jnp.int32),
        samples_hi=hi, samples_lo=lo, micro_batch_samples=per_micro.astype(jnp.float32),
        progress=progress, progress_error=progress_error)

  def _decide(self, k: jax.Array, noise: NoiseScaleState, per_micro: jax.Array, *,
              floor: jax.Array) -> jax.Array:
    """The rule's next ``k`` from the smoothed estimates (no warm-up or cooldown here), at
    least ``floor`` (and ``min_micro_batches``), at most ``max_micro_batches``."""
    ns = self.noise_scale
    g2, tr = ns.grad_sq_norm(noise), ns.trace_cov(noise)
    kf = k.astype(jnp.float32)
    finite = jnp.isfinite(g2) & jnp.isfinite(tr) & (per_micro > 0)
    # k* = tr / (c g2 m), as a float; +inf when the noise dominates (g2 <= 0 < tr).
    den = jnp.float32(self._c) * g2 * per_micro
    target = jnp.where(den > 0, tr / jnp.where(den > 0, den, 1.0),
                       jnp.where(tr > 0, jnp.inf, 0.0))
    margin = jnp.float32(1.0 + self.hysteresis)
    growth = jnp.float32(self.max_growth)
    up_cap = jnp.maximum(kf + 1, jnp.floor(kf * growth))
    grown = jnp.minimum(jnp.ceil(jnp.minimum(target, 2.0 ** 30)), up_cap)
    new = jnp.where(target > kf * margin, jnp.maximum(grown, kf + 1), kf)
    if self.allow_decrease:
      down_cap = jnp.minimum(kf - 1, jnp.ceil(kf / growth))
      shrunk = jnp.maximum(jnp.ceil(jnp.maximum(target, 0.0)), down_cap)
      # target < k / margin, as a product: exactly rounded, where XLA may turn a division
      # by a constant into a product by its rounded reciprocal.
      new = jnp.where(target * margin < kf, jnp.minimum(shrunk, kf - 1), new)
    low = jnp.minimum(jnp.maximum(floor, self.min_micro_batches), self.max_micro_batches)
    new = jnp.clip(new, low.astype(jnp.float32), self.max_micro_batches)
    return jnp.where(finite, new, kf).astype(jnp.int32)

  # --- what the state says -------------------------------------------------------------

  def b_simple(self, state: AdaptiveBatchState) -> jax.Array:
    """The smoothed ``B_simple``, in samples (NaN before any finite estimate)."""
    return self.noise_scale.b_simple(state.noise)

  def target_micro_batches(self, state: AdaptiveBatchState) -> jax.Array:
    """The rule's unrounded target ``k* = B* / m`` (float32; NaN before any estimate)."""
    ns = self.noise_scale
    g2, tr = ns.grad_sq_norm(state.noise), ns.trace_cov(state.noise)
    m = jnp.asarray(state.micro_batch_samples, jnp.float32)
    return jnp.where(m > 0, tr / (jnp.float32(self._c) * g2 * m), jnp.nan)

  def samples(self, state: AdaptiveBatchState) -> jax.Array:
    """The samples seen so far as float32 (relative error below ``6e-8``), for schedules.

    :meth:`sample_count` gives the exact count as a Python int.
    """
    return _counter.samples(state)

  @staticmethod
  def sample_count(state: AdaptiveBatchState) -> int:
    """The exact sample count as a Python int (``state`` must be concrete, not traced)."""
    return _counter.sample_count(state)

  def lr_scale(self, state: AdaptiveBatchState) -> jax.Array:
    """The factor for the base learning rate at the current ``k`` (float32), as
    ``lr_scaling`` says: 1, ``sqrt(k / k0)``, ``k / k0`` or AdaScale's gain."""
    s = jnp.asarray(state.micro_batches, jnp.float32) / jnp.float32(self._k0)
    if self.lr_scaling == "none":
      return jnp.ones([], jnp.float32)
    if self.lr_scaling == "sqrt":
      return jnp.sqrt(s)
    if self.lr_scaling == "linear":
      return s
    return self.gain(state)

  def gain(self, state: AdaptiveBatchState) -> jax.Array:
    """AdaScale's gain ``r = (tr(Sigma)/B0 + |G|^2) / (tr(Sigma)/B + |G|^2)`` at the current
    ``k``, with ``B = (k / k0) B0``; in ``[min(1, S), max(1, S)]``, 1 before any estimate.

    With ``B_s = tr(Sigma) / |G|^2`` and ``S = k / k0`` it is ``S (B_s + B0) / (B_s + S
    B0)``; ``B0 = k0 m``, ``m`` the samples per micro-batch of the last step.
    """
    ns = self.noise_scale
    g2, tr = ns.grad_sq_norm(state.noise), ns.trace_cov(state.noise)
    s = jnp.asarray(state.micro_batches, jnp.float32) / jnp.float32(self._k0)
    b0 = jnp.float32(self._k0) * jnp.asarray(state.micro_batch_samples, jnp.float32)
    # B_s in [0, inf]: no noise gains nothing (r = 1), pure noise gains S (linear scaling).
    noisy = (g2 <= 0) & (tr > 0)
    b_s = jnp.where(g2 > 0, jnp.maximum(tr, 0.0) / jnp.where(g2 > 0, g2, 1.0), 0.0)
    r = jnp.where(noisy, s, s * (b_s + b0) / jnp.where(b0 > 0, b_s + s * b0, 1.0))
    good = jnp.isfinite(g2) & jnp.isfinite(tr) & (b0 > 0) & jnp.isfinite(r)
    return jnp.where(good, r, 1.0).astype(jnp.float32)
