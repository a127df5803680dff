"""DP-SGD: ``clip_per_example`` and its options, against per-example loops written by hand.

The reference never goes through the library: ``jax.grad`` of ``fun`` on each row alone
(``x[j:j+1]``, sliced on the host), the norm and the clip factor ``min(1, C / |g|)``
computed in float64 NumPy, then the sum or the mean. Each ``method`` of
``clip_per_example`` ("materialize", "auto", "ghost") must give the same numbers with every
option the per-example path supports.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum
from jaxaccum._per_example._ghost import _analysis
from tests import _problems

B, D, H = 16, _problems.TANH_D, _problems.TANH_H
C = 0.5
# tests/per_example/test_rule.py runs every per-example option with
# method="materialize"; here the same options run with the two others, and the DP options
# with all three.
METHODS = ("auto", "ghost")
ALL = ("materialize", *METHODS)


_pred, mean_loss = _problems.tanh_pred, _problems.tanh_mean_loss


def _problem(seed=0, rows=B):
  return _problems.tanh_problem(seed, rows, bias_scale=0.1)


@functools.cache
def _jgrad(fun):
  return jax.jit(jax.grad(fun))


def _rows(batch, j):
  return jax.tree.map(lambda a: np.asarray(a)[j:j + 1], batch)


def _clip_np(g, c=C):
  """One gradient clipped in float64 NumPy; returns (clipped tree, norm)."""
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
  norm = float(np.sqrt(sum(np.sum(x ** 2) for x in leaves)))
  f = min(1.0, c / norm) if norm > 0 else 1.0
  return jax.tree.map(lambda x: np.asarray(x, np.float64) * f, g), norm


def _total(grads, divisor=1.0):
  return jax.tree.map(lambda *g: sum(g) / divisor, *grads)


def _loop(fun, params, batch, rows, *, divisor, key_of=None, c=C):
  """The clipped sum over ``rows`` (by hand), divided by ``divisor``; and every norm."""
  out, norms = [], []
  for j in rows:
    args = (params, _rows(batch, j)) + (() if key_of is None else (key_of(j),))
    g, n = _clip_np(_jgrad(fun)(*args), c)
    out.append(g)
    norms.append(n)
  return _total(out, divisor), np.array(norms)


def _close(a, b, rtol=1e-5, atol=1e-6):
  chex.assert_trees_all_close(jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b),
                              rtol=rtol, atol=atol)


# --- Every option the per-example path has, for each method ---------------------------------


def noisy_loss(p, batch, key):
  x, y = batch
  keep = jax.random.bernoulli(key, 0.7, x.shape)
  err = _pred(p, jnp.where(keep, x, 0.0)) - y
  return jnp.mean(err ** 2), {"err": err, "abs": jnp.mean(jnp.abs(err))}


@functools.cache
def _aux_step(method):
  return jax.jit(jaxaccum.dp.per_example_value_and_grad(
      noisy_loss, jaxaccum.dp.clip_per_example(C, method), num_micro_batches=4, has_aux=True,
                                            rng_argnums=2, with_info=True,
      remat=True, aux_reduce={"err": "concat", "abs": None}))


@pytest.mark.parametrize("method", METHODS)
def test_mean_with_aux_keys_info_and_remat_matches_the_loop(method):
  params, batch = _problem(1)
  key = jax.random.key(3)
  ((loss, aux), grads, info) = _aux_step(method)(params, batch, key)

  def key_of(j):  # row j is row j // 4 of micro-batch j % 4
    return jax.random.fold_in(jax.random.fold_in(key, j % 4), j // 4)

  ref, norms = _loop(lambda p, b, k: noisy_loss(p, b, k)[0], params, batch, range(B),
                     divisor=B, key_of=key_of)
  _close(grads, ref)
  np.testing.assert_allclose(info.example_grad_norms, norms, rtol=1e-5)
  assert (norms > C).sum() >= B // 2  # most examples are clipped: the test means something
  per_row = [noisy_loss(params, _rows(batch, j), key_of(j))[1] for j in range(B)]
  _close(aux["err"], np.concatenate([r["err"] for r in per_row]), rtol=1e-5)
  _close(aux["abs"], np.mean([r["abs"] for r in per_row]), rtol=1e-5)
  _close(loss, np.mean(np.concatenate([r["err"] for r in per_row]) ** 2), rtol=1e-5)


def sum_loss(p, batch):
  x, y = batch
  return jnp.sum((_pred(p, x) - y) ** 2)


@functools.cache
def _skip_step(method):
  return jax.jit(jaxaccum.grad(
      sum_loss, num_micro_batches=4, reduce="sum", skip_nonfinite=True, with_info=True,
      per_example=jaxaccum.dp.clip_per_example(C, method)))


@pytest.mark.parametrize("method", METHODS)
def test_sum_skip_nonfinite_and_active_micro_batches(method):
  params, (x, y) = _problem(2)
  batch = (x, y.at[5].set(jnp.nan))  # row 5 is in micro-batch 1
  grads, info = _skip_step(method)(params, batch, active_micro_batches=jnp.int32(3))
  ref, _ = _loop(sum_loss, params, batch, [j for j in range(B) if j % 4 in (0, 2)],
                 divisor=1.0)
  _close(grads, ref)
  assert int(info.skipped) == 1 and int(info.num_micro_batches) == 3
  norms = np.asarray(info.example_grad_norms)
  assert np.isnan(norms[[j for j in range(B) if j % 4 == 3]]).all()  # micro-batch 3 did not run
  assert np.isnan(norms[5])  # the non-finite example's norm is reported as it is


def weighted_loss(p, batch):
  x, y, m = batch
  err = (_pred(p, x) - y) ** 2
  return jnp.sum(err * m), jnp.sum(m)


@pytest.mark.parametrize("method", METHODS)
def test_weighted_divides_the_clipped_numerators_by_all_tokens(method):
  params, (x, y) = _problem(3)
  m = (jnp.arange(B) % 3 != 0).astype(jnp.float32)
  value, grads = jax.jit(jaxaccum.dp.per_example_value_and_grad(
      weighted_loss, jaxaccum.dp.clip_per_example(C, method), num_micro_batches=2,
                                               reduce="weighted"))(params, (x, y, m))
  ref, _ = _loop(lambda p, b: weighted_loss(p, b)[0], params, (x, y, m), range(B),
                 divisor=float(m.sum()))
  _close(grads, ref)
  num, den = weighted_loss(params, (x, y, m))
  _close(value, num / den, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_data_axis_on_eight_devices_returns_every_norm_in_batch_order(method):
  mesh = jax.make_mesh((8,), ("data",))
  params, batch = _problem(4, rows=32)
  step = jax.jit(jaxaccum.grad(mean_loss, num_micro_batches=2,
                 data_axis=jaxaccum.DataParallel("data", mesh=mesh), with_info=True,
                               per_example=jaxaccum.dp.clip_per_example(C, method)))
  with jax.set_mesh(mesh):
    grads, info = step(params, batch)
  ref, norms = _loop(mean_loss, params, batch, range(32), divisor=32)
  _close(grads, ref)
  np.testing.assert_allclose(info.example_grad_norms, norms, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_linen_and_equinox_adapters(method):
  import equinox as eqx
  import flax.linen as nn

  clip = jaxaccum.dp.clip_per_example(C, method)
  x, y = _problem(5)[1]

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(jnp.tanh(nn.Dense(H)(x)))[:, 0]

  model = Mlp()
  variables = model.init(jax.random.key(0), x)

  def linen_loss(params, batch, model_state, rngs):
    return jnp.mean((model.apply({"params": params}, batch[0]) - batch[1]) ** 2), model_state

  (_, _), grads = jaxaccum.linen.value_and_grad(
      linen_loss, num_micro_batches=4, per_example=clip)(
          variables["params"], (x, y), {}, {})
  ref, _ = _loop(lambda p, b: linen_loss(p, b, {}, {})[0], variables["params"], (x, y),
                 range(B), divisor=B)
  _close(grads, ref)

  mlp = eqx.nn.MLP(D, 1, H, 1, key=jax.random.key(1))

  def eqx_loss(m, x, y):
    return jnp.mean((jax.vmap(m)(x)[:, 0] - y) ** 2)

  _, grads = jaxaccum.eqx.filter_value_and_grad(
      eqx_loss, num_micro_batches=4, batch_argnums=(1, 2), per_example=clip)(
          mlp, x, y)
  arrays, static = eqx.partition(mlp, eqx.is_array)
  ref, _ = _loop(lambda a, b: eqx_loss(eqx.combine(a, static), *b), arrays, (x, y),
                 range(B), divisor=B)
  _close(eqx.filter(grads, eqx.is_array), ref)


# The NNX adapter passes every parameter through a custom_jvp (nnx.py's _rebase), which the
# analysis sees through: each of the four leaves gets its ghost norm, none is materialised.
@pytest.mark.parametrize("method", METHODS)
def test_nnx_adapter(method, monkeypatch):
  from flax import nnx

  decided = []

  def spy(*args, decide=_analysis.decide):
    decided.append(decide(*args))
    return decided[-1]

  monkeypatch.setattr(_analysis, "decide", spy)
  clip = jaxaccum.dp.clip_per_example(C, method)
  x, y = _problem(5)[1]

  class NnxMlp(nnx.Module):
    def __init__(self, rngs):
      self.l1, self.l2 = nnx.Linear(D, H, rngs=rngs), nnx.Linear(H, 1, rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))[:, 0]

  net = NnxMlp(nnx.Rngs(0))

  def nnx_loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)

  _, grads = jaxaccum.nnx.value_and_grad(nnx_loss, num_micro_batches=4, batch_argnums=(1, 2),
                                         per_example=clip)(net, x, y)
  graphdef, state = nnx.split(net)
  ref, _ = _loop(lambda s, b: nnx_loss(nnx.merge(graphdef, s), *b), state, (x, y), range(B),
                 divisor=B)
  _close(nnx.state(grads), ref)
  assert decided
  for taps, _, multi, fallback in decided:
    assert (len({s.leaf for s in taps.values()}), multi, fallback) == (4, {}, {})


# --- The options DP users rely on ------------------------------------------------------------


@functools.cache
def _nan_safe_step(method):
  return jax.jit(jaxaccum.dp.per_example_value_and_grad(
      mean_loss, jaxaccum.dp.clip_per_example(C, method, nan_safe=True), num_micro_batches=4,
                                           skip_nonfinite=True, with_info=True))


@pytest.mark.parametrize("method", ALL)
def test_nan_safe_example_adds_zero_and_keeps_its_micro_batch(method):
  params, (x, y) = _problem(6)
  batch = (x, y.at[5].set(jnp.nan))
  loss, grads, info = _nan_safe_step(method)(params, batch)
  rows = [j for j in range(B) if j != 5]
  ref, _ = _loop(mean_loss, params, batch, rows, divisor=B)  # still counted in the mean
  _close(grads, ref)
  assert int(info.skipped) == 0 and np.isnan(info.example_grad_norms[5])
  _close(loss, np.sum([mean_loss(params, _rows(batch, j)) for j in rows]) / B, rtol=1e-5)


@pytest.mark.parametrize("method", ALL)
def test_example_mask_removes_padding_from_sum_and_count_without_recompiling(method):
  params, (x, y) = _problem(7)
  y = y.at[::5].set(1e3).at[15].set(jnp.nan)  # padding rows hold garbage (row 15: in both)
  traces = []

  def loss(p, batch):
    traces.append(1)
    return mean_loss(p, batch)

  step = jax.jit(jaxaccum.dp.per_example_value_and_grad(
      loss, jaxaccum.dp.clip_per_example(C, method, example_mask="mask"), num_micro_batches=4,
                                      batch_argnames="mask", with_info=True))
  for mask in (np.arange(B) % 5 != 0, np.arange(B) < 11):
    loss_value, grads, info = step(params, (x, y), mask=jnp.asarray(mask))
    rows = np.flatnonzero(mask)
    ref, _ = _loop(mean_loss, params, (x, y), rows, divisor=len(rows))
    _close(grads, ref)
    _close(loss_value, np.mean([mean_loss(params, _rows((x, y), j)) for j in rows]),
           rtol=1e-5)
    assert float(info.batch_size) == len(rows)
  n = len(traces)
  step(params, (x, y), mask=jnp.ones(B, bool))
  assert len(traces) == n  # the same compiled program for every mask


@pytest.mark.parametrize("method", ALL)
def test_user_level_clipping_with_keep_batch_dim_false(method):
  params, (x, y) = _problem(8, rows=B * 3)
  xu, yu = x.reshape(B, 3, D), y.reshape(B, 3)  # 16 users of 3 rows each

  def unit_loss(p, batch):  # one user's rows, no leading axis of one
    xb, yb = batch
    assert xb.shape == (3, D)
    return jnp.mean((_pred(p, xb) - yb) ** 2)

  grads, info = jax.jit(jaxaccum.grad(
      unit_loss, num_micro_batches=4, with_info=True,
      per_example=jaxaccum.dp.clip_per_example(C, method, keep_batch_dim=False)))(
          params, (xu, yu))
  out, norms = [], []
  for u in range(B):
    g, n = _clip_np(_jgrad(unit_loss)(params, (np.asarray(xu)[u], np.asarray(yu)[u])))
    out.append(g)
    norms.append(n)
  _close(grads, _total(out, B))
  np.testing.assert_allclose(info.example_grad_norms, norms, rtol=1e-5)


def test_dp_noise_equals_optax_dpsgd_on_per_example_gradients():
  params, batch = _problem(9)
  sigma, lr = 1.1, 0.1
  tx = optax.chain(jaxaccum.dp.dp_noise(C, sigma, batch_size=B, key=jax.random.key(5)),
                   optax.sgd(lr))
  # optax's DP-SGD (dpsgd without momentum is this chain) takes per-example gradients.
  ref_tx = optax.chain(optax.contrib.differentially_private_aggregate(
      C, sigma, key=jax.random.key(5)), optax.sgd(lr))

  @jax.jit
  def both(params, batch):
    grads = jaxaccum.grad(mean_loss, num_micro_batches=4,
                          per_example=jaxaccum.dp.clip_per_example(C))(params, batch)
    ours, _ = tx.update(grads, tx.init(params), params)
    per_example = jax.vmap(jax.grad(mean_loss), in_axes=(None, 0))(
        params, jax.tree.map(lambda a: a[:, None], batch))
    theirs, _ = ref_tx.update(per_example, ref_tx.init(params), params)
    return grads, ours, theirs

  grads, ours, theirs = both(params, batch)
  _close(ours, theirs, rtol=1e-5, atol=1e-6)
  noise = jax.tree.map(lambda u, g: np.asarray(u) + lr * np.asarray(g), ours, grads)
  assert max(np.abs(n).max() for n in jax.tree.leaves(noise)) > 1e-3  # noise was added


# --- Clip norms, validated -------------------------------------------------------------------


def test_concrete_bad_clip_norms_raise():
  for bad in (-1.0, 0, jnp.array(-1.0), jnp.array(jnp.nan), np.float32(0.0), float("nan")):
    with pytest.raises(ValueError, match="max_norm must be positive, got max_norm="):
      jaxaccum.dp.clip_per_example(bad)
  with pytest.raises(TypeError, match="max_norm must be a scalar"):
    jaxaccum.dp.clip_per_example(jnp.ones(2))
  with pytest.raises(TypeError, match="max_norm must be a positive number"):
    jaxaccum.dp.clip_per_example("1")
  with pytest.raises(ValueError, match="method must be one of 'auto', 'ghost', 'materialize'"):
    jaxaccum.dp.clip_per_example(1.0, "fast")
  with pytest.raises(TypeError, match="nan_safe must be a bool"):
    jaxaccum.dp.clip_per_example(1.0, nan_safe=1)
  with pytest.raises(ValueError, match=r"batch_argnames=\(\) does not name it"):
    jaxaccum.grad(mean_loss, num_micro_batches=2,
                  per_example=jaxaccum.dp.clip_per_example(1.0, example_mask="mask"))


def test_a_traced_bad_clip_norm_gives_nan_for_skip_nonfinite():
  params, batch = _problem(10)

  @jax.jit
  def step(c):
    return jaxaccum.grad(mean_loss, num_micro_batches=2, skip_nonfinite=True, with_info=True,
                         per_example=jaxaccum.dp.clip_per_example(c))(params, batch)

  for bad in (-1.0, 0.0, jnp.nan):
    grads, info = step(jnp.float32(bad))
    assert int(info.skipped) == 2  # every micro-batch NaN, none silently flipped or kept
    assert all(bool(jnp.all(g == 0)) for g in jax.tree.leaves(grads))
  grads, info = step(jnp.float32(C))
  ref, _ = _loop(mean_loss, params, batch, range(B), divisor=B)
  _close(grads, ref)
  # Called directly on one gradient, a traced bad norm gives NaN too.
  out = jax.jit(lambda c: jaxaccum.dp.clip_per_example(c)(jnp.array([3.0, 4.0])))(-1.0)
  assert bool(jnp.all(jnp.isnan(out)))


# --- Defects ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL)
def test_clip_of_a_gradient_whose_squared_norm_overflows_float32(method):
  big = {"w": jnp.array([3e19, 4e19])}  # |g| = 5e19, |g|^2 = 2.5e39 > float32's max
  _close(jaxaccum.dp.clip_per_example(1.0)(big)["w"], np.array([0.6, 0.8]))
  params, batch = _problem(11)

  def huge(p, batch):
    return 1e20 * mean_loss(p, batch)

  grads = jaxaccum.grad(huge, num_micro_batches=2, per_example=jaxaccum.dp.
                        clip_per_example(C, method))(params, batch)
  # Every example's gradient is 1e20 times mean_loss's, far above C: clipped to C along it.
  unit = [_clip_np(_jgrad(mean_loss)(params, _rows(batch, j)), np.inf) for j in range(B)]
  ref = _total([jax.tree.map(lambda g, n=n: g * C / n, g) for g, n in unit], B)
  _close(grads, ref)


def test_time_major_aux_concat_under_batch_axis_one():
  params, (x, y) = _problem(12)
  xt, yt = jnp.stack([x, 0.5 * x, -x]), y[None]  # (T, B, D) and (1, B): rows along axis 1

  def seq_loss(p, xt, yt):
    pred = jax.vmap(_pred, (None, 0))(p, xt)  # (T, rows)
    return jnp.mean((jnp.mean(pred, axis=0) - yt[0]) ** 2), pred

  opts = dict(num_micro_batches=4, batch_argnums=(1, 2), batch_axis=1, has_aux=True,
              aux_reduce="concat")
  (_, plain), _ = jaxaccum.value_and_grad(seq_loss, **opts)(params, xt, yt)
  (_, aux), _ = jaxaccum.dp.per_example_value_and_grad(
      seq_loss, jaxaccum.dp.clip_per_example(C), **opts)(params, xt, yt)
  _close(aux, plain, rtol=1e-5)
  _close(aux, jax.vmap(_pred, (None, 0))(params, xt), rtol=1e-5)


def test_scalar_per_example_aux_concatenates_to_one_entry_per_example():
  params, batch = _problem(13)

  def with_loss(p, batch):
    loss = mean_loss(p, batch)
    return loss, loss  # each example's own loss, a scalar

  (_, losses), _ = jaxaccum.dp.per_example_value_and_grad(
      with_loss, jaxaccum.dp.clip_per_example(C), num_micro_batches=4, has_aux=True,
                                           aux_reduce="concat")(params, batch)
  _close(losses, np.array([mean_loss(params, _rows(batch, j)) for j in range(B)]), rtol=1e-5)


# --- Porting JAX's DP-SGD example ------------------------------------------------------------


def test_an_extra_example_axis_gets_a_jaxaccum_error_not_a_convolution_rank_error():
  from jax.example_libraries import stax

  init, apply = stax.serial(stax.Conv(2, (3, 3), padding="SAME"), stax.Relu, stax.Flatten,
                            stax.Dense(1))
  _, params = init(jax.random.key(0), (-1, 6, 6, 1))
  images = jax.random.normal(jax.random.key(1), (8, 1, 6, 6, 1))  # dummy_dim=True, as there
  labels = jnp.arange(8.0)

  def loss(p, batch):
    x, y = batch
    return jnp.mean((apply(p, x)[:, 0] - y) ** 2)

  clip = jaxaccum.dp.clip_per_example(C)
  with pytest.raises(TypeError, match=r"(?s)reaches fun as \(1, 1, 6, 6, 1\).*Drop it.*"
                                      r"keep_batch_dim=False.*convolution requires"):
    jaxaccum.grad(loss, num_micro_batches=2, per_example=clip)(
        params, (images, labels))
  # As the error says: with keep_batch_dim=False fun sees each (1, 6, 6, 1) row, as there.
  grads = jaxaccum.grad(loss, num_micro_batches=2, per_example=jaxaccum.dp.
                        clip_per_example(C, keep_batch_dim=False))(params, (images, labels))
  ref, _ = _loop(loss, params, (images[:, 0], labels), range(8), divisor=8)
  _close(grads, ref)


def _deep_tanh_loss(params, batch):
  x, y = batch
  for w, b in params[:-1]:
    x = jnp.tanh(x @ w + b)
  w, b = params[-1]
  return jnp.mean((x @ w + b - y) ** 2)


def test_plan_knows_the_ghost_step_memory_and_picks_near_plain_accumulations_count():
  # An MLP of six tanh layers over 256 rows, where the per-example gradients (256 x 21k
  # parameters) dwarf the activations. Under a budget between plain accumulation's programs
  # at 2 and 4 micro-batches, plain picks 4. The planner compiles the ghost step's own
  # program (checked against an independent compile) and picks the fewest micro-batches
  # whose program fits: plain's count (with jax 0.12's own tanh derivative rule the ghost
  # step held a 1 - y^2 buffer per layer and needed 8), while materialising does not fit
  # even with micro-batches of 8 rows.
  sizes = (8, *(64,) * 6, 1)
  keys = jax.random.split(jax.random.key(0), len(sizes) + 1)
  params = [(jax.random.normal(k, (a, b)) / a**0.5, jnp.zeros(b))
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=False)]
  batch = (jax.random.normal(keys[-2], (256, 8)), jax.random.normal(keys[-1], (256, 1)))
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, batch))

  def peak(n, method=None):
    vg = (jaxaccum.value_and_grad(_deep_tanh_loss, num_micro_batches=n) if method is None else
          jaxaccum.dp.per_example_value_and_grad(
              _deep_tanh_loss, jaxaccum.dp.clip_per_example(1.0, method), num_micro_batches=n))
    m = jax.jit(vg).lower(*shapes).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)

  budget = int(0.95 * peak(2))
  assert peak(4) <= budget
  plans = {method: jaxaccum.plan(
      _deep_tanh_loss, *shapes, memory_budget_bytes=budget, verbose=False,
      **({} if method is None else {
          "per_example": jaxaccum.dp.clip_per_example(1.0, method)}))
      for method in (None, "ghost")}
  assert plans[None].num_micro_batches == 4
  n = plans["ghost"].num_micro_batches
  assert n == 4, n
  by = {c.num_micro_batches: c.peak_bytes for c in plans["ghost"].candidates}
  assert by[n] == peak(n, "ghost") == peak(n, "auto")  # the planner's figures are the step's own
  assert by[n] <= budget < by[n // 2], (n, budget, by)  # the fewest that fit
  assert peak(32, "materialize") > budget  # micro-batches of 8 rows do not fit
