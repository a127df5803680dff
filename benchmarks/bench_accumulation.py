"""Gradient accumulation side by side: step time, memory and compile time against N.

One optimizer step over an effective batch of ``B`` examples, computed five ways:

* ``full``: the full batch through :func:`jax.value_and_grad` (the reference);
* ``jaxaccum``: :func:`jaxaccum.value_and_grad` with ``N`` micro-batches, one jitted step;
* ``optax.microbatch``: ``optax.microbatch(jax.value_and_grad(loss), ...)`` (a
  ``fori_loop``), one jitted step;
* ``optax.MultiSteps``: ``N`` calls of a jitted micro-step whose optimizer is
  ``optax.MultiSteps(tx, every_k_schedule=N)``;
* ``naive loop``: ``N`` calls of a jitted micro-step that adds its gradient to a float32
  accumulator, then one jitted optimizer update.

A sixth, ``full@B/N`` (the full-batch step on one micro-batch of ``B/N`` rows), is timed
only to decide whether a micro-batch fills the device: it does when its examples per
second reach 90% of the full batch's.

Models: an MLP classifier and a small causal transformer language model (pure JAX). For
each ``N`` in {1, 2, 4, 8, 16, 32, 64}, every method is compiled (timed, with
``memory_analysis()``), warmed up, then timed round-robin in this one process; medians
are reported. The targets are computed as pass/miss columns, never asserted.

Run ``make bench`` (or ``make bench-quick``, or ``BENCH_QUICK=1``); results go to
``benchmarks/results/accumulation.{json,md}`` and ``accumulation_*.png``. On a GPU the
script picks larger models by itself; ``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
METHODS = ("full", "jaxaccum", "optax.microbatch", "optax.MultiSteps", "naive loop")
REFERENCE = "full@B/N"
ALL_NS = (1, 2, 4, 8, 16, 32, 64)
QUICK_NS = (1, 4, 16, 64)

# Target thresholds (see the module docstring of the README section).
NOISE = 1.05           # "no slower than optax.microbatch", within 5% timing noise
NEAR_FULL = 1.10       # within 10% of the full batch where a micro-batch fills the device
FILLS = 0.90           # a micro-batch fills the device: >= 90% of the full batch's examples/s
VS_MULTISTEPS = 1.5    # >= 1.5x faster than optax.MultiSteps at small micro-batches
TEMP_SLACK = 1.5       # temp <= 1.5 x (full temp / N + one float32 parameter-sized buffer)
COMPILE_FLAT = 1.5     # max / min compile time over N


# ----------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  batch: int = 1024
  d_in: int = 256
  hidden: int = 1024
  depth: int = 2
  classes: int = 10


@dataclasses.dataclass(frozen=True)
class LMConfig:
  batch: int = 64
  seq: int = 128
  vocab: int = 256
  d_model: int = 128
  heads: int = 4
  layers: int = 2


def _dense(key: jax.Array, m: int, n: int) -> jax.Array:
  return jax.random.normal(key, (m, n), jnp.float32) / np.sqrt(m)


# Jitted with the config static: one compile per config and seed (not one per random
# draw's shape run op by op, nor one per call: every N measures the same problem).
@functools.partial(jax.jit, static_argnums=(0, 1))
def _mlp_init(cfg: MLPConfig, seed: int):
  keys = jax.random.split(jax.random.key(seed), cfg.depth + 3)
  sizes = [cfg.d_in] + [cfg.hidden] * cfg.depth + [cfg.classes]
  params = [{"w": _dense(k, m, n), "b": jnp.zeros(n)}
            for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=False)]
  x = jax.random.normal(keys[-2], (cfg.batch, cfg.d_in))
  y = jax.random.randint(keys[-1], (cfg.batch,), 0, cfg.classes)
  return params, (x, y)


def mlp_problem(cfg: MLPConfig, seed: int = 0):
  """An MLP classifier: ``(loss_fn, params, batch)`` with a mean cross-entropy loss."""
  params, (x, y) = _mlp_init(cfg, seed)

  def loss_fn(params, batch):
    h, labels = batch
    for layer in params[:-1]:
      h = jax.nn.gelu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss_fn, params, (x, y)


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


@functools.partial(jax.jit, static_argnums=(0, 1))  # as _mlp_init
def _lm_init(cfg: LMConfig, seed: int):
  d = cfg.d_model
  keys = iter(jax.random.split(jax.random.key(seed), 4 + 4 * cfg.layers))
  params = {
      "embed": 0.02 * jax.random.normal(next(keys), (cfg.vocab, d)),
      "pos": 0.02 * jax.random.normal(next(keys), (cfg.seq, d)),
      "layers": [{
          "norm1": jnp.ones(d), "qkv": _dense(next(keys), d, 3 * d),
          "out": _dense(next(keys), d, d), "norm2": jnp.ones(d),
          "up": _dense(next(keys), d, 4 * d), "down": _dense(next(keys), 4 * d, d),
      } for _ in range(cfg.layers)],
      "norm_f": jnp.ones(d),
      "unembed": _dense(next(keys), d, cfg.vocab),
  }
  tokens = jax.random.randint(next(keys), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
  return params, tokens


def lm_problem(cfg: LMConfig, seed: int = 0):
  """A causal transformer LM: ``(loss_fn, params, tokens)``, mean next-token loss."""
  d, h = cfg.d_model, cfg.heads
  params, tokens = _lm_init(cfg, seed)
  causal = np.tril(np.ones((cfg.seq, cfg.seq), bool))

  def loss_fn(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    x = params["embed"][inputs] + params["pos"][:t]
    for layer in params["layers"]:
      q, k, v = jnp.split(_rms_norm(x, layer["norm1"]) @ layer["qkv"], 3, axis=-1)
      q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
      s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // h)
      p = jax.nn.softmax(jnp.where(causal[:t, :t], s, -1e9), axis=-1)
      x = x + jnp.einsum("bhts,bshd->bthd", p, v).reshape(b, t, d) @ layer["out"]
      m = _rms_norm(x, layer["norm2"])
      x = x + jax.nn.gelu(m @ layer["up"]) @ layer["down"]
    logits = _rms_norm(x, params["norm_f"]) @ params["unembed"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss_fn, params, tokens


PROBLEMS = {"mlp": mlp_problem, "transformer": lm_problem}


def default_configs(platform: str, quick: bool) -> dict[str, Any]:
  """Model sizes: small on CPU (smaller still when quick), larger on an accelerator."""
  if platform != "cpu":
    return {"mlp": MLPConfig(batch=8192, d_in=1024, hidden=4096, depth=3),
            "transformer": LMConfig(batch=256, seq=256, vocab=512, d_model=512, heads=8,
                                    layers=4)}
  if quick:
    return {"mlp": MLPConfig(batch=256, d_in=128, hidden=256),
            "transformer": LMConfig(batch=64, seq=32, vocab=128, d_model=64, heads=4,
                                    layers=1)}
  return {"mlp": MLPConfig(), "transformer": LMConfig()}


# The tiny mode (--tiny): the smallest problems, to check that the script runs.
TINY_CONFIGS = {"mlp": MLPConfig(batch=16, d_in=8, hidden=16, depth=1),
                "transformer": LMConfig(batch=8, seq=8, vocab=16, d_model=16, heads=2, layers=1)}


# ---------------------------------------------------------------------------- methods


class Method:
  """One way of computing an optimizer step over the effective batch.

  ``init(params)`` gives the method's state, ``prepare(batch)`` its input (done once,
  outside the timing), ``compile(state, prepared, repeats)`` compiles every executable
  it calls (``repeats`` times, keeping the fastest time) and returns their statistics,
  and ``step(state, prepared)`` runs one optimizer step and returns ``(state, loss)``.
  ``params(state)`` reads the parameters back.
  """

  name: str

  def init(self, params):
    raise NotImplementedError

  def prepare(self, batch):
    return batch

  def compile(self, state, prepared, repeats: int = 1) -> dict[str, Any]:
    raise NotImplementedError

  def step(self, state, prepared):
    raise NotImplementedError

  def params(self, state):
    return state[0]


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


class OneCall(Method):
  """A method whose whole step is one jitted call ``(params, opt_state, batch)``."""

  def __init__(self, name: str, value_and_grad: Callable, tx: optax.GradientTransformation):
    self.name, self._tx = name, tx

    def step(state, batch):
      params, opt_state = state
      loss, grads = value_and_grad(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    self._jit = _common.fresh_jit(step, donate_argnums=0)
    self._compiled = None

  def init(self, params):
    params = _copy(params)
    return params, self._tx.init(params)

  def compile(self, state, prepared, repeats=1):
    self._compiled, stats = _common.compile_with_stats(self._jit, state, prepared,
                                                       repeats=repeats)
    return stats

  def step(self, state, prepared):
    return self._compiled(state, prepared)


class MultiStepsLoop(Method):
  """``N`` jitted calls per step; the optimizer is ``optax.MultiSteps(tx, N)``."""

  name = "optax.MultiSteps"

  def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, n: int):
    self._n = n
    self._tx = optax.MultiSteps(tx, every_k_schedule=n)
    vg = jax.value_and_grad(loss_fn)

    def micro_step(state, loss_acc, micro_batch):
      params, opt_state = state
      loss, grads = vg(params, micro_batch)
      updates, opt_state = self._tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss_acc + loss / n

    self._jit = _common.fresh_jit(micro_step, donate_argnums=0)
    self._zero = jnp.zeros((), jnp.float32)

  def init(self, params):
    params = _copy(params)
    return params, self._tx.init(params)

  def prepare(self, batch):
    stacked = jaxaccum.split_micro_batches(batch, num_micro_batches=self._n)
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(self._n)]

  def compile(self, state, prepared, repeats=1):
    self._compiled, stats = _common.compile_with_stats(self._jit, state, self._zero,
                                                       prepared[0], repeats=repeats)
    return stats

  def step(self, state, prepared):
    loss = self._zero
    for micro_batch in prepared:
      state, loss = self._compiled(state, loss, micro_batch)
    return state, loss


class NaiveLoop(Method):
  """``N`` jitted micro-steps adding into a float32 accumulator, then one jitted update."""

  name = "naive loop"

  def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, n: int):
    self._n, self._tx = n, tx
    vg = jax.value_and_grad(loss_fn)

    def micro_step(params, acc, loss_acc, micro_batch):
      loss, grads = vg(params, micro_batch)
      acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
      return acc, loss_acc + loss / n

    def apply(state):
      params, opt_state, acc = state
      grads = jax.tree.map(lambda a, p: (a / n).astype(p.dtype), acc, params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state,
              jax.tree.map(jnp.zeros_like, acc))

    self._micro = _common.fresh_jit(micro_step, donate_argnums=1)
    self._apply = _common.fresh_jit(apply, donate_argnums=0)
    self._zero = jnp.zeros((), jnp.float32)

  def init(self, params):
    params = _copy(params)
    acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return params, self._tx.init(params), acc

  prepare = MultiStepsLoop.prepare

  def compile(self, state, prepared, repeats=1):
    params, _, acc = state
    self._micro_c, stats = _common.compile_with_stats(self._micro, params, acc, self._zero,
                                                      prepared[0], repeats=repeats)
    self._apply_c, apply_stats = _common.compile_with_stats(self._apply, state,
                                                            repeats=repeats)
    # Memory: the larger of the two executables (the micro-step); compile time: both.
    stats["compile_s"] += apply_stats["compile_s"]
    stats["compile_s_all"] = [a + b for a, b in zip(stats["compile_s_all"],
                                                    apply_stats["compile_s_all"], strict=True)]
    return stats

  def step(self, state, prepared):
    params, opt_state, acc = state
    loss = self._zero
    for micro_batch in prepared:
      acc, loss = self._micro_c(params, acc, loss, micro_batch)
    # The update donates the whole state and returns a fresh zero accumulator.
    return self._apply_c((params, opt_state, acc)), loss


class FullOnPrefix(OneCall):
  """The full-batch step on the first ``B / N`` rows: how fast one micro-batch runs alone."""

  def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, n: int):
    super().__init__(REFERENCE, jax.value_and_grad(loss_fn), tx)
    self._n = n

  def prepare(self, batch):
    return jax.tree.map(lambda x: x[: x.shape[0] // self._n], batch)


def build_methods(loss_fn: Callable, tx: optax.GradientTransformation, batch_size: int,
                  n: int, *, reference: bool = True) -> dict[str, Method]:
  """The methods of :data:`METHODS` (and the ``full@B/N`` reference) for ``N = n``."""
  methods: list[Method] = [
      OneCall("full", jax.value_and_grad(loss_fn), tx),
      OneCall("jaxaccum", jaxaccum.value_and_grad(loss_fn, num_micro_batches=n), tx),
      OneCall("optax.microbatch",
              optax.microbatch(jax.value_and_grad(loss_fn), argnums=1,
                               microbatch_size=batch_size // n,
                               accumulator=optax.microbatching.AccumulationType.MEAN), tx),
      MultiStepsLoop(loss_fn, tx, n),
      NaiveLoop(loss_fn, tx, n),
  ]
  if reference:
    methods.append(FullOnPrefix(loss_fn, tx, n))
  return {m.name: m for m in methods}


def param_bytes_f32(params) -> int:
  """Bytes of one float32 buffer shaped like ``params``."""
  return sum(4 * int(np.prod(p.shape)) for p in jax.tree.leaves(params))


# -------------------------------------------------------------------------- measuring


def measure(model: str, cfg: Any, n: int, *, repeats: int, warmup: int,
            compile_repeats: int = 1, lr: float = 1e-3) -> dict[str, Any]:
  """Compiles, warms up and times every method for one model and one ``N``."""
  loss_fn, params, batch = PROBLEMS[model](cfg)
  methods = build_methods(loss_fn, optax.sgd(lr), cfg.batch, n)
  states, inputs, stats = {}, {}, {}
  for name, m in methods.items():
    inputs[name] = _common.block(m.prepare(batch))
    states[name] = m.init(params)
    stats[name] = m.compile(states[name], inputs[name], repeats=compile_repeats)
  losses = {}

  def runner(name):
    def run():
      states[name], losses[name] = _common.block(methods[name].step(states[name],
                                                                     inputs[name]))
    return run

  times = _common.time_interleaved({name: runner(name) for name in methods},
                                   repeats=repeats, warmup=warmup)
  out = {}
  for name in methods:
    t = _common.median(times[name])
    rows = cfg.batch // n if name == REFERENCE else cfg.batch
    out[name] = {"step_s": t, "times_s": times[name], "examples_per_s": rows / t,
                 **stats[name]}
  return {"n": n, "micro_batch": cfg.batch // n, "batch": cfg.batch,
          "param_bytes_f32": param_bytes_f32(params), "methods": out}


def targets(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Pass/miss of each target for one model's rows (one row per ``N``)."""
  per_n = []
  for row in rows:
    m = row["methods"]
    t = {k: v["step_s"] for k, v in m.items()}
    fills = m[REFERENCE]["examples_per_s"] >= FILLS * m["full"]["examples_per_s"]
    expected_temp = m["full"]["temp"] / row["n"] + row["param_bytes_f32"]
    r = {
        "n": row["n"],
        "fills_device": bool(fills),
        "vs_microbatch": t["jaxaccum"] / t["optax.microbatch"],
        "vs_full": t["jaxaccum"] / t["full"],
        "multisteps_speedup": t["optax.MultiSteps"] / t["jaxaccum"],
        "temp_vs_expected": m["jaxaccum"]["temp"] / expected_temp,
        # What jaxaccum's temp holds beyond 1/N of the full batch's, in f32 parameter sizes.
        "temp_extra_params": (m["jaxaccum"]["temp"] - m["full"]["temp"] / row["n"])
                             / row["param_bytes_f32"],
    }
    r["pass_vs_microbatch"] = r["vs_microbatch"] <= NOISE
    r["pass_vs_full"] = (r["vs_full"] <= NEAR_FULL) if fills else None
    r["pass_vs_multisteps"] = (r["multisteps_speedup"] >= VS_MULTISTEPS) if not fills else None
    r["pass_temp"] = r["temp_vs_expected"] <= TEMP_SLACK
    per_n.append(r)
  compile_s = [row["methods"]["jaxaccum"]["compile_s"] for row in rows]
  spread = max(compile_s) / min(compile_s)
  return {"per_n": per_n, "compile_spread": spread, "pass_compile_flat": spread <= COMPILE_FLAT}


