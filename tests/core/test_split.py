"""``batch_axis=``: a batch split along another axis than the leading one.

References: the full batch through plain ``jax.value_and_grad`` (the split must not change
the numbers), and a Python loop over micro-batches sliced by hand, ``x[:, i::N]`` for
``batch_axis=1`` (micro-batch ``i`` of ``N`` holds indices ``i, i + N, ...`` along the axis),
never the library's own split. float32 tolerances as in ``tests/core/test_transform.py``.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxaccum

T, B, F, N = 3, 8, 4, 4
close = functools.partial(chex.assert_trees_all_close, rtol=1e-5, atol=1e-6)


def _data(seed=0, b=B):
  """``(x, y, mask)`` as NumPy arrays (so the references slice them on the host)."""
  return jax.device_get(_random_data(seed, b))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _random_data(seed, b):
  kx, ky, km = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (T, b, F))  # time-major: (time, batch, features)
  y = jax.random.normal(ky, (T, b))
  mask = (jax.random.uniform(km, (T, b)) < 0.6).astype(jnp.float32)
  return x, y, mask


PARAMS = {"w": jnp.linspace(-1.0, 1.0, F), "b": jnp.float32(0.3)}


def seq_loss(params, x, y):
  pred = x @ params["w"] + params["b"]  # (T, b)
  return jnp.mean((pred - y) ** 2)


def _loop(fun, params, n, slices, *, reduce="mean"):
  """The accumulated value and gradients from a loop over hand-sliced micro-batches."""
  vg = jax.jit(jax.value_and_grad(fun))
  outs = [vg(params, *slices(i)) for i in range(n)]
  total = jax.tree.map(lambda *a: sum(a), *outs)
  return total if reduce == "sum" else jax.tree.map(lambda a: a / n, total)


class TimeMajorTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_time_major_batch_axis_1_is_the_full_batch_and_the_hand_sliced_loop(self):
    x, y, _ = _data()
    got = self.variant(jaxaccum.value_and_grad(
        seq_loss, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=1))(PARAMS, x, y)
    close(got, jax.jit(jax.value_and_grad(seq_loss))(PARAMS, x, y))
    close(got, _loop(seq_loss, PARAMS, N, lambda i: (x[:, i::N], y[:, i::N])))

  @chex.variants(with_jit=True, without_jit=True)
  def test_grad_negative_axis_and_micro_batch_size(self):
    x, y, _ = _data(1)
    g = self.variant(jaxaccum.grad(seq_loss, micro_batch_size=2, batch_argnums=(1, 2),
                                   batch_axis=(-2, -1)))(PARAMS, x, y)
    close(g, jax.grad(seq_loss)(PARAMS, x, y))

  @chex.variants(with_jit=True, without_jit=True)
  def test_fun_sees_the_axis_in_place_with_the_micro_batch_rows(self):
    x, y, _ = _data(2)
    seen = []

    def loss(params, x, y):
      seen.append((x.shape, y.shape))
      return seq_loss(params, x, y)

    self.variant(jaxaccum.value_and_grad(loss, num_micro_batches=N, batch_argnums=(1, 2),
                                         batch_axis=1))(PARAMS, x, y)
    assert set(seen) == {((T, B // N, F), (T, B // N))}


def test_sum_reduce_along_axis_1():
  x, y, _ = _data(3)

  def loss(params, x, y):
    return jnp.sum((x @ params["w"] - y) ** 2)

  got = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, batch_argnums=(1, 2),
                                        batch_axis=1, reduce="sum"))(PARAMS, x, y)
  close(got, jax.jit(jax.value_and_grad(loss))(PARAMS, x, y))
  close(got, _loop(loss, PARAMS, N, lambda i: (x[:, i::N], y[:, i::N]), reduce="sum"))


# --- Per-argument axes ------------------------------------------------------------------


def _mixed_loss(params, batch, labels):
  x = batch["x"]  # (T, b, F): batch axis 1
  y = batch["y"]  # (b, T): batch axis 0
  pred = x @ params["w"] + params["b"]
  return jnp.mean((pred - y.T) ** 2 * labels[None, :])  # labels: (b,)


@pytest.mark.parametrize("batch_axis", [
    ({"x": 1, "y": 0}, 0),  # a pytree prefix for argument 1, an int for argument 2
    ({"x": 1, "y": -2}, -1),
])
def test_mixed_axes_tuple_and_pytree_prefix(batch_axis):
  x, y, _ = _data(4)
  batch = {"x": x, "y": y.T}
  labels = jnp.linspace(0.5, 1.5, B)
  got = jax.jit(jaxaccum.value_and_grad(_mixed_loss, num_micro_batches=N,
                                        batch_argnums=(1, 2), batch_axis=batch_axis))(
      PARAMS, batch, labels)
  close(got, jax.jit(jax.value_and_grad(_mixed_loss))(PARAMS, batch, labels))
  close(got, _loop(_mixed_loss, PARAMS, N, lambda i: (
      {"x": x[:, i::N], "y": y.T[i::N]}, labels[i::N])))


def test_keyword_batch_gets_the_entries_after_the_positional_ones():
  x, y, _ = _data(5)

  def loss(params, x, *, labels):  # labels (b, T): batch axis 0
    return seq_loss(params, x, labels.T)

  got = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, batch_argnums=1,
                                        batch_argnames="labels", batch_axis=(1, 0)))(
      PARAMS, x, labels=y.T)
  close(got, jax.jit(jax.value_and_grad(loss))(PARAMS, x, labels=y.T))


# --- Token-weighted loss, concat aux, state and keys ------------------------------------


def test_weighted_tokens_along_axis_1():
  x, y, mask = _data(6)

  def loss(params, x, y, mask):
    err = (x @ params["w"] + params["b"] - y) ** 2
    return jnp.sum(err * mask), jnp.sum(mask)

  def full(params, x, y, mask):
    num, den = loss(params, x, y, mask)
    return num / den

  got = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, batch_argnums=(1, 2, 3),
                                        batch_axis=1, reduce="weighted"))(PARAMS, x, y, mask)
  close(got, jax.jit(jax.value_and_grad(full))(PARAMS, x, y, mask))
  # The loop: summed numerators and gradients over summed denominators.
  part = jax.jit(jax.value_and_grad(loss, has_aux=True))
  parts = [part(PARAMS, x[:, i::N], y[:, i::N], mask[:, i::N]) for i in range(N)]
  den = sum(d for (_, d), _ in parts)
  close(got, (sum(v for (v, _), _ in parts) / den,
              jax.tree.map(lambda *g: sum(g) / den, *[g for _, g in parts])))


def test_concat_aux_comes_back_along_the_batch_axis():
  x, y, _ = _data(7)

  def loss(params, x, y):
    pred = x @ params["w"] + params["b"]  # (T, b): rows along axis 1
    return jnp.mean((pred - y) ** 2), {"pred": pred, "both": jnp.stack([pred, pred - y], -1)}

  (value, aux), grads = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=1, has_aux=True,
      aux_reduce="concat"))(PARAMS, x, y)
  close(((value, aux), grads), jax.jit(jax.value_and_grad(loss, has_aux=True))(PARAMS, x, y))
  assert aux["pred"].shape == (T, B) and aux["both"].shape == (T, B, 2)


def test_concat_aux_with_different_per_argument_axes_comes_back_along_axis_0():
  x, y, _ = _data(8)
  batch = {"x": x, "y": y.T}

  def loss(params, batch, labels):
    return _mixed_loss(params, batch, labels), {"rows": batch["y"] * 2.0}  # (b, T)

  labels = jnp.ones(B)
  (_, aux), _ = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=({"x": 1, "y": 0}, 0),
      has_aux=True, aux_reduce="concat"))(PARAMS, batch, labels)
  close(aux, {"rows": y.T * 2.0})


def test_state_threaded_in_order_and_keys_folded_per_micro_batch():
  x, y, _ = _data(9)

  def loss(params, x, y, state, key):
    noise = 0.1 * jax.random.normal(key, y.shape)
    value = jnp.mean((x @ params["w"] + params["b"] - y + noise) ** 2)
    # An order-sensitive state update: a running mean with momentum.
    return value, {"ema": 0.5 * state["ema"] + 0.5 * jnp.mean(x, axis=(0, 1)),
                   "step": state["step"] + 1}

  state0 = {"ema": jnp.zeros(F), "step": jnp.int32(0)}
  key = jax.random.key(3)
  (value, state), grads = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=1, state_argnums=3,
      rng_argnums=4))(PARAMS, x, y, state0, key)
  st, vals, gs = state0, [], []
  part = jax.jit(jax.value_and_grad(loss, has_aux=True))
  for i in range(N):
    (v, st), g = part(
        PARAMS, x[:, i::N], y[:, i::N], st, jax.random.fold_in(key, i))
    vals.append(v)
    gs.append(g)
  close(((value, state), grads), ((sum(vals) / N, st), jax.tree.map(lambda *g: sum(g) / N, *gs)))
  assert int(state["step"]) == N


# --- split_micro_batches / merge_micro_batches ------------------------------------------


def test_split_and_merge_along_an_axis_round_trip():
  x, y, _ = _data(10)
  batch = {"x": x, "y": y.T}
  micro = jaxaccum.split_micro_batches(batch, num_micro_batches=N, batch_axis={"x": 1, "y": 0})
  for i in range(N):
    chex.assert_trees_all_equal(jax.tree.map(lambda a, i=i: a[i], micro),
                                {"x": x[:, i::N], "y": y.T[i::N]})
  back = jaxaccum.merge_micro_batches(micro, batch_axis={"x": 1, "y": 0})
  chex.assert_trees_all_equal(back, batch)
  micro = jaxaccum.split_micro_batches(x, micro_batch_size=2, batch_axis=-2)
  assert micro.shape == (B // 2, T, 2, F)
  chex.assert_trees_all_equal(micro[1], x[:, 1::B // 2])
  chex.assert_trees_all_equal(jaxaccum.merge_micro_batches(micro, batch_axis=-2), x)


def test_merge_of_stacked_aux_gives_the_concat():
  x, y, _ = _data(11)

  def loss(params, x, y):
    pred = x @ params["w"]
    return jnp.mean((pred - y) ** 2), pred

  (_, stacked), _ = jaxaccum.value_and_grad(loss, num_micro_batches=N, batch_argnums=(1, 2),
                                            batch_axis=1, has_aux=True, aux_reduce="stack")(
      PARAMS, x, y)
  close(jaxaccum.merge_micro_batches(stacked, batch_axis=1), x @ PARAMS["w"])


# --- Several devices --------------------------------------------------------------------


def _sharded(*trees, spec=None):
  spec = P(None, "data") if spec is None else spec
  return jax.tree.map(lambda a: jax.sharding.reshard(a, spec), trees)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_data_axis_with_the_batch_sharded_along_axis_1(axis_type):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  x, y, mask = _data(12, b=32)

  def loss(params, x, y, mask):
    pred = x @ params["w"] + params["b"]
    return (jnp.sum((pred - y) ** 2 * mask), jnp.sum(mask)), {"pred": pred}

  def full(params, x, y, mask):
    (num, den), aux = loss(params, x, y, mask)
    return num / den, aux

  ref = jax.jit(jax.value_and_grad(full, has_aux=True))(PARAMS, x, y, mask)
  step = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=2, batch_argnums=(1, 2, 3), batch_axis=1, reduce="weighted",
      has_aux=True, aux_reduce="concat", data_axis=jaxaccum.DataParallel("data", mesh=mesh)))
  with jax.set_mesh(mesh):
    if axis_type == AxisType.Explicit:
      args = _sharded(x, y, mask)
    else:
      sharding = jax.sharding.NamedSharding(mesh, P(None, "data"))
      args = tuple(jax.device_put(a, sharding) for a in (x, y, mask))
    got = step(PARAMS, *args)
    close(got, ref)
    # One reduction of loss, gradients and denominator after the loop, none inside it.
    coll = jaxaccum.planning.collectives(step, PARAMS, *args)
    assert coll.count(in_loop=True) == 0 and coll.count("all-reduce") == 1, coll


def test_data_axis_auto_reads_the_sharding_of_the_batch_axis():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  x, y, mask = _data(12, b=32)

  def loss(params, x, y, mask):
    pred = x @ params["w"] + params["b"]
    return jnp.sum((pred - y) ** 2 * mask), jnp.sum(mask)

  ref = jax.jit(jax.value_and_grad(lambda *a: jnp.divide(*loss(*a))))(PARAMS, x, y, mask)
  step = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=2, batch_argnums=(1, 2, 3), batch_axis=1, reduce="weighted",
      data_axis="auto"))
  with jax.set_mesh(mesh):
    close(step(PARAMS, *_sharded(x, y, mask)), ref)
    # Replicated: the batch axis is not sharded, a clear error naming it.
    with pytest.raises(ValueError, match=r"batch axis \(axis 1\)"):
      step(PARAMS, *_sharded(x, y, mask, spec=P()))


def test_split_along_a_sharded_axis_1_moves_no_data():
  """Without data_axis, the compiled program has no collective or copy for the split: only
  the gradients' and loss's all-reduces, none of batch size, and no all-gather, all-to-all or
  collective-permute."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  x, y, _ = _data(13, b=64)
  step = jax.jit(jaxaccum.value_and_grad(seq_loss, num_micro_batches=4, batch_argnums=(1, 2),
                                         batch_axis=1))
  with jax.set_mesh(mesh):
    xs, ys = _sharded(x, y)
    close(step(PARAMS, xs, ys), jax.jit(jax.value_and_grad(seq_loss))(PARAMS, x, y))
    coll = jaxaccum.planning.collectives(step, PARAMS, xs, ys)
    text = step.lower(PARAMS, xs, ys).compile().as_text()
  assert coll.count(["all-gather", "all-to-all", "collective-permute"]) == 0, coll
  assert all(c.bytes <= 4 * (F + 2) for c in coll), coll  # parameters' and loss' sizes
  # No copy or transpose of an array (a transposed layout copies each micro-batch of x,
  # f32[3,2,4] per device): only scalars are copied.
  copies = [line for line in text.splitlines() if " copy(" in line or " transpose(" in line]
  assert all(re.search(r"= \w+\[\] (copy|transpose)\(", line) for line in copies), copies


