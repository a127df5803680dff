"""GPipe and circular pipelines (:func:`jaxaccum.contrib.pipeline`): step time and temp memory vs M.

A model of 16 residual-MLP blocks runs on 8 stages (one per device along ``stage``; 8
virtual CPU devices unless the machine has 8 accelerators) and trains on a fixed global
batch, split into ``M`` pipeline micro-batches, two ways:

* ``gpipe``: each stage holds 2 consecutive blocks (``num_repeats=1``), ``remat`` on and off;
* ``circular R=2``: each device holds blocks ``s`` and ``8 + s`` and every micro-batch goes
  round the stages twice (``num_repeats=2``), ``remat`` on.

For each configuration the gradient step (``jax.jit(jax.value_and_grad(loss))`` with the
head and the loss outside the pipeline) is compiled; the table gives its temp memory
(``memory_analysis()``), the collectives in the compiled program, the bubble fraction
read from :func:`jaxaccum.contrib.pipeline_schedule` and the median step time (all
configurations timed round-robin in this one process). Each result is checked against
the unpipelined model (the 16 blocks one after the other, on one device).

On virtual CPU devices the 8 "devices" share the host's cores, so a bubble tick costs as
much as a busy one (bubbles compute on a real micro-batch and discard it): step time
there tracks the total work (ticks x stages x rows per micro-batch), not the pipelined
wall time of a real machine.

The last section compiles the GPipe step for 8 H100s through ``jaxaccum.planning.target_mesh`` when
this jaxaccum provides it, and otherwise records "not measured yet".

Output: ``benchmarks/results/pipeline.{md,json,png}``.
Run: ``python benchmarks/bench_pipeline.py`` (``--quick`` or ``BENCH_QUICK=1``: M in {2, 8, 32}).
"""

from __future__ import annotations

import os

# 8 virtual CPU devices; must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
STAGES, BLOCKS, BATCH, WIDTH, HIDDEN, CLASSES = 8, 16, 256, 128, 512, 10
KINDS = ("collective-permute", "all-reduce", "all-gather", "all-to-all", "reduce-scatter")
# name -> (num_repeats, remat)
METHODS = {"gpipe remat": (1, True), "gpipe": (1, False), "circular R=2 remat": (2, True)}


def block(w: dict, x: jax.Array) -> jax.Array:
  """A residual MLP block (hidden width 4x the boundary)."""
  return x + jnp.tanh(x @ w["up"]) @ w["down"]


def gpipe_stage(w: dict, x: jax.Array) -> jax.Array:
  """One GPipe stage: its ``BLOCKS // STAGES`` consecutive blocks (unrolled: they are few)."""
  for j in range(BLOCKS // STAGES):
    x = block(jax.tree.map(lambda a, j=j: a[j], w), x)
  return x


def layout(blocks: dict, repeats: int) -> dict:
  """``(BLOCKS, ...)`` -> ``(S, BLOCKS // S, ...)`` for GPipe, ``(R, S, ...)`` for circular."""
  if repeats == 1:
    return jax.tree.map(lambda a: a.reshape(STAGES, BLOCKS // STAGES, *a.shape[1:]), blocks)
  return jax.tree.map(lambda a: a.reshape(repeats, STAGES, *a.shape[1:]), blocks)


def problem(seed: int = 0):
  rng = np.random.default_rng(seed)
  params = {
      "blocks": {"up": rng.normal(size=(BLOCKS, WIDTH, HIDDEN)) / np.sqrt(WIDTH),
                 "down": rng.normal(size=(BLOCKS, HIDDEN, WIDTH)) / np.sqrt(HIDDEN) / 4},
      "head": rng.normal(size=(WIDTH, CLASSES)) / np.sqrt(WIDTH),
  }
  params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
  batch = {"x": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
           "label": rng.integers(0, CLASSES, size=BATCH).astype(np.int32)}
  return params, batch


def make_loss(body):
  def loss(params, batch):
    logits = body(params["blocks"], batch["x"]) @ params["head"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["label"][:, None], axis=1))
  return loss


def sequential(blocks, x):
  for k in range(BLOCKS):
    x = block(jax.tree.map(lambda a, k=k: a[k], blocks), x)
  return x


def bubble(m: int, repeats: int) -> float:
  table = jaxaccum.contrib.pipeline_schedule(STAGES, m, num_repeats=repeats)
  return 1 - sum(e is not None for row in table for e in row) / (STAGES * len(table))


def count_collectives(compiled) -> dict[str, int]:
  """How many collective ops of each kind the compiled program contains (not executions),
  read with ``jaxaccum.planning.collectives``."""
  found = jaxaccum.planning.collectives(compiled)
  return {k: found.count(k) for k in KINDS if found.count(k)}


def rel_error(got, ref) -> float:
  return max(float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / np.max(np.abs(np.asarray(r))))
             for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True))


