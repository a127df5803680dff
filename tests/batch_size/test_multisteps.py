"""jaxaccum.MultiSteps: a drop-in for optax.MultiSteps, token weighting, and the proofs.

The proofs train for several optimizer steps four ways and compare the parameters after
every step: (a) the full batch through plain ``jax.grad``, (b) ``jaxaccum.value_and_grad``
over micro-batches, (c) ``optax.MultiSteps`` and (d) ``jaxaccum.MultiSteps`` fed one
micro-batch per call (built with ``jaxaccum.split_micro_batches``, so every way sees the
same micro-batches). Float32; ``assert_close`` allows 1e-5 of each leaf's largest entry:
the ways differ only in summation order, a few float32 ulps per step.
"""

import logging
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum
from tests import _multisteps_lm as lm
from tests._util import assert_close

K = 4  # micro-batches per optimizer step
B = 16  # rows per (effective) batch
STEPS = 3  # optimizer steps in the proofs
CLIP = 0.05  # below the gradient norm of the MLP problem, so clipping is active

CLASSES = {"optax": optax.MultiSteps, "jaxaccum": jaxaccum.MultiSteps}


def micro_batch(split, i):
  return jax.tree.map(lambda x: x[i], split)


# ----------------------------------------------------------------------------------------
# The problems: an MLP with a mean loss, and a token-level language model.


def mlp_init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (5, 8)) / 2, "b1": jnp.full((8,), 0.1),
          "w2": jax.random.normal(k2, (8, 3)) / 3, "b2": jnp.zeros((3,))}


def mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def mlp_batches():
  out = []
  for s in range(STEPS):
    kx, ky = jax.random.split(jax.random.key(10 + s))
    out.append({"x": jax.random.normal(kx, (B, 5)), "y": jax.random.normal(ky, (B, 3))})
  return out


# Token lengths chosen so that micro-batches (rows i, i + K, ...) hold very different
# numbers of real tokens.
LM_LENGTHS = ([7, 2, 1, 5, 7, 3, 2, 6], [3, 7, 7, 1, 2, 7, 6, 1], [7, 7, 2, 2, 7, 6, 1, 3])


def lm_batches(lengths=LM_LENGTHS):
  return [lm.make_batch(jax.random.key(20 + s), ls) for s, ls in enumerate(lengths)]


def warmup_cosine():
  return optax.warmup_cosine_decay_schedule(
      init_value=3e-3, peak_value=3e-2, warmup_steps=2, decay_steps=6, end_value=1e-3)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(1e-2),
    "adamw_warmup_cosine_clip": lambda: optax.chain(
        optax.clip_by_global_norm(CLIP), optax.adamw(warmup_cosine(), weight_decay=0.1)),
}


# ----------------------------------------------------------------------------------------
# The four ways of training.


def train_per_batch(opt, params, batches, grad_fn):
  """One optimizer update per batch with ``grad_fn(params, batch)``; params after each."""
  @jax.jit
  def step(p, s, batch):
    updates, s = opt.update(grad_fn(p, batch), s, p)
    return optax.apply_updates(p, updates), s

  state, history = opt.init(params), []
  for batch in batches:
    params, state = step(params, state, batch)
    history.append(params)
  return history, state


def train_per_micro_batch(ms, params, batches, loss, weight_fn=None):
  """``ms`` fed one micro-batch per call; params after each window, and the final state."""
  @jax.jit
  def step(p, s, mb):
    kwargs = {} if weight_fn is None else {"weight": weight_fn(mb)}
    updates, s = ms.update(jax.grad(loss)(p, mb), s, p, **kwargs)
    return optax.apply_updates(p, updates), s

  state, history = ms.init(params), []
  for batch in batches:
    split = jaxaccum.split_micro_batches(batch, num_micro_batches=K)
    for i in range(K):
      new_params, state = step(params, state, micro_batch(split, i))
      if i < K - 1:  # nothing moves until the window completes
        chex.assert_trees_all_equal(new_params, params)
        assert not bool(ms.has_updated(state))
      params = new_params
    assert bool(ms.has_updated(state))
    history.append(params)
  return history, state


