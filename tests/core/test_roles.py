"""Defects of the core's input handling, each checked against an independent reference.

References: the full batch through plain ``jax.value_and_grad`` (or ``eqx``/``nnx``'s own
transforms), and a loop over micro-batches sliced by hand (``x[i::N]``). Error cases check
that the message names the argument, the value and the fix.
"""

import functools
import inspect
import re
import warnings

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxaccum


def mse(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def data(b=8, d=3, seed=0):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (b, d)), jax.random.normal(ky, (b,))


mse_value_and_grad = jax.jit(jax.value_and_grad(mse))  # plain jax


def hand_loop(fun, w, x, y, n):
  """The mean over micro-batches ``x[i::n]`` (sliced on the host) of
  ``jax.value_and_grad(fun)``."""
  x, y, vg = np.asarray(x), np.asarray(y), jax.jit(jax.value_and_grad(fun))
  outs = [vg(w, x[i::n], y[i::n]) for i in range(n)]
  return jax.tree.map(lambda *v: sum(v) / n, *outs)


# --- skip_nonfinite under jax_enable_x64 -----------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_skip_nonfinite_tests_float64_in_float64(jit):
  with jax.enable_x64(True):
    x, y = (np.asarray(v, np.float64) for v in data())
    w = jnp.ones(3, jnp.float64)
    x, y = jnp.asarray(x * 1e25), jnp.asarray(y * 1e25)  # squares near 1e50: finite in f64

    step = jaxaccum.value_and_grad(mse, num_micro_batches=4, batch_argnums=(1, 2),
                                   skip_nonfinite=True, with_info=True)
    step = jax.jit(step) if jit else step
    loss, grads, info = step(w, x, y)
    ref_loss, ref_grads = mse_value_and_grad(w, x, y)
    assert loss.dtype == jnp.float64 and float(ref_loss) > 3.5e38
    assert int(info.skipped) == 0
    chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-10)

    # A NaN in micro-batch 1 (rows 1, 5) is still skipped, in float64 too.
    x_bad = np.array(x)
    x_bad[1] = np.nan
    loss, grads, info = step(w, jnp.asarray(x_bad), y)
    keep = np.array([r % 4 != 1 for r in range(8)])
    ref_loss, ref_grads = mse_value_and_grad(w, np.asarray(x)[keep], np.asarray(y)[keep])
    assert int(info.skipped) == 1
    chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-10)


def test_shared_statistics_test_each_leaf_in_its_own_dtype():
  from jaxaccum._core import _stats

  with jax.enable_x64(True):
    big = jnp.array([1e300, -1e300], jnp.float64)
    assert bool(_stats.all_finite({"a": big, "i": jnp.arange(3)}))
    assert not bool(_stats.all_finite({"a": big.at[0].set(jnp.inf), "b": jnp.ones(2)}))
  assert not bool(_stats.all_finite((jnp.ones(2), jnp.array([jnp.nan], jnp.bfloat16))))
  chex.assert_trees_all_close(
      _stats.sq_norm({"a": jnp.array([3.0]), "c": jnp.array([4.0], jnp.bfloat16),
                      "i": jnp.arange(3)}), jnp.float32(25.0))


# --- A dict reduce must name every term fun returns --------------------------------------


def test_dict_reduce_raises_on_a_term_it_does_not_name():
  def fun(w, x):
    return {"ce": jnp.mean(x * w), "z": jnp.mean(x * w) ** 2}

  step = jaxaccum.value_and_grad(fun, num_micro_batches=2, reduce={"ce": "mean"})
  with pytest.raises(TypeError, match=re.escape(
      "fun returned loss term 'z', which reduce={'ce': 'mean'} does not name")) as e:
    jax.jit(step)(1.0, jnp.ones(4))
  assert "reduce={'ce': 'mean', 'z': ...}" in str(e.value) and "has_aux" in str(e.value)

  nested = jaxaccum.value_and_grad(
      lambda w, x: {"a": {"p": jnp.mean(x * w), "q": jnp.mean(x)}}, num_micro_batches=2,
      reduce={"a": {"p": "mean"}})
  with pytest.raises(TypeError, match=re.escape("loss term ['a']['q']")):
    nested(1.0, jnp.ones(4))


# --- Differentiated arguments must be real or complex ---------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_integer_argument_is_named_not_a_float0_error(jit):
  step = jaxaccum.value_and_grad(lambda w, x: jnp.mean(x * w), num_micro_batches=2)
  step = jax.jit(step) if jit else step
  with pytest.raises(TypeError, match=re.escape(
      "argnums names argument 0 ('w'), but its leaf (root) has dtype int32: jax.grad "
      "requires real- or complex-valued inputs")):
    step(jnp.int32(1), jnp.ones(4))
  with pytest.raises(TypeError, match=re.escape("leaf ['n'] has dtype int32")):
    jaxaccum.value_and_grad(lambda p, x: jnp.mean(x * p["w"]), num_micro_batches=2)(
        {"w": jnp.ones(()), "n": jnp.arange(2)}, jnp.ones(4))


