"""Test session setup, before jax is imported: 8 virtual CPU devices, and compiler settings
that make the suite's many small programs compile faster.

The suite's time goes mostly to compiling hundreds of small programs (in test_transform, 286
compilations of 62 ms on average were 18 of its 33 seconds). Two XLA flags cut that:

* ``--xla_backend_optimization_level=0`` (LLVM's lowest level): test_transform, test_multisteps
  and test_linen took 100 s at level 0 and 123 s at level 1 (``-n 2``, 2026-12-01, 2 cores).
  The loops XLA then generates run slower, which only tests with long steps notice.
* ``--xla_cpu_use_fusion_emitters=false`` on jaxlib 0.10 (XLA's older elemental emitters for
  CPU fusions; jaxlib 0.12 has only the fusion emitters and aborts on the flag, so it is set
  only where the installed jaxlib is a 0.10 release). A small accumulated step compiled in
  45 ms instead of 151 ms, test_transform ran in 16 s instead of 28 s, and the whole suite
  (``-n 2``, 2026-12-05, 2 idle cores) in 7 min 0 s instead of 12 min 25 s, with the same
  tests passing.

The first flag changes no HLO pass. The second changes which ops XLA fuses on the CPU, so a
compiled program's temporaries can differ from the default's by a few buffers (a small step's
temp was 5,760 bytes with the flag, 4,968 without): the memory and collective tests compare
programs compiled under the same flags, and ``make test-latest`` (jaxlib 0.12) runs every test
under the fusion emitters. Float results may differ from the defaults' in the last bits; every
test's reference is compiled under the same flags. Set either flag in ``XLA_FLAGS`` to override
it. Subprocesses that tests start (the benchmarks' tiny modes, the GPU check's dry run) inherit
the flags; the benchmarks run on their own use XLA's defaults.
"""

import os
from importlib import metadata


def _jaxlib_release() -> tuple[int, ...]:
  """The installed jaxlib's (major, minor), read without importing jax; () if unknown."""
  try:
    parts = metadata.version("jaxlib").split(".")[:2]
    return tuple(int(p) for p in parts)
  except (metadata.PackageNotFoundError, ValueError):
    return ()


os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in flags:
  flags += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in flags and _jaxlib_release() == (0, 10):
  flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = flags.strip()
