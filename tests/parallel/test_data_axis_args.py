"""data_axis with keyword arrays, closures, and inside a user's own shard_map."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxaccum

SCALE = np.array([1.0, 2.0, 3.0], np.float32)


def _data():
  """``(x, y)`` as NumPy arrays: the references slice them on the host."""
  x = np.array(jax.jit(jax.random.normal, static_argnums=1)(jax.random.key(0), (32, 3)))
  return x, np.arange(32, dtype=np.float32) / 32


def ref_loss(w, batch):
  x, y = batch
  return jnp.mean((x @ (w * SCALE) - y) ** 2)


W = jnp.array([0.5, -0.1, 0.2])
ref_value_and_grad = jax.jit(jax.value_and_grad(ref_loss))  # plain jax, the full batch


def _close(out, ref):
  chex.assert_trees_all_close(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, ref),
                              rtol=1e-5, atol=1e-6)


def test_keyword_arrays_replicated_or_split_under_explicit_data_axis():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  x, y = _data()
  ref = ref_value_and_grad(W, (x, y))

  def loss_kw(w, batch, *, scale):
    x, y = batch
    return jnp.mean((x @ (w * scale[:3]) - y) ** 2)

  def loss_batch_kw(w, *, batch, scale):
    return loss_kw(w, batch, scale=scale)

  with jax.set_mesh(mesh):
    b = jax.tree.map(lambda a: jax.sharding.reshard(a, P("data")), (x, y))
    # A keyword array sharded over the data axis is gathered: fun sees all of it.
    scale8 = jax.sharding.reshard(jnp.concatenate([SCALE, jnp.zeros(5)]), P("data"))
    out = jax.jit(jaxaccum.value_and_grad(loss_kw, num_micro_batches=2, data_axis="data"))(
        W, b, scale=scale8)
    _close(out, ref)
    out = jax.jit(jaxaccum.value_and_grad(loss_batch_kw, num_micro_batches=2, data_axis="data",
                                          batch_argnames="batch"))(W, batch=b, scale=scale8)
    _close(out, ref)


def test_closures_under_auto_data_axis_and_a_clear_error_under_explicit():
  x, y = _data()
  ref = ref_value_and_grad(W, (x, y))
  auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(auto):
    scale = jax.device_put(jnp.asarray(SCALE), jax.NamedSharding(auto, P()))

    def loss(w, batch):
      x, y = batch
      return jnp.mean((x @ (w * scale) - y) ** 2)

    _close(jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis="data"))(
        W, (x, y)), ref)

    @jax.jit
    def step(w, batch, s):  # closes over an argument of the enclosing jit
      def loss(w, batch):
        x, y = batch
        return jnp.mean((x @ (w * s) - y) ** 2)
      return jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis="data")(w, batch)

    _close(step(W, (x, y), scale), ref)

  explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(explicit):
    scale = jax.device_put(jnp.asarray(SCALE), jax.NamedSharding(explicit, P()))

    def loss(w, batch):
      x, y = batch
      return jnp.mean((x @ (w * scale) - y) ** 2)

    b = jax.tree.map(lambda a: jax.sharding.reshard(a, P("data")), (x, y))
    with pytest.raises(ValueError, match=r"fun closes over an array typed with Explicit mesh "
                       r"axes \(f32\[3\].*Pass it to the accumulated function as an argument"):
      jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis="data"))(W, b)


@pytest.mark.parametrize("reduce", ["mean", "sum", "weighted"])
def test_the_shard_map_advice_gives_the_full_batch(reduce):
  """Inside a user's own shard_map, the error's advice (pmean / psum / weigh) is exact."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  x, y = _data()
  m = (np.arange(32) % 3 != 0).astype(np.float32)

  def loss(w, batch):
    x, y, m = batch
    err = m * (x @ (w * SCALE) - y) ** 2
    if reduce == "mean":
      return jnp.mean(err)
    if reduce == "sum":
      return jnp.sum(err)
    return jnp.sum(err), jnp.sum(m)

  def full(w):
    out = loss(w, (x, y, m))
    return out[0] / out[1] if reduce == "weighted" else out

  ref = jax.jit(jax.value_and_grad(full))(W)
  inner = jaxaccum.value_and_grad(loss, num_micro_batches=2, reduce=reduce)

  def per_device(w, batch):
    w = jax.lax.pcast(w, ("data",), to="varying")  # local gradients, no psum in the loop
    v, g = inner(w, batch)
    if reduce == "mean":
      return jax.lax.pmean((v, g), "data")
    if reduce == "sum":
      return jax.lax.psum((v, g), "data")
    d = jnp.sum(batch[2])
    total = jax.lax.psum(d, "data")
    return jax.tree.map(lambda t: jax.lax.psum(t * d, "data") / total, (v, g))

  with jax.set_mesh(mesh):
    b = jax.tree.map(lambda a: jax.sharding.reshard(a, P("data")), (x, y, m))
    step = jax.jit(jax.shard_map(per_device, in_specs=(P(), P("data")), out_specs=P()))
    _close(step(W, b), ref)
    colls = jaxaccum.planning.collectives(step, W, b)
    assert colls.num_loops and not colls.in_loop, colls.ops
    with pytest.raises(ValueError, match=r"already manual here.*jax.lax.pcast\(params, "
                       r"\('data',\), to='varying'\).*pmean \(not the psum\)"):
      jax.jit(jax.shard_map(
          lambda w, b: jaxaccum.value_and_grad(loss, num_micro_batches=2, reduce=reduce,
                                               data_axis="data")(w, b),
          in_specs=(P(), P("data")), out_specs=P()))(W, b)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_a_traced_active_count_under_data_axis_runs_the_first_k_micro_batches(axis_type):
  """k is an argument of the jitted step: one program for every k, on both mesh types."""
  n = 4
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  x, y = _data()

  def loss(w, batch):
    x, y = batch
    return ref_loss(w, batch), {"rows": jnp.int32(x.shape[0]), "max_y": jnp.max(y)}

  vg = jaxaccum.value_and_grad(loss, num_micro_batches=n, data_axis="data", has_aux=True,
                               aux_reduce={"rows": "sum", "max_y": "max"})
  with jax.set_mesh(mesh):
    b = jax.device_put((x, y), jax.NamedSharding(mesh, P("data")))
    step = jax.jit(lambda w, b, k: vg(w, b, active_micro_batches=k))
    ref = jax.jit(jax.value_and_grad(loss, has_aux=True))
    for k in (1, 3, n):
      out = step(W, b, jnp.int32(k))
      # The first k micro-batches, sliced by hand: rows i, i + N, ... for i < k.
      rows = tuple(np.concatenate([a[i::n] for i in range(k)]) for a in (x, y))
      (value, _), grads = ref(W, rows)
      aux = {"rows": np.int32(rows[0].shape[0]), "max_y": np.max(rows[1])}
      _close(out, ((value, aux), grads))
      # and a loop over the same micro-batches, each the mean of its own rows
      loop = [ref_value_and_grad(W, (x[i::n], y[i::n])) for i in range(k)]
      _close((out[0][0], out[1]), jax.tree.map(lambda *v, k=k: sum(v) / k, *loop))
    assert step._cache_size() == 1