# ----------------------------------------------------------------------------------------
# Proofs.


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_full_batch_scan_optax_and_jaxaccum_multisteps_agree(name):
  params, batches = mlp_init(jax.random.key(0)), mlp_batches()
  full, full_state = train_per_batch(OPTIMIZERS[name](), params, batches, jax.grad(mlp_loss))
  scan, _ = train_per_batch(OPTIMIZERS[name](), params, batches,
                            lambda p, b: jaxaccum.value_and_grad(
                                mlp_loss, num_micro_batches=K)(p, b)[1])
  ox, ox_state = train_per_micro_batch(optax.MultiSteps(OPTIMIZERS[name](), K), params,
                                       batches, mlp_loss)
  ours, state = train_per_micro_batch(jaxaccum.MultiSteps(OPTIMIZERS[name](), K), params,
                                      batches, mlp_loss)
  for step in range(STEPS):
    for way, hist in (("value_and_grad", scan), ("optax.MultiSteps", ox),
                      ("jaxaccum.MultiSteps", ours)):
      assert_close(hist[step], full[step], err_msg=f"{way}, optimizer step {step}")
  # Every step moved the parameters (so the comparison is not vacuous) ...
  for before, after in zip([params] + full[:-1], full, strict=True):
    assert max(float(np.max(np.abs(np.asarray(after[k]) - np.asarray(before[k]))))
               for k in after) > 1e-4  # (on the host: no program per leaf)
  # ... the inner optimizer counted optimizer steps, not micro-steps ...
  assert int(state.gradient_step) == int(ox_state.gradient_step) == STEPS
  chex.assert_trees_all_close(state.inner_opt_state, full_state, rtol=1e-5, atol=1e-7)
  if name.startswith("adamw"):
    # ... and clipping acted on the effective batch's gradient, whose norm exceeds CLIP.
    assert float(optax.tree.norm(jax.jit(jax.grad(mlp_loss))(params, batches[0]))) > 2 * CLIP


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_token_weighted_lm_full_batch_scan_and_multisteps_agree(name):
  opt = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(3e-2)}[name]
  params, batches = lm.init_params(jax.random.key(0)), lm_batches()
  full, _ = train_per_batch(opt(), params, batches, jax.grad(lm.token_loss_mean))
  vg = jaxaccum.value_and_grad(lm.token_loss_sum, num_micro_batches=K, reduce="weighted")
  scan, _ = train_per_batch(opt(), params, batches, lambda p, b: vg(p, b)[1])
  ours, state = train_per_micro_batch(jaxaccum.MultiSteps(opt(), K), params, batches,
                                      lm.token_loss_mean, weight_fn=lm.num_tokens)
  for step in range(STEPS):
    assert_close(scan[step], full[step], err_msg=f"value_and_grad, step {step}")
    assert_close(ours[step], full[step], err_msg=f"jaxaccum.MultiSteps, step {step}")
  loss, _ = jax.jit(vg)(params, batches[0])
  np.testing.assert_allclose(loss, jax.jit(lm.token_loss_mean)(params, batches[0]), rtol=1e-6)
  assert bool(state.weighted) and int(state.gradient_step) == STEPS


def test_optax_multisteps_does_not_agree_on_token_weighted_loss():
  params, batches = lm.init_params(jax.random.key(0)), lm_batches()
  counts = [int(lm.num_tokens(micro_batch(jaxaccum.split_micro_batches(
      batches[0], num_micro_batches=K), i))) for i in range(K)]
  assert len(set(counts)) > 1, counts  # the micro-batches really are uneven
  full, _ = train_per_batch(optax.sgd(0.5), params, batches, jax.grad(lm.token_loss_mean))
  ox, _ = train_per_micro_batch(optax.MultiSteps(optax.sgd(0.5), K), params, batches,
                                lm.token_loss_mean)
  ours, _ = train_per_micro_batch(jaxaccum.MultiSteps(optax.sgd(0.5), K), params, batches,
                                  lm.token_loss_mean, weight_fn=lm.num_tokens)
  assert_close(ours[0], full[0])
  # optax averages the micro-batch means: its first update is far from the full batch's.
  for key in params:
    step_full = full[0][key] - params[key]
    err = float(jnp.max(jnp.abs(ox[0][key] - full[0][key])) / jnp.max(jnp.abs(step_full)))
    assert err > 1.0, (key, err)
  with pytest.raises(AssertionError):
    assert_close(ox[-1], full[-1])


def test_optax_multisteps_agrees_when_micro_batches_hold_equal_token_counts():
  # The control for the test above: with equal counts the plain mean is the token mean.
  params = lm.init_params(jax.random.key(0))
  batches = lm_batches(([5] * 8, [7] * 8, [3] * 8))
  full, _ = train_per_batch(optax.sgd(0.5), params, batches, jax.grad(lm.token_loss_mean))
  ox, _ = train_per_micro_batch(optax.MultiSteps(optax.sgd(0.5), K), params, batches,
                                lm.token_loss_mean)
  assert_close(ox[-1], full[-1])


