"""``per_example=``: each example's gradient transformed before the mean.

The reference is a Python loop over the rows: ``jax.grad`` of ``fun`` on ``x[j:j+1]`` for
every row ``j``, the transform applied, then the mean (or sum). It never goes through the
library's split or vmap, so a wrong row order, a transform applied to a micro-batch's sum
instead of each example, or a wrong divisor all show. Also translated: optax's
``test_micro_grad_basic`` and ``test_micro_grad_early_stopping``
(``optax/microbatching/_microbatching_test.py``).
"""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum
from tests import _problems

B, D, H = 16, _problems.TANH_D, _problems.TANH_H


_pred, mean_loss = _problems.tanh_pred, _problems.tanh_mean_loss


def _problem(seed=0):
  return _problems.tanh_problem(seed, B)


def sum_loss(p, batch):
  x, y = batch
  return jnp.sum((_pred(p, x) - y) ** 2)


@functools.cache
def _jgrad(fun):
  """``jax.grad(fun)``, jitted once per function: the reference loops call it per row."""
  return jax.jit(jax.grad(fun))


def _rows(batch, j):
  """Row ``j`` alone, sliced on the host (not an eagerly compiled slice per row)."""
  return jax.tree.map(lambda a: np.asarray(a)[j:j + 1], batch)


def _loop(fun, params, batch, transform, *, mean=True):
  """Per-example reference: grad of fun on each row alone, transformed, then mean or sum."""
  grads = [transform(_jgrad(fun)(params, _rows(batch, j))) for j in range(B)]
  total = jax.tree.map(lambda *g: sum(g), *grads)
  return jax.tree.map(lambda g: g / B, total) if mean else total


def _norm(tree):
  return float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(tree))))


# method="materialize": each example's gradient formed, as any transform's is; the other
# methods of clip_per_example run the same options in tests/per_example/test_dp.py.
CLIP = jaxaccum.dp.clip_per_example(0.5, "materialize")
CLIP_JIT = jax.jit(CLIP)  # the same transform for the references' per-row loops


@pytest.mark.parametrize("n", [1, 4, 16])
def test_mean_matches_the_per_example_loop(n):
  params, batch = _problem()
  step = jax.jit(jaxaccum.dp.per_example_value_and_grad(mean_loss, CLIP, num_micro_batches=n))
  loss, grads = step(params, batch)
  chex.assert_trees_all_close(grads, _loop(mean_loss, params, batch, CLIP_JIT), rtol=1e-5,
                              atol=1e-6)
  # The loss is what value_and_grad returns without the transform.
  chex.assert_trees_all_close(loss, mean_loss(params, batch), rtol=1e-6)
  # The clip did something: the unclipped mean is different.
  plain = jax.grad(mean_loss)(params, batch)
  assert _norm(jax.tree.map(jnp.subtract, grads, plain)) > 0.1 * _norm(plain)


def test_sum_matches_the_per_example_loop_and_grad_drops_the_value():
  params, batch = _problem(1)
  step = jax.jit(jaxaccum.grad(sum_loss, micro_batch_size=4, reduce="sum",
                               per_example=CLIP))
  chex.assert_trees_all_close(step(params, batch),
                              _loop(sum_loss, params, batch, CLIP_JIT, mean=False),
                              rtol=1e-5, atol=1e-6)
  loss, _ = jaxaccum.dp.per_example_value_and_grad(sum_loss, CLIP, micro_batch_size=4,
                                                reduce="sum")(params, batch)
  chex.assert_trees_all_close(loss, sum_loss(params, batch), rtol=1e-6)


