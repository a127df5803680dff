"""Planning and compiling for described NVIDIA GPUs on a machine without a GPU.

Runs in its own virtual environment with the ``gpu-plan`` extra (``make test-gpu-target``):
the CUDA compiler plugin must not be installed next to the main test suite. Every program
here is compiled for the described GPU (XLA's GPU compiler, ptxas included) and read back,
never run.
"""

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
import jaxaccum.planning
from jaxaccum._planning import _gpu_target

H100_MEMORY = 84942979072  # device_memory_size in jaxaccum/gpu_targets/h100.txtpb
H200_MEMORY = 150754820096
WIDTH, DEPTH = 4096, 4
BIG_BATCH = 2**20  # rows; with WIDTH 4096 its activations do not fit one H100 at N=1


@pytest.fixture(autouse=True)
def default_allocator_share(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)


def mlp_loss(params, batch):
  x, y = batch
  for w in params[:-1]:
    x = jax.nn.gelu(x @ w)
  return jnp.mean(jnp.square((x @ params[-1]).astype(jnp.float32) - y))


def mlp(width=WIDTH, depth=DEPTH, batch=BIG_BATCH, sharding=None, batch_sharding=None):
  sds = lambda shape, dtype, s=None: jax.ShapeDtypeStruct(shape, dtype, sharding=s)  # noqa: E731
  params = [sds((width, width), jnp.bfloat16, sharding) for _ in range(depth - 1)]
  params.append(sds((width, 1), jnp.bfloat16, None if sharding is None else
                    NamedSharding(sharding.mesh, P())))
  data = (sds((batch, width), jnp.bfloat16, batch_sharding),
          sds((batch, 1), jnp.float32, batch_sharding))
  return params, data


@pytest.mark.parametrize("name", _gpu_target.GPU_TARGETS)
def test_shipped_descriptions_parse_and_compile(name):
  mesh = jaxaccum.planning.target_mesh(name, (2,), ("data",))
  assert mesh.devices.shape == (2,) and mesh.axis_names == ("data",)
  device = mesh.devices.flat[0]
  text = _gpu_target.resolve(name).text
  assert f'device_description_str: "{device.device_kind}"' in text
  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
  compiled = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T))).lower(x).compile()
  assert compiled.memory_analysis().argument_size_in_bytes == 32 * 256 * 2  # half the rows
  assert "fusion" in compiled.as_text()  # a GPU program, not the CPU's


def test_h100_needs_micro_batches_and_the_plan_fits():
  params, batch = mlp()
  p = jaxaccum.plan(mlp_loss, params, batch, target="h100", verbose=False)
  # The default budget: described memory x JAX's allocator share (0.75) less 10%.
  assert p.memory_budget_bytes == int(H100_MEMORY * 0.75 * 0.9)
  assert p.device == "NVIDIA H100 80GB HBM3 (described)" and p.num_devices == 1
  rows = {c.num_micro_batches: c for c in p.candidates}
  assert not rows[1].fits and rows[1].peak_bytes > p.memory_budget_bytes
  assert p.num_micro_batches > 1
  assert p.peak_bytes == rows[p.num_micro_batches].peak_bytes <= p.memory_budget_bytes
  # The next smaller count was compiled and does not fit: this is the fewest.
  assert not rows[p.num_micro_batches // 2].fits
  # The chosen program is the GPU program for those shapes.
  assert p.compiled.memory_analysis().peak_memory_in_bytes == p.peak_bytes
  assert len(p.candidates) <= 1 + 5  # N = 1, then a binary search over 20 divisors
  assert "NVIDIA H100 80GB HBM3" in str(p)


def test_h200_needs_fewer_micro_batches_than_h100():
  params, batch = mlp(batch=2 * BIG_BATCH)
  h100 = jaxaccum.plan(mlp_loss, params, batch, target="h100", verbose=False)
  h200 = jaxaccum.plan(mlp_loss, params, batch, target="h200", verbose=False)
  assert h200.memory_budget_bytes == int(H200_MEMORY * 0.75 * 0.9)
  assert h200.device.startswith("NVIDIA H200")
  assert 1 < h200.num_micro_batches < h100.num_micro_batches
  assert h100.peak_bytes <= h100.memory_budget_bytes < h200.peak_bytes <= h200.memory_budget_bytes


def _step_factory(mesh_axis=None):
  optimizer = optax.adamw(1e-3)

  def make_step(n):
    vg = jaxaccum.value_and_grad(mlp_loss, num_micro_batches=n, data_axis=mesh_axis)

    def step(params, opt_state, batch):
      loss, grads = vg(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))

  return optimizer, make_step


def test_data_axis_on_8_gpus_reduces_once_in_float32_outside_the_loop():
  width = WIDTH
  params, batch = mlp(batch=8 * BIG_BATCH)  # each GPU's share does not fit at N = 1
  optimizer, make_step = _step_factory("data")
  opt_state = jax.eval_shape(optimizer.init, params)
  # No mesh passed: plan_step lowers each step inside jax.set_mesh of the described GPUs.
  p = jaxaccum.plan_step(make_step, params, opt_state, batch, batch_argnums=2, target="h100",
                         num_devices=8, verbose=False)
  assert p.num_devices == 8 and p.num_micro_batches > 1
  assert p.peak_bytes <= p.memory_budget_bytes
  found = p.collectives  # read from the program compiled for the described GPUs
  reductions = [c for c in found if c.kind == "all-reduce"]
  assert reductions, found
  # The gradient reduction: outside the micro-batch loop, in the accumulator's float32.
  assert not any(c.in_loop for c in found), found
  grad_elements = (DEPTH - 1) * width * width + width
  reduced = 0
  for c in reductions:
    assert all(o.dtype == "float32" for o in c.operands), c.line
    reduced += sum(math.prod(shape) for shape in c.shapes)
  assert reduced >= grad_elements
  # The split into micro-batches moves no data: no gather, all-to-all or permute anywhere.
  assert {c.kind for c in found} == {"all-reduce"}, found