def test_zero_weight_micro_batch_contributes_nothing_even_with_nan_gradient():
  # Micro-batch 2 holds rows 2 and 6: sequences of one token, so no next-token targets.
  params = lm.init_params(jax.random.key(0))
  batch = lm.make_batch(jax.random.key(3), [7, 2, 1, 5, 7, 3, 1, 6])
  empty = micro_batch(jaxaccum.split_micro_batches(batch, num_micro_batches=K), 2)
  assert int(lm.num_tokens(empty)) == 0
  assert np.isnan(np.asarray(jax.grad(lm.token_loss_mean)(params, empty)["out"])).all()
  full, _ = train_per_batch(optax.adam(3e-2), params, [batch], jax.grad(lm.token_loss_mean))
  ours, state = train_per_micro_batch(jaxaccum.MultiSteps(optax.adam(3e-2), K), params,
                                      [batch], lm.token_loss_mean, weight_fn=lm.num_tokens)
  assert_close(ours[0], full[0])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


# ----------------------------------------------------------------------------------------
# Weighted accumulation by hand.


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_weighted_accumulation_matches_hand_computation(use_grad_mean):
  ms = jaxaccum.MultiSteps(optax.identity(), 4, use_grad_mean=use_grad_mean)
  grads = [jnp.array([1.0, -2.0]), jnp.array([jnp.nan, jnp.inf]), jnp.array([3.0, 0.5]),
           jnp.array([-4.0, 8.0])]
  weights = [2, 0, 5.0, jnp.int32(1)]
  update = jax.jit(ms.update)
  state = ms.init(jnp.zeros(2))
  for g, w in zip(grads, weights, strict=True):
    out, state = update(g, state, weight=w)
  total = 2 * grads[0] + 5 * grads[2] + 1 * grads[3]
  np.testing.assert_allclose(out, total / 8 if use_grad_mean else total, rtol=1e-6)
  assert int(state.gradient_step) == 1 and float(state.acc_weight) == 0.0


@pytest.mark.parametrize(("accumulator_dtype", "acc_dtype"),
                         [(jnp.float32, jnp.float32), (None, jnp.bfloat16)])
def test_weighted_bfloat16_gradients_and_accumulator_dtype(accumulator_dtype, acc_dtype):
  params = jnp.zeros(3, jnp.bfloat16)
  ms = jaxaccum.MultiSteps(optax.identity(), 3, accumulator_dtype=accumulator_dtype)
  update = jax.jit(lambda g, s, w: ms.update(g, s, params, weight=w))
  state = ms.init(params)
  assert state.acc_grads.dtype == acc_dtype
  grads = [jnp.array([1.0, 2.0, -3.0]), jnp.array([0.5, -1.0, 4.0]), jnp.array([2.0, 0, 1])]
  for g, w in zip(grads, [3, 1, 4], strict=True):
    out, state = update(g.astype(jnp.bfloat16), state, w)
    assert state.acc_grads.dtype == acc_dtype
  expected = (3 * grads[0] + grads[1] + 4 * grads[2]) / 8
  assert out.dtype == jnp.bfloat16
  # bfloat16 keeps 8 bits of mantissa: 2**-8 relative per rounding.
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-2, atol=1e-2)


def test_state_tracks_window_weight_and_mode():
  ms = jaxaccum.MultiSteps(optax.sgd(1.0), 3)
  state = ms.init({"a": jnp.zeros(2)})
  assert state._fields[:5] == optax.MultiStepsState._fields
  update = jax.jit(ms.update)
  _, state = update({"a": jnp.ones(2)}, state, weight=2.5)
  _, state = update({"a": jnp.ones(2)}, state, weight=4)
  assert (int(state.mini_step), float(state.acc_weight), bool(state.weighted)) == (2, 6.5, True)
  _, state = update({"a": jnp.ones(2)}, state, weight=1)
  assert (int(state.mini_step), int(state.gradient_step), float(state.acc_weight)) == (0, 1, 0)
  _, state = update({"a": jnp.ones(2)}, state)
  assert (int(state.mini_step), float(state.acc_weight), bool(state.weighted)) == (1, 1, False)


def test_weight_one_everywhere_equals_unweighted_and_optax():
  params = {"a": jnp.zeros(3)}
  grads = [{"a": jax.random.normal(jax.random.key(i), (3,))} for i in range(6)]
  outs = {}
  for label, cls, kwargs in (("optax", optax.MultiSteps, {}),
                             ("plain", jaxaccum.MultiSteps, {}),
                             ("weight1", jaxaccum.MultiSteps, {"weight": 1})):
    ms = cls(optax.adam(0.1), 3)
    update = jax.jit(lambda g, s, ms=ms, kwargs=kwargs: ms.update(g, s, params, **kwargs))
    state, outs[label] = ms.init(params), []
    for g in grads:
      u, state = update(g, state)
      outs[label].append(u)
  assert_close(outs["plain"], outs["optax"], rtol=1e-6)
  assert_close(outs["weight1"], outs["optax"], rtol=1e-6)


