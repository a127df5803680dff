#!/usr/bin/env bash
# The check to run on a machine with a CUDA GPU (about 4 minutes on an H200, compilation
# included), as one script run from the repo root; results go to $OUT, or
# benchmarks/results/gpu without it. It uses the machine's own jax and CUDA: jaxaccum is
# installed without dependencies.
#   1. the core's numerical tests, on the GPU (skipped with a note if pytest is missing);
#   2. benchmarks/bench_gpu_lm.py at its GPU size (a 136M-parameter LM, batch 128 x 1024
#      tokens) within a time budget: every method side by side, the XLA GPU flags, and the
#      planner's prediction for the card present against the allocator's peak, with half as
#      many micro-batches tried last. The prediction is the committed plan for the card that
#      jax.devices()[0].device_kind names (benchmarks/results/gpu/plan_h100.json or
#      plan_h200.json, made on a CPU host; --prediction auto), or, for another card, one made
#      in process on the device.
# DRY_RUN=1: the same steps on this machine's CPU, as the test suite runs them
# (tests/planning/test_gpu_check.py): no install, no tests, bench_gpu_lm.py --tiny on a prediction
# made here first. PYTHON picks the interpreter (python by default).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
py="${PYTHON:-python}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "${DRY_RUN:-0}" = "1" ]; then
  export JAX_PLATFORMS=cpu
  "$py" benchmarks/bench_gpu_lm.py --tiny --predict \
    --out-dir "$out" >"$out/plan.txt" 2>&1 || { tail -20 "$out/plan.txt"; exit 1; }
  exec "$py" benchmarks/bench_gpu_lm.py --tiny --prediction "$out/plan_here_tiny.json" \
    --repeats 1 --warmup 0 --out-dir "$out"
fi
"$py" -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -2
"$py" -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/devices.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
  | tee -a "$out/devices.txt"
if "$py" -c "import pytest" 2>/dev/null; then
  # float32 tolerances of 1e-5 need full-precision matmuls (GPUs default to TF32).
  JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TESTS_TIMEOUT:-100}" \
    "$py" -m pytest -q -o addopts="-p no:cacheprovider" \
    tests/core/test_transform.py tests/core/test_weighted.py 2>&1 | tee "$out/tests.txt" | tail -3
else
  echo "pytest is not installed on this machine: tests not run" | tee "$out/tests.txt"
fi
timeout "${BENCH_TIMEOUT:-180}" "$py" benchmarks/bench_gpu_lm.py \
  --prediction auto --time-budget "${BENCH_BUDGET:-140}" \
  --out-dir "$out" 2>&1 | tee "$out/bench_gpu_lm.txt" | tail -40