# --- Adapters ---------------------------------------------------------------------------


def test_nnx_passes_batch_axis_through():
  from flax import nnx

  x, y, _ = _data(14)
  model = nnx.Linear(F, 1, rngs=nnx.Rngs(0))

  def loss(model, x, y):
    return jnp.mean((model(x)[..., 0] - y) ** 2)

  got = nnx.jit(lambda m, x, y: jaxaccum.nnx.value_and_grad(
      loss, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=1)(m, x, y))(model, x, y)
  close(got, nnx.jit(nnx.value_and_grad(loss))(model, x, y))


def test_linen_passes_batch_axis_through():
  import flax.linen as nn

  x, y, _ = _data(15)
  model = nn.Dense(1)
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]

  def loss(params, batch, model_state, rngs):
    x, y = batch
    return jnp.mean((model.apply({"params": params}, x)[..., 0] - y) ** 2), model_state

  got = jax.jit(jaxaccum.linen.value_and_grad(loss, num_micro_batches=N, batch_axis=1))(
      params, (x, y), {}, {})
  ref = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, (x, y), {}, {})
  close(got, ref)


def test_eqx_passes_batch_axis_through():
  import equinox as eqx

  x, y, _ = _data(16)
  model = eqx.nn.Linear(F, 1, key=jax.random.key(0))

  def loss(model, x, y):
    pred = jax.vmap(jax.vmap(model))(x)[..., 0]
    return jnp.mean((pred - y) ** 2)

  got = eqx.filter_jit(jaxaccum.eqx.filter_value_and_grad(
      loss, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=1))(model, x, y)
  close(got, eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, x, y))


