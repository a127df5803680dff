"""A mixture-of-experts character LM: a loss of three terms, and bad micro-batches skipped.

The model (pure JAX, parameters in a dict) embeds characters, runs one causal
self-attention layer and one mixture-of-experts MLP layer with top-1 routing (Switch
Transformer style: each token goes to the expert its router scores highest, scaled by
that expert's router probability), then predicts the next character. The data pipeline
is the one of ``examples/char_lm.py``: random stretches of the Python standard library's
source, right-padded, so micro-batches hold different numbers of real tokens.

The loss has three terms, each normalised its own way over the accumulated batch by
``jaxaccum.value_and_grad(..., reduce=jaxaccum.Terms({"ce": "weighted", "lb": "mean",
"z": "sum"}, weights={"lb": 0.01, "z": 1e-3}))``:

* ``ce``: the next-character cross-entropy, the token mean over the whole batch
  (``fun`` returns ``(summed loss, number of real tokens)``);
* ``lb``: the load-balancing loss ``E * sum_e f_e * P_e`` (``f_e`` the fraction of the
  micro-batch's real tokens routed to expert ``e``, ``P_e`` their mean router probability),
  a statistic of each micro-batch, averaged over micro-batches;
* ``z``: the router z-loss, ``logsumexp(router logits)**2`` summed over real tokens.

With ``with_info=True`` each term's value comes back in ``info.terms``; with
``skip_nonfinite=True`` a micro-batch whose loss or gradients are not finite adds nothing
and ``info.skipped`` counts it. Two runs from one initialisation, by one compiled step:

* ``clean``;
* ``poisoned``: every ``poison_every`` steps one or two micro-batches get a NaN in a row's
  token weights (the loss mask), as a corrupt example would. The run trains through them.

It writes ``examples/out/moe_lm.png`` (the total loss of both runs, and each term) and
prints how many micro-batches were skipped.

  python examples/moe_lm.py           # about a minute on a laptop CPU
  python examples/moe_lm.py --tiny    # seconds: a smoke run for the tests
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
import char_lm  # noqa: E402  (the sibling example: data pipeline)

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
RUNS = ("clean", "poisoned")
TERMS = ("ce", "lb", "z")
REDUCE = {"ce": "weighted", "lb": "mean", "z": "sum"}


@dataclasses.dataclass(frozen=True)
class Config:
  """What to train; the defaults run in about a minute on a laptop CPU."""

  steps: int = 150
  batch_size: int = 32
  num_micro_batches: int = 8
  seq_len: int = 64
  min_len: int = 8
  d_model: int = 64
  heads: int = 4
  experts: int = 4
  hidden: int = 128
  learning_rate: float = 3e-3
  lb_weight: float = 0.01
  z_weight: float = 1e-3
  poison_every: int = 10  # poisoned run: bad micro-batches at steps 0, k, 2k, ...
  max_chars: int = 2_000_000
  seed: int = 0


TINY = Config(steps=6, batch_size=8, num_micro_batches=4, seq_len=16, min_len=4, d_model=16,
              heads=2, experts=4, hidden=16, learning_rate=1e-2, poison_every=2,
              max_chars=50_000)


# ----------------------------------------------------------------------------- model


@functools.partial(jax.jit, static_argnums=0)  # one compile, not one per random draw
def init_params(cfg: Config) -> dict:
  """The model's parameters: a dict of float32 arrays (fresh buffers on every call)."""
  d, e, h, v = cfg.d_model, cfg.experts, cfg.hidden, char_lm.VOCAB
  keys = iter(jax.random.split(jax.random.key(cfg.seed), 8))

  def dense(*shape):
    return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[-2])

  return {
      "embed": 0.02 * jax.random.normal(next(keys), (v, d)),
      "pos": 0.02 * jax.random.normal(next(keys), (cfg.seq_len, d)),
      "attn": {"norm": jnp.ones(d), "qkv": dense(d, 3 * d), "out": dense(d, d)},
      "moe": {"norm": jnp.ones(d), "router": dense(d, e), "router_bias": jnp.zeros(e),
              "up": dense(e, d, h), "down": dense(e, h, d)},
      "norm_f": jnp.ones(d),
      "unembed": dense(d, v),
  }


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def forward(params: dict, inputs: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
  """``(next-character logits, router logits)`` for ``inputs`` of shape ``(rows, time)``."""
  b, t = inputs.shape
  x = params["embed"][inputs] + params["pos"][:t]
  d = x.shape[-1]
  a = params["attn"]
  q, k, v = (z.reshape(b, t, heads, d // heads)
             for z in jnp.split(_rms_norm(x, a["norm"]) @ a["qkv"], 3, axis=-1))
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  x = x + jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d) @ a["out"]
  m = params["moe"]
  h = _rms_norm(x, m["norm"])
  router_logits = h @ m["router"] + m["router_bias"]
  probs = jax.nn.softmax(router_logits, axis=-1)
  # Top-1: each token goes to its best expert, weighted by that expert's probability.
  dispatch = jax.nn.one_hot(jnp.argmax(router_logits, -1), probs.shape[-1]) * probs
  # Every expert runs on every token (small model); the dispatch weights select one.
  hidden = jax.nn.gelu(jnp.einsum("btd,edh->bteh", h, m["up"]))
  x = x + jnp.einsum("bteh,ehd,bte->btd", hidden, m["down"], dispatch)
  return _rms_norm(x, params["norm_f"]) @ params["unembed"], router_logits


def loss_terms(params: dict, batch: dict, *, heads: int) -> dict:
  """The three loss terms of one (micro-)batch, as ``reduce=REDUCE`` expects them.

  ``ce``: (summed cross-entropy over real target tokens, their number); ``lb``: the
  load-balancing loss of this (micro-)batch's real tokens; ``z``: the router z-loss
  summed over real tokens.
  """
  logits, router_logits = forward(params, batch["inputs"], heads)
  mask = batch["mask"]
  tokens = jnp.sum(mask)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  num_experts = router_logits.shape[-1]
  probs = jax.nn.softmax(router_logits, axis=-1)
  routed = jax.nn.one_hot(jnp.argmax(router_logits, -1), num_experts)
  frac = jnp.sum(routed * mask[..., None], axis=(0, 1)) / tokens  # f_e (no gradient)
  mean_prob = jnp.sum(probs * mask[..., None], axis=(0, 1)) / tokens  # P_e
  z = jax.nn.logsumexp(router_logits, axis=-1) ** 2
  return {"ce": (jnp.sum(ce * mask), tokens),
          "lb": num_experts * jnp.sum(frac * mean_prob),
          "z": jnp.sum(z * mask)}


def loss_weights(cfg: Config) -> dict[str, float]:
  return {"lb": cfg.lb_weight, "z": cfg.z_weight}


def make_step(cfg: Config, tx: optax.GradientTransformation):
  """The jitted train step ``(params, opt_state, batch) -> (params, opt_state, logs)``.

  ``step.traces`` counts its traces (each one a compiled program).
  """
  vg = jaxaccum.value_and_grad(
      functools.partial(loss_terms, heads=cfg.heads), num_micro_batches=cfg.num_micro_batches,
      reduce=jaxaccum.Terms(REDUCE, weights=loss_weights(cfg)), with_info=True, skip_nonfinite=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    traces.append(None)  # Python runs here once per trace, not once per call
    loss, grads, info = vg(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    logs = {"loss": loss, "skipped": info.skipped, **info.terms}
    return optax.apply_updates(params, updates), opt_state, logs

  traces = []
  step.traces = traces
  return step


# ------------------------------------------------------------------------------ data


def make_batches(cfg: Config) -> list[dict]:
  """``cfg.steps`` batches of ``cfg.batch_size`` padded sequences (see char_lm.py)."""
  corpus = char_lm.load_corpus(cfg.max_chars)
  rng = np.random.default_rng(cfg.seed)
  return [char_lm.sample_batch(rng, corpus, cfg) for _ in range(cfg.steps)]


def poison(batches: list[dict], cfg: Config) -> tuple[list[dict], list[list[int]]]:
  """Copies of ``batches`` with NaN token weights in some micro-batches.

  At steps ``0, k, 2k, ...`` (``k = poison_every``) one micro-batch, and at every second
  such step two, get a NaN in the mask of one of their rows (row ``i`` is in micro-batch
  ``i % N``). Returns the batches and, per step, the micro-batches poisoned.
  """
  n = cfg.num_micro_batches
  out, bad = [], []
  for s, batch in enumerate(batches):
    micro = []
    if s % cfg.poison_every == 0:
      j = s // cfg.poison_every
      micro = sorted({j % n, (j + 1) % n} if j % 2 else {j % n})
    batch = dict(batch)
    if micro:
      mask = batch["mask"].copy()
      for i in micro:
        mask[i, 0] = np.nan  # row i < N lies in micro-batch i
      batch["mask"] = mask
    out.append(batch)
    bad.append(micro)
  return out, bad


# -------------------------------------------------------------------------- reporting


def plot(logs: dict[str, dict[str, np.ndarray]], bad: list[list[int]], cfg: Config,
         path: pathlib.Path) -> None:
  """The total loss of both runs and each term, against steps; poisoned steps marked."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
  panels = [("loss", "total loss"), ("ce", "ce: token-mean cross-entropy"),
            ("lb", "lb: load balancing (mean over micro-batches)"),
            ("z", "z: router z-loss (sum over tokens)")]
  poisoned = [s for s, micro in enumerate(bad) if micro]
  for ax, (key, title) in zip(axes.flat, panels, strict=True):
    for run, style in zip(RUNS, (dict(color="C0", lw=2, alpha=0.6),
                                 dict(color="C3", lw=1, ls="--")), strict=True):
      ax.plot(logs[run][key], label=run, **style)
    for s in poisoned:
      ax.axvline(s, color="C3", alpha=0.12, lw=1)
    ax.set(title=title, yscale="log" if key == "z" else "linear")
    ax.grid(alpha=0.3)
  axes[0, 0].legend(title="(shaded: steps with NaN micro-batches)", fontsize=8,
                    title_fontsize=8)
  for ax in axes[1]:
    ax.set(xlabel="optimizer step")
  skipped = int(logs["poisoned"]["skipped"].sum())
  fig.suptitle(f"MoE char LM, {cfg.experts} experts top-1, batch {cfg.batch_size} = "
               f"{cfg.num_micro_batches} micro-batches; loss = ce + {cfg.lb_weight} lb + "
               f"{cfg.z_weight} z; {skipped} bad micro-batches skipped", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(cfg: Config = Config(), *, out_dir: pathlib.Path | str = OUT_DIR,
         progress: bool = True, verbose: bool = True) -> dict[str, Any]:
  """Trains both runs, saves the plot, prints a summary; returns the numbers.

  Returns a dict with ``logs`` (run name -> per-step arrays ``loss``, ``skipped``,
  ``ce``, ``lb``, ``z``), ``bad`` (per step, the micro-batches poisoned in the poisoned
  run), ``injected`` (their total), ``lb_full_batch`` (the load-balancing loss of the
  first whole batch at initialisation, to compare with the per-micro-batch mean
  ``logs["clean"]["lb"][0]``), ``compiled_programs`` and ``plot``.
  """
  from tqdm import tqdm

  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  clean = make_batches(cfg)
  poisoned, bad = poison(clean, cfg)
  params0 = init_params(cfg)
  lb_full = float(jax.jit(functools.partial(loss_terms, heads=cfg.heads))(params0,
                                                                          clean[0])["lb"])
  tx = optax.adam(cfg.learning_rate)
  step = make_step(cfg, tx)
  logs = {}
  for run, batches in zip(RUNS, (clean, poisoned), strict=True):
    params = init_params(cfg)  # fresh buffers (the step donates its parameters)
    opt_state = tx.init(params)
    per_step, skipped = [], 0
    bar = tqdm(batches, desc=f"{run} run", disable=not progress)
    for s, batch in enumerate(bar):
      params, opt_state, lg = step(params, opt_state, batch)
      per_step.append(lg)
      if run == "poisoned":
        skipped += int(lg["skipped"])
      if s % 10 == 0 or s == len(batches) - 1:
        bar.set_postfix(loss=f"{float(lg['loss']):.3f}", skipped=skipped)
    logs[run] = {key: np.asarray([np.asarray(lg[key]) for lg in per_step])
                 for key in per_step[0]}
  injected = sum(len(micro) for micro in bad)
  plot_path = out_dir / "moe_lm.png"
  plot(logs, bad, cfg, plot_path)
  result = {"logs": logs, "bad": bad, "injected": injected, "lb_full_batch": lb_full,
            "compiled_programs": len(step.traces), "plot": plot_path}
  if verbose:
    for run in RUNS:
      lg = logs[run]
      print(f"{run:>8}: final loss {lg['loss'][-1]:.4f} (ce {lg['ce'][-1]:.4f}, lb "
            f"{lg['lb'][-1]:.4f}, z {lg['z'][-1]:.2f}); micro-batches skipped: "
            f"{int(lg['skipped'].sum())}")
    print(f"bad micro-batches injected into the poisoned run: {injected} over "
          f"{sum(1 for m in bad if m)} steps; non-finite losses: "
          f"{int(np.sum(~np.isfinite(logs['poisoned']['loss'])))}")
    print(f"load-balancing loss at initialisation, first batch: mean over "
          f"{cfg.num_micro_batches} micro-batches {logs['clean']['lb'][0]:.4f}, over the "
          f"whole batch at once {lb_full:.4f}")
    print(f"plot: {plot_path}")
  return result


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
