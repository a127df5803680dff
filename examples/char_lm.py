"""A character-level transformer LM (Flax NNX) with token-weighted gradient accumulation.

The corpus is the Python standard library's own source code, read offline from
``sysconfig.get_paths()["stdlib"]``. Each training sequence is a random stretch of it
with a random length, right-padded to a fixed width, so micro-batches hold different
numbers of real tokens. The loss is the mean over the real (unpadded) target tokens.

The same model, from the same initialisation and on the same batches, is trained three
ways:

* ``full batch``: :func:`flax.nnx.value_and_grad` on the whole batch;
* ``accumulated``: :func:`jaxaccum.nnx.value_and_grad` with ``reduce="weighted"``: each
  micro-batch returns (summed token loss, number of real tokens), which gives exactly the
  full-batch token mean;
* ``per-micro-batch means``: each micro-batch returns its own token mean and the means
  are averaged (``reduce="mean"``), the 2024 gradient-accumulation bug: micro-batches
  with few real tokens weigh as much as those with many.

It saves one PNG with the three loss curves (the first two coincide), and prints the
effective batch, the micro-batches, the largest gradient difference from the full batch
at the first step, and the compiled memory of the full-batch and accumulated steps.

  python examples/char_lm.py            # small defaults, about a minute on a laptop CPU
  python examples/char_lm.py --big      # a bigger model, longer sequences, more steps
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sysconfig
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxaccum

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
VOCAB = 128  # ASCII; every other character maps to UNK
PAD, UNK = 0, 1
RUNS = ("full batch", "accumulated", "per-micro-batch means")


@dataclasses.dataclass(frozen=True)
class Config:
  """What to train; the defaults run in about a minute on a laptop CPU."""

  steps: int = 60
  batch_size: int = 32
  num_micro_batches: int = 16
  seq_len: int = 64
  min_len: int = 4
  d_model: int = 64
  heads: int = 4
  layers: int = 2
  learning_rate: float = 3e-3
  max_chars: int = 2_000_000
  seed: int = 0


BIG = Config(steps=400, batch_size=64, num_micro_batches=8, seq_len=256, min_len=16,
             d_model=256, heads=8, layers=4, learning_rate=1e-3, max_chars=20_000_000)


# ------------------------------------------------------------------------------ data


def load_corpus(max_chars: int) -> np.ndarray:
  """The standard library's ``.py`` files (sorted, site-packages excluded) as token ids."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(root.rglob("*.py")):
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
      continue
    try:
      text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
      continue
    chunks.append(text)
    total += len(text)
    if total >= max_chars:
      break
  if not chunks:
    raise FileNotFoundError(f"no Python source files found under {root}")
  ids = np.frombuffer("\n".join(chunks)[:max_chars].encode("utf-32-le"), np.uint32)
  ids = np.where(ids < VOCAB, ids, UNK).astype(np.int32)
  return np.where(ids == PAD, UNK, ids)


def sample_batch(rng: np.random.Generator, corpus: np.ndarray, cfg: Config) -> dict:
  """Random stretches of ``min_len..seq_len`` tokens, right-padded to ``seq_len``.

  Returns ``inputs`` and ``targets`` (int32, ``(batch, seq_len)``) and ``mask`` (float32,
  1 on real target tokens).
  """
  lengths = rng.integers(cfg.min_len, cfg.seq_len + 1, size=cfg.batch_size)
  starts = rng.integers(0, len(corpus) - cfg.seq_len - 1, size=cfg.batch_size)
  tokens = np.full((cfg.batch_size, cfg.seq_len + 1), PAD, np.int32)
  for row, (s, n) in enumerate(zip(starts, lengths, strict=True)):
    tokens[row, : n + 1] = corpus[s: s + n + 1]
  mask = (np.arange(cfg.seq_len)[None, :] < lengths[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


# ----------------------------------------------------------------------------- model


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention and an MLP."""

  def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False,
                                       rngs=rngs)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class CharLM(nnx.Module):
  """A small causal transformer over characters.

  Padding sits at the end of each row, so the causal mask alone keeps real tokens from
  attending to it; padded targets are masked out of the loss.
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model)))
    self.blocks = nnx.List([Block(cfg.d_model, cfg.heads, rngs=rngs)
                            for _ in range(cfg.layers)])
    self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
    self.head = nnx.Linear(cfg.d_model, VOCAB, rngs=rngs)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    x = self.embed(inputs) + self.pos[: inputs.shape[1]]
    mask = nnx.make_causal_mask(inputs)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


