"""The GPU check's dry run on the CPU: ``benchmarks/gpu_check.sh`` with ``DRY_RUN=1``.

The check runs on a GPU only when one is lent; between loans this keeps its script and
``benchmarks/bench_gpu_lm.py`` from rotting: the same steps at the ``--tiny`` size, a
prediction made by ``--predict`` read back by the run, every method compiled, run and timed,
and the planner's comparison (predicted against measured peak, half as many micro-batches).
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu_lm  # noqa: E402


def test_dry_run_runs_every_method_and_checks_the_plan(tmp_path):
  env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), PYTHON=sys.executable,
             PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             # The plan's programs are the run's: compiled once for both processes.
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

  plan = json.loads((tmp_path / "plan_here_tiny.json").read_text())
  r = json.loads((tmp_path / "bench_gpu_lm_tiny.json").read_text())
  assert (tmp_path / "bench_gpu_lm_tiny.md").read_text().startswith("# The accumulated step")
  assert (tmp_path / "bench_gpu_lm_tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  n = plan["num_micro_batches"]
  assert n > 1 and r["num_micro_batches"] == n  # the run used the prediction's count
  cfg = bench_gpu_lm.TINY_CONFIG
  assert r["config"] == plan["config"] == dataclasses.asdict(cfg)
  expected = {f"jaxaccum N={k}" for k in (n, 2 * n, 4 * n)} | {
      f"micro-batch alone ({cfg.batch // n} seq)", f"optax.microbatch N={n}",
      f"optax.MultiSteps N={n}", f"naive loop N={n}", "full batch"} | {
      f"jaxaccum N={n} + {label}" for label in bench_gpu_lm.FLAGS}
  assert set(r["methods"]) == expected and not r["skipped"]
  tokens = cfg.batch * cfg.seq
  for name, m in r["methods"].items():
    assert m["step_s"] > 0 and m["memory"]["peak"] > 0, name
    assert m["tokens_per_s"] == pytest.approx(m["tokens_per_step"] / m["step_s"])
    assert m["mfu"] == pytest.approx(
        r["flops_per_token"] * m["tokens_per_step"] / m["step_s"] / 989e12)
    assert m["tokens_per_step"] == (tokens // n if name.startswith("micro-batch") else tokens)
  # The plan: its peak fits its budget, half as many micro-batches does not, and the step
  # compiled by the run (a CPU has no allocator statistics) has the predicted memory.
  assert plan["memory_budget_bytes"] == bench_gpu_lm.TINY_BUDGET
  assert plan["peak_bytes"] <= plan["memory_budget_bytes"] < plan["half"]["peak_bytes"]
  assert plan["half"]["num_micro_batches"] == n // 2
  check = r["plan_check"]
  assert check["measured_peak_bytes"] == pytest.approx(plan["peak_bytes"], rel=0.10)
  assert check["meets_goal"] and check["half"]["fits"] is False
  assert check["half"]["num_micro_batches"] == n // 2
  assert r["overhead"]["per_token_ratio"] > 0


@pytest.mark.parametrize("measured", [80.0, 91.0, 100.0, 109.0, 125.0])
def test_plan_check_against_a_measured_peak(measured):
  prediction = {"num_micro_batches": 4, "peak_bytes": 100.0, "device": "H200 (described)",
                "memory_budget_bytes": 120.0, "half": None}
  acc = {"device_peak_bytes": measured, "memory": {"peak": 1.0}}
  out = bench_gpu_lm.plan_check(bench_gpu_lm.TINY_CONFIG, prediction, acc, shared=None)
  assert out["measured_peak_bytes"] == measured  # the allocator's, not the compiled figure
  assert out["relative_error"] == pytest.approx((measured - 100.0) / measured)
  assert out["meets_goal"] == (abs(measured - 100.0) <= 0.10 * measured)


def test_a_prediction_for_another_size_is_refused():
  cfg = dataclasses.asdict(bench_gpu_lm.GPU_CONFIG)
  with pytest.raises(ValueError, match="the prediction is for"):
    bench_gpu_lm.run(tiny=True, prediction={"config": cfg}, repeats=1, warmup=0,
                     time_budget=1.0, peak_tflops=989.0)


def _fake_device(monkeypatch, stats):
  """The allocator statistics a GPU reports, in turn, in place of a CPU's none."""
  it = iter(stats)
  monkeypatch.setattr(bench_gpu_lm, "device_memory", lambda: next(it))


