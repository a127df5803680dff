"""Seesaw on the character LM: a batch ramp in place of cosine's learning-rate decay.

The character LM of ``examples/adaptive_batch.py`` (2 layers, d 64, sequences of 32
characters of the Python standard library's source) is trained with AdamW and a cosine
schedule with warm-up, counted in tokens, at a fixed token budget:

* ``cosine``: the reference, at the constant batch of ``k0`` micro-batches;
* ``seesaw``: :func:`jaxaccum.contrib.seesaw` on that cosine: wherever cosine halves the learning
  rate, the batch doubles and the learning rate drops by ``1/sqrt(2)``, up to
  ``cap x k0`` micro-batches;
* ``ramp``: a fixed ramp by tokens (:func:`jaxaccum.batch_size_ramp_by_count`) under the
  cosine by tokens;
* ``adaptive``: :class:`jaxaccum.contrib.AdaptiveBatch` at its defaults under the cosine by tokens.

Each run is one compiled program (a :func:`jax.lax.scan` over steps) that samples batches
on the device and runs ``k`` of ``N`` micro-batches (``active_micro_batches=k``); the
learning rate, weight decay and ``b2`` reach AdamW through
:func:`optax.inject_hyperparams`. Runs that share ``k`` at every step (all but the
adaptive and noise-guarded ones) are vectorised over seeds.

  python examples/seesaw_lm.py           # a few minutes on a laptop CPU
  python examples/seesaw_lm.py --tiny    # seconds: a smoke run for the tests
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

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import adaptive_batch as ab  # noqa: E402  (the sibling example: model, corpus, sampling)

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
MODES = ("cosine", "seesaw", "ramp", "adaptive")


@dataclasses.dataclass(frozen=True)
class Config:
  """What to train; the defaults run in a few minutes on a laptop CPU."""

  seq_len: int = 32
  micro_batch_size: int = 4  # sequences per micro-batch
  init_micro_batches: int = 2  # k0: the reference's batch (8 sequences, 256 tokens)
  cap: int = 4  # Seesaw's max_micro_batches = cap * k0 (also N, the step's split)
  d_model: int = 64
  heads: int = 4
  layers: int = 2
  tokens: int = 500_000  # the token budget of every run
  warmup_tokens: int = 12_800  # 50 steps at k0
  learning_rate: float = 3e-3  # AdamW's peak
  weight_decay: float = 0.1  # AdamW's decoupled weight decay
  b2: float = 0.99
  eval_every_tokens: int = 25_000
  val_sequences: int = 256
  max_chars: int = 2_000_000
  # Tokens seen -> batch in sequences, up to the cap (k = 2, 4, 8 micro-batches of 4).
  ramp: str = "0:8 25K:16 75K:32"
  seed: int = 0

  @property
  def max_micro_batches(self) -> int:
    return self.cap * self.init_micro_batches

  @property
  def tokens_per_micro_batch(self) -> int:
    return self.micro_batch_size * self.seq_len

  def adaptive_config(self) -> ab.Config:
    """The sibling example's configuration, for its model, corpus and loss."""
    return ab.Config(seq_len=self.seq_len, micro_batch_size=self.micro_batch_size,
                     max_micro_batches=self.max_micro_batches, d_model=self.d_model,
                     heads=self.heads, layers=self.layers, tokens=self.tokens,
                     val_sequences=self.val_sequences, max_chars=self.max_chars,
                     seed=self.seed)


TINY = Config(seq_len=8, micro_batch_size=2, init_micro_batches=1, cap=4, d_model=8,
              heads=1, layers=1, tokens=3_200, warmup_tokens=160, learning_rate=1e-2,
              eval_every_tokens=400, val_sequences=8, max_chars=30_000,
              ramp="0:2 800:4 1600:8")


@dataclasses.dataclass(frozen=True)
class Variant:
  """How a run sets its batch and AdamW's hyperparameters."""

  mode: str = "cosine"  # one of MODES
  weight_decay_coupling: bool = False  # Seesaw: lambda x sqrt(k / k0), per token
  b2_coupling: bool = False  # Seesaw: b2 ** (k / k0)
  noise_guard: float | None = None  # Seesaw: stop the ramp at noise_guard x B_simple


