"""DP-SGD on scikit-learn's digits: per-example clipping over a large accumulated batch.

DP-SGD (Abadi et al., 2016) clips each example's gradient to an L2 norm ``C``, averages
the clipped gradients over a large batch of ``B`` examples and adds Gaussian noise of
standard deviation ``noise_multiplier * C / B`` to the mean, once per step. Privacy
accounting favours large batches, which is where accumulation comes in: here a logical
batch of 512 rows is processed as ``N`` micro-batches by :func:`jaxaccum.grad` with
``per_example=jaxaccum.dp.clip_per_example(C)``, which differentiates each
micro-batch's rows one by one under :func:`jax.vmap` (so memory holds one micro-batch's
per-example gradients, not 512 of them) and returns the mean of the clipped gradients.
The noise is drawn once per step from a key folded with the step number.

Before training, the accumulated clipped gradient is checked against a per-example Python
loop (``jax.grad`` on each row alone, clipped, averaged). It prints the check, the noise
multiplier and the test accuracy of the MLP.

A privacy accountant, which turns (noise multiplier, sampling rate, steps) into an
(epsilon, delta) guarantee, is out of scope: use Google's ``dp_accounting`` (the RDP and
PLD accountants), Opacus' RDP accountant (``opacus.accountants``) or
``tensorflow_privacy``'s ``compute_dp_sgd_privacy``. Their guarantees assume the batches
are sampled as the accountant says (Poisson sampling for most); this example shuffles
fixed-size batches for simplicity.

The transformer case (``--transformer``) compares, on a small causal LM with tied input and
output embeddings, LayerNorm and its layers in one ``lax.scan``, the clipped step by
``clip_per_example(C, method=...)`` with ``"ghost"`` (each example's norm from the
activations and output gradients of the layers that use each parameter, no per-example
gradient formed) and ``"materialize"`` against plain accumulation: it checks that both
methods give the same clipped mean, then prints each step's compiled temporary memory and
its median time.

  python examples/dp_sgd.py                    # 300 steps of 512, about a minute on a CPU
  python examples/dp_sgd.py --noise-multiplier 0 --steps 100
  python examples/dp_sgd.py --transformer      # the memory and time table
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum


@dataclasses.dataclass(frozen=True)
class Config:
  steps: int = 300
  batch_size: int = 512  # the logical batch B
  num_micro_batches: int = 8  # N: the vmap width is B / N
  hidden: int = 64
  clip: float = 1.0  # C
  noise_multiplier: float = 1.1
  learning_rate: float = 2e-3
  seed: int = 0


def load_digits(seed: int = 0):
  """Train/test splits of the digits as float32 rows of 64 pixels in [0, 1]."""
  from sklearn.datasets import load_digits as sk_load_digits
  from sklearn.model_selection import train_test_split

  data = sk_load_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed,
                                            stratify=y)
  return (x_tr, y_tr), (x_te, y_te)


@functools.partial(jax.jit, static_argnums=1)  # one compile, not one per operation
def init_params(key: jax.Array, hidden: int) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, hidden)) / 8.0, "b1": jnp.zeros(hidden),
          "w2": jax.random.normal(k2, (hidden, 10)) / np.sqrt(hidden), "b2": jnp.zeros(10)}


def logits_fn(params, x):
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params, batch):
  """The mean cross-entropy over the rows of ``batch``: one row under the transform."""
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()


def add_noise(grads: Any, key: jax.Array, std: Any) -> Any:
  """``grads`` plus Gaussian noise of standard deviation ``std``, one key per leaf."""
  leaves, treedef = jax.tree.flatten(grads)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [g + std * jax.random.normal(k, g.shape, g.dtype)
                                      for g, k in zip(leaves, keys, strict=True)])


def clipped_mean(cfg: Config):
  """The mean over the batch of the per-example gradients clipped to ``cfg.clip``."""
  return jaxaccum.grad(loss_fn, num_micro_batches=cfg.num_micro_batches,
                       per_example=jaxaccum.dp.clip_per_example(cfg.clip))


def make_step(cfg: Config, optimizer: optax.GradientTransformation):
  grad_fn = clipped_mean(cfg)
  std = cfg.noise_multiplier * cfg.clip / cfg.batch_size  # the noise on the mean

  @jax.jit
  def step(params, opt_state, batch, key):
    grads = add_noise(grad_fn(params, batch), key, std)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss_fn(params, batch)

  return step


def per_example_loop(cfg: Config, params, batch):
  """The reference: each row's gradient on its own, clipped, then the mean."""
  clip = jaxaccum.dp.clip_per_example(cfg.clip)
  # Jitted: one compile for a row's clipped gradient and one for the running sum, instead
  # of each of their operations dispatched (and compiled for its shape) one at a time.
  clipped_one = jax.jit(lambda p, row: clip(jax.grad(loss_fn)(p, row)))
  add = jax.jit(lambda total, g: jax.tree.map(jnp.add, total, g))
  x, y = (np.asarray(a) for a in batch)  # rows sliced on the host
  total = None
  for j in range(x.shape[0]):
    g = clipped_one(params, (x[j:j + 1], y[j:j + 1]))
    total = g if total is None else add(total, g)
  return jax.tree.map(lambda t: t / x.shape[0], total)