def test_a_window_whose_total_weight_is_zero_emits_zero():
  ms = jaxaccum.MultiSteps(optax.sgd(1.0), 2)
  update = jax.jit(lambda g, s, w: ms.update(g, s, weight=w))
  state = ms.init(jnp.zeros(2))
  _, state = update(jnp.full(2, jnp.nan), state, 0)
  out, state = update(jnp.full(2, jnp.nan), state, 0)
  chex.assert_trees_all_equal(out, jnp.zeros(2))
  assert bool(ms.has_updated(state)) and int(state.gradient_step) == 1


def test_consecutive_windows_may_differ_in_mode():
  ms = jaxaccum.MultiSteps(optax.identity(), 2)
  update = jax.jit(ms.update, static_argnames=())
  weighted = jax.jit(lambda g, s, w: ms.update(g, s, weight=w))
  state = ms.init(jnp.zeros(1))
  _, state = update(jnp.array([1.0]), state)
  out, state = update(jnp.array([3.0]), state)
  np.testing.assert_allclose(out, [2.0])
  _, state = weighted(jnp.array([1.0]), state, 3)
  out, state = weighted(jnp.array([5.0]), state, 1)
  np.testing.assert_allclose(out, [2.0])


def test_skipped_weighted_call_leaves_the_window_unchanged():
  ms = jaxaccum.MultiSteps(optax.identity(), 2, should_skip_update_fn=optax.skip_not_finite)
  update = jax.jit(lambda g, s, w: ms.update(g, s, weight=w))
  state = ms.init(jnp.zeros(1))
  _, state = update(jnp.array([2.0]), state, 1)
  out, skipped = update(jnp.array([jnp.nan]), state, 5)
  chex.assert_trees_all_equal(out, jnp.zeros(1))
  assert int(skipped.skip_state["num_not_finite"]) == 1
  chex.assert_trees_all_equal(skipped._replace(skip_state=()), state._replace(skip_state=()))
  out, state = update(jnp.array([6.0]), skipped, 3)
  np.testing.assert_allclose(out, [(2.0 + 18.0) / 4])


@pytest.mark.parametrize("skip", ["should_skip_update_fn", "skip_nonfinite"])
def test_skipped_call_of_the_other_mode_leaves_the_window_mode_unchanged(skip):
  # A skipped call is as if it never happened, its weighted-or-not flag included: the
  # state after it equals the state before it, but for skip_state, the skip counters and
  # info (which describes what this call emitted: nothing).
  kwargs = ({"should_skip_update_fn": optax.skip_not_finite} if skip == "should_skip_update_fn"
            else {"skip_nonfinite": True})
  ms = jaxaccum.MultiSteps(optax.identity(), 2, **kwargs)
  weighted = jax.jit(lambda g, s: ms.update(g, s, weight=3))
  unweighted = jax.jit(ms.update)
  ignore = {"skip_state": (), "skipped": 0, "window_skipped": 0, "info": ()}
  for first, other in ((unweighted, weighted), (weighted, unweighted)):
    # Before any call, and after a completed window of the first mode.
    state = ms.init(jnp.zeros(2))
    _, state = first(jnp.ones(2), state)
    _, state = first(jnp.ones(2), state)
    for before in (ms.init(jnp.zeros(2)), state):
      out, after = other(jnp.full(2, jnp.nan), before)
      chex.assert_trees_all_equal(out, jnp.zeros(2))
      chex.assert_trees_all_equal(after._replace(**ignore), before._replace(**ignore))
      assert int(after.info.num_micro_batches) == 0


