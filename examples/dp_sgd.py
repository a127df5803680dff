"""DP-SGD on scikit-learn's digits: per-example clipping over a large accumulated batch.

DP-SGD (Abadi et al., 2016) clips each example's gradient to an L2 norm ``C``, averages
the clipped gradients over a large batch of ``B`` examples and adds Gaussian noise of
standard deviation ``noise_multiplier * C / B`` to the mean, once per step. Privacy
accounting favours large batches, which is where accumulation comes in: here a logical
batch of 512 rows is processed as ``N`` micro-batches by :func:`jaxaccum.grad` with
``per_example_transform=jaxaccum.clip_per_example(C)``, which differentiates each
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

  python examples/dp_sgd.py                    # 300 steps of 512, about a minute on a CPU
  python examples/dp_sgd.py --noise-multiplier 0 --steps 100
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
                       per_example_transform=jaxaccum.clip_per_example(cfg.clip))


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
  clip = jaxaccum.clip_per_example(cfg.clip)
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


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  defaults = Config()
  for f in dataclasses.fields(Config):
    parser.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                        default=getattr(defaults, f.name))
  main(Config(**vars(parser.parse_args())))