# --- optax's microbatching tests, translated ---------------------------------------------
# optax/microbatching/_microbatching_test.py: test_in_axes_invariant and
# test_in_axes_with_argnames. optax microbatches a forward function; here the same einsum
# is the aux (summed, averaged and concatenated) of a loss that also has gradients.


class OptaxInAxesTest(parameterized.TestCase):

  @parameterized.parameters("sum", "mean", "concat")
  def test_in_axes_invariant(self, kind):
    arg_axis0 = jnp.asarray(np.random.default_rng(0).normal(size=(10, 4, 5)), jnp.float32)
    arg_axis1 = jnp.transpose(arg_axis0, (1, 0, 2))
    self.assertEqual(arg_axis1.shape, (4, 10, 5))
    rows = {"sum": False, "mean": False, "concat": True}[kind]
    w = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)

    def fun_axis0(w, a, b):
      out = jnp.einsum("bij,bkj->bik" if rows else "bij,bkj->ik", a, b)
      return jnp.sum(w * out) if not rows else jnp.mean(w * out), out

    def fun_axis1(w, a, b):
      out = jnp.einsum("ibj,kbj->ibk" if rows else "ibj,kbj->ik", a, b)
      return jnp.sum(w * out) if not rows else jnp.mean(w * jnp.swapaxes(out, 0, 1)), out

    reduce = "mean" if rows else kind
    opts = dict(micro_batch_size=2, batch_argnums=(1, 2), has_aux=True, aux_reduce=kind,
                reduce=reduce)
    (v0, a0), g0 = jaxaccum.value_and_grad(fun_axis0, batch_axis=0, **opts)(
        w, arg_axis0, arg_axis0)
    (v1, a1), g1 = jaxaccum.value_and_grad(fun_axis1, batch_axis=1, **opts)(
        w, arg_axis1, arg_axis1)
    close((v0, g0), (v1, g1))
    close(a0, jnp.swapaxes(a1, 0, 1) if rows else a1)
    # And the full batch (a mean of micro-batch sums is the sum over 5 micro-batches / 5).
    (vf, af), gf = jax.jit(jax.value_and_grad(fun_axis0, has_aux=True))(w, arg_axis0, arg_axis0)
    scale = 5.0 if kind == "mean" else 1.0
    # The value sums entries of magnitude ~10 that cancel to ~1; summed in another order
    # (five micro-batches, then the whole batch) float32 round-off is ~2e-5 of it.
    chex.assert_trees_all_close((v0, g0), jax.tree.map(lambda t: t / scale, (vf, gf)),
                                rtol=1e-4, atol=1e-6)
    close(a0, af / scale)

  @parameterized.parameters("sum", "mean")
  def test_in_axes_with_argnames(self, reduce):
    arg0 = jnp.asarray(np.random.default_rng(1).normal(size=(10, 4, 5)), jnp.float32)
    arg1 = jnp.transpose(arg0, (1, 0, 2))
    self.assertEqual(arg1.shape, (4, 10, 5))
    w = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)

    def fun(w, a=None, b=None):
      out = jnp.einsum("bij,kbj->ik", a, b)
      return jnp.sum(w * out), out

    mfun = functools.partial(jaxaccum.value_and_grad, fun, micro_batch_size=2, has_aux=True,
                             aux_reduce=reduce, reduce=reduce)
    ans0 = mfun(batch_argnums=(1, 2), batch_axis=(0, 1))(w, arg0, arg1)
    ans1 = mfun(batch_argnums=(2, 1), batch_axis=(1, 0))(w, arg0, arg1)
    ans2 = mfun(batch_argnums=(), batch_argnames=("a", "b"), batch_axis=(0, 1))(
        w, a=arg0, b=arg1)
    ans3 = mfun(batch_argnums=(), batch_argnames=("a", "b"), batch_axis=(0, 1))(
        w, b=arg1, a=arg0)
    ans4 = mfun(batch_argnums=(), batch_argnames=("b", "a"), batch_axis=(1, 0))(
        w, a=arg0, b=arg1)
    ans5 = mfun(batch_argnums=(), batch_argnames=("b", "a"), batch_axis=(1, 0))(
        w, b=arg1, a=arg0)
    ans6 = mfun(batch_argnums=1, batch_argnames="b", batch_axis=(0, 1))(w, arg0, b=arg1)
    for ans in (ans1, ans2, ans3, ans4, ans5, ans6):
      close(ans, ans0)
    full = jax.jit(jax.value_and_grad(fun, has_aux=True))(w, arg0, arg1)
    close(ans0, full if reduce == "sum" else jax.tree.map(lambda t: t / 5, full))


