"""A coupled loss under accumulation: ``jaxaccum.cached_value_and_grad`` against its alternatives.

A two-tower model (two MLPs of the same shape, an "image" and a "text" tower) trained with
CLIP's symmetric InfoNCE and a learned temperature, at one batch of ``B`` rows, four ways:

* ``full``: ``jax.value_and_grad`` of the loss on the whole batch (every activation live);
* ``cached``: ``jaxaccum.cached_value_and_grad(encode, clip_loss, num_micro_batches=N)``:
  the towers forward over ``N`` micro-batches, the loss once on the ``B`` embeddings, the
  towers again with their slice of the embeddings' cotangent, in one program;
* ``plain``: ``jaxaccum.value_and_grad`` of a per-example loss on the same towers (each
  row's two embeddings pulled together, no B x B logits): what plain accumulation costs
  on these towers, the baseline of the time and memory goals;
* ``gradcache``: GradCache's scheme as its PyTorch library runs it, written here: a jitted
  forward of a contiguous chunk, the loss's gradient with respect to the embeddings
  (jitted), and a jitted re-forward and VJP per chunk into an accumulator, with a Python
  loop over the ``N`` chunks (``2N + 1`` dispatches a step).

Besides, ``loss alone`` compiles the loss's value and gradient with respect to the
parameters and the embeddings on the ``B`` embeddings only (its B x B logits): the part of
the cached program's memory and time that belongs to the loss, not to the accumulation; and
``forward`` the cached program's first pass alone (``jaxaccum.evaluate`` of the towers):
the cached step should take plain accumulation's time plus these two.

For each ``N`` every method is compiled (``memory_analysis()``: temporaries; for
``gradcache`` the largest of its three programs), its gradient compared with the full
batch's, and all of them timed round-robin in this one process (:mod:`_common`); medians are
reported, never asserted. ``plain CLIP gap`` is the relative L2 difference between the full
batch's gradient and that of ``jaxaccum.value_and_grad`` applied to the CLIP loss itself (each
micro-batch's InfoNCE against its own rows): what plain accumulation computes instead. Results
go to ``benchmarks/results/coupled.{json,md}``; ``--quick`` takes fewer repeats.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
METHODS = ("cached", "plain", "gradcache")


@dataclasses.dataclass(frozen=True)
class Config:
  batch: int = 1024
  d_in: int = 256
  hidden: int = 512
  layers: int = 3  # hidden layers per tower
  dim: int = 128  # the embedding


def init(cfg: Config, key: jax.Array) -> dict[str, Any]:
  def tower(k):
    ks = jax.random.split(k, cfg.layers + 1)
    sizes = [cfg.d_in] + [cfg.hidden] * cfg.layers + [cfg.dim]
    return [{"w": jax.random.normal(kk, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for kk, a, b in zip(ks, sizes[:-1], sizes[1:], strict=True)]
  ki, kt = jax.random.split(key)
  return {"img": tower(ki), "txt": tower(kt), "log_t": jnp.asarray(np.log(10.0), jnp.float32)}


def encode(params: dict, batch: dict) -> dict[str, jax.Array]:
  def tower(layers, x):
    for layer in layers[:-1]:
      x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    z = x @ layers[-1]["w"] + layers[-1]["b"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)
  return {"img": tower(params["img"], batch["img"]), "txt": tower(params["txt"], batch["txt"])}


def clip_loss(params: dict, reps: dict, batch: dict) -> jax.Array:
  del batch
  logits = jnp.exp(params["log_t"]) * reps["img"] @ reps["txt"].T
  diag = jnp.diagonal(logits)
  return (jnp.mean(jax.nn.logsumexp(logits, axis=1) - diag)
          + jnp.mean(jax.nn.logsumexp(logits, axis=0) - diag)) / 2


def whole_loss(params: dict, batch: dict) -> jax.Array:
  return clip_loss(params, encode(params, batch), batch)


def per_example_loss(params: dict, batch: dict) -> jax.Array:
  """A loss on the same towers that is a mean over rows: each row's two embeddings."""
  reps = encode(params, batch)
  return jnp.mean(jnp.sum((reps["img"] - reps["txt"]) ** 2, axis=-1)) * jnp.exp(
      params["log_t"])


