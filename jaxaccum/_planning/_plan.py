"""``jaxaccum.plan`` and ``jaxaccum.plan_step``: choose the micro-batch count from a memory budget.

XLA knows how much memory a compiled program needs before it runs. The planner lowers and
compiles the accumulated program for a few candidate micro-batch counts (divisors of the batch
size), reads each program's memory from :meth:`jax.stages.Compiled.memory_analysis`, and
returns the fewest micro-batches whose program fits the budget. Nothing is ever executed, and
the arguments may be :class:`jax.ShapeDtypeStruct` s, so planning allocates nothing.

With ``target="h100"`` (or another described GPU) the programs are compiled for that GPU on a
machine without one, see :mod:`jaxaccum._planning._gpu_target`.

The search (``N = 1`` first, then a binary search over the other divisors) is described in
:func:`plan` and docs/planning.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, SupportsInt, cast

import jax

from jaxaccum import _transforms
from jaxaccum._core import _options, _roles, _split
from jaxaccum._parallel import _axes
from jaxaccum._planning import _collectives, _gpu_target
from jaxaccum._planning._collectives import Collectives
from jaxaccum._planning._collectives import format_bytes as _fmt_bytes

# The default budget keeps this fraction of the device's `bytes_limit` free for what the
# compiled program's own figure does not count: allocator fragmentation, buffers alive outside
# the program (a prefetched next batch, metrics, a second copy of the parameters for eval) and
# library workspaces (cuBLAS/cuDNN) that XLA allocates outside its buffer assignment.
_SAFETY_MARGIN = 0.10
# On a described GPU the default budget starts from the share of its memory JAX's allocator
# takes (XLA_PYTHON_CLIENT_MEM_FRACTION, this unless set).
_DEFAULT_MEM_FRACTION = 0.75

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
    in_loop_collectives: how many collective ops of the compiled program sit inside a loop
      (each runs once per iteration: per micro-batch, or per layer of a scanned model), as
      :func:`jaxaccum.planning.collectives` counts them.
    placement: ``(param_gather, grad_scatter)`` of this candidate when the planner chose
      among the FSDP placements (parameters sharded over ``data_axis``), else ``None``.
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
  in_loop_collectives: int = 0
  placement: tuple[str, str] | None = None


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
    device: the device the plan was made for: the device kind (e.g. ``"cpu"``, or
      ``"NVIDIA H100 80GB HBM3"``), followed by ``" (described)"`` when it was compiled for a
      described GPU (``target=...``) rather than a device present on this machine.
    num_devices: how many devices the program was compiled for.
    collectives: the chosen program's collectives (a :class:`jaxaccum.planning.Collectives`, as
      :func:`jaxaccum.planning.collectives` reads them), for a described GPU too: what a step
      communicates, and how much of it inside the micro-batch loop.
    placement: ``(param_gather, grad_scatter)`` of the chosen program when the planner
      chose among the FSDP placements (see :func:`plan`), else ``None``; pass them to
      :func:`jaxaccum.value_and_grad` with the chosen count.

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
  device: str = ""
  num_devices: int = 1
  collectives: Collectives = dataclasses.field(
      default_factory=lambda: Collectives(ops=()), repr=False, compare=False)
  placement: tuple[str, str] | None = None

  def table(self) -> str:
    """The candidates as a text table, the chosen row marked."""
    return _table(self.candidates, self.batch_size, self.memory_budget_bytes,
                  self.num_micro_batches, self.device, self.num_devices, self.placement)

  __str__ = table


def _table(candidates: Sequence[PlanCandidate], batch_size: int, budget: int,
           chosen: int | None, device: str = "", num_devices: int = 1,
           placement: tuple[str, str] | None = None) -> str:
  placed = any(c.placement is not None for c in candidates)
  header = ("N", "micro-batch", *(("gather/scatter",) if placed else ()), "peak", "temp",
            "arguments", "outputs", "aliased", "in-loop collectives", "compile s", "")
  rows: list[tuple[str, ...]] = [header]
  for c in sorted(candidates, key=_candidate_order):
    verdict = "fits" if c.fits else "too big"
    if c.num_micro_batches == chosen and c.placement == placement:
      verdict += "  <- chosen"
    where = ("/".join(c.placement) if c.placement else "",) if placed else ()
    rows.append((str(c.num_micro_batches), str(c.micro_batch_size), *where,
                 _fmt_bytes(c.peak_bytes), _fmt_bytes(c.temp_bytes),
                 _fmt_bytes(c.argument_bytes), _fmt_bytes(c.output_bytes),
                 _fmt_bytes(c.alias_bytes), str(c.in_loop_collectives),
                 f"{c.compile_seconds:.2f}", verdict))
  widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
  on = f" on {num_devices} x {device}" if device else ""
  lines = [f"memory plan{on}: batch of {batch_size} rows, budget {_fmt_bytes(budget)} "
           f"({budget:,} bytes) per device"]
  for r in rows:
    cells = [r[k].rjust(widths[k]) for k in range(len(header) - 1)] + [r[-1]]
    lines.append("  ".join(cells).rstrip())
  n_divisors = len(_split.divisors(batch_size))
  if chosen is not None:
    peak = next(c.peak_bytes for c in candidates
                if c.num_micro_batches == chosen and c.placement == placement)
    how = (f", param_gather={placement[0]!r}, grad_scatter={placement[1]!r}"
           if placement else "")
    counts = len({c.num_micro_batches for c in candidates})
    lines.append(f"chosen: num_micro_batches={chosen} (micro_batch_size={batch_size // chosen})"
                 f"{how}, peak {_fmt_bytes(peak)} of {_fmt_bytes(budget)}; compiled "
                 f"{counts} of {n_divisors} divisors of {batch_size}"
                 + (f" ({len(candidates)} programs)" if placed else ""))
  return "\n".join(lines)


# The FSDP placements (param_gather, grad_scatter) the planner compares, least communication
# first: per step the gathers move the full parameters once ("step") or N times
# ("micro_batch"), the reduce-scatters once from a full-size accumulator ("step") or N times
# into a shard-sized one ("micro_batch").
_PLACEMENT_ORDER = (("step", "step"), ("step", "micro_batch"), ("micro_batch", "step"),
              ("micro_batch", "micro_batch"))
# The placement that holds the least memory (nothing full-size lives across the loop): a
# count it does not fit is taken not to fit under any placement.
_LEAST_MEMORY = ("micro_batch", "micro_batch")


def _candidate_order(c: PlanCandidate) -> tuple:
  return (c.num_micro_batches, _PLACEMENT_ORDER.index(c.placement) if c.placement else 0)


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
  if budget < 1:
    raise ValueError(
        f"memory_budget_bytes is a number of bytes, got memory_budget_bytes={budget!r}, less "
        "than one byte (it is not a fraction of the device's memory). Pass bytes, e.g. "
        "memory_budget_bytes=0.5 * 80 * 2**30 for half of 80 GiB."
    )
  # numbers.Real's stub has no __int__, but every Real converts with int().
  return int(cast(SupportsInt, budget))


def _devices(args: tuple) -> list[Any]:
  """The devices the arguments live on (the default device when none says)."""
  devices = {d for sharding in _shardings(args) for d in sharding.device_set}
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


class _Progress:
  """Reports compiled candidates once planning has run longer than ``_PROGRESS_AFTER_S``.

  With tqdm installed a progress bar (on stderr), else one line per compiled candidate.
  ``verbose=True`` reports from the first candidate, ``False`` never, ``None`` (default)
  only once planning is slow enough for it to help.
  """

  def __init__(self, verbose: bool | None, total: int, device: str):
    self.verbose, self.total, self.device = verbose, total, device
    self.start = time.perf_counter()
    self.rows: list[PlanCandidate] = []
    self.bar: Any = None
    self.active = False
    if verbose is True:
      self._activate()

  def _line(self, row: PlanCandidate) -> str:
    verdict = "fits" if row.fits else "too big"
    return (f"jaxaccum.plan{self.device}: N={row.num_micro_batches} (micro-batch "
            f"{row.micro_batch_size}): peak {_fmt_bytes(row.peak_bytes)}, compiled in "
            f"{row.compile_seconds:.1f} s, {verdict}")

  def _activate(self) -> None:
    self.active = True
    try:
      import tqdm
    except ImportError:
      for row in self.rows:
        print(self._line(row), file=sys.stderr, flush=True)
      return
    self.bar = tqdm.tqdm(total=max(self.total, len(self.rows)),
                         desc=f"jaxaccum.plan{self.device}", unit="compile", file=sys.stderr,
                         leave=False, initial=len(self.rows))

  def add(self, row: PlanCandidate) -> None:
    self.rows.append(row)
    if self.verbose is False:
      return
    if not self.active:
      if time.perf_counter() - self.start < _PROGRESS_AFTER_S:
        return
      self._activate()  # reports this row with the earlier ones
    elif self.bar is None:
      print(self._line(row), file=sys.stderr, flush=True)
    else:
      if self.bar.n >= self.bar.total:
        self.bar.total = self.bar.n + 1
      self.bar.update(1)
    if self.bar is not None:
      self.bar.set_postfix_str(f"N={row.num_micro_batches} peak {_fmt_bytes(row.peak_bytes)}")

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


_PROGRESS_AFTER_S = 5.0


class _Trial(NamedTuple):
  """One compiled candidate: its row of the plan's table and what compiling it produced."""

  row: PlanCandidate
  compiled: Any
  jitted: Any
  collectives: Collectives


