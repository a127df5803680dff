"""A batch size that follows training, on a real model: the character LM with
``jaxaccum.contrib.AdaptiveBatch``, against fixed batches and a fixed ramp by tokens.

The character LM of ``examples/char_lm.py`` (its model; its corpus, the Python standard
library's own source, read offline) is trained on fixed-length sequences four ways, from
one initialisation and with one learning rate:

* ``small``: a fixed small batch (``small`` micro-batches every step);
* ``large``: a fixed large batch (``large`` micro-batches);
* ``ramp``: a fixed ramp by tokens seen, in Megatron-LM's ``THRESHOLD:BATCH_SIZE`` format
  (:func:`jaxaccum.batch_size_ramp_by_count`, batch sizes in sequences);
* ``adaptive``: :class:`jaxaccum.contrib.AdaptiveBatch` at its defaults sets the micro-batches of
  every step from the noise statistics the accumulation measures anyway.

Every run is one compiled program: a :func:`jax.lax.scan` over steps that samples its own
batches on the device, runs ``k`` of ``N`` micro-batches (``active_micro_batches``: the
others cost nothing) and evaluates a held-out validation set each time another
``eval_every_tokens`` tokens have been seen; a run stops at the token budget. Runs can be
vectorised (``jax.vmap``) over learning rates and seeds when they share ``k``, which is how
``benchmarks/bench_adaptive_lm.py`` sweeps fixed batches.

It prints, per run, the steps and tokens to reach a target validation loss (by default
the loss the small batch reaches at half the budget) and the final loss at the equal token
budget, and saves ``examples/out/adaptive_batch.png``: the active batch and B_simple, and
the validation loss against tokens and against steps.

  python examples/adaptive_batch.py           # a few minutes on a laptop CPU
  python examples/adaptive_batch.py --tiny    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import char_lm  # noqa: E402  (the sibling example: model and corpus)

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
RUNS = ("small", "large", "ramp", "adaptive")


@dataclasses.dataclass(frozen=True)
class Config:
  """What to train; the defaults run in a few minutes on a laptop CPU."""

  seq_len: int = 32  # characters per sequence (every sequence is full: tokens = rows * len)
  micro_batch_size: int = 4  # sequences per micro-batch
  max_micro_batches: int = 32  # N: a batch holds up to N micro-batches
  d_model: int = 64
  heads: int = 4
  layers: int = 2
  tokens: int = 1_000_000  # the token budget of every run
  eval_every_tokens: int = 10_000
  val_sequences: int = 64
  max_chars: int = 2_000_000
  learning_rate: float = 3e-3  # Adam
  small: int = 2  # micro-batches of the fixed small batch
  large: int = 32  # micro-batches of the fixed large batch
  # Tokens seen: batch size in sequences (k = 2, 4, 8, 16, 32 micro-batches of 4).
  ramp: str = "0:8 50K:16 150K:32 300K:64 500K:128"
  target: float | None = None  # validation loss; None: the small batch's at half budget
  seed: int = 0

  def lm(self) -> char_lm.Config:
    """The character LM's configuration."""
    return char_lm.Config(seq_len=self.seq_len, d_model=self.d_model, heads=self.heads,
                          layers=self.layers, seed=self.seed, max_chars=self.max_chars)

  @property
  def tokens_per_micro_batch(self) -> int:
    return self.micro_batch_size * self.seq_len


TINY = Config(seq_len=8, micro_batch_size=2, max_micro_batches=4, d_model=8, heads=1,
              layers=1, tokens=1_600, eval_every_tokens=160, val_sequences=8,
              max_chars=30_000, learning_rate=1e-2, small=1, large=4,
              ramp="0:2 400:4 800:8")


# ------------------------------------------------------------------------------ data


def load_data(cfg: Config) -> tuple[jax.Array, jax.Array]:
  """``(train, val)``: token ids of the corpus's first 90% and a fixed validation set of
  ``val_sequences`` sequences of ``seq_len + 1`` tokens from the last 10%."""
  corpus = char_lm.load_corpus(cfg.max_chars)
  cut = len(corpus) * 9 // 10
  train, held = corpus[:cut], corpus[cut:]
  starts = np.random.default_rng(1234).integers(0, len(held) - cfg.seq_len - 1,
                                                size=cfg.val_sequences)
  val = np.stack([held[s:s + cfg.seq_len + 1] for s in starts])
  return jnp.asarray(train), jnp.asarray(val)


def sample(key: jax.Array, train: jax.Array, rows: int, seq_len: int) -> jax.Array:
  """``rows`` random stretches of ``seq_len + 1`` tokens of ``train`` (on the device)."""
  starts = jax.random.randint(key, (rows,), 0, train.shape[0] - seq_len - 1)
  return train[starts[:, None] + jnp.arange(seq_len + 1)]


