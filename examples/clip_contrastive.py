"""A two-tower contrastive model (CLIP's loss) on scikit-learn's digits, accumulated exactly.

Each digit is seen in two "modalities": view A, the 8x8 image shifted by a pixel at random
with pixel noise, for the image tower; view B, the same digit's image transposed, blurred
and noised, for the other tower. The model learns to match the two views of each digit
against every other digit of the batch: CLIP's symmetric InfoNCE over the batch's B x B
similarities, with a learned temperature. The loss couples the batch's rows (the other
rows are the negatives), so the ordinary accumulation computes another loss; three runs
from the same initialisation, on the same batches:

* **full batch**: ``jax.value_and_grad`` of the loss on the whole batch;
* **cached** (:func:`jaxaccum.cached_value_and_grad`): the towers run over ``N``
  micro-batches, the loss once on the whole batch's embeddings; the same numbers as the
  full batch, to float32 round-off, with one micro-batch of the towers' activations live;
* **plain** (:func:`jaxaccum.value_and_grad` of the same loss): each micro-batch's InfoNCE
  against its own rows only, averaged: fewer negatives, another loss and another gradient
  (its curve shows the full batch's loss at its parameters).

It prints the first step's gradient differences and the final retrieval accuracy (view A
of a held-out digit finds its own view B among the test set's), and plots the loss curves
to ``examples/out/clip_contrastive.png``.

  python examples/clip_contrastive.py               # 150 steps of 128 rows, under a minute
  python examples/clip_contrastive.py --steps 600   # a longer run
"""

from __future__ import annotations

import argparse
import functools
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
RUNS = ("full batch", "cached", "plain")


def load_digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Train and test images of the digits, ``(n, 8, 8)`` float32 in [0, 1]."""
  from sklearn.datasets import load_digits as sk_load_digits
  from sklearn.model_selection import train_test_split

  data = sk_load_digits()
  x = (data.images / 16.0).astype(np.float32)
  x_tr, x_te = train_test_split(x, test_size=0.2, random_state=seed, stratify=data.target)
  return x_tr, x_te


def views(images: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """The two views of each image: ``a`` (shifted by up to a pixel, noised) and ``b``
  (transposed, blurred, noised), each flattened to 64 features."""
  n = len(images)
  padded = np.pad(images, ((0, 0), (1, 1), (1, 1)))
  dy, dx = rng.integers(0, 3, n), rng.integers(0, 3, n)
  a = np.stack([padded[i, dy[i]:dy[i] + 8, dx[i]:dx[i] + 8] for i in range(n)])
  t = np.transpose(images, (0, 2, 1))
  b = (t + np.roll(t, 1, axis=1) + np.roll(t, 1, axis=2)) / 3
  noise = 0.1 * rng.standard_normal((2, n, 8, 8)).astype(np.float32)
  return {"a": (a + noise[0]).reshape(n, 64), "b": (b + noise[1]).reshape(n, 64)}


def init(key: jax.Array, hidden: int = 64, dim: int = 32) -> dict[str, Any]:
  """Two MLP towers (64 -> hidden -> dim) and CLIP's learned log-temperature."""
  ks = jax.random.split(key, 4)

  def tower(k1, k2):
    return {"w1": jax.random.normal(k1, (64, hidden)) / 8.0, "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, dim)) / np.sqrt(hidden)}

  return {"a": tower(ks[0], ks[1]), "b": tower(ks[2], ks[3]),
          "log_t": jnp.asarray(np.log(10.0), jnp.float32)}


def encode(params: dict, batch: dict) -> dict[str, jax.Array]:
  """Each view through its tower: unit-norm embeddings, one row per example."""
  def tower(p, x):
    z = jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)
  return {"a": tower(params["a"], batch["a"]), "b": tower(params["b"], batch["b"])}


def clip_loss(params: dict, reps: dict, batch: dict) -> jax.Array:
  """CLIP's symmetric InfoNCE: row i of view A against every row of view B, and back."""
  del batch
  logits = jnp.exp(params["log_t"]) * reps["a"] @ reps["b"].T
  diag = jnp.diagonal(logits)
  return (jnp.mean(jax.nn.logsumexp(logits, axis=1) - diag)
          + jnp.mean(jax.nn.logsumexp(logits, axis=0) - diag)) / 2


def whole_loss(params: dict, batch: dict) -> jax.Array:
  return clip_loss(params, encode(params, batch), batch)


def value_and_grads(num_micro_batches: int) -> dict[str, Any]:
  """The three ways to compute the step's loss and gradients."""
  return {
      "full batch": jax.value_and_grad(whole_loss),
      "cached": jaxaccum.cached_value_and_grad(encode, clip_loss,
                                               num_micro_batches=num_micro_batches),
      "plain": jaxaccum.value_and_grad(whole_loss, num_micro_batches=num_micro_batches),
  }


