"""What the per-step features cost: with_info, skip_nonfinite, loss terms, active_micro_batches.

One optimizer step (``jaxaccum.value_and_grad`` then SGD) of the MLP classifier of
``bench_accumulation.py`` at ``N = 8`` micro-batches, in these variants:

* ``plain``: ``jaxaccum.value_and_grad(loss, num_micro_batches=8)``;
* ``with_info``: the same with ``with_info=True`` (one squared norm per micro-batch);
* ``skip_nonfinite``: the same with ``skip_nonfinite=True`` (one isfinite reduction per
  micro-batch);
* ``1 term (weighted)``: a loss returning ``(numerator, denominator)`` under
  ``reduce="weighted"``, whose numerator adds a mean term and a sum term to the summed
  cross-entropy;
* ``3 terms``: the same three terms as a dict under ``reduce={"ce": "weighted", "lb":
  "mean", "z": "sum"}``, each normalised its own way (terms with different divisors cost
  one backward pass each);
* ``k = N/4`` and ``k = N``: one compiled step taking ``active_micro_batches`` as a traced
  int32, called with ``k = 2`` and ``k = 8``.

Every variant is compiled first, warmed up, then timed round-robin in this one process;
medians and their ratios are reported (targets: with_info and skip_nonfinite at most 5%
over plain, ``k = N/4`` at most about 0.35x ``k = N``), never asserted. Results go to
``benchmarks/results/features.{json,md}``. ``BENCH_QUICK=1`` (or ``--quick``) takes fewer
repeats of the same model.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import bench_accumulation  # noqa: E402  (the MLP problem and its sizes)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
N = 8
K_SMALL = N // 4
VARIANTS = ("plain", "with_info", "skip_nonfinite", "1 term (weighted)", "3 terms",
            f"k = {K_SMALL}", f"k = {N}")
REDUCE = {"ce": "weighted", "lb": "mean", "z": "sum"}
WEIGHTS = {"lb": 0.01, "z": 1e-4}
# (variant, baseline, target or None): the ratios reported.
RATIOS = (("with_info", "plain", 1.05), ("skip_nonfinite", "plain", 1.05),
          ("3 terms", "1 term (weighted)", None), (f"k = {K_SMALL}", f"k = {N}", 0.35),
          (f"k = {N}", "plain", None))


def _forward(params: list, x: jax.Array) -> jax.Array:
  """The logits of ``bench_accumulation.mlp_problem``'s MLP."""
  for layer in params[:-1]:
    x = jax.nn.gelu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def terms_loss(params: list, batch: tuple) -> dict:
  """Three terms: summed cross-entropy and its count, a batch statistic, a sum."""
  x, labels = batch
  logits = _forward(params, x)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  mean_probs = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0)
  return {"ce": (jnp.sum(ce), jnp.float32(ce.shape[0])),
          "lb": logits.shape[-1] * jnp.sum(mean_probs**2),  # load-balance-like statistic
          "z": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)}


def single_loss(params: list, batch: tuple) -> tuple[jax.Array, jax.Array]:
  """The same forward and terms folded into one weighted numerator."""
  t = terms_loss(params, batch)
  num, den = t["ce"]
  return num + den * (WEIGHTS["lb"] * t["lb"] + WEIGHTS["z"] * t["z"] / den), den


def build_steps(loss_fn: Callable, tx: optax.GradientTransformation) -> dict[str, Callable]:
  """The step function of each variant: ``(params, batch[, k]) -> (params, outputs)``."""

  def step_of(vg, takes_k=False):
    def step(params, batch, *k):
      out = vg(params, batch, active_micro_batches=k[0]) if takes_k else vg(params, batch)
      grads = out[1]
      updates, _ = tx.update(grads, tx.init(params), params)
      return optax.apply_updates(params, updates), (out[0], *out[2:])
    return step

  vg = jaxaccum.value_and_grad
  ramp = step_of(vg(loss_fn, num_micro_batches=N), takes_k=True)
  return {
      "plain": step_of(vg(loss_fn, num_micro_batches=N)),
      "with_info": step_of(vg(loss_fn, num_micro_batches=N, with_info=True)),
      "skip_nonfinite": step_of(vg(loss_fn, num_micro_batches=N, skip_nonfinite=True)),
      "1 term (weighted)": step_of(vg(single_loss, num_micro_batches=N, reduce="weighted")),
      "3 terms": step_of(vg(terms_loss, num_micro_batches=N,
                            reduce=jaxaccum.Terms(REDUCE, weights=WEIGHTS))),
      f"k = {K_SMALL}": ramp,
      f"k = {N}": ramp,
  }


