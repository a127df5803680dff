"""Robust losses (skip_nonfinite, several loss terms) and ramps (active_micro_batches)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum

B, D, N = 32, 3, 4


@functools.partial(jax.jit, static_argnums=0)
def _data(seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k1, (B, D))
  y = jax.random.normal(k2, (B,))
  mask = (jax.random.uniform(k3, (B,)) < 0.5).astype(jnp.float32)
  return x, y, mask


W = jnp.array([0.3, -0.2, 0.1])


def mse(w, batch):
  x, y = batch[:2]
  return jnp.mean((x @ w - y) ** 2)


def rows_of(batch, micro_batches):
  """The rows micro-batches ``micro_batches`` (of N) hold, built by explicit slicing."""
  idx = np.sort(np.concatenate([np.arange(B)[i::N] for i in micro_batches]))
  return jax.tree.map(lambda a: np.asarray(a)[idx], batch)


# Full-batch references: plain jax.value_and_grad under jit.
mse_value_and_grad = jax.jit(jax.value_and_grad(mse))


# --- skip_nonfinite --------------------------------------------------------------------------


def _poison(batch, micro_batch, value=np.nan):
  x, y = batch[:2]
  x = np.array(x)
  x[micro_batch, 0] = value  # row i is the first row of micro-batch i
  return (x, y, *batch[2:])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_bad_micro_batch_is_skipped(bad):
  x, y, _ = _data()
  batch = _poison((x, y), 2, bad)
  vg = jax.jit(jaxaccum.value_and_grad(mse, num_micro_batches=N, skip_nonfinite=True,
                                       with_info=True))
  loss, grads, info = vg(W, batch)
  ref = mse_value_and_grad(W, rows_of((x, y), [0, 1, 3]))
  chex.assert_trees_all_close((loss, grads), ref, rtol=1e-5, atol=1e-7)
  assert int(info.skipped) == 1 and int(info.num_samples) == N - 1
  # Without the option, the NaN reaches everything.
  loss, grads = jaxaccum.value_and_grad(mse, num_micro_batches=N)(W, batch)
  assert not bool(jnp.isfinite(loss)) or not bool(jnp.all(jnp.isfinite(grads)))


def test_skipped_micro_batch_drops_its_state_update_aux_and_tokens():
  x, y, mask = _data()

  def loss(w, batch, count):
    x, y, m = batch
    num = jnp.sum(m * (x @ w - y) ** 2)
    return (num, jnp.sum(m)), (count + 1, {"tok": jnp.sum(m), "mx": jnp.max(x[:, 0])})

  batch = _poison((x, y, mask), 1)
  step = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=N, reduce="weighted", has_aux=True, state_argnums=2,
      skip_nonfinite=True, aux_reduce={"tok": "sum", "mx": "max"}))
  ((value, (count, aux)), grads) = step(W, batch, jnp.int32(0))
  kept = rows_of((x, y, mask), [0, 2, 3])

  def ref_loss(w):
    num, den = loss(w, kept, 0)[0]
    return num / den

  ref_v, ref_g = jax.jit(jax.value_and_grad(ref_loss))(W)
  chex.assert_trees_all_close((value, grads), (ref_v, ref_g), rtol=1e-5, atol=1e-7)
  assert int(count) == 3  # the skipped micro-batch's state update was dropped
  np.testing.assert_allclose(aux["tok"], np.sum(kept[2]))  # its tokens too
  np.testing.assert_allclose(aux["mx"], np.max(kept[0][:, 0]))


def test_all_skipped_gives_zero_gradients_and_nan_value():
  x, y, _ = _data()
  x = np.array(x)
  x[:, 0] = np.nan
  batch = (x, y)
  loss, grads, info = jax.jit(jaxaccum.value_and_grad(
      mse, num_micro_batches=N, skip_nonfinite=True, with_info=True))(W, batch)
  assert bool(jnp.isnan(loss))
  np.testing.assert_array_equal(grads, np.zeros(D))
  assert int(info.skipped) == N
  _, grads, info = jaxaccum.value_and_grad(
      multi, num_micro_batches=N, reduce=REDUCE, skip_nonfinite=True, with_info=True)(
          W, (x, y, np.ones(B, np.float32)))
  assert all(bool(jnp.isnan(v)) for v in info.terms.values())
  np.testing.assert_array_equal(grads, np.zeros(D))


def test_skip_is_per_shard_under_data_axis():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  x, y, _ = _data()
  bad_row = 5  # shard 1 (rows 4..7), local row 1: local micro-batch 1 of 4 (1 row each)
  x, y = np.array(x), np.asarray(y)
  x[bad_row, 0] = np.nan
  batch = (x, y)
  keep = np.ones(B, bool)
  keep[bad_row] = False
  ref = mse_value_and_grad(W, (x[keep], y[keep]))
  with jax.set_mesh(mesh):
    sb = jax.tree.map(lambda a: jax.sharding.reshard(a, P("data")), batch)
    loss, grads, info = jax.jit(jaxaccum.value_and_grad(
        mse, num_micro_batches=N, skip_nonfinite=True, with_info=True,
        data_axis="data"))(W, sb)
  chex.assert_trees_all_close((loss, grads), ref, rtol=1e-5, atol=1e-7)
  assert int(info.skipped) == 1


# --- Several loss terms ----------------------------------------------------------------------


def multi(w, batch):
  x, y, m = batch
  err = (x @ w - y) ** 2
  return {"ce": (jnp.sum(m * err), jnp.sum(m)),
          "lb": jnp.var(x @ w),  # a statistic of the micro-batch
          "z": jnp.sum(w**2) * jnp.sum(jnp.abs(x[:, 0]))}


REDUCE = {"ce": "weighted", "lb": "mean", "z": "sum"}
WEIGHTS = {"lb": 0.01, "z": 1e-3}


@functools.partial(jax.jit, static_argnums=2)
@functools.partial(jax.value_and_grad, has_aux=True)
def reference(w, batch, micro_batches=tuple(range(N))):
  """The weighted total over ``micro_batches`` (rows i::N, sliced by hand), its terms, and
  their gradient by plain jax.value_and_grad."""
  parts = [jax.tree.map(lambda a, i=i: a[i::N], batch) for i in micro_batches]
  nums = sum(multi(w, p)["ce"][0] for p in parts)
  dens = sum(multi(w, p)["ce"][1] for p in parts)
  ce = nums / dens
  lb = sum(multi(w, p)["lb"] for p in parts) / len(parts)
  z = sum(multi(w, p)["z"] for p in parts)
  return ce + 0.01 * lb + 1e-3 * z, {"ce": ce, "lb": lb, "z": z}


@pytest.mark.parametrize("with_info", [False, True])
def test_loss_terms_each_normalised_their_own_way(with_info):
  batch = _data()
  vg = jax.jit(jaxaccum.value_and_grad(multi, num_micro_batches=N, reduce=jaxaccum.Terms(REDUCE,
               weights=WEIGHTS),
                                       with_info=with_info))
  value, grads, *info = vg(W, batch)  # without info, mean and sum terms share one sum
  (ref_v, ref_terms), ref_g = reference(W, batch)
  chex.assert_trees_all_close((value, grads), (ref_v, ref_g), rtol=1e-5, atol=1e-7)
  if with_info:
    chex.assert_trees_all_close(info[0].terms, ref_terms, rtol=1e-5, atol=1e-7)
  # MaxText's way (everything divided by the token count) differs: the test can tell.
  wrong = jax.jit(jax.grad(lambda w: sum(
      multi(w, jax.tree.map(lambda a, i=i: a[i::N], batch))["ce"][0]
      + 0.01 * multi(w, jax.tree.map(lambda a, i=i: a[i::N], batch))["lb"]
      for i in range(N)) / jnp.sum(batch[2])))(W)
  assert float(jnp.max(jnp.abs(wrong - ref_g))) > 1e-4


def test_loss_terms_with_skipping():
  batch = _poison(_data(), 3)
  value, grads, info = jax.jit(jaxaccum.value_and_grad(
      multi, num_micro_batches=N, reduce=jaxaccum.Terms(REDUCE, weights=WEIGHTS),
                                                        skip_nonfinite=True,
      with_info=True))(W, batch)
  (ref_v, ref_terms), ref_g = reference(W, batch, (0, 1, 2))
  chex.assert_trees_all_close((value, grads), (ref_v, ref_g), rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(info.terms, ref_terms, rtol=1e-5, atol=1e-7)
  assert int(info.skipped) == 1


def test_loss_terms_errors():
  with pytest.raises(ValueError, match=r"^weights names \['zz'\], which are not terms"):
    jaxaccum.value_and_grad(multi, num_micro_batches=N, reduce=jaxaccum.Terms(REDUCE,
                            weights={"zz": 1.0}))
  with pytest.raises(ValueError, match="loss_weights=.* was given but reduce='mean' is a single"), \
      pytest.warns(DeprecationWarning, match="is deprecated"):
    jaxaccum.value_and_grad(mse, num_micro_batches=N, loss_weights={"a": 1.0})
  with pytest.raises(ValueError, match="reduce must be one of"):
    jaxaccum.value_and_grad(multi, num_micro_batches=N, reduce={"ce": "avg"})
  with pytest.raises(TypeError, match=r"reduce names loss term \['lb'\], but the value fun "
                     r"returned has keys \['ce', 'z'\]"):
    jaxaccum.value_and_grad(lambda w, b: {k: v for k, v in multi(w, b).items() if k != "lb"},
                            num_micro_batches=N, reduce=REDUCE)(W, _data())


# --- active_micro_batches --------------------------------------------------------------------


def test_active_micro_batches_one_program_equal_to_the_rows_that_ran():
  x, y, _ = _data()
  traces = []

  def counted(w, batch):
    traces.append(1)
    return mse(w, batch), {"rows": batch[1], "i": jnp.sum(batch[1])}

  vg = jaxaccum.value_and_grad(counted, num_micro_batches=N, has_aux=True, with_info=True,
                               aux_reduce={"rows": "concat", "i": "stack"})
  step = jax.jit(lambda w, b, k: vg(w, b, active_micro_batches=k))
  for k in (1, 2, N):
    (loss, aux), grads, info = step(W, (x, y), jnp.int32(k))
    ref = mse_value_and_grad(W, rows_of((x, y), range(k)))
    chex.assert_trees_all_close((loss, grads), ref, rtol=1e-5, atol=1e-7)
    assert int(info.num_micro_batches) == k
    ran = np.isin(np.arange(B) % N, np.arange(k))
    np.testing.assert_allclose(aux["rows"], np.where(ran, np.asarray(y), 0.0))
    assert np.all(np.asarray(aux["i"])[k:] == 0)
  assert step._cache_size() == 1  # one compiled program for every k
  n_traces = len(traces)
  step(W, (x, y), jnp.int32(3))
  assert len(traces) == n_traces


def test_active_micro_batches_with_state_and_keys_follow_the_same_rule():
  x, y, _ = _data()

  def loss(w, batch, count, key):
    noise = jax.random.normal(key, ()) * 0
    return mse(w, batch) + noise, count + 1

  vg = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, state_argnums=2,
                                       rng_argnums=3),
               static_argnames=())
  (v, count), g = vg(W, (x, y), jnp.int32(0), jax.random.key(0), active_micro_batches=3)
  assert int(count) == 3
  ref = mse_value_and_grad(W, rows_of((x, y), range(3)))
  chex.assert_trees_all_close((v, g), ref, rtol=1e-5, atol=1e-7)


def test_active_micro_batches_errors():
  x, y, _ = _data()
  vg = jaxaccum.value_and_grad(mse, num_micro_batches=N)
  with pytest.raises(ValueError, match=r"active_micro_batches=5 is out of range: it counts "
                     r"the micro-batches to run, from 1 to num_micro_batches=4"):
    vg(W, (x, y), active_micro_batches=5)
  with pytest.raises(ValueError, match="active_micro_batches=0 is out of range"):
    vg(W, (x, y), active_micro_batches=0)
  with pytest.raises(TypeError, match="active_micro_batches must be an int"):
    vg(W, (x, y), active_micro_batches=1.5)


def test_loss_terms_under_data_axis():
  """Each shard's micro-batch is one piece: weighted terms pool all pieces, mean terms average
  the pieces' values, sum terms add them (a reference built piece by piece by hand)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  batch = _data()
  n, local = 2, B // 8
  pieces = [jax.tree.map(lambda a, d=d, i=i: a[d * local:(d + 1) * local][i::n], batch)
            for d in range(8) for i in range(n)]

  def ref(w):
    terms = [multi(w, p) for p in pieces]
    ce = sum(t["ce"][0] for t in terms) / sum(t["ce"][1] for t in terms)
    lb = sum(t["lb"] for t in terms) / len(terms)
    z = sum(t["z"] for t in terms)
    return ce + 0.01 * lb + 1e-3 * z

  ref_v, ref_g = jax.jit(jax.value_and_grad(ref))(W)
  with jax.set_mesh(mesh):
    sb = jax.tree.map(lambda a: jax.sharding.reshard(a, P("data")), batch)
    for with_info in (False, True):  # sum and mean terms share one accumulator, or not
      out = jax.jit(jaxaccum.value_and_grad(
          multi, num_micro_batches=n, reduce=jaxaccum.Terms(REDUCE, weights=WEIGHTS),
                                                            with_info=with_info,
                                                                data_axis="data"))(W, sb)
      chex.assert_trees_all_close(tuple(map(np.asarray, out[:2])), (ref_v, ref_g),
                                  rtol=1e-5, atol=1e-7)