# ---------------------------------------------------------------------------- losses


def token_loss(model: CharLM, batch: dict) -> tuple[jax.Array, jax.Array]:
  """(summed cross-entropy over real target tokens, number of real target tokens)."""
  logits = model(batch["inputs"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])


def token_mean_loss(model: CharLM, batch: dict) -> jax.Array:
  """The mean cross-entropy over the batch's real tokens."""
  total, count = token_loss(model, batch)
  return total / count


def micro_mean_loss(model: CharLM, batch: dict):
  """A micro-batch's own token mean, with (sum, count) as aux to report the true loss."""
  total, count = token_loss(model, batch)
  return total / count, (total, count)


def value_and_grad_fn(run: str, num_micro_batches: int):
  """``fn(model, batch) -> (token-mean loss over the whole batch, grads)`` for one run."""
  if run == "full batch":
    return nnx.value_and_grad(token_mean_loss)
  if run == "accumulated":
    return jaxaccum.nnx.value_and_grad(token_loss, num_micro_batches=num_micro_batches,
                                       reduce="weighted")
  if run == "per-micro-batch means":
    vg = jaxaccum.nnx.value_and_grad(micro_mean_loss, num_micro_batches=num_micro_batches,
                                     has_aux=True, aux_reduce="sum")

    def buggy(model, batch):
      (_, (total, count)), grads = vg(model, batch)
      return total / count, grads  # report the true token mean of the whole batch

    return buggy
  raise ValueError(f"run must be one of {RUNS}, got {run!r}")


# ---------------------------------------------------------------------------- train


@functools.partial(nnx.jit, static_argnums=0)
def _create(cfg: Config) -> tuple[CharLM, nnx.Optimizer]:
  """A fresh model and optimizer, built under jit: one compile instead of one per initialiser."""
  model = CharLM(cfg, rngs=nnx.Rngs(cfg.seed))
  return model, nnx.Optimizer(model, optax.adam(cfg.learning_rate), wrt=nnx.Param)


def make_trainer(cfg: Config, run: str):
  """A fresh model (same seed, so the same init for every run) and its jitted step.

  The step returns ``(state, loss, grads)``: the gradients it applied, to compare (one
  compiled program per run, instead of a second one for the gradients alone).
  """
  graphdef, state = nnx.split(_create(cfg))
  vg = value_and_grad_fn(run, cfg.num_micro_batches)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = vg(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, grads

  return state, step


def _max_abs_diff(a: Any, b: Any) -> float:
  # NumPy on the host: jnp here would compile a small program for every leaf's shape.
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _max_abs(a: Any) -> float:
  return max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(a))