def target_section(ms: tuple[int, ...]) -> dict[str, Any]:
  """The compiled GPipe program for 8 H100s, through ``jaxaccum.planning.target_mesh`` if it
  exists."""
  if not hasattr(jaxaccum.planning, "target_mesh"):
    return {"status": "not measured yet",
            "reason": "this jaxaccum has no target_mesh (compiling for described GPUs)"}
  try:
    mesh = jaxaccum.planning.target_mesh("h100", (STAGES,), ("stage",))
    params, batch = problem()
    rows = []
    for m in ms:
      pipe = jaxaccum.contrib.pipeline(gpipe_stage, num_micro_batches=m, mesh=mesh)
      step = jax.jit(jax.value_and_grad(make_loss(lambda b, x, pipe=pipe: pipe(layout(b, 1), x))))

      def spec(a, p):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p))

      specs = ({"blocks": jax.tree.map(lambda a: spec(a, P("stage")), params["blocks"]),
                "head": spec(params["head"], P())},
               jax.tree.map(lambda a: spec(a, P()), batch))
      compiled = step.lower(*specs).compile()
      mem = compiled.memory_analysis()
      rows.append({"m": m, "collectives": count_collectives(compiled),
                   "temp": float(mem.temp_size_in_bytes)})
    return {"status": "measured", "rows": rows}
  except (ImportError, RuntimeError) as e:  # the gpu-plan extra is not installed here
    return {"status": "not measured yet", "reason": f"{type(e).__name__}: {e}"}


def run(quick: bool, ms: tuple[int, ...] | None = None, repeats: int | None = None,
        warmup: int = 2) -> dict[str, Any]:
  ms = ms or ((2, 8, 32) if quick else (1, 2, 4, 8, 16, 32, 64))
  repeats = repeats or (5 if quick else 20)
  mesh = jax.make_mesh((STAGES,), ("stage",))
  params, batch = problem()
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(make_loss(sequential)))(params, batch)
  batch_on_mesh = jax.device_put(batch, NamedSharding(mesh, P()))
  head = jax.device_put(params["head"], NamedSharding(mesh, P()))
  rows, runners = [], {}
  for m in ms:
    for name, (r, remat) in METHODS.items():
      spec = P("stage") if r == 1 else P(None, "stage")
      placed = ({"blocks": jax.device_put(layout(params["blocks"], r), NamedSharding(mesh, spec)),
                 "head": head}, batch_on_mesh)
      pipe = jaxaccum.contrib.pipeline(gpipe_stage if r == 1 else block, num_micro_batches=m,
                               mesh=mesh, remat=remat, num_repeats=r)
      compiled, stats = _common.compile_with_stats(
          _common.fresh_jit(jax.value_and_grad(make_loss(pipe))), *placed)
      loss, grads = compiled(*placed)
      grads = {"blocks": jax.tree.map(lambda a: np.asarray(a).reshape(BLOCKS, *a.shape[2:]),
                                      grads["blocks"]), "head": grads["head"]}
      key = f"M={m} {name}"
      runners[key] = lambda c=compiled, a=placed: _common.block(c(*a))
      ticks = len(jaxaccum.contrib.pipeline_schedule(STAGES, m, num_repeats=r))
      rows.append({
          "m": m, "method": name, "repeats": r, "remat": remat, "ticks": ticks,
          "bubble": bubble(m, r), "micro_batch": BATCH // m, "temp": stats["temp"],
          "compile_s": stats["compile_s"], "collectives": count_collectives(compiled),
          "rel_err": max(rel_error(grads, ref_grads), rel_error(loss, ref_loss)),
          # Stage-boundary activations of one micro-batch, f32: the stash unit.
          "boundary_bytes": BATCH // m * WIDTH * 4,
          "key": key})
  times = _common.time_interleaved(runners, repeats=repeats, warmup=warmup)
  for row in rows:
    row["step_s"] = _common.median(times[row.pop("key")])
  return {"environment": _common.device_info(), "quick": quick, "repeats": repeats,
          "model": {"stages": STAGES, "blocks": BLOCKS, "batch": BATCH, "width": WIDTH,
                    "hidden": HIDDEN, "classes": CLASSES},
          "rows": rows, "target": target_section(ms)}


