"""Shared benchmark helpers: compile with statistics, interleaved timing, the environment.

Every benchmark compiles first (``.lower(...).compile()``, timed), warms up, then times
its methods round-robin in one process (repeat ``r`` visits the methods in an order
rotated by ``r``, so drift in the machine's load falls on all of them alike) and reports
medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

MIB = 2.0**20


def device_info() -> dict[str, Any]:
  """The device, host and library versions the numbers were taken on."""
  dev = jax.devices()[0]
  return {
      "device_kind": dev.device_kind,
      "platform": dev.platform,
      "num_devices": jax.device_count(),
      "host_cpus": os.cpu_count(),
      "host": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "date": datetime.date.today().isoformat(),
  }


def compile_with_stats(make_jitted: Callable[[], Any], *args: Any,
                       repeats: int = 1) -> tuple[Any, dict[str, float]]:
  """Lowers and compiles ``make_jitted()`` for ``args``; returns it and its statistics.

  ``make_jitted`` returns a fresh ``jax.jit`` of a fresh function object each time, so
  each of the ``repeats`` compilations misses JAX's caches; ``compile_s`` is the fastest
  (the least disturbed by other load on the machine), ``compile_s_all`` all of them. The
  memory statistics, in bytes from ``memory_analysis()``, are ``argument``, ``output``,
  ``alias``, ``temp`` and ``total = argument + output + temp - alias`` (what the
  executable needs at its peak, inputs and outputs included; donated inputs counted once).
  """
  times = []
  for _ in range(max(1, repeats)):
    fn = make_jitted()
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    times.append(time.perf_counter() - t0)
  stats: dict[str, Any] = {"compile_s": min(times), "compile_s_all": times}
  mem = compiled.memory_analysis()
  for key, attr in (("argument", "argument_size_in_bytes"), ("output", "output_size_in_bytes"),
                    ("alias", "alias_size_in_bytes"), ("temp", "temp_size_in_bytes")):
    stats[key] = float(getattr(mem, attr, 0) or 0) if mem is not None else float("nan")
  stats["total"] = stats["argument"] + stats["output"] + stats["temp"] - stats["alias"]
  return compiled, stats


def fresh_jit(fun: Callable[..., Any], **jit_kwargs: Any) -> Callable[[], Any]:
  """A factory of ``jax.jit(f)`` for a new wrapper ``f`` of ``fun`` each call (no cache hit)."""
  return lambda: jax.jit(lambda *args: fun(*args), **jit_kwargs)


def time_interleaved(
    runners: dict[str, Callable[[], Any]], *, repeats: int, warmup: int
) -> dict[str, list[float]]:
  """Times each zero-argument runner ``repeats`` times, round-robin, after ``warmup`` calls.

  Each runner does one step and blocks until its results are ready. Returns the list of
  wall times in seconds per runner.
  """
  names = list(runners)
  for _ in range(warmup):
    for name in names:
      runners[name]()
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(repeats):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      t0 = time.perf_counter()
      runners[name]()
      times[name].append(time.perf_counter() - t0)
  return times


def median(xs: Sequence[float]) -> float:
  """The median of a non-empty sequence (NaN when empty)."""
  return statistics.median(xs) if xs else float("nan")


def block(tree: Any) -> Any:
  """``jax.block_until_ready`` on a pytree; returns it."""
  return jax.block_until_ready(tree)


def write_results(out_dir: pathlib.Path, name: str, results: dict[str, Any],
                  markdown: Callable[[dict[str, Any]], str]) -> None:
  """Writes ``name.json`` (the figures) and ``name.md`` (their tables) into ``out_dir``."""
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1, default=float))
  (out_dir / f"{name}.md").write_text(markdown(results))


def main(doc: str, run: Callable[..., dict[str, Any]], markdown: Callable[..., str], *,
         quick_help: str, out_dir: pathlib.Path, argv: Sequence[str] | None = None) -> None:
  """The command line shared by the feature benchmarks: ``--quick`` (or ``BENCH_QUICK=1``),
  ``--repeats``, ``--warmup`` and ``--out-dir``; runs ``run`` and prints its tables."""
  parser = argparse.ArgumentParser(description=doc.split("\n")[0])
  parser.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK")
                      == "1", help=f"{quick_help} (also BENCH_QUICK=1)")
  parser.add_argument("--repeats", type=int)
  parser.add_argument("--warmup", type=int)
  parser.add_argument("--out-dir", type=pathlib.Path, default=out_dir)
  args = parser.parse_args(argv)
  results = run(quick=args.quick, repeats=args.repeats, warmup=args.warmup,
                out_dir=args.out_dir)
  print(markdown(results))
