"""Streaming accumulation across calls with ``jaxaccum.MultiSteps`` and token weights.

When micro-batches arrive one at a time (from a data stream, a pipeline stage, or a loop
you do not control), accumulate across calls instead of inside one step:
``jaxaccum.MultiSteps(tx, every_k_schedule=k)`` is a drop-in for ``optax.MultiSteps``
whose ``update(grads, state, params, weight=n_tokens)`` weights each micro-batch's mean
gradient by its number of real tokens. Every ``k``-th call then applies ``tx`` to the
exact token-mean gradient of the whole window.

Here the stream is the Python standard library's source, a few lines per micro-batch,
each line padded to a fixed width: micro-batches hold very different numbers of real
characters (blank lines hold none). A small character model is trained three ways on the
same stream from the same initialisation:

* ``jaxaccum.MultiSteps`` with ``weight=`` the micro-batch's number of real tokens;
* ``optax.MultiSteps``, which averages the per-micro-batch means;
* the reference: every ``k`` micro-batches, one step on their concatenation with the
  token-mean loss (what a big enough device would do).

It prints, after each optimizer step, how far each run's parameters are from the
reference's, and saves ``examples/out/streaming_multisteps.png``.

  python examples/streaming_multisteps.py                # 40 optimizer steps, seconds
  python examples/streaming_multisteps.py --windows 400  # a longer run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import pathlib
import sysconfig
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
VOCAB = 128
PAD, BOS, UNK = 0, 2, 1
CONTEXT = 3
MODULES = ("inspect.py", "textwrap.py", "argparse.py", "functools.py", "typing.py")


def line_stream(width: int, rows: int) -> Iterator[dict[str, np.ndarray]]:
  """Micro-batches of ``rows`` consecutive stdlib source lines, padded to ``width``.

  Each row predicts a line's characters and its newline from the characters before them
  (the first from a BOS token). Yields ``inputs``/``targets`` (int32) and ``mask`` (float32,
  1 on real target tokens), each ``(rows, width)``.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  lines = itertools.chain.from_iterable(
      (root / name).read_text(encoding="utf-8").splitlines() for name in MODULES)
  while True:
    chunk = list(itertools.islice(lines, rows))
    if len(chunk) < rows:
      return
    inputs = np.full((rows, width), PAD, np.int32)
    targets = np.full((rows, width), PAD, np.int32)
    mask = np.zeros((rows, width), np.float32)
    for r, line in enumerate(chunk):
      ids = [c if 2 < c < VOCAB else UNK for c in map(ord, line[: width - 1])] + [ord("\n")]
      inputs[r, : len(ids)] = [BOS] + ids[:-1]
      targets[r, : len(ids)] = ids
      mask[r, : len(ids)] = 1.0
    yield {"inputs": inputs, "targets": targets, "mask": mask}


@functools.partial(jax.jit, static_argnames=("d", "hidden"))  # one compile, not op by op
def init_params(key: jax.Array, d: int = 32, hidden: int = 128) -> dict[str, jax.Array]:
  """A character model: the last ``CONTEXT`` characters -> an MLP -> next-char logits."""
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "embed": 0.1 * jax.random.normal(k1, (VOCAB, d)),
      "w1": jax.random.normal(k2, (CONTEXT * d, hidden)) / np.sqrt(CONTEXT * d),
      "b1": jnp.zeros(hidden),
      "w2": jax.random.normal(k3, (hidden, VOCAB)) / np.sqrt(hidden),
      "b2": jnp.zeros(VOCAB),
  }


def token_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
  """(summed next-character cross-entropy over real tokens, number of real tokens)."""
  x = batch["inputs"]
  shifted = [jnp.pad(x, ((0, 0), (j, 0)), constant_values=PAD)[:, : x.shape[1]]
             for j in range(CONTEXT)]
  h = jnp.concatenate([params["embed"][s] for s in shifted], axis=-1)
  h = jnp.tanh(h @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])


def mean_loss(params: dict, batch: dict):
  """The micro-batch's token mean (0 when it has no real token), and its token count."""
  total, count = token_loss(params, batch)
  return total / jnp.maximum(count, 1.0), count


