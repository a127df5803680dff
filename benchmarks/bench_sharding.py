"""Accumulation on a device mesh: collectives per step and step time against N.

One training-step gradient of an MLP classifier over a global batch sharded on a mesh of
8 devices (8 virtual CPU devices unless the machine has 8 accelerators), computed by:

* ``jaxaccum``: :func:`jaxaccum.value_and_grad` under :func:`jax.jit`, no extra option:
  XLA reduces the gradients where it likes (on CPU: inside the loop, every micro-batch);
* ``jaxaccum data_axis``: the same with ``data_axis=...``: local accumulation, one
  reduction per step after the loop;
* ``jaxaccum data_axis overlap``: the same with ``overlap_grad_reduce=True`` (the last
  micro-batch after the loop, so its reductions may overlap its backward pass);
* ``optax.microbatch``: ``optax.microbatch(jax.value_and_grad(loss), ...)`` with a MEAN
  accumulator, under :func:`jax.jit` (a ``fori_loop`` over a contiguous split);

on a data-parallel mesh (``dp``: 8 x ``data``, parameters replicated) and a DP x FSDP
mesh (``dp_fsdp``: 4 x ``data`` by 2 x ``fsdp``, parameters sharded over ``fsdp``; the
``data_axis`` variant names both axes).

For each ``N`` every method is compiled; its collectives are read from the compiled HLO
text and multiplied by the trip count of the loops they sit in (``known_trip_count``), so
"per step" counts what one step executes. Then all methods of a mesh are warmed up and
timed round-robin in this one process (medians). Each result is checked against the
full-batch gradient. Output: ``benchmarks/results/sharding.{md,json}``.

A second section (``--section placement``) compiles the four FSDP placements
(``param_gather`` x ``grad_scatter``) of an MLP and of a scan-over-layers LM with parameters
sharded over the 8-device data axis: compiled memory, where the all-gathers and
reduce-scatters sit and their bytes per step, and (on this machine's devices) step time as a
ratio; then the same programs compiled for 8 described H100s (``--gpu-target``; needs the
``gpu-plan`` extra and ``JAX_PLATFORMS=cpu``). Output: ``benchmarks/results/
sharding_placement.{md,json}``.

Run: ``python benchmarks/bench_sharding.py`` (``--quick`` for N in {1, 4, 16}).
"""

from __future__ import annotations

import os

# 8 virtual CPU devices; must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# (name, mesh axis type): optax.microbatch's order="F" reshape is rejected on Explicit
# axes (jax 0.10.2 asks for an out_sharding), so the comparison runs on Auto axes; the
# last rows show jaxaccum on Explicit axes (jax.make_mesh's default), where the types
# carry the FSDP parameters' sharding into the step.
METHODS = (("jaxaccum", "Auto"), ("jaxaccum data_axis", "Auto"), ("optax.microbatch", "Auto"),
           ("jaxaccum", "Explicit"), ("jaxaccum data_axis", "Explicit"),
           ("jaxaccum data_axis overlap", "Explicit"))
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
         "collective-permute": "CP"}


# --- Collectives executed per step, from the compiled program -----------------------------


def collectives_per_step(compiled, default_trip: int) -> dict[str, tuple[int, float]]:
  """``{kind: (executions per step, MiB of results per step)}`` for a compiled program,
  read with ``jaxaccum.planning.collectives`` (a loop whose trip count the text does not give counts
  ``default_trip`` times)."""
  counts: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
  for op in jaxaccum.planning.collectives(compiled):
    times = op.executions if op.executions is not None else default_trip ** op.loop_depth
    counts[op.kind][0] += times
    counts[op.kind][1] += times * op.bytes / 2**20
  return {k: (int(v[0]), v[1]) for k, v in counts.items()}


# --- The problem --------------------------------------------------------------------------


def problem(batch: int, features: int, hidden: int, classes: int):
  rng = np.random.default_rng(0)
  params = {
      "w1": jnp.asarray(rng.normal(size=(features, hidden)) / np.sqrt(features), jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(hidden, hidden)) / np.sqrt(hidden), jnp.float32),
      "w3": jnp.asarray(rng.normal(size=(hidden, classes)) / np.sqrt(hidden), jnp.float32),
  }
  data = {
      "x": jnp.asarray(rng.normal(size=(batch, features)), jnp.float32),
      "label": jnp.asarray(rng.integers(0, classes, size=batch), jnp.int32),
  }
  return params, data


