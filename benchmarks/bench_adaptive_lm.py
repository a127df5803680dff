"""Does ``jaxaccum.contrib.AdaptiveBatch`` at its defaults make a real model reach its target sooner
than the best fixed batch? The character LM against a sweep of fixed batch sizes.

The model, data and training loop are those of ``examples/adaptive_batch.py`` (a 2-layer
character transformer, d 64, on the Python standard library's source; sequences of 32
characters, micro-batches of 4 sequences, up to N = 32 micro-batches, Adam, a budget of 1M
tokens per run, validation every 10k tokens). Runs:

* the sweep: fixed ``k`` in ``KS`` micro-batches, each at every learning rate of ``LRS``,
  over ``SEEDS`` (one compiled program, vectorised over learning rates and seeds);
* the controller: ``AdaptiveBatch(N)`` at its defaults (``rule="norm_test"``, ``theta=3``,
  ...), at the learning rate that is best for the fixed batch of its starting ``k``
  (the one a user tunes before adapting), and, as a sensitivity check, at every rate;
* a fixed ramp by tokens (Megatron-LM format, ``examples/adaptive_batch.py``'s default) at
  the same rate.

The target validation loss is fixed from the sweep alone, before any controller run: the
highest of the fixed batches' best final losses (mean over seeds) plus ``MARGIN``, a loss
that every fixed batch reaches within the budget. Each fixed batch's learning rate is then
the one with the fewest steps to the target (mean over seeds). The goals (issue 28): the
controller is dominated by no fixed batch (none reaches the target with both fewer steps
and fewer tokens, means over seeds), and reaches it in at least 25% fewer steps than the
most token-efficient fixed batch with at most 10% more tokens.

  nice -n 10 python benchmarks/bench_adaptive_lm.py                 # everything
  nice -n 10 python benchmarks/bench_adaptive_lm.py --phase sweep   # the sweep (cached)
  nice -n 10 python benchmarks/bench_adaptive_lm.py --phase rest    # controller, ramp (cached)
  nice -n 10 python benchmarks/bench_adaptive_lm.py --phase report  # tables, plot

Writes ``benchmarks/results/adaptive_lm.{json,md,png}`` (the runs are cached in
``adaptive_lm_sweep.json`` and ``adaptive_lm_rest.json`` next to them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "examples"))
import _common  # noqa: E402
import adaptive_batch as ab  # noqa: E402  (the example: model, data, training loop)

import jaxaccum  # noqa: E402

OUT_DIR = ROOT / "benchmarks" / "results"
KS = (1, 2, 4, 8, 16, 32)
LRS = (1e-3, 3e-3, 1e-2)
SEEDS = (0, 1, 2)
MARGIN = 0.02  # nats above the worst fixed batch's best final loss
CONFIG = ab.Config()


def _compact(log: dict[str, Any]) -> dict[str, Any]:
  """A run's evaluations, with ``k`` and B_simple at each evaluation step."""
  ev = log["evals"]
  idx = np.clip(ev[:, 0].astype(int) - 1, 0, len(log["k"]) - 1)
  return {"lr": log["lr"], "seed": log["seed"],
          "step": ev[:, 0].astype(int).tolist(), "tokens": ev[:, 1].astype(int).tolist(),
          "val": np.round(ev[:, 2], 5).tolist(),
          "k": log["k"][idx].astype(int).tolist(),
          "b_simple": [None if not np.isfinite(b) else round(float(b), 3)
                       for b in log["b_simple"][idx]]}


def _evals(run: dict[str, Any]) -> np.ndarray:
  return np.stack([run["step"], run["tokens"], run["val"]], axis=1).astype(float)


def sweep(cfg: ab.Config, data) -> dict[str, Any]:
  """Every fixed ``k`` at every learning rate and seed."""
  runs, seconds = {}, {}
  for k in [k for k in KS if k <= cfg.max_micro_batches]:
    t0 = time.perf_counter()
    logs = ab.train(cfg, "fixed", k=k, lrs=list(LRS), seeds=list(SEEDS), data=data)
    seconds[k] = time.perf_counter() - t0
    runs[str(k)] = [_compact(lg) for lg in logs]
    print(f"fixed k={k:>2}: {seconds[k]:.0f} s for {len(logs)} runs", flush=True)
  return {"runs": runs, "seconds": seconds}


