"""jaxaccum.nnx as a real train step uses it: several batch arguments, keyword batches,
path filters, NNX objects nested in arguments, the core's options forwarded, and errors
that name the model's own paths.

References: plain ``nnx.value_and_grad`` on the full batch where the forward pass is per
example, and ``nnx.value_and_grad`` on each micro-batch built by explicit slicing
(``x[i::N]``), one after the other on a copy of the objects, where it is not (dropout
draws, BatchNorm statistics, counters). Tolerances: float32, 1e-5 relative to each leaf's
largest entry (``tests._util.assert_close``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests._util import assert_close

B, N = 16, 4


class Net(nnx.Module):
  def __init__(self, rngs):
    self.backbone = nnx.Linear(4, 8, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.backbone(x)))


def xy(seed=0, b=B):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (b, 4)), jax.random.normal(ky, (b, 3))


def mse(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


# The full-batch (and per-micro-batch) references, plain nnx.value_and_grad / nnx.grad,
# jitted once for the module: one compile per shape instead of op-by-op runs.
mse_value_and_grad = nnx.jit(nnx.value_and_grad(mse))
mse_grad = nnx.jit(nnx.grad(mse))


def micro(tree, i, n=N):
  """Micro-batch ``i`` of ``n`` by explicit slicing: rows i, i + n, ..."""
  return jax.tree.map(lambda a: a[i::n], tree)


def test_several_batch_argnums_equal_full_batch_and_split_each():
  model, (x, y) = Net(nnx.Rngs(0)), xy()
  seen = []

  def loss_fn(model, x, y):
    seen.append((x.shape[0], y.shape[0]))
    return mse(model, x, y)

  ref_loss, ref_grads = mse_value_and_grad(model, x, y)
  vg = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=N, batch_argnums=(1, 2))
  loss, grads = nnx.jit(vg)(model, x, y)
  assert set(seen) == {(B // N, B // N)}
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)


def test_batch_argnames_split_keyword_arrays():
  model, (x, y) = Net(nnx.Rngs(0)), xy()
  seen = []

  def loss_fn(model, x, *, labels, scale):
    seen.append((x.shape[0], labels.shape[0], scale.shape))
    return jnp.mean((model(x) * scale - labels) ** 2)

  scale = jnp.array([1.0, 2.0, 3.0])
  ref_loss, ref_grads = nnx.value_and_grad(
      lambda m, x, y: loss_fn(m, x, labels=y, scale=scale))(model, x, y)
  seen.clear()
  vg = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=N, batch_argnums=1,
                                   batch_argnames="labels")
  loss, grads = vg(model, x, labels=y, scale=scale)
  assert set(seen) == {(B // N, B // N, (3,))}
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)

  # Only keyword batches: no positional batch is required.
  def kw_only(model, *, batch):
    return mse(model, *batch)

  vg = jaxaccum.nnx.value_and_grad(kw_only, micro_batch_size=2, batch_argnames=("batch",))
  loss, grads = vg(model, batch=(x, y))
  ref_loss, ref_grads = nnx.value_and_grad(lambda m, b: kw_only(m, batch=b))(model, (x, y))
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)


def test_wrt_path_filter_sees_paths_from_the_model_root():
  model, (x, y) = Net(nnx.Rngs(0)), xy()
  no_backbone = nnx.All(nnx.Param, lambda path, v: path[0] != "backbone")
  ref_loss, ref_grads = nnx.value_and_grad(mse, argnums=nnx.DiffState(0, no_backbone))(
      model, x, y)
  vg = jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N, batch_argnums=(1, 2),
                                   wrt=no_backbone)
  loss, grads = vg(model, x, y)
  assert set(grads) == {"head"}
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)

  only_head = nnx.All(nnx.Param, lambda path, v: path[0] == "head")
  _, grads = jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N, batch_argnums=(1, 2),
                                         wrt=only_head)(model, x, y)
  assert_close(grads, ref_grads)


class Teacher(nnx.Module):
  """Writes three kinds of state: BatchNorm statistics, a Dropout stream, a counter."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 3, rngs=rngs)
    self.norm = nnx.BatchNorm(3, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    self.calls[...] += 1
    return self.drop(self.norm(self.lin(x)))


def distill(model, x, extra):
  target = jax.lax.stop_gradient(extra["teacher"](x))
  return jnp.mean((model(x) - target * extra["scale"]) ** 2)


def raw(tree):
  """State as arrays with PRNG keys as their key data, for comparisons."""
  def one(a):
    return jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a
  return jax.tree.map(one, nnx.to_pure_dict(tree))


def test_nnx_objects_nested_in_arguments_are_threaded_like_top_level_ones():
  model, (x, _) = Net(nnx.Rngs(0)), xy()
  teacher = Teacher(nnx.Rngs(params=1, dropout=2))
  scale = jnp.float32(0.5)
  ref_model, ref_teacher = nnx.clone(model), nnx.clone(teacher)

  ref_vg = nnx.value_and_grad(distill)
  outs = [ref_vg(ref_model, micro(x, i), {"teacher": ref_teacher, "scale": scale})
          for i in range(N)]
  ref_loss, ref_grads = jax.tree.map(lambda *a: sum(a) / N, *outs)

  vg = jaxaccum.nnx.value_and_grad(distill, num_micro_batches=N)
  loss, grads = nnx.jit(vg)(model, x, {"teacher": teacher, "scale": scale})
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)
  assert int(teacher.calls[...]) == N
  assert_close(raw(nnx.state(teacher)), raw(nnx.state(ref_teacher)))

  # The same object passed by keyword is threaded too.
  def by_keyword(model, x, *, teacher):
    return distill(model, x, {"teacher": teacher, "scale": scale})

  teacher2 = Teacher(nnx.Rngs(params=1, dropout=2))
  loss2, grads2 = jaxaccum.nnx.value_and_grad(by_keyword, num_micro_batches=N)(
      nnx.clone(Net(nnx.Rngs(0))), x, teacher=teacher2)
  assert_close((loss2, grads2), (ref_loss, ref_grads))
  assert_close(raw(nnx.state(teacher2)), raw(nnx.state(ref_teacher)))