# ----------------------------------------------------------------------------- model


def init_params(cfg: Config, seeds) -> tuple[Any, Any]:
  """``(loss_fn, params)``: ``params`` stacked over ``seeds`` (leading axis), and the mean
  token cross-entropy ``loss_fn(params, tokens)`` of one run's parameters (one function
  for every seed, so that one compiled program serves them all)."""
  # Stacked in NumPy: jnp.stack would compile a small program for every leaf's shape.
  params = jax.tree.map(lambda *xs: jnp.asarray(np.stack([np.asarray(x) for x in xs])),
                        *[_create(cfg.lm(), jnp.int32(s))[0] for s in seeds])
  return _loss_fn(cfg), params


@functools.partial(jax.jit, static_argnums=0)
def _create(cfg: char_lm.Config, seed: jax.Array):
  """A fresh model's parameters, built under jit: one compile for every seed instead of
  one per initialiser and shape."""
  model = char_lm.CharLM(cfg, rngs=nnx.Rngs(jax.random.key(seed)))
  return nnx.split(model, nnx.Param, ...)[1:]


@functools.lru_cache(maxsize=4)
def _loss_fn(cfg: Config):
  abstract = nnx.eval_shape(lambda: char_lm.CharLM(cfg.lm(), rngs=nnx.Rngs(0)))
  graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))

  return loss_fn


# ----------------------------------------------------------------------------- train

MODES = ("fixed", "ramp", "adaptive")


