"""Tests for ``jaxaccum.plan`` / ``jaxaccum.plan_step``: memory read from compiled programs.

Every memory figure the planner reports is checked against an independent compile of
``jaxaccum.value_and_grad`` with the same count (``argument + output + temp - alias`` bytes of
``memory_analysis()``, the CPU figure), and every numerical result against the full batch
through plain ``jax.value_and_grad``.
"""

import functools
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._planning import _plan
from tests._util import assert_close, count_compiles

BATCH = 64  # divisors 1, 2, 4, 8, 16, 32, 64
SIZES = (8, 32, 32, 1)
HUGE = 2**40


def mlp_loss(params, batch):
  x, y = batch
  for w, b in params[:-1]:
    x = jnp.tanh(x @ w + b)
  w, b = params[-1]
  return jnp.mean((x @ w + b - y) ** 2)


@functools.partial(jax.jit, static_argnames=("batch_size", "seed"))
def make_mlp(batch_size=BATCH, seed=0):  # one compiled program per batch size, not one per op
  keys = jax.random.split(jax.random.key(seed), len(SIZES) + 1)
  params = [(jax.random.normal(k, (a, b)) / a**0.5, 0.1 * jax.random.normal(k, (b,)))
            for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=False)]
  x = jax.random.normal(keys[-2], (batch_size, SIZES[0]))
  y = jax.random.normal(keys[-1], (batch_size, 1))
  return params, (x, y)