# --- batch_argnames keeps the default batch_argnums=1 --------------------------------------


@pytest.mark.parametrize("n", [4, 8])
def test_batch_argnames_alone_still_splits_argument_1(n):
  x, y = data()
  w = jnp.arange(3.0)

  def fun(p, x, *, labels):
    return mse(p, x, labels)

  step = jax.jit(jaxaccum.value_and_grad(fun, num_micro_batches=n, batch_argnames="labels"))
  got = step(w, x, labels=y)
  chex.assert_trees_all_close(got, mse_value_and_grad(w, x, y), rtol=1e-5)
  chex.assert_trees_all_close(got, hand_loop(mse, w, x, y, n), rtol=1e-5)


def test_batch_argnums_default_is_shown_as_1():
  for fn in (jaxaccum.value_and_grad, jaxaccum.nnx.value_and_grad):
    p = inspect.signature(fn).parameters["batch_argnums"]
    assert repr(p.default) == "1" and p.default == 1, fn


def test_batch_argnames_with_only_keyword_arguments():
  x, y = data()
  w = jnp.arange(3.0)

  def fun(p, *, batch):
    return mse(p, *batch)

  got = jaxaccum.value_and_grad(fun, num_micro_batches=4, batch_argnames="batch")(
      w, batch=(x, y))
  chex.assert_trees_all_close(got, mse_value_and_grad(w, x, y), rtol=1e-5)


def test_empty_batch_argnums_with_batch_argnames_splits_none_positionally():
  x, y = data()
  scale = jnp.arange(1.0, 4.0)  # argument 1, passed whole to every micro-batch

  def fun(p, s, *, xy):
    return mse(p * s, *xy)

  got = jaxaccum.value_and_grad(fun, num_micro_batches=4, batch_argnums=(),
                                batch_argnames="xy")(jnp.ones(3), scale, xy=(x, y))
  ref = jax.jit(jax.value_and_grad(lambda p: mse(p * scale, x, y)))(jnp.ones(3))
  chex.assert_trees_all_close(got, ref, rtol=1e-5)


def test_adapters_keep_splitting_argument_1_with_batch_argnames():
  x, y = data()
  lin = eqx.nn.Linear(3, 1, key=jax.random.key(1))

  def eqx_loss(model, x, *, labels):
    return jnp.mean((jax.vmap(model)(x)[:, 0] - labels) ** 2)

  got = eqx.filter_jit(jaxaccum.eqx.filter_value_and_grad(
      eqx_loss, num_micro_batches=8, batch_argnames="labels"))(lin, x, labels=y)
  ref = eqx.filter_jit(eqx.filter_value_and_grad(eqx_loss))(lin, x, labels=y)
  chex.assert_trees_all_close(got, ref, rtol=1e-5)

  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

  def nnx_loss(model, x, *, labels):
    return jnp.mean((model(x)[:, 0] - labels) ** 2)

  ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(lambda m: nnx_loss(m, x, labels=y)))(model)
  loss, grads = jaxaccum.nnx.value_and_grad(
      nnx_loss, num_micro_batches=8, batch_argnames="labels")(model, x, labels=y)
  chex.assert_trees_all_close((loss, nnx.to_pure_dict(grads)),
                              (ref_loss, nnx.to_pure_dict(ref_grads)), rtol=1e-5)

  def nnx_kw_only(model, *, batch):
    return nnx_loss(model, batch[0], labels=batch[1])

  loss, grads = jaxaccum.nnx.value_and_grad(
      nnx_kw_only, num_micro_batches=4, batch_argnames="batch")(model, batch=(x, y))
  chex.assert_trees_all_close((loss, nnx.to_pure_dict(grads)),
                              (ref_loss, nnx.to_pure_dict(ref_grads)), rtol=1e-5)


# --- None batch arguments, as jax.vmap accepts them ----------------------------------------


