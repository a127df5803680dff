"""The tiny modes of the benchmarks that compile for described GPUs (``gpu-plan`` extra).

``tests/test_benchmarks.py`` runs the other benchmarks' tiny modes and lists these; here each
runs in a subprocess of this environment's Python, as ``make bench`` runs it, so that a
broken benchmark fails ``make test-gpu-target``.
"""

import sys

import pytest

from tests.test_benchmarks import GPU_TARGET_TINY, run_tiny


@pytest.mark.parametrize("script", sorted(GPU_TARGET_TINY))
def test_gpu_target_benchmark_tiny_mode_runs(script, tmp_path):
  run_tiny(script, GPU_TARGET_TINY[script], tmp_path, python=sys.executable, timeout=900)
