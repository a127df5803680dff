#!/usr/bin/env bash
# The check to run on a machine with a CUDA GPU, as one short script run from the repo root;
# results go to $OUT, or benchmarks/results/gpu without it.
# It uses the machine's own jax and CUDA: jaxaccum is installed without dependencies.
#   1. the core's numerical tests, on the GPU (skipped with a note if pytest is missing);
#   2. benchmarks/bench_accumulation.py, which names the device and picks GPU-sized models.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -2
python -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/devices.txt"
if python -c "import pytest" 2>/dev/null; then
  # float32 tolerances of 1e-5 need full-precision matmuls (GPUs default to TF32).
  JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 python -m pytest -q -x -o addopts="-p no:cacheprovider" \
    tests/test_transform.py tests/test_weighted.py 2>&1 | tee "$out/tests.txt" | tail -3
else
  echo "pytest is not installed on this machine: tests not run" | tee "$out/tests.txt"
fi
timeout "${BENCH_TIMEOUT:-300}" python benchmarks/bench_accumulation.py --out-dir "$out" \
  2>&1 | tail -40
