"""Accumulation on a device mesh: collectives per step and step time against N.

One training-step gradient of an MLP classifier over a global batch sharded on a mesh of
8 devices (8 virtual CPU devices unless the machine has 8 accelerators), computed by:

* ``jaxaccum``: :func:`jaxaccum.value_and_grad` under :func:`jax.jit`, no extra option:
  XLA reduces the gradients where it likes (on CPU: inside the loop, every micro-batch);
* ``jaxaccum data_axis``: the same with ``data_axis=...``: local accumulation, one
  reduction per step after the loop;
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
           ("jaxaccum", "Explicit"), ("jaxaccum data_axis", "Explicit"))
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
         "collective-permute": "CP"}


# --- Collectives executed per step, from the compiled program -----------------------------


def collectives_per_step(compiled, default_trip: int) -> dict[str, tuple[int, float]]:
  """``{kind: (executions per step, MiB of results per step)}`` for a compiled program,
  read with ``jaxaccum.collectives`` (a loop whose trip count the text does not give counts
  ``default_trip`` times)."""
  counts: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
  for op in jaxaccum.collectives(compiled):
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
  if method == "jaxaccum data_axis":
    return jax.jit(jaxaccum.value_and_grad(
        loss_fn, num_micro_batches=n, data_axis=data_axis, mesh=mesh))
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
  for kind in ("dp", "dp_fsdp"):
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
        stats[key] = {"collectives": colls, "compile_s": cstats["compile_s"], "rel_error": err}
        runners[key] = (lambda c=compiled, p=params, b=batch: _common.block(c(p, b)))
    times = _common.time_interleaved(runners, repeats=args.repeats, warmup=args.warmup)
    for (method, axis_type, n), ts in times.items():
      s = stats[(method, axis_type, n)]
      rows.append({"mesh": kind, "method": method, "axes": axis_type, "N": n,
                   "step_ms": 1e3 * _common.median(ts),
                   "collectives": {k: v[0] for k, v in s["collectives"].items()},
                   "collective_mib": sum(v[1] for v in s["collectives"].values()),
                   "compile_s": s["compile_s"], "rel_error": s["rel_error"]})
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
      "A2A all-to-all, CP collective-permute; MiB = sum of their result sizes. "
      "`rel err` = max |grad - full-batch grad| / max |full-batch grad|.",
      "",
  ]
  for kind, title in (("dp", "Data parallel: 8 x data, parameters replicated"),
                      ("dp_fsdp", "DP x FSDP: 4 x data by 2 x fsdp, parameters sharded "
                                  "over fsdp")):
    rows = [r for r in result["rows"] if r["mesh"] == kind]
    base = {r["N"]: r["step_ms"] for r in rows
            if r["method"] == "jaxaccum" and r["axes"] == "Auto"}
    lines += [f"## {title}", "",
              "| N | method | axes | collectives / step | MiB / step | step ms | vs row 1 "
              "| rel err |",
              "|---:|---|---|---|---:|---:|---:|---:|"]
    for n in cfg["ns"]:
      for method, axis_type in METHODS:
        r = next(r for r in rows
                 if r["N"] == n and r["method"] == method and r["axes"] == axis_type)
        colls = ", ".join(f"{SHORT[k]} {r['collectives'][k]}" for k in KINDS
                          if r["collectives"].get(k)) or "none"
        lines.append(f"| {n} | {method} | {axis_type} | {colls} | {r['collective_mib']:.2f} | "
                     f"{r['step_ms']:.2f} | {r['step_ms'] / base[n]:.2f}x | "
                     f"{r['rel_error']:.1e} |")
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
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
  args = parser.parse_args(argv)
  args.ns = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16]
  if args.quick:
    args.repeats = min(args.repeats, 10)
  result = run(args)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "sharding.json").write_text(json.dumps(result, indent=1))
  table = markdown(result)
  (args.out / "sharding.md").write_text(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