def test_identity_transform_equals_plain_accumulation_with_aux():
  params, batch = _problem(2)

  def fun(p, batch):
    x, y = batch
    err = _pred(p, x) - y
    return jnp.mean(err ** 2), {"abs": jnp.mean(jnp.abs(err)), "big": jnp.sum(err > 1.0),
                                "peak": jnp.max(err), "ok": jnp.all(jnp.isfinite(err)),
                                "err": err}

  red = {"abs": None, "big": None, "peak": "max", "ok": None, "err": "concat"}
  plain = jax.jit(jaxaccum.value_and_grad(fun, num_micro_batches=4, has_aux=True,
                                          aux_reduce=red))(params, batch)
  ident = jax.jit(jaxaccum.dp.per_example_value_and_grad(fun, lambda g: g, num_micro_batches=4,
                  has_aux=True,
                                          aux_reduce=red)
                  )(params, batch)
  chex.assert_trees_all_close(ident, plain, rtol=1e-5, atol=1e-6)
  (_, aux), _ = ident
  assert aux["ok"].dtype == jnp.bool_ and aux["big"].dtype == jnp.int32
  chex.assert_trees_all_close(aux["err"], _pred(params, batch[0]) - batch[1], rtol=1e-5)


def test_clip_per_example_clips_each_example_to_the_norm():
  params, batch = _problem(3)
  clipped = 0
  for j in range(B):
    g = _jgrad(mean_loss)(params, _rows(batch, j))
    norm = _norm(g)
    np.testing.assert_allclose(_norm(CLIP(g)), min(norm, 0.5), rtol=1e-5)
    if norm <= 0.5:
      chex.assert_trees_all_close(CLIP(g), g)  # under the norm: unchanged
    clipped += norm > 0.5
  assert clipped >= B - 2  # the test means something: most examples are clipped
  # Each example then contributes at most 0.5: the mean of such vectors is no longer.
  grads = jaxaccum.grad(mean_loss, num_micro_batches=2, per_example=CLIP)(
      params, batch)
  assert _norm(grads) <= 0.5 + 1e-6
  # A sum of 16 examples of norm at most 0.5 each: at most 8 (the triangle inequality).
  total = jaxaccum.grad(sum_loss, num_micro_batches=2, reduce="sum",
                        per_example=CLIP)(params, batch)
  assert _norm(total) <= 8.0 + 1e-5


def test_clip_per_example_validates_max_norm_and_keeps_nan():
  with pytest.raises(ValueError, match="max_norm must be positive, got max_norm=0"):
    jaxaccum.dp.clip_per_example(0)
  with pytest.raises(TypeError, match="max_norm must be a positive number"):
    jaxaccum.dp.clip_per_example("1")
  out = jaxaccum.dp.clip_per_example(1.0)({"a": jnp.array([jnp.nan, 1.0])})
  assert bool(jnp.isnan(out["a"][0]))
  # A traced norm (a schedule inside jit) works too.
  clipped = jax.jit(lambda c, g: jaxaccum.dp.clip_per_example(c)(g))(2.0, jnp.array([3.0, 4.0]))
  chex.assert_trees_all_close(clipped, jnp.array([1.2, 1.6]))


def test_weighted_transforms_each_numerator_gradient_and_divides_by_all_tokens():
  params, (x, y) = _problem(4)
  mask = (jnp.arange(B) % 3 != 0).astype(jnp.float32)  # rows with 0 or 1 "token"

  def fun(p, batch):
    x, y, m = batch
    err = (_pred(p, x) - y) ** 2
    return jnp.sum(err * m), jnp.sum(m), jnp.sum(err * m) / jnp.maximum(jnp.sum(m), 1)

  def loss(p, batch):
    num, den, tok = fun(p, batch)
    return (num, den), tok

  batch = (x, y, mask)
  (value, aux), grads = jax.jit(jaxaccum.dp.per_example_value_and_grad(
      loss, CLIP, num_micro_batches=4, reduce="weighted", has_aux=True)
  )(params, batch)
  num_grad = jax.jit(jax.grad(lambda p, b: fun(p, b)[0]))
  ref = [CLIP_JIT(num_grad(params, _rows(batch, j))) for j in range(B)]
  total = jax.tree.map(lambda *g: sum(g) / jnp.sum(mask), *ref)
  chex.assert_trees_all_close(grads, total, rtol=1e-5, atol=1e-6)
  num, den, _ = fun(params, batch)
  chex.assert_trees_all_close(value, num / den, rtol=1e-6)
  # The aux mean is token-weighted, as without the transform.
  chex.assert_trees_all_close(aux, num / den, rtol=1e-5)


