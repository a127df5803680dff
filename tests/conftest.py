"""The suite's compilation cache (the root ``conftest.py`` sets up the devices first).

Many tests compile a program that another test of the same worker compiled already (the same
loss on the same shapes, built anew). Each worker therefore keeps JAX's persistent
compilation cache in a directory of its own, empty at the start of the session and removed
after it, so that such a program is compiled once. One directory per worker means no two
processes write the same file. On test_transform, test_multisteps and test_linen (``-n 2``,
2026-12-03, 2 cores) this took the time from 145 s without the cache to 110 s with it.
Results do not change: a cached program is the same executable. ``JAXACCUM_TEST_NO_CACHE=1``
turns the cache off.
"""

import atexit
import os
import shutil
import tempfile

import jax

if not os.environ.get("JAXACCUM_TEST_NO_CACHE"):
  _worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  _cache = tempfile.mkdtemp(prefix=f"jaxaccum-tests-{_worker}-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