def _stats(runs: list[dict], target: float, budget: float) -> dict[str, Any]:
  """Mean (and spread) over seeds of steps and tokens to ``target``, loss at budget."""
  st = np.array([ab.to_target(_evals(r), target) for r in runs])
  final = np.array([ab.loss_at_tokens(_evals(r), budget) for r in runs])
  reached = int(np.sum(np.isfinite(st[:, 0])))
  return {"steps": float(np.mean(st[:, 0])), "tokens": float(np.mean(st[:, 1])),
          "steps_sd": float(np.std(st[:, 0])), "tokens_sd": float(np.std(st[:, 1])),
          "steps_per_seed": st[:, 0].tolist(), "tokens_per_seed": st[:, 1].tolist(),
          "reached": reached, "seeds": len(runs), "loss_at_budget": float(np.mean(final)),
          "loss_at_budget_sd": float(np.std(final))}


def choose(sweep_runs: dict[str, list[dict]], budget: float) -> tuple[float, dict[int, float]]:
  """The target (from the sweep alone) and each fixed batch's best learning rate."""
  best_final = {}
  for k, runs in sweep_runs.items():
    finals = {lr: np.mean([ab.loss_at_tokens(_evals(r), budget) for r in runs
                           if r["lr"] == lr]) for lr in LRS}
    best_final[k] = min(finals.values())
  target = max(best_final.values()) + MARGIN
  best_lr = {}
  for k, runs in sweep_runs.items():
    by_lr = {lr: _stats([r for r in runs if r["lr"] == lr], target, budget) for lr in LRS}
    ok = {lr: s for lr, s in by_lr.items() if s["reached"] == s["seeds"]}
    pool = ok or by_lr
    field = "steps" if ok else "loss_at_budget"
    best_lr[int(k)] = min(pool, key=lambda lr, pool=pool, field=field: pool[lr][field])
  return float(target), best_lr


def rest(cfg: ab.Config, data) -> dict[str, Any]:
  """The controller at its defaults and the fixed ramp, at every learning rate and seed.

  Which rate counts (the best one of the fixed batch of the controller's starting ``k``)
  is chosen from the sweep alone, in :func:`analyse`; the others are the sensitivity.
  """
  controller = jaxaccum.contrib.AdaptiveBatch(cfg.max_micro_batches)
  out: dict[str, Any] = {"k0": controller.init_micro_batches, "controller": repr(controller)}
  t0 = time.perf_counter()
  adaptive = {}
  for lr in LRS:
    adaptive[str(lr)] = [_compact(ab.train(cfg, "adaptive", lrs=[lr], seeds=[s], data=data,
                                           controller=controller)[0]) for s in SEEDS]
    print(f"adaptive lr={lr}: {time.perf_counter() - t0:.0f} s", flush=True)
  out["adaptive"] = adaptive
  t0 = time.perf_counter()
  ramp = [_compact(lg) for lg in ab.train(cfg, "ramp", lrs=list(LRS), seeds=list(SEEDS),
                                          data=data)]
  out["ramp"] = {str(lr): [r for r in ramp if r["lr"] == lr] for lr in LRS}
  print(f"ramp: {time.perf_counter() - t0:.0f} s", flush=True)
  return out


def analyse(sw: dict[str, Any], extra: dict[str, Any], cfg: ab.Config) -> dict[str, Any]:
  budget = cfg.tokens
  target, best_lr = choose(sw["runs"], budget)
  k0 = extra["k0"]
  lr0 = best_lr[k0] if k0 in best_lr else best_lr[min(best_lr)]
  fixed = {}
  for k in best_lr:
    lr = best_lr[k]
    fixed[k] = {"lr": lr, **_stats([r for r in sw["runs"][str(k)] if r["lr"] == lr],
                                   target, budget)}
  adaptive = {lr: _stats(runs, target, budget) for lr, runs in extra["adaptive"].items()}
  ctrl = adaptive[str(lr0)]
  ramps = {lr: _stats(runs, target, budget) for lr, runs in extra["ramp"].items()}
  ramp = ramps[str(lr0)]
  reaching = {k: f for k, f in fixed.items() if f["reached"] == f["seeds"]}
  efficient = min(reaching, key=lambda k: reaching[k]["tokens"])
  dominated_by = [k for k, f in reaching.items()
                  if f["steps"] < ctrl["steps"] and f["tokens"] < ctrl["tokens"]]
  steps_ratio = ctrl["steps"] / fixed[efficient]["steps"]
  tokens_ratio = ctrl["tokens"] / fixed[efficient]["tokens"]
  # B_simple growth in the controller's runs: its EMA at the evaluations nearest 1% and 5%
  # of the budget, against its median over the last 10%.
  growth = []
  for run in extra["adaptive"][str(lr0)]:
    b = np.array([np.nan if x is None else x for x in run["b_simple"]], float)
    t = np.array(run["tokens"], float)
    late = b[t >= 0.9 * budget]
    growth.append({"at_1pct": float(b[np.argmin(abs(t - 0.01 * budget))]),
                   "at_5pct": float(b[np.argmin(abs(t - 0.05 * budget))]),
                   "late": float(np.nanmedian(late)), "k_final": run["k"][-1]})
  return {
      "target": target, "margin": MARGIN, "budget_tokens": budget, "best_lr": best_lr,
      "fixed": fixed, "ramp": ramp, "ramp_all_lrs": ramps, "adaptive": adaptive,
      "controller_lr": lr0,
      "most_token_efficient_fixed": efficient, "dominated_by": dominated_by,
      "steps_ratio_vs_most_token_efficient": steps_ratio,
      "tokens_ratio_vs_most_token_efficient": tokens_ratio,
      "goal_not_dominated": not dominated_by,
      "goal_steps_and_tokens": bool(steps_ratio <= 0.75 and tokens_ratio <= 1.10),
      "b_simple_growth": growth,
  }


