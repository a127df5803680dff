"""``overlap_grad_reduce`` in the schedule compiled for 8 described H100s (never run).

The schedule is read by ``benchmarks/bench_overlap.py``'s :func:`schedule`: the gradient
all-reduce starts of the entry computation against its last instruction that is or runs a
GEMM. With the last micro-batch outside the loop, gradients whose last contribution is
ready early are reduced while the rest of its backward pass runs, provided XLA keeps them
as separate all-reduces (a combine threshold below the gradients' sizes); without the
option every reduction follows the loop, which holds the last backward pass.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum
import jaxaccum.planning

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_overlap  # noqa: E402


def mlp_loss(params, batch):
  x, y = batch
  for layer in params[:-1]:
    x = jax.nn.gelu(x @ layer["w"] + layer["b"])
  return jnp.mean(jnp.square((x @ params[-1]["w"]).astype(jnp.float32) - y))


def compiled_schedule(overlap, flags, width=1024, depth=4, **options):
  mesh = jaxaccum.planning.target_mesh("h100", (8,), ("data",))
  sds = jax.ShapeDtypeStruct
  rep, rows = jax.sharding.NamedSharding(mesh, P()), jax.sharding.NamedSharding(mesh, P("data"))
  params = [{"w": sds((width, width), jnp.bfloat16, sharding=rep),
             "b": sds((width,), jnp.bfloat16, sharding=rep)} for _ in range(depth - 1)]
  params.append({"w": sds((width, 1), jnp.bfloat16, sharding=rep)})
  batch = (sds((2048, width), jnp.bfloat16, sharding=rows),
           sds((2048, 1), jnp.float32, sharding=rows))
  fn = jaxaccum.value_and_grad(
      mlp_loss, num_micro_batches=4,
      data_axis=jaxaccum.DataParallel("data", mesh=mesh, overlap_grad_reduce=overlap),
      **options)
  compiled = jax.jit(fn).lower(params, batch).compile(compiler_options=flags or None)
  found = jaxaccum.planning.collectives(compiled)
  assert found.count(in_loop=True) == 0  # data_axis: every reduction after the loop
  reduces = bench_overlap.gradient_reductions(found, params)
  return bench_overlap.schedule(compiled.as_text(), [c.name for c in reduces])


NO_COMBINE = {"xla_gpu_all_reduce_combine_threshold_bytes": 0}


@pytest.mark.parametrize("flags", [NO_COMBINE,
                                   bench_overlap.FLAGS["LHS, 4 MiB combine"]],
                         ids=["no-combine", "lhs-4MiB"])
def test_gradient_reductions_start_before_the_last_gemm_only_with_the_option(flags):
  off = compiled_schedule(False, flags)
  on = compiled_schedule(True, flags)
  assert off["all_reduce_starts"] > 1 and on["all_reduce_starts"] > 1
  assert off["starts_before_last_gemm"] == 0
  assert off["gemm_positions_inside_an_all_reduce"] == 0
  assert on["starts_before_last_gemm"] >= 1
  assert on["gemm_positions_inside_an_all_reduce"] >= 1


def test_one_combined_reduction_cannot_overlap():
  # XLA's default combine threshold merges these gradients (under 30 MB) into one
  # all-reduce, which waits for the last of them: the option changes nothing here.
  on = compiled_schedule(True, {})
  assert on["all_reduce_starts"] == 1
  assert on["starts_before_last_gemm"] == 0


def test_skip_nonfinite_makes_every_reduction_wait_for_the_whole_backward():
  # Whether the last micro-batch is kept depends on all of its gradients, and every
  # gradient's add depends on that verdict.
  on = compiled_schedule(True, NO_COMBINE, skip_nonfinite=True)
  assert on["all_reduce_starts"] > 1
  assert on["starts_before_last_gemm"] == 0
