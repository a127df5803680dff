"""Flax NNX training step with gradient accumulation: ``jaxaccum.nnx.value_and_grad``.

A small CNN with GroupNorm and dropout learns scikit-learn's 8x8 digits (shipped with the
package, so this runs offline). Each step takes a batch of 64 as 8 micro-batches of 8 in
one jitted ``lax.scan``; ``nnx.Optimizer`` applies the accumulated gradients. Dropout draws
a fresh mask for every micro-batch from the model's ``nnx.Rngs`` stream, which advances
between steps.

Before training it checks the accumulated loss and gradients against the full batch with
dropout switched off (GroupNorm is per example, so they agree to float32 round-off).

  python examples/nnx_train.py            # a few seconds on a CPU
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import jaxaccum


class CNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, *, dropout: float = 0.2):
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.norm1 = nnx.GroupNorm(16, num_groups=4, rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
    self.norm2 = nnx.GroupNorm(32, num_groups=4, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.norm1(self.conv1(x)))
    x = jax.nn.relu(self.norm2(self.conv2(x)))
    return self.head(self.drop(x.mean(axis=(1, 2))))


def loss_fn(model, batch):
  logits = model(batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["label"])}


def load(seed: int):
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  test, train = order[:300], order[300:]
  return (x[train], y[train]), (x[test], y[test])


@functools.partial(nnx.jit, static_argnums=0)
def create(seed: int) -> tuple[CNN, nnx.Optimizer]:
  """The model and its optimizer, built under jit: one compile, not one per initialiser."""
  model = CNN(nnx.Rngs(params=seed, dropout=seed + 1))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def main(steps: int = 150, batch_size: int = 64, num_micro_batches: int = 8,
         seed: int = 0) -> dict:
  (x_train, y_train), (x_test, y_test) = load(seed)
  model, optimizer = create(seed)
  grad_fn = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=num_micro_batches,
                                        has_aux=True)

  @nnx.jit
  def train_step(model, optimizer, batch):
    (loss, metrics), grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    return loss, metrics

  # Accumulation is exact where the full batch is defined: dropout off, GroupNorm.
  first = {"image": x_train[:batch_size], "label": y_train[:batch_size]}
  model.eval()
  (loss, _), grads = nnx.jit(grad_fn)(model, first)
  (ref_loss, _), ref_grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model, first)
  # (in NumPy on the host: jnp would compile a small program for every leaf's shape)
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
             zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
  print(f"check, dropout off: loss {float(loss):.6f} vs full batch {float(ref_loss):.6f}, "
        f"max |grad - full-batch grad| = {diff:.2e}")
  model.train()

  rng = np.random.default_rng(seed)
  losses = []
  for step in range(steps):
    idx = rng.choice(len(x_train), batch_size, replace=False)
    loss, metrics = train_step(model, optimizer, {"image": x_train[idx], "label": y_train[idx]})
    losses.append(float(loss))
    if step % max(1, steps // 5) == 0 or step == steps - 1:
      print(f"step {step:4d}: loss {losses[-1]:.4f}, "
            f"batch accuracy {float(metrics['accuracy']):.3f}")

  model.eval()
  test_accuracy = float(np.mean(np.asarray(nnx.jit(lambda m, x: m(x).argmax(-1))(model, x_test))
                                == y_test))
  print(f"test accuracy {test_accuracy:.3f} after {steps} steps of {num_micro_batches} "
        f"micro-batches of {batch_size // num_micro_batches}")
  return {"grad_diff": diff, "losses": losses, "test_accuracy": test_accuracy}


if __name__ == "__main__":
  main()