def test_dict_terms_of_one_kind_transform_the_example_total():
  params, batch = _problem(5)

  def terms(p, batch):
    x, y = batch
    return {"mse": jnp.mean((_pred(p, x) - y) ** 2), "l1": jnp.mean(jnp.abs(_pred(p, x)))}

  def total(p, batch):
    t = terms(p, batch)
    return t["mse"] + 0.1 * t["l1"]

  loss, grads = jax.jit(jaxaccum.dp.per_example_value_and_grad(
      terms, CLIP, num_micro_batches=4, reduce=jaxaccum.Terms({"mse": "mean", "l1": "mean"},
          weights={"l1": 0.1})))(params, batch)
  chex.assert_trees_all_close(grads, _loop(total, params, batch, CLIP_JIT), rtol=1e-5,
                              atol=1e-6)
  chex.assert_trees_all_close(loss, total(params, batch), rtol=1e-6)


def test_rng_example_r_of_micro_batch_i_gets_fold_in_key_i_r():
  params, batch = _problem(6)
  key = jax.random.key(7)
  n = 4

  def noisy(p, batch, key):
    x, y = batch
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return jnp.mean((_pred(p, jnp.where(keep, x, 0.0)) - y) ** 2)

  grads = jax.jit(jaxaccum.grad(noisy, num_micro_batches=n, rng_argnums=2,
                                per_example=CLIP))(params, batch, key)
  # Row j is row r = j // n of micro-batch i = j % n.
  ref = [CLIP_JIT(_jgrad(noisy)(params, _rows(batch, j),
                              jax.random.fold_in(jax.random.fold_in(key, j % n), j // n)))
         for j in range(B)]
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *g: sum(g) / B, *ref),
                              rtol=1e-5, atol=1e-6)


def test_keyword_key_under_rng_argnames_is_folded_per_example_too():
  params, batch = _problem(8)
  key = jax.random.key(9)
  n = 4

  def noisy(p, batch, *, key):
    x, y = batch
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return jnp.mean((_pred(p, jnp.where(keep, x, 0.0)) - y) ** 2)

  grads = jax.jit(jaxaccum.grad(noisy, num_micro_batches=n, rng_argnames="key",
                                per_example=CLIP))(params, batch, key=key)
  ref = [CLIP_JIT(_jgrad(functools.partial(noisy, key=jax.random.fold_in(
      jax.random.fold_in(key, j % n), j // n)))(params, _rows(batch, j))) for j in range(B)]
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *g: sum(g) / B, *ref),
                              rtol=1e-5, atol=1e-6)


def test_time_major_batch_under_batch_axis_one_matches_the_per_example_loop():
  # x is (T, B, D): example j is x[:, j]; the per-example loop slices that axis by hand.
  params, (x, y) = _problem(10)
  xt = jnp.stack([x, 0.5 * x, -x])  # (3, B, D)

  def seq_loss(p, xt, y):
    return jnp.mean((jnp.mean(jax.vmap(_pred, (None, 0))(p, xt), axis=0) - y) ** 2)

  grads = jax.jit(jaxaccum.grad(seq_loss, num_micro_batches=4, batch_argnums=(1, 2),
                                batch_axis=(1, 0), per_example=CLIP))(params, xt, y)
  g = jax.jit(jax.grad(seq_loss))
  ref = [CLIP_JIT(g(params, xt[:, j:j + 1], y[j:j + 1])) for j in range(B)]
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *a: sum(a) / B, *ref),
                              rtol=1e-5, atol=1e-6)


def test_state_shared_by_examples_passes_and_per_example_state_is_an_error():
  params, batch = _problem(7)

  def counted(p, batch, state):
    return mean_loss(p, batch), {"step": state["step"] + 1}

  (loss, state), grads = jaxaccum.dp.per_example_value_and_grad(
      counted, CLIP, num_micro_batches=4, state_argnums=2)(
          params, batch, {"step": jnp.int32(0)})
  assert int(state["step"]) == 4  # once per micro-batch, as without the transform
  chex.assert_trees_all_close(grads, _loop(mean_loss, params, batch, CLIP_JIT), rtol=1e-5,
                              atol=1e-6)

  def stats(p, batch, state):
    return mean_loss(p, batch), {"mean": jnp.mean(batch[0], axis=0)}

  step = jaxaccum.dp.per_example_value_and_grad(stats, CLIP, num_micro_batches=4, state_argnums=2)
  with pytest.raises(TypeError, match="state_argnums=.*depends on the example"):
    step(params, batch, {"mean": jnp.zeros(D)})


def test_skip_nonfinite_drops_the_micro_batch_of_a_nan_example():
  params, (x, y) = _problem(8)
  y = y.at[5].set(jnp.nan)  # row 5 is in micro-batch 5 % 4 = 1
  batch = (x, y)
  grads, info = jax.jit(jaxaccum.grad(mean_loss, num_micro_batches=4, skip_nonfinite=True,
                                      with_info=True, per_example=CLIP))(
      params, batch)
  rows = [j for j in range(B) if j % 4 != 1]
  ref = [CLIP_JIT(_jgrad(mean_loss)(params, _rows(batch, j))) for j in rows]
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *g: sum(g) / len(rows), *ref),
                              rtol=1e-5, atol=1e-6)
  assert int(info.skipped) == 1 and int(info.num_micro_batches) == 4


