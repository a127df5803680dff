"""Test session setup, before jax is imported: 8 virtual CPU devices, and LLVM's lowest
optimisation level for the compiled programs.

The suite's time goes mostly to compiling hundreds of small programs, which compile faster at
``--xla_backend_optimization_level=0``: test_transform, test_multisteps and test_linen took
100 s at level 0 and 123 s at level 1 (``-n 2``, 2026-12-01, 2 cores). The loops XLA then
generates run slower, which only tests with long steps notice (the Flax CNN examples' tests:
71 s at level 0, 43 s at level 1). XLA's HLO passes, fusion and buffer assignment (which the
memory and collective tests read) do not depend on it; float results may differ from the
default level's in the last bits. Set either flag in ``XLA_FLAGS`` to override it.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in flags:
  flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags.strip()
