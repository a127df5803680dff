"""``jaxaccum.contrib.seesaw``: batch ramps that replace learning-rate decay.

Seesaw (Meterez et al. 2025, arXiv 2510.14717): wherever a reference schedule would halve
the learning rate, multiply the batch by 2 and the learning rate by ``1/sqrt(2)`` (Adam,
normalised SGD) or leave it unchanged (SGD; Smith et al. 2017, arXiv 1711.00489). The
batch grows by running more micro-batches per step (``active_micro_batches=k``), so the
same tokens take fewer optimizer steps.

The reference is a function of the samples (or tokens) seen. The ramp ``k(n)`` is a table
of thresholds found when the rule is made, by bisection on the reference itself, and read
by :func:`jaxaccum.batch_size_ramp_by_count` (exact for counts below ``2**62``); the
learning rate is the reference's times a factor of ``k``. A :class:`SeesawState` adds an
exact sample counter and, with ``noise_guard=``, a level at which the ramp stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._batch_size import _counter, _ramp
from jaxaccum._batch_size._noise import NoiseScale, NoiseScaleState
from jaxaccum._core import _validate
from jaxaccum._core._info import AccumInfo

_INT32_MAX = _validate.INT32_MAX
_OPTIMIZERS = ("adam", "sgd")
_PROBES = 257  # points at which the reference is checked for a rise
# A level is reached within this relative tolerance, 8 float32 ulps (at 1): a reference that
# decays by exactly 1/r (1/3, 0.1) gives float32 values that round up to one or a few ulps
# above peak / r**j, and must still ramp once per r-fold decay.
LEVEL_RTOL = 8 * float(np.finfo(np.float32).eps)


class SeesawState(NamedTuple):
  """State of a :class:`Seesaw` rule: an exact sample counter and the noise guard.
  Experimental, as :func:`jaxaccum.contrib.seesaw` is.

  Attributes:
    samples_hi: int32, the high word of the samples (or tokens) seen, in units of ``2**24``.
    samples_lo: int32, the low word, in ``[0, 2**24)``: the count is ``samples_hi * 2**24 +
      samples_lo`` (the layout of :class:`jaxaccum.contrib.AdaptiveBatchState`'s counter).
    max_level: int32, the highest ramp level allowed (level ``i`` runs ``ks[i]``
      micro-batches): the last level, unless the noise guard stopped the ramp.
    noise: the :class:`jaxaccum.NoiseScaleState` of the guard's smoothed estimates.
  """

  samples_hi: jax.Array
  samples_lo: jax.Array
  max_level: jax.Array
  noise: NoiseScaleState


_check_int = functools.partial(_validate.check_int, "seesaw")


def _value(schedule: Callable[[Any], Any], n: int) -> float:
  """The reference at the Python int ``n``, as a Python float (float32's value, exactly)."""
  with jax.ensure_compile_time_eval():  # concrete, also when the rule is made under jit
    out = schedule(n)
  try:
    value = float(np.asarray(out))
  except (TypeError, ValueError):
    raise TypeError(
        f"seesaw: schedule({n}) must return a scalar learning rate, got "
        f"{_validate.describe(out)}.") from None
  return value


@dataclasses.dataclass(frozen=True, eq=False)
class Seesaw:
  """A batch ramp that replaces a reference schedule's learning-rate decay (Seesaw).
  Experimental, as :func:`jaxaccum.contrib.seesaw` is (measured: +0.85% loss at x0.68 the steps
  on the character LM).

  Made by :func:`jaxaccum.contrib.seesaw`, which documents the rule. Every method takes the count
  of samples (or tokens) seen as a Python int, a JAX or NumPy integer or float scalar
  (traced or not), a :class:`jaxaccum.contrib.AdaptiveBatchState` (its exact counter) or a
  :class:`SeesawState` (its exact counter and the noise guard's level), and is jittable.

  Attributes:
    schedule: the reference ``samples -> learning rate``.
    init_micro_batches: ``k`` while the reference has not decayed.
    max_micro_batches: the largest ``k``.
    optimizer: ``"adam"`` or ``"sgd"``.
    ramp_factor: the batch's factor per level (2: one level per halving).
    decay_start: the count from which the reference decays (its peak).
    total: the count at the end of training, or ``None``.
    noise_guard: the multiple of the measured ``B_simple`` that the batch may not pass,
      or ``None``.
    noise_decay: the decay of the guard's EMAs.
    thresholds: the counts at which each level begins (level 0 at 0).
    ks: the micro-batch count of each level.
  """

  schedule: Callable[[Any], Any]
  init_micro_batches: int
  max_micro_batches: int
  optimizer: str
  ramp_factor: int
  decay_start: int
  total: int | None
  noise_guard: float | None
  noise_decay: float
  thresholds: tuple[int, ...]
  ks: tuple[int, ...]
  # Tables built from the fields above.
  _lr_factors: np.ndarray = dataclasses.field(init=False, repr=False)
  _ks: np.ndarray = dataclasses.field(init=False, repr=False)
  _ramp: Callable[[Any], jax.Array] = dataclasses.field(init=False, repr=False)
  _f32_first: np.ndarray = dataclasses.field(init=False, repr=False)
  _f32_last: np.ndarray = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    ratios = np.asarray(self.ks, np.float64) / self.init_micro_batches
    factor = np.sqrt(ratios) if self.optimizer == "adam" else ratios
    object.__setattr__(self, "_lr_factors", factor.astype(np.float32))
    object.__setattr__(self, "_ks", np.asarray(self.ks, np.int32))
    object.__setattr__(self, "_ramp", _ramp.batch_size_ramp_by_count(
        dict(zip(self.thresholds, range(1, len(self.ks) + 1), strict=True))))
    # Per level, the float32 counts inside it: from the first float32 at or above its
    # threshold to the last one below the next level's (schedule_count).
    first = [_float32_at_least(t) for t in self.thresholds]
    last = [np.nextafter(f, np.float32(-np.inf)) for f in first[1:]] + [np.float32(np.inf)]
    object.__setattr__(self, "_f32_first", np.asarray(first, np.float32))
    object.__setattr__(self, "_f32_last", np.asarray(last, np.float32))

  def __repr__(self) -> str:
    return (f"Seesaw(init_micro_batches={self.init_micro_batches}, max_micro_batches="
            f"{self.max_micro_batches}, optimizer={self.optimizer!r}, ramp_factor="
            f"{self.ramp_factor}, thresholds={self.thresholds}, ks={self.ks}, noise_guard="
            f"{self.noise_guard})")

  @property
  def noise_scale(self) -> NoiseScale:
    """The :class:`jaxaccum.NoiseScale` that smooths the guard's estimates."""
    return NoiseScale(decay=self.noise_decay)

  # -------------------------------------------------------------------------- levels

  def level(self, count: Any) -> jax.Array:
    """The ramp level at ``count`` (int32): ``k = ks[level]``, the guard's cap applied."""
    level = self._count_level(count)
    if isinstance(count, SeesawState):
      return jnp.minimum(level, jnp.asarray(count.max_level, jnp.int32))
    return level

  def _count_level(self, count: Any) -> jax.Array:
    """The level the count has reached (int32), before the guard's cap: exact for a
    Python int, a JAX or NumPy integer or float and a state's counter
    (:func:`jaxaccum.batch_size_ramp_by_count`)."""
    if isinstance(count, (float, np.floating)) and math.isnan(count):
      raise ValueError("seesaw: the count is nan; pass the samples (or tokens) seen.")
    return self._ramp(count) - 1

  def micro_batches(self, count: Any) -> jax.Array:
    """``k`` at ``count``: the int32 to pass as ``active_micro_batches``."""
    return jnp.asarray(self._ks)[self.level(count)]

  def lr_factor(self, count: Any) -> jax.Array:
    """The learning rate's factor on the reference at ``count`` (float32): ``sqrt(k /
    init_micro_batches)`` for ``"adam"``, ``k / init_micro_batches`` for ``"sgd"``."""
    return jnp.asarray(self._lr_factors)[self.level(count)]

  def schedule_count(self, count: Any) -> Any:
    """The count as the reference is called with it: a Python int stays one, an array is
    unchanged, and a state's exact counter becomes the float32 nearest it within the level
    the counter has reached (relative error below ``1.2e-7``).

    Float32 cannot hold every count past ``2**24``: the nearest float32 to a count at a
    level's threshold may lie below it, where the reference has not yet decayed. The level
    and the reference's count then come from the one exact counter: the float32 is taken
    at or above the threshold of the counter's level and below the next one's, so that
    ``learning_rate`` is the reference at the level that ``micro_batches`` runs.
    """
    if _counter.has_counter(count):
      level = self._count_level(count)
      inside = jnp.minimum(_counter.samples(count), jnp.asarray(self._f32_last)[level])
      # A level with no float32 inside it (two thresholds within one float32 step) reads the
      # reference at its first float32 at or above: the next level's, the lower rate.
      return jnp.maximum(inside, jnp.asarray(self._f32_first)[level])
    if isinstance(count, np.ndarray) and count.shape == ():
      count = count[()]
    if _validate.is_int(count):
      return int(count)
    return count

  def learning_rate(self, count: Any) -> jax.Array:
    """The learning rate at ``count``: ``schedule(count) * lr_factor(count)`` (float32)."""
    base = jnp.asarray(self.schedule(self.schedule_count(count)), jnp.float32)
    return base * self.lr_factor(count)

  # --------------------------------------------------------------------- couplings

  def b2(self, count: Any, b2: float) -> jax.Array:
    """Adam's ``b2`` at ``count`` that keeps its half-life in samples: ``b2 ** (k / init)``.

    The second-moment average spans ``1 / (1 - b2)`` steps of ``B`` samples; with ``k / init``
    times the samples per step, ``b2 ** (k / init)`` spans the same samples (Marek et al.
    2025, arXiv 2507.07101). ``b2`` is the value tuned at ``init_micro_batches``.
    """
    if not _validate.is_real(b2) or not 0 <= b2 < 1:
      raise ValueError(f"Seesaw.b2: b2 must be a float in [0, 1), got b2={b2!r}; e.g. 0.95.")
    ratio = jnp.asarray(self._ks, jnp.float32)[self.level(count)] / jnp.float32(
        self.init_micro_batches)
    return jnp.power(jnp.float32(b2), ratio)

  def every_k_schedule(self, count: Any) -> Callable[[Any], jax.Array]:
    """A :class:`jaxaccum.MultiSteps` ``every_k_schedule`` returning ``k`` at ``count``."""
    k = self.micro_batches(count)
    return lambda gradient_step: k

  # ------------------------------------------------------------------------- state

  def init(self) -> SeesawState:
    """No samples seen, every level allowed."""
    zero = jnp.zeros([], jnp.int32)
    return SeesawState(samples_hi=zero, samples_lo=zero,
                       max_level=jnp.int32(len(self.ks) - 1),
                       noise=self.noise_scale.init())

  def update(self, state: SeesawState, info: AccumInfo | None = None, *,
             samples: jax.typing.ArrayLike | None = None) -> SeesawState:
    """Counts one step's samples and, with ``noise_guard``, stops the ramp if it must.

    Args:
      state: from :meth:`init` or the previous :meth:`update`.
      info: the step's :class:`jaxaccum.AccumInfo` (``with_info=True``); its
        ``batch_size`` (rows, or tokens under ``reduce="weighted"``) is counted unless
        ``samples`` is given. The noise guard needs it.
      samples: what the step used in the unit the schedule counts (e.g. tokens: ``k *
        rows_per_micro_batch * seq_len``), an int or a scalar array; ``None`` counts
        ``info.batch_size``.

    Returns:
      The new state. With ``noise_guard=c``, once the next level's batch would exceed
      ``c`` times the smoothed ``B_simple`` (:class:`jaxaccum.NoiseScale`, in the unit of
      ``info.batch_size``), ``max_level`` stays at the current level for the rest of the
      run: the reference's decay goes on as plain learning-rate decay.

    Raises:
      TypeError: ``state`` is not a :class:`SeesawState`; ``info`` is not an
        :class:`jaxaccum.AccumInfo` while ``noise_guard`` is set or ``samples`` is None.
    """
    if not isinstance(state, SeesawState):
      raise TypeError(
          "Seesaw.update takes the SeesawState from init() or the previous update, got "
          f"{_validate.describe(state)}.")
    if not isinstance(info, AccumInfo) and (info is not None or samples is None
                                            or self.noise_guard is not None):
      need = (f"noise_guard={self.noise_guard} needs" if self.noise_guard is not None
              else "without samples=, it counts")
      raise TypeError(
          f"Seesaw.update: {need} the step's jaxaccum.AccumInfo, got info="
          f"{_validate.describe(info)}. Build the step with with_info=True and pass its info"
          " (and samples= to count tokens), or pass samples= alone without a noise guard.")
    if samples is None:
      samples = info.batch_size if isinstance(info, AccumInfo) else 0  # checked above
    count = jnp.asarray(samples, jnp.float32)
    if count.shape != ():
      raise TypeError(
          f"Seesaw.update takes one step's samples (a scalar), got shape "
          f"{tuple(count.shape)}.")
    count = jnp.where(jnp.isfinite(count) & (count > 0), jnp.round(count), 0.0)
    level = self.level(state)
    hi, lo = _counter.add_samples(jnp.asarray(state.samples_hi, jnp.int32),
                                  jnp.asarray(state.samples_lo, jnp.int32), count)
    max_level = jnp.asarray(state.max_level, jnp.int32)
    noise = state.noise
    if self.noise_guard is not None and isinstance(info, AccumInfo):  # checked above
      noise = self.noise_scale.update(state.noise, info)
      ks = jnp.asarray(self._ks)
      per_micro = jnp.asarray(info.batch_size, jnp.float32) / ks[level].astype(jnp.float32)
      last = jnp.int32(len(self.ks) - 1)
      ramp_level = self.level(SeesawState(hi, lo, last, noise))
      b_simple = self.noise_scale.b_simple(noise)
      would_pass = (ks[ramp_level].astype(jnp.float32) * per_micro
                    > jnp.float32(self.noise_guard) * b_simple)
      stop = (ramp_level > level) & jnp.isfinite(b_simple) & would_pass & (count > 0)
      max_level = jnp.where(stop, jnp.minimum(max_level, level), max_level)
    return SeesawState(samples_hi=hi, samples_lo=lo, max_level=max_level, noise=noise)

  @staticmethod
  def sample_count(state: SeesawState) -> int:
    """The exact count of a concrete state as a Python int."""
    return _counter.sample_count(state)


def _float32_at_least(n: int) -> np.float32:
  """The smallest float32 at or above the Python int ``n`` (``0 <= n < 2**62``)."""
  x = np.float32(n)  # the nearest, or a neighbour: then one step corrects it
  up, down = np.float32(np.inf), np.float32(-np.inf)
  while float(x) < n:  # Python compares a float with an int exactly
    x = np.nextafter(x, up)
  while float(np.nextafter(x, down)) >= n:
    x = np.nextafter(x, down)
  return x


def _check_no_rise(schedule: Callable[[Any], Any], start: int, horizon: int,
                   peak: float) -> None:
  """Raises if the reference rises after its peak ``schedule(start) = peak`` (or is not
  finite), probed at 257 evenly spaced counts and at ``start + 2**i`` up to ``horizon``."""
  probes = sorted({start + (horizon - start) * i // (_PROBES - 1) for i in range(_PROBES)}
                  | {start + 2**i for i in range(63) if start + 2**i <= horizon})
  previous_n, previous = start, peak
  for n in probes[1:]:
    value = _value(schedule, n)
    if not math.isfinite(value):
      raise ValueError(f"seesaw: the reference is not finite: schedule({n})={value}.")
    if value > previous:
      raise ValueError(
          f"seesaw: the reference rises from schedule({previous_n})={previous} to "
          f"schedule({n})={value}; Seesaw replaces decay, so the schedule must not rise "
          f"after decay_start={start}. If it warms up, pass decay_start= the count at which "
          "the warm-up ends (e.g. warmup_steps * B0 for a step-indexed schedule).")
    previous_n, previous = n, value


def _levels(schedule: Callable[[Any], Any], start: int, horizon: int, peak: float, *,
            init: int, cap: int, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The ramp's ``(thresholds, ks)``: level ``i`` begins at the first count ``n`` with
  ``schedule(n) * r**i <= peak`` within :data:`LEVEL_RTOL` (bisection on ``[start,
  horizon]``) and runs ``init * r**i`` micro-batches, at most ``cap``; a drop of several
  levels at once is one level."""
  def decayed(n: int, j: int) -> bool:  # the one comparison of a value with a level
    return _value(schedule, n) * float(r) ** j <= peak * (1 + LEVEL_RTOL)

  thresholds, ks = [0], [init]
  k, j = init, 0
  while k < cap:
    j += 1
    if not decayed(horizon, j):
      break  # the reference never decays this far
    low, high = start, horizon  # not decayed(low, j), decayed(high, j)
    if decayed(low, j):
      high = low
    while high - low > 1:
      mid = (low + high) // 2
      if decayed(mid, j):
        high = mid
      else:
        low = mid
    k = min(k * r, cap)
    if high == thresholds[-1]:  # a drop of several levels at once
      ks[-1] = k
    else:
      thresholds.append(high)
      ks.append(k)
  return tuple(thresholds), tuple(ks)


def seesaw(
    schedule: Callable[[Any], Any],
    *,
    init_micro_batches: int,
    max_micro_batches: int,
    optimizer: str = "adam",
    ramp_factor: int = 2,
    decay_start: int = 0,
    total: int | None = None,
    noise_guard: float | None = None,
    noise_decay: float = 0.95,
) -> Seesaw:
  """Seesaw: a batch ramp in place of a reference schedule's learning-rate decay.
  Experimental (:mod:`jaxaccum.contrib`): the method is recent (2025). Measured on the
  character LM with AdamW: +0.85% final validation loss against cosine at x0.68 the optimizer
  steps (goal within 1% at <= x0.70: met), and with SGD on linear regression 2 of 3 settings
  met their goal (``benchmarks/results/seesaw.md``).

  ``schedule(n)`` is the reference learning rate after ``n`` samples (or tokens) at the
  constant batch of ``init_micro_batches`` micro-batches. For a step-indexed optax schedule
  at ``B0`` samples per step, pass ``lambda n: sched(n // B0)``.

  The rule, with ``r = ramp_factor`` and ``peak = schedule(decay_start)``: level ``j(n)``
  is the number of times the reference has decayed by ``r`` since its peak, the largest
  ``j`` with ``schedule(n) * r**j <= peak`` (0 before ``decay_start``; equal within 8
  float32 ulps counts, so that a decay by exactly ``1/r``, which float32 rounds up, is a
  level), and

  * ``k(n) = min(init_micro_batches * r**j, max_micro_batches)``;
  * ``learning_rate(n) = schedule(n) * sqrt(k / init_micro_batches)`` for
    ``optimizer="adam"`` (normalised SGD, Adam: each halving becomes ``k x 2`` and ``lr x
    1/sqrt(2)``), ``schedule(n) * k / init_micro_batches`` for ``"sgd"`` (``k x 2``, ``lr``
    unchanged).

  Once ``k`` reaches ``max_micro_batches`` (which need not be ``init * r**i``: the last
  level is the cap), the reference's decay goes on as plain decay. A warm-up before the
  peak is the reference's own: pass ``decay_start=`` the count at which it ends.

  The levels' thresholds are found once, here, by bisection on the reference (which must
  not rise after ``decay_start``; it is checked at 257 points up to ``total``). The
  methods of the returned :class:`Seesaw` read them exactly for any count: ``k`` is exact
  past ``2**31`` (:func:`jaxaccum.batch_size_ramp_by_count`), and one compiled program
  serves every ``k``.

  Args:
    schedule: ``samples -> learning rate``, called with Python ints here (and with the
      count you pass later: a Python int, a traced int32/float32, or a float32 from a
      state's counter); non-increasing from ``decay_start`` on, positive at its peak.
    init_micro_batches: ``k`` at the start (the batch the reference was tuned at).
    max_micro_batches: the cap on ``k`` (at most the step's ``num_micro_batches``).
    optimizer: ``"adam"`` (Adam, AdamW, normalised SGD) or
      ``"sgd"`` (SGD with or without momentum).
    ramp_factor: the batch's factor per level, an int >= 2 (2: the paper's rule).
    decay_start: the count of the reference's peak (the end of its warm-up).
    total: the count at which training ends, to check the reference up to it and bound
      the search; ``None`` searches up to ``2**31 - 1``.
    noise_guard: ``None`` (default: no guard), or ``c > 0``: the ramp stops for good
      before the batch passes ``c`` times the measured ``B_simple`` (:meth:`Seesaw.update`
      with ``with_info=True``'s info).
    noise_decay: the decay of the guard's EMAs (:class:`jaxaccum.NoiseScale`).

  Returns:
    A :class:`Seesaw` with :meth:`~Seesaw.micro_batches` and :meth:`~Seesaw.learning_rate`.

  Raises:
    TypeError, ValueError: a schedule that is not callable, rises after ``decay_start`` or
      is not positive at its peak; ``init_micro_batches > max_micro_batches``; an unknown
      optimizer; a count or factor out of range.

  >>> import jax, optax
  >>> import jaxaccum
  >>> ref = optax.piecewise_constant_schedule(1.0, {100: 0.5, 200: 0.5, 300: 0.1})
  >>> rule = jaxaccum.contrib.seesaw(lambda n: ref(n // 8), init_micro_batches=2,
  ...                        max_micro_batches=8, total=4000)
  >>> rule.thresholds, rule.ks
  ((0, 800, 1600), (2, 4, 8))
  >>> [int(rule.micro_batches(n)) for n in (0, 799, 800, 1600, 2400)]
  [2, 2, 4, 8, 8]
  >>> [round(float(rule.learning_rate(n)), 4) for n in (0, 800, 1600, 2400)]
  [1.0, 0.7071, 0.5, 0.05]
  >>> float(jax.jit(rule.learning_rate)(jax.numpy.int32(1600)))
  0.5
  """
  if not callable(schedule):
    raise TypeError(
        f"seesaw: schedule must be a callable samples -> learning rate, got "
        f"{_validate.describe(schedule)}. For a step-indexed optax schedule at B0 samples per "
        "step, pass schedule=lambda n: sched(n // B0).")
  init = _check_int("init_micro_batches", init_micro_batches, low=1,
                    what="the micro-batches per step the reference was tuned at", example="2")
  cap = _check_int("max_micro_batches", max_micro_batches, low=1,
                   what="the most micro-batches per step", example="32")
  if init > cap:
    raise ValueError(
        f"seesaw: init_micro_batches={init} is more than max_micro_batches={cap}; the ramp "
        f"only grows k: raise max_micro_batches to at least {init} or lower "
        "init_micro_batches.")
  if cap > _INT32_MAX:
    raise ValueError(f"seesaw: max_micro_batches={cap} must fit in int32.")
  if optimizer not in _OPTIMIZERS:
    raise ValueError(
        f"seesaw: optimizer must be 'adam' (Adam, AdamW, normalised SGD: lr x 1/sqrt(r) "
        f"per level) or 'sgd' (lr unchanged per level), got optimizer={optimizer!r}.")
  r = _check_int("ramp_factor", ramp_factor, low=2,
                 what="the batch's factor at each level", example="2")
  start = _check_int("decay_start", decay_start, low=0,
                     what="the count at which the reference peaks", example="0")
  if total is not None:
    total = _check_int("total", total, low=start + 1,
                       what=f"the count at the end of training, above decay_start={start}",
                       example=str(max(start * 10, 10**6)))
  horizon = total if total is not None else _INT32_MAX
  if horizon > _ramp.COUNT_MAX:
    raise ValueError(f"seesaw: total={total} must be below 2**62.")
  if noise_guard is not None:
    if not _validate.is_real(noise_guard):
      raise TypeError(
          f"seesaw: noise_guard must be None or a float > 0 (a multiple of B_simple), got "
          f"{_validate.describe(noise_guard)}. For example noise_guard=1.0.")
    if not (math.isfinite(noise_guard) and noise_guard > 0):
      raise ValueError(
          f"seesaw: noise_guard must be None or a finite float > 0 (a multiple of "
          f"B_simple), got noise_guard={noise_guard}. For example noise_guard=1.0.")
    noise_guard = float(noise_guard)
  NoiseScale(decay=noise_decay)  # its own check of the decay

  peak = _value(schedule, start)
  if not (math.isfinite(peak) and peak > 0):
    raise ValueError(
        f"seesaw: the reference must be positive at its peak, got schedule({start})={peak}. "
        "If it warms up from 0, pass decay_start= the count at which the warm-up ends.")
  _check_no_rise(schedule, start, horizon, peak)
  thresholds, ks = _levels(schedule, start, horizon, peak, init=init, cap=cap, r=r)
  return Seesaw(schedule=schedule, init_micro_batches=init, max_micro_batches=cap,
                optimizer=optimizer, ramp_factor=r, decay_start=start, total=total,
                noise_guard=noise_guard, noise_decay=float(noise_decay),
                thresholds=thresholds, ks=ks)