# --- Errors -------------------------------------------------------------------------------


def _vg(**kw):
  return jaxaccum.value_and_grad(seq_loss, num_micro_batches=N, batch_argnums=(1, 2), **kw)


@pytest.mark.parametrize("bad, match", [
    (1.5, r"batch_axis must be an int .* got batch_axis=1.5"),
    (True, r"batch_axis must be an int"),
    ([1, 1], r"or a tuple with one entry per batch argument .* got batch_axis=\[1, 1\]"),
    ((1, "a"), r"got batch_axis=\(1, 'a'\)"),
    ((1, None), r"batch_axis=\(1, None\) has a None entry: every leaf of a batch argument "
     r"is split"),
    ((1, 1, 1), r"batch_axis=\(1, 1, 1\) has 3 entries, but there are 2 batch arguments: "
     r"give one entry per batch argument \(batch_argnums in order, then batch_argnames"),
])
def test_bad_batch_axis_at_construction(bad, match):
  with pytest.raises((TypeError, ValueError), match=match):
    _vg(batch_axis=bad)


def test_a_tuple_with_the_optional_default_batch_argnums_asks_for_them():
  with pytest.raises(ValueError, match=r"batch_argnums is left at its default with "
                     r"batch_argnames=\('labels',\).*Pass batch_argnums explicitly"):
    jaxaccum.value_and_grad(seq_loss, num_micro_batches=N, batch_argnames="labels",
                            batch_axis=(1, 0))