def markdown(result: dict) -> str:
  env, mdl = result["environment"], result["model"]
  lines = [
      "# Pipelines (GPipe, circular): step time and temp memory vs M", "",
      f"{env['num_devices']} x {env['device_kind']} ({env['platform']}), {env['host_cpus']} "
      f"host CPUs, jax {env['jax']}, {env['date']}. {mdl['blocks']} residual MLP blocks "
      f"{mdl['width']}-{mdl['hidden']}-{mdl['width']} on {mdl['stages']} stages (one per "
      f"device), global batch {mdl['batch']}, float32; medians of {result['repeats']} "
      "interleaved steps. `gpipe`: 2 blocks per stage; `circular R=2`: blocks s and 8+s on "
      "device s, two rounds. `bubble` = idle share of the schedule's slots "
      "(jaxaccum.contrib.pipeline_schedule). `stash MiB` = ticks x one micro-batch of "
      "stage-boundary activations (batch/M x width x 4 bytes), the memory formula's main "
      "term. Collectives are ops in the compiled program (CP collective-permute, AR "
      "all-reduce), not executions. `rel err` = max |grad - unpipelined grad| / max "
      "|unpipelined grad|.", "",
      "| M | method | ticks | bubble | micro-batch | stash MiB | temp MiB | step ms | "
      "collectives | rel err |",
      "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
  short = {"collective-permute": "CP", "all-reduce": "AR"}
  for r in result["rows"]:
    colls = ", ".join(f"{short.get(k, k)} {v}" for k, v in r["collectives"].items())
    lines.append(
        f"| {r['m']} | {r['method']} | {r['ticks']} | {r['bubble']:.2f} | "
        f"{r['micro_batch']} | {r['ticks'] * r['boundary_bytes'] / _common.MIB:.2f} | "
        f"{r['temp'] / _common.MIB:.2f} | {r['step_s'] * 1e3:.1f} | {colls} | "
        f"{r['rel_err']:.1e} |")
  by = {(r["m"], r["method"]): r for r in result["rows"]}
  ms = sorted({r["m"] for r in result["rows"]})
  lines += ["", "GPipe temp memory with remat relative to without: " + "; ".join(
      f"M={m}: {by[m, 'gpipe remat']['temp'] / by[m, 'gpipe']['temp']:.2f}x" for m in ms) + "."]
  target = result["target"]
  lines += ["", "## 8 x H100 (compiled from this host)", ""]
  if target["status"] != "measured":
    lines.append(f"not measured yet ({target['reason']}).")
  else:
    lines += ["| M | temp MiB | collectives |", "|---:|---:|---|"]
    lines += [f"| {r['m']} | {r['temp'] / _common.MIB:.2f} | {r['collectives']} |"
              for r in target["rows"]]
  return "\n".join(lines) + "\n"


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
  for name, style in zip(METHODS, ("-o", "--s", ":^"), strict=True):
    rows = [r for r in result["rows"] if r["method"] == name]
    ms = [r["m"] for r in rows]
    ax_t.plot(ms, [r["step_s"] * 1e3 for r in rows], style, label=name)
    ax_m.plot(ms, [r["temp"] / _common.MIB for r in rows], style, label=name)
  for ax, label in ((ax_t, "step time (ms)"), (ax_m, "temp memory (MiB)")):
    ax.set(xlabel="pipeline micro-batches M", ylabel=label)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
  env = result["environment"]
  fig.suptitle(f"jaxaccum.contrib.pipeline, {BLOCKS} blocks on {STAGES} stages, "
               f"global batch {BATCH}, "
               f"{env['num_devices']} x {env['device_kind']}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                      help="M in {2, 8, 32}, fewer repeats (also BENCH_QUICK=1)")
  parser.add_argument("--out-dir", type=pathlib.Path, help=f"default: {RESULTS}")
  parser.add_argument("--target-only", action="store_true",
                      help="only compile for 8 described H100s (needs the gpu-plan extra and "
                      "JAX_PLATFORMS=cpu); writes pipeline_target.{json,md}")
  _common.add_tiny(parser)
  args = parser.parse_args(argv)
  args.out_dir = _common.out_dir_for(args.tiny, args.out_dir, RESULTS)
  ms = (2,) if args.tiny else (2, 8, 32) if args.quick else None
  if args.tiny:  # the smallest blocks (still 16 on 8 stages), one timed step
    global BATCH, WIDTH, HIDDEN
    BATCH, WIDTH, HIDDEN = 16, 8, 16
  if args.target_only:
    ms = ms or (1, 2, 4, 8, 16, 32, 64)
    target = {"environment": _common.device_info(), "target": target_section(ms)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "pipeline_target.json").write_text(json.dumps(target, indent=1))
    lines = ["# jaxaccum.contrib.pipeline compiled for 8 H100s (described, from a CPU host)", "",
             "Compiled-program figures, not timings: no GPU ran this program, and autotuning "
             "on a real device may choose other kernels.", ""]
    t = target["target"]
    if t["status"] != "measured":
      lines.append(f"not measured yet ({t['reason']}).")
    else:
      lines += ["| M | temp MiB per device | collectives |", "|---:|---:|---|"]
      lines += [f"| {r['m']} | {r['temp'] / _common.MIB:.2f} | {r['collectives']} |"
                for r in t["rows"]]
    text = "\n".join(lines) + "\n"
    (args.out_dir / "pipeline_target.md").write_text(text)
    print(text)
    print(f"results in {args.out_dir}")
    return
  result = run(args.quick, ms, repeats=1 if args.tiny else None,
               warmup=1 if args.tiny else 2)
  args.out_dir.mkdir(parents=True, exist_ok=True)
  (args.out_dir / "pipeline.json").write_text(json.dumps(result, indent=1))
  text = markdown(result)
  (args.out_dir / "pipeline.md").write_text(text)
  plot(result, args.out_dir / "pipeline.png")
  print(text)
  print(f"results in {args.out_dir}")


if __name__ == "__main__":
  main()
