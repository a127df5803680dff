"""A tiny token-level language model for the MultiSteps tests, and the resume script.

Padded sequences of different lengths make micro-batches hold different numbers of real
tokens, which is what separates the token mean (jaxaccum) from the mean of micro-batch
means (optax.MultiSteps).

Run as ``python -m tests._multisteps_lm resume CKPT_DIR OUT.npz`` (from the repository
root), it restores a mid-window checkpoint written by the checkpoint test, finishes the
run and writes the final parameters and optimizer state.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

VOCAB, DIM, SEQ = 11, 4, 7


def init_params(key):
  k1, k2 = jax.random.split(key)
  return {"embed": jax.random.normal(k1, (VOCAB, DIM)),
          "out": jax.random.normal(k2, (DIM, VOCAB)) / 2}


def make_batch(key, lengths):
  """Random token sequences padded with 0 after ``lengths[i]`` real tokens."""
  lengths = jnp.asarray(lengths, jnp.int32)
  tokens = jax.random.randint(key, (lengths.shape[0], SEQ), 1, VOCAB)
  tokens = jnp.where(jnp.arange(SEQ)[None, :] < lengths[:, None], tokens, 0)
  return {"tokens": tokens, "lengths": lengths}


def target_mask(batch):
  """Which next-token targets are real tokens (not padding)."""
  return jnp.arange(1, SEQ)[None, :] < batch["lengths"][:, None]


def num_tokens(batch):
  """The number of real next-token targets: the weight of the batch's mean loss."""
  return jnp.sum(target_mask(batch))


def token_loss_sum(params, batch):
  """(summed next-token cross-entropy over the real targets, number of real targets)."""
  tokens = batch["tokens"]
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  mask = target_mask(batch)
  logits = params["embed"][inputs] @ params["out"]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * mask), jnp.sum(mask)


def token_loss_mean(params, batch):
  """The mean over real target tokens (NaN for a batch that has none)."""
  num, den = token_loss_sum(params, batch)
  return num / den


# The checkpoint/resume scenario: two windows of 8 micro-batches of 2 sequences.
RESUME_K = 8
RESUME_SAVE_AFTER = 3
RESUME_LENGTHS = ([7, 2, 1, 5, 7, 3, 2, 6, 1, 7, 4, 1, 6, 7, 2, 3],
                  [3, 7, 7, 1, 2, 7, 6, 1, 7, 7, 1, 2, 5, 4, 7, 1])


def resume_setup():
  """(optimizer, initial params, the list of micro-batches in call order)."""
  opt = jaxaccum.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-2)),
                            RESUME_K)
  params = init_params(jax.random.key(0))
  micro = []
  for s, lengths in enumerate(RESUME_LENGTHS):
    batch = make_batch(jax.random.key(100 + s), lengths)
    split = jaxaccum.split_micro_batches(batch, num_micro_batches=RESUME_K)
    micro += [jax.tree.map(lambda x, i=i: x[i], split) for i in range(RESUME_K)]
  return opt, params, micro


def resume_step_fn(opt):
  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(token_loss_mean)(params, batch)
    updates, state = opt.update(grads, state, params, weight=num_tokens(batch))
    return optax.apply_updates(params, updates), state

  return step


def run_calls(step, params, state, micro, start, stop):
  for i in range(start, stop):
    params, state = step(params, state, micro[i])
  return params, state


def _resume_main(ckpt_dir, out_path):
  import orbax.checkpoint as ocp

  opt, params0, micro = resume_setup()
  target = {"params": params0, "opt_state": opt.init(params0),
            "calls": np.zeros((), np.int32)}
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)
  restored = ocp.StandardCheckpointer().restore(ckpt_dir, target)
  params, state = run_calls(resume_step_fn(opt), restored["params"], restored["opt_state"],
                            micro, int(restored["calls"]), len(micro))
  leaves = jax.tree.leaves({"params": params, "opt_state": state})
  np.savez(out_path, *[np.asarray(x) for x in leaves])


if __name__ == "__main__":
  if len(sys.argv) != 4 or sys.argv[1] != "resume":
    raise SystemExit("usage: python -m tests._multisteps_lm resume CKPT_DIR OUT.npz")
  _resume_main(sys.argv[2], sys.argv[3])