def reference(cfg: Config):
  """The reference: tokens -> learning rate, cosine to 0 with linear warm-up."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_tokens,
      decay_steps=cfg.tokens, end_value=0.0)


def rule(cfg: Config, noise_guard: float | None = None) -> jaxaccum.contrib.Seesaw:
  """Seesaw on :func:`reference`, counted in tokens."""
  return jaxaccum.contrib.seesaw(reference(cfg), init_micro_batches=cfg.init_micro_batches,
                         max_micro_batches=cfg.max_micro_batches, optimizer="adam",
                         decay_start=cfg.warmup_tokens, total=cfg.tokens,
                         noise_guard=noise_guard)


@functools.partial(jax.jit, static_argnames=("cfg", "variant", "loss_fn"))
def _train(params, keys, train, val, *, cfg: Config, variant: Variant, loss_fn):
  """``R`` runs (leading axis of ``params`` and ``keys``) that share ``k`` at every step."""
  n, m, seq = cfg.max_micro_batches, cfg.micro_batch_size, cfg.seq_len
  per_micro = cfg.tokens_per_micro_batch
  max_steps = -(-cfg.tokens // (per_micro * cfg.init_micro_batches))
  vg = jaxaccum.value_and_grad(loss_fn, num_micro_batches=n, with_info=True)
  tx = optax.inject_hyperparams(optax.adamw)(
      learning_rate=cfg.learning_rate, b1=0.9, b2=cfg.b2, weight_decay=cfg.weight_decay)
  ref = reference(cfg)
  seesaw = rule(cfg, variant.noise_guard)
  ramp = jaxaccum.batch_size_ramp_by_count(cfg.ramp, micro_batch_size=m, num_micro_batches=n)
  controller = jaxaccum.contrib.AdaptiveBatch(n)
  val_loss = jax.vmap(loss_fn, in_axes=(0, None))
  r = keys.shape[0]
  mode = variant.mode

  def hyper(state, tokens, ctrl):
    """``(k, lr, weight_decay, b2)`` for the next step."""
    wd, b2 = jnp.float32(cfg.weight_decay), jnp.float32(cfg.b2)
    if mode == "seesaw":
      k, lr = seesaw.micro_batches(state), seesaw.learning_rate(state)
      if variant.weight_decay_coupling:
        # AdamW decays lr * lambda / B per token; Seesaw's lr is the reference's times
        # sqrt(S) at S times its batch: lambda x sqrt(S) gives back the reference's decay
        # per token. Measured without effect (docs/seesaw.md), so not part of the rule.
        wd = wd * seesaw.lr_factor(state)
      if variant.b2_coupling:
        b2 = seesaw.b2(state, cfg.b2)
      return k, lr, wd, b2
    lr = ref(tokens)
    if mode == "cosine":
      return jnp.int32(cfg.init_micro_batches), lr, wd, b2
    if mode == "ramp":
      return ramp(tokens), lr, wd, b2
    return controller.micro_batches(ctrl), lr, wd, b2

  def one(p, o, key, k, lr, wd, b2):
    batch = ab.sample(key, train, n * m, seq)
    loss, grads, info = vg(p, batch, active_micro_batches=k)
    o.hyperparams.update(learning_rate=lr, weight_decay=wd, b2=b2)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss, info

  def body(carry, _):
    params, opt, state, ctrl, keys, tokens, next_eval = carry

    def run(carry):
      params, opt, state, ctrl, keys, tokens, next_eval = carry
      k, lr, wd, b2 = hyper(state, tokens, ctrl)
      split = jax.vmap(jax.random.split)(keys)
      params, opt, loss, info = jax.vmap(one, in_axes=(0, 0, 0) + (None,) * 4)(
          params, opt, split[:, 0], k, lr, wd, b2)
      first = jax.tree.map(lambda x: x[0], info)
      state = seesaw.update(state, first, samples=k * per_micro)
      if mode == "adaptive":
        ctrl = controller.update(ctrl, first)
      tokens = tokens + k * per_micro
      due = (tokens >= next_eval) | (tokens >= cfg.tokens)
      val_now = jax.lax.cond(due, lambda p: val_loss(p, val),
                             lambda p: jnp.full((r,), jnp.nan), params)
      next_eval = jnp.where(due, (tokens // cfg.eval_every_tokens + 1)
                            * cfg.eval_every_tokens, next_eval)
      out = {"k": k, "lr": lr, "tokens": tokens, "loss": loss, "val": val_now,
             "level_cap": state.max_level,
             "b_simple": seesaw.noise_scale.b_simple(state.noise)}  # guarded runs only
      return (params, opt, state, ctrl, split[:, 1], tokens, next_eval), out

    def skip(carry):
      nan = jnp.full((r,), jnp.nan)
      return carry, {"k": jnp.int32(0), "lr": jnp.float32(0), "tokens": carry[5],
                     "loss": nan, "val": nan, "level_cap": carry[2].max_level,
                     "b_simple": jnp.float32(jnp.nan)}

    return jax.lax.cond(carry[5] < cfg.tokens, run, skip, carry)

  opt = jax.vmap(tx.init)(params)
  carry = (params, opt, seesaw.init(), controller.init(), keys, jnp.int32(0),
           jnp.int32(cfg.eval_every_tokens))
  val0 = val_loss(params, val)
  _, out = jax.lax.scan(body, carry, None, length=max_steps)
  out["val0"] = val0
  return out


def train(cfg: Config, variant: Variant, *, seeds, data) -> list[dict[str, Any]]:
  """Runs one run per seed (vectorised when they share ``k``); one log per seed.

  Each log holds per-step arrays ``k``, ``lr``, ``tokens`` (after the step), ``loss``, and
  ``evals``: ``(step, tokens, validation loss)`` rows from step 0 on.
  """
  train_ids, val = data
  acfg = cfg.adaptive_config()
  shared = variant.mode != "adaptive" and variant.noise_guard is None
  groups = [list(seeds)] if shared else [[s] for s in seeds]
  logs = []
  for group in groups:
    loss_fn, params = ab.init_params(acfg, group)
    keys = jnp.stack([jax.random.key(10_000 + int(s)) for s in group])
    out = jax.tree.map(np.asarray, _train(params, keys, train_ids, val, cfg=cfg,
                                          variant=variant, loss_fn=loss_fn))
    steps_run = int(np.sum(out["k"] > 0))
    for i, seed in enumerate(group):
      val_i = out["val"][:steps_run, i]
      at = np.nonzero(np.isfinite(val_i))[0]
      evals = np.concatenate([[[0, 0, out["val0"][i]]],
                              np.stack([at + 1, out["tokens"][at], val_i[at]], axis=1)])
      logs.append({"k": out["k"][:steps_run], "lr": out["lr"][:steps_run],
                   "tokens": out["tokens"][:steps_run], "loss": out["loss"][:steps_run, i],
                   "evals": evals, "seed": seed,
                   "level_cap": out["level_cap"][:steps_run],
                   "b_simple": out["b_simple"][:steps_run]})
  return logs


def summary(log: dict[str, Any]) -> dict[str, float]:
  """Final validation loss, optimizer steps and tokens of one run."""
  return {"final_val": float(log["evals"][-1, 2]), "steps": int(len(log["k"])),
          "tokens": int(log["tokens"][-1]), "final_k": int(log["k"][-1])}


def plot(logs: dict[str, list[dict]], cfg: Config, path: pathlib.Path, title: str = "") -> None:
  """Validation loss against tokens and against steps, and the batch against tokens."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_t, ax_s, ax_b) = plt.subplots(1, 3, figsize=(15, 4.6))
  lo = min(float(np.min(lg["evals"][:, 2])) for runs in logs.values() for lg in runs)
  for i, (name, runs) in enumerate(logs.items()):
    color = f"C{i}"
    for j, lg in enumerate(runs):
      lab = name if j == 0 else None
      ev = lg["evals"]
      ax_t.plot(ev[:, 1], ev[:, 2], color=color, lw=1, label=lab)
      ax_s.plot(np.maximum(ev[:, 0], 1), ev[:, 2], color=color, lw=1, label=lab)
      if j == 0:
        ax_b.plot(lg["tokens"], lg["k"] * cfg.micro_batch_size, color=color, lw=1, label=lab)
  ax_t.set(xlabel="tokens seen", ylabel="validation loss")
  ax_s.set(xlabel="optimizer steps", ylabel="validation loss")
  for ax in (ax_t, ax_s):
    ax.set_ylim(lo - 0.05, lo + 0.6)
  ax_b.set(yscale="log", xlabel="tokens seen", ylabel="batch (sequences)")
  for ax in (ax_t, ax_s, ax_b):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(title or f"char LM ({cfg.layers} layers, d {cfg.d_model}), AdamW, cosine "
               f"with warm-up, {cfg.tokens:,} tokens", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(cfg: Config = Config(), *, out_dir: pathlib.Path | str = OUT_DIR,
         verbose: bool = True) -> dict[str, Any]:
  """Trains cosine, Seesaw, the ramp and AdaptiveBatch for one seed; plots; returns numbers."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  data = ab.load_data(cfg.adaptive_config())
  logs = {mode: train(cfg, Variant(mode=mode), seeds=[cfg.seed], data=data)
          for mode in MODES}
  path = out_dir / "seesaw_lm.png"
  plot(logs, cfg, path)
  results = {mode: summary(runs[0]) for mode, runs in logs.items()}
  if verbose:
    print(f"{rule(cfg)}\nbudget {cfg.tokens:,} tokens; AdamW lr {cfg.learning_rate}, "
          f"weight decay {cfg.weight_decay}")
    for mode, s in results.items():
      print(f"{mode:>9}: final val {s['final_val']:.4f}, {s['steps']:5d} steps, "
            f"{s['tokens']:,} tokens, last k {s['final_k']}")
    print(f"plot: {path}")
  return {"logs": logs, "summary": results, "plot": path}


def _parse(argv=None) -> tuple[Config, pathlib.Path]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
  for field in dataclasses.fields(Config):
    parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default))
  parser.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
  args = parser.parse_args(argv)
  cfg = TINY if args.tiny else Config()
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
               if getattr(args, f.name) is not None}
  return dataclasses.replace(cfg, **overrides), args.out_dir


if __name__ == "__main__":
  config, out = _parse()
  main(config, out_dir=out)
