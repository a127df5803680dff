"""Aux reductions: what each kind gives back, checked against the full batch and by-hand loops.

Each test here failed on the code before its fix: a (b*T,) or (T,) leaf under "concat"
came back interleaved; a bool aux came back summed as int32.
"""

import re

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxaccum

N = 4


def _data(rows=8, tokens=3):
  x = jax.random.normal(jax.random.key(0), (rows, tokens, 2))
  y = jax.random.normal(jax.random.key(1), (rows, tokens))
  return jnp.array([0.5, -1.0]), (x, y)


def _per_token(w, batch):
  x, y = batch
  return (x @ w - y) ** 2  # (rows, tokens)


@pytest.mark.parametrize(("leaf", "shape"), [
    (lambda t: t.reshape(-1), (6,)),  # per-token values flattened to (rows * tokens,)
    (lambda t: t.mean(0), (3,)),  # one value per token position
])
def test_concat_of_a_leaf_without_the_rows_axis_is_rejected(leaf, shape):
  def loss(w, batch):
    t = _per_token(w, batch)
    return jnp.mean(t), {"tok": leaf(t)}

  step = jaxaccum.value_and_grad(loss, num_micro_batches=N, has_aux=True,
                                 aux_reduce={"tok": "concat"})
  w, batch = _data()
  msg = (rf"aux leaf \['tok'\] has shape {re.escape(str(shape))}.*micro-batch's 2 rows"
         r".*'stack'")
  with pytest.raises(ValueError, match=msg):
    step(w, batch)


def test_concat_of_rows_first_leaves_is_the_full_batch():
  def loss(w, batch):
    t = _per_token(w, batch)
    return jnp.mean(t), {"tok": t, "row": t.sum(1)}

  w, batch = _data()
  step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, has_aux=True,
                                         aux_reduce="concat"))
  chex.assert_trees_all_close(step(w, batch), jax.value_and_grad(loss, has_aux=True)(w, batch),
                              rtol=1e-6)


# --- Boolean aux: "all" (the default for a bool scalar) and "any" ----------------------------


def _flags_loss(w, batch):
  x, y = batch
  err = (x @ w - y) ** 2
  return jnp.mean(err), {
      "finite": jnp.all(jnp.isfinite(err)),  # bool scalar: default "all"
      "not_big": ~jnp.any(y > 1.5),  # bool scalar: default "all"
      "big": jnp.any(y > 1.5),  # bool scalar, named "any"
      "rows": jnp.int32(x.shape[0]),  # int scalar: still summed
  }


BOOL_SPEC = {"finite": None, "not_big": None, "big": "any", "rows": None}


def _flag_data(n=N, rows_per=2, big_in=None):
  """(x, y) with rows_per * n rows; y > 1.5 only in row big_in (of micro-batch big_in and,
  under data_axis, of shard 0)."""
  x = jax.random.normal(jax.random.key(2), (n * rows_per, 2))
  y = jnp.linspace(-1.0, 1.0, n * rows_per)
  if big_in is not None:
    y = y.at[big_in].set(2.0)
  return jnp.array([0.3, 0.7]), (x, y)


def _hand_loop(w, batch, micro_batches, n=N):
  """The documented rules over the listed micro-batches, each sliced by hand (x[i::n])."""
  outs = [jax.value_and_grad(_flags_loss, has_aux=True)(w, tuple(a[i::n] for a in batch))
          for i in micro_batches]
  k = len(outs)
  value = sum(o[0][0] for o in outs) / k
  grads = sum(o[1] for o in outs) / k
  auxs = [o[0][1] for o in outs]
  aux = {
      "finite": jnp.array(all(bool(a["finite"]) for a in auxs)),
      "not_big": jnp.array(all(bool(a["not_big"]) for a in auxs)),
      "big": jnp.array(any(bool(a["big"]) for a in auxs)),
      "rows": jnp.int32(sum(int(a["rows"]) for a in auxs)),
  }
  return (value, aux), grads


def _assert_bool_aux(out, ref):
  chex.assert_trees_all_close(out, ref, rtol=1e-6)
  for key in ("finite", "not_big", "big"):
    assert out[0][1][key].dtype == jnp.bool_, (key, out[0][1][key].dtype)
  assert out[0][1]["rows"].dtype == jnp.int32


@pytest.mark.parametrize("big_in", [None, 2])
def test_bool_aux_comes_back_a_bool_equal_to_the_full_batch(big_in):
  w, batch = _flag_data(big_in=big_in)
  step = jax.jit(jaxaccum.value_and_grad(_flags_loss, num_micro_batches=N, has_aux=True,
                                         aux_reduce=BOOL_SPEC))
  out = step(w, batch)
  _assert_bool_aux(out, jax.value_and_grad(_flags_loss, has_aux=True)(w, batch))
  _assert_bool_aux(out, _hand_loop(w, batch, range(N)))


