"""What ordering the padding last saves: a padded DP-SGD batch, all micro-batches or only k.

A gelu MLP classifier (64 -> 256 -> 256 -> 10), a batch of ``B = 256`` rows in ``N = 8``
micro-batches, each row real with probability ``p`` (the rest padding, masked out with
``clip_per_example(1.0, method, example_mask="mask")``). Two steps, each under one
``jax.jit``:

* ``all N``: the batch as it comes, every micro-batch run;
* ``padding last``: ``jaxaccum.dp.place_padding_last`` first (inside the same jit), then the
  step with ``active_micro_batches=k``, the micro-batches that hold a real row.

Both give the same clipped mean (the largest difference is reported). Timed round-robin in
this one process after a warm-up; medians. Results go to
``benchmarks/results/dp_padding.{json,md}``. ``BENCH_QUICK=1`` (or ``--quick``) runs fewer
repeats and the materialised method only at one fraction; ``--tiny`` (or ``BENCH_TINY=1``)
that one case on a batch of 32 rows, one repeat, results in a temporary folder.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
B, N, SIZES = 256, 8, (64, 256, 256, 10)


def _params(key):
  keys = jax.random.split(key, len(SIZES) - 1)
  return [(jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
          for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)]


def loss_fn(params, batch):
  x, y = batch
  h = x
  for w, b in params[:-1]:
    h = jax.nn.gelu(h @ w + b)
  w, b = params[-1]
  logits = h @ w + b
  return jnp.mean(jax.nn.logsumexp(logits, -1)
                  - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])


def _steps(method: str):
  clip = jaxaccum.dp.clip_per_example(1.0, method, example_mask="mask")
  grad = jaxaccum.grad(loss_fn, num_micro_batches=N, batch_argnames="mask",
                       per_example=clip)

  @jax.jit
  def all_n(params, batch, mask):
    return grad(params, batch, mask=mask)

  @jax.jit
  def padding_last(params, batch, mask):
    batch, mask, k = jaxaccum.dp.place_padding_last(batch, mask, num_micro_batches=N)
    return grad(params, batch, mask=mask, active_micro_batches=k)

  return {"all N": all_n, "padding last": padding_last}


def run(*, quick: bool, repeats: int | None = None, warmup: int | None = None,
        out_dir: pathlib.Path = RESULTS, batch: int = B) -> dict[str, Any]:
  repeats = repeats or (5 if quick else 15)
  warmup = warmup or 1
  params = _params(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (batch, SIZES[0]))
  y = jax.random.randint(jax.random.key(2), (batch,), 0, SIZES[-1])
  rng = np.random.default_rng(0)
  cases = [("materialize", 0.25)] if quick else [
      (m, p) for m in ("ghost", "materialize") for p in (0.25, 0.5, 0.9)]
  rows = []
  for method, p in cases:
    steps = _steps(method)
    mask = jnp.asarray(rng.random(batch) < p)
    outs = {name: _common.block(f(params, (x, y), mask)) for name, f in steps.items()}
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(outs["all N"]), jax.tree.leaves(outs["padding last"]), strict=True))
    times = _common.time_interleaved(
        {name: (lambda f=f, m=mask: _common.block(f(params, (x, y), m)))
         for name, f in steps.items()},
        repeats=repeats, warmup=warmup)
    real = int(mask.sum())
    med = {name: 1e3 * _common.median(t) for name, t in times.items()}
    rows.append({"method": method, "real_rows": real, "k": max(1, -(-real // (batch // N))),
                 "all_n_ms": med["all N"], "padding_last_ms": med["padding last"],
                 "ratio": med["padding last"] / med["all N"], "max_diff": diff})
  results = {"environment": _common.device_info(), "quick": quick, "repeats": repeats,
             "warmup": warmup, "batch": batch, "micro_batches": N, "rows": rows}
  _common.write_results(out_dir, "dp_padding", results, markdown)
  return results


def markdown(results: dict[str, Any]) -> str:
  env = results["environment"]
  lines = [f"# Padding placed last (jax {env.get('jax')}, {env.get('device_kind')}, "
           f"{env.get('host_cpus')} host CPUs, {env.get('date')})", "",
           f"Batch {results['batch']} in {results['micro_batches']} micro-batches; medians of "
           f"{results['repeats']} interleaved repeats.", "",
           "| method | real rows | k | all N (ms) | padding last (ms) | ratio | max diff |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for r in results["rows"]:
    lines.append(f"| {r['method']} | {r['real_rows']} | {r['k']} | {r['all_n_ms']:.1f} | "
                 f"{r['padding_last_ms']:.1f} | {r['ratio']:.2f} | {r['max_diff']:.1e} |")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
  _common.main(__doc__, run, markdown, quick_help="fewer repeats, one case",
               out_dir=RESULTS, tiny=lambda: {"batch": 32}, argv=argv)


if __name__ == "__main__":
  main()