def _search(make: Callable[..., Any], args: tuple, batch_argnums: Any, budget: Any,
            search: str, shards: int = 1, *, target: _gpu_target.GpuTarget | None = None,
            verbose: bool | None = None, context: Callable[[], Any] | None = None,
            batch_axis: Any = 0, placements: bool = False) -> Plan:
  budget = _check_search(budget, search, verbose)
  argnums = _roles.normalize_argnums("batch_argnums", batch_argnums, allow_empty=False)
  argnums = _roles.resolve_argnums("batch_argnums", argnums, len(args))
  batches = {j: args[j] for j in argnums}
  size = _split.batch_size(batches, axes=_split.batch_axes(batches, batch_axis))
  devices = _devices(args)
  if budget is None:
    budget = _target_budget(target) if target is not None else _default_budget(devices)
  platform = devices[0].platform
  device = devices[0].device_kind + (" (described)" if target is not None else "")
  # A batch sharded over D devices (or split over D data shards by data_axis) only splits in
  # place into micro-batches of a multiple of D rows.
  counts = _counts(size, max(shards, _batch_shards(batches)))
  trials: dict[int, _Trial] = {}
  expected = len(counts) if search == "all" else 1 + math.ceil(math.log2(max(len(counts), 1)))
  progress = _Progress(verbose, expected, f" [{len(devices)} x {device}]" if target else "")

  compiled: list[PlanCandidate] = []

  def trial(n: int, placement: tuple[str, str] | None) -> _Trial:
    t = _compile(make, n, args, size, budget, platform, context, placement)
    progress.add(t.row)
    compiled.append(t.row)
    return t

  def fits(i: int) -> bool:
    n = counts[i]
    if n not in trials:
      if not placements:
        trials[n] = trial(n, None)
      else:
        # trials[n]: the placement that fits with the least communication, else the gate.
        trials[n] = gate = trial(n, _LEAST_MEMORY)
        if gate.row.fits:
          trials[n] = next((t for t in (trial(n, p) for p in _PLACEMENT_ORDER[:-1]) if t.row.fits),
                           gate)
    return trials[n].row.fits

  try:
    found = _find(fits, len(counts), search,
                  lambda: {n: t.row.peak_bytes for n, t in trials.items() if n > 1})
  finally:
    progress.close()
  if found == len(counts):
    fits(len(counts) - 1)  # the most micro-batches allowed, for the error message
    raise _too_small(trials, size, counts[-1], budget, device, len(devices),
                     described=target is not None)
  n = counts[found]
  best = trials[n]
  return Plan(num_micro_batches=n, micro_batch_size=size // n, peak_bytes=best.row.peak_bytes,
              candidates=tuple(sorted(compiled, key=_candidate_order)), batch_size=size,
              memory_budget_bytes=budget, compiled=best.compiled, jitted=best.jitted,
              device=device, num_devices=len(devices), collectives=best.collectives,
              placement=best.row.placement)