def measure(cfg: bench_accumulation.MLPConfig, *, repeats: int, warmup: int) -> dict[str, Any]:
  """Compiles, warms up and times every variant, interleaved."""
  loss_fn, params, batch = bench_accumulation.mlp_problem(cfg)
  steps = build_steps(loss_fn, optax.sgd(1e-3))
  k_args = {f"k = {K_SMALL}": (jnp.int32(K_SMALL),), f"k = {N}": (jnp.int32(N),)}
  compiled, stats, states = {}, {}, {}
  for name, step in steps.items():
    args = k_args.get(name, ())
    states[name] = jax.tree.map(jnp.copy, params)
    if name == f"k = {N}":  # the same executable as k = N/4: one program for every k
      compiled[name], stats[name] = compiled[f"k = {K_SMALL}"], stats[f"k = {K_SMALL}"]
      continue
    compiled[name], stats[name] = _common.compile_with_stats(
        _common.fresh_jit(step, donate_argnums=0), states[name], batch, *args)

  # One call each from the initial parameters (a warm-up call): the losses, for checking.
  first_loss = {}
  for name in steps:
    states[name], out = _common.block(compiled[name](states[name], batch, *k_args.get(name, ())))
    first_loss[name] = float(out[0])

  def runner(name):
    args = k_args.get(name, ())

    def run():
      states[name], _ = _common.block(compiled[name](states[name], batch, *args))
    return run

  times = _common.time_interleaved({name: runner(name) for name in steps}, repeats=repeats,
                                   warmup=warmup)
  rows = {name: {"step_s": _common.median(times[name]), "min_s": min(times[name]),
                 "times_s": times[name],
                 "compile_s": stats[name]["compile_s"], "temp": stats[name]["temp"],
                 "first_loss": first_loss[name]}
          for name in steps}
  ratios = []
  for name, base, target in RATIOS:
    r = rows[name]["step_s"] / rows[base]["step_s"]
    ratios.append({"variant": name, "baseline": base, "ratio": r,
                   "ratio_min": rows[name]["min_s"] / rows[base]["min_s"], "target": target,
                   "pass": None if target is None else bool(r <= target)})
  return {"config": repr(cfg), "n": N, "rows": rows, "ratios": ratios}


def markdown(results: dict[str, Any]) -> str:
  env = results["environment"]
  m = results["mlp"]
  lines = [
      "# Feature costs: with_info, skip_nonfinite, loss terms, active_micro_batches", "",
      f"{env['date']}, device `{env['device_kind']}` ({env['platform']}), host CPUs "
      f"{env['host_cpus']}, jax {env['jax']}, {'quick run' if results['quick'] else 'full run'}: "
      f"{results['repeats']} timed repeats after {results['warmup']} warm-up, interleaved, "
      "medians.", "",
      f"MLP `{m['config']}`, N = {m['n']} micro-batches; one optimizer step (SGD).", "",
      "| variant | step (ms, median) | fastest (ms) | compile (s) | temp (MiB) |",
      "|:---|---:|---:|---:|---:|"]
  for name, row in m["rows"].items():
    lines.append(f"| {name} | {1e3 * row['step_s']:.3f} | {1e3 * row['min_s']:.3f} | "
                 f"{row['compile_s']:.2f} | "
                 f"{row['temp'] / _common.MIB:.2f} |")
  lines += ["", "| ratio | of medians | of fastest | target (medians) |",
            "|:---|---:|---:|:---|"]
  for r in m["ratios"]:
    target = "-" if r["target"] is None else (
        f"<= {r['target']} {'pass' if r['pass'] else '**miss**'}")
    lines.append(f"| {r['variant']} / {r['baseline']} | {r['ratio']:.3f} | "
                 f"{r['ratio_min']:.3f} | {target} |")
  lines += ["", f"`k = {K_SMALL}` and `k = {N}` are one compiled program (the step takes "
            "`active_micro_batches` as a traced int32). `3 terms` has two gradient "
            "accumulators (the weighted term's, and the mean and sum terms' together), "
            "`1 term (weighted)` one.", ""]
  return "\n".join(lines)


def run(*, quick: bool, repeats: int | None = None, warmup: int | None = None,
        cfg: bench_accumulation.MLPConfig | None = None,
        out_dir: pathlib.Path = RESULTS) -> dict[str, Any]:
  """Runs the benchmark and writes ``features.json`` and ``features.md``."""
  env = _common.device_info()
  repeats = repeats or (21 if quick else 61)
  warmup = warmup or (3 if quick else 5)
  # The full-size MLP even when quick: on the small one fixed per-op costs dominate a step.
  cfg = cfg or bench_accumulation.default_configs(env["platform"], quick=False)["mlp"]
  results = {"environment": env, "quick": quick, "repeats": repeats, "warmup": warmup,
             "mlp": measure(cfg, repeats=repeats, warmup=warmup)}
  _common.write_results(out_dir, "features", results, markdown)
  return results


def main(argv: Sequence[str] | None = None) -> None:
  _common.main(__doc__, run, markdown, quick_help="fewer repeats", out_dir=RESULTS,
               tiny=lambda: {"cfg": bench_accumulation.MLPConfig(batch=16, d_in=8, hidden=16,
                                                                 depth=1)}, argv=argv)


if __name__ == "__main__":
  main()