# --------------------------------------------------------------------------- reporting


def _mark(ok: bool | None) -> str:
  return "n/a" if ok is None else ("pass" if ok else "**miss**")


def markdown(results: dict[str, Any]) -> str:
  """The results as markdown tables: step time, memory and compile time, targets."""
  env = results["environment"]
  lines = [
      "# Gradient accumulation benchmark",
      "",
      f"{env['date']}, device `{env['device_kind']}` ({env['platform']}, "
      f"{env['num_devices']} device(s)), host CPUs {env['host_cpus']}, jax {env['jax']}, "
      f"{'quick run' if results['quick'] else 'full run'}: {results['repeats']} timed "
      f"repeats after {results['warmup']} warm-up, medians; compile time the fastest of "
      f"{results['compile_repeats']} compilation(s).",
      "",
  ]
  for model, block in results["models"].items():
    rows = block["rows"]
    lines += [f"## {model}: `{block['config']}`", "",
              "Step time (ms, median) for one optimizer step over the whole batch; "
              "examples/s for jaxaccum.", "",
              "| N | micro-batch | " + " | ".join(METHODS) + f" | {REFERENCE} | "
              "jaxaccum ex/s |",
              "|---:" * (len(METHODS) + 4) + "|"]
    for row in rows:
      m = row["methods"]
      cells = [f"{1e3 * m[k]['step_s']:.2f}" for k in METHODS + (REFERENCE,)]
      lines.append(f"| {row['n']} | {row['micro_batch']} | " + " | ".join(cells)
                   + f" | {m['jaxaccum']['examples_per_s']:,.0f} |")
    lines += ["", "Compiled memory in MiB, total = argument + output + temp - alias, and "
              "temp alone (for the two loops: their micro-step executable); compile time "
              "in s (lower + compile; the naive loop's includes its update step).", "",
              "| N | total full | total jaxaccum | " + " | ".join(f"temp {k}" for k in METHODS)
              + " | " + " | ".join(f"compile {k}" for k in METHODS) + " |",
              "|---:" * (3 + 2 * len(METHODS)) + "|"]
    for row in rows:
      m = row["methods"]
      lines.append(
          f"| {row['n']} | {m['full']['total'] / _common.MIB:.2f} | "
          f"{m['jaxaccum']['total'] / _common.MIB:.2f} | "
          + " | ".join(f"{m[k]['temp'] / _common.MIB:.2f}" for k in METHODS) + " | "
          + " | ".join(f"{m[k]['compile_s']:.2f}" for k in METHODS) + " |")
    tg = block["targets"]
    lines += ["", "Targets (computed; see the legend below).", "",
              "| N | micro-batch fills device | jaxaccum / optax.microbatch | "
              "jaxaccum / full | MultiSteps / jaxaccum | temp / (full temp/N + f32 params) | "
              "(temp - full temp/N) / f32 params |",
              "|---:|:---:|---:|---:|---:|---:|---:|"]
    for r in tg["per_n"]:
      lines.append(
          f"| {r['n']} | {'yes' if r['fills_device'] else 'no'} | "
          f"{r['vs_microbatch']:.2f} {_mark(r['pass_vs_microbatch'])} | "
          f"{r['vs_full']:.2f} {_mark(r['pass_vs_full'])} | "
          f"{r['multisteps_speedup']:.2f} {_mark(r['pass_vs_multisteps'])} | "
          f"{r['temp_vs_expected']:.2f} {_mark(r['pass_temp'])} | "
          f"{r['temp_extra_params']:.2f} |")
    lines += ["", f"jaxaccum compile time, max/min over N: {tg['compile_spread']:.2f} "
              f"{_mark(tg['pass_compile_flat'])}", ""]
  lines += [
      "Legend. A micro-batch *fills the device* when the full-batch step on one micro-batch "
      f"alone ({REFERENCE}) reaches {FILLS:.0%} of the full batch's examples/s. Targets: "
      f"jaxaccum / optax.microbatch <= {NOISE} (no slower, within 5% timing noise); "
      f"jaxaccum / full <= {NEAR_FULL} where a micro-batch fills the device; "
      f"MultiSteps / jaxaccum >= {VS_MULTISTEPS} where it does not (small micro-batches); "
      f"jaxaccum temp <= {TEMP_SLACK} x (full-batch temp / N + one float32 parameter-sized "
      f"buffer); compile time max/min over N <= {COMPILE_FLAT}.", ""]
  return "\n".join(lines)