def relative_l2(a: Any, b: Any) -> float:
  """``|a - b| / |b|`` over all leaves, in float64 on the host."""
  diff = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  size = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
  return float(np.sqrt(diff / size))


full_loss = jax.jit(whole_loss)


@jax.jit
def retrieval_accuracy(params: dict, batch: dict) -> jax.Array:
  """How often view A's nearest view B (by cosine) is the same digit's."""
  reps = encode(params, batch)
  return jnp.mean(jnp.argmax(reps["a"] @ reps["b"].T, axis=1) == jnp.arange(len(reps["a"])))


def plot(curves: dict, path: pathlib.Path, batch: int, n: int) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  styles = {"full batch": dict(lw=3, alpha=0.45), "cached": dict(lw=1.2, ls="--"),
            "plain": dict(lw=1.2, alpha=0.8)}
  for name in RUNS:
    ax.plot(np.arange(len(curves[name])), curves[name], **styles[name], label=name)
  ax.set(title=f"CLIP loss, batch {batch}: full batch, cached and plain over {n} micro-batches",
         xlabel="optimizer step", ylabel="the batch's InfoNCE before the step",
         yscale="log")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(*, steps: int = 150, batch_size: int = 128, num_micro_batches: int = 8,
         lr: float = 3e-3, seed: int = 0, out_dir: pathlib.Path | str = OUT_DIR,
         verbose: bool = True) -> dict[str, Any]:
  """Trains the three runs; returns their loss curves, the first step's gradient gaps and
  the final retrieval accuracies.

  Returns a dict with ``curves[run]`` (per-step losses of the whole batch, before the step:
  for ``"plain"`` the full batch's loss at its parameters, not the loss it minimises),
  ``grad_gap[run]`` (the first
  step's relative L2 difference from the full batch's gradient), ``accuracy[run]`` and
  ``plot``.
  """
  if batch_size % num_micro_batches:
    raise ValueError(f"batch_size={batch_size} must be a multiple of "
                     f"num_micro_batches={num_micro_batches}.")
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  x_tr, x_te = load_digits(seed)
  rng = np.random.default_rng(seed)
  tx = optax.adam(lr)
  params0 = init(jax.random.key(seed))
  vgs = value_and_grads(num_micro_batches)

  @functools.partial(jax.jit, static_argnums=0)
  def step(name, params, opt_state, batch):
    loss, grads = vgs[name](params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  state = {name: (params0, tx.init(params0)) for name in RUNS}
  curves: dict[str, list[float]] = {name: [] for name in RUNS}
  grad_gap: dict[str, float] = {}
  for t in range(steps):
    idx = rng.choice(len(x_tr), batch_size, replace=False)
    batch = views(x_tr[idx], rng)
    first = {}
    for name in RUNS:
      before = state[name][0]
      params, opt_state, loss, grads = step(name, *state[name], batch)
      state[name] = (params, opt_state)
      # plain's own loss is another one (each micro-batch's negatives): plot the batch's
      curves[name].append(float(loss if name != "plain" else full_loss(before, batch)))
      first[name] = grads
    if t == 0:
      grad_gap = {name: relative_l2(first[name], first["full batch"]) for name in RUNS}
  test = views(x_te, np.random.default_rng(seed + 1))
  accuracy = {name: float(retrieval_accuracy(state[name][0], test)) for name in RUNS}
  path = out_dir / "clip_contrastive.png"
  plot(curves, path, batch_size, num_micro_batches)
  if verbose:
    full, cached = np.asarray(curves["full batch"]), np.asarray(curves["cached"])
    print(f"batch {batch_size} = {num_micro_batches} micro-batches of "
          f"{batch_size // num_micro_batches}, {steps} steps of Adam({lr:g})")
    print(f"first step's gradient, relative L2 difference from the full batch's: cached "
          f"{grad_gap['cached']:.1e}, plain value_and_grad {grad_gap['plain']:.3f}")
    print(f"largest relative loss-curve gap, cached vs full batch: "
          f"{np.max(np.abs(cached - full) / full):.1e}")
    print("test retrieval accuracy (view A finds its view B among "
          f"{len(x_te)}): " + ", ".join(f"{name} {accuracy[name]:.1%}" for name in RUNS))
    print(f"plot: {path}")
  return {"curves": curves, "grad_gap": grad_gap, "accuracy": accuracy, "plot": path}


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--num-micro-batches", type=int, default=8)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
  args = parser.parse_args()
  main(steps=args.steps, batch_size=args.batch_size, num_micro_batches=args.num_micro_batches,
       lr=args.lr, seed=args.seed, out_dir=args.out_dir)
