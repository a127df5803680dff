"""The gradient noise scale of a character LM, and a batch-size ramp in one compiled program.

Accumulation sees ``N`` micro-batch gradients and their mean every step. From the squared
norms of the two, ``jaxaccum.value_and_grad(..., with_info=True)`` returns a
:class:`jaxaccum.AccumInfo` whose unbiased estimates of the true gradient's squared norm
``|G|^2`` and of the per-token gradient covariance's trace ``tr(Sigma)`` (McCandlish et
al. 2018, appendix A) give the simple noise scale ``B_simple = tr(Sigma) / |G|^2``: about
the batch (here in tokens, the denominators of the token-weighted loss) beyond which a
larger batch stops paying. One step's estimate is very noisy, so it is smoothed with an
exponential moving average of each estimate (``jaxaccum.NoiseScale``).

The character LM of ``examples/char_lm.py`` (its data pipeline, the Python standard
library's source, and its model) is trained twice from one initialisation, by the same
jitted step:

* ``constant``: every step runs all ``N`` micro-batches;
* ``ramp``: the step's ``active_micro_batches`` (a traced int32 argument) grows from a few
  micro-batches to ``N`` along ``jaxaccum.batch_size_ramp``: one compiled program for
  every batch size, checked by the jit cache size.

It writes ``examples/out/noise_scale.png``: the loss, and B_simple next to the batch that
each step used, against steps, for both runs.

  python examples/noise_scale.py           # a few minutes on a laptop CPU
  python examples/noise_scale.py --tiny    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import char_lm  # noqa: E402  (the sibling example: data pipeline and model)

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
RUNS = ("constant", "ramp")


@dataclasses.dataclass(frozen=True)
class Config:
  """What to train; the defaults run in a few minutes on a laptop CPU."""

  steps: int = 300
  batch_size: int = 64
  num_micro_batches: int = 16
  ramp_from: int = 2  # micro-batches at step 0 of the ramp run
  ramp_steps: int = 200  # steps over which the ramp reaches num_micro_batches
  seq_len: int = 64
  min_len: int = 16
  d_model: int = 64
  heads: int = 4
  layers: int = 2
  learning_rate: float = 2e-3
  decay: float = 0.95  # the noise-scale EMA's decay
  max_chars: int = 2_000_000
  seed: int = 0

  def lm(self) -> char_lm.Config:
    """The character LM's configuration (model, data)."""
    names = {f.name for f in dataclasses.fields(char_lm.Config)}
    return char_lm.Config(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})


TINY = Config(steps=12, batch_size=16, num_micro_batches=8, ramp_from=2, ramp_steps=8,
              seq_len=16, min_len=8, d_model=16, heads=2, layers=1, learning_rate=1e-2,
              decay=0.8, max_chars=50_000)


@functools.partial(nnx.jit, static_argnums=0)
def _create(cfg: char_lm.Config) -> char_lm.CharLM:
  return char_lm.CharLM(cfg, rngs=nnx.Rngs(cfg.seed))


def init_model(cfg: Config):
  """``(loss_fn, params)``: the token loss as a pure function of the LM's parameters.

  ``loss_fn(params, batch)`` returns ``(summed cross-entropy over real target tokens,
  number of real target tokens)``, for ``reduce="weighted"``.
  """
  graphdef, params, rest = nnx.split(_create(cfg.lm()), nnx.Param, ...)

  def loss_fn(params, batch):
    return char_lm.token_loss(nnx.merge(graphdef, params, rest), batch)

  return loss_fn, params


def make_step(cfg: Config, loss_fn: Callable, tx: optax.GradientTransformation, noise):
  """The jitted train step ``(params, opt_state, noise_state, batch, k) -> (..., logs)``.

  ``k`` (int32) is ``active_micro_batches``: only micro-batches ``0..k-1`` run, and the
  step is compiled once for every ``k``. ``step.traces`` counts its traces (each one a
  compiled program).
  """
  vg = jaxaccum.value_and_grad(loss_fn, num_micro_batches=cfg.num_micro_batches,
                               reduce="weighted", with_info=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, noise_state, batch, k):
    traces.append(None)  # Python runs here once per trace, not once per call
    loss, grads, info = vg(params, batch, active_micro_batches=k)
    updates, opt_state = tx.update(grads, opt_state, params)
    noise_state = noise.update(noise_state, info)
    logs = {"loss": loss, "b_simple": noise.b_simple(noise_state),
            "tokens": info.batch_size, "k": info.num_micro_batches,
            "grad_sq_norm": info.grad_sq_norm_estimate(),
            "trace_cov": info.trace_cov_estimate()}
    return optax.apply_updates(params, updates), opt_state, noise_state, logs

  traces = []
  step.traces = traces
  return step


def make_batches(cfg: Config) -> list[dict]:
  """The same ``cfg.steps`` batches of ``cfg.batch_size`` sequences for both runs."""
  corpus = char_lm.load_corpus(cfg.max_chars)
  rng = np.random.default_rng(cfg.seed)
  return [char_lm.sample_batch(rng, corpus, cfg.lm()) for _ in range(cfg.steps)]