def _max_abs_diff(a: Any, b: Any) -> float:
  # NumPy on the host: jnp here would compile a small program for every leaf's shape.
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def main(*, windows: int = 40, k: int = 8, rows: int = 4, width: int = 80, lr: float = 1e-2,
         seed: int = 0, out_dir: pathlib.Path | str = OUT_DIR, progress: bool = True,
         verbose: bool = True) -> dict[str, Any]:
  """Streams ``windows * k`` micro-batches through the three runs.

  Returns a dict with ``gap`` (run name -> per-window largest absolute difference of its
  parameters from the reference's), ``loss`` (run name -> per-window token-mean loss of
  the window, before its update), ``steps`` (optimizer steps ``jaxaccum.MultiSteps``
  reports via ``has_updated``), ``tokens`` (real tokens per micro-batch) and ``plot``.
  """
  from tqdm import tqdm

  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  tx = optax.adam(lr)
  ours = jaxaccum.MultiSteps(tx, every_k_schedule=k)
  theirs = optax.MultiSteps(tx, every_k_schedule=k)
  params0 = init_params(jax.random.key(seed))
  vg = jax.value_and_grad(mean_loss, has_aux=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def ours_step(params, state, micro_batch):
    (_, count), grads = vg(params, micro_batch)
    updates, state = ours.update(grads, state, params, weight=count)
    return optax.apply_updates(params, updates), state, ours.has_updated(state)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def optax_step(params, state, micro_batch):
    _, grads = vg(params, micro_batch)
    updates, state = theirs.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def window_mean(params, window):
    total, count = token_loss(params, window)
    return total / jnp.maximum(count, 1.0)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def reference_step(params, state, window):
    loss, grads = jax.value_and_grad(window_mean)(params, window)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  runs = {"jaxaccum.MultiSteps": [jax.tree.map(jnp.copy, params0)],
          "optax.MultiSteps": [jax.tree.map(jnp.copy, params0)],
          "reference": [jax.tree.map(jnp.copy, params0)]}
  runs["jaxaccum.MultiSteps"].append(ours.init(runs["jaxaccum.MultiSteps"][0]))
  runs["optax.MultiSteps"].append(theirs.init(runs["optax.MultiSteps"][0]))
  runs["reference"].append(tx.init(runs["reference"][0]))

  gap = {"jaxaccum.MultiSteps": [], "optax.MultiSteps": []}
  loss = {"reference": []}
  tokens, steps = [], 0
  stream = line_stream(width, rows)
  for _ in tqdm(range(windows), desc=f"optimizer steps ({k} calls each)",
                disable=not progress):
    window = list(itertools.islice(stream, k))
    if len(window) < k:
      break
    for micro_batch in window:  # one call per micro-batch, as it arrives
      tokens.append(int(micro_batch["mask"].sum()))
      p, s, updated = ours_step(*runs["jaxaccum.MultiSteps"], micro_batch)
      runs["jaxaccum.MultiSteps"] = [p, s]
      steps += int(updated)
      runs["optax.MultiSteps"] = list(optax_step(*runs["optax.MultiSteps"], micro_batch))
    whole = {key: np.concatenate([mb[key] for mb in window]) for key in window[0]}
    p, s, window_loss = reference_step(*runs["reference"], whole)
    runs["reference"] = [p, s]
    loss["reference"].append(float(window_loss))
    for name in gap:
      gap[name].append(_max_abs_diff(runs[name][0], p))

  path = out_dir / "streaming_multisteps.png"
  _plot(gap, path, k, rows)
  if verbose:
    print(f"{len(gap['optax.MultiSteps'])} optimizer steps of {k} calls x {rows} lines; "
          f"real tokens per micro-batch from {min(tokens)} to {max(tokens)}; "
          f"jaxaccum.MultiSteps has_updated on {steps} calls")
    print(f"reference token-mean loss: first window {loss['reference'][0]:.3f}, "
          f"last {loss['reference'][-1]:.3f}")
    for name, g in gap.items():
      print(f"{name:>20}: largest |params - reference params| after step 1: {g[0]:.1e}, "
            f"after the last: {g[-1]:.1e}")
    print(f"plot: {path}")
  return {"gap": gap, "loss": loss, "steps": steps, "tokens": tokens, "plot": path}


def _plot(gap: dict[str, list[float]], path: pathlib.Path, k: int, rows: int) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  for name, g in gap.items():
    ax.plot(np.arange(1, len(g) + 1), np.maximum(g, 1e-9), marker=".", label=name)
  ax.set(yscale="log", xlabel="optimizer step",
         ylabel="max |params - reference params|",
         title=f"streaming {k} micro-batches of {rows} lines per optimizer step")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--windows", type=int, default=40, help="optimizer steps to run")
  parser.add_argument("--k", type=int, default=8, help="micro-batches per optimizer step")
  parser.add_argument("--rows", type=int, default=4, help="source lines per micro-batch")
  parser.add_argument("--width", type=int, default=80, help="padded line width")
  parser.add_argument("--lr", type=float, default=1e-2)
  parser.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
  args = parser.parse_args()
  main(windows=args.windows, k=args.k, rows=args.rows, width=args.width, lr=args.lr,
       out_dir=args.out_dir)