def test_axis_out_of_range_names_the_leaf_its_shape_and_rank():
  x, y, _ = _data()
  with pytest.raises(ValueError, match=r"batch_axis=2 is out of range for batch leaf argument "
                     r"2 \('y'\) of shape \(3, 8\) \(rank 2\): valid axes are -2..1"):
    _vg(batch_axis=2)(PARAMS, x, y)


def test_sizes_that_differ_name_each_leaf_and_its_axis():
  x, y, _ = _data()
  with pytest.raises(ValueError, match=r"sizes along their batch axes \(batch_axis\) differ: "
                     r"8 at argument 1 \('x'\) \(axis 1\); 3 at argument 2 \('y'\) \(axis 0\)"):
    _vg(batch_axis=(1, 0))(PARAMS, x, y)


def test_not_divisible_names_the_axis_and_the_leaf():
  x, y, _ = _data()
  with pytest.raises(ValueError, match=r"batch size 8 \(the size of batch_axis=1 of batch leaf "
                     r"argument 1 \('x'\), shape \(3, 8, 4\)\) is not divisible by "
                     r"num_micro_batches=3"):
    jaxaccum.value_and_grad(seq_loss, num_micro_batches=3, batch_argnums=(1, 2),
                            batch_axis=1)(PARAMS, x, y)