def test_info_counts_each_shards_piece_of_a_micro_batch_under_data_axis():
  """num_micro_batches is k * D: the pieces that skipped and num_samples count as well."""
  n, shards = 4, 8
  mesh = jax.make_mesh((shards,), ("data",), axis_types=(AxisType.Explicit,))
  x, y = _data()
  x[5, 0] = np.nan  # shard 1 (rows 4..7), its piece of micro-batch 1
  vg = jaxaccum.value_and_grad(ref_loss, num_micro_batches=n, data_axis="data",
                               with_info=True, skip_nonfinite=True)
  with jax.set_mesh(mesh):
    b = jax.device_put((x, y), jax.NamedSharding(mesh, P("data")))
    step = jax.jit(lambda w, b, k: vg(w, b, active_micro_batches=k))
    for k in (1, 2, n):
      loss, grads, info = step(W, b, jnp.int32(k))
      skipped = int(k > 1)  # micro-batch 1 runs only when k > 1
      assert (int(info.num_micro_batches), int(info.skipped), int(info.num_samples)) == (
          k * shards, skipped, k * shards - skipped)
      rows = np.concatenate([np.arange(i, 32, n) for i in range(k)])
      rows = rows[rows != 5]  # micro-batches of one row per shard: only row 5 goes
      _close((loss, grads), ref_value_and_grad(W, (x[rows], y[rows])))
