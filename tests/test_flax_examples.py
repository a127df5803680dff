"""The Flax examples run end to end, tiny, and learn."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod  # dataclasses (the Linen TrainState) look their module up
  spec.loader.exec_module(mod)
  return mod


def test_nnx_example(capsys):
  out = load("nnx_train").main(steps=60, batch_size=32, num_micro_batches=4)
  printed = capsys.readouterr().out
  # Dropout off + GroupNorm: the accumulated gradients are the full batch's (float32).
  assert out["grad_diff"] < 1e-5, printed
  losses = np.asarray(out["losses"])
  assert losses.shape == (60,) and np.isfinite(losses).all()
  assert losses[-10:].mean() < losses[:10].mean(), printed
  assert out["test_accuracy"] > 0.25, printed  # chance is 0.1
  assert "test accuracy" in printed


def test_linen_example(capsys):
  out = load("linen_train").main(steps=60, batch_size=32, num_micro_batches=4)
  printed = capsys.readouterr().out
  assert out["step"] == 60
  losses = np.asarray(out["losses"])
  assert losses.shape == (60,) and np.isfinite(losses).all()
  assert losses[-10:].mean() < losses[:10].mean(), printed
  assert out["test_accuracy"] > 0.25, printed
  # The running BatchNorm means moved away from their initial zeros.
  means = [x for p, x in jax.tree_util.tree_leaves_with_path(out["batch_stats"])
           if "mean" in jax.tree_util.keystr(p)]
  assert means and all(np.abs(np.asarray(m)).max() > 0 for m in means)
