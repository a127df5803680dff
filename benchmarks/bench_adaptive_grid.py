"""``jaxaccum.contrib.AdaptiveBatch``'s defaults on a grid of settings they were not chosen on.

The problem, the fixed sweep and the goal are those of ``bench_adaptive.py`` (noisy linear
regression, plain SGD at a fixed learning rate, ``N = 64`` micro-batches of 4 rows, steps
and samples to a target excess risk, medians over seeds), on a grid: dimension ``d`` in
{16, 256}, label noise ``sigma`` in {0.5, 2}, and two learning rates per dimension (SGD's
stability limit at ``B`` rows is roughly ``2B / (B + d + 1)``: at ``k = 8``, 1.3 for
``d = 16`` and 0.22 for ``d = 256``). Each target is
1.5x the SGD noise floor of ``k = 8`` (32 rows) at that setting, ``lr sigma**2 d / 128``:
the smallest batches cannot reach it, large ones reach it in the fewest steps. Compared:
the controller at its defaults and at the settings the adaptive-batch guide recommends per
regime. Results go to ``benchmarks/results/adaptive_grid.{json,md}``. ``BENCH_QUICK=1``
(or ``--quick``) runs one seed on the two settings of ``d = 16`` at the smaller rate and
writes nothing. ``--tiny`` (or ``BENCH_TINY=1``): one seed, one small setting with a near
target, the defaults only, results in a temporary folder (``--out-dir`` picks another).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_adaptive as ba  # noqa: E402

import jaxaccum  # noqa: E402


def settings(quick: bool) -> dict[str, dict[str, Any]]:
  out = {}
  for d, rates in ((16, (0.02, 0.1)), (256, (0.005, 0.02))):
    for sigma in (0.5, 2.0):
      for lr in rates:
        if quick and (d != 16 or lr != rates[0]):
          continue
        floor8 = lr * sigma**2 * d / (4 * 32)  # SGD's excess-risk floor at 32 rows
        out[f"d={d} sigma={sigma} lr={lr}"] = dict(
            d=d, sigma=sigma, lr=lr, target=1.5 * floor8,
            max_steps=4000 if lr * d <= 1.6 else 3000)
  return out


def controllers() -> dict[str, jaxaccum.contrib.AdaptiveBatch]:
  default = jaxaccum.contrib.AdaptiveBatch(ba.N)
  fast = dict(warmup_steps=2, cooldown_steps=2)
  return {
      "controller (defaults)": default,
      "theta=1.5": dataclasses.replace(default, theta=1.5),
      "theta=5": dataclasses.replace(default, theta=5.0),
      "theta=8": dataclasses.replace(default, theta=8.0),
      "b_simple fraction=1": jaxaccum.contrib.AdaptiveBatch(ba.N, rule="b_simple", fraction=1.0),
      "warmup 2, cooldown 2": dataclasses.replace(default, **fast),
      "theta=1.5, warmup 2, cooldown 2": dataclasses.replace(default, theta=1.5, **fast),
      "theta=1, warmup 2, cooldown 2": dataclasses.replace(default, theta=1.0, **fast),
  }


def write_markdown(out: dict[str, Any], path: pathlib.Path) -> None:
  env = out["env"]
  names = list(next(iter(out["goals"].values())))  # the controllers run
  lines = [
      "# AdaptiveBatch on a grid of linear-regression settings",
      "",
      f"Measured {env['date']} on a {env['host_cpus']}-core CPU container, jax {env['jax']}, "
      f"by `benchmarks/bench_adaptive_grid.py`: medians over {len(out['seeds'])} seeds of "
      "the steps and samples (rows) to the target, as ratios to the fewest steps and the "
      "fewest samples of any fixed k = 1 ... 64 (goal: within 1.25x and 1.5x, both).",
      "",
      "| setting | fewest steps (fixed) | fewest samples (fixed) | "
      + " | ".join(names) + " |",
      "|---|---|---|" + "---|" * len(names),
  ]
  for sname in out["tables"]:
    goals = out["goals"][sname]
    g0 = goals[names[0]]
    cells = []
    for n in names:
      g = goals[n]
      if g["steps_ratio"] is None:
        cells.append("not reached")
        continue
      mark = " **met**" if g["met"] else ""
      cells.append(f"{g['steps_ratio']:.2f}x, {g['samples_ratio']:.2f}x{mark}")
    lines.append(f"| {sname} | {g0['best_steps']:,.0f} | {g0['best_samples']:,.0f} | "
                 + " | ".join(cells) + " |")
  met = {n: sum(out["goals"][s][n]["met"] for s in out["tables"]) for n in names}
  lines += ["", "Settings where the goal was met, of " + str(len(out["tables"])) + ": "
            + ", ".join(f"{n} {m}" for n, m in met.items()) + ".", ""]
  path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK")
                      == "1", help="one seed, two settings, nothing written (also BENCH_QUICK=1)")
  ba._common.add_tiny(parser)
  parser.add_argument("--out-dir", type=pathlib.Path)
  args = parser.parse_args(argv)
  quick, tiny = args.quick, args.tiny
  seeds = [0] if quick or tiny else [0, 1, 2]
  grid, ctrls = settings(quick), controllers()
  if tiny:
    grid = {"d=8 sigma=1.0 lr=0.05": dict(d=8, sigma=1.0, lr=0.05, target=1.0, max_steps=50)}
    ctrls = {"controller (defaults)": ctrls["controller (defaults)"]}
  out: dict[str, Any] = {"env": ba._common.device_info(), "settings": grid, "seeds": seeds,
                         "tables": {}, "goals": {}}
  t0 = time.perf_counter()
  for sname, setting in grid.items():
    table = ba.sweep(setting, ctrls, seeds)
    out["tables"][sname] = table
    out["goals"][sname] = {n: ba.goal(table, n) for n in ctrls}
    g = out["goals"][sname]["controller (defaults)"]
    print(f"{sname}: defaults {g['steps_ratio']}, {g['samples_ratio']}, met={g['met']} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
  out["seconds"] = time.perf_counter() - t0
  if quick and not tiny:
    return  # a smoke run: the committed results are the full grid's
  where = ba._common.out_dir_for(tiny, args.out_dir, ba.RESULTS)
  where.mkdir(parents=True, exist_ok=True)
  (where / "adaptive_grid.json").write_text(json.dumps(out, indent=1))
  write_markdown(out, where / "adaptive_grid.md")
  print(f"results in {where}")


if __name__ == "__main__":
  main()