def test_all_and_any_named_on_a_bool_array_are_elementwise_over_micro_batches():
  def loss(w, batch):
    x, y = batch
    return jnp.mean((x @ w - y) ** 2), {"all": x[:2] > 0, "any": x[:2] > 0}

  w, batch = _flag_data()
  step = jaxaccum.value_and_grad(loss, num_micro_batches=N, has_aux=True,
                                 aux_reduce={"all": "all", "any": "any"})
  (_, aux), _ = step(w, batch)
  per = [batch[0][i::N][:2] > 0 for i in range(N)]
  chex.assert_trees_all_equal(aux, {"all": jnp.all(jnp.stack(per), 0),
                                    "any": jnp.any(jnp.stack(per), 0)})


def test_skipped_micro_batches_do_not_count_in_all_and_any():
  w, (x, y) = _flag_data(big_in=1)
  x = x.at[1].set(jnp.nan)  # row 1 is in micro-batch 1, the only one with y > 1.5
  step = jax.jit(jaxaccum.value_and_grad(_flags_loss, num_micro_batches=N, has_aux=True,
                                         aux_reduce=BOOL_SPEC, skip_nonfinite=True))
  # Micro-batch 1 is dropped: "finite" is all True over the others, "big" no longer seen.
  _assert_bool_aux(step(w, (x, y)), _hand_loop(w, (x, y), (0, 2, 3)))


def test_inactive_micro_batches_do_not_count_in_all_and_any():
  w, batch = _flag_data(big_in=3)
  vg = jaxaccum.value_and_grad(_flags_loss, num_micro_batches=N, has_aux=True,
                               aux_reduce=BOOL_SPEC)
  step = jax.jit(lambda w, b, k: vg(w, b, active_micro_batches=k))
  for k in (2, 4):
    _assert_bool_aux(step(w, batch, jnp.int32(k)), _hand_loop(w, batch, range(k)))


@pytest.mark.parametrize("big_in", [None, 1])
def test_bool_aux_under_data_axis_is_and_or_across_shards(big_in):
  from jax.sharding import AxisType, PartitionSpec as P  # noqa: I001

  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  w, batch = _flag_data(rows_per=16, big_in=big_in)  # 64 rows: 8 shards x 4 x 2 rows
  with jax.set_mesh(mesh):
    b = jax.device_put(batch, jax.NamedSharding(mesh, P("data")))
    step = jax.jit(jaxaccum.value_and_grad(_flags_loss, num_micro_batches=N, has_aux=True,
                                           aux_reduce=BOOL_SPEC, data_axis="data"))
    out = step(w, b)
  ref = jax.value_and_grad(_flags_loss, has_aux=True)(w, batch)
  _assert_bool_aux(jax.tree.map(jax.device_get, out), ref)


def test_all_and_any_take_only_booleans():
  def loss(w, batch):
    x, y = batch
    return jnp.mean((x @ w - y) ** 2), {"count": jnp.sum(y > 0)}

  w, batch = _flag_data()
  step = jaxaccum.value_and_grad(loss, num_micro_batches=N, has_aux=True,
                                 aux_reduce={"count": "any"})
  with pytest.raises(TypeError, match=r"aux leaf \['count'\] has dtype int32.*'any' is a "
                     r"logical reduction of booleans.*x != 0"):
    step(w, batch)


# --- How aux means are weighted under a dict reduce -----------------------------------------


@pytest.mark.parametrize("terms", ["one_weighted", "two_weighted"])
def test_aux_means_weigh_by_the_one_weighted_term_else_plain_means(terms):
  x = jax.random.normal(jax.random.key(3), (8, 2))
  m1 = jnp.array([1.0, 1, 1, 1, 1, 0, 0, 0])  # micro-batches i::4 hold 2, 1, 1, 1 of them
  m2 = jnp.array([1.0, 0, 1, 1, 0, 1, 1, 1])

  def loss(w, batch):
    x, m1, m2 = batch
    err = (x @ w) ** 2
    value = {"a": (jnp.sum(err * m1), jnp.sum(m1)), "l2": jnp.sum(w ** 2)}
    if terms == "two_weighted":
      value["b"] = (jnp.sum(err * m2), jnp.sum(m2))
    return value, {"acc": jnp.mean(x[:, 0])}

  reduce = {"a": "weighted", "l2": "mean"}
  if terms == "two_weighted":
    reduce["b"] = "weighted"
  step = jaxaccum.value_and_grad(loss, num_micro_batches=N, has_aux=True, reduce=reduce)
  (_, aux), _ = step(jnp.array([0.3, -0.2]), (x, m1, m2))
  per = jnp.stack([jnp.mean(x[i::N, 0]) for i in range(N)])
  dens = jnp.stack([jnp.sum(m1[i::N]) for i in range(N)])
  expected = (jnp.sum(per * dens) / jnp.sum(dens) if terms == "one_weighted"
              else jnp.mean(per))
  chex.assert_trees_all_close(aux["acc"], expected, rtol=1e-6)
