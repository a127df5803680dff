"""A CNN on scikit-learn's digits: micro-batches of 2 accumulated to a batch of 32.

scikit-learn ships the 1,797 8x8 handwritten digits with the package, so this runs
offline. The same CNN is trained with a normalisation layer of each kind, once with the
full batch of 32 and once with :func:`jaxaccum.nnx.value_and_grad` over 16 micro-batches
of 2 (the same initialisation, the same batches):

* **GroupNorm** normalises each example on its own, so the accumulated gradients are the
  full-batch gradients (to float32 round-off) and the two runs coincide;
* **BatchNorm** normalises over the batch, so under accumulation each micro-batch of 2 is
  normalised with its own statistics (a "ghost batch" of 2) and the running averages are
  updated once per micro-batch: the gradients, and the training, differ from the full
  batch's (it is a different model, not a worse or better copy of the same one). When
  accumulation must reproduce the full batch, use a per-example normalisation
  (GroupNorm, LayerNorm).

It prints the largest gradient difference from the full batch at the first step and the
test accuracies, and saves the loss curves to ``examples/out/digits_cnn.png``.

  python examples/digits_cnn.py              # 4 epochs, well under a minute on a CPU
  python examples/digits_cnn.py --epochs 30  # a longer run
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
from flax import nnx

import jaxaccum

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
NORMS = ("GroupNorm", "BatchNorm")
MODES = ("full batch", "accumulated")


def load_digits(seed: int = 0):
  """Train/test splits of the digits as float32 images ``(n, 8, 8, 1)`` in [0, 1]."""
  from sklearn.datasets import load_digits as sk_load_digits
  from sklearn.model_selection import train_test_split

  data = sk_load_digits()
  x = (data.images / 16.0).astype(np.float32)[..., None]
  y = data.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed,
                                            stratify=y)
  return (x_tr, y_tr), (x_te, y_te)


class CNN(nnx.Module):
  """Two 3x3 convolutions, each followed by GroupNorm or BatchNorm, then a linear head."""

  def __init__(self, norm: str, *, rngs: nnx.Rngs):
    if norm not in NORMS:
      raise ValueError(f"norm must be one of {NORMS}, got norm={norm!r}.")

    def make_norm(c):
      if norm == "GroupNorm":
        return nnx.GroupNorm(c, num_groups=4, rngs=rngs)
      return nnx.BatchNorm(c, momentum=0.9, rngs=rngs)

    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.norm1 = make_norm(16)
    self.conv2 = nnx.Conv(16, 32, (3, 3), strides=(2, 2), rngs=rngs)
    self.norm2 = make_norm(32)
    self.head = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.norm1(self.conv1(x)))
    x = nnx.relu(self.norm2(self.conv2(x)))
    return self.head(x.mean(axis=(1, 2)))


def loss_fn(model: CNN, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@functools.partial(nnx.jit, static_argnums=(0, 1, 2))
def _create(norm: str, lr: float, seed: int) -> tuple[CNN, nnx.Optimizer]:
  """A fresh model and optimizer, built under jit: one compile instead of one per initialiser."""
  model = CNN(norm, rngs=nnx.Rngs(seed))
  return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


@functools.cache
def _accuracy_fn(graphdef: nnx.GraphDef):
  """Test accuracy of the model in a (model, optimizer) state; one compile per graph."""

  @jax.jit
  def accuracy(state, x, y):
    model, _ = nnx.merge(graphdef, state)
    model.eval()  # BatchNorm uses its running averages
    return jnp.mean(jnp.argmax(model(x), axis=-1) == y)

  return accuracy


def make_trainer(norm: str, mode: str, *, num_micro_batches: int, lr: float, seed: int):
  """A fresh model (same seed for every run), its jitted train step and its test accuracy.

  The train step returns ``(state, loss, grads)``: the gradients it applied, to compare.
  """
  graphdef, state = nnx.split(_create(norm, lr, seed))
  if mode == "full batch":
    vg = nnx.value_and_grad(loss_fn)
  else:
    vg = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=num_micro_batches)

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = vg(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, grads

  return state, train_step, _accuracy_fn(graphdef)


def _max_abs_diff(a: Any, b: Any) -> float:
  # NumPy on the host: jnp here would compile a small program for every leaf's shape.
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def plot(curves: dict, accuracy: dict, path: pathlib.Path, micro: int, batch: int) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, norm in zip(axes, NORMS, strict=True):
    for mode, style in zip(MODES, (dict(lw=3, alpha=0.5), dict(lw=1.2, ls="--")),
                           strict=True):
      losses = curves[norm][mode]
      ax.plot(np.arange(len(losses)), losses, **style,
              label=f"{mode} (test accuracy {accuracy[norm][mode]:.1%})")
    ax.set(title=f"{norm}: batch {batch} vs {batch // micro} micro-batches of {micro}",
           xlabel="optimizer step", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
  axes[0].set_ylabel("training loss")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(*, epochs: int = 4, batch_size: int = 32, micro_batch_size: int = 2, lr: float = 1e-2,
         seed: int = 0, max_steps: int | None = None, out_dir: pathlib.Path | str = OUT_DIR,
         progress: bool = True, verbose: bool = True) -> dict[str, Any]:
  """Trains the four runs; returns their loss curves, accuracies and first-step grad gaps.

  Returns a dict with ``curves[norm][mode]`` (per-step training losses),
  ``accuracy[norm][mode]`` (test accuracy at the end), ``grad_diff[norm]`` and
  ``grad_scale[norm]`` (the largest difference between the accumulated and full-batch
  gradients at the first step, and the largest full-batch gradient entry), and ``plot``.
  """
  from tqdm import tqdm

  if batch_size % micro_batch_size:
    raise ValueError(f"batch_size={batch_size} must be a multiple of "
                     f"micro_batch_size={micro_batch_size}.")
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  (x_tr, y_tr), (x_te, y_te) = load_digits(seed)
  n = batch_size // micro_batch_size
  rng = np.random.default_rng(seed)
  steps_per_epoch = len(x_tr) // batch_size
  order = np.concatenate([rng.permutation(len(x_tr))[: steps_per_epoch * batch_size]
                          for _ in range(epochs)]).reshape(-1, batch_size)
  if max_steps is not None:
    order = order[:max_steps]

  runs = {(norm, mode): make_trainer(norm, mode, num_micro_batches=n, lr=lr, seed=seed)
          for norm in NORMS for mode in MODES}
  states = {key: run[0] for key, run in runs.items()}
  curves = {norm: {mode: [] for mode in MODES} for norm in NORMS}
  first_grads = {}
  for idx in tqdm(order, desc="training (4 runs)", disable=not progress):
    batch = (x_tr[idx], y_tr[idx])
    for (norm, mode), run in runs.items():
      states[norm, mode], loss, grads = run[1](states[norm, mode], batch)
      first_grads.setdefault((norm, mode), grads)
      curves[norm][mode].append(float(loss))
  grad_diff = {norm: _max_abs_diff(first_grads[norm, "accumulated"],
                                   first_grads[norm, "full batch"]) for norm in NORMS}
  grad_scale = {norm: max(float(np.max(np.abs(np.asarray(g))))
                          for g in jax.tree.leaves(first_grads[norm, "full batch"]))
                for norm in NORMS}
  accuracy = {norm: {mode: float(runs[norm, mode][2](states[norm, mode], x_te, y_te))
                     for mode in MODES} for norm in NORMS}

  path = out_dir / "digits_cnn.png"
  plot(curves, accuracy, path, micro_batch_size, batch_size)
  if verbose:
    print(f"effective batch {batch_size} = {n} micro-batches of {micro_batch_size}, "
          f"{len(order)} steps")
    for norm in NORMS:
      full, acc = (np.asarray(curves[norm][m]) for m in MODES)
      print(f"{norm}: largest |accumulated - full-batch gradient| at the first step "
            f"{grad_diff[norm]:.1e} (largest entry {grad_scale[norm]:.1e}); largest relative "
            f"loss-curve gap {np.max(np.abs(acc - full) / full):.1e}; test accuracy "
            f"full batch {accuracy[norm]['full batch']:.1%}, accumulated "
            f"{accuracy[norm]['accumulated']:.1%}")
    print(f"plot: {path}")
  return {"curves": curves, "accuracy": accuracy, "grad_diff": grad_diff,
          "grad_scale": grad_scale, "plot": path}


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--epochs", type=int, default=4, help="more epochs for a longer run")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--micro-batch-size", type=int, default=2)
  parser.add_argument("--lr", type=float, default=1e-2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
  args = parser.parse_args()
  main(epochs=args.epochs, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
       lr=args.lr, seed=args.seed, out_dir=args.out_dir)