def test_fsdp_reduce_scatters_once_per_micro_batch():
  mesh = jaxaccum.planning.target_mesh("h100", (8,), ("data",))
  width, batch_rows = 512, 8192  # activations larger than weights: XLA gathers weights
  params, batch = mlp(width=width, batch=batch_rows, sharding=NamedSharding(mesh, P(None, "data")),
                      batch_sharding=NamedSharding(mesh, P("data")))
  # Already placed on the described GPUs: plan keeps the parameters' sharding.
  p = jaxaccum.plan(mlp_loss, params, batch, target="h100", num_devices=8,
                    memory_budget_bytes=2**40, verbose=False)
  shard_bytes = ((DEPTH - 1) * width * width // 8 + width) * 2 + batch_rows // 8 * (2 * width + 4)
  assert p.candidates[0].argument_bytes == shard_bytes
  for n in (1, 4):
    compiled = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=n)).lower(
        params, batch).compile()
    text = compiled.as_text()
    if n == 1:
      assert text.count(" reduce-scatter(") + text.count(" reduce-scatter-start(") >= 1
      continue
    found = jaxaccum.planning.collectives(compiled)
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    # One (combined) reduce-scatter of the sharded weights' gradients per loop iteration,
    # i.e. once per micro-batch, and none after the loop.
    assert len(scatters) == 1 and scatters[0].in_loop, found
    shard = ("bfloat16", (width, width // 8))
    assert [(o.dtype, o.shape) for o in scatters[0].operands].count(shard) == DEPTH - 1, scatters


def test_jax_initialised_without_cpu_platform_says_what_to_do():
  code = textwrap.dedent("""
      import jax, jaxaccum
      jax.devices()
      try:
        jaxaccum.planning.target_mesh("h100")
      except RuntimeError as e:
        print("MESSAGE:", e)
  """)
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout
  assert "MESSAGE: JAX refused to build a CUDA topology" in out
  assert "JAX_PLATFORMS=cpu" in out


def test_unparsable_description_is_a_clear_error():
  text = _gpu_target.resolve("h100").text.replace("core_count", "cores_count")
  with pytest.raises(ValueError, match="could not be parsed as a GpuTargetConfigProto"):
    jaxaccum.planning.target_mesh(text, (1,))


def test_field_newer_xla_writes_is_dropped():
  text = _gpu_target.resolve("h200").text.replace(
      "  thread_dim_limit_z: 64",
      "  thread_dim_limit_z: 64\n  collective_memory_granularity: 2097152")
  mesh = jaxaccum.planning.target_mesh(text, (1,))
  assert mesh.devices.flat[0].device_kind == "NVIDIA H200"


@pytest.mark.parametrize("through_set_mesh", [True, False])
def test_fsdp_gathers_of_scanned_layers_stay_in_the_loop(through_set_mesh):
  """``param_gather="micro_batch"`` on a scan over stacked layers (weights ``(L, D, D)``
  sharded ``P(None, "data", None)``), compiled for 8 described H100s on an Explicit mesh:
  the stack's all-gather runs in every micro-batch, none before the loop, for both
  ``grad_scatter`` placements (the same rule ``tests/parallel/test_fsdp_placement.py`` checks
  on CPU)."""
  base = jaxaccum.planning.target_mesh("h100", (8,), ("data",))
  mesh = jax.sharding.Mesh(base.devices, base.axis_names,
                           axis_types=(jax.sharding.AxisType.Explicit,))
  layers, width, rows, n = 4, 512, 1024, 4
  sds = lambda shape, spec, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dtype, sharding=NamedSharding(mesh, spec))
  params = {"w": sds((layers, width, width), P(None, "data", None)),
            "head": sds((width, 8), P())}
  batch = {"x": sds((rows, width), P("data")), "y": sds((rows, 8), P("data"), jnp.float32)}

  def loss(p, b):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) + h, None), b["x"], p["w"])
    return jnp.mean(jnp.square((h @ p["head"]).astype(jnp.float32) - b["y"]))

  for scatter in ("micro_batch", "step"):
    step = jax.jit(jaxaccum.value_and_grad(
        loss, num_micro_batches=n, data_axis=jaxaccum.DataParallel(
            "data", mesh=None if through_set_mesh else mesh, param_gather="micro_batch",
            grad_scatter=scatter)))
    if through_set_mesh:
      with jax.set_mesh(mesh):
        found = jaxaccum.planning.collectives(step.lower(params, batch).compile())
    else:
      found = jaxaccum.planning.collectives(step.lower(params, batch).compile())
    gathers = found.select("all-gather")
    assert len(gathers) >= 1 and found.count("all-gather", in_loop=False) == 0, found
    assert {c.executions for c in gathers} == {n}, found
    assert found.bytes("all-gather") == layers * width * width * 2, found
    assert found.count("reduce-scatter", in_loop=scatter == "micro_batch") >= 1, found
    assert found.count("reduce-scatter", in_loop=scatter != "micro_batch") == 0, found