class WithEma(Net):
  def __init__(self, rngs):
    super().__init__(rngs)
    self.ema = nnx.BatchStat(jnp.zeros(3))


def test_errors_name_the_model_paths():
  model, (x, y) = WithEma(nnx.Rngs(0)), xy()

  def widens(model, x, y):
    out = model(x)
    model.ema.set_value(jnp.mean(out, axis=0).astype(jnp.bfloat16))
    return jnp.mean((out - y) ** 2)

  vg = jaxaccum.nnx.value_and_grad(widens, num_micro_batches=N, batch_argnums=(1, 2))
  with pytest.raises(TypeError, match=r"fun changed model\.ema \(BatchStat\) from an array of "
                     r"shape \(3,\) and dtype float32 to .*bfloat16.*astype\(float32\)"):
    vg(model, x, y)

  def counter_widens(model, x, extra):
    extra["teacher"].calls.set_value(jnp.zeros((), jnp.float32))
    return mse(model, x, x[:, :3])

  vg = jaxaccum.nnx.value_and_grad(counter_widens, num_micro_batches=N)
  with pytest.raises(TypeError, match=r"fun changed extra\['teacher'\]\.calls"):
    vg(model, x, {"teacher": Teacher(nnx.Rngs(0))})

  def grows(model, x, y):
    model.extra = nnx.BatchStat(jnp.zeros(()))
    return mse(model, x, y)

  with pytest.raises(ValueError, match=r"fun changed the structure of the model \(added "
                     r"model\.extra\)"):
    jaxaccum.nnx.value_and_grad(grows, num_micro_batches=N, batch_argnums=(1, 2))(model, x, y)


def test_batch_argnums_out_of_range_names_the_usual_causes():
  model, (x, y) = Net(nnx.Rngs(0)), xy()
  vg = jaxaccum.nnx.value_and_grad(lambda model, *args: mse(model, x, y), num_micro_batches=N)
  with pytest.raises(ValueError, match=r"batch_argnums=1 is out of range.*called with 1 "
                     r"positional argument.*closes over the batch.*batch_argnames="):
    vg(model)
  with pytest.raises(ValueError, match=r"batch_argnums names argument 0 \(model\), which is "
                     r"the model"):
    jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N, batch_argnums=-3)(model, x, y)
  with pytest.raises(TypeError, match=r"takes no argnums= option.*wrt="):
    jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N, argnums=0)
  with pytest.raises(TypeError, match=r"takes no state_argnums= option"):
    jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N, state_argnums=2)
  with pytest.raises(TypeError, match=r"the second argument \(x\) is the batch by default "
                     r"\(batch_argnums=1\), but it holds the NNX object Teacher"):
    jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N)(model, Teacher(nnx.Rngs(0)), y)