def test_entry_that_is_not_a_prefix_names_the_argument():
  x, y, _ = _data()
  with pytest.raises(ValueError, match=r"gives the batch argument 1 \('x'\) the entry "
                     r"\{'x': 1\}, which is not a pytree prefix of the argument"):
    _vg(batch_axis=({"x": 1}, 1))(PARAMS, x, y)


def test_concat_aux_without_rows_along_the_axis():
  x, y, _ = _data()

  def loss(params, x, y):
    return seq_loss(params, x, y), jnp.zeros((T, 5))

  with pytest.raises(ValueError, match=r"aux leaf \(root\) has shape \(3, 5\), but aux_reduce "
                     r"'concat' puts per-example rows back in batch order along the batch axis "
                     r"\(batch_axis=1\), so its axis 1 must be the micro-batch's 2 rows, not 5"):
    jaxaccum.value_and_grad(loss, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=1,
                            has_aux=True, aux_reduce="concat")(PARAMS, x, y)

  def loss_vec(params, x, y):
    return seq_loss(params, x, y), jnp.zeros((2,))

  with pytest.raises(ValueError, match=r"batch_axis=1, which is out of range for its rank 1"):
    jaxaccum.value_and_grad(loss_vec, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=1,
                            has_aux=True, aux_reduce="concat")(PARAMS, x, y)