def test_first_call_reads_the_allocators_peak(monkeypatch):
  def stats(in_use, peak):
    return {"bytes_in_use": in_use, "peak_bytes_in_use": peak, "bytes_limit": 1000.0}

  calls = []
  m = bench_gpu_lm.Method("m", 1, 1, {"peak": 1.0}, 0.0, lambda: calls.append(1))
  _fake_device(monkeypatch, [stats(10.0, 50.0), stats(10.0, 80.0)])
  bench_gpu_lm.first_call(m)
  assert calls == [1] and m.result["device_peak_bytes"] == 80.0
  assert m.result["device_peak_raised"] and m.result["device_in_use_before"] == 10.0
  quiet = bench_gpu_lm.Method("q", 1, 1, {"peak": 1.0}, 0.0, lambda: None)
  _fake_device(monkeypatch, [stats(10.0, 80.0), stats(10.0, 80.0)])
  bench_gpu_lm.first_call(quiet)  # did not raise the peak: reported as "<=" the peak so far
  assert not quiet.result["device_peak_raised"]
  assert "<= " in bench_gpu_lm.markdown({
      "environment": {"device_kind": "d", "platform": "gpu", "jax": "x", "date": "y"},
      "num_params": 1, "config": {}, "repeats": 1, "warmup": 0, "peak_tflops": 989.0,
      "flops_per_token": 1.0, "skipped": [],
      "methods": {"q": {"n": 1, "tokens_per_step": 1, "compile_s": 0.0, "step_s": 1.0,
                        "tokens_per_s": 1.0, "mfu": 0.0, **quiet.result,
                        "memory": quiet.memory}},
      "plan_check": {"predicted_on": "p", "num_micro_batches": 1, "predicted_peak_bytes": 1,
                     "memory_budget_bytes": 1, "goal": 0.1}})


def test_half_as_many_out_of_memory_on_a_device(monkeypatch):
  """On a GPU the half count is run: an out-of-memory error is the answer "does not fit"."""
  cfg = bench_gpu_lm.TINY_CONFIG
  shared = bench_gpu_lm.Shared(cfg)

  def oom(compiled, tokens):
    def run():
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    return run

  monkeypatch.setattr(shared, "one_call", oom)
  monkeypatch.setattr(bench_gpu_lm, "device_memory", lambda: {
      "bytes_in_use": 0.0, "peak_bytes_in_use": 0.0, "bytes_limit": 1.0})
  prediction = {"num_micro_batches": 4, "peak_bytes": 100.0, "device": "H200 (described)",
                "memory_budget_bytes": 120.0,
                "half": {"num_micro_batches": 2, "peak_bytes": 200.0, "fits": False}}
  out = bench_gpu_lm.plan_check(cfg, prediction, {"device_peak_bytes": 105.0}, shared)
  assert out["half"]["fits"] is False and "RESOURCE_EXHAUSTED" in out["half"]["how"]
  assert out["half"]["compiled_peak_bytes"] > 0 and out["meets_goal"]


@pytest.mark.parametrize("kind, plan", [
    ("NVIDIA H100 80GB HBM3", "plan_h100.json"),  # the described H100 by name
    ("NVIDIA H100 PCIe", "plan_h100.json"),  # another H100: the same model's plan
    ("NVIDIA H200", "plan_h200.json"),
    ("NVIDIA H200 NVL", "plan_h200.json"),
    ("NVIDIA A100-SXM4-80GB", None),  # no committed plan: the run plans on the device
    ("cpu", None),
])
def test_the_check_takes_the_committed_plan_for_the_card_present(kind, plan):
  got = bench_gpu_lm.plan_for_device(kind)
  assert (got and got.name) == plan


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_each_committed_plan_is_for_the_run_and_fits_its_card(target):
  """The plans gpu_check.sh reads (--prediction auto) are for the GPU-size run, made for
  the card they name: the count fits the card's budget and half as many does not."""
  plan = json.loads((bench_gpu_lm.RESULTS / f"plan_{target}.json").read_text())
  assert plan["config"] == dataclasses.asdict(bench_gpu_lm.GPU_CONFIG)
  assert plan["target"] == target and target.upper() in plan["device"]
  assert plan["peak_bytes"] <= plan["memory_budget_bytes"] < plan["half"]["peak_bytes"]
  assert plan["half"]["num_micro_batches"] == plan["num_micro_batches"] // 2
  chosen = [c for c in plan["candidates"] if c["num_micro_batches"] == plan["num_micro_batches"]]
  assert chosen and chosen[0]["fits"] and chosen[0]["peak_bytes"] == plan["peak_bytes"]


def test_the_gpu_check_reads_the_plan_for_the_card_present():
  script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
  run_line = [ln for ln in script.splitlines() if "--prediction" in ln and "DRY" not in ln]
  assert any("--prediction auto" in ln for ln in run_line), run_line
  assert "plan_h200.json --time-budget" not in script