def test_core_options_are_forwarded():
  model, (x, y) = Net(nnx.Rngs(0)), xy()
  ref_loss, ref_grads = mse_value_and_grad(model, x, y)

  # with_info: (value_part, grads, info); grad: (grads_part, info).
  vg = jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N, batch_argnums=(1, 2),
                                   with_info=True)
  loss, grads, info = vg(model, x, y)
  assert isinstance(info, jaxaccum.AccumInfo)
  assert_close((loss, grads), (ref_loss, ref_grads))
  micro_sq = [optax_sq_norm(mse_grad(model, *micro((x, y), i))) for i in range(N)]
  np.testing.assert_allclose(info.micro_grad_sq_norm, np.mean(micro_sq), rtol=1e-5)
  np.testing.assert_allclose(info.batch_grad_sq_norm, optax_sq_norm(ref_grads), rtol=1e-5)
  assert int(info.num_micro_batches) == N and int(info.skipped) == 0

  def with_aux(model, x, y):
    return mse(model, x, y), jnp.sum(jnp.argmax(model(x), -1) == jnp.argmax(y, -1))

  (grads, count), info = jaxaccum.nnx.grad(
      with_aux, num_micro_batches=N, batch_argnums=(1, 2), has_aux=True, with_info=True)(
          model, x, y)
  ref_grads2, ref_count = nnx.jit(nnx.grad(with_aux, has_aux=True))(model, x, y)
  assert_close(grads, ref_grads2)
  assert int(count) == int(ref_count)  # an integer count is summed, not averaged
  assert int(info.num_micro_batches) == N

  # active_micro_batches at call time: only micro-batches 0..k-1, i.e. rows i::N, i < k.
  k = 2
  rows = np.sort(np.concatenate([np.arange(i, B, N) for i in range(k)]))
  ref_loss_k, ref_grads_k = mse_value_and_grad(model, x[rows], y[rows])
  vg = jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N, batch_argnums=(1, 2))
  loss_k, grads_k = nnx.jit(vg)(model, x, y, active_micro_batches=jnp.int32(k))
  assert_close((loss_k, grads_k), (ref_loss_k, ref_grads_k))

  # skip_nonfinite: a micro-batch with a NaN input adds nothing.
  x_nan = x.at[1].set(jnp.nan)  # row 1 is in micro-batch 1
  keep = np.array([r for r in range(B) if r % N != 1])
  ref_loss_s, ref_grads_s = mse_value_and_grad(model, x[keep], y[keep])
  vg = jaxaccum.nnx.value_and_grad(mse, num_micro_batches=N, batch_argnums=(1, 2),
                                   skip_nonfinite=True, with_info=True)
  loss_s, grads_s, info_s = vg(model, x_nan, y)
  assert int(info_s.skipped) == 1
  assert_close((loss_s, grads_s), (ref_loss_s, ref_grads_s))


def test_loss_terms_are_forwarded():
  model, (x, y) = Net(nnx.Rngs(0)), xy()
  w = (jnp.arange(B) % 3 == 0).astype(jnp.float32)  # uneven across micro-batches

  def terms(model, x, y, w):
    err = jnp.sum((model(x) - y) ** 2, axis=-1)
    return {"mse": jnp.mean(err), "masked": (jnp.sum(err * w), jnp.sum(w))}

  def total(model, x, y, w):
    t = terms(model, x, y, w)
    return t["mse"] + 0.5 * t["masked"][0] / t["masked"][1]

  ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(total))(model, x, y, w)
  vg = jaxaccum.nnx.value_and_grad(
      terms, num_micro_batches=N, batch_argnums=(1, 2, 3),
      reduce=jaxaccum.Terms({"mse": "mean", "masked": "weighted"}, weights={"masked": 0.5}),
                            with_info=True)
  loss, grads, info = vg(model, x, y, w)
  assert_close((loss, grads), (ref_loss, ref_grads))
  ref_terms = terms(model, x, y, w)
  assert_close(info.terms["masked"], ref_terms["masked"][0] / ref_terms["masked"][1])


def optax_sq_norm(tree):
  return float(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)))


def test_keyword_arrays_under_data_axis_replicated_unless_named():
  model, (x, y) = Net(nnx.Rngs(0)), xy(b=32)
  scale = jnp.array([1.0, 2.0, 3.0])

  def loss_fn(model, x, *, labels, scale):
    return jnp.mean((model(x) * scale - labels) ** 2)

  ref_loss, ref_grads = nnx.value_and_grad(
      lambda m, x, y: loss_fn(m, x, labels=y, scale=scale))(model, x, y)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
  x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  scale = jax.device_put(scale, NamedSharding(mesh, P()))

  @nnx.jit
  def step(model, x, y, scale):
    vg = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=2, batch_argnames="labels",
                                     batch_argnums=1, data_axis=jaxaccum.DataParallel("data",
                                         mesh=mesh))
    return vg(model, x, labels=y, scale=scale)

  loss, grads = step(model, x, y, scale)
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)
