"""jaxaccum across processes: 2 local processes x 2 CPU devices, one jax.distributed runtime.

Each child (``tests/_multiprocess_child.py``) joins the runtime with gloo CPU collectives
on 127.0.0.1, places a global batch sharded over all 4 devices (each process supplies only
its own rows), and runs an accumulated step with and without ``data_axis``. The loss and
gradients every process sees must equal the single-process full batch.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests import _multiprocess_child as child
from tests._util import assert_close

CHILD = Path(child.__file__)
TIMEOUT_S = 240


class ChildFailed(RuntimeError):
  pass


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(outs: list[str], tmp_path: Path, timeout: float = TIMEOUT_S) -> None:
  """Runs one child per entry of ``outs``; raises ChildFailed with its log if one fails.

  The children are always stopped before returning: on success they have exited, on a
  failure or a timeout the survivors are killed (by their own process handles).
  """
  address = f"127.0.0.1:{_free_port()}"
  root = str(CHILD.parent.parent)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  procs, logs = [], []
  try:
    for i, out in enumerate(outs):
      log = open(tmp_path / f"process{i}.log", "w+")  # closed in the finally below
      logs.append(log)
      procs.append(subprocess.Popen(
          [sys.executable, str(CHILD), address, str(len(outs)), str(i), out],
          stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
      for i, p in enumerate(procs):
        if p.poll() not in (None, 0):
          raise ChildFailed(
              f"process {i} of {len(procs)} exited with code {p.returncode}; its log:\n"
              + _tail(logs[i]))
      if time.monotonic() > deadline:
        raise ChildFailed(
            f"the {len(procs)} processes did not finish within {timeout:.0f} s; logs:\n"
            + "\n".join(f"--- process {i}\n{_tail(log)}" for i, log in enumerate(logs)))
      time.sleep(0.1)
    for i, p in enumerate(procs):
      if p.returncode != 0:
        raise ChildFailed(
            f"process {i} of {len(procs)} exited with code {p.returncode}; its log:\n"
            + _tail(logs[i]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait(timeout=30)
    for log in logs:
      log.close()


def _tail(log, lines: int = 30) -> str:
  log.flush()
  log.seek(0)
  return "".join(log.readlines()[-lines:])


def test_two_processes_match_the_single_process_full_batch(tmp_path):
  outs = [str(tmp_path / f"out{i}.npz") for i in range(2)]
  run_processes(outs, tmp_path)

  params, batch = child.problem()

  def token_mean(p, b):
    num, den = child.token_loss(p, b)
    return num / den

  references = {
      "mean": jax.jit(jax.value_and_grad(child.mean_loss))(params, batch),
      "weighted": jax.jit(jax.value_and_grad(token_mean))(params, batch),
  }
  for i, out in enumerate(outs):
    got = np.load(out)
    for name, (loss, grads) in references.items():
      for mode in ("plain", "data_axis"):
        where = f"process {i}, {name} loss, {mode}"
        assert_close(got[f"{name}/{mode}/loss"], loss, err_msg=where)
        assert_close({k: got[f"{name}/{mode}/{k}"] for k in grads}, grads, err_msg=where)


def test_a_dying_process_fails_clearly_and_is_cleaned_up(tmp_path):
  with pytest.raises(ChildFailed, match=r"process 1 of 2 exited with code 3(.|\n)*on purpose"):
    run_processes([str(tmp_path / "out0.npz"), "die"], tmp_path, timeout=120)