def problem(cfg: Config, seed: int = 0) -> tuple[dict, dict]:
  kp, ki, kt = jax.random.split(jax.random.key(seed), 3)
  batch = {"img": jax.random.normal(ki, (cfg.batch, cfg.d_in)),
           "txt": jax.random.normal(kt, (cfg.batch, cfg.d_in))}
  return init(cfg, kp), batch


def gradcache(n: int) -> tuple[Callable[..., Any], list[Any]]:
  """GradCache's step, as the PyTorch library runs it: a Python loop over ``n`` contiguous
  chunks around jitted pieces. Returns the step and its jitted pieces (for their memory)."""
  forward = jax.jit(encode)
  loss_grad = jax.jit(jax.value_and_grad(clip_loss, argnums=(0, 1)))

  @jax.jit
  def chunk_grad(params, chunk, cotangent, acc):
    _, vjp = jax.vjp(lambda p: encode(p, chunk), params)
    (g,) = vjp(cotangent)
    return jax.tree.map(jnp.add, acc, g)

  def step(params, batch):
    b = jax.tree.leaves(batch)[0].shape[0] // n
    chunks = [jax.tree.map(lambda x, i=i: x[i * b:(i + 1) * b], batch) for i in range(n)]
    reps = [forward(params, c) for c in chunks]
    whole = jax.tree.map(lambda *r: jnp.concatenate(r), *reps)
    loss, (grads, cot) = loss_grad(params, whole, batch)
    for i, c in enumerate(chunks):
      grads = chunk_grad(params, c, jax.tree.map(lambda x, i=i: x[i * b:(i + 1) * b], cot),
                         grads)
    return loss, grads

  return step, [forward, loss_grad, chunk_grad]


def _gradcache_temp(pieces: list[Any], params: dict, batch: dict, n: int) -> float:
  """The largest temporaries of GradCache's three programs (each compiled for its inputs)."""
  forward, loss_grad, chunk_grad = pieces
  b = batch["img"].shape[0] // n
  chunk = jax.tree.map(lambda x: x[:b], batch)
  reps = jax.eval_shape(encode, params, batch)
  temps = [forward.lower(params, chunk).compile().memory_analysis().temp_size_in_bytes,
           loss_grad.lower(params, reps, batch).compile().memory_analysis().temp_size_in_bytes,
           chunk_grad.lower(params, chunk, jax.tree.map(lambda r: r[:b], encode(params, chunk)),
                            params).compile().memory_analysis().temp_size_in_bytes]
  return float(max(temps))


def _rel(a: Any, b: Any) -> float:
  diff = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  size = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
  return float(np.sqrt(diff / size))