def loss_fn(params, batch):
  h = jax.nn.relu(batch["x"] @ params["w1"])
  h = jax.nn.relu(h @ params["w2"])
  logp = jax.nn.log_softmax(h @ params["w3"])
  return -jnp.mean(jnp.take_along_axis(logp, batch["label"][:, None], axis=1))


def layout(kind: str, axis_type: str):
  axis_type = getattr(jax.sharding.AxisType, axis_type)
  if kind == "dp":
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    return mesh, P("data"), P(), "data"
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  return mesh, P(("data", "fsdp")), P("fsdp", None), ("data", "fsdp")


def make_step(method: str, n: int, batch: int, mesh, data_axis):
  if method == "jaxaccum":
    return jax.jit(jaxaccum.value_and_grad(loss_fn, num_micro_batches=n))
  if method.startswith("jaxaccum data_axis"):
    return jax.jit(jaxaccum.value_and_grad(
        loss_fn, num_micro_batches=n, data_axis=jaxaccum.DataParallel(data_axis, mesh=mesh,
            overlap_grad_reduce=method.endswith("overlap"))))
  return jax.jit(optax.microbatch(
      jax.value_and_grad(loss_fn), argnums=1, microbatch_size=batch // n,
      accumulator=optax.microbatching.AccumulationType.MEAN))


def rel_error(got, ref) -> float:
  return max(float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
             for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True))


def run(args) -> dict:
  assert jax.device_count() >= 8, f"needs 8 devices, found {jax.device_count()}"
  params0, batch0 = problem(args.batch, args.features, args.hidden, args.classes)
  ref = jax.jit(jax.value_and_grad(loss_fn))(params0, batch0)
  rows = []
  for kind in ("dp",) if args.tiny else ("dp", "dp_fsdp"):  # tiny: one mesh
    runners, stats = {}, {}
    for method, axis_type in METHODS:
      mesh, batch_spec, param_spec, data_axis = layout(kind, axis_type)
      params = jax.device_put(params0, NamedSharding(mesh, param_spec))
      batch = jax.device_put(batch0, NamedSharding(mesh, batch_spec))
      for n in args.ns:
        step = make_step(method, n, args.batch, mesh, data_axis)
        compiled, cstats = _common.compile_with_stats(lambda s=step: s, params, batch)
        colls = collectives_per_step(compiled, n)
        err = rel_error(compiled(params, batch), ref)
        key = (method, axis_type, n)
        stats[key] = {"collectives": colls, "compile_s": cstats["compile_s"], "rel_error": err,
                      "temp_mib": cstats["temp"] / 2**20}
        runners[key] = (lambda c=compiled, p=params, b=batch: _common.block(c(p, b)))
    times = _common.time_interleaved(runners, repeats=args.repeats, warmup=args.warmup)
    for (method, axis_type, n), ts in times.items():
      s = stats[(method, axis_type, n)]
      rows.append({"mesh": kind, "method": method, "axes": axis_type, "N": n,
                   "step_ms": 1e3 * _common.median(ts),
                   "collectives": {k: v[0] for k, v in s["collectives"].items()},
                   "collective_mib": sum(v[1] for v in s["collectives"].values()),
                   "compile_s": s["compile_s"], "rel_error": s["rel_error"],
                   "temp_mib": s["temp_mib"]})
    print(f"{kind}: done", flush=True)
  return {"device": _common.device_info(), "config": {**vars(args), "out": str(args.out)},
          "rows": rows}