def test_none_batch_argument_is_passed_as_none():
  x, y = data()
  w = jnp.arange(3.0)

  def fun(p, xy, position):
    assert position is None
    return mse(p, *xy)

  got = jax.jit(jaxaccum.value_and_grad(fun, num_micro_batches=4, batch_argnums=(1, 2)))(
      w, (x, y), None)
  chex.assert_trees_all_close(got, mse_value_and_grad(w, x, y), rtol=1e-5)

  def fun_tree(p, batch):
    assert batch["mask"] is None and batch["pos"] == (None,)
    return mse(p, batch["x"], batch["y"])

  got = jaxaccum.value_and_grad(fun_tree, num_micro_batches=4)(
      w, {"x": x, "y": y, "mask": None, "pos": (None,)})
  chex.assert_trees_all_close(got, mse_value_and_grad(w, x, y), rtol=1e-5)

  def fun_kw(p, xy, *, position=0):
    assert position is None
    return mse(p, *xy)

  got = jaxaccum.value_and_grad(fun_kw, num_micro_batches=4, batch_argnames="position")(
      w, (x, y), position=None)
  chex.assert_trees_all_close(got, mse_value_and_grad(w, x, y), rtol=1e-5)


# --- An array with the batch's rows that is not split --------------------------------------


def test_closed_over_batch_sized_array_warns_once():
  x, y = data()
  w = jnp.arange(3.0)

  def closes_over_y(p, x):
    return mse(p, x, y)

  step = jaxaccum.value_and_grad(closes_over_y, num_micro_batches=8)
  with pytest.warns(jaxaccum.BatchBroadcastWarning, match=re.escape(
      "an array of shape (8,) that fun closes over has the batch's 8 rows")) as record:
    jax.jit(step)(w, x)
  assert len(record) == 1 and "batch_argnums" in str(record[0].message)
  with pytest.warns(jaxaccum.BatchBroadcastWarning):
    step(w, x)  # eagerly, where the closed-over array is a constant


def test_non_batch_argument_with_batch_rows_warns_naming_it():
  x, y = data()
  step = jaxaccum.value_and_grad(mse, num_micro_batches=8)
  with pytest.warns(jaxaccum.BatchBroadcastWarning, match=re.escape(
      "argument 2 ('y'), an array of shape (8,), has the batch's 8 rows")) as record:
    jax.jit(step)(jnp.arange(3.0), x, y)
  assert "batch_argnums=(1, 2)" in str(record[0].message)


def test_a_batch_sized_constant_does_not_warn_when_micro_batches_have_several_rows():
  """A (B, B) constant (e.g. a causal mask whose length equals the batch) with micro-batches
  of 4 rows: no silent broadcast can happen, so no warning, and the numbers are right."""
  x, y = data()
  b = x.shape[0]
  mask = jnp.tril(jnp.ones((b, b)))

  def fun(p, x, y):
    return mse(p, x, y) + jnp.sum(mask) * 1e-3 * jnp.sum(p)

  step = jaxaccum.value_and_grad(fun, num_micro_batches=2, batch_argnums=(1, 2))
  w = jnp.arange(3.0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    loss, grads = jax.jit(step)(w, x, y)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(fun))(w, x, y)
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-6)


def test_parameters_state_and_unused_arrays_of_batch_size_do_not_warn():
  x, _ = data()
  b = x.shape[0]
  w = {"square": jax.random.normal(jax.random.key(2), (b, b)) / b,
       "table": jax.random.normal(jax.random.key(3), (b, 3)), "out": jnp.ones((3, b))}
  unused = jnp.ones(b)

  def fun(p, x, state, unused):
    del unused
    h = jnp.tanh(x @ p["out"] @ p["square"]) @ p["table"] + state
    return jnp.mean(h ** 2), state + 1

  step = jaxaccum.value_and_grad(fun, num_micro_batches=8, state_argnums=2)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    (loss, _), grads = jax.jit(step)(w, x, jnp.zeros((b, 1, 1)), unused)
  ref_loss = 0.0
  ref_grads = jax.tree.map(jnp.zeros_like, w)
  state, rows = jnp.zeros((b, 1, 1)), np.asarray(x)
  micro_vg = jax.jit(jax.value_and_grad(fun, has_aux=True))
  for i in range(8):
    (v, state), g = micro_vg(w, rows[i::8], state, unused)
    ref_loss += v / 8
    ref_grads = jax.tree.map(lambda a, c: a + c / 8, ref_grads, g)
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-6)


# --- Clearer errors --------------------------------------------------------------------------


@pytest.mark.parametrize("keys", [jax.random.split(jax.random.key(0), 4),
                                  jnp.zeros((4, 2), jnp.uint32)])
def test_per_example_keys_point_to_batch_argnums(keys):
  step = jaxaccum.value_and_grad(lambda w, x, k: jnp.mean(x * w), num_micro_batches=2,
                                 rng_argnums=2)
  with pytest.raises(TypeError, match=re.escape(
      "leading axis of size 4 is the batch's: per-example keys are per-example data. Pass "
      "them as a batch argument (batch_argnums=(1, 2)) instead of rng_argnums")):
    step(1.0, jnp.ones(4), keys)