def test_split_sharding_error_names_the_axis():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  x, y, _ = _data(b=16)
  with jax.set_mesh(mesh):
    xs, ys = _sharded(x, y)
    with pytest.raises(ValueError, match=r"batch leaf argument 1 \('x'\) has its batch axis "
                       r"\(axis 1\) of 16 rows sharded over 'data' \(size 8\)"):
      jax.jit(_vg(batch_axis=1))(PARAMS, xs, ys)


def test_split_and_merge_errors():
  x, _, _ = _data()
  with pytest.raises(ValueError, match=r"batch_axis=3 is out of range for batch leaf batch of "
                     r"shape \(3, 8, 4\)"):
    jaxaccum.split_micro_batches(x, num_micro_batches=2, batch_axis=3)
  with pytest.raises(TypeError, match=r"batch_axis must be an int or a pytree prefix of batch "
                     r"with an int at each leaf .* got batch_axis='time'"):
    jaxaccum.split_micro_batches(x, num_micro_batches=2, batch_axis="time")
  with pytest.raises(ValueError, match=r"batch size 8 \(the size of batch_axis=1 .*\) is not "
                     r"divisible by num_micro_batches=3"):
    jaxaccum.split_micro_batches(x, num_micro_batches=3, batch_axis=1)
  with pytest.raises(ValueError, match=r"stacked leaves must share their \(num_micro_batches, "
                     r"micro_batch_size\) sizes \(axis 0 and batch_axis=1\), got \(2, 4\) and "
                     r"\(2, 3\)"):
    jaxaccum.merge_micro_batches({"a": jnp.zeros((2, 3, 4)), "b": jnp.zeros((2, 4, 3))},
                                 batch_axis=1)
  with pytest.raises(ValueError, match=r"batch_axis=2 is out of range for batch leaf stacked"):
    jaxaccum.merge_micro_batches(jnp.zeros((2, 3, 4)), batch_axis=2)


def test_concat_aux_with_a_tuple_of_equal_axes_comes_back_along_that_axis():
  # batch_axis=(1, 1) names axis 1 for every batch argument: "concat" rows come back along
  # axis 1, as with batch_axis=1 (the axis that the entries agree on, not axis 0).
  x, y, _ = _data(9)

  def loss(params, x, y):
    pred = x @ params["w"] + params["b"]  # (T, b): rows along axis 1
    return jnp.mean((pred - y) ** 2), {"pred": pred, "residual": pred - y}

  (value, aux), grads = jax.jit(jaxaccum.value_and_grad(
      loss, num_micro_batches=N, batch_argnums=(1, 2), batch_axis=(1, 1), has_aux=True,
      aux_reduce="concat"))(PARAMS, x, y)
  want = jax.jit(jax.value_and_grad(loss, has_aux=True))(PARAMS, x, y)
  close(((value, aux), grads), want)
  assert aux["pred"].shape == (T, B)
  # By hand: micro-batch i holds columns i, i + N, ..., and so does its aux in the result.
  for i in range(N):
    (_, part), _ = jax.value_and_grad(loss, has_aux=True)(PARAMS, x[:, i::N], y[:, i::N])
    close(jax.tree.map(lambda a, i=i: a[:, i::N], aux), part)
