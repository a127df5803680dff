"""The Flax examples run end to end, tiny, and learn."""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tests._problems import micro_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod  # dataclasses (the Linen TrainState) look their module up
  spec.loader.exec_module(mod)
  return mod


# Few steps: a CNN step runs ~25x slower at the suite's --xla_backend_optimization_level=0
# than at the default level. 30 steps of 32 take the nnx example's test accuracy from
# chance (0.1) to ~0.44 (20 steps: still 0.09); 20 steps take the linen one to ~0.48
# (30: ~0.73).
STEPS = 30
LINEN_STEPS = 20


def test_nnx_example(capsys):
  out = load("nnx_train").main(steps=STEPS, batch_size=32, num_micro_batches=4)
  printed = capsys.readouterr().out
  # Dropout off + GroupNorm: the accumulated gradients are the full batch's (float32).
  assert out["grad_diff"] < 1e-5, printed
  losses = np.asarray(out["losses"])
  assert losses.shape == (STEPS,) and np.isfinite(losses).all()
  assert losses[-10:].mean() < losses[:10].mean(), printed
  assert out["test_accuracy"] > 0.25, printed  # chance is 0.1
  assert "test accuracy" in printed


def _linen_reference_losses(mod, steps, batch_size, num_micro_batches, seed=0):
  """The example's first steps by hand: its batches, dropout keys and Adam, with each
  batch run as a Python loop over micro-batches sliced by hand (rows i::N), batch_stats
  threaded through them, micro-batch i's dropout key fold_in(key, i), losses and
  gradients averaged over the micro-batches."""
  n = num_micro_batches
  (x_train, y_train), _ = mod.load(seed)
  state = mod.create(seed)  # the example's initial state: both runs start from it
  vg = jax.jit(jax.value_and_grad(mod.loss_fn, has_aux=True))
  # The glue between the micro-batch calls, jitted once instead of run op by op.
  add = jax.jit(lambda loss, grads, l_i, g_i: (
      loss + l_i / n, jax.tree.map(lambda a, g: a + g / n, grads, g_i)))
  apply = jax.jit(lambda state, grads, stats: state.apply_gradients(grads=grads,
                                                                    batch_stats=stats))
  fold_in = jax.jit(jax.random.fold_in)
  zeros = jax.jit(lambda params: jax.tree.map(jnp.zeros_like, params))
  dropout_key, rng = jax.random.key(seed + 1), np.random.default_rng(seed)
  losses = []
  for step in range(steps):
    idx = rng.choice(len(x_train), batch_size, replace=False)
    batch = {"image": x_train[idx], "label": y_train[idx]}
    key = fold_in(dropout_key, step)
    model_state = {"batch_stats": state.batch_stats}
    loss, grads = 0.0, zeros(state.params)
    for i in range(n):
      (l_i, model_state), g_i = vg(state.params, micro_batch(batch, i, n), model_state,
                                   {"dropout": fold_in(key, i)})
      loss, grads = add(loss, grads, l_i, g_i)
    state = apply(state, grads, model_state["batch_stats"])
    losses.append(float(loss))
  return np.asarray(losses)


def test_linen_example(capsys):
  mod = load("linen_train")
  out = mod.main(steps=LINEN_STEPS, batch_size=32, num_micro_batches=4)
  printed = capsys.readouterr().out
  assert out["step"] == LINEN_STEPS
  losses = np.asarray(out["losses"])
  assert losses.shape == (LINEN_STEPS,) and np.isfinite(losses).all()
  # The first three steps equal the sequential micro-batch loop (float32 round-off, a few
  # 1e-7 relative, grows a little through Adam's normalisation and BatchNorm).
  np.testing.assert_allclose(losses[:3], _linen_reference_losses(mod, 3, 32, 4), rtol=1e-5)
  assert losses[-10:].mean() < losses[:10].mean(), printed
  assert out["test_accuracy"] > 0.25, printed
  # The running BatchNorm means moved away from their initial zeros.
  means = [x for p, x in jax.tree_util.tree_leaves_with_path(out["batch_stats"])
           if "mean" in jax.tree_util.keystr(p)]
  assert means and all(np.abs(np.asarray(m)).max() > 0 for m in means)