@functools.partial(jax.jit, static_argnames=("cfg", "controller", "loss_fn"))
def _train(params, lrs, keys, k_fixed, mode, train, val, *, cfg: Config,
           controller: jaxaccum.contrib.AdaptiveBatch, loss_fn):
  """``R`` runs (leading axis of ``params``, ``lrs``, ``keys``) that share ``k`` each step.

  ``mode`` (int32, an index into ``MODES``, traced: one program for all three):
  ``"fixed"`` (``k = k_fixed``), ``"ramp"`` (``cfg.ramp`` by tokens seen) or
  ``"adaptive"`` (``controller``, fed the first run's statistics: ``R`` must be 1).
  Returns per-step arrays (NaN after the budget; ``val`` NaN where no evaluation ran).
  """
  n, m, seq = cfg.max_micro_batches, cfg.micro_batch_size, cfg.seq_len
  per_micro = cfg.tokens_per_micro_batch
  max_steps = -(-cfg.tokens // per_micro)
  vg = jaxaccum.value_and_grad(loss_fn, num_micro_batches=n, with_info=True)
  tx = optax.scale_by_adam()
  noise = jaxaccum.NoiseScale(decay=0.95)
  ramp = jaxaccum.batch_size_ramp_by_count(cfg.ramp, micro_batch_size=m,
                                           num_micro_batches=n)
  val_loss = jax.vmap(loss_fn, in_axes=(0, None))
  r = lrs.shape[0]
  ctrl = controller.init()

  def one(p, o, key, k, lr_scale, lr):
    batch = sample(key, train, n * m, seq)
    loss, grads, info = vg(p, batch, active_micro_batches=k)
    updates, o = tx.update(grads, o, p)
    p = jax.tree.map(lambda x, u: x - (lr * lr_scale) * u, p, updates)
    return p, o, loss, info

  def body(carry, _):
    params, opt, ns, ctrl, keys, tokens, next_eval = carry
    k = jnp.stack([k_fixed, ramp(tokens), controller.micro_batches(ctrl)])[mode]
    lr_scale = jnp.where(mode == 2, controller.lr_scale(ctrl), 1.0)

    def run(carry):
      params, opt, ns, ctrl, keys, tokens, next_eval = carry
      split = jax.vmap(jax.random.split)(keys)
      params, opt, loss, info = jax.vmap(one, in_axes=(0, 0, 0, None, None, 0))(
          params, opt, split[:, 0], k, lr_scale, lrs)
      ns = jax.vmap(noise.update)(ns, info)
      ctrl = controller.update(ctrl, jax.tree.map(lambda x: x[0], info))
      tokens = tokens + k * per_micro
      due = tokens >= next_eval
      val_now = jax.lax.cond(due, lambda p: val_loss(p, val),
                             lambda p: jnp.full((r,), jnp.nan), params)
      next_eval = jnp.where(due, (tokens // cfg.eval_every_tokens + 1)
                            * cfg.eval_every_tokens, next_eval)
      out = {"k": k, "tokens": tokens, "loss": loss, "val": val_now,
             "b_simple": jax.vmap(noise.b_simple)(ns)}
      return (params, opt, ns, ctrl, split[:, 1], tokens, next_eval), out

    def skip(carry):
      nan = jnp.full((r,), jnp.nan)
      return carry, {"k": jnp.int32(0), "tokens": carry[5], "loss": nan, "val": nan,
                     "b_simple": nan}

    return jax.lax.cond(carry[5] < cfg.tokens, run, skip, carry)

  opt = jax.vmap(tx.init)(params)
  ns = jax.vmap(lambda _: noise.init())(lrs)
  carry = (params, opt, ns, ctrl, keys, jnp.int32(0), jnp.int32(cfg.eval_every_tokens))
  val0 = val_loss(params, val)
  _, out = jax.lax.scan(body, carry, None, length=max_steps)
  out["val0"] = val0
  return out


def train(cfg: Config, mode: str, *, lrs, seeds, data, k: int = 0,
          controller: jaxaccum.contrib.AdaptiveBatch | None = None) -> list[dict[str, np.ndarray]]:
  """Runs ``len(lrs) * len(seeds)`` runs (one program); returns one log per run, in the
  order ``[(lr, seed) for lr in lrs for seed in seeds]``.

  Each log holds per-step arrays ``k``, ``tokens`` (seen after the step), ``loss`` (the
  step's training loss), ``b_simple`` (the EMA, in sequences), and ``evals``: an array of
  ``(step, tokens, validation loss)`` rows from step 0 on.
  """
  train_ids, val = data
  pairs = [(lr, s) for lr in lrs for s in seeds]
  loss_fn, params = init_params(cfg, [s for _, s in pairs])
  lr_arr = jnp.asarray([lr for lr, _ in pairs], jnp.float32)
  keys = jnp.stack([jax.random.key(10_000 + int(s)) for _, s in pairs])
  if mode == "adaptive" and len(pairs) != 1:
    raise ValueError("adaptive runs choose their own k: train them one at a time")
  if controller is None:
    controller = jaxaccum.contrib.AdaptiveBatch(cfg.max_micro_batches)
  out = _train(params, lr_arr, keys, jnp.int32(k), jnp.int32(MODES.index(mode)), train_ids,
               val, cfg=cfg, controller=controller, loss_fn=loss_fn)
  out = jax.tree.map(np.asarray, out)
  steps_run = int(np.sum(out["k"] > 0))
  logs = []
  for i in range(len(pairs)):
    val_i = out["val"][:steps_run, i]
    at = np.nonzero(np.isfinite(val_i))[0]
    evals = np.concatenate([[[0, 0, out["val0"][i]]],
                            np.stack([at + 1, out["tokens"][at], val_i[at]], axis=1)])
    logs.append({"k": out["k"][:steps_run], "tokens": out["tokens"][:steps_run],
                 "loss": out["loss"][:steps_run, i],
                 "b_simple": out["b_simple"][:steps_run, i],
                 "evals": evals, "lr": pairs[i][0], "seed": pairs[i][1]})
  return logs


def to_target(evals: np.ndarray, target: float) -> tuple[float, float]:
  """``(steps, tokens)`` at which the validation loss first reaches ``target``, linearly
  interpolated between evaluations; ``(nan, nan)`` if it never does."""
  below = np.nonzero(evals[:, 2] <= target)[0]
  if not len(below):
    return float("nan"), float("nan")
  j = below[0]
  if j == 0:
    return 0.0, 0.0
  (s0, t0, v0), (s1, t1, v1) = evals[j - 1], evals[j]
  f = (v0 - target) / (v0 - v1)
  return float(s0 + f * (s1 - s0)), float(t0 + f * (t1 - t0))


def loss_at_tokens(evals: np.ndarray, tokens: float) -> float:
  """The validation loss at ``tokens`` seen, interpolated between evaluations."""
  return float(np.interp(tokens, evals[:, 1], evals[:, 2]))


# ----------------------------------------------------------------------------- report


def plot(logs: dict[str, dict[str, np.ndarray]], cfg: Config, target: float,
         path: pathlib.Path, title: str = "") -> None:
  """Active batch and B_simple, and the validation loss against tokens and steps."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_b, ax_t, ax_s) = plt.subplots(3, 1, figsize=(7.5, 10))
  for i, (run, lg) in enumerate(logs.items()):
    color = f"C{i}"
    batch = lg["k"] * cfg.micro_batch_size
    ax_b.plot(lg["tokens"], batch, color=color, label=f"{run}: batch (sequences)")
    if np.isfinite(lg["b_simple"]).any():
      ax_b.plot(lg["tokens"], lg["b_simple"], color=color, ls=":", lw=1,
                label=f"{run}: B_simple (EMA)")
    ev = lg["evals"]
    ax_t.plot(ev[:, 1], ev[:, 2], color=color, label=run)
    ax_s.plot(ev[:, 0], ev[:, 2], color=color, label=run)
  ax_b.set(yscale="log", xlabel="tokens seen", ylabel="sequences")
  ax_t.set(xlabel="tokens seen", ylabel="validation loss")
  ax_s.set(xscale="log", xlabel="optimizer steps", ylabel="validation loss")
  for ax in (ax_t, ax_s):
    ax.axhline(target, color="k", lw=0.8, ls="--", label=f"target {target:.3f}")
    lo = min(float(np.nanmin(lg["evals"][:, 2])) for lg in logs.values())
    ax.set_ylim(lo - 0.05, min(target + 1.0, 5.0))
  ax_b.set_title(title or f"char LM ({cfg.layers} layer, d {cfg.d_model}), sequences of "
                 f"{cfg.seq_len} characters, micro-batches of {cfg.micro_batch_size}",
                 fontsize=10)
  for ax in (ax_b, ax_t, ax_s):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summarize(logs: dict[str, dict], target: float, budget: float) -> dict[str, dict]:
  """Per run: steps and tokens to ``target``, and the validation loss at ``budget`` tokens."""
  out = {}
  for run, lg in logs.items():
    steps, tokens = to_target(lg["evals"], target)
    out[run] = {"steps_to_target": steps, "tokens_to_target": tokens,
                "loss_at_budget": loss_at_tokens(lg["evals"], budget),
                "steps": len(lg["k"]), "final_k": int(lg["k"][-1])}
  return out


def main(cfg: Config = Config(), *, out_dir: pathlib.Path | str = OUT_DIR,
         verbose: bool = True) -> dict[str, Any]:
  """Trains the four runs, saves the plot, prints a summary; returns the numbers.

  Returns a dict with ``logs`` (run -> the log of :func:`train`), ``target``, ``summary``
  (run -> steps and tokens to the target, validation loss at the budget) and ``plot``.
  """
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  data = load_data(cfg)
  lr, seeds = [cfg.learning_rate], [cfg.seed]
  controller = jaxaccum.contrib.AdaptiveBatch(cfg.max_micro_batches)
  logs = {
      "small": train(cfg, "fixed", k=cfg.small, lrs=lr, seeds=seeds, data=data)[0],
      "large": train(cfg, "fixed", k=cfg.large, lrs=lr, seeds=seeds, data=data)[0],
      "ramp": train(cfg, "ramp", lrs=lr, seeds=seeds, data=data)[0],
      "adaptive": train(cfg, "adaptive", lrs=lr, seeds=seeds, data=data,
                        controller=controller)[0],
  }
  target = cfg.target
  if target is None:
    target = loss_at_tokens(logs["small"]["evals"], cfg.tokens / 2)
  summary = summarize(logs, target, cfg.tokens)
  path = out_dir / "adaptive_batch.png"
  plot(logs, cfg, target, path)
  if verbose:
    print(f"target validation loss {target:.4f}; budget {cfg.tokens:,} tokens; lr "
          f"{cfg.learning_rate} (Adam); micro-batches of {cfg.micro_batch_size} sequences "
          f"of {cfg.seq_len} characters, up to {cfg.max_micro_batches}")
    for run, s in summary.items():
      lg = logs[run]
      b = lg["b_simple"][np.isfinite(lg["b_simple"])]
      grow = f"B_simple {b[min(10, len(b) - 1)]:.1f} -> {b[-1]:.1f} seq" if len(b) else ""
      print(f"{run:>9}: {s['steps_to_target']:7.0f} steps, {s['tokens_to_target']:9,.0f} "
            f"tokens to target; loss at budget {s['loss_at_budget']:.4f} ({s['steps']} "
            f"steps, last k {s['final_k']}) {grow}")
    print(f"plot: {path}")
  return {"logs": logs, "target": target, "summary": summary, "plot": path}


def _parse(argv=None) -> tuple[Config, pathlib.Path]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
  for field in dataclasses.fields(Config):
    kind = float if field.name == "target" else type(field.default)
    parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind)
  parser.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
  args = parser.parse_args(argv)
  cfg = TINY if args.tiny else Config()
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
               if getattr(args, f.name) is not None}
  return dataclasses.replace(cfg, **overrides), args.out_dir


if __name__ == "__main__":
  config, out = _parse()
  main(config, out_dir=out)