def plot(logs: dict[str, dict[str, np.ndarray]], cfg: Config, path: pathlib.Path) -> None:
  """The loss and B_simple (with the batch each step used) against steps, both runs."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_loss, ax_b) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
  for color, run in zip(("C0", "C1"), RUNS, strict=True):
    lg = logs[run]
    steps = np.arange(len(lg["loss"]))
    ax_loss.plot(steps, lg["loss"], color=color, label=run)
    ax_b.plot(steps, lg["b_simple"], color=color, label=f"{run}: B_simple (EMA)")
    ax_b.plot(steps, lg["tokens"], color=color, ls=":", label=f"{run}: tokens in the batch")
  ax_loss.set(ylabel="token-mean cross-entropy")
  ax_loss.set_title(f"char LM, up to {cfg.batch_size} sequences = {cfg.num_micro_batches} "
                    f"micro-batches of {cfg.batch_size // cfg.num_micro_batches}\nramp run: "
                    f"{cfg.ramp_from} -> {cfg.num_micro_batches} micro-batches over "
                    f"{cfg.ramp_steps} steps, one compiled step", fontsize=10)
  ax_b.set(yscale="log", xlabel="optimizer step", ylabel="tokens")
  for ax in (ax_loss, ax_b):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(cfg: Config = Config(), *, out_dir: pathlib.Path | str = OUT_DIR,
         progress: bool = True, verbose: bool = True) -> dict[str, Any]:
  """Trains both runs, saves the plot, prints a summary; returns the numbers.

  Returns a dict with ``logs`` (run name -> per-step arrays ``loss``, ``b_simple`` (the
  EMA after the step), ``tokens`` (the batch's real tokens), ``k`` (micro-batches run),
  ``grad_sq_norm`` and ``trace_cov`` (the step's own estimates)), ``ks`` (run name -> the
  ``k`` passed each step), ``compiled_programs`` (the jit cache size of the train step
  after both runs) and ``plot`` (its path).
  """
  from tqdm import tqdm

  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  n = cfg.num_micro_batches
  batches = make_batches(cfg)
  loss_fn, params0 = init_model(cfg)
  tx = optax.adam(cfg.learning_rate)
  noise = jaxaccum.NoiseScale(decay=cfg.decay)
  step = make_step(cfg, loss_fn, tx, noise)
  ramp = jaxaccum.batch_size_ramp(init_value=cfg.ramp_from, end_value=n,
                                  transition_steps=cfg.ramp_steps)
  # Jitted, as the schedule and the initial states are small programs: one compile each
  # instead of every operation run (and compiled for its shapes) one at a time.
  schedules = {"constant": lambda s: jnp.int32(n), "ramp": jax.jit(ramp)}

  @jax.jit
  def fresh_state(params):
    # A copy of the parameters (the step donates them), and fresh optimizer and EMA states.
    return jax.tree.map(jnp.copy, params), tx.init(params), noise.init()

  logs, ks = {}, {}
  for run in RUNS:
    params, opt_state, noise_state = fresh_state(params0)
    per_step, ks[run] = [], []
    bar = tqdm(batches, desc=f"{run} run", disable=not progress)
    for s, batch in enumerate(bar):
      k = jnp.asarray(schedules[run](s), jnp.int32)
      params, opt_state, noise_state, lg = step(params, opt_state, noise_state, batch, k)
      per_step.append(lg)
      ks[run].append(int(k))
      if s % 10 == 0 or s == len(batches) - 1:
        bar.set_postfix(loss=f"{float(lg['loss']):.3f}", k=int(k),
                        B_simple=f"{float(lg['b_simple']):.0f}")
    logs[run] = {key: np.asarray([float(lg[key]) for lg in per_step]) for key in per_step[0]}
  compiled = len(step.traces)
  if compiled != 1:
    raise RuntimeError(f"the train step compiled {compiled} programs; expected one for all k")

  plot_path = out_dir / "noise_scale.png"
  plot(logs, cfg, plot_path)
  result = {"logs": logs, "ks": ks, "compiled_programs": compiled, "plot": plot_path}
  if verbose:
    for run in RUNS:
      lg = logs[run]
      print(f"{run:>8}: final loss {lg['loss'][-1]:.4f}, B_simple (EMA, decay {cfg.decay}) "
            f"{lg['b_simple'][-1]:,.0f} tokens; last batch {lg['tokens'][-1]:,.0f} tokens "
            f"in {int(lg['k'][-1])} of {n} micro-batches; tokens seen "
            f"{lg['tokens'].sum():,.0f}")
      ratio = lg["b_simple"][-1] / lg["tokens"][-1]
      print(f"{'':>10}B_simple / batch = {ratio:.2f}: "
            + ("a larger batch would still cut the steps needed almost in proportion"
               if ratio > 1 else "a larger batch would mostly spend more tokens per step"))
    print(f"micro-batches per step in the ramp run: {ks['ramp'][0]} -> {ks['ramp'][-1]}, "
          f"compiled programs of the train step: {compiled}")
    print(f"plot: {plot_path}")
  return result


def _parse(argv=None) -> tuple[Config, pathlib.Path]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
  for field in dataclasses.fields(Config):
    parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default))
  parser.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
  args = parser.parse_args(argv)
  cfg = TINY if args.tiny else Config()
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
               if getattr(args, f.name) is not None}
  return dataclasses.replace(cfg, **overrides), args.out_dir


if __name__ == "__main__":
  config, out = _parse()
  main(config, out_dir=out)