def markdown(res: dict[str, Any]) -> str:
  a, env, cfg = res["analysis"], res["env"], res["config"]
  lines = [
      "# AdaptiveBatch on the character LM, against a sweep of fixed batches",
      "",
      f"{env['date']}, {res['machine']}, jax {env['jax']}; `benchmarks/bench_adaptive_lm.py`."
      f" Model: {cfg['layers']} layers, d {cfg['d_model']}, sequences of {cfg['seq_len']} "
      f"characters, micro-batches of {cfg['micro_batch_size']} sequences, up to "
      f"{cfg['max_micro_batches']}; Adam; {cfg['tokens']:,} tokens per run; seeds "
      f"{list(SEEDS)}; learning rates {list(LRS)}.",
      "",
      f"Target validation loss **{a['target']:.4f}** (the worst fixed batch's best final "
      f"loss + {a['margin']}, fixed from the sweep before any controller run). Means over "
      "seeds (± standard deviation); the learning rate of each fixed batch is its best "
      "from the grid (fewest steps to the target).",
      "",
      "| run | lr | steps to target | tokens to target | loss at budget | reached |",
      "|---|---|---|---|---|---|",
  ]

  def row(name, lr, s):
    return (f"| {name} | {lr:g} | {s['steps']:,.0f} ± {s['steps_sd']:,.0f} | "
            f"{s['tokens']:,.0f} ± {s['tokens_sd']:,.0f} | {s['loss_at_budget']:.4f} | "
            f"{s['reached']}/{s['seeds']} |")

  for k, f in a["fixed"].items():
    mark = " (most token-efficient)" if int(k) == int(a["most_token_efficient_fixed"]) else ""
    lines.append(row(f"fixed k={k} ({int(k) * cfg['micro_batch_size']} seq){mark}",
                     f["lr"], f))
  lines.append(row(f"ramp `{cfg['ramp']}`", a["controller_lr"], a["ramp"]))
  lr0 = a["controller_lr"]
  lines.append(row("**AdaptiveBatch, defaults**", lr0, a["adaptive"][str(lr0)]))
  for lr, s in a["adaptive"].items():
    if float(lr) != lr0:
      lines.append(row("AdaptiveBatch, defaults (other lr)", float(lr), s))
  e = a["most_token_efficient_fixed"]
  g = a["b_simple_growth"]
  lines += [
      "",
      f"Against the most token-efficient fixed batch (k={e}): steps x"
      f"{a['steps_ratio_vs_most_token_efficient']:.2f}, tokens x"
      f"{a['tokens_ratio_vs_most_token_efficient']:.2f} (goal: <= 0.75 and <= 1.10): "
      f"**{'met' if a['goal_steps_and_tokens'] else 'not met'}**. Dominated by: "
      f"{a['dominated_by'] or 'none'} (goal: none): "
      f"**{'met' if a['goal_not_dominated'] else 'not met'}**.",
      "",
      "B_simple (EMA, sequences) in the controller's runs, at 1% and 5% of the budget -> "
      "over its last 10%: "
      + ", ".join(f"{x['at_1pct']:.0f}, {x['at_5pct']:.0f} -> {x['late']:.0f} "
                  f"(x{x['late'] / x['at_1pct']:.0f}, x{x['late'] / x['at_5pct']:.1f}; "
                  f"final k {x['k_final']})" for x in g) + ".",
      "",
      f"Sweep time: {sum(res['sweep_seconds'].values()):.0f} s for "
      f"{len(KS) * len(LRS) * len(SEEDS)} runs (2-core CPU container, shared).",
  ]
  return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], sw_runs, extra, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  a, cfg = res["analysis"], res["config"]
  fig, axes = plt.subplots(2, 2, figsize=(12, 9))
  ax_f, ax_b, ax_t, ax_s = axes.ravel()
  for k, f in a["fixed"].items():
    ax_f.errorbar(f["tokens"], f["steps"], xerr=f["tokens_sd"], yerr=f["steps_sd"],
                  fmt="o", color="C0")
    ax_f.annotate(f"k={k}", (f["tokens"], f["steps"]), fontsize=8, xytext=(4, 4),
                  textcoords="offset points")
  for name, s, c in (("ramp", a["ramp"], "C2"),
                     ("AdaptiveBatch", a["adaptive"][str(a["controller_lr"])], "C3")):
    ax_f.errorbar(s["tokens"], s["steps"], xerr=s["tokens_sd"], yerr=s["steps_sd"],
                  fmt="s", color=c, label=name)
  ax_f.set(xscale="log", yscale="log", xlabel="tokens to target", ylabel="steps to target",
           title=f"to validation loss {a['target']:.3f} (means over seeds)")
  ax_f.legend(fontsize=8)
  lr0 = str(a["controller_lr"])
  show = {f"fixed k={k}": [r for r in sw_runs[str(k)] if r["lr"] == a["best_lr"][k]]
          for k in sorted({min(a["best_lr"]) * 2, a["most_token_efficient_fixed"],
                           max(a["best_lr"])})}
  show["ramp"] = extra["ramp"][lr0]
  show["AdaptiveBatch"] = extra["adaptive"][lr0]
  for i, (name, runs) in enumerate(show.items()):
    c = f"C{i}"
    for j, r in enumerate(runs):
      lab = name if j == 0 else None
      ax_t.plot(r["tokens"], r["val"], color=c, lw=1, label=lab)
      ax_s.plot(np.maximum(r["step"], 1), r["val"], color=c, lw=1, label=lab)
      if name in ("AdaptiveBatch", "ramp") or j == 0:
        ax_b.plot(r["tokens"], np.array(r["k"]) * cfg["micro_batch_size"], color=c, lw=1,
                  label=f"{name}: batch" if j == 0 else None)
      if name == "AdaptiveBatch" or (j == 0 and name.startswith("fixed")):
        b = np.array([np.nan if x is None else x for x in r["b_simple"]], float)
        ax_b.plot(r["tokens"], b, color=c, lw=0.8, ls=":",
                  label=f"{name}: B_simple" if j == 0 else None)
  ax_b.set(yscale="log", xlabel="tokens seen", ylabel="sequences",
           title="batch and B_simple (EMA)")
  for ax in (ax_t, ax_s):
    ax.axhline(a["target"], color="k", ls="--", lw=0.8)
    ax.set_ylim(a["target"] - 0.3, a["target"] + 0.8)
  ax_t.set(xlabel="tokens seen", ylabel="validation loss")
  ax_s.set(xscale="log", xlabel="optimizer steps", ylabel="validation loss")
  for ax in axes.ravel():
    ax.grid(alpha=0.3)
  for ax in (ax_b, ax_t, ax_s):
    ax.legend(fontsize=7)
  env = res["env"]
  fig.suptitle(f"char LM, AdaptiveBatch at its defaults vs fixed batches; {env['date']}, "
               f"{res['machine']}, jax {env['jax']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--phase", choices=("all", "sweep", "rest", "report"), default="all")
  parser.add_argument("--out-dir", type=pathlib.Path, help=f"default: {OUT_DIR}")
  _common.add_tiny(parser)  # the example's tiny model: a smoke run of the pipeline
  args = parser.parse_args(argv)
  cfg = ab.TINY if args.tiny else CONFIG
  if args.tiny:  # one seed, one learning rate, two fixed batches
    global KS, LRS, SEEDS
    KS, LRS, SEEDS = (1, 2), (1e-2,), (0,)
  out = _common.out_dir_for(args.tiny, args.out_dir, OUT_DIR)
  out.mkdir(parents=True, exist_ok=True)
  cache = out / "adaptive_lm_sweep.json"
  cache_rest = out / "adaptive_lm_rest.json"
  data = ab.load_data(cfg)
  if args.phase in ("all", "sweep"):
    cache.write_text(json.dumps(sweep(cfg, data)))
  if args.phase in ("all", "rest"):
    cache_rest.write_text(json.dumps(rest(cfg, data)))
  if args.phase in ("sweep", "rest"):
    return
  sw = json.loads(cache.read_text())
  extra = json.loads(cache_rest.read_text())
  res = {"env": _common.device_info(), "machine": "2-core CPU container",
         "config": dataclasses.asdict(cfg), "ks": KS, "lrs": LRS, "seeds": SEEDS,
         "sweep_seconds": sw["seconds"]}
  res["analysis"] = analyse(sw, extra, cfg)
  res["runs"] = {"ramp": extra["ramp"], "adaptive": extra["adaptive"]}
  _common.write_results(out, "adaptive_lm", res, markdown)
  plot(res, sw["runs"], extra, out / "adaptive_lm.png")
  print(markdown(res))
  print(f"results in {out}")


if __name__ == "__main__":
  main()
