"""The accumulated train step of a ~136M-parameter LM where the global batch does not fit.

A decoder-only transformer LM (d_model 768, 12 layers in a ``lax.scan`` over stacked
weights, 12 heads, vocabulary 32,768, 1,024 tokens per sequence: 136M parameters), float32
parameters and AdamW state, bf16 compute (the parameters are cast to bf16 inside the loss),
and a global batch of 128 sequences (131,072 tokens) that does not fit in one pass on an
H200. Side by side in one process, timed round-robin (``_common.time_interleaved``):

* ``jaxaccum N=n``: ``jaxaccum.value_and_grad(loss, num_micro_batches=n)`` and an AdamW
  update in one jitted step, at the planner's count ``N`` and at ``2N`` and ``4N``;
* ``micro-batch alone``: the plain step on one micro-batch of ``B / N`` sequences, the
  largest that fits (the accumulated step's time per token against it: goal <= 1.03x);
* ``optax.microbatch``, ``optax.MultiSteps`` (``N`` jitted calls) and a ``naive loop``
  (``N`` jitted micro-steps adding into a float32 accumulator, then a jitted update), at ``N``;
* ``full batch``: ``jax.value_and_grad`` on the whole batch, where its compiled program fits
  the device's memory;
* the accumulated step at ``N`` compiled with XLA's latency-hiding scheduler
  (``xla_gpu_enable_latency_hiding_scheduler``), with while-loop double buffering
  (``xla_gpu_enable_while_loop_double_buffering``, which applies to every while loop: the
  micro-batch loop and the layer scan inside it), and with both.

Per method: compiled memory (``memory_analysis()``), the step time (median of interleaved
repeats), tokens per second, MFU against a bf16 dense peak (``--peak-tflops``, 989 TFLOP/s:
the H100/H200 SXM dense bf16 specification), and on a GPU the allocator's peak
(``device.memory_stats()["peak_bytes_in_use"]``), read after each method's first step in
order of increasing compiled memory (the process peak only grows: a method that does not
raise it is reported as "<=" the peak so far).

**The planner against the device.** ``--prediction FILE`` reads a JSON written by
``--predict`` (``jaxaccum.plan_step`` for the same step, compiled for a described GPU on a
CPU host, e.g. ``--predict --target h200``): its count ``N`` is the one run, its predicted
peak is compared with the measured one (goal: within 10%; the plan's step runs first, alone
with its arguments, so the allocator's peak is its own), and half as many micro-batches is
tried last (goal: out of memory). Without ``--prediction`` the plan is made in process, for
the device present.

``--tiny`` (or ``BENCH_TINY=1``): a 2-layer, d=32 model on 16 sequences of 32 tokens that
runs every method, the flags and the prediction check on a CPU in about a minute (the dry
run the test suite runs). ``--time-budget S``: methods still to compile once 0.65 S seconds
have passed are skipped and listed, and the repeats fit in the rest. A plot of tokens per
second and peak memory per method goes with the tables. The dry run compiles with
``--xla_backend_optimization_level=0`` (added to ``XLA_FLAGS``): it checks the programs, not
their speed. Output:
``bench_gpu_lm{,_tiny}.{json,md,png}`` in ``--out-dir``.

  # on a CPU host, in the environment with the gpu-plan extra:
  JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/bench_gpu_lm.py --predict --target h200
  # on the H100 or H200: the committed plan for the card present (plan_for_device)
  python benchmarks/bench_gpu_lm.py --prediction auto
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv or os.environ.get("BENCH_TINY", "") not in ("", "0"):
  # The dry run checks the programs, not their speed: LLVM's optimizations off cut its
  # compile times by about 2.5x on a CPU.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

import jaxaccum  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "gpu"
GIB = 2.0**30
PEAK_TFLOPS = 989.0  # H200 SXM (and H100 SXM) bf16 dense, from the specification
TINY_BUDGET = 3_000_000  # bytes: the dry run's plan needs N > 1 (the full step takes ~7 MiB)
OVERHEAD_GOAL = 1.03
PLAN_GOAL = 0.10
FLAGS = {
    "latency-hiding scheduler": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "while-loop double buffering": {"xla_gpu_enable_while_loop_double_buffering": True},
    "both": {"xla_gpu_enable_latency_hiding_scheduler": True,
             "xla_gpu_enable_while_loop_double_buffering": True},
}


@dataclasses.dataclass(frozen=True)
class LMConfig:
  batch: int = 128
  seq: int = 1024
  vocab: int = 32768
  d_model: int = 768
  heads: int = 12
  layers: int = 12


GPU_CONFIG = LMConfig()
TINY_CONFIG = LMConfig(batch=16, seq=32, vocab=256, d_model=32, heads=2, layers=2)


# ----------------------------------------------------------------------------- the model


def param_shapes(cfg: LMConfig) -> dict[str, Any]:
  """The parameters as float32 ShapeDtypeStructs (layers stacked for the scan)."""
  d, L, f32 = cfg.d_model, cfg.layers, jnp.float32
  sds = jax.ShapeDtypeStruct
  return {
      "embed": sds((cfg.vocab, d), f32), "pos": sds((cfg.seq, d), f32),
      "layers": {"norm1": sds((L, d), f32), "qkv": sds((L, d, 3 * d), f32),
                 "out": sds((L, d, d), f32), "norm2": sds((L, d), f32),
                 "up": sds((L, d, 4 * d), f32), "down": sds((L, 4 * d, d), f32)},
      "norm_f": sds((d,), f32), "unembed": sds((d, cfg.vocab), f32),
  }


def init_params(cfg: LMConfig, seed: int = 0) -> dict[str, Any]:
  shapes = param_shapes(cfg)
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = []
  for k, s in zip(keys, leaves, strict=True):
    if len(s.shape) == 1 or (len(s.shape) == 2 and s.shape[0] == cfg.layers):  # norm scales
      out.append(jnp.ones(s.shape, s.dtype))
    else:
      out.append(jax.random.normal(k, s.shape, s.dtype) * 0.02)
  return jax.tree.unflatten(treedef, out)


def batch_shape(cfg: LMConfig, rows: int | None = None) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((cfg.batch if rows is None else rows, cfg.seq + 1), jnp.int32)


def make_loss(cfg: LMConfig) -> Callable[[Any, jax.Array], jax.Array]:
  """Next-token cross-entropy; float32 parameters, computed in bf16 (logits in float32)."""
  h = cfg.heads

  def loss_fn(params, tokens):
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    return _common.scanned_lm_loss(p, tokens, h)

  return loss_fn


def num_params(cfg: LMConfig) -> int:
  return sum(math.prod(s.shape) for s in jax.tree.leaves(param_shapes(cfg)))


def flops_per_token(cfg: LMConfig) -> float:
  """Training FLOPs per token, ``6 N + 12 L T d`` (PaLM, appendix B): ``N`` the parameters
  that multiply (the layers and the unembedding; the embedding and position lookups do
  not), ``12 L T d`` the attention scores and values, forward and backward, the causal
  half not skipped."""
  d, L = cfg.d_model, cfg.layers
  matmul_params = L * (d * 3 * d + d * d + 2 * d * 4 * d) + d * cfg.vocab
  return 6.0 * matmul_params + 12.0 * L * cfg.seq * d


def optimizer() -> optax.GradientTransformation:
  return optax.adamw(1e-4, weight_decay=0.1)


# ----------------------------------------------------------------------------- the steps


def make_step(cfg: LMConfig, n: int):
  """``jax.jit`` of the jaxaccum train step at ``n`` micro-batches (``n = 1``: plain
  ``jax.value_and_grad``); parameters and optimizer state donated."""
  loss_fn, tx = make_loss(cfg), optimizer()
  grad_fn = (jax.value_and_grad(loss_fn) if n == 1
             else jaxaccum.value_and_grad(loss_fn, num_micro_batches=n))

  def step(params, opt_state, tokens):
    loss, grads = grad_fn(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def make_optax_microbatch_step(cfg: LMConfig, n: int):
  loss_fn, tx = make_loss(cfg), optimizer()
  grad_fn = optax.microbatch(jax.value_and_grad(loss_fn), argnums=1,
                             microbatch_size=cfg.batch // n,
                             accumulator=optax.microbatching.AccumulationType.MEAN)

  def step(params, opt_state, tokens):
    loss, grads = grad_fn(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def memory_of(compiled, platform: str | None = None) -> dict[str, float]:
  """Compiled memory in bytes, read as ``jaxaccum.plan`` reads it (``PlanCandidate``):
  ``peak`` is XLA's ``peak_memory_in_bytes`` off the CPU (it counts temporaries there),
  ``argument + output + temp - alias`` on the CPU (where it leaves them out)."""
  m = compiled.memory_analysis()
  out = {k: float(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias",
                                                               "temp")}
  xla_peak = float(getattr(m, "peak_memory_in_bytes", 0) or 0)
  total = out["argument"] + out["output"] + out["temp"] - out["alias"]
  cpu = (platform or jax.devices()[0].platform) == "cpu"
  out["peak"] = xla_peak if not cpu and xla_peak > 0 else total
  return out


def compile_timed(jitted, *args, options: dict[str, Any] | None = None):
  t0 = time.perf_counter()
  compiled = jitted.lower(*args).compile(compiler_options=options or None)
  return compiled, time.perf_counter() - t0


def micro_batches(tokens: jax.Array, n: int) -> list[jax.Array]:
  stacked = jaxaccum.split_micro_batches(tokens, num_micro_batches=n)
  return [stacked[i] for i in range(n)]


@dataclasses.dataclass
class Method:
  """A method: its compiled programs, what one global step runs, and its figures."""

  name: str
  n: int
  tokens_per_step: int
  memory: dict[str, float]
  compile_s: float
  run: Callable[[], Any]
  result: dict[str, Any] = dataclasses.field(default_factory=dict)


class Shared:
  """The parameters and AdamW state the one-call methods train in turn (donated each step,
  so one copy is alive), and the global batch."""

  def __init__(self, cfg: LMConfig, seed: int = 0):
    self.params = init_params(cfg, seed)
    self.opt_state = optimizer().init(self.params)
    self.tokens = jax.random.randint(jax.random.key(seed + 1), (cfg.batch, cfg.seq + 1), 0,
                                     cfg.vocab, jnp.int32)

  def one_call(self, compiled, tokens):
    def run():
      self.params, self.opt_state, loss = compiled(self.params, self.opt_state, tokens)
      return _common.block(loss)
    return run


def first_call(m: Method) -> None:
  """Runs ``m``'s first step; on a GPU records the allocator's peak after it."""
  before = device_memory()
  m.run()
  after = device_memory()
  m.result["first_call_done"] = True
  if before is not None and after is not None:
    m.result["device_in_use_before"] = before["bytes_in_use"]
    m.result["device_peak_bytes"] = after["peak_bytes_in_use"]
    m.result["device_peak_raised"] = after["peak_bytes_in_use"] > before["peak_bytes_in_use"]


def build_methods(cfg: LMConfig, shared: Shared, n: int, counts: list[int],
                  deadline: float, skipped: list[str], full_limit: float | None,
                  full_predicted: float | None = None) -> list[Method]:
  """Compiles every method (in order of priority, until ``deadline``); returns them."""
  tokens = shared.tokens
  B, T = cfg.batch, cfg.seq
  state = (shared.params, shared.opt_state)
  methods: list[Method] = []

  def add(name: str, build: Callable[[], Method | None]) -> None:
    if time.perf_counter() > deadline:
      skipped.append(name)
      return
    m = build()
    if m is not None:
      methods.append(m)

  def one_call(name, jitted, toks, nn, options=None):
    def build():
      compiled, secs = compile_timed(jitted, *state, toks, options=options)
      return Method(name, nn, toks.shape[0] * T, memory_of(compiled), secs,
                    shared.one_call(compiled, toks))
    return build

  add(f"jaxaccum N={n}", one_call(f"jaxaccum N={n}", make_step(cfg, n), tokens, n))
  if methods:  # its first call before anything else is allocated: the peak is its own
    first_call(methods[0])
  alone = tokens[: B // n]
  add(f"micro-batch alone ({B // n} seq)",
      one_call(f"micro-batch alone ({B // n} seq)", make_step(cfg, 1), alone, 1))
  add(f"optax.microbatch N={n}", one_call(f"optax.microbatch N={n}",
                                          make_optax_microbatch_step(cfg, n), tokens, n))
  add(f"optax.MultiSteps N={n}", lambda: multisteps(cfg, shared, n))
  add(f"naive loop N={n}", lambda: naive_loop(cfg, shared, n))
  more = [k for k in counts if k != n]  # 2N, then the flags, then 4N (in order of priority)
  for k in more[:1]:
    add(f"jaxaccum N={k}", one_call(f"jaxaccum N={k}", make_step(cfg, k), tokens, k))
  for label, options in FLAGS.items():
    add(f"jaxaccum N={n} + {label}",
        one_call(f"jaxaccum N={n} + {label}", make_step(cfg, n), tokens, n, options))
  for k in more[1:]:
    add(f"jaxaccum N={k}", one_call(f"jaxaccum N={k}", make_step(cfg, k), tokens, k))

  def full():
    if full_limit is not None and full_predicted is not None and full_predicted > full_limit:
      m = Method("full batch", 1, B * T, {"peak": float(full_predicted)}, 0.0, lambda: None)
      m.result["skipped"] = (f"does not fit: predicted peak {full_predicted / GIB:.2f} GiB > "
                             f"the device's {full_limit / GIB:.2f} GiB (not compiled)")
      return m
    compiled, secs = compile_timed(make_step(cfg, 1), *state, tokens)
    mem = memory_of(compiled)
    m = Method("full batch", 1, B * T, mem, secs, shared.one_call(compiled, tokens))
    if full_limit is not None and mem["peak"] > full_limit:
      m.result["skipped"] = (f"does not fit: compiled peak {mem['peak'] / GIB:.2f} GiB > "
                             f"the device's {full_limit / GIB:.2f} GiB")
    return m
  add("full batch", full)
  return methods


def multisteps(cfg: LMConfig, shared: Shared, n: int) -> Method:
  loss_fn = make_loss(cfg)
  tx = optax.MultiSteps(optimizer(), every_k_schedule=n)
  vg = jax.value_and_grad(loss_fn)

  def micro_step(params, opt_state, micro):
    loss, grads = vg(params, micro)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.tree.map(jnp.copy, shared.params)
  holder = {"state": (params, tx.init(params))}
  micros = micro_batches(shared.tokens, n)
  compiled, secs = compile_timed(jax.jit(micro_step, donate_argnums=(0, 1)),
                                 *holder["state"], micros[0])

  def run():
    params, opt_state = holder["state"]
    loss = None
    for micro in micros:
      params, opt_state, loss = compiled(params, opt_state, micro)
    holder["state"] = (params, opt_state)
    return _common.block(loss)

  return Method(f"optax.MultiSteps N={n}", n, cfg.batch * cfg.seq, memory_of(compiled), secs,
                run)


def naive_loop(cfg: LMConfig, shared: Shared, n: int) -> Method:
  loss_fn, tx = make_loss(cfg), optimizer()
  vg = jax.value_and_grad(loss_fn)

  def micro_step(params, acc, loss_acc, micro):
    loss, grads = vg(params, micro)
    return jax.tree.map(jnp.add, acc, grads), loss_acc + loss / n

  def apply(params, opt_state, acc):
    grads = jax.tree.map(lambda a: a / n, acc)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  micros = micro_batches(shared.tokens, n)
  zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))
  zero = jnp.zeros((), jnp.float32)
  acc0 = zeros(shared.params)
  micro_c, s1 = compile_timed(jax.jit(micro_step, donate_argnums=1), shared.params, acc0, zero,
                              micros[0])
  apply_c, s2 = compile_timed(jax.jit(apply, donate_argnums=(0, 1)), shared.params,
                              shared.opt_state, acc0)
  del acc0

  def run():
    acc, loss = zeros(shared.params), zero
    for micro in micros:
      acc, loss = micro_c(shared.params, acc, loss, micro)
    shared.params, shared.opt_state = apply_c(shared.params, shared.opt_state, acc)
    return _common.block(loss)

  return Method(f"naive loop N={n}", n, cfg.batch * cfg.seq, memory_of(micro_c), s1 + s2, run)


# ----------------------------------------------------------------------------- the planner


def predict(cfg: LMConfig, *, target: str | None, budget: int | None) -> dict[str, Any]:
  """``jaxaccum.plan_step`` for the benchmark's step (compiled, never run), as a JSON-able
  dict: the chosen count, its predicted peak, and half as many micro-batches' peak."""
  params = param_shapes(cfg)
  opt_state = jax.eval_shape(optimizer().init, params)
  tokens = batch_shape(cfg)
  plan = jaxaccum.plan_step(lambda n: make_step(cfg, n), params, opt_state, tokens,
                            batch_argnums=2, target=target, memory_budget_bytes=budget)
  by_n = {c.num_micro_batches: c for c in plan.candidates}
  n = plan.num_micro_batches
  half = None
  if n > 1:
    h = max(k for k in range(1, n) if cfg.batch % k == 0 and n % k == 0)
    if h not in by_n:  # not compiled by the search: compile it
      extra = jaxaccum.plan_step(lambda _: make_step(cfg, h), params, opt_state,
                                 batch_shape(cfg), batch_argnums=2, target=target,
                                 memory_budget_bytes=2**62, verbose=False)
      by_n[h] = extra.candidates[0]._replace(num_micro_batches=h,
                                             micro_batch_size=cfg.batch // h,
                                             fits=extra.candidates[0].peak_bytes
                                             <= plan.memory_budget_bytes)
    half = {"num_micro_batches": h, "peak_bytes": by_n[h].peak_bytes, "fits": by_n[h].fits}
  env = _common.device_info()
  where = (f"compiled for a described {target.upper()} on a {env['host_cpus']}-core CPU host"
           if target else f"compiled for the {env['device_kind']} present")
  return {
      "note": f"{where}, jax {env['jax']}, {env['date']}: compiled-program figures, never run",
      "config": dataclasses.asdict(cfg),
      "num_params": num_params(cfg),
      "device": plan.device,
      "target": target,
      "memory_budget_bytes": plan.memory_budget_bytes,
      "num_micro_batches": n,
      "micro_batch_size": plan.micro_batch_size,
      "peak_bytes": plan.peak_bytes,
      "half": half,
      "candidates": [c._asdict() for c in plan.candidates],
      "table": plan.table(),
      "environment": env,
  }