def shapes(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def xla_bytes(compiled):
  """The reference CPU figure, straight from XLA."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def compile_vg(n, *args, loss=mlp_loss):
  fn = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=n))
  return fn.lower(*args).compile()


def test_memory_falls_with_micro_batch_count_on_an_mlp():
  # 32 rows (6 counts to compile); at 16 rows the float32 accumulator of N = 2 already
  # outweighs the activations it saves and the figures are not monotone.
  params, batch = make_mlp(batch_size=32)
  p = jaxaccum.plan(mlp_loss, *shapes((params, batch)), memory_budget_bytes=HUGE,
                    search="all")
  assert all(isinstance(c, jaxaccum.PlanCandidate) for c in p.candidates)
  counts = [c.num_micro_batches for c in p.candidates]
  assert counts == [1, 2, 4, 8, 16, 32]
  assert [c.micro_batch_size for c in p.candidates] == [32 // n for n in counts]
  peaks = [c.peak_bytes for c in p.candidates]
  temps = [c.temp_bytes for c in p.candidates]
  assert all(a >= b for a, b in zip(peaks, peaks[1:], strict=False)), peaks
  assert all(a >= b for a, b in zip(temps, temps[1:], strict=False)), temps
  # Activations of 32 rows vs 1: the fall is real, not round-off.
  assert peaks[-1] < 0.9 * peaks[0], peaks
  # The planner's figures are XLA's, for the same program.
  assert peaks[0] == xla_bytes(compile_vg(1, params, batch))
  # A budget everything fits: the fewest micro-batches.
  assert (p.num_micro_batches, p.micro_batch_size, p.peak_bytes) == (1, 32, peaks[0])
  table = str(p)
  assert p.table() == table
  for c in p.candidates:
    assert re.search(rf"^\s*{c.num_micro_batches}\s+{c.micro_batch_size}\s", table, re.M)
  assert "<- chosen" in table and "num_micro_batches=1 " in table


@pytest.mark.parametrize("target", [4, 16])
def test_chosen_plan_fits_and_the_next_smaller_count_does_not(target):
  params, batch = make_mlp()
  budget = xla_bytes(compile_vg(target, params, batch))  # exactly the target's figure
  p = jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=budget)
  assert p.num_micro_batches == target
  assert p.micro_batch_size == BATCH // target
  assert p.memory_budget_bytes == budget
  # Independently: the chosen compiled program fits, the next smaller divisor does not.
  assert xla_bytes(p.compiled) == p.peak_bytes <= budget
  smaller = target // 2
  assert xla_bytes(compile_vg(smaller, params, batch)) > budget
  rows = {c.num_micro_batches: c for c in p.candidates}
  assert rows[target].fits and not rows[smaller].fits


def test_plan_count_gives_full_batch_gradients():
  params, batch = make_mlp()
  vg = compile_vg(8, params, batch)  # compiled once: its figure, then its numbers
  budget = xla_bytes(vg)
  p = jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=budget)
  assert p.num_micro_batches == 8
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
  loss, grads = vg(params, batch)  # value_and_grad with num_micro_batches=8
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)
  # The chosen program comes back compiled: running it compiles nothing.
  with count_compiles() as compiles:
    loss, grads = p.compiled(params, batch)
  assert compiles == []
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)


def test_plan_reads_the_batch_size_along_batch_axis():
  # A time-major batch (T, B, F): the planner's counts divide B (axis 1), not T.
  def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  w = jax.random.normal(jax.random.key(0), (8, 8))
  x = jax.random.normal(jax.random.key(1), (3, 32, 8))
  budget = xla_bytes(jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=16, batch_axis=1)).lower(w, x).compile())
  p = jaxaccum.plan(loss, w, x, memory_budget_bytes=budget, batch_axis=1, search="all")
  assert p.batch_size == 32
  assert [c.num_micro_batches for c in p.candidates] == [1, 2, 4, 8, 16, 32]
  assert p.num_micro_batches <= 16
  ref = jax.jit(jax.value_and_grad(loss))(w, x)
  assert_close(p.compiled(w, x), ref)


def linear_loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


def test_batch_4096_needs_few_compilations():
  # 4096 = 2**12 has 13 divisors: N = 1, then a binary search over the other 12 needs at
  # most ceil(log2(12)) = 4 more.
  w = jax.ShapeDtypeStruct((4,), jnp.float32)
  batch = (jax.ShapeDtypeStruct((4096, 4), jnp.float32),
           jax.ShapeDtypeStruct((4096,), jnp.float32))
  with count_compiles() as compiles:
    loose = jaxaccum.plan(linear_loss, w, batch, memory_budget_bytes=HUGE)
  assert loose.num_micro_batches == 1
  assert len(compiles) == len(loose.candidates) == 1  # the full batch fits: nothing else
  every = jaxaccum.plan(linear_loss, w, batch, memory_budget_bytes=HUGE, search="all")
  peaks = {c.num_micro_batches: c.peak_bytes for c in every.candidates}
  assert len(peaks) == 13
  # For each budget, the reference answer is read off the table of every divisor.
  expected_n = lambda budget: min(n for n, peak in peaks.items() if peak <= budget)  # noqa: E731
  budgets = sorted(set(peaks.values()))
  for budget in (budgets[0], budgets[len(budgets) // 2], budgets[-1] - 1):
    with count_compiles() as compiles:
      p = jaxaccum.plan(linear_loss, w, batch, memory_budget_bytes=budget, verbose=False)
    assert p.num_micro_batches == expected_n(budget), (budget, p)
    assert p.peak_bytes == peaks[p.num_micro_batches] <= budget
    assert len(compiles) == len(p.candidates) <= 1 + 4
    assert len({c.num_micro_batches for c in p.candidates}) == len(p.candidates)
    assert p.compiled is not None
  # Here memory falls, then rises again past N = 256 (per-step overhead of a long loop), so
  # "nothing fits" is only known after every count: the planner compiles them all.
  assert peaks[4096] > peaks[256]
  with pytest.raises(ValueError, match="is too small") as info:
    jaxaccum.plan(linear_loss, w, batch, memory_budget_bytes=budgets[0] - 1, verbose=False)
  assert f"smallest figure reached is {budgets[0]:,} bytes" in str(info.value)


def test_parameters_dominate_full_batch_fits_and_is_chosen():
  # A 1024 x 1024 layer and a batch of 64: the float32 accumulator of N > 1 costs more than
  # the activations it saves, so memory rises from N = 1 to N = 2, then falls (not monotone).
  w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  batch = (jax.ShapeDtypeStruct((64, 1024), jnp.float32),
           jax.ShapeDtypeStruct((64, 1024), jnp.float32))
  full = xla_bytes(compile_vg(1, w, batch, loss=linear_loss))
  assert xla_bytes(compile_vg(2, w, batch, loss=linear_loss)) > full
  # One-row micro-batches fit this budget too; the fewest micro-batches that fit is 1.
  assert xla_bytes(compile_vg(64, w, batch, loss=linear_loss)) <= full + 1024
  p = jaxaccum.plan(linear_loss, w, batch, memory_budget_bytes=full + 1024)
  assert (p.num_micro_batches, p.peak_bytes) == (1, full)
  assert [c.num_micro_batches for c in p.candidates] == [1]


def test_curve_that_rises_with_n_is_searched_below_the_binary_answer(monkeypatch):
  # Made-up figures (bytes) for N = 1 .. 64 where N = 2 fits, N = 4 does not, N = 8 does: a
  # binary search alone would stop at 8 or later; the planner sees N = 8 < N = 16 ... and
  # compiles the smaller counts it skipped.
  figures = {1: 900, 2: 450, 4: 700, 8: 400, 16: 420, 32: 430, 64: 440}
  params, batch = make_mlp()
  made = []

  def make_step(n):  # the planner compiles and measures each step right after making it
    made.append(n)
    return jax.jit(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=n))

  real_memory = _plan._memory
  monkeypatch.setattr(_plan, "_memory", lambda compiled, platform: dict(
      real_memory(compiled, platform), peak_bytes=figures[made[-1]]))
  p = jaxaccum.plan_step(make_step, params, batch, batch_argnums=1, memory_budget_bytes=500)
  # The reference: the fewest of all counts whose figure is within the budget.
  assert min(n for n, f in figures.items() if f <= 500) == 2
  assert (p.num_micro_batches, p.peak_bytes) == (2, 450)
  assert made[0] == 1 and len(made) < len(figures)  # N = 1 first, and not every count
  assert {c.num_micro_batches: c.peak_bytes for c in p.candidates} == {
      n: figures[n] for n in made}


def test_plan_step_with_donation_matches_a_full_batch_step():
  params, batch = make_mlp(batch_size=32)  # 6 counts to compile, not 7
  optimizer = optax.sgd(0.1, momentum=0.9)
  opt_state = optimizer.init(params)
  made = []

  def make_step(n):
    made.append(n)
    vg = jaxaccum.value_and_grad(mlp_loss, num_micro_batches=n)

    def step(params, opt_state, batch):
      loss, grads = vg(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))

  args = shapes((params, opt_state, batch))
  loose = jaxaccum.plan_step(make_step, *args, batch_argnums=2, memory_budget_bytes=HUGE,
                             search="all")
  assert loose.num_micro_batches == 1
  assert sorted(made) == [c.num_micro_batches for c in loose.candidates]
  # Donation shows: the new parameters and momentum reuse the old buffers.
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  assert all(c.alias_bytes >= 2 * param_bytes for c in loose.candidates)
  budget = max(c.peak_bytes for c in loose.candidates if c.num_micro_batches > 1)
  p = jaxaccum.plan_step(make_step, *args, batch_argnums=-1, memory_budget_bytes=budget)
  assert 1 < p.num_micro_batches and p.peak_bytes <= budget
  assert xla_bytes(p.compiled) == p.peak_bytes

  def ref_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  expected = jax.jit(ref_step)(params, opt_state, batch)
  copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731 (the step consumes donated inputs)
  got = p.compiled(copy(params), copy(opt_state), batch)
  assert_close(got, expected)


def test_sharded_batch_is_planned_per_device():
  devices = np.array(jax.devices()[:8])
  mesh = Mesh(devices, ("data",))
  params, batch = make_mlp()
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params_s = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                          params)
  batch_s = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=split), batch)
  p = jaxaccum.plan(mlp_loss, params_s, batch_s, memory_budget_bytes=HUGE)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch))
  for c in p.candidates:
    # One device holds all the parameters and an eighth of the batch.
    assert c.argument_bytes == param_bytes + batch_bytes // len(devices)
  # Against the same program on one device, holding the whole batch.
  assert p.num_micro_batches == 1
  assert p.peak_bytes < xla_bytes(compile_vg(1, params, batch))


def _in_loop_all_reduces(text):
  """All-reduce ops inside the bodies of the ENTRY computation's while loops and the
  computations those bodies call (a plain reading of the text, for comparison)."""
  comps, name = {}, None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m:
      name = m.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  entry = next(n for n in comps if f"ENTRY %{n} " in text or f"ENTRY {n} " in text)
  todo = [b for line in comps[entry] for b in re.findall(r"\bbody=%?([\w.\-]+)", line)]
  seen = set()
  while todo:
    c = todo.pop()
    if c not in seen and c in comps:
      seen.add(c)
      todo += [b for line in comps[c] for b in re.findall(r"\b(?:body|calls)=%?([\w.\-]+)", line)]
  return sum(len(re.findall(r"\sall-reduce(?:-start)?\(", "\n".join(comps[c]))) for c in seen)


@pytest.mark.parametrize("data_axis", [None, "data"])
def test_plan_reports_the_collectives_of_each_candidate(data_axis):
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  params, batch = make_mlp(batch_size=16)  # 2 rows per shard: N = 1 and 2
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                        params)
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=split), batch)
  options = {} if data_axis is None else dict(data_axis=jaxaccum.DataParallel(data_axis, mesh=mesh))
  p = jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, search="all", **options)
  assert [c.num_micro_batches for c in p.candidates] == [1, 2]
  table = p.table().splitlines()
  assert "in-loop collectives" in table[1]
  for c in p.candidates:
    fn = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=c.num_micro_batches,
                                         **options))
    text = fn.lower(params, batch).compile().as_text()
    assert c.in_loop_collectives == _in_loop_all_reduces(text), c
    # Without data_axis XLA reduces the gradients inside the micro-batch loop; with it, once
    # after the loop.
    assert (c.in_loop_collectives > 0) == (data_axis is None and c.num_micro_batches > 1), c
    row = next(r for r in table if re.match(rf"\s*{c.num_micro_batches}\s", r))
    assert row.split()[-5 if "chosen" in row else -3] == str(c.in_loop_collectives), row
  # The chosen program's own collectives, read from the compiled program the plan returns.
  assert p.collectives == jaxaccum.planning.collectives(p.compiled)
  assert p.collectives.count("all-reduce") == len(
      re.findall(r"\sall-reduce(?:-start)?\(", p.compiled.as_text())) > 0
  assert p.collectives.count(in_loop=True) == p.candidates[0].in_loop_collectives


def test_budget_too_small_says_by_how_much():
  params, batch = make_mlp()
  budget = 1000
  least = xla_bytes(compile_vg(BATCH, params, batch))
  with pytest.raises(ValueError, match="memory_budget_bytes=1,000 .* is too small") as info:
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=budget)
  message = str(info.value)
  assert f"smallest figure reached is {least:,} bytes" in message
  assert f"num_micro_batches={BATCH} (micro-batches of 1 row)" in message
  assert f"{least - budget:,} bytes" in message and "over the budget" in message


@pytest.mark.parametrize("budget", [0, -5, float("nan"), -1.5])
def test_non_positive_budget(budget):
  params, batch = make_mlp()
  with pytest.raises(ValueError, match="memory_budget_bytes must be a positive number"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=budget)


@pytest.mark.parametrize("budget", ["8GB", True])
def test_non_numeric_budget(budget):
  params, batch = make_mlp()
  with pytest.raises(TypeError, match="memory_budget_bytes must be a number of bytes"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=budget)


def test_batch_leaves_that_disagree():
  params, (x, y) = make_mlp()
  with pytest.raises(ValueError, match="leading sizes differ.*64.*32"):
    jaxaccum.plan(mlp_loss, params, (x, y[:32]), memory_budget_bytes=HUGE)


def test_cpu_needs_an_explicit_budget():
  params, batch = make_mlp()
  with pytest.raises(ValueError, match=r"memory_budget_bytes is required here: .*\(cpu\)"):
    jaxaccum.plan(mlp_loss, params, batch)


def test_bad_options():
  params, batch = make_mlp()
  with pytest.raises(TypeError, match="plan chooses the micro-batch count.*num_micro_batches=4"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, num_micro_batches=4)
  with pytest.raises(TypeError, match="micro_batch_size=2"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, micro_batch_size=2)
  with pytest.raises(TypeError, match="unknown option.*'batch_axes'"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, batch_axes=0)
  with pytest.raises(ValueError, match="reduce must be one of"):  # value_and_grad's own check
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, reduce="avg")
  with pytest.raises(ValueError, match="search must be one of 'binary', 'all'"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, search="linear")
  with pytest.raises(ValueError, match="batch_argnums=3 is out of range"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, batch_argnums=3)


def test_plan_step_bad_factory():
  params, batch = make_mlp()
  with pytest.raises(TypeError, match="make_step must be a function"):
    jaxaccum.plan_step(None, params, batch, batch_argnums=1, memory_budget_bytes=HUGE)
  with pytest.raises(TypeError, match=r"make_step\(\d+\) must return a jitted function"):
    jaxaccum.plan_step(lambda n: jaxaccum.value_and_grad(mlp_loss, num_micro_batches=n),
                       params, batch, batch_argnums=1, memory_budget_bytes=HUGE)


class _FakeDevice:
  platform = "gpu"

  def __init__(self, id, stats):
    self.id, self._stats = id, stats

  def memory_stats(self):
    return self._stats


def test_default_budget_is_the_device_limit_less_the_margin():
  # The default is read from memory_stats() where a backend reports it (GPU); CPU does not.
  devices = [_FakeDevice(0, {"bytes_limit": 1000, "bytes_in_use": 10}),
             _FakeDevice(1, {"bytes_limit": 800})]
  assert _plan._default_budget(devices) == int(800 * (1 - _plan._SAFETY_MARGIN)) == 720
  with pytest.raises(ValueError, match="memory_budget_bytes is required"):
    _plan._default_budget([_FakeDevice(0, None)])


def test_memory_figure_uses_xla_peak_only_where_it_counts_temporaries():
  stats = types.SimpleNamespace(argument_size_in_bytes=100, output_size_in_bytes=40,
                                temp_size_in_bytes=500, alias_size_in_bytes=30,
                                peak_memory_in_bytes=520)
  compiled = types.SimpleNamespace(memory_analysis=lambda: stats)
  assert _plan._memory(compiled, "gpu")["peak_bytes"] == 520
  assert _plan._memory(compiled, "cpu")["peak_bytes"] == 100 + 40 + 500 - 30


def test_example_script_prints_the_plan(capsys):
  path = pathlib.Path(__file__).parents[2] / "examples" / "plan_memory.py"
  spec = importlib.util.spec_from_file_location("plan_memory_example", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  p = module.main(["--batch-size", "16", "--features", "4", "--width", "8", "--depth", "1",
                   "--budget-mib", "1"])
  out = capsys.readouterr().out
  assert str(p) in out
  assert isinstance(p, jaxaccum.Plan)
  assert p.peak_bytes <= p.memory_budget_bytes == 2**20
  assert f"chosen: num_micro_batches={p.num_micro_batches} " in out


@pytest.mark.parametrize("axis_type", ["explicit_batch", "data_axis"])
def test_sharded_batch_only_plans_counts_that_split_in_place(axis_type):
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  size = 32  # N = 1, 2, 4 are planned; 8, 16 and 32 would split a shard's 4 rows
  params, batch = make_mlp(batch_size=size)
  options = {}
  if axis_type == "data_axis":
    options = dict(data_axis=jaxaccum.DataParallel("data", mesh=mesh))
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
  else:
    split = NamedSharding(mesh, P("data"))
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=split), batch)
  p = jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, search="all", **options)
  counts = [c.num_micro_batches for c in p.candidates]
  # Every micro-batch holds a multiple of 8 rows: N divides size / 8, and no other N is tried.
  assert counts == [n for n in range(1, size + 1) if size % n == 0 and (size // n) % 8 == 0]
  with pytest.raises(ValueError, match=rf"even num_micro_batches={size // 8} \(micro-batches "
                     r"of 8 rows\) needs|num_micro_batches=\d+ \(micro-batches of 8 rows\)"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=1000, **options)


def test_data_axis_not_in_the_set_mesh_is_a_value_error():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params, batch = make_mlp()
  with jax.set_mesh(mesh), pytest.raises(
      ValueError, match=r"data_axis='dat' names mesh axis 'dat', which is not in the mesh; "
      r"its axes are \{'data': 8\}"):
    jaxaccum.plan(mlp_loss, *shapes((params, batch)), memory_budget_bytes=HUGE,
                  data_axis="dat")


@pytest.mark.parametrize("budget", [0.5, 0.999])
def test_budget_below_one_byte_is_not_truncated(budget):
  params, batch = make_mlp()
  with pytest.raises(ValueError, match=rf"memory_budget_bytes={budget}, less than one byte "
                     r"\(it is not a fraction of the device's memory\)"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=budget)


def test_progress_lines_without_tqdm(monkeypatch, capsys):
  monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # `import tqdm` fails
  params, batch = make_mlp(batch_size=4)
  p = jaxaccum.plan(mlp_loss, *shapes((params, batch)), memory_budget_bytes=HUGE,
                    search="all", verbose=True)
  err = capsys.readouterr().err.splitlines()
  assert len(err) == len(p.candidates) == 3
  for line, c in zip(err, p.candidates, strict=True):
    assert line.startswith(f"jaxaccum.plan: N={c.num_micro_batches} (micro-batch "
                           f"{c.micro_batch_size}): peak {_plan._fmt_bytes(c.peak_bytes)}, "
                           "compiled in ")
    assert line.endswith(" s, fits")
  jaxaccum.plan(mlp_loss, *shapes((params, batch)), memory_budget_bytes=HUGE, verbose=False)
  assert capsys.readouterr().err == ""
  with pytest.raises(TypeError, match="verbose must be True, False or None, got verbose=1"):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, verbose=1)


_XLA_NOISE = (
    "W1205 17:38:51.568933   19448 hlo_rematerialization.cc:3231] Can't reduce memory use "
    "below 29.62GiB (31801004525 bytes) by rematerialization; only reduced to 50.26GiB "
    "(53971517564 bytes), down from 88.30GiB (94815846572 bytes) originally\n"
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1796492257.589230   18493 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.\n")


def test_plan_holds_back_compiler_noise_and_passes_other_stderr_lines(capfd):
  # What XLA's C++ code logs on file descriptor 2 while a candidate compiles, written
  # there the same way from inside the traced loss: the rematerialisation report (whose
  # limit is not the budget) and the CUDA driver lines are held back, anything else (an
  # XLA error, a print to sys.stderr) comes through.
  def noisy_loss(w, batch):
    os.write(2, (_XLA_NOISE + "E1205 other XLA line\n").encode())
    print("a line of the user's", file=sys.stderr)
    return mlp_loss(w, batch)

  params, batch = make_mlp(batch_size=4)
  capfd.readouterr()
  plan = jaxaccum.plan(noisy_loss, *shapes((params, batch)), memory_budget_bytes=HUGE,
                       search="all", verbose=False)
  err = capfd.readouterr().err.splitlines()
  assert set(err) == {"E1205 other XLA line", "a line of the user's"}, err
  assert err.count("E1205 other XLA line") >= len(plan.candidates) == 3


def test_gpu_target_errors_without_a_gpu_or_the_extra():
  params, batch = make_mlp()
  with pytest.raises(ValueError, match=r"target='h300' is not a GPU description jaxaccum "
                     r"ships; those are 'h100', 'h200', 'a100-80gb', 'b200'"):
    jaxaccum.plan(mlp_loss, params, batch, target="h300")
  with pytest.raises(ValueError, match=r"num_devices=8 needs target=\.\.\."):
    jaxaccum.plan(mlp_loss, params, batch, memory_budget_bytes=HUGE, num_devices=8)
  with pytest.raises(ValueError, match="capture_gpu_target needs a CUDA GPU"):
    jaxaccum.planning.capture_gpu_target()
  try:
    importlib.metadata.version("jax-cuda12-plugin")
  except importlib.metadata.PackageNotFoundError:  # the main test environment: not installed
    with pytest.raises(ImportError,
                       match=r"install them with `pip install 'jaxaccum\[gpu-plan\]'`"):
      jaxaccum.plan(mlp_loss, params, batch, target="h100")
    with pytest.raises(ImportError, match="jax-cuda12-plugin and jax-cuda12-pjrt not installed"):
      jaxaccum.planning.target_mesh("h100", (8,), ("data",))


def test_shipped_descriptions_and_the_default_budget(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  from jaxaccum._planning import _gpu_target
  memory = {"h100": 84942979072, "h200": 150754820096, "a100-80gb": 85100068864,
            "b200": 191514411008}
  for name, size in memory.items():
    gpu = _gpu_target.resolve(name)
    assert gpu.memory_bytes == size
    assert "collective_memory_granularity" not in gpu.text  # jaxlib 0.10.2 rejects it
    assert _plan._target_budget(gpu) == int(size * 0.75 * 0.9)
  assert _gpu_target.resolve("H100").device_name == "NVIDIA H100 80GB HBM3"
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95")
  assert _plan._target_budget(_gpu_target.resolve("h100")) == int(84942979072 * 0.95 * 0.9)


def test_parameters_on_an_auto_mesh_are_not_taken_for_fsdp():
  # Parameters sharded over "data" on an Auto mesh are XLA's to place: param_gather and
  # grad_scatter act on Explicit axes only, so the planner compares no placements, as for the
  # same parameters replicated.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params, batch = make_mlp(batch_size=16)

  def placed(spec_of):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, spec_of(a))), params)

  over_data = placed(lambda a: P("data") if a.shape[0] % 8 == 0 else P())
  assert any(not s.sharding.is_fully_replicated for s in jax.tree.leaves(over_data))
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
  options = dict(memory_budget_bytes=HUGE, data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  p = jaxaccum.plan(mlp_loss, over_data, batch, **options)
  ref = jaxaccum.plan(mlp_loss, placed(lambda a: P()), batch, **options)
  assert p.placement is None and [c.placement for c in p.candidates] == [None], str(p)
  assert [c.num_micro_batches for c in p.candidates] == [
      c.num_micro_batches for c in ref.candidates] == [1]
  assert "gather/scatter" not in p.table()
