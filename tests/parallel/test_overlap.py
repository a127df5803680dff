"""``overlap_grad_reduce=True``: the last micro-batch runs after the loop, same results.

Under ``data_axis`` on the 8 CPU devices, every output is compared with the full batch
through plain :func:`jax.value_and_grad`, with the reference model of tests/_reference.py
(a Python loop over ``x[i::N]`` slices per shard) and with the option off: skipped
micro-batches, ``active_micro_batches`` (concrete and traced), stacked and concatenated
aux (complete and in order), state threaded in order, PRNG keys, ``N = 1``. The program's
shape is checked too: a scan over ``N - 1`` micro-batches and the last one outside it.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests._reference import reference
from tests._util import scan_lengths
from tests.core import test_reference_model as trm


@functools.cache
def mesh8():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def step(case: trm.Case, overlap: bool):
  """The reference-model test's library step, with overlap_grad_reduce set."""
  extra = {"data_axis": jaxaccum.DataParallel("data", mesh=mesh8(),
                                              overlap_grad_reduce=overlap)}
  if case.rng:
    extra["rng_argnums"] = 2
  if case.state:
    extra["state_argnums"] = 3 if case.rng else 2
  f = jaxaccum.value_and_grad(trm.core_fun(case), **trm.options(case), **extra)
  return jax.jit(lambda args, k: f(*args, active_micro_batches=k))


def placed(args):
  mesh = mesh8()
  return (jax.device_put(args[0], NamedSharding(mesh, P())),
          jax.device_put(args[1], NamedSharding(mesh, P("data"))),
          *jax.device_put(args[2:], NamedSharding(mesh, P())))