# ----------------------------------------------------------------------------------------
# Drop-in: optax's own MultiSteps tests (optax/transforms/_accumulation_test.py), run on
# both classes.


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_dropin_updates_only_every_k_steps(cls):
  params = {"w": jax.random.normal(jax.random.key(0), (7, 10)), "b": jnp.zeros(10)}
  data = jnp.ones((32, 7))

  def loss(p, x):
    return jnp.sum((x @ p["w"] + p["b"]) ** 2)

  k = 4
  ms = cls(optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(1e-2),
                       optax.scale(-1e-4)), k)
  opt_init, opt_update = ms.gradient_transformation()

  @jax.jit
  def train_step(opt_state, params):
    return opt_update(jax.grad(loss)(params, data), opt_state, params)

  opt_state, prev_loss = opt_init(params), loss(params, data)
  for idx in range(3 * k):
    updates, opt_state = train_step(opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new_loss = loss(new_params, data)
    if idx % k < k - 1:
      chex.assert_trees_all_equal(new_params, params)
      assert new_loss == prev_loss and not bool(ms.has_updated(opt_state))
    else:
      assert new_loss < prev_loss and bool(ms.has_updated(opt_state))
      prev_loss = new_loss
    params = new_params


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_dropin_every_k_schedule(cls):
  ms = cls(optax.sgd(1e-4), lambda grad_step: jnp.where(grad_step < 2, 1, 3))
  opt_init, opt_update = ms.gradient_transformation()
  opt_update = jax.jit(opt_update)
  params = grad = {"a": jnp.zeros([])}
  opt_state = opt_init(params)
  assert not bool(ms.has_updated(opt_state))
  for _ in range(2):
    _, opt_state = opt_update(grad, opt_state, params)
    assert bool(ms.has_updated(opt_state))
  for _ in range(3):
    for _ in range(2):
      _, opt_state = opt_update(grad, opt_state, params)
      assert not bool(ms.has_updated(opt_state))
    _, opt_state = opt_update(grad, opt_state, params)
    assert bool(ms.has_updated(opt_state))


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_dropin_scan_dtype_stability(cls):
  # bfloat16 gradients into a float32 accumulator: the scan carry keeps its dtypes.
  ms = cls(optax.sgd(1e-4), 2, accumulator_dtype=jnp.float32)
  opt_init, opt_update = ms.gradient_transformation()
  params = {"a": jnp.zeros([], dtype=jnp.bfloat16)}

  def train_step(state, _):
    updates, state = opt_update({"a": jnp.ones([], dtype=jnp.bfloat16)}, state, params)
    return state, updates

  final_state, updates = jax.lax.scan(train_step, opt_init(params), jnp.arange(4))
  assert final_state.acc_grads["a"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(updates["a"], np.float32), [0, -1e-4, 0, -1e-4], rtol=1e-2)


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_dropin_zero_nans(cls):
  # optax's test only checks that this runs (optax#828). The reference: the inner chain
  # applied directly to each window's mean gradient, computed by hand.
  inner = lambda: optax.chain(optax.zero_nans(), optax.sgd(1e-4))  # noqa: E731
  ms = cls(inner(), every_k_schedule=2)
  opt_init, opt_update = ms.gradient_transformation()
  opt_update = jax.jit(opt_update)
  params = {"a": jnp.zeros([]), "b": jnp.zeros(2)}
  calls = [{"a": 1.0, "b": [2.0, -4.0]}, {"a": 3.0, "b": [0.0, 8.0]},  # mean: 2, [1, 2]
           {"a": jnp.nan, "b": [1.0, 1.0]}, {"a": 5.0, "b": [3.0, 5.0]}]  # mean: nan, [2, 3]
  calls = [{"a": jnp.float32(c["a"]), "b": jnp.array(c["b"])} for c in calls]
  window_means = [{"a": jnp.float32(2.0), "b": jnp.array([1.0, 2.0])},
                  {"a": jnp.float32(jnp.nan), "b": jnp.array([2.0, 3.0])}]
  ref, ref_state, ref_updates = inner(), None, []
  ref_state = ref.init(params)
  for mean in window_means:
    u, ref_state = ref.update(mean, ref_state, params)
    ref_updates.append(u)
  # zero_nans zeroed the NaN and recorded it; the rest is -1e-4 times the mean.
  chex.assert_trees_all_close(ref_updates, [{"a": -2e-4, "b": jnp.array([-1e-4, -2e-4])},
                                            {"a": 0.0, "b": jnp.array([-2e-4, -3e-4])}])
  state = opt_init(params)
  outs = []
  for i, g in enumerate(calls):
    u, state = opt_update(g, state, params)
    if i % 2 == 0:
      chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))
    else:
      outs.append(u)
  chex.assert_trees_all_close(outs, ref_updates, rtol=1e-6)
  chex.assert_trees_all_equal(state.inner_opt_state, ref_state)
  assert bool(state.inner_opt_state[0].found_nan["a"])


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
@pytest.mark.parametrize(("start", "expected"), [(3, 4), (np.iinfo(np.int32).max,) * 2])
def test_dropin_counters_saturate_instead_of_wrapping(cls, start, expected):
  # optax's safe_increment test (optax/_src/numerics_test.py, "Increments correctly" and
  # "Avoids overflow"), ported to the optimizer step count of MultiSteps: a window that
  # completes at gradient_step == int32 max keeps it there rather than wrapping to
  # int32 min, which would make has_updated() false and the inner schedules jump.
  ms = cls(optax.sgd(1.0), 2)
  update = jax.jit(ms.update)
  state = ms.init(jnp.zeros(2))._replace(gradient_step=jnp.int32(start))
  _, state = update(jnp.ones(2), state)
  assert int(state.gradient_step) == start and int(state.mini_step) == 1
  out, state = update(jnp.full(2, 3.0), state)
  chex.assert_trees_all_close(out, jnp.full(2, -2.0))
  assert int(state.gradient_step) == expected and state.gradient_step.dtype == jnp.int32
  assert int(state.mini_step) == 0 and bool(ms.has_updated(state))


