"""``jaxaccum.plan`` and ``jaxaccum.plan_step``: choose the micro-batch count from a memory budget.

XLA knows how much memory a compiled program needs before it runs. The planner lowers and
compiles the accumulated program for a few candidate micro-batch counts (divisors of the batch
size), reads each program's memory from :meth:`jax.stages.Compiled.memory_analysis`, and
returns the fewest micro-batches whose program fits the budget. Nothing is ever executed, and
the arguments may be :class:`jax.ShapeDtypeStruct` s, so planning allocates nothing.

Memory falls as the micro-batch count grows (each micro-batch holds fewer activations), so the
search is a binary search over the divisors: ``ceil(log2(d + 1))`` compilations for ``d``
divisors, e.g. 4 for a batch of 4096 (13 divisors). ``search="all"`` compiles every divisor
and does not rely on that order.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jaxaccum import _split
from jaxaccum._transform import value_and_grad

PyTree = Any

# The default budget keeps this fraction of the device's `bytes_limit` free for what the
# compiled program's own figure does not count: allocator fragmentation, buffers alive outside
# the program (a prefetched next batch, metrics, a second copy of the parameters for eval) and
# library workspaces (cuBLAS/cuDNN) that XLA allocates outside its buffer assignment.
_SAFETY_MARGIN = 0.10

_SEARCHES = ("binary", "all")
_FIXED_BY_PLAN = ("num_micro_batches", "micro_batch_size")


class PlanCandidate(NamedTuple):
  """One compiled candidate of a :class:`Plan`; sizes are bytes per device.

  Attributes:
    num_micro_batches: the micro-batch count ``N`` that was compiled.
    micro_batch_size: rows per micro-batch, ``batch_size // N``.
    peak_bytes: the program's memory: XLA's ``peak_memory_in_bytes`` on backends that fill
      it in with temporaries (GPU, TPU), else ``argument + output + temp - alias`` (CPU).
    temp_bytes: XLA's temporary (scratch) bytes, where activations live.
    compile_seconds: wall time of lowering and compiling this candidate.
    argument_bytes: bytes of the program's inputs.
    output_bytes: bytes of its outputs.
    alias_bytes: bytes of outputs that reuse donated inputs.
    fits: ``peak_bytes <= memory_budget_bytes``.
  """

  num_micro_batches: int
  micro_batch_size: int
  peak_bytes: int
  temp_bytes: int
  compile_seconds: float
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  fits: bool


@dataclasses.dataclass(frozen=True)
class Plan:
  """The planner's choice, the candidates it compiled, and the chosen compiled program.

  Attributes:
    num_micro_batches: the fewest micro-batches whose program fits the budget.
    micro_batch_size: rows per micro-batch, ``batch_size // num_micro_batches``.
    peak_bytes: memory of the chosen program, in bytes per device (see :class:`PlanCandidate`).
    candidates: one :class:`PlanCandidate` per compiled micro-batch count, by increasing count.
    batch_size: the rows of the batch arguments.
    memory_budget_bytes: the budget the plan was made for, in bytes per device.
    compiled: the chosen :class:`jax.stages.Compiled` program. Call it with arguments of the
      planned shapes, dtypes and shardings; it runs without compiling again.
    jitted: the jitted function that was lowered for the chosen count.

  ``str(plan)`` (or :meth:`table`) is a readable table of the candidates.
  """

  num_micro_batches: int
  micro_batch_size: int
  peak_bytes: int
  candidates: tuple[PlanCandidate, ...]
  batch_size: int
  memory_budget_bytes: int
  compiled: Any = dataclasses.field(repr=False, compare=False)
  jitted: Any = dataclasses.field(repr=False, compare=False)

  def table(self) -> str:
    """The candidates as a text table, the chosen row marked."""
    return _table(self.candidates, self.batch_size, self.memory_budget_bytes,
                  self.num_micro_batches)

  def __str__(self) -> str:
    return self.table()


def _fmt_bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def _table(candidates: Sequence[PlanCandidate], batch_size: int, budget: int,
           chosen: int | None) -> str:
  header = ("N", "micro-batch", "peak", "temp", "arguments", "outputs", "aliased",
            "compile s", "")
  rows = [header]
  for c in sorted(candidates):
    verdict = "fits" if c.fits else "too big"
    if c.num_micro_batches == chosen:
      verdict += "  <- chosen"
    rows.append((str(c.num_micro_batches), str(c.micro_batch_size), _fmt_bytes(c.peak_bytes),
                 _fmt_bytes(c.temp_bytes), _fmt_bytes(c.argument_bytes),
                 _fmt_bytes(c.output_bytes), _fmt_bytes(c.alias_bytes),
                 f"{c.compile_seconds:.2f}", verdict))
  widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
  lines = [f"memory plan: batch of {batch_size} rows, budget {_fmt_bytes(budget)} "
           f"({budget:,} bytes) per device"]
  for r in rows:
    cells = [r[0].rjust(widths[0])] + [r[k].rjust(widths[k]) for k in range(1, 8)] + [r[8]]
    lines.append("  ".join(cells).rstrip())
  n_divisors = len(_split.divisors(batch_size))
  if chosen is not None:
    peak = next(c.peak_bytes for c in candidates if c.num_micro_batches == chosen)
    lines.append(f"chosen: num_micro_batches={chosen} (micro_batch_size={batch_size // chosen})"
                 f", peak {_fmt_bytes(peak)} of {_fmt_bytes(budget)}; compiled "
                 f"{len(candidates)} of {n_divisors} divisors of {batch_size}")
  return "\n".join(lines)


def _check_budget(budget: Any) -> int | None:
  if budget is None:
    return None
  if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
    raise TypeError(
        f"memory_budget_bytes must be a number of bytes, got {budget!r} of type "
        f"{type(budget).__name__}. Pass e.g. memory_budget_bytes=8 * 2**30 for 8 GiB."
    )
  if not math.isfinite(budget) or budget <= 0:
    raise ValueError(
        f"memory_budget_bytes must be a positive number of bytes, got "
        f"memory_budget_bytes={budget!r}. Pass e.g. memory_budget_bytes=8 * 2**30 for 8 GiB, "
        "or None to use the device's limit where it reports one."
    )
  return int(budget)


def _devices(args: tuple) -> list[Any]:
  """The devices the arguments live on (the default device when none says)."""
  devices = set()
  for leaf in jax.tree.leaves(args):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      devices |= set(sharding.device_set)
  return sorted(devices, key=lambda d: d.id) if devices else [jax.devices()[0]]


def _default_budget(devices: Sequence[Any]) -> int:
  """``bytes_limit`` minus the safety margin, the smallest over ``devices``."""
  limits = []
  for d in devices:
    stats = d.memory_stats()
    if not stats or "bytes_limit" not in stats:
      raise ValueError(
          f"memory_budget_bytes is required here: device {d} ({d.platform}) does not report "
          f"a memory limit (its memory_stats() is {stats!r}). Pass the budget per device "
          "explicitly, e.g. memory_budget_bytes=2 * 2**30 for 2 GiB."
      )
    limits.append(int(stats["bytes_limit"] * (1 - _SAFETY_MARGIN)))
  return min(limits)


def _memory(compiled: Any, platform: str) -> dict[str, int]:
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError(
        f"the {platform} backend does not report memory_analysis() for compiled programs, "
        "so the planner cannot measure them."
    )
  arg = int(stats.argument_size_in_bytes)
  out = int(stats.output_size_in_bytes)
  temp = int(stats.temp_size_in_bytes)
  alias = int(stats.alias_size_in_bytes)
  total = arg + out + temp - alias
  # XLA's own heap-simulated peak counts temporaries on GPU/TPU; on CPU it leaves them out
  # (it is about argument + output), so there the sum is the honest figure.
  xla_peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
  peak = xla_peak if platform != "cpu" and xla_peak > 0 else total
  return dict(peak_bytes=peak, temp_bytes=temp, argument_bytes=arg, output_bytes=out,
              alias_bytes=alias)


def _search(make: Callable[[int], Any], args: tuple, batch_argnums: Any, budget: Any,
            search: str, shards: int = 1) -> Plan:
  budget = _check_budget(budget)
  if search not in _SEARCHES:
    raise ValueError(
        f"search must be one of {', '.join(map(repr, _SEARCHES))}, got search={search!r}.")
  argnums = _split.normalize_argnums("batch_argnums", batch_argnums, allow_empty=False)
  argnums = _split.resolve_argnums("batch_argnums", argnums, len(args))
  size = _split.batch_size({j: args[j] for j in argnums})
  devices = _devices(args)
  if budget is None:
    budget = _default_budget(devices)
  platform = devices[0].platform
  # Increasing N: decreasing memory. A batch sharded over D devices (or split over D data
  # shards by data_axis) only splits in place into micro-batches of a multiple of D rows.
  shards = max(shards, _batch_shards({j: args[j] for j in argnums}))
  counts = [n for n in _split.divisors(size) if (size // n) % shards == 0]
  if not counts:
    raise ValueError(
        f"the batch of {size} rows is sharded over {shards} devices, which does not divide "
        "it: no micro-batch count splits it in place. Use a batch size that is a multiple of "
        f"{shards}.")
  cache: dict[int, tuple[PlanCandidate, Any, Any]] = {}

  def fits(i: int) -> bool:
    n = counts[i]
    if n not in cache:
      start = time.perf_counter()
      jitted = make(n)
      if not hasattr(jitted, "lower"):
        raise TypeError(
            f"make_step({n}) must return a jitted function (jax.jit(step, "
            f"donate_argnums=...)), got {jitted!r} of type {type(jitted).__name__}."
        )
      compiled = jitted.lower(*args).compile()
      seconds = time.perf_counter() - start
      mem = _memory(compiled, platform)
      row = PlanCandidate(num_micro_batches=n, micro_batch_size=size // n, compile_seconds=seconds,
                      fits=mem["peak_bytes"] <= budget, **mem)
      cache[n] = (row, compiled, jitted)
    return cache[n][0].fits

  if search == "all":
    fitting = [i for i in range(len(counts)) if fits(i)]
    found = fitting[0] if fitting else len(counts)
  else:
    # Invariant: the answer is in [lo, hi]; hi == len(counts) stands for "none fits".
    lo, hi = 0, len(counts)
    while lo < hi:
      mid = (lo + hi) // 2
      if fits(mid):
        hi = mid
      else:
        lo = mid + 1
    found = lo
  rows = tuple(sorted(entry[0] for entry in cache.values()))
  if found == len(counts):
    least = min(rows, key=lambda r: r.peak_bytes)
    last = counts[-1]  # the most micro-batches allowed; always compiled when none fits
    rows_of = f"micro-batches of {size // last} row{'s' if size // last > 1 else ''}"
    at = (f"num_micro_batches={least.num_micro_batches}" + (
        f" ({rows_of})" if least.num_micro_batches == last else
        f"; even num_micro_batches={last} ({rows_of}) needs {cache[last][0].peak_bytes:,} "
        "bytes"))
    raise ValueError(
        f"memory_budget_bytes={budget:,} ({_fmt_bytes(budget)}) is too small: the smallest "
        f"figure reached is {least.peak_bytes:,} bytes ({_fmt_bytes(least.peak_bytes)}) at "
        f"{at}, {least.peak_bytes - budget:,} bytes ({_fmt_bytes(least.peak_bytes - budget)}) "
        "over the budget. Raise the budget, shard the batch over more devices, shrink the "
        "parameters or optimizer state (which no micro-batch count splits), or try remat=True."
        f"\n{_table(rows, size, budget, None)}"
    )
  n = counts[found]
  row, compiled, jitted = cache[n]
  return Plan(num_micro_batches=n, micro_batch_size=size // n, peak_bytes=row.peak_bytes,
              candidates=rows, batch_size=size, memory_budget_bytes=budget,
              compiled=compiled, jitted=jitted)


def plan(
    fun: Callable[..., Any],
    *args: Any,
    memory_budget_bytes: int | None = None,
    search: str = "binary",
    **options: Any,
) -> Plan:
  """Chooses the fewest micro-batches whose accumulated value-and-grad fits a memory budget.

  Lowers and compiles (never runs) ``jax.jit(jaxaccum.value_and_grad(fun,
  num_micro_batches=N, **options))`` on ``args`` for candidate counts ``N`` (divisors of the
  batch size), measures each compiled program's memory, and returns the smallest ``N`` whose
  memory is at most the budget. Memory falls as ``N`` grows, so a binary search needs
  ``ceil(log2(d + 1))`` compilations for ``d`` divisors (4 for a batch of 4096); each count is
  compiled at most once, and the chosen program comes back compiled, as ``plan.compiled``.

  The memory of a program is XLA's ``peak_memory_in_bytes`` on backends that count
  temporaries in it (GPU, TPU), and ``argument + output + temp - alias`` bytes from
  :meth:`~jax.stages.Compiled.memory_analysis` otherwise (CPU). For sharded arguments it is
  per device, and so is the budget. Buffers alive outside the program are not counted.

  To plan the whole train step (value-and-grad plus the optimizer update, with donated
  buffers), which is what has to fit, use :func:`plan_step`.

  Args:
    fun: the loss, as for :func:`jaxaccum.value_and_grad`.
    *args: the arguments to plan for: arrays, or :class:`jax.ShapeDtypeStruct` s (with a
      ``sharding`` for sharded inputs) to plan without allocating anything.
    memory_budget_bytes: the budget per device, in bytes. ``None`` uses the device's
      ``memory_stats()["bytes_limit"]`` less a 10% safety margin (for fragmentation, buffers
      alive outside the program and library workspaces); backends that do not report a limit
      (CPU) require an explicit budget.
    search: ``"binary"`` (default) or ``"all"``, which compiles every divisor and does not
      assume that memory falls with ``N``.
    **options: options of :func:`jaxaccum.value_and_grad` (``batch_argnums``, ``has_aux``,
      ``reduce``, ``remat``, ...), except ``num_micro_batches`` and ``micro_batch_size``,
      which the planner chooses.

  Returns:
    A :class:`Plan`; ``print(plan)`` shows the table of compiled candidates.

  Raises:
    ValueError: a non-positive budget, no budget on a backend that reports no limit, a budget
      that even ``N = batch size`` exceeds (with the smallest figure reached), batch leaves
      whose leading sizes disagree.
    TypeError: a non-numeric budget, an unknown option, or ``num_micro_batches`` /
      ``micro_batch_size`` among the options.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> def loss_fn(w, batch):
  ...   x, y = batch
  ...   return jnp.mean((jnp.tanh(x @ w) - y) ** 2)
  >>> w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
  >>> batch = (jax.ShapeDtypeStruct((64, 16), jnp.float32),
  ...          jax.ShapeDtypeStruct((64, 4), jnp.float32))
  >>> p = jaxaccum.plan(loss_fn, w, batch, memory_budget_bytes=2**30)
  >>> p.num_micro_batches, p.peak_bytes <= p.memory_budget_bytes
  (1, True)
  """
  for name in _FIXED_BY_PLAN:
    if name in options:
      raise TypeError(
          f"plan chooses the micro-batch count itself, so {name}={options[name]!r} cannot be "
          "passed to it; drop it (or call jaxaccum.value_and_grad directly with a fixed count)."
      )
  # Build once with N = 1 to validate the options eagerly, with the transform's own errors.
  try:
    value_and_grad(fun, num_micro_batches=1, **options)
  except TypeError as e:
    if "unexpected keyword argument" not in str(e):
      raise
    unknown = sorted(set(options) - set(_VALUE_AND_GRAD_OPTIONS))
    raise TypeError(
        f"plan got unknown option(s) {', '.join(map(repr, unknown))}; its options are those "
        f"of jaxaccum.value_and_grad: {', '.join(_VALUE_AND_GRAD_OPTIONS)}."
    ) from None

  def make(n: int) -> Any:
    return jax.jit(value_and_grad(fun, num_micro_batches=n, **options))

  shards = 1
  if options.get("data_axis") is not None:
    axes = options["data_axis"]
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    mesh = options.get("mesh") or jax.sharding.get_abstract_mesh()
    if not mesh.empty:  # otherwise the transform's own error says a mesh is needed
      shards = math.prod(mesh.shape[a] for a in axes)
  return _search(make, args, options.get("batch_argnums", 1), memory_budget_bytes, search,
                 shards=shards)


_VALUE_AND_GRAD_OPTIONS = tuple(
    name for name, p in inspect.signature(value_and_grad).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _FIXED_BY_PLAN)


def _batch_shards(batches: dict[int, Any]) -> int:
  """Into how many pieces the batch axis is sharded (1 when nothing says)."""
  shards = 1
  for leaf in jax.tree.leaves(batches):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and hasattr(sharding, "shard_shape") and leaf.shape:
      shards = max(shards, leaf.shape[0] // sharding.shard_shape(leaf.shape)[0])
  return shards


def plan_step(
    make_step: Callable[[int], Any],
    *args: Any,
    batch_argnums: int | Sequence[int],
    memory_budget_bytes: int | None = None,
    search: str = "binary",
) -> Plan:
  """Chooses the fewest micro-batches whose whole jitted train step fits a memory budget.

  What has to fit is the train step, not only the gradients: parameters, optimizer state,
  the batch, and the update, with donated buffers reused in place. ``make_step(N)`` returns
  the jitted step for ``N`` micro-batches (typically ``jax.jit(step, donate_argnums=...)``
  around :func:`jaxaccum.value_and_grad` and an optax update); the planner lowers and
  compiles it on ``args`` for candidate ``N`` exactly as :func:`plan` does, and returns the
  fewest micro-batches that fit. ``plan.compiled`` is the chosen step, ready to call.

  Args:
    make_step: ``make_step(num_micro_batches)`` returns a jitted train step.
    *args: the step's arguments (arrays or :class:`jax.ShapeDtypeStruct` s).
    batch_argnums: which of ``args`` carry the batch (their leaves share a leading batch
      axis, whose divisors are the candidate counts).
    memory_budget_bytes: as for :func:`plan`.
    search: as for :func:`plan`.

  Returns:
    A :class:`Plan`.

  Raises:
    ValueError, TypeError: as for :func:`plan`, and a ``make_step`` that does not return a
    jitted function.

  >>> import jax, jax.numpy as jnp, optax
  >>> import jaxaccum
  >>> def loss_fn(w, batch):
  ...   return jnp.mean((batch @ w) ** 2)
  >>> opt = optax.sgd(0.1)
  >>> def make_step(n):
  ...   def step(w, opt_state, batch):
  ...     loss, g = jaxaccum.value_and_grad(loss_fn, num_micro_batches=n)(w, batch)
  ...     updates, opt_state = opt.update(g, opt_state, w)
  ...     return optax.apply_updates(w, updates), opt_state, loss
  ...   return jax.jit(step, donate_argnums=(0, 1))
  >>> w, batch = jnp.ones((8, 2)), jnp.ones((32, 8))
  >>> p = jaxaccum.plan_step(make_step, w, opt.init(w), batch, batch_argnums=2,
  ...                        memory_budget_bytes=2**30)
  >>> p.num_micro_batches
  1
  >>> w, opt_state, loss = p.compiled(w, opt.init(w), batch)
  """
  if not callable(make_step):
    raise TypeError(
        "make_step must be a function of the micro-batch count returning a jitted step, got "
        f"{make_step!r} of type {type(make_step).__name__}."
    )
  return _search(make_step, args, batch_argnums, memory_budget_bytes, search)
