"""The benchmarks and examples use only jaxaccum's public names, and every benchmark runs.

Nothing outside the package may import a private module or read a private attribute
(``jaxaccum._x``): such code breaks silently when the private code changes, as
``bench_gpu_target.py`` once did. The check reads the source with :mod:`ast`.

Every ``benchmarks/bench_*.py`` has a tiny mode (``--tiny`` or ``BENCH_TINY=1``: the smallest
problems, one timed repeat, results in a temporary folder); each is run here as a user runs
it, in a subprocess, so that a broken benchmark fails the suite. Those that compile for
described GPUs need the ``gpu-plan`` environment: ``tests_gpu_target/test_benchmarks.py``
runs their tiny modes. No figure is checked, only that the script finishes, writes its
results where the tiny mode says, and leaves ``benchmarks/results`` alone.
"""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
# The tiny run of each benchmark on this environment's CPU devices (script, extra arguments).
TINY = {
    "bench_accumulation.py": (),
    "bench_adaptive.py": (),
    "bench_adaptive_lm.py": (),
    "bench_evaluate.py": (),
    "bench_features.py": (),
    "bench_per_example.py": (),
    "bench_pipeline.py": (),
    "bench_sharding.py": (),
}
# Compiled for described GPUs: run by tests_gpu_target/test_benchmarks.py.
GPU_TARGET_TINY = {"bench_gpu_target.py": (), "bench_overlap.py": (),
                   "bench_pipeline.py": ("--target-only",)}


def private_uses(source: str) -> list[str]:
  """Every import of a private jaxaccum module or name, and every private attribute read
  from jaxaccum (under any alias), in ``source``: ``"line: what"``."""
  tree = ast.parse(source)
  aliases = {"jaxaccum"}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      aliases |= {a.asname for a in node.names if a.name.startswith("jaxaccum") and a.asname}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxaccum"):
      aliases |= {a.asname or a.name for a in node.names if not _private(a.name)}
  found = []
  for node in ast.walk(tree):
    names: list[str] = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names if a.name.split(".")[0] == "jaxaccum"]
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jaxaccum":
      names = [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Attribute) and _private(node.attr):
      base = node.value
      while isinstance(base, ast.Attribute):
        base = base.value
      if isinstance(base, ast.Name) and base.id in aliases:
        names = [ast.unparse(node)]
    found += [f"{node.lineno}: {n}" for n in names if any(map(_private, n.split(".")))]
  return found


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_public_names_check_finds_every_form():
  """The checker itself, on sources that use private names in each way and on ones that
  do not (dunders such as ``__version__`` are public)."""
  bad = {
      "from jaxaccum import _collectives": "jaxaccum._collectives",
      "import jaxaccum._collectives as c": "jaxaccum._collectives",
      "from jaxaccum._plan import plan": "jaxaccum._plan.plan",
      "import jaxaccum\nx = jaxaccum._collectives._contexts": "jaxaccum._collectives",
      "import jaxaccum as ja\nja._split.divisors(4)": "ja._split",
      "import jaxaccum\njaxaccum.Collectives._parse": "jaxaccum.Collectives._parse",
      "from jaxaccum import eqx\neqx._helper()": "eqx._helper",
      "import jaxaccum.linen as ln\nln._private": "ln._private",
  }
  for source, what in bad.items():
    found = private_uses(source)
    assert len(found) >= 1 and any(what in f for f in found), (source, found)
  good = ["import jaxaccum\njaxaccum.collectives(f)\nprint(jaxaccum.__version__)",
          "from jaxaccum import eqx, Collectives\nCollectives.from_text('')",
          "import numpy as np\nnp._private_thing", "x = obj._cache  # not jaxaccum",
          "import jaxaccum.linen as ln\nln.value_and_grad"]
  for source in good:
    assert private_uses(source) == [], source


@pytest.mark.parametrize("path", sorted([*BENCHMARKS.glob("*.py"), *(ROOT / "examples").glob(
    "*.py")]), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_benchmarks_and_examples_use_only_public_names(path):
  found = private_uses(path.read_text())
  assert not found, (
      f"{path.relative_to(ROOT)} uses jaxaccum's private names: {found}. Use the public API "
      "(what jaxaccum/__init__.py exports), or add to it.")


def test_every_benchmark_has_a_tiny_check():
  scripts = {p.name for p in BENCHMARKS.glob("bench_*.py")}
  assert scripts == set(TINY) | set(GPU_TARGET_TINY), (
      "give each benchmark a tiny mode and list it in TINY (or GPU_TARGET_TINY)")


def run_tiny(script: str, extra: tuple, tmp_path: pathlib.Path, python: str = sys.executable,
             timeout: int = 600) -> pathlib.Path:
  """Runs ``script``'s tiny mode in a subprocess; returns the folder it wrote its results to
  (a temporary folder under ``tmp_path``), after checking that it holds them."""
  before = {p: p.stat().st_mtime_ns for p in RESULTS.rglob("*")}
  env = {**os.environ, "TMPDIR": str(tmp_path), "BENCH_TINY": "1",
         "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run([python, str(BENCHMARKS / script), "--tiny", *extra], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=timeout, check=False)
  tail = textwrap.indent((done.stdout + done.stderr)[-4000:], "  ")
  assert done.returncode == 0, f"{script} --tiny failed:\n{tail}"
  written = [p for p in tmp_path.glob("jaxaccum-bench-tiny-*") if p.is_dir()]
  assert len(written) == 1, (written, tail)
  files = {p.suffix for p in written[0].iterdir()}
  assert {".json", ".md"} <= files, (sorted(written[0].iterdir()), tail)
  assert {p: p.stat().st_mtime_ns for p in RESULTS.rglob("*")} == before, (
      f"{script} --tiny wrote into benchmarks/results")
  return written[0]


@pytest.mark.parametrize("script", sorted(TINY))
def test_benchmark_tiny_mode_runs(script, tmp_path):
  run_tiny(script, TINY[script], tmp_path)
