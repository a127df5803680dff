"""Shared benchmark helpers: compile with statistics, interleaved timing, the environment.

Every benchmark also has a tiny mode (``--tiny`` or ``BENCH_TINY=1``, :func:`add_tiny`):
the smallest problems, one timed repeat, its results written to a fresh temporary folder
(never over ``benchmarks/results``). It checks that the script runs end to end, not a
figure; ``tests/test_benchmarks.py`` (and ``tests_gpu_target/test_benchmarks.py`` for the
scripts that need the ``gpu-plan`` environment) run it.

Every benchmark compiles first (``.lower(...).compile()``, timed), warms up, then times
its methods round-robin in one process (repeat ``r`` visits the methods in an order
rotated by ``r``, so drift in the machine's load falls on all of them alike) and reports
medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

MIB = 2.0**20


def device_info() -> dict[str, Any]:
  """The device, host and library versions the numbers were taken on."""
  dev = jax.devices()[0]
  return {
      "device_kind": dev.device_kind,
      "platform": dev.platform,
      "num_devices": jax.device_count(),
      "host_cpus": os.cpu_count(),
      "host": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "date": datetime.date.today().isoformat(),
  }


def compile_with_stats(make_jitted: Callable[[], Any], *args: Any,
                       repeats: int = 1) -> tuple[Any, dict[str, float]]:
  """Lowers and compiles ``make_jitted()`` for ``args``; returns it and its statistics.

  ``make_jitted`` returns a fresh ``jax.jit`` of a fresh function object each time, so
  each of the ``repeats`` compilations misses JAX's caches; ``compile_s`` is the fastest
  (the least disturbed by other load on the machine), ``compile_s_all`` all of them. The
  memory statistics, in bytes from ``memory_analysis()``, are ``argument``, ``output``,
  ``alias``, ``temp`` and ``total = argument + output + temp - alias`` (what the
  executable needs at its peak, inputs and outputs included; donated inputs counted once).
  """
  times = []
  for _ in range(max(1, repeats)):
    fn = make_jitted()
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    times.append(time.perf_counter() - t0)
  stats: dict[str, Any] = {"compile_s": min(times), "compile_s_all": times}
  mem = compiled.memory_analysis()
  for key, attr in (("argument", "argument_size_in_bytes"), ("output", "output_size_in_bytes"),
                    ("alias", "alias_size_in_bytes"), ("temp", "temp_size_in_bytes")):
    stats[key] = float(getattr(mem, attr, 0) or 0) if mem is not None else float("nan")
  stats["total"] = stats["argument"] + stats["output"] + stats["temp"] - stats["alias"]
  return compiled, stats


def fresh_jit(fun: Callable[..., Any], **jit_kwargs: Any) -> Callable[[], Any]:
  """A factory of ``jax.jit(f)`` for a new wrapper ``f`` of ``fun`` each call (no cache hit)."""
  return lambda: jax.jit(lambda *args: fun(*args), **jit_kwargs)


def time_interleaved(
    runners: dict[str, Callable[[], Any]], *, repeats: int, warmup: int
) -> dict[str, list[float]]:
  """Times each zero-argument runner ``repeats`` times, round-robin, after ``warmup`` calls.

  Each runner does one step and blocks until its results are ready. Returns the list of
  wall times in seconds per runner.
  """
  names = list(runners)
  for _ in range(warmup):
    for name in names:
      runners[name]()
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(repeats):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      t0 = time.perf_counter()
      runners[name]()
      times[name].append(time.perf_counter() - t0)
  return times


def median(xs: Sequence[float]) -> float:
  """The median of a non-empty sequence (NaN when empty)."""
  return statistics.median(xs) if xs else float("nan")


def block(tree: Any) -> Any:
  """``jax.block_until_ready`` on a pytree; returns it."""
  return jax.block_until_ready(tree)


def write_results(out_dir: pathlib.Path, name: str, results: dict[str, Any],
                  markdown: Callable[[dict[str, Any]], str]) -> None:
  """Writes ``name.json`` (the figures) and ``name.md`` (their tables) into ``out_dir``."""
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1, default=float))
  (out_dir / f"{name}.md").write_text(markdown(results))


def tiny_from_env() -> bool:
  """Whether ``BENCH_TINY`` asks for the tiny mode (any value but empty or ``0``)."""
  return os.environ.get("BENCH_TINY", "") not in ("", "0")


def add_tiny(parser: argparse.ArgumentParser) -> None:
  """Adds ``--tiny`` (default: ``BENCH_TINY=1``) to a benchmark's command line."""
  parser.add_argument("--tiny", action="store_true", default=tiny_from_env(),
                      help="the smallest problems and one repeat, results in a temporary "
                      "folder: checks that the script runs (also BENCH_TINY=1)")


def out_dir_for(tiny: bool, out_dir: pathlib.Path | None, default: pathlib.Path
                ) -> pathlib.Path:
  """Where results go: ``out_dir`` if given, else a fresh temporary folder in the tiny
  mode (its figures mean nothing), else ``default``."""
  if out_dir is not None:
    return out_dir
  if tiny:
    return pathlib.Path(tempfile.mkdtemp(prefix="jaxaccum-bench-tiny-"))
  return default


def main(doc: str, run: Callable[..., dict[str, Any]], markdown: Callable[..., str], *,
         quick_help: str, out_dir: pathlib.Path, tiny: Callable[[], dict[str, Any]],
         argv: Sequence[str] | None = None) -> None:
  """The command line shared by the feature benchmarks: ``--quick`` (or ``BENCH_QUICK=1``),
  ``--tiny`` (or ``BENCH_TINY=1``), ``--repeats``, ``--warmup`` and ``--out-dir``; runs
  ``run`` and prints its tables. In the tiny mode ``run`` also gets ``tiny()``'s keyword
  arguments (the smallest problems)."""
  parser = argparse.ArgumentParser(description=doc.split("\n")[0])
  parser.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK")
                      == "1", help=f"{quick_help} (also BENCH_QUICK=1)")
  add_tiny(parser)
  parser.add_argument("--repeats", type=int)
  parser.add_argument("--warmup", type=int)
  parser.add_argument("--out-dir", type=pathlib.Path)
  args = parser.parse_args(argv)
  where = out_dir_for(args.tiny, args.out_dir, out_dir)
  results = run(quick=args.quick or args.tiny, repeats=1 if args.tiny else args.repeats,
                warmup=1 if args.tiny else args.warmup, out_dir=where,
                **(tiny() if args.tiny else {}))
  print(markdown(results))
  print(f"results in {where}")


def rms_norm(x, scale):
  """RMSNorm in float32, returned in ``x``'s dtype."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale).astype(x.dtype)


def scanned_lm_loss(params, tokens, heads: int):
  """Next-token cross-entropy of the decoder-only LM of the GPU benchmarks, its layers in
  one ``lax.scan`` over stacked weights (``params["layers"]``), computed in the parameters'
  dtype, logits in float32."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  b, t = inputs.shape
  d, h = params["embed"].shape[1], heads
  x = params["embed"][inputs] + params["pos"][:t]
  causal = jnp.tril(jnp.ones((t, t), bool))

  def layer(x, p):
    q, k, v = jnp.split(rms_norm(x, p["norm1"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / np.sqrt(d // h)
    a = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1).astype(x.dtype)
    x = x + jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, d) @ p["out"]
    x = x + jax.nn.gelu(rms_norm(x, p["norm2"]) @ p["up"]) @ p["down"]
    return x, None

  x, _ = jax.lax.scan(layer, x, params["layers"])
  logits = (rms_norm(x, params["norm_f"]) @ params["unembed"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
