"""Forward-only evaluation in micro-batches: ``jaxaccum.evaluate`` against its alternatives.

The MLP classifier of ``bench_accumulation.py`` evaluated on one large batch (its mean
cross-entropy), three ways:

* ``full``: ``jax.jit(loss)`` on the whole batch;
* ``jaxaccum.evaluate``: ``jaxaccum.evaluate(loss, num_micro_batches=N)``;
* ``optax.microbatch``: ``optax.microbatch(loss, argnums=1, microbatch_size=B // N,
  accumulator=MEAN)``, the same function through optax.

For each ``N`` every method is compiled (``memory_analysis()`` gives its temporary memory),
its value is checked against the full batch's, and all of them are then timed round-robin
in this one process (:mod:`_common`); medians are reported, never asserted. Results go to
``benchmarks/results/evaluate.{json,md}``. ``BENCH_QUICK=1`` (or ``--quick``) takes fewer
values of ``N`` and fewer repeats of the same model.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import bench_accumulation  # noqa: E402  (the MLP problem and its sizes)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
METHODS = ("full", "jaxaccum.evaluate", "optax.microbatch")


def build(loss_fn: Callable, batch_size: int, n: int) -> dict[str, Callable]:
  """Each method's function ``(params, batch) -> mean loss`` at ``n`` micro-batches."""
  return {
      "full": loss_fn,
      "jaxaccum.evaluate": jaxaccum.evaluate(loss_fn, num_micro_batches=n),
      "optax.microbatch": optax.microbatch(
          loss_fn, argnums=1, microbatch_size=batch_size // n,
          accumulator=optax.microbatching.AccumulationType.MEAN),
  }


def measure(cfg: bench_accumulation.MLPConfig, counts: Sequence[int], *, repeats: int,
            warmup: int) -> dict[str, Any]:
  """Compiles every method at every ``N``, checks its value, then times them interleaved."""
  loss_fn, params, batch = bench_accumulation.mlp_problem(cfg)
  reference = float(jax.jit(loss_fn)(params, batch))
  compiled, stats, values = {}, {}, {}
  for n in counts:
    for name, fun in build(loss_fn, cfg.batch, n).items():
      key = f"{name} N={n}" if name != "full" else "full"
      if key in compiled:
        continue
      compiled[key], stats[key] = _common.compile_with_stats(_common.fresh_jit(fun), params,
                                                             batch)
      values[key] = float(_common.block(compiled[key](params, batch)))

  def runner(key):
    return lambda: _common.block(compiled[key](params, batch))

  times = _common.time_interleaved({k: runner(k) for k in compiled}, repeats=repeats,
                                   warmup=warmup)
  rows = {k: {"step_s": _common.median(times[k]), "min_s": min(times[k]), "times_s": times[k],
              "compile_s": stats[k]["compile_s"], "temp": stats[k]["temp"],
              "value": values[k], "rel_error": abs(values[k] - reference) / abs(reference)}
          for k in compiled}
  return {"config": repr(cfg), "counts": list(counts), "reference": reference, "rows": rows}


def markdown(results: dict[str, Any]) -> str:
  env, m = results["environment"], results["mlp"]
  full = m["rows"]["full"]
  lines = [
      "# Evaluation in micro-batches: jaxaccum.evaluate, optax.microbatch, the full batch", "",
      f"{env['date']}, device `{env['device_kind']}` ({env['platform']}), host CPUs "
      f"{env['host_cpus']}, jax {env['jax']}, {'quick run' if results['quick'] else 'full run'}: "
      f"{results['repeats']} timed repeats after {results['warmup']} warm-up, interleaved, "
      "medians.", "",
      f"MLP `{m['config']}`: the mean cross-entropy of one batch, forward only.", "",
      "| method | N | time (ms, median) | fastest (ms) | time / full | temp (MiB) | "
      "temp / full | compile (s) | rel. error |",
      "|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for key, row in m["rows"].items():
    name, _, n = key.partition(" N=")
    lines.append(
        f"| {name} | {n or '-'} | {1e3 * row['step_s']:.3f} | {1e3 * row['min_s']:.3f} | "
        f"{row['step_s'] / full['step_s']:.2f} | {row['temp'] / _common.MIB:.2f} | "
        f"{row['temp'] / full['temp']:.3f} | {row['compile_s']:.2f} | {row['rel_error']:.1e} |")
  lines.append("")
  return "\n".join(lines)


def run(*, quick: bool, repeats: int | None = None, warmup: int | None = None,
        cfg: bench_accumulation.MLPConfig | None = None, counts: Sequence[int] | None = None,
        out_dir: pathlib.Path = RESULTS) -> dict[str, Any]:
  """Runs the benchmark and writes ``evaluate.json`` and ``evaluate.md``."""
  env = _common.device_info()
  repeats = repeats or (21 if quick else 61)
  warmup = warmup or (3 if quick else 5)
  cfg = cfg or bench_accumulation.default_configs(env["platform"], quick=False)["mlp"]
  counts = counts or ((4, 16) if quick else (2, 4, 8, 16, 32))
  results = {"environment": env, "quick": quick, "repeats": repeats, "warmup": warmup,
             "mlp": measure(cfg, counts, repeats=repeats, warmup=warmup)}
  _common.write_results(out_dir, "evaluate", results, markdown)
  return results


def main(argv: Sequence[str] | None = None) -> None:
  _common.main(__doc__, run, markdown, quick_help="fewer N and repeats", out_dir=RESULTS,
               tiny=lambda: {"cfg": bench_accumulation.MLPConfig(batch=16, d_in=8, hidden=16,
                                                                 depth=1),
                             "counts": (4,)}, argv=argv)


if __name__ == "__main__":
  main()
