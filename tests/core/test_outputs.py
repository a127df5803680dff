"""Real train steps drop in: per-example aux, keyword batches, default aux rules, clear errors."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum

B, D, C = 24, 5, 3


def _problem(seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  params = {"w": jax.random.normal(k1, (D, C)) * 0.5, "b": jnp.zeros(C)}
  x = jax.random.normal(k2, (B, D))
  y = jax.random.randint(k3, (B,), 0, C)
  return params, x, y


def classifier(params, x, y):
  logits = x @ params["w"] + params["b"]
  logp = jax.nn.log_softmax(logits)
  loss = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
  correct = jnp.sum(jnp.argmax(logits, -1) == y)
  return loss, {"logits": logits, "correct": correct, "acc": jnp.mean(jnp.argmax(logits, -1) == y)}


@pytest.mark.parametrize("n", [1, 4, 24])
def test_concat_aux_equals_full_batch_aux(n):
  params, x, y = _problem()
  ref = jax.jit(jax.value_and_grad(classifier, has_aux=True))(params, x, y)
  step = jax.jit(jaxaccum.value_and_grad(
      classifier, num_micro_batches=n, has_aux=True, batch_argnums=(1, 2),
      aux_reduce={"logits": "concat", "correct": None, "acc": None}))
  (loss, aux), grads = step(params, x, y)
  (ref_loss, ref_aux), ref_grads = ref
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-6)
  chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
  # Per-example rows in the batch's order, equal to the full batch's.
  chex.assert_trees_all_close(aux["logits"], ref_aux["logits"], rtol=1e-6, atol=1e-6)
  # An integer count sums to the full batch's count (not the mean of per-micro-batch counts).
  assert aux["correct"].dtype == jnp.int32
  assert int(aux["correct"]) == int(ref_aux["correct"])
  chex.assert_trees_all_close(aux["acc"], ref_aux["acc"], rtol=1e-6)


def test_concat_rows_follow_the_column_major_split():
  # Row r of micro-batch i is row r * N + i: the concatenated rows must be the batch's.
  x = jnp.arange(12.0)

  def fun(w, x):
    return jnp.mean(w * x), {"rows": x, "first": x[0]}

  (_, aux), _ = jaxaccum.value_and_grad(
      fun, num_micro_batches=3, has_aux=True,
      aux_reduce={"rows": "concat", "first": "stack"})(1.0, x)
  np.testing.assert_array_equal(aux["rows"], np.arange(12.0))
  np.testing.assert_array_equal(aux["first"], [0.0, 1.0, 2.0])


def test_merge_inverts_split():
  tree = {"a": jnp.arange(24.0).reshape(12, 2), "b": jnp.arange(12)}
  for n in (1, 2, 3, 12):
    stacked = jaxaccum.split_micro_batches(tree, num_micro_batches=n)
    np.testing.assert_array_equal(stacked["b"][1 % n], np.arange(12)[1 % n::n])
    chex.assert_trees_all_equal(jaxaccum.merge_micro_batches(stacked), tree)
  with pytest.raises(ValueError, match=r"stacked leaf \['x'\] has shape \(3,\); every leaf "
                     r"needs the leading axes \(num_micro_batches, micro_batch_size"):
    jaxaccum.merge_micro_batches({"x": jnp.ones(3)})
  with pytest.raises(ValueError, match="share their leading"):
    jaxaccum.merge_micro_batches({"x": jnp.ones((2, 3)), "y": jnp.ones((3, 2))})


def test_non_scalar_aux_needs_a_reduction():
  params, x, y = _problem()
  step = jaxaccum.value_and_grad(classifier, num_micro_batches=4, has_aux=True,
                                 batch_argnums=(1, 2))
  with pytest.raises(ValueError, match=re.escape(
      "aux leaf ['logits'] has shape (6, 3), and the default aux reduction only applies to "
      "scalars")) as e:
    jax.jit(step)(params, x, y)
  assert "'concat' for per-example outputs" in str(e.value)
  assert "'mean' or 'sum'" in str(e.value)


def test_scalar_defaults_sum_counts_and_average_floats():
  x = jnp.arange(8.0)

  def fun(w, x):
    return jnp.mean(w * x), {"n": jnp.sum(x > 2), "flag": jnp.any(x > 6), "m": jnp.mean(x)}

  (_, aux), _ = jaxaccum.value_and_grad(fun, num_micro_batches=4, has_aux=True)(1.0, x)
  assert int(aux["n"]) == 5  # the full batch's count: rows 3..7
  # A bool is AND-ed, as jnp.all over the micro-batches: x > 6 holds in one of four.
  assert aux["flag"].dtype == jnp.bool_ and not bool(aux["flag"])
  np.testing.assert_allclose(aux["m"], 3.5)


def test_got_tuple_names_has_aux_and_weighted():
  params, x, y = _problem()
  step = jaxaccum.value_and_grad(classifier, num_micro_batches=4, batch_argnums=(1, 2))
  with pytest.raises(TypeError, match=re.escape(
      "It is a tuple of 2: if fun returns (loss, aux), pass has_aux=True; if it returns "
      "(numerator, denominator) such as (summed token loss, token count), pass "
      "reduce='weighted'.")):
    step(params, x, y)


def test_batch_by_keyword():
  params, x, y = _problem()

  def loss_kw(params, batch):
    return classifier(params, batch["x"], batch["y"])[0]

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_kw))(params, {"x": x, "y": y})
  step = jax.jit(jaxaccum.value_and_grad(loss_kw, num_micro_batches=4, batch_argnames="batch"))
  loss, grads = step(params, batch={"x": x, "y": y})
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-7)

  # Labels by keyword, inputs positionally; a keyword not named is passed whole.
  def loss_labels(params, x, *, labels, scale):
    return classifier(params, x, labels)[0] * scale

  ref = jax.jit(jax.value_and_grad(loss_labels), static_argnames="scale")(
      params, x, labels=y, scale=2.0)
  step = jax.jit(jaxaccum.value_and_grad(loss_labels, num_micro_batches=3, batch_argnums=1,
                                         batch_argnames=("labels",)))
  chex.assert_trees_all_close(step(params, x, labels=y, scale=2.0), ref, rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match=r"batch_argnames=\('labels',\) names keyword "
                     r"argument\(s\) \['labels'\], but the function was called with keyword "
                     r"arguments \['scale'\]"):
    step(params, x, y, scale=2.0)


def test_out_of_range_batch_argnums_names_the_causes():
  params, x, y = _problem()

  def closes_over(params):
    return classifier(params, x, y)[0]

  with pytest.raises(ValueError, match=re.escape(
      "batch_argnums=1 is out of range: the function was called with 1 positional "
      "argument(s), so valid indices are 0..0. The two usual causes: the loss closes over the "
      "batch")) as e:
    jaxaccum.value_and_grad(closes_over, num_micro_batches=2)(params)
  assert "batch_argnames='batch'" in str(e.value)


def test_smaller_items():
  params, x, y = _problem()
  # A string in aux is named, with the fix.
  with pytest.raises(TypeError,
                     match=r"aux leaf \['tag'\] is str 'hello', not an array: every leaf"):
    jaxaccum.value_and_grad(lambda p, x: (jnp.mean(x @ p["w"]), {"tag": "hello"}),
                            num_micro_batches=2, has_aux=True)(params, x)
  # numpy integers are accepted for unroll, as for the counts.
  vg = jaxaccum.value_and_grad(lambda p, x: jnp.mean(x @ p["w"]),
                               num_micro_batches=np.int64(4), unroll=np.int64(2))
  ref = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(x @ p["w"])))(params, x)
  chex.assert_trees_all_close(vg(params, x), ref, rtol=1e-5, atol=1e-7)
  # A Python int denominator, such as x.shape[0], is accepted under reduce="weighted".
  vg = jaxaccum.value_and_grad(lambda p, x: (jnp.sum(jnp.mean(x @ p["w"], -1)), x.shape[0]),
                               num_micro_batches=4, reduce="weighted")
  chex.assert_trees_all_close(vg(params, x), ref, rtol=1e-5, atol=1e-7)
  # B = 0 with micro_batch_size gives a clear error, not a ZeroDivisionError.
  with pytest.raises(ValueError, match="batch size 0"):
    jaxaccum.value_and_grad(lambda p, x: jnp.mean(x @ p["w"]),
                            micro_batch_size=2)(params, jnp.ones((0, D)))