@jax.jit
def _predict(params, x):
  return jnp.argmax(logits_fn(params, x), axis=-1)


def accuracy(params, x, y) -> float:
  return float(np.mean(np.asarray(_predict(params, x)) == np.asarray(y)))


def main(cfg: Config = Config(), *, verbose: bool = True) -> dict[str, Any]:
  if cfg.batch_size % cfg.num_micro_batches:
    raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of "
                     f"num_micro_batches={cfg.num_micro_batches}.")
  (x_tr, y_tr), (x_te, y_te) = load_digits(cfg.seed)
  rng = np.random.default_rng(cfg.seed)
  key = jax.random.key(cfg.seed)
  params = init_params(jax.random.fold_in(key, 0), cfg.hidden)
  noise_key = jax.random.fold_in(key, 1)

  def batch_at():
    idx = rng.choice(len(x_tr), cfg.batch_size, replace=False)
    return jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx])

  first = batch_at()
  accumulated = jax.jit(clipped_mean(cfg))(params, first)
  reference = per_example_loop(cfg, params, first)
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(r)))) for a, r in
             zip(jax.tree.leaves(accumulated), jax.tree.leaves(reference), strict=True))
  scale = max(float(np.max(np.abs(np.asarray(r)))) for r in jax.tree.leaves(reference))
  if diff > 1e-5 * scale + 1e-7:
    raise AssertionError(f"accumulated clipped gradient differs from the per-example loop "
                         f"by {diff:.3g} (scale {scale:.3g})")
  if verbose:
    print(f"check: clipped mean over {cfg.batch_size} rows in {cfg.num_micro_batches} "
          f"micro-batches of {cfg.batch_size // cfg.num_micro_batches} vs a per-example "
          f"loop: max |difference| {diff:.2e} (largest entry {scale:.2e})")

  optimizer = optax.adam(cfg.learning_rate)
  opt_state = optimizer.init(params)
  step = make_step(cfg, optimizer)
  losses = []
  start = time.perf_counter()
  batch = first
  for t in range(cfg.steps):
    params, opt_state, loss = step(params, opt_state, batch, jax.random.fold_in(noise_key, t))
    losses.append(float(loss))
    batch = batch_at()
  seconds = time.perf_counter() - start
  acc = accuracy(params, jnp.asarray(x_te), jnp.asarray(y_te))
  if verbose:
    print(f"DP-SGD: {cfg.steps} steps of {cfg.batch_size} examples, clip C={cfg.clip}, "
          f"noise multiplier {cfg.noise_multiplier} (noise std on the mean "
          f"{cfg.noise_multiplier * cfg.clip / cfg.batch_size:.2e}), {seconds:.1f} s")
    print(f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}; test accuracy {acc:.3f}")
    print("privacy accounting (epsilon, delta) is out of scope: see dp_accounting, "
          "Opacus' RDP accountant or tensorflow_privacy")
  return {"check_diff": diff, "check_scale": scale, "accuracy": acc, "losses": losses,
          "noise_multiplier": cfg.noise_multiplier}


# --- the transformer case -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LMConfig:
  batch_size: int = 32
  micro_batch_size: int = 8
  seq: int = 33  # tokens per row: 32 positions predicted
  vocab: int = 128
  d_model: int = 64
  layers: int = 2
  clip: float = 1.0
  repeats: int = 5