@pytest.mark.parametrize("start", [5, np.iinfo(np.int32).max])
def test_skipped_call_counters_saturate(start):
  ms = jaxaccum.MultiSteps(optax.sgd(1.0), 2, skip_nonfinite=True)
  update = jax.jit(ms.update)
  state = ms.init(jnp.zeros(2))._replace(skipped=jnp.int32(start),
                                         window_skipped=jnp.int32(start))
  _, state = update(jnp.full(2, jnp.nan), state)
  expected = min(start + 1, np.iinfo(np.int32).max)
  assert int(state.skipped) == expected and int(state.window_skipped) == expected


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_dropin_computes_mean(cls):
  ms = cls(optax.scale(1.0), 4, use_grad_mean=True)
  opt_init, opt_update = ms.gradient_transformation()
  params = {"a": jnp.zeros([])}
  opt_state = opt_init(params)
  grads = [{"a": jnp.ones([]) * i} for i in [1, 2, 3, 4]]
  for g in grads[:-1]:
    _, opt_state = opt_update(g, opt_state, params)
    assert not bool(ms.has_updated(opt_state))
  new_params, opt_state = opt_update(grads[-1], opt_state, params)
  assert bool(ms.has_updated(opt_state))
  np.testing.assert_array_equal(new_params["a"], 2.5)


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_dropin_skip_not_finite(cls):
  ms = cls(optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite)
  opt_init, opt_update = ms.gradient_transformation()
  opt_update = jax.jit(opt_update)
  params = {"a": jnp.zeros([])}
  opt_state = jax.jit(opt_init)(params)
  expected_mini_step = [1, 0, 0, 0, 1, 0]
  for value, mini in zip([1.0, 1.0, jnp.inf, jnp.nan, 1.0, 1.0], expected_mini_step,
                         strict=True):
    updates, opt_state = opt_update({"a": jnp.full([], value)}, opt_state, params)
    assert int(opt_state.mini_step) == mini
    params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["a"], -2.0)


@pytest.mark.parametrize(("upd_dtype", "param_dtype"), [
    (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.bfloat16),
    (jnp.float32, jnp.bfloat16)])
def test_dropin_mixed_precision_dtypes_match_the_inner_optimizer(upd_dtype, param_dtype):
  opt = optax.adam(0.1)
  ms = jaxaccum.MultiSteps(opt, 2)
  params = {"w": jnp.ones((3, 2), param_dtype)}
  grads = {"w": jnp.full((3, 2), 0.5, upd_dtype)}
  opt_state, ms_state = opt.init(params), ms.init(params)
  opt_update, ms_update = jax.jit(opt.update), jax.jit(ms.update)
  for _ in range(3):
    updates, opt_state = opt_update(grads, opt_state, params)
    ms_updates, ms_state = ms_update(grads, ms_state, params)
    assert jax.tree.map(lambda x: x.dtype, ms_updates) == jax.tree.map(lambda x: x.dtype,
                                                                       updates)
    chex.assert_trees_all_equal_dtypes(ms_state, ms.init(params))
    new = optax.apply_updates(params, ms_updates)
    assert new["w"].dtype == params["w"].dtype
    params = new


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_unweighted_calls_match_optax_call_by_call(use_grad_mean):
  # A schedule, an inner optimizer with state, and every state field optax has.
  params = {"a": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
  schedule = lambda step: jnp.where(step < 1, 2, 3)  # noqa: E731
  states, outs = {}, {}
  for label, cls in CLASSES.items():
    ms = cls(optax.adam(0.1), schedule, use_grad_mean=use_grad_mean)
    update = jax.jit(ms.update)
    state, outs[label] = ms.init(params), []
    for i in range(11):
      g = jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape), params)
      u, state = update(g, state, params)
      outs[label].append((u, state.mini_step, state.gradient_step, state.inner_opt_state,
                          state.acc_grads))
    states[label] = state
  # Equal up to float32 round-off (the inner update is fused differently).
  assert_close(outs["jaxaccum"], outs["optax"], rtol=1e-6)
  assert int(states["jaxaccum"].gradient_step) == 4


# ----------------------------------------------------------------------------------------
# Transformations and integrations.


def test_runs_in_lax_scan_without_retracing():
  params, batches = lm.init_params(jax.random.key(0)), lm_batches()
  ms = jaxaccum.MultiSteps(optax.adam(3e-2), K)

  def body(carry, mb):
    p, s = carry
    updates, s = ms.update(jax.grad(lm.token_loss_mean)(p, mb), s, p,
                           weight=lm.num_tokens(mb))
    return (optax.apply_updates(p, updates), s), None

  @jax.jit
  @chex.assert_max_traces(n=1)
  def train(p, s, batch):
    split = jaxaccum.split_micro_batches(batch, num_micro_batches=K)
    return jax.lax.scan(body, (p, s), split)[0]

  p, s = params, ms.init(params)
  for batch in batches:
    p, s = train(p, s, batch)
  ref, _ = train_per_micro_batch(ms, params, batches, lm.token_loss_mean,
                                 weight_fn=lm.num_tokens)
  assert_close(p, ref[-1])
  full, _ = train_per_batch(optax.adam(3e-2), params, batches, jax.grad(lm.token_loss_mean))
  assert_close(p, full[-1])