def test_no_positional_arguments_gives_no_negative_range():
  step = jaxaccum.value_and_grad(lambda *a, **k: 1.0, num_micro_batches=2)
  with pytest.raises(ValueError, match="called with no positional arguments") as e:
    step()
  assert "0..-1" not in str(e.value)


def eqx_bn():
  return eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")


def eqx_bn_loss(model, x, state):
  y, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
      x, state)
  return jnp.mean(y ** 2), state


def test_equinox_state_without_state_argnums_names_it():
  model, state = eqx_bn()
  x = jnp.arange(24.0).reshape(8, 3)
  step = jaxaccum.eqx.filter_value_and_grad(eqx_bn_loss, num_micro_batches=2)
  with pytest.raises(TypeError, match=re.escape(
      "fun returned an eqx.nn.State, but state_argnums is not set: pass the position of "
      "the state argument, state_argnums=2")) as e:
    step(model, x, state)
  assert "(value, new_state)" in str(e.value)

  def with_aux(model, x, state):
    loss, state = eqx_bn_loss(model, x, state)
    return loss, (state, {"n": jnp.float32(1)})

  step = jaxaccum.eqx.filter_value_and_grad(with_aux, num_micro_batches=2, has_aux=True)
  with pytest.raises(TypeError, match=re.escape("state_argnums=2")) as e:
    step(model, x, state)
  assert "(value, (new_state, aux))" in str(e.value)


def test_state_and_has_aux_message_names_the_return_shape():
  model, state = eqx_bn()
  x = jnp.arange(24.0).reshape(8, 3)
  step = jaxaccum.eqx.filter_value_and_grad(eqx_bn_loss, num_micro_batches=2, has_aux=True,
                                            state_argnums=2)
  with pytest.raises(TypeError, match=re.escape(
      "fun must return (value, (new_state, aux)), got (value, State)")) as e:
    step(model, x, state)
  assert "drop has_aux=True" in str(e.value)


def test_nnx_loss_closing_over_the_batch_names_the_closure():
  x = jnp.ones((8, 3))
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="closes over the batch") as e:
    jaxaccum.nnx.value_and_grad(lambda model: jnp.mean(model(x)), num_micro_batches=2)
  assert "fun(model, batch)" in str(e.value)

  def loss(model, rngs):
    return jnp.mean(model(x))

  step = jaxaccum.nnx.value_and_grad(loss, num_micro_batches=2)
  with pytest.raises(TypeError, match="closes over the batch") as e:
    step(model, nnx.Rngs(1))
  assert "named by batch_argnums" not in str(e.value)
  assert "the second argument (rngs) is the batch by default (batch_argnums=1)" in str(e.value)


def row_keyed(w, x, k):
  """Each row scaled by a uniform drawn from its own raw key (rows of ``k``)."""
  return jnp.mean(jnp.sum(x * w, -1) * jax.vmap(jax.random.uniform)(k))


@pytest.mark.parametrize("dtype", [jnp.uint32, jnp.float32])
def test_rng_argnums_check_reads_only_metadata_of_sharded_arrays(dtype):
  # A 2-D leaf with the batch's rows is tested for rows of keys; on an Explicit mesh,
  # outside jit, indexing its first row is a gather that JAX refuses to shard.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  x, _ = data(16, 3)
  w = jnp.arange(3.0)
  keys = jax.random.key_data(jax.random.split(jax.random.key(1), 16))
  x, keys = jax.device_put((x, keys.astype(dtype)), rows)
  step = jaxaccum.value_and_grad(row_keyed, num_micro_batches=2, rng_argnums=2)
  hint = ("Its leading axis of size 16 is the batch's: per-example keys are per-example "
          "data. Pass them as a batch argument (batch_argnums=(1, 2))"
          if dtype == jnp.uint32 else "Pass one key from jax.random.key(seed)")
  with pytest.raises(TypeError, match=re.escape(
      f"rng_argnums names argument 2 ('k'), but its leaf (root) is an array of shape (16, 2) "
      f"and dtype {np.dtype(dtype)}, not a single PRNG key. {hint}")):
    step(w, x, keys)
  if dtype == jnp.uint32:  # the fix the message gives: the keys are split with the batch
    step = jaxaccum.value_and_grad(row_keyed, num_micro_batches=2, batch_argnums=(1, 2))
    ref = jax.jit(jax.value_and_grad(row_keyed))(w, np.asarray(x), np.asarray(keys))  # unsharded
    chex.assert_trees_all_close(jax.jit(step)(w, x, keys), ref, rtol=1e-5, atol=1e-6)