def _check_search(budget: Any, search: str, verbose: bool | None) -> int | None:
  """Validates ``_search``'s options; returns the budget (``None``: the default)."""
  budget = _check_budget(budget)
  if search not in _SEARCHES:
    raise ValueError(
        f"search must be one of {', '.join(map(repr, _SEARCHES))}, got search={search!r}.")
  if verbose is not None and not isinstance(verbose, bool):
    raise TypeError(f"verbose must be True, False or None, got verbose={verbose!r}.")
  return budget


def _counts(size: int, shards: int) -> list[int]:
  """The micro-batch counts to try: divisors of ``size`` leaving ``shards`` | rows each."""
  counts = [n for n in _split.divisors(size) if (size // n) % shards == 0]
  if not counts:
    raise ValueError(
        f"the batch of {size} rows is sharded over {shards} devices, which does not divide "
        "it: no micro-batch count splits it in place. Use a batch size that is a multiple of "
        f"{shards}.")
  return counts


def _compile(make: Callable[..., Any], n: int, args: tuple, size: int, budget: int,
             platform: str, context: Callable[[], Any] | None,
             placement: tuple[str, str] | None = None) -> _Trial:
  """Builds ``make(n)`` (``make(n, placement)`` with one), compiles it for ``args`` and
  reads its memory and collectives."""
  start = time.perf_counter()
  jitted = make(n) if placement is None else make(n, placement)
  if not hasattr(jitted, "lower"):
    raise TypeError(
        f"make_step({n}) must return a jitted function (jax.jit(step, "
        f"donate_argnums=...)), got {jitted!r} of type {type(jitted).__name__}."
    )
  with (context() if context is not None else contextlib.nullcontext(),
        _gpu_target.quiet_compiler_stderr()):
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - start
    colls = _collectives.from_compiled(compiled)
  mem = _memory(compiled, platform)
  row = PlanCandidate(num_micro_batches=n, micro_batch_size=size // n,
                      compile_seconds=seconds, fits=mem["peak_bytes"] <= budget,
                      in_loop_collectives=colls.count(in_loop=True), placement=placement,
                      **mem)
  return _Trial(row, compiled, jitted, colls)


def _find(fits: Callable[[int], bool], num_counts: int, search: str,
          peaks: Callable[[], dict[int, int]]) -> int:
  """The index of the fewest micro-batches that fit, ``num_counts`` when none does.

  ``fits(i)`` compiles the ``i``-th count (once) and says whether it fits; ``peaks()`` gives
  the figures compiled so far for counts above 1.
  """
  if search == "all":
    fitting = [i for i in range(num_counts) if fits(i)]
    return fitting[0] if fitting else num_counts
  if fits(0):
    return 0  # the full batch fits: nothing to gain from micro-batches
  found = _bisect(fits, 1, num_counts)
  if _falls(peaks()):
    return found
  # The figures do not fall with N: the binary search's premise does not hold, so try every
  # smaller count it skipped, fewest first (those it compiled there did not fit).
  return next((i for i in range(1, found) if fits(i)), found)


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
  """The first index in ``[lo, hi)`` that fits, if fitting holds from there on; else ``hi``.

  Invariant: the answer is in ``[lo, hi]``; ``hi`` stands for "none fits".
  """
  while lo < hi:
    mid = (lo + hi) // 2
    if fits(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo


def _too_small(trials: dict[int, _Trial], size: int, last: int, budget: int, device: str,
               num_devices: int, *, described: bool) -> ValueError:
  """The error for a budget that no count fits, ``last`` the most micro-batches allowed.

  The message names ``device`` when it is a ``described`` GPU (``target=``).
  """
  rows = sorted(trial.row for trial in trials.values())
  least = min(rows, key=lambda r: r.peak_bytes)
  rows_of = f"micro-batches of {size // last} row{'s' if size // last > 1 else ''}"
  at = (f"num_micro_batches={least.num_micro_batches}" + (
      f" ({rows_of})" if least.num_micro_batches == last else
      f"; even num_micro_batches={last} ({rows_of}) needs {trials[last].row.peak_bytes:,} "
      "bytes"))
  return ValueError(
      f"memory_budget_bytes={budget:,} ({_fmt_bytes(budget)}) is too small"
      f"{' on ' + device if described else ''}: the smallest "
      f"figure reached is {least.peak_bytes:,} bytes ({_fmt_bytes(least.peak_bytes)}) at "
      f"{at}, {least.peak_bytes - budget:,} bytes ({_fmt_bytes(least.peak_bytes - budget)}) "
      "over the budget. Raise the budget, shard the batch over more devices, shrink the "
      "parameters or optimizer state (which no micro-batch count splits), or try remat=True."
      f"\n{_table(rows, size, budget, None, device, num_devices)}"
  )


def _falls(peaks: dict[int, int]) -> bool:
  """Whether the compiled figures never rise as the micro-batch count grows."""
  ordered = [peaks[n] for n in sorted(peaks)]
  return all(a >= b for a, b in zip(ordered, ordered[1:], strict=False))


def _target_budget(target: _gpu_target.GpuTarget) -> int:
  """The default budget on a described GPU: its memory less the documented reserve."""
  if not target.memory_bytes:
    raise ValueError(
        f"memory_budget_bytes is required here: the GPU description {target.name!r} has no "
        "device_memory_size. Pass the budget per device, e.g. memory_budget_bytes=60 * 2**30.")
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                  _DEFAULT_MEM_FRACTION))
  return int(target.memory_bytes * fraction * (1 - _SAFETY_MARGIN))


def _place(args: tuple, batch_argnums: Any, mesh: Any, axis: str) -> tuple:
  """``args`` as ShapeDtypeStructs on ``mesh``: batch leaves split over ``axis``, the rest
  replicated; leaves already placed on the mesh's devices keep their sharding."""
  argnums = _roles.normalize_argnums("batch_argnums", batch_argnums, allow_empty=False)
  argnums = set(_roles.resolve_argnums("batch_argnums", argnums, len(args)))
  mesh_devices = set(mesh.devices.flat)
  P = jax.sharding.PartitionSpec

  def place(leaf: Any, batch: bool) -> Any:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      return leaf
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and set(sharding.device_set) <= mesh_devices:
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    spec = P(axis) if batch and len(leaf.shape) else P()
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                sharding=jax.sharding.NamedSharding(mesh, spec))

  return tuple(jax.tree.map(lambda x, b=i in argnums: place(x, b), a)
               for i, a in enumerate(args))