def markdown(result: dict) -> str:
  cfg, dev = result["config"], result["device"]
  lines = [
      "# Accumulation on a mesh: collectives per step and step time vs N",
      "",
      f"{dev['num_devices']} x {dev['device_kind']} ({dev['platform']}), {dev['host_cpus']} "
      f"host CPUs, jax {dev['jax']}, {dev['date']}. MLP {cfg['features']}-{cfg['hidden']}-"
      f"{cfg['hidden']}-{cfg['classes']}, global batch {cfg['batch']}, float32; medians "
      f"of {cfg['repeats']} interleaved steps. Collectives are per step (ops in a loop "
      "counted once per iteration): AR all-reduce, RS reduce-scatter, AG all-gather, "
      "A2A all-to-all, CP collective-permute; MiB = sum of their result sizes; temp = "
      "compiled temporary memory per device (`memory_analysis()`). "
      "`rel err` = max |grad - full-batch grad| / max |full-batch grad|.",
      "",
  ]
  for kind, title in (("dp", "Data parallel: 8 x data, parameters replicated"),
                      ("dp_fsdp", "DP x FSDP: 4 x data by 2 x fsdp, parameters sharded "
                                  "over fsdp")):
    rows = [r for r in result["rows"] if r["mesh"] == kind]
    if not rows:
      continue
    base = {r["N"]: r["step_ms"] for r in rows
            if r["method"] == "jaxaccum" and r["axes"] == "Auto"}
    lines += [f"## {title}", "",
              "| N | method | axes | collectives / step | MiB / step | temp MiB | step ms "
              "| vs row 1 | rel err |",
              "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for n in cfg["ns"]:
      for method, axis_type in METHODS:
        r = next(r for r in rows
                 if r["N"] == n and r["method"] == method and r["axes"] == axis_type)
        colls = ", ".join(f"{SHORT[k]} {r['collectives'][k]}" for k in KINDS
                          if r["collectives"].get(k)) or "none"
        temp = f"{r['temp_mib']:.2f}" if "temp_mib" in r else "-"
        lines.append(f"| {n} | {method} | {axis_type} | {colls} | {r['collective_mib']:.2f} | "
                     f"{temp} | {r['step_ms']:.2f} | {r['step_ms'] / base[n]:.2f}x | "
                     f"{r['rel_error']:.1e} |")
    lines.append("")
  return "\n".join(lines)


# --- FSDP placement: param_gather x grad_scatter ------------------------------------------

PLACEMENTS = (("step", "micro_batch"), ("micro_batch", "micro_batch"), ("step", "step"),
              ("micro_batch", "step"))


def mlp_fsdp(batch: int, width: int, depth: int):
  """An MLP of ``depth`` square ``width`` layers (tanh), a squared-error loss."""
  rng = np.random.default_rng(1)
  params = {f"w{i}": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32)
            for i in range(depth)}
  data = {"x": jnp.asarray(rng.normal(size=(batch, width)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)}
  return params, data, {k: P("data") for k in params}, mlp_fsdp_loss


def mlp_fsdp_loss(params, batch):
  h = batch["x"]
  for i in range(len(params)):
    h = jnp.tanh(h @ params[f"w{i}"])
  return jnp.mean((h - batch["y"]) ** 2)


def scan_lm(batch: int, width: int, depth: int, vocab: int = 512, seq: int = 32):
  """A causal-free residual LM whose ``depth`` layers run in one ``lax.scan`` (stacked
  parameters, the shape of MaxText's and NNX's scanned transformers), next-token loss."""
  rng = np.random.default_rng(2)
  params = {
      "embed": jnp.asarray(rng.normal(size=(vocab, width)) * 0.3, jnp.float32),
      "w_in": jnp.asarray(rng.normal(size=(depth, width, 4 * width)) / np.sqrt(width),
                          jnp.float32),
      "w_out": jnp.asarray(rng.normal(size=(depth, 4 * width, width)) / np.sqrt(4 * width),
                           jnp.float32),
      "head": jnp.asarray(rng.normal(size=(width, vocab)) / np.sqrt(width), jnp.float32),
  }
  data = {"tokens": jnp.asarray(rng.integers(0, vocab, size=(batch, seq)), jnp.int32)}
  specs = {"embed": P("data"), "w_in": P(None, "data"), "w_out": P(None, "data"),
           "head": P(None, "data")}
  return params, data, specs, scan_lm_loss


def scan_lm_loss(params, batch):
  tokens = batch["tokens"]
  h = params["embed"][tokens]

  def layer(h, w):
    w_in, w_out = w
    return h + jax.nn.gelu(h @ w_in) @ w_out, None

  h, _ = jax.lax.scan(layer, h, (params["w_in"], params["w_out"]))
  logp = jax.nn.log_softmax(h[:, :-1] @ params["head"])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def placement_stats(compiled) -> dict:
  """Memory and collectives of one compiled program (per device)."""
  mem = compiled.memory_analysis()
  colls = jaxaccum.planning.collectives(compiled)

  def per_step(kind):
    ops = colls.select(kind)
    return sum(c.bytes * (c.executions or 1) for c in ops) / _common.MIB

  return {
      "temp_mib": mem.temp_size_in_bytes / _common.MIB,
      "argument_mib": mem.argument_size_in_bytes / _common.MIB,
      "peak_mib": float(getattr(mem, "peak_memory_in_bytes", 0) or 0) / _common.MIB,
      "ag_in_loop": colls.count("all-gather", in_loop=True),
      "ag_out_loop": colls.count("all-gather", in_loop=False),
      "rs_in_loop": colls.count("reduce-scatter", in_loop=True),
      "rs_out_loop": colls.count("reduce-scatter", in_loop=False),
      "ar": colls.count("all-reduce"),
      "ag_mib": per_step("all-gather"),
      "rs_mib": per_step("reduce-scatter"),
  }


def run_placement(args, target: str | None = None) -> list[dict]:
  """The four FSDP placements on an MLP and a scan-over-layers LM, parameters sharded over
  the 8-device data axis (Explicit axes). On this machine's devices: compiled, checked
  against the full batch and timed interleaved; on described GPUs (``target``): compiled
  only."""
  n = args.placement_n
  if target is None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    sizes = {"MLP": (mlp_fsdp, 256, 512, 4), "scan LM": (scan_lm, 64, 256, 4)}
    if args.tiny:  # the MLP only: the scanned LM runs the same code
      sizes = {"MLP": (mlp_fsdp, 32, 16, 2)}
  else:
    base = jaxaccum.planning.target_mesh(target, (8,), ("data",))
    mesh = jax.sharding.Mesh(base.devices, base.axis_names,
                             axis_types=(jax.sharding.AxisType.Explicit,))
    sizes = {"MLP": (mlp_fsdp, 1024, 4096, 8), "scan LM": (scan_lm, 256, 1024, 8)}
  rows = []
  for model, (build, batch_size, width, depth) in sizes.items():
    params0, batch0, specs, loss = build(batch_size, width, depth)
    if target is None:
      place = jax.device_put
      ref = jax.jit(jax.value_and_grad(loss))(params0, batch0)
    else:
      place, ref = _shapes_on, None
    params = place(params0, {k: NamedSharding(mesh, specs[k]) for k in params0})
    batch = place(batch0, jax.tree.map(lambda _: NamedSharding(mesh, P("data")), batch0))
    runners, stats = {}, {}
    for gather, scatter in PLACEMENTS:
      step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=n,
                     data_axis=jaxaccum.DataParallel("data", mesh=mesh, param_gather=gather,
                                                     grad_scatter=scatter)))
      compiled, cstats = _common.compile_with_stats(lambda s=step: s, params, batch)
      row = {"model": model, "target": target or jax.devices()[0].device_kind, "N": n,
             "param_gather": gather, "grad_scatter": scatter,
             "params_mib": sum(a.size * 4 for a in jax.tree.leaves(params0)) / _common.MIB,
             "compile_s": cstats["compile_s"], **placement_stats(compiled)}
      if ref is not None:
        row["rel_error"] = rel_error(compiled(params, batch), ref)
        runners[gather, scatter] = (lambda c=compiled, p=params, b=batch: _common.block(c(p, b)))
      stats[gather, scatter] = row
    if runners:
      times = _common.time_interleaved(runners, repeats=args.repeats, warmup=args.warmup)
      for key, ts in times.items():
        stats[key]["step_ms"] = 1e3 * _common.median(ts)
    rows += list(stats.values())
    print(f"placement, {model}{' on ' + target if target else ''}: done", flush=True)
  return rows