def test_update_under_vmap():
  ms = jaxaccum.MultiSteps(optax.identity(), 2)
  state = ms.init(jnp.zeros(2))
  grads = jnp.arange(6.0).reshape(3, 2)
  weights = jnp.array([0.0, 1.0, 2.0])
  _, states = jax.jit(jax.vmap(lambda g, w: ms.update(g, state, weight=w)))(grads, weights)
  np.testing.assert_array_equal(states.acc_weight, weights)
  np.testing.assert_array_equal(states.acc_grads, jnp.where(weights[:, None] > 0, grads, 0))


class _Scale:
  """An inner optimizer that needs an extra keyword argument."""

  def __new__(cls):
    def update(updates, state, params=None, *, factor):
      return jax.tree.map(lambda u: u * factor, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_extra_keyword_arguments_reach_the_inner_optimizer(cls):
  ms = cls(_Scale(), 2)
  update = jax.jit(lambda g, s, f: ms.update(g, s, factor=f))
  state = ms.init(jnp.zeros(2))
  _, state = update(jnp.array([1.0, 2.0]), state, 10.0)
  out, state = update(jnp.array([3.0, 4.0]), state, -1.0)
  np.testing.assert_allclose(out, [-2.0, -3.0])


def test_weight_passes_through_chain_and_an_outer_inject_hyperparams():
  inner = lambda learning_rate: jaxaccum.MultiSteps(  # noqa: E731
      optax.sgd(learning_rate), 2).gradient_transformation()
  for tx in (optax.chain(optax.identity(), inner(1.0)),
             optax.inject_hyperparams(inner)(learning_rate=1.0)):
    params = jnp.zeros(2)
    update = jax.jit(lambda g, s, w, tx=tx, p=params: tx.update(g, s, p, weight=w))
    state = tx.init(params)
    _, state = update(jnp.array([4.0, 0.0]), state, 1)
    out, state = update(jnp.array([0.0, 4.0]), state, 3)
    np.testing.assert_allclose(out, [-1.0, -3.0])


def test_inner_inject_hyperparams_schedule_counts_optimizer_steps():
  params, batches = lm.init_params(jax.random.key(0)), lm_batches()
  make = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=warmup_cosine())  # noqa: E731
  full, full_state = train_per_batch(make(), params, batches, jax.grad(lm.token_loss_mean))
  ours, state = train_per_micro_batch(jaxaccum.MultiSteps(make(), K), params, batches,
                                      lm.token_loss_mean, weight_fn=lm.num_tokens)
  assert_close(ours[-1], full[-1])
  inner = state.inner_opt_state
  assert int(inner.count) == STEPS
  np.testing.assert_allclose(inner.hyperparams["learning_rate"], warmup_cosine()(STEPS - 1))
  np.testing.assert_allclose(inner.hyperparams["learning_rate"],
                             full_state.hyperparams["learning_rate"])


class _TinyLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(lm.VOCAB, lm.DIM, rngs=rngs)
    self.out = nnx.Linear(lm.DIM, lm.VOCAB, rngs=rngs)

  def __call__(self, tokens):
    return self.out(self.embed(tokens))


def _nnx_token_loss(model, batch):
  tokens = batch["tokens"]
  ce = optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:])
  mask = lm.target_mask(batch)
  return jnp.sum(ce * mask) / jnp.sum(mask)


def test_as_the_tx_of_nnx_optimizer_with_weight_forwarded():
  batches = lm_batches()
  model = _TinyLM(nnx.Rngs(0))
  ref_model = nnx.clone(model)
  optimizer = nnx.Optimizer(model, jaxaccum.MultiSteps(optax.adam(3e-2), K), wrt=nnx.Param)
  ref_optimizer = nnx.Optimizer(ref_model, optax.adam(3e-2), wrt=nnx.Param)

  @nnx.jit
  def micro_step(model, optimizer, mb):
    grads = nnx.grad(_nnx_token_loss)(model, mb)
    optimizer.update(model, grads, weight=lm.num_tokens(mb))

  @nnx.jit
  def full_step(model, optimizer, batch):
    optimizer.update(model, nnx.grad(_nnx_token_loss)(model, batch))

  for batch in batches:
    split = jaxaccum.split_micro_batches(batch, num_micro_batches=K)
    for i in range(K):
      micro_step(model, optimizer, micro_batch(split, i))
    full_step(ref_model, ref_optimizer, batch)
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
  assert int(optimizer.opt_state.gradient_step[...]) == STEPS


