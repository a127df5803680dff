"""``overlap_grad_reduce``: are gradient all-reduces scheduled before the last backward ends?

Compiles ``jaxaccum.value_and_grad(loss, num_micro_batches=N, data_axis="data")`` with and
without ``overlap_grad_reduce=True`` for 8 described H100s (``jaxaccum.planning.target_mesh``:
XLA's GPU compiler on this machine's CPU; nothing runs), on the two bf16 models of
``bench_gpu_target.py`` (the MLP and the scan-over-layers LM), and reads the entry
computation of the scheduled program (``compiled.as_text()``, printed in schedule order):

* the position of the *last GEMM* of the entry computation: the last instruction that is a
  cuBLAS GEMM or a GEMM fusion, or that runs one inside it (a ``while`` loop whose body
  holds GEMMs, such as a scan over layers, counts as one position: its GEMMs end with it);
* the asynchronous all-reduce starts of gradients (``all-reduce-start`` with an operand of
  a parameter's shape, each named by :func:`jaxaccum.planning.collectives`), and how many are
  scheduled before that position, and how many GEMMs run while one is in flight: those
  reductions can run while the rest of the last backward pass computes. Without the
  option the last backward is inside the micro-batch ``while`` loop, so every reduction
  after the loop comes after the last GEMM by construction;
* compile time, and code size: the HLO text's length, the number of entry instructions and
  the generated code (``compiled.runtime_executable()`` serialised, where it can be);
* peak and temporary memory, against ``N / 2`` micro-batches without the option: the last
  micro-batch's temporaries, outside the loop, do not share the loop body's buffers.

Each configuration is compiled with XLA's defaults and with a few flag sets
(``compiler_options`` on ``.compile()``) that control the combiner and the scheduler.

Run in the environment with the ``gpu-plan`` extra (``make bench`` does):
``JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/bench_overlap.py`` (``--quick``: smaller
models). Output: ``benchmarks/results/overlap{,_quick}.{json,md}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax initialises: see jaxaccum.plan

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import bench_gpu_target as gt  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
N = 4
DEVICES = 8

# Flag sets tried on .compile(compiler_options=...): XLA's defaults, no all-reduce
# combining (each gradient its own reduction), and the latency-hiding scheduler asked for
# explicitly with a 4 MiB combine threshold.
FLAGS: dict[str, dict[str, Any]] = {
    "default": {},
    "no combine": {"xla_gpu_all_reduce_combine_threshold_bytes": 0},
    "LHS, 4 MiB combine": {"xla_gpu_enable_latency_hiding_scheduler": True,
                           "xla_gpu_all_reduce_combine_threshold_bytes": 4 * 2**20},
}

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_DONE = re.compile(r"all-reduce-done\(%?([\w.\-]+)\)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  comps: dict[str, list[str]] = {}
  entry, current = None, None
  for line in text.splitlines():
    m = _HEADER.match(line) if not line.startswith((" ", "}")) else None
    if m:
      current = m.group(2)
      comps[current] = []
      entry = current if m.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and line.strip():
      comps[current].append(line)
  assert entry is not None, "no ENTRY computation in the HLO text"
  return comps, entry


def _callees(line: str) -> list[str]:
  out = _CALLS.findall(line)
  for group in _BRANCHES.findall(line):
    out += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
  return out


def _is_gemm(line: str) -> bool:
  return ("__cublas" in line or "__triton_gemm" in line or " dot(" in line
          or "kind=kCustom" in line and "gemm" in line)


def schedule(text: str, all_reduce_names: Sequence[str]) -> dict[str, Any]:
  """Where the all-reduce starts sit against the entry computation's last GEMM.

  ``text`` is a scheduled compiled program (``compiled.as_text()``); ``all_reduce_names``
  the names of its asynchronous all-reduces at loop depth 0 (from
  :func:`jaxaccum.planning.collectives`). Returns the entry position of the last instruction that
  is or runs a GEMM, the positions of the all-reduce starts, how many come before it, and
  how many GEMM-running entry instructions sit between a start and its done.
  """
  comps, entry = _computations(text)
  memo: dict[str, bool] = {}

  def runs_gemm(comp: str, seen: frozenset = frozenset()) -> bool:
    if comp not in memo:
      lines = comps.get(comp, [])
      memo[comp] = any(_is_gemm(ln) or any(runs_gemm(c, seen | {comp}) for c in _callees(ln)
                                           if c not in seen) for ln in lines)
    return memo[comp]

  names = set(all_reduce_names)
  lines = comps[entry]
  gemm_at, starts, dones = [], {}, {}
  for pos, line in enumerate(lines):
    m = _NAME.match(line)
    name = m.group(1) if m else ""
    if _is_gemm(line) or any(runs_gemm(c) for c in _callees(line)):
      gemm_at.append(pos)
    if name in names and "all-reduce-start(" in line:
      starts[name] = pos
    done = _DONE.search(line)
    if done and done.group(1) in names:
      dones[done.group(1)] = pos
  last = max(gemm_at, default=-1)
  before = sorted(n for n, p in starts.items() if p < last)
  overlapped = sum(any(starts[n] < g < dones.get(n, len(lines)) for n in starts)
                   for g in gemm_at)
  return {"entry_instructions": len(lines), "last_gemm_position": last,
          "all_reduce_starts": len(starts), "starts_before_last_gemm": len(before),
          "start_positions": sorted(starts.values()),
          "gemm_positions_inside_an_all_reduce": overlapped}


def gradient_reductions(found: Any, params: Any) -> list[Any]:
  """The all-reduces after the loop (depth 0) that reduce a gradient: an operand with a
  parameter's shape, or a flat one at least as large as the smallest parameter (XLA's GPU
  combiner concatenates the reductions it combines into one flat buffer). The loss and the
  counters are reduced too, but are ready early: they are not counted."""
  shapes = {tuple(p.shape) for p in jax.tree.leaves(params)}
  smallest = min(math.prod(s) for s in shapes)
  return [c for c in found.select("all-reduce") if not c.in_loop and any(
      tuple(s) in shapes or len(s) == 1 and s[0] >= smallest for s in c.shapes)]


def code_size(compiled: Any) -> int | None:
  """Bytes of the serialised executable (the generated GPU code with its HLO), if available."""
  try:
    return len(compiled.runtime_executable().serialize())
  except Exception:  # noqa: BLE001 -- not every backend and jaxlib can serialise here
    return None


def analyse(loss_fn, params, batch, *, overlap: bool, flags: dict[str, Any],
            n: int = N) -> dict[str, Any]:
  mesh = jaxaccum.planning.target_mesh("h100", (DEVICES,), ("data",))
  args = (gt.place(params, mesh, P()), gt.place(batch, mesh, P("data")))
  fn = jaxaccum.value_and_grad(loss_fn, num_micro_batches=n,
                               data_axis=jaxaccum.DataParallel("data", mesh=mesh,
                                   overlap_grad_reduce=overlap))
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile(compiler_options=flags or None)
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  found = jaxaccum.planning.collectives(compiled)
  reduces = gradient_reductions(found, params)
  sched = schedule(text, [c.name for c in reduces])
  return {"overlap": overlap, "n": n, "compile_s": seconds, "hlo_chars": len(text),
          "executable_bytes": code_size(compiled),
          "all_reduces": len(reduces), "all_reduce_bytes": sum(c.bytes for c in reduces),
          "in_loop_collectives": found.count(in_loop=True),
          "peak": float(compiled.memory_analysis().peak_memory_in_bytes),
          "temp": float(compiled.memory_analysis().temp_size_in_bytes), **sched}


def problems(quick: bool, tiny: bool = False) -> dict[str, tuple[Any, Any]]:
  if tiny:  # --tiny: the tiny model of bench_gpu_target.py
    return gt.problems(quick, tiny=True)
  if quick:
    return {"mlp": (gt.mlp_problem, gt.MLPConfig(batch=1024, d_in=256, hidden=1024)),
            "lm": (gt.lm_problem, gt.LMConfig(batch=64, seq=256, vocab=4096, d_model=256,
                                              heads=4, layers=4))}
  return {"mlp": (gt.mlp_problem, gt.MLPConfig()), "lm": (gt.lm_problem, gt.LMConfig())}


def run(quick: bool, flag_sets: Sequence[str], tiny: bool = False) -> list[dict[str, Any]]:
  rows = []
  for name, (make, cfg) in problems(quick, tiny).items():
    loss_fn, params, batch = make(cfg)
    runs = [(label, overlap, N) for label in flag_sets for overlap in (False, True)]
    # The memory reference: the option's temporaries against half as many micro-batches.
    runs.append((flag_sets[0], False, N // 2))
    for label, overlap, n in runs:
      r = analyse(loss_fn, params, batch, overlap=overlap, flags=FLAGS[label], n=n)
      rows.append({"model": name, "flags": label, **r})
      print(f"  {name} [{label}] N={n} overlap={overlap}: {r['starts_before_last_gemm']} of "
              f"{r['all_reduce_starts']} all-reduce starts before the last GEMM (entry "
              f"position {r['last_gemm_position']} of {r['entry_instructions']}); compile "
              f"{r['compile_s']:.1f} s, HLO {r['hlo_chars']:,} chars, executable "
              f"{r['executable_bytes']}, temp {r['temp'] / gt.GIB:.2f} GiB", flush=True)
  return rows


def markdown(results: dict[str, Any]) -> str:
  env = results["environment"]
  lines = ["# overlap_grad_reduce on 8 described H100s", "",
           f"> {gt.NOTE}", "",
           f"jax {env['jax']}, `jaxaccum/gpu_targets/h100.txtpb` x {DEVICES}, compiled on "
           f"{env['host_cpus']} CPU cores ({env['host']}), {env['date']}. N = {N}, batch "
           "sharded over `data`, parameters replicated, `data_axis=\"data\"`. Command: "
           f"`{env['command']}`.", ""]
  for name, info in results["models"].items():
    lines.append(f"- `{name}`: {info['config']}")
  lines += ["", "\"before last GEMM\": asynchronous all-reduce starts scheduled in the entry "
            "computation before its last instruction that is or runs a GEMM (a loop over "
            "layers counts as one); \"GEMMs inside a reduction\": GEMM-running entry "
            "instructions scheduled between a gradient all-reduce's start and its done. "
            "Executable: the serialised executable's bytes. The last row of each model, "
            f"N = {N // 2} without the option, is the memory reference.", "",
            "| model | flags | N | overlap | gradient all-reduces (MiB) | starts before last "
            "GEMM | GEMMs inside a reduction | compile (s) | HLO chars | executable bytes | "
            "peak / temp (GiB) |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results["rows"]:
    lines.append(
        f"| {r['model']} | {r['flags']} | {r['n']} | {'on' if r['overlap'] else 'off'} | "
        f"{r['all_reduces']} ({r['all_reduce_bytes'] / 2**20:.1f}) | "
        f"{r['starts_before_last_gemm']} of {r['all_reduce_starts']} | "
        f"{r['gemm_positions_inside_an_all_reduce']} | {r['compile_s']:.1f} | "
        f"{r['hlo_chars']:,} | {r['executable_bytes'] or 'n/a'} | "
        f"{r['peak'] / gt.GIB:.2f} / {r['temp'] / gt.GIB:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      default=os.environ.get("BENCH_QUICK") == "1",
                      help="smaller models (also BENCH_QUICK=1)")
  parser.add_argument("--flags", nargs="*", default=list(FLAGS), choices=list(FLAGS))
  parser.add_argument("--out-dir", type=pathlib.Path, help=f"default: {RESULTS}")
  _common.add_tiny(parser)
  args = parser.parse_args(argv)
  args.out_dir = _common.out_dir_for(args.tiny, args.out_dir, RESULTS)
  if args.tiny:  # one flag set
    args.flags = args.flags[:1]
  start = time.perf_counter()
  results: dict[str, Any] = {
      "environment": {"jax": jax.__version__, "host_cpus": os.cpu_count(),
                      "host": platform.platform(), "date": datetime.date.today().isoformat(),
                      "command": "JAX_PLATFORMS=cpu .venv-gpu/bin/python "
                                 f"benchmarks/bench_overlap.py{' --quick' * args.quick}"},
      "models": {name: {"config": dataclasses.asdict(cfg)}
                 for name, (_, cfg) in problems(args.quick, args.tiny).items()}}
  results["rows"] = run(args.quick, args.flags, args.tiny)
  results["environment"]["seconds"] = time.perf_counter() - start
  args.out_dir.mkdir(parents=True, exist_ok=True)
  suffix = "_quick" if args.quick else ""
  (args.out_dir / f"overlap{suffix}.json").write_text(json.dumps(results, indent=1))
  (args.out_dir / f"overlap{suffix}.md").write_text(markdown(results))
  print(markdown(results))
  print(f"done in {results['environment']['seconds']:.0f} s; results in {args.out_dir}")


if __name__ == "__main__":
  main()
