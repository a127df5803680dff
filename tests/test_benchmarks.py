"""The benchmarks and examples use only jaxaccum's public names, and every benchmark runs.

Nothing outside the package may import a private module or read a private attribute
(``jaxaccum._x``): such code breaks silently when the private code changes, as
``bench_gpu_target.py`` once did. The check reads the source with :mod:`ast`.

Every ``benchmarks/bench_*.py`` has a tiny mode (``--tiny`` or ``BENCH_TINY=1``: the smallest
problems, one timed repeat, results in a temporary folder); each is run here as a user runs
it, in a subprocess, so that a broken benchmark fails the suite. Those that compile for
described GPUs need the ``gpu-plan`` environment: ``tests_gpu_target/test_benchmarks.py``
runs their tiny modes. Every script must finish, write its results where the tiny mode says
and leave ``benchmarks/results`` alone; the results are read further (no timing is checked):
``bench_accumulation.py``'s report and plots, ``bench_features.py``'s first losses and
``bench_evaluate.py``'s values against hand references, ``bench_per_example.py``'s and
``bench_dp_padding.py``'s clipped gradients against each other, and the tables of
``bench_adaptive_grid.py`` and ``bench_seesaw.py``. ``bench_gpu_lm.py``'s tiny mode runs in
``tests/planning/test_gpu_check.py``, as the GPU check's dry run: its plan (``--predict``), then the
run on that plan.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from tests.test_examples import _is_png, _load

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
# The tiny run of each benchmark on this environment's CPU devices (script, extra arguments).
TINY = {
    "bench_accumulation.py": (),
    "bench_adaptive.py": (),
    "bench_adaptive_grid.py": (),
    "bench_adaptive_lm.py": (),
    "bench_coupled.py": (),
    "bench_dp_padding.py": (),
    "bench_evaluate.py": (),
    "bench_features.py": (),
    "bench_per_example.py": (),
    "bench_pipeline.py": (),
    "bench_seesaw.py": (),
    "bench_sharding.py": (),
}
# Compiled for described GPUs: run by tests_gpu_target/test_benchmarks.py.
GPU_TARGET_TINY = {"bench_gpu_target.py": (), "bench_overlap.py": (),
                   "bench_pipeline.py": ("--target-only",)}
# Run tiny by another test: the GPU check's dry run (tests/planning/test_gpu_check.py) runs
# bench_gpu_lm.py's --tiny --predict and then its run on that prediction.
RUN_ELSEWHERE = {"bench_gpu_lm.py": "tests/planning/test_gpu_check.py"}


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
      "import jaxaccum._planning._collectives as c": "jaxaccum._planning._collectives",
      "from jaxaccum._planning._plan import plan": "jaxaccum._planning._plan.plan",
      "import jaxaccum\nx = jaxaccum._planning._collectives._contexts":
          "jaxaccum._planning._collectives",
      "import jaxaccum as ja\nja._split.divisors(4)": "ja._split",
      "import jaxaccum\njaxaccum.planning.Collectives._parse":
          "jaxaccum.planning.Collectives._parse",
      "from jaxaccum import eqx\neqx._helper()": "eqx._helper",
      "import jaxaccum.linen as ln\nln._private": "ln._private",
  }
  for source, what in bad.items():
    found = private_uses(source)
    assert len(found) >= 1 and any(what in f for f in found), (source, found)
  good = ["import jaxaccum\njaxaccum.planning.collectives(f)\nprint(jaxaccum.__version__)",
          "from jaxaccum import eqx\nfrom jaxaccum.planning import Collectives\n"
          "Collectives.from_text('')",
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
  assert scripts == set(TINY) | set(GPU_TARGET_TINY) | set(RUN_ELSEWHERE), (
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


def _accumulation(out: pathlib.Path):
  """The report of the tiny run (the MLP at N = 1 and 2, batch 16): every method's row,
  memory statistics that add up, the targets' columns, the tables and both plots."""
  bench = _load("benchmarks/bench_accumulation.py")
  saved = json.loads((out / "accumulation.json").read_text())
  assert saved["environment"]["device_kind"] == jax.devices()[0].device_kind
  rows = saved["models"]["mlp"]["rows"]
  assert [r["n"] for r in rows] == [1, 2] and [r["micro_batch"] for r in rows] == [16, 8]
  for row in rows:
    assert set(row["methods"]) == set(bench.METHODS) | {bench.REFERENCE}
    for stats in row["methods"].values():
      assert stats["step_s"] > 0 and stats["temp"] >= 0 and stats["total"] > 0
      assert stats["total"] == pytest.approx(stats["argument"] + stats["output"]
                                             + stats["temp"] - stats["alias"])
  targets = saved["models"]["mlp"]["targets"]
  assert len(targets["per_n"]) == 2 and isinstance(targets["pass_compile_flat"], bool)
  for r in targets["per_n"]:
    assert (r["pass_vs_full"] is None) != (r["pass_vs_multisteps"] is None)
  md = (out / "accumulation.md").read_text()
  assert "| N | micro-batch |" in md and saved["environment"]["device_kind"] in md
  for name in ("accumulation_step_time.png", "accumulation_memory.png"):
    assert _is_png(out / name)


