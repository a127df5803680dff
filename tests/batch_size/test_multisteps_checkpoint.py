"""Checkpoint jaxaccum.MultiSteps in the middle of a window and resume in a fresh process.

The scenario (``tests/_multisteps_lm.py``): a token-weighted language model trained with
``MultiSteps(clip + adam, 8)`` for two windows of 8 micro-batches. The run is saved with
orbax-checkpoint after 3 of the first window's 8 micro-batches, restored by a new Python
process that finishes it, and compared bitwise with an uninterrupted run: the same
compiled step on the same inputs in the same order must give the same bits, so any state
that the checkpoint lost or altered (the partial gradient sum, the window's weight and
mode, the micro-step counter) would show.
"""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from tests import _multisteps_lm as lm

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def test_resume_mid_window_in_a_fresh_process_is_bitwise_identical(tmp_path):
  opt, params0, micro = lm.resume_setup()
  step = lm.resume_step_fn(opt)

  # The uninterrupted run.
  params, full_state = lm.run_calls(step, params0, opt.init(params0), micro, 0, len(micro))
  expected = jax.tree.leaves({"params": params, "opt_state": full_state})

  # The interrupted run: 3 micro-batches, then a checkpoint in the middle of the window.
  save_after = lm.RESUME_SAVE_AFTER
  params, state = lm.run_calls(step, params0, opt.init(params0), micro, 0, save_after)
  assert int(state.mini_step) == save_after and bool(state.weighted)
  assert float(state.acc_weight) > 0 and not bool(opt.has_updated(state))
  ckpt = tmp_path / "ckpt"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(ckpt, {"params": params, "opt_state": state,
                           "calls": np.asarray(save_after, np.int32)})
  checkpointer.wait_until_finished()
  checkpointer.close()

  out = tmp_path / "resumed.npz"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run(
      [sys.executable, "-m", "tests._multisteps_lm", "resume", str(ckpt), str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]

  with np.load(out) as resumed:
    got = [resumed[f"arr_{i}"] for i in range(len(resumed.files))]
  assert len(got) == len(expected)
  for i, (a, b) in enumerate(zip(got, expected, strict=True)):
    b = np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(a, b, err_msg=f"leaf {i} differs after resuming")
  # Two windows completed, and the parameters moved.
  assert int(full_state.gradient_step) == 2 and len(micro) == 2 * lm.RESUME_K
  assert not np.array_equal(got[0], np.asarray(jax.tree.leaves(params0)[0]))
