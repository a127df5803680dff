"""Flax Linen ``TrainState`` step with BatchNorm, dropout and gradient accumulation.

A small Linen CNN with BatchNorm and dropout learns scikit-learn's 8x8 digits (shipped
with the package, so this runs offline). ``jaxaccum.linen.make_train_step`` builds the
step: each batch of 64 runs as 8 micro-batches of 8 in one jitted ``lax.scan``;
``batch_stats`` is threaded from micro-batch to micro-batch and micro-batch ``i`` draws its
dropout mask from ``jax.random.fold_in(key, i)``, with a new key every step.

BatchNorm normalises each micro-batch of 8 with its own statistics (a "ghost batch") and
updates its running averages once per micro-batch, so this trains like BatchNorm with a
batch of 8 and gradients averaged over 64 examples, not like one batch of 64. Use GroupNorm
or LayerNorm where the full-batch result must be reproduced exactly.

  python examples/linen_train.py          # a few seconds on a CPU
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits

import jaxaccum


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(16, (3, 3))(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.Conv(32, (3, 3), strides=2)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.Dropout(0.2, deterministic=not train)(x.mean(axis=(1, 2)))
    return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any


MODEL = CNN()


def loss_fn(params, batch, model_state, rngs):
  """One micro-batch: the loss and the updated mutable collections."""
  logits, new_model_state = MODEL.apply(
      {"params": params, **model_state}, batch["image"], train=True,
      mutable=list(model_state), rngs=rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, new_model_state


def load(seed: int):
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  test, train = order[:300], order[300:]
  return (x[train], y[train]), (x[test], y[test])


@functools.partial(jax.jit, static_argnums=0)
def create(seed: int) -> TrainState:
  """The initial train state, built under jit: one compile, not one per initialiser."""
  variables = MODEL.init(jax.random.key(seed), jnp.zeros((1, 8, 8, 1)), train=False)
  return TrainState.create(apply_fn=MODEL.apply, params=variables["params"],
                           batch_stats=variables["batch_stats"], tx=optax.adam(1e-2))


def main(steps: int = 150, batch_size: int = 64, num_micro_batches: int = 8,
         seed: int = 0) -> dict:
  (x_train, y_train), (x_test, y_test) = load(seed)
  state = create(seed)
  train_step = jax.jit(jaxaccum.linen.make_train_step(
      loss_fn, num_micro_batches=num_micro_batches, collections=("batch_stats",)))

  dropout_key = jax.random.key(seed + 1)
  rng = np.random.default_rng(seed)
  losses = []
  for step in range(steps):
    idx = rng.choice(len(x_train), batch_size, replace=False)
    batch = {"image": x_train[idx], "label": y_train[idx]}
    state, loss = train_step(state, batch, {"dropout": jax.random.fold_in(dropout_key, step)})
    losses.append(float(loss))
    if step % max(1, steps // 5) == 0 or step == steps - 1:
      print(f"step {step:4d}: loss {losses[-1]:.4f}")

  @jax.jit
  def predict(state, x):
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    return state.apply_fn(variables, x, train=False).argmax(-1)

  test_accuracy = float(np.mean(np.asarray(predict(state, x_test)) == y_test))
  print(f"test accuracy {test_accuracy:.3f} (running BatchNorm statistics) after {steps} "
        f"steps of {num_micro_batches} micro-batches of {batch_size // num_micro_batches}")
  return {"losses": losses, "test_accuracy": test_accuracy, "step": int(state.step),
          "batch_stats": state.batch_stats}


if __name__ == "__main__":
  main()
