"""Compiled GPU programs, without a GPU: memory, collectives and fusion against N.

Every program here is compiled for a *described* NVIDIA GPU
(``jaxaccum.planning.target_mesh``: XLA's GPU compiler and ptxas, on this machine's CPU) and
read back with ``memory_analysis()`` and
``as_text()``. Nothing runs, so these are compiled-program figures, not timings. Without the
device XLA does not autotune: on a real GPU the autotuner may choose other GEMM kernels
(Triton or cuBLAS), other tilings and so slightly other buffers.

Two bf16 models at GPU scale:

* ``lm``: a ~110M-parameter causal transformer LM (12 layers scanned, d_model 768, 12 heads,
  vocabulary 16384, 1024 tokens, batch 256 sequences);
* ``mlp``: an MLP classifier (1024 -> 3 x 4096 -> 10, batch 8192), the GPU configuration of
  ``bench_accumulation.py``.

Sections (per model):

1. memory against N on one H100 and one H200: per-device peak and temp bytes for the full
   batch (``jax.value_and_grad``), ``jaxaccum.value_and_grad`` and ``optax.microbatch``;
2. collectives per step on 1, 8 and 2 x 8 H100s (batch sharded over ``data``, parameters
   replicated), ``jaxaccum`` with and without ``data_axis``: every collective with its dtype,
   element count, and whether it runs inside the micro-batch loop (once per micro-batch) or
   once per step;
3. whether the float32 accumulation add fuses into the weight-gradient GEMM, with XLA's
   defaults and with ``--xla_gpu_enable_triton_gemm=false``.

Run in the environment with the ``gpu-plan`` extra (``make bench`` does):
``JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/bench_gpu_target.py`` (``BENCH_QUICK=1``
or ``--quick``: N in {1, 4, 16} instead of 1 to 32). Output:
``benchmarks/results/gpu_target{,_quick}.{json,md}`` and ``gpu_target{,_quick}_memory.png``.
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
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
GIB = 2.0**30
ALL_NS = (1, 2, 4, 8, 16, 32)
QUICK_NS = (1, 4, 16)
COLLECTIVE_N = 4
NOTE = ("Compiled-program figures, not timings: every program was compiled for a described "
        "GPU on a machine without one (jaxaccum.planning.target_mesh) and never run. Without the "
        "device XLA does not autotune, so on a real GPU the autotuner may choose other GEMM "
        "kernels (Triton or cuBLAS) and slightly different buffers.")


# ----------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class LMConfig:
  batch: int = 256
  seq: int = 1024
  vocab: int = 16384
  d_model: int = 768
  heads: int = 12
  layers: int = 12


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  batch: int = 8192
  d_in: int = 1024
  hidden: int = 4096
  depth: int = 3
  classes: int = 10


def lm_problem(cfg: LMConfig):
  """``(loss_fn, params, batch)`` as ShapeDtypeStructs: bf16 parameters, int32 tokens."""
  d, L = cfg.d_model, cfg.layers
  bf = jnp.bfloat16
  sds = jax.ShapeDtypeStruct
  params = {
      "embed": sds((cfg.vocab, d), bf), "pos": sds((cfg.seq, d), bf),
      "layers": {"norm1": sds((L, d), bf), "qkv": sds((L, d, 3 * d), bf),
                 "out": sds((L, d, d), bf), "norm2": sds((L, d), bf),
                 "up": sds((L, d, 4 * d), bf), "down": sds((L, 4 * d, d), bf)},
      "norm_f": sds((d,), bf), "unembed": sds((d, cfg.vocab), bf),
  }
  tokens = sds((cfg.batch, cfg.seq + 1), jnp.int32)
  h = cfg.heads

  def loss_fn(params, tokens):
    return _common.scanned_lm_loss(params, tokens, h)

  return loss_fn, params, tokens


def mlp_problem(cfg: MLPConfig):
  bf = jnp.bfloat16
  sds = jax.ShapeDtypeStruct
  sizes = [cfg.d_in] + [cfg.hidden] * cfg.depth + [cfg.classes]
  params = [{"w": sds((m, n), bf), "b": sds((n,), bf)} for m, n in zip(sizes[:-1], sizes[1:],
                                                                         strict=True)]
  batch = (sds((cfg.batch, cfg.d_in), bf), sds((cfg.batch,), jnp.int32))

  def loss_fn(params, batch):
    h, labels = batch
    for layer in params[:-1]:
      h = jax.nn.gelu(h @ layer["w"] + layer["b"])
    logits = (h @ params[-1]["w"] + params[-1]["b"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss_fn, params, batch


def problems(quick: bool, tiny: bool = False) -> dict[str, tuple[Any, Any]]:
  if tiny:  # --tiny: the smallest scanned LM (the MLP runs the same code), to check that
    # the script runs
    return {"lm": (lm_problem, LMConfig(batch=64, seq=8, vocab=64, d_model=32, heads=2,
                                        layers=2))}
  return {"lm": (lm_problem, LMConfig()), "mlp": (mlp_problem, MLPConfig())}


def num_params(params) -> int:
  return sum(math.prod(p.shape) for p in jax.tree.leaves(params))


# ------------------------------------------------------------------------ placement


def place(tree, mesh, spec):
  sharding = NamedSharding(mesh, spec)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def compile_for(fn, args, **compiler_options):
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile(compiler_options=compiler_options or None)
  return compiled, time.perf_counter() - start


def memory(compiled) -> dict[str, float]:
  m = compiled.memory_analysis()
  return {"peak": float(m.peak_memory_in_bytes), "temp": float(m.temp_size_in_bytes),
          "argument": float(m.argument_size_in_bytes), "output": float(m.output_size_in_bytes)}


def methods(loss_fn, batch_size: int, n: int) -> dict[str, Any]:
  out = {"jaxaccum": jaxaccum.value_and_grad(loss_fn, num_micro_batches=n)}
  out["optax.microbatch"] = optax.microbatch(
      jax.value_and_grad(loss_fn), argnums=1, microbatch_size=batch_size // n,
      accumulator=optax.microbatching.AccumulationType.MEAN)
  return out


# ---------------------------------------------------------------------------- HLO text

_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_INSTR = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\(")


def _loop_computations(text: str):
  """The HLO computations that run inside a while loop (the micro-batch loop and everything
  it calls), by name, read with the HLO walk of ``jaxaccum.planning.collectives``."""
  return jaxaccum.planning.Collectives.from_text(text).computations(in_loop=True)


def collectives(compiled) -> list[dict[str, Any]]:
  """Every collective of a compiled program, read with ``jaxaccum.planning.collectives``: kind,
  whether it sits in a loop, how many times it runs per step, dtypes, elements and bytes."""
  out = []
  for op in jaxaccum.planning.collectives(compiled):
    runs = op.executions if op.executions is not None else COLLECTIVE_N ** op.loop_depth
    out.append({"kind": op.kind, "in_loop": op.in_loop, "executions": runs,
                "dtypes": sorted({o.dtype for o in op.operands}),
                "elements": int(sum(math.prod(o.shape) for o in op.operands)),
                "bytes": op.bytes})
  return out


def fusion_report(text: str, weight_shapes: set[tuple[int, ...]]) -> dict[str, Any]:
  """Weight-gradient GEMMs in the micro-batch loop and where their float32 add happens."""
  in_loop = _loop_computations(text)
  cublas = cublas_beta1 = triton = adds = 0
  for lines in in_loop.values():
    for line in lines:
      m = _INSTR.match(line)
      if not m:
        continue
      result, op = m.group(1), m.group(2)
      shapes = [tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(result)]
      weightlike = any(s in weight_shapes for s in shapes)
      if not weightlike:
        continue
      if op == "custom-call" and "__cublas" in line:
        cublas += 1
        cublas_beta1 += '"beta":1' in line
      elif op == "fusion" and "kind=kCustom" in line and ("gemm_fusion" in line
                                                         or "triton" in line):
        triton += 1
      elif (op == "fusion" and ("kind=kLoop" in line or "kind=kInput" in line)
            and "add" in line.split("=", 1)[0] and result.lstrip("(").startswith("f32[")):
        adds += 1
  return {"cublas_gemms": cublas, "cublas_gemms_accumulating_beta1": cublas_beta1,
          "triton_gemm_fusions": triton, "separate_f32_add_fusions": adds}


# ------------------------------------------------------------------------------ runs


def run_memory(name, make, cfg, ns, targets) -> list[dict[str, Any]]:
  loss_fn, params, batch = make(cfg)
  rows = []
  for target in targets:
    mesh = jaxaccum.planning.target_mesh(target, (1,), ("data",))
    args = (place(params, mesh, P()), place(batch, mesh, P()))
    compiled, seconds = compile_for(jax.value_and_grad(loss_fn), args)
    rows.append({"model": name, "target": target, "method": "full", "n": 1,
                 "compile_s": seconds, **memory(compiled)})
    print(f"  {name} {target} full: peak {rows[-1]['peak'] / GIB:.2f} GiB ({seconds:.1f} s)",
          flush=True)
    for n in ns:
      for method, fn in methods(loss_fn, cfg.batch, n).items():
        compiled, seconds = compile_for(fn, args)
        rows.append({"model": name, "target": target, "method": method, "n": n,
                     "compile_s": seconds, **memory(compiled)})
        print(f"  {name} {target} {method} N={n}: peak {rows[-1]['peak'] / GIB:.2f} GiB, "
              f"temp {rows[-1]['temp'] / GIB:.2f} GiB ({seconds:.1f} s)", flush=True)
  return rows


def run_collectives(name, make, cfg, device_counts) -> list[dict[str, Any]]:
  loss_fn, params, batch = make(cfg)
  rows = []
  for count in device_counts:
    mesh = jaxaccum.planning.target_mesh("h100", (count,), ("data",))
    args = (place(params, mesh, P()), place(batch, mesh, P("data")))
    for mode in ("jit", "data_axis"):
      options = {"data_axis": "data", "mesh": mesh} if mode == "data_axis" else {}
      fn = jaxaccum.value_and_grad(loss_fn, num_micro_batches=COLLECTIVE_N, **options)
      compiled, seconds = compile_for(fn, args)
      found = collectives(compiled)
      per_step = sum(c["executions"] for c in found)
      rows.append({"model": name, "devices": count, "mode": mode, "n": COLLECTIVE_N,
                   "collectives": found, "per_step": per_step, "compile_s": seconds,
                   "bytes_per_step": bytes_per_step(found), **memory(compiled)})
      print(f"  {name} {count} GPUs {mode}: {per_step} collectives per step "
            f"{summarize(found)} ({seconds:.1f} s)", flush=True)
  return rows


def run_fusion(name, make, cfg) -> list[dict[str, Any]]:
  loss_fn, params, batch = make(cfg)
  shapes = {tuple(p.shape) for p in jax.tree.leaves(params) if len(p.shape) >= 2}
  shapes |= {s[1:] for s in shapes if len(s) == 3}  # layers scanned: one layer's slice
  mesh = jaxaccum.planning.target_mesh("h100", (1,), ("data",))
  args = (place(params, mesh, P()), place(batch, mesh, P()))
  rows = []
  for label, options in (("default", {}),
                         ("triton_gemm=false", {"xla_gpu_enable_triton_gemm": False})):
    fn = jaxaccum.value_and_grad(loss_fn, num_micro_batches=COLLECTIVE_N)
    compiled, seconds = compile_for(fn, args, **options)
    report = fusion_report(compiled.as_text(), shapes)
    rows.append({"model": name, "flags": label, "n": COLLECTIVE_N, "compile_s": seconds,
                 **report, **memory(compiled)})
    print(f"  {name} fusion {label}: {report} ({seconds:.1f} s)", flush=True)
  return rows


def bytes_per_step(found: Sequence[dict[str, Any]]) -> int:
  """Bytes the collectives reduce or move per step (result bytes x executions)."""
  return sum(c["bytes"] * c["executions"] for c in found)


def summarize(found: Sequence[dict[str, Any]]) -> str:
  if not found:
    return "none"
  parts = []
  for c in found:
    where = "loop" if c["in_loop"] else "step"
    parts.append(f"{c['kind']} {'/'.join(c['dtypes'])}[{c['elements']:,}] ({where})")
  return "; ".join(parts)


# ---------------------------------------------------------------------------- report


def markdown(results: dict[str, Any]) -> str:
  env = results["environment"]
  lines = ["# Compiled GPU programs without a GPU: memory, collectives, fusion", "",
           f"> {NOTE}", "",
           f"jax {env['jax']}, described GPUs from `jaxaccum/gpu_targets/`, compiled on "
           f"{env['host_cpus']} CPU cores ({env['host']}), {env['date']}. "
           f"Command: `{env['command']}`.", ""]
  for name, info in results["models"].items():
    lines.append(f"- `{name}`: {info['params']:,} bf16 parameters, {info['config']}")
  lines += ["", "## Per-device memory against N (one GPU)", "",
            "Peak is XLA's `peak_memory_in_bytes` (arguments, outputs and temporaries); "
            "temp is the scratch where activations live. `full` is `jax.value_and_grad` on "
            "the whole batch.", ""]
  lines.append("| model | GPU | N | full peak / temp (GiB) | jaxaccum peak / temp | "
               "optax.microbatch peak / temp |")
  lines.append("|---|---|---:|---:|---:|---:|")
  mem = results["memory"]
  for name in results["models"]:
    for target in sorted({r["target"] for r in mem}):
      full = next(r for r in mem if r["model"] == name and r["target"] == target
                  and r["method"] == "full")
      for n in sorted({r["n"] for r in mem if r["method"] != "full"}):
        cells = []
        for method in ("jaxaccum", "optax.microbatch"):
          r = next(r for r in mem if r["model"] == name and r["target"] == target
                   and r["method"] == method and r["n"] == n)
          cells.append(f"{r['peak'] / GIB:.2f} / {r['temp'] / GIB:.2f}")
        f = f"{full['peak'] / GIB:.2f} / {full['temp'] / GIB:.2f}" if n == 1 else ""
        lines.append(f"| {name} | {target} | {n} | {f} | {cells[0]} | {cells[1]} |")
  lines += ["", f"## Collectives per step (H100s, N = {COLLECTIVE_N}, batch sharded over "
            "`data`, parameters replicated)", "",
            "\"loop\": inside the micro-batch loop, run N times per step; \"step\": once per "
            "step. `jit` is `jaxaccum.value_and_grad` under `jax.jit` with sharded inputs "
            "and no option; `data_axis` adds `data_axis=\"data\"`. 2 x 8 GPUs are described "
            "as two hosts of 8.", "",
            "| model | GPUs | mode | per step | MiB per step | peak (GiB) | collectives "
            "(dtype[elements], where) |",
            "|---|---:|---|---:|---:|---:|---|"]
  for r in results["collectives"]:
    lines.append(f"| {r['model']} | {r['devices']} | {r['mode']} | {r['per_step']} | "
                 f"{r['bytes_per_step'] / 2**20:.1f} | {r['peak'] / GIB:.2f} | "
                 f"{summarize(r['collectives'])} |")
  lines += ["", f"## Does the accumulation add fuse into the weight-gradient GEMM? (one H100, "
            f"N = {COLLECTIVE_N})", "",
            "Counted inside the micro-batch loop, over GEMMs and fusions whose result has a "
            "weight's shape: cuBLAS GEMMs (and those with `beta=1`, which add into the "
            "float32 accumulator in place), Triton GEMM fusions, and separate float32 add "
            "fusions (a second pass over the gradient).", "",
            "| model | flags | cuBLAS GEMMs | of which beta=1 (add fused) | Triton GEMM fusions "
            "| separate f32 adds | peak (GiB) |", "|---|---|---:|---:|---:|---:|---:|"]
  for r in results["fusion"]:
    lines.append(f"| {r['model']} | {r['flags']} | {r['cublas_gemms']} | "
                 f"{r['cublas_gemms_accumulating_beta1']} | {r['triton_gemm_fusions']} | "
                 f"{r['separate_f32_add_fusions']} | {r['peak'] / GIB:.2f} |")
  lines += ["", "## Findings", ""] + [f"- {f}" for f in results["findings"]]
  return "\n".join(lines) + "\n"


def findings(results: dict[str, Any]) -> list[str]:
  out = []
  for r in results["collectives"]:
    if r["devices"] > 1 and r["mode"] == "jit":
      big = [c for c in r["collectives"] if c["elements"] > 1]
      dts = sorted({d for c in big for d in c["dtypes"]})
      in_loop = sum(c["in_loop"] for c in big)
      out.append(f"{r['model']} on {r['devices']} GPUs without data_axis: gradient "
                 f"reductions in {'/'.join(dts) or 'none'}, {in_loop} of {len(big)} inside "
                 "the loop.")
    if r["devices"] > 1 and r["mode"] == "data_axis":
      dts = sorted({d for c in r["collectives"] for d in c["dtypes"]})
      in_loop = sum(c["in_loop"] for c in r["collectives"])
      kinds = sorted({c["kind"] for c in r["collectives"]})
      out.append(f"{r['model']} on {r['devices']} GPUs with data_axis: {', '.join(kinds)} in "
                 f"{'/'.join(dts)}, {in_loop} inside the loop.")
  for r in results["fusion"]:
    fused = r["cublas_gemms_accumulating_beta1"]
    out.append(f"{r['model']} ({r['flags']}): {fused} weight-gradient GEMMs add into the "
               f"accumulator in place; {r['separate_f32_add_fusions']} separate float32 add "
               "fusions in the loop.")
  return out


def plot(results: dict[str, Any], path: pathlib.Path) -> pathlib.Path | None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no PNG")
    return None
  mem = results["memory"]
  names = list(results["models"])
  fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
  for ax, name in zip(axes[0], names, strict=True):
    for target in sorted({r["target"] for r in mem}):
      style = "-" if target == "h100" else "--"
      for method, color in (("jaxaccum", "C0"), ("optax.microbatch", "C1")):
        rows = sorted((r for r in mem if r["model"] == name and r["target"] == target
                       and r["method"] == method), key=lambda r: r["n"])
        ax.plot([r["n"] for r in rows], [r["peak"] / GIB for r in rows], style, color=color,
                marker="o", label=f"{method} ({target})")
      full = next(r for r in mem if r["model"] == name and r["target"] == target
                  and r["method"] == "full")
      ax.axhline(full["peak"] / GIB, color="gray", ls=style, lw=0.8,
                 label=f"full batch ({target})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches N")
    ax.set_ylabel("per-device peak (GiB), compiled")
    ax.set_title(f"{name}: compiled for described GPUs (not run)")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK")
                      == "1", help="N in {1, 4, 16} only (also BENCH_QUICK=1)")
  parser.add_argument("--out-dir", type=pathlib.Path, help=f"default: {RESULTS}")
  _common.add_tiny(parser)
  args = parser.parse_args(argv)
  args.out_dir = _common.out_dir_for(args.tiny, args.out_dir, RESULTS)
  ns = (2,) if args.tiny else QUICK_NS if args.quick else ALL_NS
  targets = ("h100",) if args.tiny else ("h100", "h200")
  device_counts = (8,) if args.tiny else (1, 8, 16)
  start = time.perf_counter()
  results: dict[str, Any] = {
      "note": NOTE,
      "environment": {"jax": jax.__version__, "host_cpus": os.cpu_count(),
                      "host": platform.platform(), "date": datetime.date.today().isoformat(),
                      "command": "JAX_PLATFORMS=cpu .venv-gpu/bin/python "
                                 f"benchmarks/bench_gpu_target.py{' --quick' * args.quick}",
                      "quick": args.quick},
      "models": {}, "memory": [], "collectives": [], "fusion": []}
  for name, (make, cfg) in problems(args.quick, args.tiny).items():
    _, params, _ = make(cfg)
    results["models"][name] = {"params": num_params(params), "config": dataclasses.asdict(cfg)}
    print(f"{name}: {num_params(params):,} parameters", flush=True)
    results["memory"] += run_memory(name, make, cfg, ns, targets)
    results["collectives"] += run_collectives(name, make, cfg, device_counts)
    results["fusion"] += run_fusion(name, make, cfg)
  results["findings"] = findings(results)
  results["environment"]["seconds"] = time.perf_counter() - start
  args.out_dir.mkdir(parents=True, exist_ok=True)
  suffix = "_quick" if args.quick else ""
  (args.out_dir / f"gpu_target{suffix}.json").write_text(json.dumps(results, indent=1))
  (args.out_dir / f"gpu_target{suffix}.md").write_text(markdown(results))
  plot(results, args.out_dir / f"gpu_target{suffix}_memory.png")
  print(markdown(results))
  print(f"done in {results['environment']['seconds']:.0f} s; results in {args.out_dir}")


if __name__ == "__main__":
  main()