def lm_init(cfg: LMConfig, key: jax.Array):
  d, n = cfg.d_model, cfg.layers
  ks = jax.random.split(key, 6)

  def dense(k, *shape):
    return jax.random.normal(k, shape) / np.sqrt(shape[-2])

  params = {"embed": 0.1 * jax.random.normal(ks[0], (cfg.vocab, d)),
            "norm": jnp.ones(d),
            "layers": {"norm": jnp.ones((n, d)), "qkv": dense(ks[1], n, d, 3 * d),
                       "out": dense(ks[2], n, d, d), "up": dense(ks[3], n, d, 4 * d),
                       "down": dense(ks[4], n, 4 * d, d)}}
  tokens = jax.random.randint(ks[5], (cfg.batch_size, cfg.seq), 0, cfg.vocab)
  return params, tokens


def _layer_norm(x, scale):
  m = jnp.mean(x, axis=-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(jnp.mean(jnp.square(x - m), -1, keepdims=True) + 1e-6) * scale


def lm_loss(params, tokens):
  """Next-token cross-entropy of a causal LM: tied embeddings, its layers in one scan."""
  x, y = tokens[:, :-1], tokens[:, 1:]
  mask = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))
  h = jnp.take(params["embed"], x, axis=0)

  def block(h, w):
    a = _layer_norm(h, w["norm"])
    q, k, v = jnp.split(a @ w["qkv"], 3, axis=-1)
    s = jnp.where(mask, jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1]), -1e9)
    h = h + jax.nn.softmax(s, axis=-1) @ v @ w["out"]
    return h + jax.nn.gelu(a @ w["up"]) @ w["down"], None

  h, _ = jax.lax.scan(block, h, params["layers"])
  logits = _layer_norm(h, params["norm"]) @ params["embed"].T
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def transformer_costs(cfg: LMConfig = LMConfig(), *, verbose: bool = True) -> dict[str, Any]:
  """The memory and time of a clipped SGD step by method, against plain accumulation."""
  params, tokens = lm_init(cfg, jax.random.key(0))
  methods = {"plain": {}, **{m: {"per_example": jaxaccum.dp.clip_per_example(
      cfg.clip, method=m)} for m in ("ghost", "materialize")}}
  compiled, temp, grads = {}, {}, {}
  for name, extra in methods.items():
    grad_fn = jaxaccum.grad(lm_loss, micro_batch_size=cfg.micro_batch_size, **extra)
    def step(p, t, grad_fn=grad_fn):  # SGD; the gradient also returned, for the check
      g = grad_fn(p, t)
      return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), g

    compiled[name] = jax.jit(step).lower(params, tokens).compile()
    temp[name] = compiled[name].memory_analysis().temp_size_in_bytes
    grads[name] = compiled[name](params, tokens)[1]
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(grads["ghost"]), jax.tree.leaves(grads["materialize"]), strict=True))
  times: dict[str, list[float]] = {name: [] for name in methods}
  for _ in range(cfg.repeats):  # interleaved
    for name in methods:
      start = time.perf_counter()
      jax.block_until_ready(compiled[name](params, tokens))
      times[name].append(time.perf_counter() - start)
  table = {name: {"temp_mib": temp[name] / 2**20, "step_ms": 1e3 * float(np.median(t)),
                  "time_vs_plain": float(np.median(t) / np.median(times["plain"])),
                  "temp_vs_plain": temp[name] / max(temp["plain"], 1)}
           for name, t in times.items()}
  if verbose:
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"transformer LM, {n_params:,} parameters, batch {cfg.batch_size} in micro-batches "
          f"of {cfg.micro_batch_size}; ghost vs materialize: max |difference| {diff:.1e}")
    print("| method | temp (MiB) | step (ms, median) | time / plain | temp / plain |")
    print("|:---|---:|---:|---:|---:|")
    for name, r in table.items():
      print(f"| {name} | {r['temp_mib']:.2f} | {r['step_ms']:.1f} | {r['time_vs_plain']:.2f} "
            f"| {r['temp_vs_plain']:.2f} |")
  return {"diff": diff, "table": table}


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  defaults = Config()
  for f in dataclasses.fields(Config):
    parser.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                        default=getattr(defaults, f.name))
  parser.add_argument("--transformer", action="store_true",
                      help="print the transformer case's memory and time table instead")
  options = vars(parser.parse_args())
  if options.pop("transformer"):
    transformer_costs()
  else:
    main(Config(**options))