def _features(out: pathlib.Path):
  """Each variant's first loss (from the initial parameters of the tiny MLP) against a hand
  reference: the full batch, the first k micro-batches sliced by hand, the loss terms."""
  bench = _load("benchmarks/bench_features.py")
  acc = sys.modules["bench_accumulation"]
  cfg = acc.MLPConfig(batch=16, d_in=8, hidden=16, depth=1)  # the tiny mode's
  saved = json.loads((out / "features.json").read_text())
  assert saved["mlp"]["config"] == repr(cfg)
  assert set(saved["mlp"]["rows"]) == set(bench.VARIANTS)
  assert "| k = 2 / k = 8 |" in (out / "features.md").read_text()
  assert [r["variant"] for r in saved["mlp"]["ratios"]] == [r[0] for r in bench.RATIOS]
  loss_fn, params, batch = acc.mlp_problem(cfg)
  # The references jitted (one compile per shape instead of op by op); the micro-batches
  # sliced by hand on the host.
  loss_fn = jax.jit(loss_fn)
  terms_loss, single_loss = jax.jit(bench.terms_loss), jax.jit(bench.single_loss)
  batch = jax.tree.map(np.asarray, batch)
  n = bench.N
  micro = [jax.tree.map(lambda a, i=i: a[i::n], batch) for i in range(n)]
  full = float(loss_fn(params, batch))
  first = {name: row["first_loss"] for name, row in saved["mlp"]["rows"].items()}
  for name in ("plain", "with_info", "skip_nonfinite", "k = 8"):
    np.testing.assert_allclose(first[name], full, rtol=1e-5, err_msg=name)
  k_rows = jax.tree.map(lambda *a: np.concatenate(a), *micro[: bench.K_SMALL])
  np.testing.assert_allclose(first["k = 2"], float(loss_fn(params, k_rows)), rtol=1e-5)
  t = [terms_loss(params, m) for m in micro]
  w = bench.WEIGHTS
  whole = terms_loss(params, batch)
  three = (whole["ce"][0] / whole["ce"][1] + w["lb"] * np.mean([p["lb"] for p in t])
           + w["z"] * whole["z"])
  np.testing.assert_allclose(first["3 terms"], float(three), rtol=1e-5)
  one = sum(single_loss(params, m)[0] for m in micro) / cfg.batch
  np.testing.assert_allclose(first["1 term (weighted)"], float(one), rtol=1e-5)


def _per_example(out: pathlib.Path):
  """The tiny LM and CNN at b = 2: every variant ran, and every clipped variant computes the
  same clipped mean gradient as materialising the per-example gradients (entries of order
  0.1)."""
  bench = _load("benchmarks/bench_per_example.py")
  saved = json.loads((out / "per_example.json").read_text())
  assert saved["problems"]["lm"]["config"] == repr(
      bench.LMConfig(batch=4, seq=6, vocab=11, d_model=8, layers=1))
  rows = {(r["micro_batch_size"], r["variant"]): r for r in saved["problems"]["lm"]["rows"]}
  assert set(rows) == {(2, v) for v in bench.variants()}
  for key, row in rows.items():
    assert key[1] == "plain" or row["max_abs_diff_vs_materialize"] < 1e-6, (key, row)
  assert [r["micro_batch_size"] for r in saved["problems"]["lm"]["ratios"]] == [2] * (
      len(bench.variants()) - 1)
  assert "| 2 | 2 | ghost | " in (out / "per_example.md").read_text()
  cnn = {(r["micro_batch_size"], r["variant"]): r for r in saved["problems"]["cnn"]["rows"]}
  assert set(cnn) == {(2, v) for v in bench.variants()}
  for key, row in cnn.items():
    assert key[1] == "plain" or row["max_abs_diff_vs_materialize"] < 1e-6, (key, row)


def _evaluate(out: pathlib.Path):
  """The tiny MLP evaluated whole and in 4 micro-batches: each method's value against the
  full batch through the loss."""
  _load("benchmarks/bench_evaluate.py")
  acc = sys.modules["bench_accumulation"]
  cfg = acc.MLPConfig(batch=16, d_in=8, hidden=16, depth=1)  # the tiny mode's
  saved = json.loads((out / "evaluate.json").read_text())
  assert saved["mlp"]["config"] == repr(cfg) and saved["mlp"]["counts"] == [4]
  rows = saved["mlp"]["rows"]
  assert set(rows) == {"full", "jaxaccum.evaluate N=4", "optax.microbatch N=4"}
  loss_fn, params, batch = acc.mlp_problem(cfg)
  full = float(jax.jit(loss_fn)(params, batch))
  for name, row in rows.items():
    np.testing.assert_allclose(row["value"], full, rtol=1e-5, atol=1e-6, err_msg=name)
  assert "| jaxaccum.evaluate | 4 |" in (out / "evaluate.md").read_text()