def measure(cfg: Config, counts: Sequence[int], *, repeats: int, warmup: int,
            gap_counts: Sequence[int]) -> dict[str, Any]:
  """Compiles every method at every ``N``, checks its gradient, then times them interleaved."""
  params, batch = problem(cfg)
  runners: dict[str, Callable[[], Any]] = {}
  rows: dict[str, dict[str, Any]] = {}
  compiled, stats = _common.compile_with_stats(
      _common.fresh_jit(jax.value_and_grad(whole_loss)), params, batch)
  ref = _common.block(compiled(params, batch))
  runners["full"] = lambda c=compiled: _common.block(c(params, batch))
  rows["full"] = {"temp": stats["temp"], "compile_s": stats["compile_s"], "grad_gap": 0.0}
  reps = jax.jit(encode)(params, batch)
  alone, st = _common.compile_with_stats(
      _common.fresh_jit(jax.value_and_grad(clip_loss, argnums=(0, 1))), params, reps, batch)
  loss_temp = st["temp"]
  runners["loss alone"] = lambda: _common.block(alone(params, reps, batch))
  rows["loss alone"] = {"temp": loss_temp, "compile_s": st["compile_s"], "grad_gap": None}
  for n in counts:
    funs = {"cached": jaxaccum.cached_value_and_grad(encode, clip_loss, num_micro_batches=n),
            "plain": jaxaccum.value_and_grad(per_example_loss, num_micro_batches=n),
            # the cached program's first pass alone: the towers forward, reps in batch order
            "forward": jaxaccum.evaluate(lambda p, b: (jnp.zeros(()), encode(p, b)),
                                         num_micro_batches=n, has_aux=True,
                                         aux_reduce="concat")}
    for name, fun in funs.items():
      c, st = _common.compile_with_stats(_common.fresh_jit(fun), params, batch)
      out = _common.block(c(params, batch))
      runners[f"{name} N={n}"] = lambda c=c: _common.block(c(params, batch))
      rows[f"{name} N={n}"] = {"temp": st["temp"], "compile_s": st["compile_s"],
                               "grad_gap": _rel(out[1], ref[1]) if name == "cached" else None}
    step, pieces = gradcache(n)
    out = _common.block(step(params, batch))
    runners[f"gradcache N={n}"] = lambda s=step: _common.block(s(params, batch))
    rows[f"gradcache N={n}"] = {"temp": _gradcache_temp(pieces, params, batch, n),
                                "compile_s": None, "grad_gap": _rel(out[1], ref[1])}
  plain_gap = {}
  for n in gap_counts:
    vg = jax.jit(jaxaccum.value_and_grad(whole_loss, num_micro_batches=n))
    plain_gap[n] = _rel(vg(params, batch)[1], ref[1])
  times = _common.time_interleaved(runners, repeats=repeats, warmup=warmup)
  for key, row in rows.items():
    row.update(step_s=_common.median(times[key]), min_s=min(times[key]), times_s=times[key])
  return {"config": repr(cfg), "counts": list(counts), "rows": rows, "loss_alone_temp": loss_temp,
          "plain_clip_gap": plain_gap, "goals": goals(rows, loss_temp, counts)}


def goals(rows: dict, loss_temp: float, counts: Sequence[int]) -> dict[str, Any]:
  """The issue's goals, per ``N``: the cached program's temporaries against the full batch's
  (<= 0.5x at N = 16) and against plain accumulation's plus the loss's own; its time against
  plain accumulation's (<= 1.5x) and GradCache's loop's (faster)."""
  out = {}
  for n in counts:
    c, p, g = rows[f"cached N={n}"], rows[f"plain N={n}"], rows[f"gradcache N={n}"]
    out[n] = {"temp_vs_full": c["temp"] / rows["full"]["temp"],
              "temp_minus_plain_and_loss_MiB": (c["temp"] - p["temp"] - loss_temp) / _common.MIB,
              "temp_within_plain_plus_loss": c["temp"] <= p["temp"] + loss_temp,
              "time_vs_plain": c["step_s"] / p["step_s"],
              # the time the three passes' parts add up to, over plain accumulation's
              "parts_vs_plain": (p["step_s"] + rows[f"forward N={n}"]["step_s"]
                                 + rows["loss alone"]["step_s"]) / p["step_s"],
              "time_vs_gradcache": c["step_s"] / g["step_s"]}
  return out