CASES = [
    # Every kind of aux that comes back per micro-batch or per row, state and keys threaded.
    trm.Case(n=4, reduce="mean", aux=(("f_vec", "stack"), ("rows", "concat"),
                                      ("i_rows", "concat"), ("f_mean", None)),
             state=True, rng=True, shards=8),
    # A NaN in the last micro-batch (the one after the loop) and in a looped one.
    trm.Case(n=4, reduce=("mean", "w1"), aux=(("rows", "concat"), ("f_vec", "stack"),
                                              ("b_flag", "any")),
             state=True, skip=True, nan=(1, 3), info=True, shards=8),
    # Traced active count: micro-batch k - 1 runs after the loop, stacked zeros past k.
    trm.Case(n=4, rows=1, reduce="weighted", aux=(("f_sum", "stack"), ("rows", "concat")),
             state=True, rng=True, active=3, shards=8),
    trm.Case(n=3, reduce="sum", aux=(("f_vec", "stack"),), skip=True, nan=(0,), active=1,
             remat=True, shards=8),
    # N = 1: no loop; the one micro-batch is the last.
    trm.Case(n=1, reduce=("mean", "sum"), aux=(("rows", "concat"), ("f_vec", "stack")),
             state=True, info=True, shards=8),
    # Stacked per-row arrays, with_info's samples (the last one taken after the loop).
    trm.Case(n=2, reduce="mean", aux=(("rows", "stack"),), info=True, shards=8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c.n}-{c.reduce}-k{c.active}")
def test_matches_the_reference_model_and_the_option_off(case):
  data = trm.make_data(case)
  args = placed(data)
  k = None if case.active is None else jnp.int32(case.active)
  on = step(case, True)(args, k)
  off = step(case, False)(args, k)
  # The reference's loop runs one micro-batch at a time; fun under jit makes each of its
  # forward and backward passes one compiled call instead of many eager ops.
  trm.compare(on, reference(jax.jit(trm.core_fun(case)), data, trm.rules(case)), case)
  chex.assert_trees_all_close(on, off, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_equal_dtypes(on, off)


def mlp_loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  err = (h @ params["w2"] + params["b2"] - y) ** 2
  return jnp.mean(err), {"rows": jnp.sum(err, -1), "mb": jnp.mean(err)}


def mlp_data(rows=64):
  """Parameters and batch on the host (for the references), and placed on the mesh."""
  k = jax.random.split(jax.random.key(3), 4)
  params = {"w1": jax.random.normal(k[0], (5, 16)) / 2, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k[1], (16, 3)) / 4, "b2": jnp.full(3, 0.1)}
  batch = (jax.random.normal(k[2], (rows, 5)), jax.random.normal(k[3], (rows, 3)))
  mesh = mesh8()
  return (params, batch), (jax.device_put(params, NamedSharding(mesh, P())),
                           jax.device_put(batch, NamedSharding(mesh, P("data"))))


@pytest.mark.parametrize("n", [1, 4])
def test_full_batch_and_concrete_active_count(n):
  (params, batch), on_mesh = mlp_data()
  f = jaxaccum.value_and_grad(mlp_loss, num_micro_batches=n, has_aux=True,
                              data_axis=jaxaccum.DataParallel("data", mesh=mesh8(),
                                  overlap_grad_reduce=True),
                              aux_reduce={"rows": "concat", "mb": "stack"})
  (loss, aux), grads = jax.jit(f)(*on_mesh)
  full_batch = jax.jit(jax.value_and_grad(mlp_loss, has_aux=True))
  (ref_loss, ref_aux), ref_grads = full_batch(params, batch)
  chex.assert_trees_all_close((loss, aux["rows"], grads), (ref_loss, ref_aux["rows"], ref_grads),
                              rtol=1e-5, atol=1e-6)
  # Stacked: entry i is the mean over shards of micro-batch i's loss (rows i::n of each block).
  x, y = batch
  blocks = [(x[d * 8:(d + 1) * 8], y[d * 8:(d + 1) * 8]) for d in range(8)]
  loss_of = jax.jit(mlp_loss)
  per_mb = [np.mean([loss_of(params, (bx[i::n], by[i::n]))[0] for bx, by in blocks])
            for i in range(n)]
  chex.assert_trees_all_close(aux["mb"], jnp.asarray(per_mb), rtol=1e-5, atol=1e-6)
  # A concrete count (a Python int, checked against N when the call is traced): micro-batches
  # 0..k-1 only, k - 1 after the loop. The call is jitted with the count bound as a Python
  # int: run outside jit, the shard_map executes op by op (about 15 s on CPU).
  k = max(1, n - 1)
  (loss_k, aux_k), grads_k = jax.device_get(
      jax.jit(functools.partial(f, active_micro_batches=k))(*on_mesh))
  sel = [(jnp.concatenate([bx[i::n] for bx, _ in blocks]),
          jnp.concatenate([by[i::n] for _, by in blocks])) for i in range(k)]
  ref_k = full_batch(
      params, (jnp.concatenate([s[0] for s in sel]), jnp.concatenate([s[1] for s in sel])))
  chex.assert_trees_all_close((loss_k, grads_k), (ref_k[0][0], ref_k[1]), rtol=1e-5,
                              atol=1e-6)
  chex.assert_trees_all_close(aux_k["mb"][:k], jnp.asarray(per_mb[:k]), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(aux_k["mb"][k:], jnp.zeros(n - k))


@pytest.mark.parametrize("n", [1, 4])
def test_the_last_micro_batch_runs_after_the_loop(n):
  _, (params, batch) = mlp_data()
  lengths = {}
  for overlap in (False, True):
    f = jaxaccum.value_and_grad(lambda p, b: mlp_loss(p, b)[0], num_micro_batches=n,
                                data_axis=jaxaccum.DataParallel("data", mesh=mesh8(),
                                    overlap_grad_reduce=overlap))
    lengths[overlap] = scan_lengths(jax.make_jaxpr(f)(params, batch).jaxpr)
  assert lengths[False] == [n]
  assert lengths[True] == ([n - 1] if n > 1 else [])


def test_bad_values():
  with pytest.raises(TypeError, match="overlap_grad_reduce must be a bool"):
    jaxaccum.value_and_grad(mlp_loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel("data",
                            overlap_grad_reduce=1))
  with pytest.raises(ValueError, match="data_axis is not set"), \
      pytest.warns(DeprecationWarning, match="is deprecated"):
    jaxaccum.grad(mlp_loss, num_micro_batches=2, overlap_grad_reduce=True)


def test_grad_and_options_are_kept():
  (params, batch), on_mesh = mlp_data()
  g = jaxaccum.grad(lambda p, b: mlp_loss(p, b)[0], num_micro_batches=4,
                    data_axis=jaxaccum.DataParallel("data", mesh=mesh8(), overlap_grad_reduce=True))
  assert g.value_and_grad.options.parallel.overlap_grad_reduce is True
  chex.assert_trees_all_close(
      jax.jit(g)(*on_mesh), jax.grad(lambda p, b: mlp_loss(p, b)[0])(params, batch),
      rtol=1e-5, atol=1e-6)