def _log_axes(ax, ns: Sequence[int]) -> None:
  """Log-log axes with plain numbers: N on the x ticks, 1-2-5 steps on the y axis."""
  from matplotlib import ticker

  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.xaxis.set_major_locator(ticker.FixedLocator(ns))
  ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%d"))
  ax.xaxis.set_minor_locator(ticker.NullLocator())
  ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
  ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
  ax.yaxis.set_minor_formatter(ticker.NullFormatter())
  ax.grid(alpha=0.3)


def plot(results: dict[str, Any], out_dir: pathlib.Path) -> list[pathlib.Path]:
  """Step time vs N and memory vs N, one panel per model."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(results["models"])
  paths = []
  fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
  for ax, model in zip(axes[0], models, strict=True):
    rows = results["models"][model]["rows"]
    ns = [r["n"] for r in rows]
    for name in METHODS + (REFERENCE,):
      ax.plot(ns, [1e3 * r["methods"][name]["step_s"] for r in rows], marker="o",
              linestyle=":" if name == REFERENCE else "-", label=name)
    ax.set(xlabel="micro-batches N", ylabel="step time (ms)",
           title=f"{model}, batch {rows[0]['batch']}")
    _log_axes(ax, ns)
    ax.legend(fontsize=8)
  fig.suptitle(f"One optimizer step, {results['environment']['device_kind']}")
  fig.tight_layout()
  paths.append(out_dir / "accumulation_step_time.png")
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)

  fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
  for ax, model in zip(axes[0], models, strict=True):
    rows = results["models"][model]["rows"]
    ns = [r["n"] for r in rows]
    for i, name in enumerate(METHODS[:3]):
      color = f"C{i}"
      ax.plot(ns, [r["methods"][name]["total"] / _common.MIB for r in rows], marker="o",
              color=color, label=f"{name} total")
      ax.plot(ns, [r["methods"][name]["temp"] / _common.MIB for r in rows], marker="s",
              linestyle="--", color=color, label=f"{name} temp")
    ax.plot(ns, [(r["methods"]["full"]["temp"] / r["n"] + r["param_bytes_f32"]) / _common.MIB
                 for r in rows], color="gray", linestyle=":",
            label="full temp / N + f32 params")
    ax.set(xlabel="micro-batches N", ylabel="compiled MiB",
           title=f"{model}, batch {rows[0]['batch']}")
    _log_axes(ax, ns)
    ax.legend(fontsize=7)
  fig.suptitle(f"Compiled memory, {results['environment']['device_kind']}")
  fig.tight_layout()
  paths.append(out_dir / "accumulation_memory.png")
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)
  return paths


def run(*, quick: bool, ns: Sequence[int] | None = None, models: Sequence[str] = ("mlp",
        "transformer"), repeats: int | None = None, warmup: int | None = None,
        compile_repeats: int | None = None,
        out_dir: pathlib.Path = RESULTS, configs: dict[str, Any] | None = None,
        progress: bool = True) -> dict[str, Any]:
  """Runs the benchmark and writes the JSON, markdown and plots; returns the results."""
  env = _common.device_info()
  ns = tuple(ns or (QUICK_NS if quick else ALL_NS))
  repeats = repeats or (5 if quick else 7)
  warmup = warmup or (1 if quick else 2)
  compile_repeats = compile_repeats or (1 if quick else 2)
  configs = configs or default_configs(env["platform"], quick)
  results = {"environment": env, "quick": quick, "repeats": repeats, "warmup": warmup,
             "compile_repeats": compile_repeats,
             "targets": {"noise": NOISE, "near_full": NEAR_FULL, "fills": FILLS,
                         "vs_multisteps": VS_MULTISTEPS, "temp_slack": TEMP_SLACK,
                         "compile_flat": COMPILE_FLAT},
             "models": {}}
  jobs = [(model, n) for model in models for n in ns]
  bar = None
  if progress:
    from tqdm import tqdm

    bar = tqdm(total=len(jobs), desc="bench", file=sys.stderr)
  for model in models:
    rows = []
    for n in ns:
      if bar is not None:
        bar.set_postfix_str(f"{model} N={n}")
      rows.append(measure(model, configs[model], n, repeats=repeats, warmup=warmup,
                          compile_repeats=compile_repeats))
      if bar is not None:
        bar.update()
    results["models"][model] = {"config": repr(configs[model]), "rows": rows,
                                "targets": targets(rows)}
  if bar is not None:
    bar.close()
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "accumulation.json").write_text(json.dumps(results, indent=1))
  (out_dir / "accumulation.md").write_text(markdown(results))
  plot(results, out_dir)
  return results


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                      help="small models, N in 1,4,16,64, 5 repeats (also BENCH_QUICK=1)")
  parser.add_argument("--ns", type=int, nargs="+", help="micro-batch counts N")
  parser.add_argument("--models", nargs="+", choices=list(PROBLEMS),
                      help="default: all; mlp only in the tiny mode")
  parser.add_argument("--repeats", type=int, help="timed repeats per method")
  parser.add_argument("--warmup", type=int, help="warm-up steps per method")
  parser.add_argument("--compile-repeats", type=int,
                      help="compilations per executable; the fastest is reported")
  parser.add_argument("--out-dir", type=pathlib.Path, help=f"default: {RESULTS}")
  _common.add_tiny(parser)
  args = parser.parse_args(argv)
  out_dir = _common.out_dir_for(args.tiny, args.out_dir, RESULTS)
  tiny = {"ns": args.ns or (1, 2), "models": args.models or ("mlp",), "repeats": 1,
          "warmup": 1, "compile_repeats": 1, "configs": TINY_CONFIGS,
          "progress": False} if args.tiny else {}
  kwargs = {"ns": args.ns, "models": args.models or list(PROBLEMS), "repeats": args.repeats,
            "warmup": args.warmup, "compile_repeats": args.compile_repeats, **tiny}
  results = run(quick=args.quick or args.tiny, out_dir=out_dir, **kwargs)
  print(markdown(results))
  print(f"wrote {out_dir}/accumulation.json, accumulation.md, "
        "accumulation_step_time.png, accumulation_memory.png")


if __name__ == "__main__":
  main()