# ----------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("k", [0, -3])
def test_every_k_below_one_is_rejected(k):
  with pytest.raises(ValueError, match=rf"every_k_schedule must be a positive int.*"
                                       rf"every_k_schedule={k}"):
    jaxaccum.MultiSteps(optax.sgd(0.1), k)


@pytest.mark.parametrize("k", [2.5, "4", True, None])
def test_every_k_of_the_wrong_type_is_rejected(k):
  with pytest.raises(TypeError, match=re.escape(f"every_k_schedule={k!r}")):
    jaxaccum.MultiSteps(optax.sgd(0.1), k)


def test_a_schedule_returning_zero_fails_when_the_step_runs():
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), lambda step: jnp.where(step < 1, 1, 0))
  update = jax.jit(ms.update)
  _, state = update(jnp.ones(2), ms.init(jnp.zeros(2)))
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"every_k_schedule returned 0 at gradient_step=1"):
    jax.block_until_ready(update(jnp.ones(2), state))


@pytest.mark.parametrize("weight", [jnp.ones(2), np.ones((1,)), [1, 2]])
def test_non_scalar_weight_is_rejected(weight):
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), 2)
  with pytest.raises(TypeError, match=r"weight must be a scalar.*shape"):
    jax.jit(lambda s: ms.update(jnp.ones(2), s, weight=weight))(ms.init(jnp.zeros(2)))


@pytest.mark.parametrize("weight", [True, jnp.array(1 + 2j), "3"])
def test_weight_of_the_wrong_type_is_rejected(weight):
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), 2)
  with pytest.raises(TypeError, match=r"weight must"):
    ms.update(jnp.ones(2), ms.init(jnp.zeros(2)), weight=weight)


@pytest.mark.parametrize("weight", [-1, -0.5, float("nan")])
def test_negative_python_weight_is_rejected_at_trace_time(weight):
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), 2)
  with pytest.raises(ValueError, match=r"weight must be non-negative.*got weight="):
    jax.jit(lambda s: ms.update(jnp.ones(2), s, weight=weight))(ms.init(jnp.zeros(2)))


def test_negative_traced_weight_fails_when_the_step_runs():
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), 2)
  update = jax.jit(lambda s, w: ms.update(jnp.ones(2), s, weight=w))
  state = ms.init(jnp.zeros(2))
  jax.block_until_ready(update(state, jnp.float32(2.0)))
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"weight must be non-negative.*got weight=-2\.0"):
    jax.block_until_ready(update(state, jnp.float32(-2.0)))


@pytest.mark.parametrize("first_weighted", [True, False])
def test_mixing_weighted_and_unweighted_calls_in_a_window_is_an_error(first_weighted, caplog,
                                                                      capfd):
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), 3)
  weighted = jax.jit(lambda s: ms.update(jnp.ones(2), s, weight=2))
  unweighted = jax.jit(lambda s: ms.update(jnp.ones(2), s))
  first, second = (weighted, unweighted) if first_weighted else (unweighted, weighted)
  _, state = first(ms.init(jnp.zeros(2)))
  capfd.readouterr()
  # Under jit: the step's error ends with the ValueError and the whole message, and
  # nothing else is printed or logged before it (no second traceback from the callback).
  with pytest.raises(jax.errors.JaxRuntimeError) as raised:
    jax.block_until_ready(second(state))
  last = str(raised.value).strip().splitlines()[-1]
  assert re.fullmatch(
      r"ValueError: MultiSteps: refused when the compiled step ran: MultiSteps.update was "
      r"called with(out)? weight= after 1 call\(s\) with(out)? it in the same window: "
      r"weighted and unweighted calls cannot be mixed in one accumulation window. Pass "
      r"weight= on every call of the window, or on none.", last), last
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
  assert capfd.readouterr().err == ""
  # Eagerly, the same check raises the ValueError itself.
  with pytest.raises(ValueError, match=r"cannot be mixed in one accumulation window"):
    ms.update(jnp.ones(2), state, **({} if first_weighted else {"weight": 2}))


def test_other_bad_options_are_rejected():
  with pytest.raises(TypeError, match=r"accumulator_dtype must be a floating dtype"):
    jaxaccum.MultiSteps(optax.sgd(0.1), 2, accumulator_dtype=jnp.int32)
  with pytest.raises(TypeError, match=r"opt must be an optax.GradientTransformation"):
    jaxaccum.MultiSteps(lambda g: g, 2)
  with pytest.raises(TypeError, match=r"use_grad_mean must be a bool"):
    jaxaccum.MultiSteps(optax.sgd(0.1), 2, use_grad_mean="yes")
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), 2,
                           should_skip_update_fn=lambda u, step, p: (jnp.int32(0), ()))
  with pytest.raises(ValueError, match=r"should_skip_update_fn must return a boolean scalar"):
    ms.update(jnp.ones(2), ms.init(jnp.zeros(2)))
