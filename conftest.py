"""Test session setup, before jax is imported: 8 virtual CPU devices, and LLVM's
optimisation level 1 for the compiled programs.

The suite's time goes mostly to compiling hundreds of small programs. At
``--xla_backend_optimization_level=1`` they compile faster than at the default level, and
the loops XLA generates still run fast: at level 0 the Flax CNN examples' tests took 71 s,
at level 1 43 s, at the default level 48 s (2026-12-01, 2 cores). XLA's HLO passes,
fusion and buffer assignment (which the memory and collective tests read) do not depend on
it; float results may differ from the default level's in the last bits. Set either flag in
``XLA_FLAGS`` to override it.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in flags:
  flags += " --xla_backend_optimization_level=1"
os.environ["XLA_FLAGS"] = flags.strip()
