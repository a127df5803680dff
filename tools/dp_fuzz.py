"""The long differential fuzz of ``clip_per_example`` (``make fuzz-dp``).

Runs ``--cases`` generated cases (seeds ``--seed`` to ``--seed + cases - 1``) of
``tests/_dp_fuzz.py``: each method of ``clip_per_example`` against per-example ``jax.grad``
on three properties (the norms, the clipped sum, and the sensitivity bound measured on each
example alone). Prints each failing case as it is found and a summary at the end: cases run
and skipped, failures by property and method, each method's status counts, the largest
contribution over ``C`` and the largest relative error of a norm. The JSON report (every
case's results) is rewritten after each case, so an interrupted run keeps what it found.

Every ``--fsdp-every``-th case (default 4) also runs under an FSDP placement on 8 virtual
CPU devices (``_dp_fuzz.draw_fsdp``: ``param_gather`` x ``grad_scatter`` x
``overlap_grad_reduce`` in turn, the shard count and the sharded parameters drawn), each
method on the clipped sum and the bound; the summary counts the runs of each placement x
method, their failures and their largest contribution over ``C``.

  python tools/dp_fuzz.py --cases 1000 --seed 0 --out fuzz-dp-report.json
  python tools/dp_fuzz.py --known          # the named known cases
  python tools/dp_fuzz.py --only 17,42     # some seeds again

The exit status is 1 if any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# XLA's lowest CPU optimisation level compiles these small programs faster (the suite's
# conftest.py does the same); set XLA_FLAGS to override.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()
# The FSDP placements run on 8 virtual CPU devices (before jax is imported).
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from tests import _dp_fuzz  # noqa: E402

# The FSDP placements in the order the cases take them: (param_gather, grad_scatter, overlap).
PLACEMENTS = [(g, s, o) for g, s in _dp_fuzz.FSDP_PLACEMENTS for o in (False, True)]


def summarise(reports: list[dict], methods: tuple[str, ...]) -> dict:
  """Counts and extremes over ``reports`` (the cases' reports from ``_dp_fuzz.check``)."""
  checked = [r for r in reports if "skipped" not in r]
  out: dict = {"cases": len(reports), "checked": len(checked),
               "skipped": len(reports) - len(checked),
               "ill_conditioned": sum(1 for r in checked if r.get("ill_conditioned")),
               "failed_cases": 0, "methods": {}}
  for m in methods:
    rs = [(r["case"], r["methods"][m]) for r in checked if m in r["methods"]]
    status: dict[str, int] = {}
    by_prop = {p: 0 for p in _dp_fuzz.PROPERTIES}
    for _, x in rs:
      status[x["status"]] = status.get(x["status"], 0) + 1
      for p in x["failed"]:
        by_prop[p] += 1
    ran = [(c, x) for c, x in rs if "contribution_over_c" in x]
    worst_c = max(ran, key=lambda cx: cx[1]["contribution_over_c"], default=None)
    worst_n = max(ran, key=lambda cx: cx[1]["norm_rel_err"], default=None)
    out["methods"][m] = {
        "status": status, "failures_by_property": by_prop,
        "worst_contribution_over_c": None if worst_c is None else
        {"case": worst_c[0], "value": worst_c[1]["contribution_over_c"]},
        "worst_norm_rel_err": None if worst_n is None else
        {"case": worst_n[0], "value": worst_n[1]["norm_rel_err"]}}
  out["failed_cases"] = sum(1 for r in checked if _dp_fuzz.failures(r))
  return out


def summarise_fsdp(reports: list[dict]) -> dict:
  """Per FSDP placement x method (the cases' reports under ``fsdp=``): runs, status counts,
  failures and the largest contribution over ``C``."""
  out: dict = {}
  for r in reports:
    if "skipped" in r:
      continue
    for m, x in r["methods"].items():
      e = out.setdefault(r["fsdp"]["placement"], {}).setdefault(
          m, {"runs": 0, "status": {}, "failed": 0, "worst_contribution_over_c": None})
      e["runs"] += 1
      e["status"][x["status"]] = e["status"].get(x["status"], 0) + 1
      e["failed"] += bool(x["failed"])
      v = x.get("contribution_over_c")
      worst = e["worst_contribution_over_c"]
      if v is not None and (worst is None or v > worst["value"]):
        e["worst_contribution_over_c"] = {"case": r["case"], "value": v}
  return out


def print_fsdp(s: dict, skipped: int) -> None:
  runs = sum(e["runs"] for ms in s.values() for e in ms.values())
  failed = sum(e["failed"] for ms in s.values() for e in ms.values())
  print(f"FSDP: {runs} placement x method runs over {len(s)} placements, {failed} failed"
        f" ({skipped} cases had no placement or a skipped reference)")
  for name in sorted(s):
    for m, e in sorted(s[name].items()):
      w = e["worst_contribution_over_c"]
      worst = "" if w is None else f"; worst contribution/C {w['value']:.6f} ({w['case']})"
      print(f"  {name:32s} {m:12s} {e['runs']} runs {e['status']}, {e['failed']} failed{worst}")


def print_summary(s: dict) -> None:
  print(f"\n{s['cases']} cases: {s['checked']} checked, {s['skipped']} skipped "
        f"(non-finite or all-zero reference), {s['failed_cases']} failed; "
        f"{s['ill_conditioned']} ill-conditioned in their compute dtype (bound only)")
  print(f"rounding bound: C * (1 + {_dp_fuzz.ROUNDING_BOUND:g}); norm rtol "
        f"{_dp_fuzz.NORM_RTOL}; sum rtol {_dp_fuzz.SUM_RTOL}")
  for m, x in s["methods"].items():
    props = ", ".join(f"{p} {k}" for p, k in x["failures_by_property"].items())
    wc, wn = x["worst_contribution_over_c"], x["worst_norm_rel_err"]
    print(f"  {m:12s} {x['status']}; failures by property: {props}")
    if wc is not None:
      print(f"  {'':12s} worst contribution/C {wc['value']:.6f} ({wc['case']}); "
            f"worst norm rel err {wn['value']:.3g} ({wn['case']})")


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--cases", type=int, default=1000)
  ap.add_argument("--seed", type=int, default=0, help="the first case's seed")
  ap.add_argument("--out", default="fuzz-dp-report.json", help="the JSON report's path")
  ap.add_argument("--methods", default=",".join(_dp_fuzz.METHODS))
  ap.add_argument("--exclude", default="", help="ops left out, comma-separated (e.g. rp,neg)")
  ap.add_argument("--only", default="", help="run these seeds only, comma-separated")
  ap.add_argument("--per-layer", action="store_true",
                  help="clip each parameter leaf to its own norm (a pytree of clip norms)")
  ap.add_argument("--known", action="store_true",
                  help="run the named known cases (tests/_dp_fuzz.py REGRESSIONS) instead")
  ap.add_argument("--fsdp-every", type=int, default=4,
                  help="every k-th case also runs under an FSDP placement (0: none)")
  ap.add_argument("--time-budget", type=float, default=0.0,
                  help="stop starting new cases after this many seconds (0: no limit)")
  args = ap.parse_args(argv)
  methods = tuple(m for m in args.methods.split(",") if m)
  exclude = tuple(o for o in args.exclude.split(",") if o)
  seeds: list = ([int(s) for s in args.only.split(",")] if args.only
                 else list(range(args.seed, args.seed + args.cases)))
  if args.known:
    seeds = sorted(_dp_fuzz.REGRESSIONS)
  reports: list[dict] = []
  fsdp_reports: list[dict] = []
  no_placement = 0
  start = time.time()
  out = Path(args.out)
  for k, seed in enumerate(seeds):
    if args.time_budget and time.time() - start > args.time_budget:
      print(f"time budget reached after {k} cases")
      break
    t = time.time()
    case = (_dp_fuzz.REGRESSIONS[seed]() if args.known
            else _dp_fuzz.generate(seed, exclude))
    report = _dp_fuzz.check(case, methods, per_layer=args.per_layer)
    report["seconds"] = round(time.time() - t, 2)
    reports.append(report)
    if _dp_fuzz.failures(report):
      print(_dp_fuzz.describe(report), flush=True)
    if args.fsdp_every and k % args.fsdp_every == 0:
      placement = PLACEMENTS[(k // args.fsdp_every) % len(PLACEMENTS)]
      rng = np.random.default_rng([args.seed, k])
      fsdp = _dp_fuzz.draw_fsdp(case, rng, placement)
      fsdp_report = (None if fsdp is None else
                     _dp_fuzz.check(case, methods, per_layer=args.per_layer, fsdp=fsdp))
      if fsdp_report is None or "skipped" in fsdp_report:
        no_placement += 1
      else:
        fsdp_reports.append(fsdp_report)
        if _dp_fuzz.failures(fsdp_report):
          print(_dp_fuzz.describe(fsdp_report), flush=True)
    if (k + 1) % 10 == 0:
      print(f"[{k + 1}/{len(seeds)} cases, {time.time() - start:.0f} s]", flush=True)
    summary = summarise(reports, methods)
    summary["fsdp"] = summarise_fsdp(fsdp_reports)
    out.write_text(json.dumps({"args": vars(args), "seconds": round(time.time() - start, 1),
                               "summary": summary, "cases": reports,
                               "fsdp_cases": fsdp_reports}, indent=1))
  summary = summarise(reports, methods)
  print_summary(summary)
  fsdp_summary = summarise_fsdp(fsdp_reports)
  fsdp_failed = sum(1 for r in fsdp_reports if _dp_fuzz.failures(r))
  if args.fsdp_every:
    print_fsdp(fsdp_summary, no_placement)
  print(f"{time.time() - start:.0f} s; report written to {out}")
  return 1 if summary["failed_cases"] or fsdp_failed else 0


if __name__ == "__main__":
  sys.exit(main())