def plot_curves(curves: dict[str, list[float]], cfg: Config, path: pathlib.Path) -> None:
  """One PNG: the three loss curves, and below them their relative distance from the full batch."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True,
                                    gridspec_kw={"height_ratios": (2, 1)})
  styles = {"full batch": dict(color="C0", lw=3, alpha=0.5),
            "accumulated": dict(color="C1", lw=1.2, ls="--"),
            "per-micro-batch means": dict(color="C3", lw=1.2)}
  full = np.asarray(curves["full batch"])
  steps = np.arange(len(full))
  for run, losses in curves.items():
    ax.plot(steps, losses, label=run, **styles[run])
    if run != "full batch":
      rel = np.abs(np.asarray(losses) - full) / full
      ax_diff.plot(steps, np.maximum(rel, 1e-9), label=run, **styles[run])
  ax.set(ylabel="token-mean cross-entropy",
         title=f"char LM on the Python stdlib: batch {cfg.batch_size} = "
               f"{cfg.num_micro_batches} x {cfg.batch_size // cfg.num_micro_batches} sequences")
  ax_diff.set(yscale="log", xlabel="optimizer step",
              ylabel="|loss - full-batch loss|\n/ full-batch loss")
  ax.legend()
  for a in (ax, ax_diff):
    a.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(cfg: Config = Config(), *, out_dir: pathlib.Path | str = OUT_DIR,
         progress: bool = True, verbose: bool = True) -> dict[str, Any]:
  """Trains the three runs, saves the plot, prints a summary; returns the numbers.

  Returns a dict with ``curves`` (run name -> per-step losses), ``grad_diff`` (run name
  -> largest absolute difference from the full-batch gradient at the first step),
  ``grad_scale`` (largest absolute full-batch gradient entry), ``memory`` (compiled
  bytes of the full-batch and accumulated steps), ``tokens_per_micro_batch`` (real
  target tokens in each micro-batch of the first batch) and ``plot`` (its path).
  """
  from tqdm import tqdm

  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  corpus = load_corpus(cfg.max_chars)
  rng = np.random.default_rng(cfg.seed)
  batches = [sample_batch(rng, corpus, cfg) for _ in range(cfg.steps)]
  trainers = {run: make_trainer(cfg, run) for run in RUNS}
  mask = jaxaccum.split_micro_batches(batches[0]["mask"],
                                      num_micro_batches=cfg.num_micro_batches)
  tokens_per_micro = [int(t) for t in np.asarray(mask).sum(axis=(1, 2))]

  # Each train step compiled once, ahead of time: its memory is read from the executable
  # that then trains (calling the jitted function would compile it a second time).
  compiled, memory = {}, {}
  for run, (state, step) in trainers.items():
    compiled[run] = step.lower(state, batches[0]).compile()
    if run in RUNS[:2]:
      mem = compiled[run].memory_analysis()
      memory[run] = {"temp": mem.temp_size_in_bytes,
                     "total": (mem.argument_size_in_bytes + mem.output_size_in_bytes
                               + mem.temp_size_in_bytes - mem.alias_size_in_bytes)}

  curves, first = {run: [] for run in RUNS}, {}
  states = {run: t[0] for run, t in trainers.items()}
  for batch in tqdm(batches, desc="training (3 runs)", disable=not progress):
    for run in RUNS:
      states[run], loss, grads = compiled[run](states[run], batch)
      first.setdefault(run, grads)  # the first step's, from the shared initialisation
      curves[run].append(float(loss))
  grad_diff = {run: _max_abs_diff(first[run], first["full batch"]) for run in RUNS[1:]}
  grad_scale = _max_abs(first["full batch"])

  plot_path = out_dir / "char_lm_loss.png"
  plot_curves(curves, cfg, plot_path)
  full, acc, bug = (np.asarray(curves[r]) for r in RUNS)
  result = {
      "curves": curves, "grad_diff": grad_diff, "grad_scale": grad_scale, "memory": memory,
      "tokens_per_micro_batch": tokens_per_micro, "plot": plot_path,
      "curve_rel_diff": {"accumulated": float(np.max(np.abs(acc - full) / full)),
                         "per-micro-batch means": float(np.max(np.abs(bug - full) / full))},
  }
  if verbose:
    mib = 2.0**20
    n, mb = cfg.num_micro_batches, cfg.batch_size // cfg.num_micro_batches
    print(f"final loss: full batch {full[-1]:.4f}, accumulated {acc[-1]:.4f}, "
          f"per-micro-batch means {bug[-1]:.4f}")
    print(f"largest relative loss-curve difference from the full batch over {cfg.steps} "
          f"steps: accumulated {result['curve_rel_diff']['accumulated']:.1e}, "
          f"per-micro-batch means {result['curve_rel_diff']['per-micro-batch means']:.1e}")
    print(f"effective batch: {cfg.batch_size} sequences of up to {cfg.seq_len} characters")
    print(f"micro-batches: {n} of {mb} sequences (real tokens per micro-batch at step 0: "
          f"{tokens_per_micro})")
    print("largest |gradient - full-batch gradient| at the first step (largest full-batch "
          f"entry {grad_scale:.2e}): token-weighted accumulation "
          f"{grad_diff['accumulated']:.1e}, averaged per-micro-batch means "
          f"{grad_diff['per-micro-batch means']:.1e}")
    print(f"compiled memory, full-batch step: {memory['full batch']['total'] / mib:.1f} MiB "
          f"(temp {memory['full batch']['temp'] / mib:.1f} MiB); accumulated step: "
          f"{memory['accumulated']['total'] / mib:.1f} MiB "
          f"(temp {memory['accumulated']['temp'] / mib:.1f} MiB)")
    print(f"plot: {plot_path}")
  return result


def _parse(argv=None) -> tuple[Config, pathlib.Path]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--big", action="store_true", help="a bigger model and longer run")
  for field in dataclasses.fields(Config):
    parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default))
  parser.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
  args = parser.parse_args(argv)
  cfg = BIG if args.big else Config()
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
               if getattr(args, f.name) is not None}
  return dataclasses.replace(cfg, **overrides), args.out_dir


if __name__ == "__main__":
  config, out = _parse()
  main(config, out_dir=out)
