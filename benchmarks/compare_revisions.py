"""One benchmark on two revisions of jaxaccum, side by side: is a change within noise?

``python benchmarks/compare_revisions.py --base REV [--rounds R] -- bench_x.py [args]``
checks ``REV`` out into a temporary folder and runs ``bench_x.py`` with its arguments
``R`` times from each tree (base, this tree, base, this tree, ...: interleaved, so that load
on the machine falls on both alike), each tree's script importing that tree's package. Every
run writes its JSON (``--out-dir``); the report pairs the two revisions' figures leaf by leaf:
step times (``step_s``) as the median over rounds of this tree over the base, and compiled
memory (``temp``, ``total``) as a ratio (a compiled size does not vary between runs). The
report goes to stdout and, with ``--out``, to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMES = ("step_s",)
SIZES = ("temp", "total")


def leaves(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, str, float]]:
  """``(path, key, value)`` for every number under a key in ``TIMES + SIZES``."""
  if isinstance(tree, dict):
    for key, value in tree.items():
      if key in TIMES + SIZES and isinstance(value, (int, float)):
        yield path, key, float(value)
      else:
        yield from leaves(value, path + (key,))
  elif isinstance(tree, list):
    for i, value in enumerate(tree):
      yield from leaves(value, path + (i,))


def compare(base_runs: list[Any], head_runs: list[Any]) -> list[dict[str, Any]]:
  """Pairs the runs' leaves: medians over the runs, and this tree's over the base's."""
  def collect(runs):
    out: dict[tuple, list[float]] = {}
    for run in runs:
      for path, key, value in leaves(run):
        out.setdefault(path + (key,), []).append(value)
    return out

  base, head = collect(base_runs), collect(head_runs)
  rows = []
  for where in sorted(set(base) & set(head), key=str):
    b, h = statistics.median(base[where]), statistics.median(head[where])
    rows.append({"where": "/".join(map(str, where[:-1])), "what": where[-1], "base": b,
                 "head": h, "ratio": h / b if b else (1.0 if h == b else float("inf"))})
  return rows


def _run(tree: pathlib.Path, script: str, args: list[str], out: pathlib.Path) -> Any:
  env = dict(os.environ, PYTHONPATH=str(tree))
  subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args, "--out-dir",
                  str(out)], env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
  (found,) = sorted(out.glob("*.json"))[:1]
  return json.loads(found.read_text())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--base", required=True, help="the revision to compare against")
  parser.add_argument("--rounds", type=int, default=2, help="runs per revision")
  parser.add_argument("--out", type=pathlib.Path, help="also write the report here (JSON)")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="-- bench_x.py [its arguments]")
  ns = parser.parse_args(argv)
  command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
  if not command:
    parser.error("give the benchmark after --, e.g. -- bench_accumulation.py --quick")
  script, args = command[0], command[1:]
  with tempfile.TemporaryDirectory(prefix="jaxaccum-compare-") as tmp:
    base = pathlib.Path(tmp) / "base"
    base.mkdir()
    archive = subprocess.run(["git", "archive", ns.base], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    runs: dict[str, list[Any]] = {"base": [], "head": []}
    for r in range(ns.rounds):
      for name, tree in (("base", base), ("head", ROOT)):
        out = pathlib.Path(tmp) / f"{name}-{r}"
        out.mkdir()
        runs[name].append(_run(tree, script, args, out))
  rows = compare(runs["base"], runs["head"])
  print(f"{script} {' '.join(args)}: this tree against {ns.base}, median of {ns.rounds} "
        "interleaved runs each")
  print(f"{'where':60s} {'what':7s} {'base':>12s} {'head':>12s} {'ratio':>7s}")
  for row in rows:
    print(f"{row['where'][:60]:60s} {row['what']:7s} {row['base']:12.6g} {row['head']:12.6g} "
          f"{row['ratio']:7.3f}")
  for what in TIMES + SIZES:
    ratios = [row["ratio"] for row in rows if row["what"] == what]
    if ratios:
      print(f"{what}: median ratio {statistics.median(ratios):.3f} over {len(ratios)} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
  if ns.out:
    ns.out.write_text(json.dumps({"base": ns.base, "command": command, "rounds": ns.rounds,
                                  "rows": rows}, indent=1))
  return rows


if __name__ == "__main__":
  main()