def _shapes_on(tree, shardings):
  """``tree`` as ShapeDtypeStructs with ``shardings``: compiled, never allocated."""
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                      tree, shardings)


def placement_markdown(result: dict) -> str:
  dev = result["device"]
  lines = [
      "# FSDP placement under data_axis: param_gather x grad_scatter",
      "",
      f"jax {dev['jax']}, {dev['date']}, {dev['host_cpus']} host CPUs. Parameters (float32) "
      "sharded over the 8-device `data` axis (Explicit axes), `data_axis=\"data\"`, "
      f"N = {result['config']['placement_n']}. Memory per device from `memory_analysis()`: "
      "temp (scratch: activations, accumulators, gathered parameters) and arguments; peak is "
      "XLA's `peak_memory_in_bytes` (GPU only). Collectives from `jaxaccum.planning.collectives`: "
      "all-gathers (AG) and reduce-scatters (RS) inside / outside the micro-batch loop, "
      "MiB per step = result bytes x executions. Step time: CPU only, medians of "
      f"{result['config']['repeats']} interleaved steps, as a ratio to the default row.",
      "",
  ]
  for target in dict.fromkeys(r["target"] for r in result["placement"]):
    for model in dict.fromkeys(r["model"] for r in result["placement"]):
      rows = [r for r in result["placement"] if r["target"] == target and r["model"] == model]
      if not rows:
        continue
      base = rows[0]
      timed = "step_ms" in base
      machine = (f"{dev['host_cpus']}-core CPU host, 8 virtual devices" if timed else
                 f"described 8 x {target.upper()}, deviceless compile")
      lines += [f"## {model}, {machine} ({base['params_mib']:.1f} MiB of parameters)", "",
                "| param_gather | grad_scatter | temp MiB | args MiB | temp + args | peak MiB "
                "| AG in / out loop | RS in / out loop | AG MiB / step | RS MiB / step |"
                + (" step vs default | rel err |" if timed else ""),
                "|---|---|---:|---:|---:|---:|---|---|---:|---:|"
                + ("---:|---:|" if timed else "")]
      for r in rows:
        # CPU's peak_memory_in_bytes leaves temporaries out (see jaxaccum.plan): not shown.
        peak = f"{r['peak_mib']:.1f}" if r["peak_mib"] and not timed else "-"
        line = (f"| {r['param_gather']} | {r['grad_scatter']} | {r['temp_mib']:.2f} | "
                f"{r['argument_mib']:.2f} | {r['temp_mib'] + r['argument_mib']:.2f} | {peak} | "
                f"{r['ag_in_loop']} / {r['ag_out_loop']} | {r['rs_in_loop']} / "
                f"{r['rs_out_loop']} | {r['ag_mib']:.2f} | {r['rs_mib']:.2f} |")
        if timed:
          line += f" {r['step_ms'] / base['step_ms']:.2f}x | {r['rel_error']:.1e} |"
        lines.append(line)
      lines.append("")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                      help="N in {1, 4, 16}, fewer repeats (also BENCH_QUICK=1)")
  parser.add_argument("--batch", type=int, default=512)
  parser.add_argument("--features", type=int, default=128)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--out", type=pathlib.Path, help=f"default: {RESULTS}")
  parser.add_argument("--section", choices=("all", "methods", "placement"), default="all",
                      help="methods: the mesh comparison; placement: the FSDP placements")
  parser.add_argument("--placement-n", type=int, default=4)
  parser.add_argument("--gpu-target", default="h100",
                      help="described GPU for the placement section ('' to skip); needs the "
                           "gpu-plan extra and JAX_PLATFORMS=cpu")
  _common.add_tiny(parser)
  args = parser.parse_args(argv)
  args.ns = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16]
  if args.quick:
    args.repeats = min(args.repeats, 10)
  if args.tiny:  # the smallest problems, on this machine's devices only
    args.ns, args.repeats, args.warmup, args.placement_n = [2], 1, 1, 2
    args.batch, args.features, args.hidden, args.classes = 32, 8, 16, 4
    args.gpu_target = ""
  args.out = _common.out_dir_for(args.tiny, args.out, RESULTS)
  args.out.mkdir(parents=True, exist_ok=True)
  if args.section in ("all", "methods"):
    result = run(args)
    (args.out / "sharding.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (args.out / "sharding.md").write_text(table + "\n")
    print(table)
  if args.section in ("all", "placement"):
    rows = run_placement(args)
    if args.gpu_target:
      try:
        rows += run_placement(args, args.gpu_target)
      except (ImportError, RuntimeError) as e:
        print(f"placement on {args.gpu_target!r} skipped: {e}", flush=True)
    result = {"device": _common.device_info(), "config": {**vars(args), "out": str(args.out)},
              "placement": rows}
    (args.out / "sharding_placement.json").write_text(json.dumps(result, indent=1))
    table = placement_markdown(result)
    (args.out / "sharding_placement.md").write_text(table + "\n")
    print(table)
  print(f"results in {args.out}")


if __name__ == "__main__":
  main()
