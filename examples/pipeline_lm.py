"""A transformer LM whose blocks run as a GPipe pipeline over 4 stages, with accumulation on top.

8 virtual CPU devices form a ``data 2 x stage 4`` mesh. The model's blocks are stacked
``(stages, blocks_per_stage, ...)``; stage ``s`` lives on the ``s``-th device along
``stage`` and :func:`jaxaccum.contrib.pipeline` streams micro-batches through them. The embedding,
the head and the token-weighted loss stay outside the pipeline, under
:func:`jaxaccum.value_and_grad` with ``reduce="weighted"`` and ``data_axis="data"``: each
optimizer step accumulates ``num_micro_batches`` micro-batches per data shard, each of
which the pipeline splits again into ``pipeline_micro_batches``.

The same model, from the same initialisation and on the same batches, is also trained
unpipelined (the blocks applied one after the other, the whole batch through
:func:`jax.value_and_grad` on one device). The two loss curves coincide up to float32
round-off; the PNG under ``examples/out/`` shows both and their relative distance.

The corpus is the Python standard library's source code (as in ``examples/char_lm.py``),
sequences of random length right-padded, so micro-batches hold different token counts.

  python examples/pipeline_lm.py            # 300 steps, a few minutes on a laptop CPU
  python examples/pipeline_lm.py --tiny     # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import sys
import time
from typing import Any

if __name__ == "__main__":  # 8 virtual CPU devices, set before jax starts
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import char_lm  # noqa: E402  (the sibling example)

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
VOCAB, PAD, UNK = char_lm.VOCAB, char_lm.PAD, char_lm.UNK


@dataclasses.dataclass(frozen=True)
class Config:
  """What to train; the defaults take a few minutes on a laptop CPU."""

  steps: int = 300
  batch_size: int = 32
  num_micro_batches: int = 2  # accumulation, per data shard
  pipeline_micro_batches: int = 4  # M, per accumulated micro-batch
  data: int = 2
  stages: int = 4
  blocks_per_stage: int = 1
  seq_len: int = 32
  min_len: int = 4
  d_model: int = 32
  heads: int = 2
  learning_rate: float = 3e-3
  max_chars: int = 1_000_000
  seed: int = 0


TINY = Config(steps=4, batch_size=16, seq_len=12, d_model=16, max_chars=50_000)


# ------------------------------------------------------------------------------ data


# The sibling example's data pipeline: the standard library's source as a character corpus,
# random stretches right-padded with a mask of the real target tokens.
load_corpus = char_lm.load_corpus
sample_batch = char_lm.sample_batch


# ----------------------------------------------------------------------------- model


def init_params(cfg: Config) -> dict:
  """Embedding and head, and the blocks stacked as ``(stages, blocks_per_stage, ...)``."""
  d, lead = cfg.d_model, (cfg.stages, cfg.blocks_per_stage)
  keys = iter(jax.random.split(jax.random.key(cfg.seed), 8))

  def normal(shape, scale):
    return scale * jax.random.normal(next(keys), shape, jnp.float32)

  blocks = {
      "ln1": jnp.ones((*lead, d)), "ln2": jnp.ones((*lead, d)),
      "qkv": normal((*lead, d, 3 * d), d ** -0.5),
      "out": normal((*lead, d, d), (2 * d * cfg.stages * cfg.blocks_per_stage) ** -0.5),
      "up": normal((*lead, d, 4 * d), d ** -0.5),
      "down": normal((*lead, 4 * d, d), (8 * d * cfg.stages * cfg.blocks_per_stage) ** -0.5),
  }
  return {"embed": normal((VOCAB, d), 1.0), "pos": normal((cfg.seq_len, d), 0.02),
          "blocks": blocks, "ln_f": jnp.ones((d,)), "head": normal((d, VOCAB), d ** -0.5)}


def _norm(x, scale):
  x = x - jnp.mean(x, axis=-1, keepdims=True)
  return scale * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def block(p: dict, x: jax.Array, heads: int) -> jax.Array:
  """A pre-norm transformer block on ``(rows, seq, d)``: causal attention and an MLP."""
  rows, seq, d = x.shape
  q, k, v = jnp.split(_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
  split = lambda t: t.reshape(rows, seq, heads, d // heads)  # noqa: E731
  logits = jnp.einsum("bqhc,bkhc->bhqk", split(q), split(k)) / np.sqrt(d // heads)
  causal = np.tril(np.ones((seq, seq), bool))
  attn = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
  x = x + jnp.einsum("bhqk,bkhc->bqhc", attn, split(v)).reshape(rows, seq, d) @ p["out"]
  return x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def stage_fn(cfg: Config):
  """One pipeline stage: its ``blocks_per_stage`` blocks, scanned."""
  def run(stage_blocks: dict, x: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda h, p: (block(p, h, cfg.heads), None), x, stage_blocks)[0]
  return run


def sequential(cfg: Config):
  """The unpipelined body: the stages one after the other on the whole batch."""
  run = stage_fn(cfg)

  def body(blocks: dict, x: jax.Array) -> jax.Array:
    for s in range(cfg.stages):
      x = run(jax.tree.map(lambda a, s=s: a[s], blocks), x)
    return x
  return body


def token_loss(body):
  """``(summed cross-entropy over real target tokens, their count)`` with ``body`` as blocks."""
  def loss(params: dict, batch: dict):
    inputs = batch["inputs"]
    x = jax.nn.one_hot(inputs, VOCAB) @ params["embed"] + params["pos"][: inputs.shape[1]]
    logits = _norm(body(params["blocks"], x), params["ln_f"]) @ params["head"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])
  return loss


# ---------------------------------------------------------------------------- train


def token_mean(cfg: Config):
  """The unpipelined token-mean loss, jitted: the held-out evaluation of both runs."""
  @jax.jit
  def loss(params: dict, batch: dict) -> jax.Array:
    total, count = token_loss(sequential(cfg))(params, batch)
    return total / count
  return loss


def make_steps(cfg: Config, mesh: jax.sharding.Mesh):
  """The pipelined step (on ``mesh``) and the unpipelined one (one device)."""
  tx = optax.adam(cfg.learning_rate)
  pipe = jaxaccum.contrib.pipeline(stage_fn(cfg), num_micro_batches=cfg.pipeline_micro_batches,
                           stage_axis="stage")
  pipelined_vg = jaxaccum.value_and_grad(token_loss(pipe), num_micro_batches=cfg.num_micro_batches,
                                         reduce="weighted", data_axis="data")

  def full_vg(params, batch):
    def mean_loss(p):
      total, count = token_loss(sequential(cfg))(p, batch)
      return total / count
    return jax.value_and_grad(mean_loss)(params)

  def make(vg):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
      loss, grads = vg(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss
    return step

  return {"pipelined": make(pipelined_vg), "unpipelined": make(full_vg)}, tx


def place(cfg: Config, mesh: jax.sharding.Mesh, params: dict) -> dict:
  """Blocks sharded ``P('stage')``; the rest replicated."""
  rep = NamedSharding(mesh, P())
  out = jax.tree.map(lambda a: jax.device_put(a, rep), params)
  out["blocks"] = jax.device_put(params["blocks"], NamedSharding(mesh, P("stage")))
  return out


def plot_curves(curves: dict[str, list[float]], cfg: Config, path: pathlib.Path) -> None:
  """One PNG: both loss curves, and below them their relative distance."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                    gridspec_kw={"height_ratios": (2, 1)})
  ref = np.asarray(curves["unpipelined"])
  steps = np.arange(len(ref))
  ax.plot(steps, ref, color="C0", lw=3, alpha=0.5, label="unpipelined (one device)")
  ax.plot(steps, curves["pipelined"], color="C1", lw=1.2, ls="--",
          label=f"pipelined: data {cfg.data} x stage {cfg.stages}")
  rel = np.abs(np.asarray(curves["pipelined"]) - ref) / ref
  ax_diff.plot(steps, np.maximum(rel, 1e-9), color="C1")
  m = cfg.pipeline_micro_batches
  ax.set(ylabel="token-mean cross-entropy",
         title=f"{cfg.stages * cfg.blocks_per_stage} blocks over {cfg.stages} stages, "
               f"M={m} (bubble {(cfg.stages - 1) / (m + cfg.stages - 1):.0%}), "
               f"{cfg.num_micro_batches} accumulated micro-batches")
  ax.title.set_fontsize(10)
  ax_diff.set(yscale="log", xlabel="optimizer step",
              ylabel="|pipelined - unpipelined|\n/ unpipelined")
  ax.legend()
  for a in (ax, ax_diff):
    a.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(cfg: Config = Config(), *, out_dir: pathlib.Path | str = OUT_DIR,
         verbose: bool = True) -> dict[str, Any]:
  """Trains both runs, saves the plot.

  Returns ``curves`` (the training loss of each step, per run), ``max_rel_diff``,
  ``held_out`` (the token-mean loss on a batch not trained on: ``initial``, and after
  training ``pipelined`` and ``unpipelined``), ``plot`` and ``seconds``.
  """
  if jax.device_count() < cfg.data * cfg.stages:
    raise RuntimeError(
        f"this example needs {cfg.data * cfg.stages} devices, found {jax.device_count()}: run "
        "it as a script (it sets XLA_FLAGS=--xla_force_host_platform_device_count=8), or "
        "set that flag before jax starts.")
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  # Auto axes: with Explicit ones jax 0.10 gathers arrays at the boundary of a shard_map
  # that is manual over one axis of two (see docs/pipeline.md).
  mesh = jax.make_mesh((cfg.data, cfg.stages), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
  corpus = load_corpus(cfg.max_chars)
  rng = np.random.default_rng(cfg.seed)
  batches = [sample_batch(rng, corpus, cfg) for _ in range(cfg.steps)]
  held_out = sample_batch(rng, corpus, cfg)  # drawn after the training batches
  steps, tx = make_steps(cfg, mesh)
  dev = jax.devices()[0]
  evaluate = token_mean(cfg)
  evals = {"initial": float(evaluate(jax.device_put(init_params(cfg), dev), held_out))}

  curves, seconds = {}, {}
  # Initialised outside the mesh, as for the held-out loss above: its operations run
  # again without being compiled again for the mesh (the same values either way).
  fresh = init_params(cfg)
  with jax.set_mesh(mesh):
    params = place(cfg, mesh, fresh)
    state = (params, tx.init(params))
    batch_sharding = NamedSharding(mesh, P("data"))
    losses, t0 = [], time.perf_counter()
    for batch in batches:
      *state, loss = steps["pipelined"](*state, jax.device_put(batch, batch_sharding))
      losses.append(float(loss))
    curves["pipelined"], seconds["pipelined"] = losses, time.perf_counter() - t0
  evals["pipelined"] = float(evaluate(jax.device_put(state[0], dev), held_out))
  params = jax.device_put(init_params(cfg), dev)
  # All of the state on the device, Adam's step count included (jnp.zeros leaves it
  # uncommitted; the step's output is committed, which would compile the step again).
  state = jax.device_put((params, tx.init(params)), dev)
  losses, t0 = [], time.perf_counter()
  for batch in batches:
    *state, loss = steps["unpipelined"](*state, jax.device_put(batch, dev))
    losses.append(float(loss))
  curves["unpipelined"], seconds["unpipelined"] = losses, time.perf_counter() - t0
  evals["unpipelined"] = float(evaluate(state[0], held_out))

  plot_path = out_dir / "pipeline_lm_loss.png"
  plot_curves(curves, cfg, plot_path)
  ref, got = np.asarray(curves["unpipelined"]), np.asarray(curves["pipelined"])
  result = {"curves": curves, "max_rel_diff": float(np.max(np.abs(got - ref) / ref)),
            "held_out": evals, "plot": plot_path, "seconds": seconds}
  if verbose:
    m, s = cfg.pipeline_micro_batches, cfg.stages
    print(f"mesh data {cfg.data} x stage {s}; {s * cfg.blocks_per_stage} blocks, "
          f"{cfg.blocks_per_stage} per stage; batch {cfg.batch_size} = {cfg.data} shards x "
          f"{cfg.num_micro_batches} accumulated x {m} pipeline micro-batches of "
          f"{cfg.batch_size // (cfg.data * cfg.num_micro_batches * m)} sequences")
    print(f"bubble fraction (S-1)/(M+S-1) = {(s - 1) / (m + s - 1):.2f}")
    print(f"loss after {cfg.steps} steps: pipelined {got[-1]:.4f}, unpipelined {ref[-1]:.4f}; "
          f"largest relative difference over the run {result['max_rel_diff']:.1e}")
    print(f"held-out loss: {evals['initial']:.4f} at the start, after training pipelined "
          f"{evals['pipelined']:.4f}, unpipelined {evals['unpipelined']:.4f}")
    print(f"wall time (compile included): pipelined {seconds['pipelined']:.1f} s, "
          f"unpipelined {seconds['unpipelined']:.1f} s")
    print(f"plot: {plot_path}")
  return result


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true", help="a few steps of a tiny model")
  parser.add_argument("--steps", type=int)
  parser.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
  args = parser.parse_args()
  config = TINY if args.tiny else Config()
  if args.steps:
    config = dataclasses.replace(config, steps=args.steps)
  main(config, out_dir=args.out_dir)