def _coupled(out: pathlib.Path):
  """The tiny towers at N = 4: every method's row, and the cached program's and GradCache's
  loop's gradients equal to the full batch's."""
  saved = json.loads((out / "coupled.json").read_text())["clip"]
  assert set(saved["rows"]) == {"full", "loss alone", "cached N=4", "plain N=4", "forward N=4",
                                "gradcache N=4"}
  for name in ("cached N=4", "gradcache N=4"):
    assert saved["rows"][name]["grad_gap"] < 1e-5, (name, saved["rows"][name])
  assert saved["plain_clip_gap"]["4"] > 1e-2 and set(saved["goals"]) == {"4"}
  assert "| cached | 4 |" in (out / "coupled.md").read_text()


def _dp_padding(out: pathlib.Path):
  """The one tiny case (materialised clipping, 32 rows in 8 micro-batches): the padding placed
  last, over the first k micro-batches only, gives the clipped mean of all N."""
  saved = json.loads((out / "dp_padding.json").read_text())
  assert saved["batch"] == 32 and saved["micro_batches"] == 8 and saved["repeats"] == 1
  [row] = saved["rows"]
  assert row["method"] == "materialize" and 0 < row["real_rows"] <= 32
  assert row["k"] == max(1, -(-row["real_rows"] // 4)) and row["max_diff"] < 1e-6, row
  assert "| materialize | " in (out / "dp_padding.md").read_text()


def _adaptive_grid(out: pathlib.Path):
  """The tiny setting: the fixed sweep and the defaults' row, and its goal read off them."""
  bench = _load("benchmarks/bench_adaptive_grid.py")
  saved = json.loads((out / "adaptive_grid.json").read_text())
  assert saved["seeds"] == [0] and set(saved["settings"]) == set(saved["tables"])
  [(name, table)] = saved["tables"].items()
  assert set(table) == {f"fixed k={k}" for k in bench.ba.FIXED} | {"controller (defaults)"}
  g = saved["goals"][name]["controller (defaults)"]
  fixed = [r["steps"] for n, r in table.items() if n.startswith("fixed") and r["steps"]]
  assert g["best_steps"] == min(fixed)
  assert f"| {name} | " in (out / "adaptive_grid.md").read_text()


def _seesaw(out: pathlib.Path):
  """The tiny LM (cosine and Seesaw, one seed) and one regression, tables and plot."""
  saved = json.loads((out / "seesaw_tiny.json").read_text())
  assert saved["tiny"] is True and saved["seeds"] == [0]
  assert set(saved["lm"]["rows"]) == {"cosine", "seesaw"} and len(saved["linreg"]) == 1
  assert saved["lm"]["rows"]["cosine"]["steps_ratio"] == 1.0
  assert (out / "seesaw_tiny.md").read_text().startswith("# Seesaw")
  assert _is_png(out / "seesaw_tiny_lm.png")


CHECKS = {"bench_accumulation.py": _accumulation, "bench_adaptive_grid.py": _adaptive_grid,
          "bench_coupled.py": _coupled, "bench_dp_padding.py": _dp_padding,
          "bench_evaluate.py": _evaluate, "bench_features.py": _features,
          "bench_per_example.py": _per_example, "bench_seesaw.py": _seesaw}


@pytest.mark.parametrize("script", sorted(TINY))
def test_benchmark_tiny_mode_runs(script, tmp_path):
  out = run_tiny(script, TINY[script], tmp_path)
  if script in CHECKS:
    CHECKS[script](out)


def test_compare_revisions_pairs_leaves_by_path():
  compare = _load("benchmarks/compare_revisions.py")
  run = lambda t, m: {"models": {"mlp": {"rows": [  # noqa: E731
      {"n": 2, "methods": {"jaxaccum": {"step_s": t, "temp": m, "compile_s": 9.0}}},
      {"n": 4, "methods": {"jaxaccum": {"step_s": 2 * t, "temp": m}}}]}}}
  base = [run(1.0, 100), run(3.0, 100), run(2.0, 100)]
  head = [run(2.0, 50), run(2.0, 50), run(8.0, 50)]
  rows = {(r["where"], r["what"]): r for r in compare.compare(base, head)}
  assert set(rows) == {(f"models/mlp/rows/{i}/methods/jaxaccum", w)
                       for i in (0, 1) for w in ("step_s", "temp")}  # compile_s not paired
  r = rows[("models/mlp/rows/0/methods/jaxaccum", "step_s")]
  assert (r["base"], r["head"], r["ratio"]) == (2.0, 2.0, 1.0)  # medians, then the ratio
  assert rows[("models/mlp/rows/1/methods/jaxaccum", "temp")]["ratio"] == 0.5