def flag_memory(cfg: LMConfig, n: int, *, target: str | None) -> dict[str, Any]:
  """The accumulated step at ``n`` compiled with each of ``FLAGS`` (and without), for the
  described ``target`` GPU (or the device present): compiled memory and compile time."""
  params = param_shapes(cfg)
  opt_state = jax.eval_shape(optimizer().init, params)
  args: tuple[Any, ...] = (params, opt_state, batch_shape(cfg))
  if target is not None:
    mesh = jaxaccum.planning.target_mesh(target, (1,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        args)
  out = {}
  for label, options in {"default": {}, **FLAGS}.items():
    compiled, secs = compile_timed(make_step(cfg, n), *args, options=options)
    platform = "cuda" if target is not None else None
    out[label] = {"options": options, "compile_s": secs, **memory_of(compiled, platform)}
  return out


# ----------------------------------------------------------------------------- the run


def device_memory() -> dict[str, float] | None:
  stats = jax.devices()[0].memory_stats()
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return {k: float(stats.get(k, float("nan")))
          for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def run(*, tiny: bool, prediction: dict[str, Any] | None, repeats: int, warmup: int,
        time_budget: float, peak_tflops: float) -> dict[str, Any]:
  start = time.perf_counter()
  cfg = TINY_CONFIG if tiny else GPU_CONFIG
  mem0 = device_memory()
  if prediction is None:  # plan for the device present (a CPU reports no memory limit)
    prediction = predict(cfg, target=None, budget=TINY_BUDGET if mem0 is None else None)
  if prediction["config"] != dataclasses.asdict(cfg):
    raise ValueError(f"the prediction is for {prediction['config']}, this run is "
                     f"{dataclasses.asdict(cfg)}: make it with the same --tiny setting.")
  n = int(prediction["num_micro_batches"])
  counts = [k for k in (n, 2 * n, 4 * n) if cfg.batch % k == 0]
  shared = Shared(cfg)
  skipped: list[str] = []
  deadline = start + time_budget * 0.65  # leave time for the repeats and the half check

  full_predicted = next((c["peak_bytes"] for c in prediction["candidates"]
                         if c["num_micro_batches"] == 1), None)
  methods = build_methods(cfg, shared, n, counts, deadline, skipped,
                          None if mem0 is None else mem0["bytes_limit"], full_predicted)
  to_time = [m for m in methods if "skipped" not in m.result]
  to_time.sort(key=lambda m: (m.name != f"jaxaccum N={n}", m.memory["peak"]))
  for m in to_time:  # first calls, by increasing compiled memory: the allocator's peaks
    if not m.result.get("first_call_done"):
      first_call(m)
  left = start + time_budget - time.perf_counter()
  per_round = 0.0
  for m in to_time:
    t0 = time.perf_counter()
    m.run()
    per_round += time.perf_counter() - t0
  reps = max(1, min(repeats, int(max(left - per_round * (1 + warmup), 0) / max(per_round, 1e-9))))
  times = _common.time_interleaved({m.name: m.run for m in to_time}, repeats=reps,
                                   warmup=warmup)
  flops_tok = flops_per_token(cfg)
  for m in to_time:
    t = _common.median(times[m.name])
    m.result.update(step_s=t, step_s_all=times[m.name], tokens_per_s=m.tokens_per_step / t,
                    mfu=flops_tok * m.tokens_per_step / t / (peak_tflops * 1e12))

  results: dict[str, Any] = {
      "config": dataclasses.asdict(cfg), "num_params": num_params(cfg),
      "flops_per_token": flops_tok, "peak_tflops": peak_tflops, "repeats": reps,
      "warmup": warmup, "environment": _common.device_info(), "tiny": tiny,
      "device_memory_at_start": mem0, "num_micro_batches": n, "skipped": skipped,
      "methods": {m.name: {"n": m.n, "tokens_per_step": m.tokens_per_step,
                           "compile_s": m.compile_s, "memory": m.memory, **m.result}
                  for m in methods},
  }
  acc, alone = results["methods"].get(f"jaxaccum N={n}"), results["methods"].get(
      f"micro-batch alone ({cfg.batch // n} seq)")
  if acc and alone and "step_s" in acc and "step_s" in alone:
    ratio = (acc["step_s"] / acc["tokens_per_step"]) / (alone["step_s"] / alone["tokens_per_step"])
    results["overhead"] = {"per_token_ratio": ratio, "goal": OVERHEAD_GOAL,
                           "meets_goal": ratio <= OVERHEAD_GOAL}
  results["plan_check"] = plan_check(cfg, prediction, results["methods"].get(f"jaxaccum N={n}"),
                                     shared)
  return results


def plan_for_device(device_kind: str, plans: pathlib.Path = RESULTS) -> pathlib.Path | None:
  """The committed plan (``plan_<target>.json`` in ``plans``, made by ``--predict --target``
  on a CPU host) for the card ``device_kind`` names (``jax.devices()[0].device_kind``).

  A plan whose described device is that card by name is taken first (``"NVIDIA H100 80GB
  HBM3"``); else one of the same model (a letter and three digits: ``H100``, ``H200``);
  else ``None``, and the run plans in process for the device present
  (``tests/planning/test_gpu_check.py`` checks the choice for each card).
  """
  def model(name: str) -> str | None:
    m = re.search(r"\b([A-Z]\d{3})", name.removeprefix("NVIDIA "))
    return m.group(1) if m else None

  found = {}
  for path in sorted(plans.glob("plan_*.json")):
    described = json.loads(path.read_text()).get("device", "")
    found[path] = described.removesuffix(" (described)")
  same = [path for path, name in found.items() if name == device_kind]
  family = [path for path, name in found.items()
            if model(device_kind) is not None and model(name) == model(device_kind)]
  return (same or family or [None])[0]


def plan_check(cfg: LMConfig, prediction: dict[str, Any], acc: dict[str, Any] | None,
               shared: Shared) -> dict[str, Any]:
  """The predicted peak against the measured one, and whether half as many micro-batches
  fits (run on a GPU; on a CPU, compiled for it and set against the plan's budget)."""
  n = int(prediction["num_micro_batches"])
  out: dict[str, Any] = {"predicted_peak_bytes": prediction["peak_bytes"],
                         "predicted_on": prediction["device"], "num_micro_batches": n,
                         "memory_budget_bytes": prediction["memory_budget_bytes"],
                         "goal": PLAN_GOAL}
  if acc is None:
    out["measured"] = "not measured: the plan's step was not compiled"
    return out
  measured = acc.get("device_peak_bytes")
  out["measured_from"] = "device.memory_stats() peak_bytes_in_use"
  if measured is None:
    measured = acc["memory"]["peak"]
    out["measured_from"] = "memory_analysis() of the step compiled here (no allocator stats)"
  out["measured_peak_bytes"] = measured
  out["relative_error"] = (measured - prediction["peak_bytes"]) / measured
  out["meets_goal"] = abs(out["relative_error"]) <= PLAN_GOAL
  half = prediction.get("half")
  if half is None:
    return out
  h = int(half["num_micro_batches"])
  out["half"] = {"num_micro_batches": h, "predicted_peak_bytes": half["peak_bytes"],
                 "predicted_fits": half["fits"]}
  try:
    compiled, _ = compile_timed(make_step(cfg, h), shared.params, shared.opt_state,
                                shared.tokens)
    out["half"]["compiled_peak_bytes"] = memory_of(compiled)["peak"]
    if device_memory() is None:
      out["half"]["fits"] = memory_of(compiled)["peak"] <= prediction["memory_budget_bytes"]
      out["half"]["how"] = "compiled here, against the plan's budget"
    else:
      shared.one_call(compiled, shared.tokens)()
      out["half"]["fits"] = True
      out["half"]["how"] = "ran on the device"
      out["half"]["device_peak_bytes"] = device_memory()["peak_bytes_in_use"]  # type: ignore[index]
  except Exception as e:  # noqa: BLE001 (an out-of-memory error is the expected outcome)
    out["half"]["fits"] = False
    out["half"]["how"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return out


# ----------------------------------------------------------------------------- reports


def _gib(x: Any) -> str:
  """Bytes as GiB (MiB under one GiB, as the dry run's are)."""
  if x is None:
    return ""
  return f"{x / GIB:.2f} GiB" if abs(x) >= GIB else f"{x / 2**20:.2f} MiB"


def markdown(r: dict[str, Any]) -> str:
  env = r["environment"]
  lines = [f"# The accumulated step of a {r['num_params'] / 1e6:.3g}M-parameter LM",
           "",
           f"{env['device_kind']} ({env['platform']}), jax {env['jax']}, {env['date']}; "
           f"config {r['config']}; median of {r['repeats']} interleaved repeats after "
           f"{r['warmup']} warm-up; MFU against {r['peak_tflops']:.0f} TFLOP/s bf16 dense, "
           f"{r['flops_per_token'] / 1e9:.3f} GFLOP per token (6 N + 12 L T d).", "",
           "| method | N | step (s) | tokens/s | MFU | compiled peak | device peak |"
           " compile (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for name, m in r["methods"].items():
    if "step_s" not in m:
      lines.append(f"| {name} | {m['n']} | {m.get('skipped', 'not run')} | | | "
                   f"{_gib(m['memory']['peak'])} | | {m['compile_s']:.1f} |")
      continue
    dev = m.get("device_peak_bytes")
    dev_s = "" if dev is None else ("" if m["device_peak_raised"] else "<= ") + _gib(dev)
    lines.append(f"| {name} | {m['n']} | {m['step_s']:.4f} | {m['tokens_per_s']:,.0f} | "
                 f"{100 * m['mfu']:.3g}% | {_gib(m['memory']['peak'])} | {dev_s} | "
                 f"{m['compile_s']:.1f} |")
  if r["skipped"]:
    lines += ["", f"Skipped (time budget): {', '.join(r['skipped'])}."]
  if "overhead" in r:
    o = r["overhead"]
    lines += ["", f"Accumulated step per token against the micro-batch alone: "
              f"{o['per_token_ratio']:.3f}x (goal <= {o['goal']}x)."]
  p = r["plan_check"]
  lines += ["", "## The planner against the run", "",
            f"Predicted on {p['predicted_on']}: N = {p['num_micro_batches']}, peak "
            f"{_gib(p['predicted_peak_bytes'])} (budget {_gib(p['memory_budget_bytes'])})."]
  if "measured_peak_bytes" in p:
    lines.append(f"Measured ({p['measured_from']}): {_gib(p['measured_peak_bytes'])}, "
                 f"{p['relative_error']:+.1%} (goal within {p['goal']:.0%}).")
  if "half" in p:
    h = p["half"]
    lines.append(f"Half as many (N = {h['num_micro_batches']}): predicted "
                 f"{_gib(h['predicted_peak_bytes'])}, fits: {h.get('fits')} "
                 f"({h.get('how', '')}).")
  return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
  """Tokens per second and peak memory (the allocator's where measured, else compiled) per
  method, side by side; methods not run are left out."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [(name, m) for name, m in r["methods"].items() if "step_s" in m]
  names = [name for name, _ in rows]
  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.6), sharey=True)
  ys = range(len(rows))
  ax_t.barh(ys, [m["tokens_per_s"] for _, m in rows], color="tab:blue")
  ax_t.set_yticks(list(ys), names)
  ax_t.invert_yaxis()
  ax_t.set_xlabel("tokens / s")
  peaks = [m.get("device_peak_bytes") or m["memory"]["peak"] for _, m in rows]
  ax_m.barh(ys, [p / GIB for p in peaks], color="tab:orange")
  ax_m.set_xlabel("peak memory, GiB (the device's where measured)")
  env = r["environment"]
  fig.suptitle(f"{r['num_params'] / 1e6:.3g}M-parameter LM, {env['device_kind']}, "
               f"jax {env['jax']}, {env['date']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def flags_markdown(f: dict[str, Any]) -> str:
  lines = ["| XLA flags | peak | temp | compile (s) |", "|---|---:|---:|---:|"]
  for label, m in f.items():
    lines.append(f"| {label} | {_gib(m['peak'])} | {_gib(m['temp'])} | {m['compile_s']:.1f} |")
  return "\n".join(lines) + "\n"


def prediction_markdown(out: dict[str, Any]) -> str:
  """The prediction's note, the planner's table and (with ``--flags``) the flags' memory."""
  text = (f"# The planner's prediction for bench_gpu_lm.py\n\n{out['note']}.\n\n"
          f"{out['num_params']:,} parameters, config {out['config']}.\n\n"
          f"```\n{out['table']}\n```\n")
  if "flags" in out:
    text += (f"\nThe step at N = {out['num_micro_batches']} compiled with XLA's GPU flags "
             f"(compiled memory; step time not measured yet):\n\n{flags_markdown(out['flags'])}")
  return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  _common.add_tiny(parser)  # the CPU dry run: a tiny model, every method
  parser.add_argument("--predict", action="store_true",
                      help="only plan (compile, never run) and write plan_<target>.json")
  parser.add_argument("--target", default=None, help="described GPU for --predict (h200)")
  parser.add_argument("--budget", type=int, default=None,
                      help="--predict's budget in bytes (default: the device's; --tiny on a "
                      f"CPU: {TINY_BUDGET:,})")
  parser.add_argument("--flags", action="store_true",
                      help="with --predict: also compile the step with each XLA flag")
  parser.add_argument("--prediction", type=pathlib.Path, default=None,
                      help="a --predict JSON, or 'auto': the committed plan for the card "
                      "present (plan_for_device); without it the plan is made in process")
  parser.add_argument("--repeats", type=int, default=None, help="default 5 (--tiny: 1)")
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--time-budget", type=float, default=180.0)
  parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
  parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                      help=f"default: {RESULTS} (--tiny: a fresh temporary folder)")
  args = parser.parse_args(argv)
  args.out_dir = _common.out_dir_for(args.tiny, args.out_dir, RESULTS)
  cfg = TINY_CONFIG if args.tiny else GPU_CONFIG
  suffix = "_tiny" if args.tiny else ""
  args.out_dir.mkdir(parents=True, exist_ok=True)
  if args.predict:
    budget = args.budget
    if budget is None and args.target is None and device_memory() is None:
      budget = TINY_BUDGET
    out = predict(cfg, target=args.target, budget=budget)
    if args.flags:
      out["flags"] = flag_memory(cfg, out["num_micro_batches"], target=args.target)
    name = f"plan_{args.target or 'here'}{suffix}"
    (args.out_dir / f"{name}.json").write_text(json.dumps(out, indent=1, default=float))
    (args.out_dir / f"{name}.md").write_text(prediction_markdown(out))
    print(out["table"])
    if "flags" in out:
      print(flags_markdown(out["flags"]))
    return out
  if args.prediction == pathlib.Path("auto"):  # the committed plan for the card present
    kind = jax.devices()[0].device_kind
    args.prediction = plan_for_device(kind)
    print(f"device {kind!r}: prediction "
          f"{args.prediction or 'made in process (no committed plan for this card)'}")
  prediction = json.loads(args.prediction.read_text()) if args.prediction else None
  repeats = args.repeats or (1 if args.tiny else 5)
  results = run(tiny=args.tiny, prediction=prediction, repeats=repeats,
                warmup=args.warmup, time_budget=args.time_budget, peak_tflops=args.peak_tflops)
  _common.write_results(args.out_dir, f"bench_gpu_lm{suffix}", results, markdown)
  try:
    plot(results, args.out_dir / f"bench_gpu_lm{suffix}.png")
  except ImportError as e:  # the figures are written; only the plot needs matplotlib
    print(f"no plot: {e}")
  print(markdown(results))
  print(f"results in {args.out_dir}")
  return results


if __name__ == "__main__":
  main()
