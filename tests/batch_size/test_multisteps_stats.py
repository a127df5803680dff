"""jaxaccum.MultiSteps: noise-scale statistics, skipped non-finite calls, ramps, loss terms.

References are hand computations: per-call gradients from ``jax.grad`` on explicitly
sliced micro-batches (``x[i::K]``), their squared norms summed in numpy, the estimators
written out from their formulas (jaxaccum/_core/_info.py), and windows built without the
skipped calls. Float32 throughout; ``rtol=1e-5`` covers summation order.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum
from tests import _multisteps_lm as lm

K = 4


def mlp_init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (5, 8)) / 2, "b1": jnp.full((8,), 0.1, jnp.float32),
          "w2": jax.random.normal(k2, (8, 3)) / 3, "b2": jnp.zeros((3,))}


def mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def mlp_batch(seed, rows):
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (rows, 5)), "y": jax.random.normal(ky, (rows, 3))}


def sq_norm(tree):
  return sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(tree))


def estimates(b, big, micro, batch):
  """The estimators of jaxaccum/_core/_info.py, written out."""
  g2 = (big * batch - b * micro) / (big - b)
  tr = (micro - batch) / (1 / b - 1 / big)
  return g2, tr


def run(ms, calls, params=None, **kwargs):
  """Feeds ``calls`` (``(grads, kwargs)`` pairs) to ``ms``; returns updates and states."""
  update = jax.jit(lambda g, s, kw: ms.update(g, s, params, **kw))
  state = ms.init(params if params is not None else calls[0][0])
  outs, states = [], []
  for g, kw in calls:
    u, state = update(g, state, kw)
    outs.append(u)
    states.append(state)
  return outs, states


# ----------------------------------------------------------------------------------------
# Statistics.


def test_statistics_of_an_mlp_window_equal_the_micro_batch_gradients_by_hand():
  params, batch = mlp_init(jax.random.key(0)), mlp_batch(1, 32)
  micro = [jax.tree.map(lambda x, i=i: x[i::K], batch) for i in range(K)]  # 8 rows each
  grad_fn = jax.jit(jax.grad(mlp_loss))
  grads = [grad_fn(params, mb) for mb in micro]
  ms = jaxaccum.MultiSteps(optax.sgd(0.1), K, with_info=True, micro_batch_size=8)
  outs, states = run(ms, [(g, {}) for g in grads], params)
  for s in states[:-1]:  # no window completed: an empty info, NaN estimates
    assert int(s.info.num_micro_batches) == 0 and int(s.info.num_samples) == 0
    assert np.isnan(s.info.b_simple())
  info = states[-1].info
  micro_sq = np.mean([sq_norm(g) for g in grads])
  full = grad_fn(params, batch)  # equal sizes: the mean of the micro gradients
  batch_sq = sq_norm(full)
  assert micro_sq > 1.5 * batch_sq  # the micro-batch gradients really are noisy
  chex.assert_trees_all_close(
      (info.num_micro_batches, info.micro_batch_size, info.batch_size, info.num_samples,
       info.skipped, info.micro_grad_sq_norm, info.batch_grad_sq_norm),
      (K, 8.0, 32.0, K, 0, micro_sq, batch_sq), rtol=1e-5)
  g2, tr = estimates(8, 32, micro_sq, batch_sq)
  chex.assert_trees_all_close((info.grad_sq_norm_estimate(), info.trace_cov_estimate(),
                               info.b_simple()), (g2, tr, tr / g2), rtol=1e-4)
  chex.assert_trees_all_close(outs[-1], jax.tree.map(lambda g: -0.1 * g, full), rtol=1e-5,
                              atol=1e-8)
  # The same statistics as accumulation inside one step.
  _, _, core = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=K,
                                               with_info=True))(params, batch)
  chex.assert_trees_all_close(info._replace(terms=None), core._replace(terms=None), rtol=1e-5)


def test_without_with_info_the_statistics_stay_empty_and_updates_are_unchanged():
  g = [jnp.array([float(i), 2.0 - i]) for i in range(4)]
  outs = {}
  for with_info in (False, True):
    ms = jaxaccum.MultiSteps(optax.adam(0.1), 2, with_info=with_info)
    outs[with_info], states = run(ms, [(gi, {}) for gi in g])
    if not with_info:
      for s in states:
        chex.assert_trees_all_equal(s.info, ms.init(g[0]).info)
        assert (int(s.num_samples), float(s.acc_grad_sq_norm)) == (0, 0.0)
  chex.assert_trees_all_equal(outs[False], outs[True])


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_weighted_statistics_use_the_weights_as_sizes(use_grad_mean):
  # Weights 2, 0, 5, 1: the weight-0 call (NaN gradient: a mean over no tokens) is no
  # sample; B is the total weight and b the harmonic mean of the samples' weights.
  g = [{"a": jnp.array([1.0, -2.0]), "b": jnp.float32(0.5)},
       {"a": jnp.array([jnp.nan, 1.0]), "b": jnp.float32(jnp.nan)},
       {"a": jnp.array([3.0, 0.5]), "b": jnp.float32(-1.0)},
       {"a": jnp.array([-4.0, 8.0]), "b": jnp.float32(2.0)}]
  weights = [2, 0, 5.0, jnp.int32(1)]
  ms = jaxaccum.MultiSteps(optax.identity(), 4, use_grad_mean=use_grad_mean, with_info=True)
  outs, states = run(ms, [(gi, {"weight": w}) for gi, w in zip(g, weights, strict=True)])
  info = states[-1].info
  used = [0, 2, 3]
  w = np.array([2.0, 5.0, 1.0])
  mean = jax.tree.map(lambda *x: sum(wi * xi for wi, xi in zip(w, x, strict=True)) / 8,
                      *[g[i] for i in used])
  micro_sq = np.mean([sq_norm(g[i]) for i in used])
  b = 3 / np.sum(1 / w)
  chex.assert_trees_all_close(
      (info.num_micro_batches, info.num_samples, info.batch_size, info.micro_batch_size,
       info.micro_grad_sq_norm, info.batch_grad_sq_norm),
      (4, 3, 8.0, b, micro_sq, sq_norm(mean)), rtol=1e-5)
  g2, tr = estimates(b, 8.0, micro_sq, sq_norm(mean))
  chex.assert_trees_all_close((info.grad_sq_norm_estimate(), info.trace_cov_estimate()),
                              (g2, tr), rtol=1e-4)
  expected = mean if use_grad_mean else jax.tree.map(lambda m: 8 * m, mean)
  chex.assert_trees_all_close(outs[-1], expected, rtol=1e-5)


def test_statistics_follow_each_window_of_a_schedule():
  # Windows of 1, 2 and 3 calls: a window of one call has one sample (NaN estimates).
  ms = jaxaccum.MultiSteps(optax.identity(), lambda step: step + 1, with_info=True,
                           micro_batch_size=4)
  g = [jnp.array([float(i), 1.0 - i]) for i in range(6)]
  _, states = run(ms, [(gi, {}) for gi in g])
  emitted = [i for i, s in enumerate(states) if int(s.info.num_micro_batches) > 0]
  assert emitted == [0, 2, 5]
  for end, window in zip(emitted, ([0], [1, 2], [3, 4, 5]), strict=True):
    info = states[end].info
    micro_sq = np.mean([sq_norm(g[i]) for i in window])
    batch_sq = sq_norm(sum(g[i] for i in window) / len(window))
    chex.assert_trees_all_close(
        (info.num_micro_batches, info.batch_size, info.micro_batch_size,
         info.micro_grad_sq_norm, info.batch_grad_sq_norm),
        (len(window), 4.0 * len(window), 4.0, micro_sq, batch_sq), rtol=1e-5)
    if len(window) == 1:
      assert np.isnan(info.grad_sq_norm_estimate()) and np.isnan(info.trace_cov_estimate())
    else:
      chex.assert_trees_all_close(
          (info.grad_sq_norm_estimate(), info.trace_cov_estimate()),
          estimates(4.0, 4.0 * len(window), micro_sq, batch_sq), rtol=1e-5)


def _linear_regression_calls(key, windows, k, rows, dim, noise, weighted):
  """Per-call gradients of 0.5 * mean((x.w - y)^2) for Gaussian x at w - w* = delta.

  For x ~ N(0, I_dim) and y = x.w* + noise * eps, the per-example gradient x (x.delta -
  noise * eps) has mean G = delta and E|g|^2 = (dim + 2)|delta|^2 + dim * noise^2, so
  tr(Sigma) = (dim + 1)|delta|^2 + dim * noise^2. With ``weighted`` each call keeps a
  random number of its rows (1 to rows) and its gradient is the mean over those.
  """
  delta = jnp.linspace(-1.0, 1.0, dim)
  kx, ke, kn = jax.random.split(key, 3)
  x = jax.random.normal(kx, (windows * k, rows, dim))
  r = x @ delta - noise * jax.random.normal(ke, (windows * k, rows))
  per_example = x * r[..., None]
  if weighted:
    n = jax.random.randint(kn, (windows * k,), 1, rows + 1)
  else:
    n = jnp.full((windows * k,), rows)
  mask = jnp.arange(rows)[None, :] < n[:, None]
  grads = jnp.sum(per_example * mask[..., None], axis=1) / n[:, None]
  g2 = float(jnp.sum(delta**2))
  tr = (dim + 1) * g2 + dim * noise**2
  return grads, n.astype(jnp.float32), g2, tr


@pytest.mark.parametrize("weighted", [False, True])
def test_estimates_are_unbiased_on_gaussian_linear_regression(weighted):
  # The mean of the per-window estimates over many windows lies within a few standard
  # errors of the closed-form |G|^2 and tr(Sigma) (fixed seeds: deterministic).
  windows, k, rows, dim, noise = 2000, 4, 8, 3, 0.5
  grads, n, g2, tr = _linear_regression_calls(jax.random.key(7), windows, k, rows, dim,
                                              noise, weighted)
  ms = jaxaccum.MultiSteps(optax.identity(), k, with_info=True,
                           micro_batch_size=None if weighted else rows)

  @jax.jit
  def all_windows(grads, n):
    def body(state, gn):
      g, w = gn
      _, state = ms.update(g, state, **({"weight": w} if weighted else {}))
      return state, (state.info.grad_sq_norm_estimate(), state.info.trace_cov_estimate(),
                     state.info.num_micro_batches)
    return jax.lax.scan(body, ms.init(grads[0]), (grads, n))[1]

  est_g2, est_tr, emitted = all_windows(grads, n)
  keep = np.asarray(emitted) > 0
  assert keep.sum() == windows
  for name, est, exact in (("|G|^2", est_g2, g2), ("tr(Sigma)", est_tr, tr)):
    est = np.asarray(est)[keep]
    se = est.std(ddof=1) / np.sqrt(windows)
    assert abs(est.mean() - exact) < 4 * se, (name, est.mean(), exact, se)
    assert se < 0.1 * exact, (name, se, exact)  # the check has power


def test_noise_scale_tracks_multisteps_windows():
  # NoiseScale.update on every call counts only the calls that complete a window.
  ms = jaxaccum.MultiSteps(optax.identity(), 3, with_info=True, micro_batch_size=2)
  ns = jaxaccum.NoiseScale(decay=0.5)
  g = [jnp.array([np.sin(i), np.cos(3 * i)]) for i in range(9)]
  @jax.jit
  def update(gi, s, n):
    _, s = ms.update(gi, s)
    return s, ns.update(n, s.info)

  state, nstate = ms.init(g[0]), ns.init()
  ref = []
  for gi in g:
    state, nstate = update(gi, state, nstate)
    if bool(ms.has_updated(state)):
      ref.append((state.info.grad_sq_norm_estimate(), state.info.trace_cov_estimate()))
  assert int(nstate.count) == len(ref) == 3
  ema = np.zeros(2)
  for x in ref:
    ema = 0.5 * ema + 0.5 * np.asarray(x)
  chex.assert_trees_all_close(
      (ns.grad_sq_norm(nstate), ns.trace_cov(nstate)), tuple(ema / (1 - 0.5**3)), rtol=1e-5)


# ----------------------------------------------------------------------------------------
# skip_nonfinite.


def _grads(i, bad=None):
  g = {"a": jnp.array([1.0 + i, -2.0 * i]), "b": jnp.float32(0.5 * i - 1)}
  if bad is not None:
    g["a"] = g["a"].at[1].set(bad)
  return g


@pytest.mark.parametrize("weighted", [False, True])
def test_a_window_with_a_nonfinite_call_equals_the_window_without_it(weighted):
  # Two windows of 3 good calls under adam, with bad calls at the start, the middle and
  # where the window would complete: each is dropped, and everything else is as if the
  # bad calls never came.
  good = [(_grads(i), {"weight": float(i + 1)} if weighted else {}) for i in range(6)]
  bad_grads = [(_grads(9, jnp.nan), {"weight": 2.0} if weighted else {}),
               (_grads(9, jnp.inf), {"weight": 3.0} if weighted else {}),
               (_grads(9, -jnp.inf), {"weight": 1.0} if weighted else {})]
  if weighted:  # a finite gradient with a NaN or infinite weight is bad too
    bad_grads[1] = (_grads(9), {"weight": jnp.nan})
    bad_grads[2] = (_grads(9), {"weight": jnp.inf})
  with_bad = [bad_grads[0], *good[:2], bad_grads[1], good[2], good[3], good[4],
              bad_grads[2], good[5]]
  params = _grads(0)
  make = lambda: jaxaccum.MultiSteps(optax.adam(0.1), 3, skip_nonfinite=True,  # noqa: E731
                                    with_info=True)
  ref_outs, ref_states = run(make(), good, params)
  outs, states = run(make(), with_bad, params)
  is_bad = [any(c is b for b in bad_grads) for c in with_bad]
  zeros = jax.tree.map(jnp.zeros_like, params)
  kept_outs = [o for o, b in zip(outs, is_bad, strict=True) if not b]
  kept_states = [s for s, b in zip(states, is_bad, strict=True) if not b]
  for o, b in zip(outs, is_bad, strict=True):
    if b:
      chex.assert_trees_all_equal(o, zeros)
  chex.assert_trees_all_close(kept_outs, ref_outs, rtol=1e-6)
  counters = {"skipped": 0, "window_skipped": 0, "info": ()}
  chex.assert_trees_all_close([s._replace(**counters) for s in kept_states],
                              [s._replace(**counters) for s in ref_states], rtol=1e-6)
  # The window's info equals the clean one but counts its dropped calls.
  for s, r, skipped in ((kept_states[2], ref_states[2], 2), (kept_states[5], ref_states[5], 1)):
    chex.assert_trees_all_close(
        s.info, r.info._replace(skipped=jnp.int32(skipped),
                                num_micro_batches=r.info.num_micro_batches + skipped),
        rtol=1e-6)
  assert int(states[-1].skipped) == 3 and int(states[-1].window_skipped) == 0
  assert [int(s.skipped) for s in states] == [1, 1, 1, 2, 2, 2, 2, 3, 3]
  assert int(states[-1].gradient_step) == 2
  # The control: without skip_nonfinite the bad calls poison the window.
  plain_outs, _ = run(jaxaccum.MultiSteps(optax.adam(0.1), 3), with_bad[:3], params)
  assert np.isnan(np.asarray(plain_outs[2]["a"])).any()


def test_weight_zero_call_with_nan_gradient_is_not_counted_as_skipped():
  ms = jaxaccum.MultiSteps(optax.identity(), 2, skip_nonfinite=True, with_info=True)
  outs, states = run(ms, [(jnp.array([2.0]), {"weight": 1}),
                          (jnp.array([jnp.nan]), {"weight": 0})])
  chex.assert_trees_all_equal(outs[-1], jnp.array([2.0]))
  assert int(states[-1].skipped) == 0 and int(states[-1].info.num_samples) == 1


def test_python_nan_weight_is_skipped_with_skip_nonfinite_and_rejected_without():
  ms = jaxaccum.MultiSteps(optax.identity(), 2, skip_nonfinite=True)
  state = ms.init(jnp.zeros(1))
  out, after = ms.update(jnp.array([1.0]), state, weight=float("nan"))
  chex.assert_trees_all_equal(out, jnp.zeros(1))
  assert int(after.skipped) == 1 and int(after.mini_step) == 0
  with pytest.raises(ValueError, match=r"weight must be non-negative.*got weight=-1"):
    ms.update(jnp.array([1.0]), state, weight=-1.0)
  with pytest.raises(ValueError, match=r"weight must be non-negative.*got weight=nan"):
    jaxaccum.MultiSteps(optax.identity(), 2).update(jnp.array([1.0]), state,
                                                    weight=float("nan"))


def test_an_all_bad_stream_never_emits_and_never_crashes():
  ms = jaxaccum.MultiSteps(optax.sgd(1.0), 2, skip_nonfinite=True)
  outs, states = run(ms, [(jnp.full(2, jnp.nan), {})] * 3)
  chex.assert_trees_all_equal(outs, [jnp.zeros(2)] * 3)
  assert int(states[-1].skipped) == 3 and int(states[-1].gradient_step) == 0
  chex.assert_trees_all_equal(states[-1].acc_grads, jnp.zeros(2))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"skip_nonfinite": 1}, TypeError, r"skip_nonfinite must be a bool, got skip_nonfinite=1"),
    ({"with_info": "yes"}, TypeError, r"with_info must be a bool, got with_info='yes'"),
    ({"micro_batch_size": 8}, ValueError, r"micro_batch_size=8 is used only by the "
                                          r"statistics; pass with_info=True"),
    ({"micro_batch_size": 0, "with_info": True}, ValueError,
     r"micro_batch_size must be a positive number.*got micro_batch_size=0"),
    ({"micro_batch_size": float("inf"), "with_info": True}, ValueError,
     r"got micro_batch_size=inf"),
    ({"micro_batch_size": "8"}, TypeError, r"micro_batch_size must be a positive number"),
    ({"micro_batch_size": True}, TypeError, r"micro_batch_size must be a positive number"),
])
def test_bad_statistics_and_skip_options_are_rejected(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxaccum.MultiSteps(optax.sgd(0.1), 2, **kwargs)


# ----------------------------------------------------------------------------------------
# batch_size_ramp as every_k_schedule.


def test_ramp_drives_windows_of_changing_length_equal_to_full_batches():
  # k = 1, 2, 2, 4: each window of k micro-batches of 4 rows equals one SGD step on the
  # full batch of its 4k rows.
  ramp = jaxaccum.batch_size_ramp(init_value=1, boundaries_and_values={1: 2, 3: 4})
  ks = [1, 2, 2, 4]
  params = mlp_init(jax.random.key(0))
  ms = jaxaccum.MultiSteps(optax.sgd(0.5), every_k_schedule=ramp, with_info=True,
                           micro_batch_size=4)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def micro_step(p, s, mb):
    updates, s = ms.update(jax.grad(mlp_loss)(p, mb), s, p)
    return optax.apply_updates(p, updates), s

  @jax.jit
  def full_step(p, batch):
    return jax.tree.map(lambda w, g: w - 0.5 * g, p, jax.grad(mlp_loss)(p, batch))

  p, ref, state = params, params, ms.init(params)
  for step, k in enumerate(ks):
    assert int(ramp(state.gradient_step)) == k
    batch = mlp_batch(100 + step, 4 * k)
    for i in range(k):
      p, state = micro_step(p, state, jax.tree.map(lambda x, i=i, k=k: x[i::k], batch))
      assert bool(ms.has_updated(state)) == (i == k - 1)
    ref = full_step(ref, batch)
    chex.assert_trees_all_close(p, ref, rtol=1e-5, atol=1e-7)
    assert int(state.info.num_micro_batches) == k
    assert float(state.info.batch_size) == 4.0 * k
  assert int(state.gradient_step) == len(ks)


# ----------------------------------------------------------------------------------------
# Several loss terms across calls: the documented recipe.


def test_several_loss_terms_recipe_equals_the_full_batch_total():
  # total = token mean of the cross-entropy over the window
  #       + 0.01 * (mean over micro-batches of a per-micro-batch statistic)
  #       + 1e-3 * (sum over the window of a z-loss-like sum).
  # Recipe (docs/multisteps.md): use_grad_mean=False and feed each call the gradient of
  # ce_sum_i / W + 0.01 * lb_i / K + 1e-3 * z_i, where W is the window's token total.
  params = lm.init_params(jax.random.key(0))
  batch = lm.make_batch(jax.random.key(5), [7, 2, 1, 5, 7, 3, 2, 6])

  def terms(p, b):
    tokens = b["tokens"]
    logits = jnp.take(p["embed"], tokens[:, :-1], axis=0) @ p["out"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    mask = lm.target_mask(b)
    probs = jax.nn.softmax(logits)
    lb = jnp.sum(jnp.mean(probs, axis=(0, 1)) ** 2)  # a statistic of the micro-batch
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * mask)
    return jnp.sum(ce * mask), jnp.sum(mask), lb, z

  micro = [jax.tree.map(lambda x, i=i: x[i::K], batch) for i in range(K)]

  def reference(p):  # written from the definition, slicing by hand
    parts = [terms(p, mb) for mb in micro]
    ce = sum(c for c, _, _, _ in parts) / sum(n for _, n, _, _ in parts)
    lb = sum(lb for _, _, lb, _ in parts) / K
    z = sum(z for _, _, _, z in parts)
    return ce + 0.01 * lb + 1e-3 * z

  def wrong(p):  # the load-balancing term without its 1 / K
    return reference(p) + 0.01 * (K - 1) * sum(terms(p, mb)[2] for mb in micro) / K

  total_tokens = sum(terms(params, mb)[1] for mb in micro)

  def call_loss(p, mb):
    ce_sum, _, lb, z = terms(p, mb)
    return ce_sum / total_tokens + 0.01 * lb / K + 1e-3 * z

  ms = jaxaccum.MultiSteps(optax.identity(), K, use_grad_mean=False)
  call_grad = jax.jit(jax.grad(call_loss))
  outs, _ = run(ms, [(call_grad(params, mb), {}) for mb in micro], params)
  expected, not_expected = jax.jit(lambda p: (jax.grad(reference)(p), jax.grad(wrong)(p)))(
      params)
  chex.assert_trees_all_close(outs[-1], expected, rtol=1e-5, atol=1e-7)
  with pytest.raises(AssertionError):  # the load-balancing term's normalisation matters
    chex.assert_trees_all_close(outs[-1], not_expected, rtol=1e-5, atol=1e-7)