def test_with_info_samples_are_micro_batch_means_of_transformed_gradients():
  params, batch = _problem(9)
  n = 4
  _, info = jax.jit(jaxaccum.grad(mean_loss, num_micro_batches=n, with_info=True,
                                  per_example=CLIP))(params, batch)
  micro = []
  for i in range(n):
    g = [CLIP_JIT(_jgrad(mean_loss)(params, _rows(batch, j))) for j in range(i, B, n)]
    micro.append(_norm(jax.tree.map(lambda *a: sum(a) / (B // n), *g)) ** 2)
  np.testing.assert_allclose(float(info.micro_grad_sq_norm), np.mean(micro), rtol=1e-5)
  assert float(info.micro_batch_size) == B // n


def test_remat_and_active_micro_batches():
  params, batch = _problem(10)
  grads = jax.jit(jaxaccum.grad(mean_loss, num_micro_batches=4, remat=True,
                                per_example=CLIP))(params, batch)
  chex.assert_trees_all_close(grads, _loop(mean_loss, params, batch, CLIP_JIT), rtol=1e-5,
                              atol=1e-6)
  step = jax.jit(jaxaccum.grad(mean_loss, num_micro_batches=4, per_example=CLIP))
  rows = [j for j in range(B) if j % 4 < 2]  # micro-batches 0 and 1
  ref = [CLIP_JIT(_jgrad(mean_loss)(params, _rows(batch, j))) for j in rows]
  chex.assert_trees_all_close(step(params, batch, active_micro_batches=jnp.int32(2)),
                              jax.tree.map(lambda *g: sum(g) / len(rows), *ref),
                              rtol=1e-5, atol=1e-6)


def test_data_axis_on_eight_devices_matches_the_loop():
  assert jax.device_count() == 8
  mesh = jax.make_mesh((8,), ("data",))
  params, (x, y) = _problem(11)
  x2, y2 = jnp.concatenate([x, -x]), jnp.concatenate([y, y + 1.0])  # 32 rows
  batch = (x2, y2)
  step = jax.jit(jaxaccum.dp.per_example_value_and_grad(mean_loss, CLIP, num_micro_batches=2,
                 data_axis=jaxaccum.DataParallel("data", mesh=mesh)))
  with jax.set_mesh(mesh):
    loss, grads = step(params, batch)
  ref = [CLIP_JIT(_jgrad(mean_loss)(params, _rows(batch, j))) for j in range(32)]
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *g: sum(g) / 32, *ref),
                              rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(loss, mean_loss(params, batch), rtol=1e-5)


def test_micro_grad_basic_translated_from_optax():
  # optax: per-example grads of 0.5 * (p - t)^2 at p = 0 are -t = [0, -1, -2, -3]; summed
  # -6, the transform x**2 summed 14, per-example values [0, 0.5, 2, 4.5].
  def mean_squared_loss(params, features, targets):
    assert features.shape == (1, 1)  # a batch of one, as optax's keep_batch_dim=True
    diff = features @ params - targets
    return 0.5 * jnp.mean(diff ** 2), 0.5 * diff ** 2

  params = jnp.zeros(1)
  features = jnp.ones((4, 1))
  targets = jnp.array([0, 1, 2, 3], dtype=jnp.float32)
  opts = dict(reduce="sum", has_aux=True, aux_reduce="concat", batch_argnums=(1, 2),
              micro_batch_size=2)
  (value, values), grads = jaxaccum.dp.per_example_value_and_grad(
      mean_squared_loss, lambda g: g, **opts)(params, features, targets)
  chex.assert_trees_all_close(grads, jnp.array([-6.0]))
  chex.assert_trees_all_close(values, jnp.array([0, 0.5, 2, 4.5]))
  chex.assert_trees_all_close(value, 7.0)
  squared, _ = jaxaccum.grad(mean_squared_loss, per_example=lambda g: g ** 2,
                             **opts)(params, features, targets)
  chex.assert_trees_all_close(squared, jnp.array([14.0]))


def test_micro_grad_early_stopping_translated_from_optax():
  grad_fn = jaxaccum.grad(lambda c, x: c * x.sum(), micro_batch_size=4, reduce="sum",
                          per_example=lambda g: g)
  chex.assert_trees_all_close(grad_fn(1.0, jnp.ones(16), active_micro_batches=3), 12.0)


def test_errors_name_the_option():
  params, batch = _problem()
  with pytest.raises(TypeError, match="per_example_value_and_grad's transform must be a function"):
    jaxaccum.dp.per_example_value_and_grad(mean_loss, 1.0, num_micro_batches=2)
  with pytest.raises(ValueError, match=r"transform .* mixes the kinds"):
    jaxaccum.dp.per_example_value_and_grad(mean_loss, CLIP, num_micro_batches=2,
                                           reduce={"a": "mean", "b": "sum"})
  with pytest.raises(ValueError, match=r"transform .* 2 weighted terms"):
    jaxaccum.dp.per_example_value_and_grad(mean_loss, CLIP, num_micro_batches=2,
                                        reduce={"a": "weighted", "b": "weighted"})
  wrong = jaxaccum.grad(mean_loss, num_micro_batches=2,
                        per_example=lambda g: (g, g))
  with pytest.raises(TypeError, match="per_example= must return a gradient with"):
    wrong(params, batch)

  def with_aux(p, batch):
    return mean_loss(p, batch), mean_loss(p, batch)

  stacked = jaxaccum.grad(with_aux, num_micro_batches=2, has_aux=True, aux_reduce="stack",
                          per_example=CLIP)
  with pytest.raises(ValueError, match=r"reduced with 'stack', which has no per-example"):
    stacked(params, batch)


def test_an_unsplit_batch_sized_array_warns_whatever_the_micro_batch_size():
  params, (x, y) = _problem()

  def closes_over_y(p, x):
    return jnp.mean((_pred(p, x) - y) ** 2)

  step = jaxaccum.grad(closes_over_y, num_micro_batches=2, per_example=CLIP)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step(params, x)
  assert any(issubclass(w.category, jaxaccum.BatchBroadcastWarning) for w in caught)


def test_linen_nnx_and_equinox_adapters_forward_the_transform():
  import equinox as eqx
  import flax.linen as nn
  from flax import nnx

  x, y = _problem(12)[1]
  batch = (x, y)

  # Linen: an empty model_state, keys folded per example.
  model = nn.Dense(1)
  variables = model.init(jax.random.key(0), x)

  def linen_loss(params, batch, model_state, rngs):
    xb, yb = batch
    out = model.apply({"params": params}, xb)[:, 0]
    return jnp.mean((out - yb) ** 2), model_state

  def plain(params, batch):
    return linen_loss(params, batch, {}, {})[0]

  (_, _), grads = jaxaccum.linen.value_and_grad(
      linen_loss, num_micro_batches=4, per_example=CLIP)(
          variables["params"], batch, {}, {})
  chex.assert_trees_all_close(grads, _loop(plain, variables["params"], batch, CLIP_JIT),
                              rtol=1e-5, atol=1e-6)

  # NNX: the model's graph state is threaded (unchanged by a Linear).
  lin = nnx.Linear(D, 1, rngs=nnx.Rngs(0))

  def nnx_loss(m, x, y):
    return jnp.mean((m(x)[:, 0] - y) ** 2)

  _, grads = jaxaccum.nnx.value_and_grad(nnx_loss, num_micro_batches=4, batch_argnums=(1, 2),
                                         per_example=CLIP)(lin, x, y)
  row_grad = nnx.jit(nnx.grad(nnx_loss))
  ref = [CLIP_JIT(row_grad(lin, *_rows((x, y), j))) for j in range(B)]
  chex.assert_trees_all_close(nnx.state(grads), jax.tree.map(
      lambda *g: sum(g) / B, *[nnx.state(g) for g in ref]), rtol=1e-5, atol=1e-6)

  # Equinox.
  mlp = eqx.nn.Linear(D, 1, key=jax.random.key(1))

  def eqx_loss(m, x, y):
    return jnp.mean((jax.vmap(m)(x)[:, 0] - y) ** 2)

  _, grads = jaxaccum.eqx.filter_value_and_grad(
      eqx_loss, num_micro_batches=4, batch_argnums=(1, 2), per_example=CLIP)(
          mlp, x, y)
  row_grad = eqx.filter_jit(eqx.filter_grad(eqx_loss))
  ref = [CLIP_JIT(row_grad(mlp, *_rows((x, y), j))) for j in range(B)]
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *g: sum(g) / B, *ref),
                              rtol=1e-5, atol=1e-6)


def test_keyword_batch_along_axis_one_matches_the_per_example_loop():
  # The keyword batch xt is (T, B, D), split and mapped along axis 1; T equals the
  # micro-batch's 4 rows, so mapping it along axis 0 instead would be a silent wrong answer.
  params, (x, y) = _problem(11)
  xt = jnp.stack([x, 0.5 * x, -x, 2.0 * x])  # (4, B, D)

  def seq_loss(p, y, *, xt):
    return jnp.mean((jnp.mean(jax.vmap(_pred, (None, 0))(p, xt), axis=0) - y) ** 2)

  grads = jax.jit(jaxaccum.grad(seq_loss, num_micro_batches=4, batch_argnums=1,
                                batch_argnames="xt", batch_axis=(0, 1),
                                per_example=CLIP))(params, y, xt=xt)
  g = jax.jit(jax.grad(seq_loss))
  ref = [CLIP_JIT(g(params, y[j:j + 1], xt=xt[:, j:j + 1])) for j in range(B)]
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *a: sum(a) / B, *ref),
                              rtol=1e-5, atol=1e-6)


def test_an_unsplit_batch_sized_array_warns_with_one_micro_batch_too():
  # One micro-batch holds the whole batch, but under per_example= fun still sees one
  # row at a time, so y closed over whole broadcasts against each row: the warning must come,
  # and the gradients are those of that broadcast (the per-row loop over the same function).
  params, (x, y) = _problem(12)

  def closes_over_y(p, x):
    return jnp.mean((_pred(p, x) - y) ** 2)

  step = jax.jit(jaxaccum.grad(closes_over_y, num_micro_batches=1,
                               per_example=CLIP))
  with pytest.warns(jaxaccum.BatchBroadcastWarning,
                    match=r"an array of shape \(16,\) that fun closes over has the batch's 16 "
                    r"rows, but it is not split into micro-batches"):
    grads = step(params, x)
  g = jax.jit(jax.grad(closes_over_y))
  ref = [CLIP_JIT(g(params, np.asarray(x)[j:j + 1])) for j in range(B)]
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *a: sum(a) / B, *ref),
                              rtol=1e-5, atol=1e-6)
