"""Quickstart: an optax train step whose gradients are accumulated over 8 micro-batches.

Runs in seconds on a CPU. Checks at every step that the accumulated loss and gradients
equal the full batch's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum


def loss_fn(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.partial(jax.jit, static_argnums=0)  # one compiled program, not one per operation
def init(batch_size: int):
  """Parameters and one batch ``(x, y)`` of random data."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
  params = {
      "w1": jax.random.normal(k1, (32, 64)) / jnp.sqrt(32.0),
      "b1": jnp.zeros(64),
      "w2": jax.random.normal(k2, (64, 10)) / 8.0,
  }
  x = jax.random.normal(k3, (batch_size, 32))
  y = jax.random.randint(k4, (batch_size,), 0, 10)
  return params, (x, y)


def main(steps: int = 5, batch_size: int = 256, num_micro_batches: int = 8) -> None:
  params, (x, y) = init(batch_size)
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  accumulated = jaxaccum.value_and_grad(loss_fn, num_micro_batches=num_micro_batches)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = accumulated(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  full = jax.jit(jax.value_and_grad(loss_fn))
  for step in range(steps):
    ref_loss, ref_grads = full(params, (x, y))
    params, opt_state, loss, grads = train_step(params, opt_state, (x, y))
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
               zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
    print(f"step {step}: loss {float(loss):.6f} (full batch {float(ref_loss):.6f}), "
          f"max |grad - full-batch grad| = {diff:.2e}")
  print(f"effective batch {batch_size} = {num_micro_batches} micro-batches of "
        f"{batch_size // num_micro_batches}")


if __name__ == "__main__":
  main()