def plan(
    fun: Callable[..., Any],
    *args: Any,
    target: str | None = None,
    num_devices: int = 1,
    memory_budget_bytes: int | None = None,
    search: str = "binary",
    verbose: bool | None = None,
    **options: Any,
) -> Plan:
  """Chooses the fewest micro-batches whose accumulated value-and-grad fits a memory budget.

  Lowers and compiles (never runs) ``jax.jit(jaxaccum.value_and_grad(fun,
  num_micro_batches=N, **options))`` on ``args`` for candidate counts ``N`` (divisors of the
  batch size), measures each compiled program's memory, and returns the smallest ``N`` whose
  memory is at most the budget. ``N = 1`` is compiled first and chosen when it fits; then a
  binary search over the other divisors (memory falls with ``N`` from ``N = 2`` on, where the
  accumulator's size is fixed), at most ``1 + ceil(log2(d))`` compilations for ``d`` divisors
  (5 for a batch of 4096). Where the figures show memory rising with ``N``, the smaller counts
  the search skipped are compiled too. Each count is compiled at most once, and the chosen
  program comes back compiled, as ``plan.compiled``.

  With ``target`` (e.g. ``"h100"``) the programs are compiled for ``num_devices`` described
  GPUs on this machine, which needs no GPU: ``pip install 'jaxaccum[gpu-plan]'`` and
  ``JAX_PLATFORMS=cpu`` set before JAX initialises. Arguments without a sharding on the
  described GPUs are placed on :func:`jaxaccum.planning.target_mesh` ``(target, (num_devices,),
  (axis,))``: the batch split over ``axis`` (``data_axis`` when given, else ``"data"``), the
  rest replicated; with ``data_axis`` that mesh is passed as ``mesh=``. ShapeDtypeStructs
  already sharded on a :func:`jaxaccum.planning.target_mesh` (e.g. FSDP parameters) keep their
  sharding.

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
    target: ``None`` (default) plans for the devices the arguments are on. Else a GPU to
      compile for without it: a shipped description (``"h100"``, ``"h200"``, ``"a100-80gb"``,
      ``"b200"``), the text of a ``GpuTargetConfigProto`` (see
      :func:`jaxaccum.planning.capture_gpu_target`) or the path of a ``.txtpb`` file holding one.
    num_devices: with ``target``, how many of those GPUs (more than 8 are described as hosts
      of 8).
    memory_budget_bytes: the budget per device, in bytes. ``None`` uses the device's
      ``memory_stats()["bytes_limit"]`` less a 10% safety margin (for fragmentation, buffers
      alive outside the program and library workspaces); backends that do not report a limit
      (CPU) require an explicit budget. With ``target``, ``None`` uses the described memory
      times JAX's allocator share (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 unless set in this
      process's environment), less the same 10%: e.g. 53.4 GiB for ``"h100"``.
    search: ``"binary"`` (default) or ``"all"``, which compiles every divisor.
    verbose: progress on stderr (a tqdm bar when tqdm is installed, else one line per
      compiled candidate with its peak and compile time). ``None`` (default) shows it once
      planning has run 5 s; ``True`` from the start; ``False`` never.
    **options: options of :func:`jaxaccum.value_and_grad` (``batch_argnums``, ``has_aux``,
      ``reduce``, ``remat``, ...), except ``num_micro_batches`` and ``micro_batch_size``,
      which the planner chooses.

  Returns:
    A :class:`Plan`; ``print(plan)`` shows the table of compiled candidates (with the number
    of collectives inside loops for each), ``plan.collectives`` the chosen program's
    collectives (see :func:`jaxaccum.planning.collectives`).

  Raises:
    ValueError: a non-positive budget, no budget on a backend that reports no limit, a budget
      that even ``N = batch size`` exceeds (with the smallest figure reached), batch leaves
      whose leading sizes disagree, a ``data_axis`` that is not in the mesh, an unknown
      ``target``.
    TypeError: a non-numeric budget, an unknown option, or ``num_micro_batches`` /
      ``micro_batch_size`` among the options.
    ImportError: ``target`` without the ``gpu-plan`` extra installed.
    RuntimeError: ``target`` when JAX was initialised without ``JAX_PLATFORMS=cpu``.

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
  # Build once with N = 1 to validate the options eagerly, with the transform's own errors;
  # the plan then reads the validated options, never the raw ones.
  try:
    vg = _transforms.make_value_and_grad(fun, dict(options, num_micro_batches=1))
  except TypeError as e:
    if "unexpected keyword argument" not in str(e):
      raise
    unknown = sorted(set(options) - set(_VALUE_AND_GRAD_OPTIONS))
    raise TypeError(
        f"plan got unknown option(s) {', '.join(map(repr, unknown))}; its options are those "
        f"of jaxaccum.value_and_grad: {', '.join(_VALUE_AND_GRAD_OPTIONS)}."
    ) from None
  opts = vg.options
  axes = None if opts.parallel is None else opts.parallel.axis
  gpu = _target(target, num_devices)
  if gpu is not None:
    if isinstance(axes, tuple) and len(axes) != 1:
      raise ValueError(
          f"with target={gpu.name!r} the planner builds a mesh of one axis, so data_axis must "
          f"name one axis, got data_axis={axes!r}. For a mesh of several axes build it with "
          "jaxaccum.planning.target_mesh and pass it as DataParallel(axis, mesh=...), with "
          "arguments sharded on it.")
    axis = cast(str, axes[0]) if isinstance(axes, tuple) else "data"
    if opts.parallel is not None and opts.parallel.mesh is not None:
      mesh = opts.parallel.mesh
    else:
      mesh = _gpu_target.target_mesh(gpu, (num_devices,), (axis,))
      if axes is not None:
        opts = dataclasses.replace(opts, parallel=dataclasses.replace(
            cast(_axes.DataParallel, opts.parallel), mesh=mesh))
  # The batch positions, resolved as the transform resolves them for this call.
  batch = opts.roles.resolve(len(args), {}).batch
  if gpu is not None:
    args = _place(args, batch, mesh, axis)

  # FSDP parameters under named data axes: the placement is a dimension of the search too,
  # unless the options fix it.
  placements = (isinstance(axes, tuple) and not _placement_given(options)
                and _shards_over(args, opts.roles.resolve(len(args), {}).diff, cast(tuple, axes)))

  def make(n: int, placement: tuple[str, str] | None = None) -> Any:
    parallel = opts.parallel
    if placement is not None:
      parallel = dataclasses.replace(cast(_axes.DataParallel, parallel),
                                     param_gather=placement[0], grad_scatter=placement[1])
    return jax.jit(_transforms.ValueAndGrad(dataclasses.replace(
        opts, split=dataclasses.replace(opts.split, count=n, size=None), parallel=parallel)))

  shards = 1
  if isinstance(axes, tuple):
    mesh = cast(Any, opts.parallel).mesh
    if mesh is None:
      mesh = jax.sharding.get_abstract_mesh()
      mesh = None if mesh.empty else mesh  # then the transform's own error asks for a mesh
    if mesh is not None:
      _axes.check_mesh(mesh, axes)
      shards = math.prod(mesh.shape[a] for a in axes)
  return _search(make, args, batch, memory_budget_bytes, search, shards=shards,
                 target=gpu, verbose=verbose, batch_axis=opts.split.batch_axis,
                 placements=placements)


def _placement_given(options: dict[str, Any]) -> bool:
  """Whether the options fix the FSDP placement (a :class:`jaxaccum.DataParallel` with a
  placement other than the defaults, or the deprecated keywords)."""
  dp = options["data_axis"] if "data_axis" in options else None
  if isinstance(dp, _axes.DataParallel):
    return not dp.default_placement
  return bool({"param_gather", "grad_scatter"} & set(options))


def _shards_over(args: tuple, argnums: Any, axes: tuple[str, ...]) -> bool:
  """Whether a differentiated argument has a leaf sharded over a data axis of an Explicit
  mesh (FSDP): what ``param_gather`` and ``grad_scatter`` act on."""
  diff = _roles.normalize_argnums("argnums", argnums, allow_empty=False)
  for j in _roles.resolve_argnums("argnums", diff, len(args)):
    for leaf in jax.tree.leaves(args[j]):
      sharding = getattr(leaf, "sharding", None)
      if not isinstance(sharding, jax.sharding.NamedSharding):
        continue
      explicit = set(getattr(sharding.mesh, "explicit_axes", ()))
      used = {a for entry in sharding.spec if entry is not None
              for a in (entry if isinstance(entry, tuple) else (entry,))}
      if used & explicit & set(axes):
        return True
  return False


_VALUE_AND_GRAD_OPTIONS = tuple(name for name in _options.DEFAULTS if name not in _FIXED_BY_PLAN)


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
    target: str | None = None,
    num_devices: int = 1,
    memory_budget_bytes: int | None = None,
    search: str = "binary",
    verbose: bool | None = None,
) -> Plan:
  """Chooses the fewest micro-batches whose whole jitted train step fits a memory budget.

  What has to fit is the train step, not only the gradients: parameters, optimizer state,
  the batch, and the update, with donated buffers reused in place. ``make_step(N)`` returns
  the jitted step for ``N`` micro-batches (typically ``jax.jit(step, donate_argnums=...)``
  around :func:`jaxaccum.value_and_grad` and an optax update); the planner lowers and
  compiles it on ``args`` for candidate ``N`` exactly as :func:`plan` does, and returns the
  fewest micro-batches that fit. ``plan.compiled`` is the chosen step, ready to call.

  With ``target``, arguments not already placed on described GPUs are placed on
  :func:`jaxaccum.planning.target_mesh` ``(target, (num_devices,), ("data",))`` (the batch split
  over ``"data"``, the rest replicated), and each step is lowered inside ``jax.set_mesh`` of that
  mesh, so a step using ``value_and_grad(..., data_axis="data")`` finds it. To shard
  parameters too (FSDP), build the mesh with :func:`jaxaccum.planning.target_mesh` and pass
  ShapeDtypeStructs with their shardings.

  Args:
    make_step: ``make_step(num_micro_batches)`` returns a jitted train step.
    *args: the step's arguments (arrays or :class:`jax.ShapeDtypeStruct` s).
    batch_argnums: which of ``args`` carry the batch (their leaves share a leading batch
      axis, whose divisors are the candidate counts).
    target: as for :func:`plan`.
    num_devices: as for :func:`plan`.
    memory_budget_bytes: as for :func:`plan`.
    search: as for :func:`plan`.
    verbose: as for :func:`plan`.

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
  gpu = _target(target, num_devices)
  context = None
  if gpu is not None:
    args = _place(args, batch_argnums, _gpu_target.target_mesh(gpu, (num_devices,)), "data")
    meshes = {s.mesh for s in _shardings(args) if isinstance(s, jax.sharding.NamedSharding)}
    if len(meshes) == 1:
      # A concrete Mesh: _place keeps only shardings over target_mesh's devices.
      mesh = cast(jax.sharding.Mesh, meshes.pop())
      context = functools.partial(jax.set_mesh, mesh)
  return _search(make_step, args, batch_argnums, memory_budget_bytes, search, target=gpu,
                 verbose=verbose, context=context)


def _target(target: Any, num_devices: int) -> _gpu_target.GpuTarget | None:
  """The described GPU of ``target=``; without one, ``num_devices`` must be 1."""
  if target is None:
    if num_devices != 1:
      raise ValueError(
          f"num_devices={num_devices!r} needs target=...: without a target the plan is for the "
          "devices the arguments are placed on.")
    return None
  return _gpu_target.resolve(target)


def _shardings(tree: Any) -> list[Any]:
  return [leaf.sharding for leaf in jax.tree.leaves(tree)
          if getattr(leaf, "sharding", None) is not None]
