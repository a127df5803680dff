"""User-defined aux reductions (optax Accumulators, jaxaccum Reductions) and aux leaves that
do not vary across data shards.

References: the full batch through plain ``jax.value_and_grad``, a hand loop over
``x[i::N]``, or tests/_reference.py.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.microbatching import AccumulationType
from optax.microbatching import _microbatching as optax_mb

import jaxaccum
from jaxaccum._core import _reduce
from tests._reference import Rules, reference

N = 4
X = jax.random.normal(jax.random.key(0), (16, 3))
W = jnp.array([0.5, -1.0, 2.0])


def optax_accumulator(kind: AccumulationType, n: int = N) -> optax.microbatching.Accumulator:
  """The Accumulator that optax.microbatch builds for ``kind`` over ``n`` micro-batches."""
  return optax_mb._canonicalize(kind, n)


def fun(w, x):
  pred = jnp.tanh(x @ w)
  return jnp.mean(pred ** 2), {"mean": jnp.mean(pred), "sum": jnp.sum(pred), "rows": pred}


def run(aux_reduce, x=X, **kw):
  f = jaxaccum.value_and_grad(fun, num_micro_batches=N, has_aux=True, aux_reduce=aux_reduce,
                              **kw)
  return jax.jit(f)(W, x)


def test_optax_accumulators_match_the_full_batch_and_the_builtin_kinds():
  (loss_ref, aux_ref), g_ref = jax.value_and_grad(fun, has_aux=True)(W, X)
  spec = {"mean": optax_accumulator(AccumulationType.MEAN),
          "sum": optax_accumulator(AccumulationType.SUM),
          "rows": optax_accumulator(AccumulationType.CONCAT)}
  (loss, aux), g = run(spec)
  # optax's CONCAT puts rows back column-major, as optax.microbatch splits: batch order.
  chex.assert_trees_all_close((loss, aux, g), (loss_ref, aux_ref, g_ref), rtol=1e-5, atol=1e-6)
  (_, builtin), _ = run({"mean": "mean", "sum": "sum", "rows": "concat"})
  chex.assert_trees_all_close(aux, builtin, rtol=1e-6)
  # RUNNING_MEAN reads the micro-batch index: the mean when every micro-batch runs.
  (_, running), _ = run({"mean": optax_accumulator(AccumulationType.RUNNING_MEAN),
                         "sum": None, "rows": "concat"})
  chex.assert_trees_all_close(running["mean"], aux_ref["mean"], rtol=1e-5)


def test_one_accumulator_for_the_whole_aux_and_a_reduction_instance():
  def fun2(w, x):
    loss, aux = fun(w, x)
    return loss, {"sum": aux["sum"], "rows": aux["rows"]}

  f = jaxaccum.value_and_grad(fun2, num_micro_batches=N, has_aux=True,
                              aux_reduce=optax_accumulator(AccumulationType.SUM))
  (_, aux), _ = jax.jit(f)(W, X)
  # SUM of per-example rows adds micro-batch i's row j over i: a hand loop over x[i::N].
  want = {"sum": sum(fun2(W, X[i::N])[1]["sum"] for i in range(N)),
          "rows": sum(fun2(W, X[i::N])[1]["rows"] for i in range(N))}
  chex.assert_trees_all_close(aux, want, rtol=1e-5)
  # A jaxaccum Reduction is an entry too: the table's own "max" entry, passed as an object.
  (_, got), _ = run({"mean": _reduce.AUX_REDUCTIONS["max"], "sum": "sum", "rows": "concat"})
  want_max = max(float(fun(W, X[i::N])[1]["mean"]) for i in range(N))
  np.testing.assert_allclose(got["mean"], want_max, rtol=1e-6)


def test_accumulator_update_is_skipped_for_skipped_and_inactive_micro_batches():
  x = X.at[1, 0].set(jnp.nan)  # row 1 is in micro-batch 1
  spec = {"mean": optax_accumulator(AccumulationType.SUM), "sum": "sum",
          "rows": optax_accumulator(AccumulationType.CONCAT)}
  (_, aux), _ = run(spec, x=x, skip_nonfinite=True)
  kept = [i for i in range(N) if i != 1]
  np.testing.assert_allclose(aux["mean"], sum(fun(W, x[i::N])[1]["mean"] for i in kept),
                             rtol=1e-5)
  # The skipped micro-batch's rows keep CONCAT's initial zeros; the others are as returned.
  rows = np.asarray(aux["rows"])
  for i in range(N):
    want = np.zeros(4) if i == 1 else fun(W, x[i::N])[1]["rows"]
    np.testing.assert_allclose(rows[i::N], want, rtol=1e-5)
  # active_micro_batches: micro-batches past k do not run, so do not update.
  f = jaxaccum.value_and_grad(fun, num_micro_batches=N, has_aux=True, aux_reduce=spec)
  (_, aux), _ = jax.jit(lambda w, x, k: f(w, x, active_micro_batches=k))(W, X, jnp.int32(2))
  np.testing.assert_allclose(aux["mean"], sum(fun(W, X[i::N])[1]["mean"] for i in range(2)),
                             rtol=1e-5)


def test_bad_entries_are_refused_when_the_transform_is_built():
  with pytest.raises(ValueError, match=r"aux_reduce entries must be one of.*'median'"):
    jaxaccum.value_and_grad(fun, num_micro_batches=N, has_aux=True,
                            aux_reduce={"mean": "median"})
  with pytest.raises(ValueError, match=r"AccumulationType.*pass the matching name"):
    jaxaccum.value_and_grad(fun, num_micro_batches=N, has_aux=True,
                            aux_reduce={"mean": AccumulationType.MEAN})


# --- Under data_axis ----------------------------------------------------------------------


def mesh8():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_a_user_reduction_without_a_cross_device_rule_is_refused_under_data_axis():
  mesh = mesh8()
  x = jax.device_put(jnp.tile(X, (2, 1)), NamedSharding(mesh, P("data")))
  f = jaxaccum.value_and_grad(
      fun, num_micro_batches=2, has_aux=True, data_axis=jaxaccum.DataParallel("data", mesh=mesh),
          aux_reduce={"mean": "mean", "sum": optax_accumulator(AccumulationType.SUM, 2),
                  "rows": "concat"})
  with pytest.raises(ValueError, match=r"aux leaf \['sum'\] is reduced with the optax "
                     r"Accumulator.*no rule for combining data shards.*Reduction with a "
                     r"combine"):
    jax.jit(f)(W, x)


def test_a_reduction_with_a_combine_runs_under_data_axis():
  mesh = mesh8()
  xs = jnp.tile(X, (2, 1))
  x = jax.device_put(xs, NamedSharding(mesh, P("data")))
  sum_sq = _reduce.Reduction(
      init=lambda s, acc: jnp.zeros(s.shape, jnp.float32),
      update=lambda c, v, w, i: c + jnp.sum(v.astype(c.dtype) ** 2, axis=0),
      combine=lambda c, axes, is_sum: lax.psum(c, axes),
      finalize=lambda c, st, s, d: c, numeric_only=True, name="sum of squares")
  f = jaxaccum.value_and_grad(fun, num_micro_batches=2, has_aux=True,
                              data_axis=jaxaccum.DataParallel("data", mesh=mesh),
                              aux_reduce={"mean": "mean", "sum": "sum",
                                                     "rows": sum_sq})
  (_, aux), _ = jax.jit(f)(W, x)
  want = jnp.sum(fun(W, xs)[1]["rows"] ** 2)
  np.testing.assert_allclose(aux["rows"], want, rtol=1e-5)


def test_skip_nonfinite_with_an_aux_leaf_that_does_not_vary_across_shards():
  def fun3(w, batch):
    x = batch["x"]
    pred = jnp.tanh(x @ w)
    # The row count and a constant are the same on every shard: device-invariant leaves.
    return jnp.mean(pred ** 2), {"rows": jnp.int32(x.shape[0]), "one": jnp.float32(1.0),
                                 "flag": jnp.bool_(True), "max": jnp.max(pred)}

  mesh = mesh8()
  xs = jnp.tile(X, (2, 1)).at[3, 0].set(jnp.nan)  # shard 0's micro-batch 1
  batch = {"x": xs}
  f = jaxaccum.value_and_grad(fun3, num_micro_batches=2, has_aux=True,
                              data_axis=jaxaccum.DataParallel("data", mesh=mesh),
                              skip_nonfinite=True, with_info=True,
                              aux_reduce={"rows": None, "one": None, "flag": None,
                                          "max": "max"})
  out = jax.jit(f)(W, jax.device_put(batch, NamedSharding(mesh, P("data"))))
  ref = reference(fun3, (W, batch), Rules(
      num_micro_batches=2, has_aux=True, aux_reduce={"max": "max"}, skip_nonfinite=True,
      with_info=True, shards=8))
  chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-6)
  assert int(out[0][1]["rows"]) == 30  # 16 micro-batches of 2 rows, one skipped