def markdown(results: dict[str, Any]) -> str:
  env, m = results["environment"], results["clip"]
  full = m["rows"]["full"]
  lines = [
      "# A coupled loss under accumulation: cached_value_and_grad, plain accumulation, "
      "GradCache's loop, the full batch", "",
      f"{env['date']}, device `{env['device_kind']}` ({env['platform']}), host CPUs "
      f"{env['host_cpus']}, jax {env['jax']}, {'quick run' if results['quick'] else 'full run'}: "
      f"{results['repeats']} timed repeats after {results['warmup']} warm-up, interleaved, "
      "medians.", "",
      f"Two towers `{m['config']}`, CLIP's symmetric InfoNCE with a learned temperature. "
      f"`loss alone` (the loss's value and gradient on the B embeddings, compiled alone): "
      f"{m['loss_alone_temp'] / _common.MIB:.2f} MiB of temporaries.", "",
      "| method | N | time (ms, median) | fastest (ms) | time / full | temp (MiB) | "
      "temp / full | compile (s) | gradient vs full |",
      "|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for key, row in m["rows"].items():
    name, _, n = key.partition(" N=")
    gap = "-" if row["grad_gap"] is None else f"{row['grad_gap']:.1e}"
    comp = "-" if row["compile_s"] is None else f"{row['compile_s']:.2f}"
    lines.append(
        f"| {name} | {n or '-'} | {1e3 * row['step_s']:.2f} | {1e3 * row['min_s']:.2f} | "
        f"{row['step_s'] / full['step_s']:.2f} | {row['temp'] / _common.MIB:.2f} | "
        f"{row['temp'] / full['temp']:.3f} | {comp} | {gap} |")
  lines += ["", "`plain` is a per-example loss on the same towers (no gradient to compare); "
            "`forward` is the cached program's first pass alone (`jaxaccum.evaluate` of the "
            "towers, reps in batch order) and `loss alone` the loss's value and gradient on the "
            "B embeddings: the cached step should cost plain + forward + loss alone. "
            "`gradcache`'s temp is the largest of its three programs'.", "",
            "| N | cached temp / full | cached temp - (plain + loss alone) (MiB) | "
            "cached time / plain | (plain + forward + loss alone) / plain | "
            "cached time / gradcache |", "|---:|---:|---:|---:|---:|---:|"]
  for n, g in m["goals"].items():
    lines.append(f"| {n} | {g['temp_vs_full']:.3f} | {g['temp_minus_plain_and_loss_MiB']:+.2f} | "
                 f"{g['time_vs_plain']:.2f} | {g['parts_vs_plain']:.2f} | "
                 f"{g['time_vs_gradcache']:.2f} |")
  gaps = ", ".join(f"N = {n}: {v:.3f}" for n, v in m["plain_clip_gap"].items())
  lines += ["", "What plain accumulation of the CLIP loss computes instead (relative L2 "
            f"difference of its gradient from the full batch's): {gaps}.", ""]
  return "\n".join(lines)


def run(*, quick: bool, repeats: int | None = None, warmup: int | None = None,
        cfg: Config | None = None, counts: Sequence[int] | None = None,
        gap_counts: Sequence[int] | None = None,
        out_dir: pathlib.Path = RESULTS) -> dict[str, Any]:
  """Runs the benchmark and writes ``coupled.json`` and ``coupled.md``."""
  env = _common.device_info()
  repeats = repeats or (7 if quick else 31)
  warmup = warmup or 2
  cfg = cfg or Config()
  counts = counts or (4, 16, 64)
  gap_counts = gap_counts or (4, 8, 16, 64)
  results = {"environment": env, "quick": quick, "repeats": repeats, "warmup": warmup,
             "clip": measure(cfg, counts, repeats=repeats, warmup=warmup,
                             gap_counts=gap_counts)}
  _common.write_results(out_dir, "coupled", results, markdown)
  return results


def main(argv: Sequence[str] | None = None) -> None:
  _common.main(__doc__, run, markdown, quick_help="fewer repeats", out_dir=RESULTS,
               tiny=lambda: {"cfg": Config(batch=16, d_in=8, hidden=16, layers=1, dim=4),
                             "counts": (4,), "gap_counts": (4,)}, argv=argv)


if __name__ == "__main__":
  main()
