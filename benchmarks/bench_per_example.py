"""What ``per_example_transform`` costs against plain accumulation, at 3 micro-batch sizes.

One optimizer step (gradients, then SGD) of the MLP classifier of ``bench_accumulation.py``
over the same batch, at micro-batch sizes ``b`` in :data:`SIZES` (``N = B / b``), in two
variants each:

* ``plain``: ``jaxaccum.grad(loss, micro_batch_size=b)``: one backward pass per
  micro-batch;
* ``per-example``: the same with ``per_example_transform=jaxaccum.clip_per_example(1.0)``:
  the micro-batch's ``b`` rows are differentiated one by one under ``jax.vmap``, so the
  step holds ``b`` per-example gradients (``b`` times the parameters) and runs
  matrix-vector products where plain accumulation runs matrix-matrix ones.

Every variant is compiled first (its temporary memory read from ``memory_analysis()``),
warmed up, then timed round-robin in this one process; medians and the ratio
per-example / plain at each size are reported, never asserted. Results go to
``benchmarks/results/per_example.{json,md}``. ``BENCH_QUICK=1`` (or ``--quick``) runs a
smaller MLP with fewer repeats.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import optax

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import bench_accumulation  # noqa: E402  (the MLP problem)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SIZES = (8, 32, 128)  # rows per micro-batch: the vmap width under per_example_transform
VARIANTS = ("plain", "per-example")


def configs(quick: bool) -> bench_accumulation.MLPConfig:
  if quick:
    return bench_accumulation.MLPConfig(batch=256, d_in=128, hidden=256)
  return bench_accumulation.MLPConfig(batch=1024, d_in=256, hidden=512)


def build_step(loss_fn, size: int, variant: str, tx: optax.GradientTransformation):
  extra = ({"per_example_transform": jaxaccum.clip_per_example(1.0)}
           if variant == "per-example" else {})
  grad_fn = jaxaccum.value_and_grad(loss_fn, micro_batch_size=size, **extra)

  def step(params, batch):
    loss, grads = grad_fn(params, batch)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates), loss

  return step


def measure(cfg: bench_accumulation.MLPConfig, sizes: Sequence[int], *, repeats: int,
            warmup: int) -> dict[str, Any]:
  """Compiles, warms up and times every (size, variant), interleaved."""
  loss_fn, params, batch = bench_accumulation.mlp_problem(cfg)
  tx = optax.sgd(1e-3)
  names = [(b, v) for b in sizes for v in VARIANTS]
  compiled, stats, states, first_loss = {}, {}, {}, {}
  for b, v in names:
    states[b, v] = params
    compiled[b, v], stats[b, v] = _common.compile_with_stats(
        _common.fresh_jit(build_step(loss_fn, b, v, tx)), params, batch)
    _, loss = _common.block(compiled[b, v](params, batch))
    first_loss[b, v] = float(loss)

  def runner(key):
    def run():
      states[key], _ = _common.block(compiled[key](states[key], batch))
    return run

  label = {key: f"b={key[0]} {key[1]}" for key in names}
  times = _common.time_interleaved({label[k]: runner(k) for k in names}, repeats=repeats,
                                   warmup=warmup)
  rows = []
  for b, v in names:
    t = times[label[b, v]]
    rows.append({"micro_batch_size": b, "num_micro_batches": cfg.batch // b, "variant": v,
                 "step_s": _common.median(t), "min_s": min(t), "times_s": t,
                 "compile_s": stats[b, v]["compile_s"], "temp": stats[b, v]["temp"],
                 "first_loss": first_loss[b, v]})
  by = {(r["micro_batch_size"], r["variant"]): r for r in rows}
  ratios = [{"micro_batch_size": b,
             "time": by[b, "per-example"]["step_s"] / by[b, "plain"]["step_s"],
             "temp": by[b, "per-example"]["temp"] / max(by[b, "plain"]["temp"], 1.0)}
            for b in sizes]
  n_params = sum(x.size for x in jax.tree.leaves(params))
  return {"config": repr(cfg), "params": int(n_params), "rows": rows, "ratios": ratios}


def markdown(results: dict[str, Any]) -> str:
  env = results["environment"]
  m = results["mlp"]
  lines = [
      "# per_example_transform against plain accumulation", "",
      f"{env['date']}, device `{env['device_kind']}` ({env['platform']}), host CPUs "
      f"{env['host_cpus']}, jax {env['jax']}, {'quick run' if results['quick'] else 'full run'}: "
      f"{results['repeats']} timed repeats after {results['warmup']} warm-up, interleaved, "
      "medians.", "",
      f"MLP `{m['config']}` ({m['params']:,} parameters); one optimizer step (SGD); "
      "per-example: `clip_per_example(1.0)`.", "",
      "| rows per micro-batch b | N | variant | step (ms, median) | fastest (ms) | "
      "compile (s) | temp (MiB) |",
      "|---:|---:|:---|---:|---:|---:|---:|"]
  for r in m["rows"]:
    lines.append(f"| {r['micro_batch_size']} | {r['num_micro_batches']} | {r['variant']} | "
                 f"{1e3 * r['step_s']:.2f} | {1e3 * r['min_s']:.2f} | {r['compile_s']:.2f} | "
                 f"{r['temp'] / _common.MIB:.2f} |")
  lines += ["", "| b | time per-example / plain | temp per-example / plain |",
            "|---:|---:|---:|"]
  for r in m["ratios"]:
    lines.append(f"| {r['micro_batch_size']} | {r['time']:.2f} | {r['temp']:.2f} |")
  lines.append("")
  return "\n".join(lines)


def run(*, quick: bool, repeats: int | None = None, warmup: int | None = None,
        cfg: bench_accumulation.MLPConfig | None = None, sizes: Sequence[int] = SIZES,
        out_dir: pathlib.Path = RESULTS) -> dict[str, Any]:
  """Runs the benchmark and writes ``per_example.json`` and ``per_example.md``."""
  env = _common.device_info()
  repeats = repeats or (11 if quick else 41)
  warmup = warmup or (2 if quick else 5)
  cfg = cfg or configs(quick)
  results = {"environment": env, "quick": quick, "repeats": repeats, "warmup": warmup,
             "mlp": measure(cfg, sizes, repeats=repeats, warmup=warmup)}
  _common.write_results(out_dir, "per_example", results, markdown)
  return results


def main(argv: Sequence[str] | None = None) -> None:
  _common.main(__doc__, run, markdown, quick_help="a smaller MLP, fewer repeats", out_dir=RESULTS,
               argv=argv)


if __name__ == "__main__":
  main()
