"""What per-example clipping costs against plain accumulation, by method, on three models.

One optimizer step (gradients, then SGD) over the same batch, at micro-batch sizes ``b``,
on three problems:

* ``mlp``: the MLP classifier of ``bench_accumulation.py``;
* ``lm``: a causal transformer LM with tied input and output embeddings, LayerNorm and its
  layers in one ``lax.scan`` (stacked weights), whose dense layers hold most parameters;
* ``cnn``: a small CNN on 8x8 images, most of its parameters convolution kernels.

Variants, each over the whole batch in micro-batches of ``b`` rows:

* ``plain``: ``jaxaccum.value_and_grad(loss, micro_batch_size=b)``, no clipping;
* ``ghost``: the same with ``per_example=jaxaccum.dp.clip_per_example(1.0,
  method="ghost")``: each example's norm from the activations and output gradients of the
  layers that use each parameter, then the clipped sum from them (the MLP) or by one
  reweighted backward pass (the LM, whose layers sit in a scan);
* ``auto``: ``clip_per_example(1.0)``, the default: ghost norms, or materialising where
  they would save little (the CNN);
* ``materialize``: ``clip_per_example(1.0, method="materialize")``: each example's gradient
  formed under ``jax.vmap`` (``b`` times the parameters);
* ``optax.micro_grad``: ``optax.microbatching.micro_grad(loss, microbatch_size=b,
  transform_fn=<clip>)``;
* ``jax_privacy``: ``jax_privacy.clipping.clipped_grad(loss, l2_clip_norm=1.0,
  microbatch_size=b)``, only where ``jax_privacy`` imports (it is no dependency of
  jaxaccum: run this script from an environment that has it to get the column).

Every variant is compiled first (its temporary memory read from ``memory_analysis()``),
warmed up, then timed round-robin in this one process; medians and the ratios against
``plain`` at each size are reported, never asserted. Results go to
``benchmarks/results/per_example.{json,md}``. ``BENCH_QUICK=1`` (or ``--quick``) runs smaller
models with fewer repeats.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import bench_accumulation  # noqa: E402  (the MLP problem)

try:  # only for its column; never a dependency
  from jax_privacy import clipping as jp_clipping
except ImportError:  # pragma: no cover - depends on the environment
  jp_clipping = None

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CLIP = 1.0
VARIANTS = ("plain", "ghost", "auto", "materialize", "optax.micro_grad", "jax_privacy")


@dataclasses.dataclass(frozen=True)
class LMConfig:
  batch: int = 64
  seq: int = 64
  vocab: int = 256
  d_model: int = 128
  layers: int = 2


@functools.partial(jax.jit, static_argnums=(0, 1))
def _lm_init(cfg: LMConfig, seed: int):
  d, n = cfg.d_model, cfg.layers
  k = iter(jax.random.split(jax.random.key(seed), 8))

  def dense(key, *shape):
    return jax.random.normal(key, shape) / np.sqrt(shape[-2])

  params = {"embed": 0.02 * jax.random.normal(next(k), (cfg.vocab, d)),
            "norm": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "layers": {"norm1": jnp.ones((n, d)), "qkv": dense(next(k), n, d, 3 * d),
                       "out": dense(next(k), n, d, d), "norm2": jnp.ones((n, d)),
                       "up": dense(next(k), n, d, 4 * d), "up_b": jnp.zeros((n, 4 * d)),
                       "down": dense(next(k), n, 4 * d, d)}}
  tokens = jax.random.randint(next(k), (cfg.batch, cfg.seq), 0, cfg.vocab)
  return params, tokens


def _layer_norm(x, scale, bias=0.0):
  m = jnp.mean(x, axis=-1, keepdims=True)
  v = jnp.mean(jnp.square(x - m), axis=-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(v + 1e-6) * scale + bias


def lm_problem(cfg: LMConfig, seed: int = 0):
  """``(loss_fn, params, tokens)``: next-token cross-entropy, mean over rows and positions."""
  params, tokens = _lm_init(cfg, seed)

  def loss_fn(params, tokens):
    x, y = tokens[:, :-1], tokens[:, 1:]
    mask = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))  # causal
    h = jnp.take(params["embed"], x, axis=0)

    def block(h, w):
      q, k, v = jnp.split(_layer_norm(h, w["norm1"]) @ w["qkv"], 3, axis=-1)
      s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
      h = h + jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1) @ v @ w["out"]
      a = jax.nn.gelu(_layer_norm(h, w["norm2"]) @ w["up"] + w["up_b"])
      return h + a @ w["down"], None

    h, _ = jax.lax.scan(block, h, params["layers"])
    logits = _layer_norm(h, params["norm"]["scale"], params["norm"]["bias"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return loss_fn, params, tokens


@dataclasses.dataclass(frozen=True)
class CNNConfig:
  """A small CNN on 8x8 images (the size of scikit-learn's digits): two 3x3 convolutions
  and a dense head, most of its parameters convolution kernels."""
  batch: int = 256
  channels: int = 16


def cnn_problem(cfg: CNNConfig, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 5)
  c = cfg.channels
  params = {"k1": jax.random.normal(keys[0], (3, 3, 1, c)) / 3.0,
            "k2": jax.random.normal(keys[1], (3, 3, c, c)) / (3.0 * c ** 0.5),
            "w": jax.random.normal(keys[2], (4 * 4 * c, 10)) / (4 * c ** 0.5),
            "b": jnp.zeros((10,))}
  images = jax.random.normal(keys[3], (cfg.batch, 8, 8, 1))
  labels = jax.random.randint(keys[4], (cfg.batch,), 0, 10)

  def loss_fn(p, batch):
    x, y = batch
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, p["k1"], (1, 1), "SAME",
                                                 dimension_numbers=dn))
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["k2"], (2, 2), "SAME",
                                                 dimension_numbers=dn))
    logits = h.reshape(h.shape[0], -1) @ p["w"] + p["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return loss_fn, params, (images, labels)


def _clip_one(grads):  # one example's gradient to norm CLIP (optax.micro_grad's transform)
  norm = optax.tree.norm(grads)
  return jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / norm), grads)


def build_grad(loss_fn, size: int, batch_size: int, variant: str):
  """``(params, batch) -> mean clipped gradient`` (plain: the mean gradient)."""
  if variant in ("plain", "ghost", "auto", "materialize"):
    extra = ({} if variant == "plain" else
             {"per_example": jaxaccum.dp.clip_per_example(CLIP, method=variant)})
    grad_fn = jaxaccum.grad(loss_fn, micro_batch_size=size, **extra)
    return grad_fn
  if variant == "optax.micro_grad":
    fn = optax.microbatching.micro_grad(
        loss_fn, batch_argnums=1, microbatch_size=size, transform_fn=_clip_one,
        accumulator=optax.microbatching.AccumulationType.MEAN)
    return lambda params, batch: fn(params, batch)[0]
  assert jp_clipping is not None
  fn = jp_clipping.clipped_grad(loss_fn, l2_clip_norm=CLIP, batch_argnums=1,
                                microbatch_size=size, normalize_by=float(batch_size))
  return fn


def build_step(loss_fn, size: int, batch_size: int, variant: str,
               tx: optax.GradientTransformation):
  grad_fn = build_grad(loss_fn, size, batch_size, variant)

  def step(params, batch):
    grads = grad_fn(params, batch)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates), grads

  return step


def variants() -> tuple[str, ...]:
  return tuple(v for v in VARIANTS if v != "jax_privacy" or jp_clipping is not None)


def measure(problem, sizes: Sequence[int], *, repeats: int, warmup: int) -> dict[str, Any]:
  """Compiles, warms up and times every (size, variant), interleaved."""
  loss_fn, params, batch = problem
  batch_size = jax.tree.leaves(batch)[0].shape[0]
  tx = optax.sgd(1e-3)
  names = [(b, v) for b in sizes for v in variants()]
  compiled, stats, states = {}, {}, {}
  grads = {}
  for b, v in names:
    states[b, v] = params
    compiled[b, v], stats[b, v] = _common.compile_with_stats(
        _common.fresh_jit(build_step(loss_fn, b, batch_size, v, tx)), params, batch)
    # every clipped variant computes the same clipped mean gradient
    grads[b, v] = _common.block(compiled[b, v](params, batch))[1]

  def runner(key):
    def run():
      states[key] = _common.block(compiled[key](states[key], batch))[0]
    return run

  label = {key: f"b={key[0]} {key[1]}" for key in names}
  times = _common.time_interleaved({label[k]: runner(k) for k in names}, repeats=repeats,
                                   warmup=warmup)
  rows = []
  for b, v in names:
    t = times[label[b, v]]
    diff = (None if v == "plain" else max(
        float(jnp.max(jnp.abs(x - y))) for x, y in zip(
            jax.tree.leaves(grads[b, v]), jax.tree.leaves(grads[b, "materialize"]),
            strict=True)))
    rows.append({"micro_batch_size": b, "num_micro_batches": batch_size // b, "variant": v,
                 "step_s": _common.median(t), "min_s": min(t), "times_s": t,
                 "compile_s": stats[b, v]["compile_s"], "temp": stats[b, v]["temp"],
                 "max_abs_diff_vs_materialize": diff})
  by = {(r["micro_batch_size"], r["variant"]): r for r in rows}
  ratios = [{"micro_batch_size": b, "variant": v,
             "time": by[b, v]["step_s"] / by[b, "plain"]["step_s"],
             "temp": by[b, v]["temp"] / max(by[b, "plain"]["temp"], 1.0)}
            for b in sizes for v in variants() if v != "plain"]
  n_params = sum(x.size for x in jax.tree.leaves(params))
  return {"params": int(n_params), "batch": int(batch_size), "rows": rows, "ratios": ratios}


def markdown(results: dict[str, Any]) -> str:
  env = results["environment"]
  lines = [
      "# Per-example clipping against plain accumulation", "",
      f"{env['date']}, device `{env['device_kind']}` ({env['platform']}), host CPUs "
      f"{env['host_cpus']}, jax {env['jax']}, {'quick run' if results['quick'] else 'full run'}: "
      f"{results['repeats']} timed repeats after {results['warmup']} warm-up, interleaved, "
      f"medians. Clip norm {CLIP}; one SGD step over the batch. jax_privacy: "
      f"{results['jax_privacy'] or 'not installed (column skipped)'}.", ""]
  for name, m in results["problems"].items():
    lines += [f"## {name}: `{m['config']}` ({m['params']:,} parameters, batch {m['batch']})",
              "",
              "| b | N | variant | step (ms, median) | fastest (ms) | compile (s) | temp (MiB) "
              "| max abs diff vs materialize |",
              "|---:|---:|:---|---:|---:|---:|---:|---:|"]
    for r in m["rows"]:
      d = r["max_abs_diff_vs_materialize"]
      lines.append(
          f"| {r['micro_batch_size']} | {r['num_micro_batches']} | {r['variant']} | "
          f"{1e3 * r['step_s']:.2f} | {1e3 * r['min_s']:.2f} | {r['compile_s']:.2f} | "
          f"{r['temp'] / _common.MIB:.2f} | {'' if d is None else f'{d:.1e}'} |")
    lines += ["", "| b | variant | time / plain | temp / plain |", "|---:|:---|---:|---:|"]
    for r in m["ratios"]:
      lines.append(f"| {r['micro_batch_size']} | {r['variant']} | {r['time']:.2f} | "
                   f"{r['temp']:.2f} |")
    lines.append("")
  return "\n".join(lines)


def run(*, quick: bool, repeats: int | None = None, warmup: int | None = None,
        out_dir: pathlib.Path = RESULTS, configs: dict[str, Any] | None = None,
        sizes: dict[str, Sequence[int]] | None = None) -> dict[str, Any]:
  """Runs the benchmark and writes ``per_example.json`` and ``per_example.md``.

  ``configs``: the problems by name (``"mlp"``: a ``bench_accumulation.MLPConfig``, ``"lm"``:
  an :class:`LMConfig`); ``sizes``: the micro-batch sizes per problem.
  """
  env = _common.device_info()
  repeats = repeats or (7 if quick else 21)
  warmup = warmup or (2 if quick else 3)
  configs = configs or (
      {"mlp": bench_accumulation.MLPConfig(batch=256, d_in=128, hidden=256),
       "lm": LMConfig(batch=32, seq=33, d_model=128), "cnn": CNNConfig()} if quick else
      {"mlp": bench_accumulation.MLPConfig(batch=1024, d_in=256, hidden=512), "lm": LMConfig(),
       "cnn": CNNConfig(batch=1024)})
  sizes = sizes or ({"mlp": (8, 32), "lm": (4, 16), "cnn": (32, 128)} if quick
                    else {"mlp": (8, 32, 128), "lm": (4, 16, 64), "cnn": (32, 128, 512)})
  out: dict[str, Any] = {}
  for name, cfg in configs.items():
    problem = (bench_accumulation.mlp_problem(cfg) if name == "mlp" else
               cnn_problem(cfg) if name == "cnn" else lm_problem(cfg))
    out[name] = {"config": repr(cfg), **measure(problem, sizes[name], repeats=repeats,
                                                warmup=warmup)}
  jp = None
  if jp_clipping is not None:
    import jax_privacy  # noqa: PLC0415
    jp = f"jax_privacy {getattr(jax_privacy, '__version__', '?')}"
  results = {"environment": env, "quick": quick, "repeats": repeats, "warmup": warmup,
             "jax_privacy": jp, "problems": out}
  _common.write_results(out_dir, "per_example", results, markdown)
  return results


def main(argv: Sequence[str] | None = None) -> None:
  _common.main(__doc__, run, markdown, quick_help="smaller models, fewer repeats",
               out_dir=RESULTS, tiny=_tiny, argv=argv)


def _tiny() -> dict[str, Any]:
  """The tiny mode's problems (``--tiny``): the LM and the CNN at their smallest (the MLP
  runs the same code as the LM)."""
  return {"configs": {"lm": LMConfig(batch=4, seq=6, vocab=11, d_model=8, layers=1),
                      "cnn": CNNConfig(batch=4, channels=2)},
          "sizes": {"lm": (2,), "cnn": (2,)}}


if __name__ == "__main__":
  main()
