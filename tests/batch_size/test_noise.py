"""jaxaccum.NoiseScale against an EMA sequence computed by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum


def make_info(b, big, micro, batch, num_samples=4):
  return jaxaccum.AccumInfo(
      num_micro_batches=jnp.int32(num_samples), micro_batch_size=jnp.float32(b),
      batch_size=jnp.float32(big), micro_grad_sq_norm=jnp.float32(micro),
      batch_grad_sq_norm=jnp.float32(batch), num_samples=jnp.int32(num_samples),
      skipped=jnp.int32(0))


# (b, B, mean |g_i|^2, |G_B|^2, samples): the third step has a single sample (NaN
# estimates), the fifth an overflow to inf; both must be left out.
STEPS = [(8, 32, 3.0, 1.5, 4), (8, 32, 2.0, 1.8, 4), (16, 16, 2.5, 2.5, 1),
         (4, 32, 5.0, 0.5, 8), (8, 32, 3e38, -3e38, 4), (8, 16, 1.0, 1.2, 2)]


def hand_sequence(decay):
  """(count, |G|^2, tr(Sigma), B_simple) after each step, in float64."""
  ema_g, ema_t, count, out = 0.0, 0.0, 0, []
  for b, big, micro, batch, n in STEPS:
    if n > 1 and abs(micro) < 1e30:
      g2 = (big * batch - b * micro) / (big - b)
      tr = (micro - batch) / (1 / b - 1 / big)
      ema_g = decay * ema_g + (1 - decay) * g2
      ema_t = decay * ema_t + (1 - decay) * tr
      count += 1
    corr = 1 - decay**count
    out.append((count, ema_g / corr, ema_t / corr, ema_t / ema_g))
  return out


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.99])
def test_matches_a_hand_computed_ema_sequence(decay):
  ns = jaxaccum.NoiseScale(decay=decay)
  update = jax.jit(ns.update)
  state = ns.init()
  assert np.isnan(ns.b_simple(state)) and np.isnan(ns.grad_sq_norm(state))
  for step, expected in zip(STEPS, hand_sequence(decay), strict=True):
    state = update(state, make_info(*step))
    count, g2, tr, b_simple = expected
    assert int(state.count) == count
    chex.assert_trees_all_close(
        (ns.grad_sq_norm(state), ns.trace_cov(state), ns.b_simple(state)),
        (np.float32(g2), np.float32(tr), np.float32(b_simple)), rtol=1e-5)
  # With decay 0 the averages are the last finite step's estimates.
  if decay == 0.0:
    info = make_info(*STEPS[-1])
    chex.assert_trees_all_close(ns.b_simple(state), info.b_simple(), rtol=1e-6)


def test_bias_correction_removes_the_pull_towards_zero():
  # A constant estimate: the corrected averages equal it from the first step; the raw
  # EMA is (1 - decay**t) times it.
  ns = jaxaccum.NoiseScale(decay=0.9)
  info = make_info(8, 32, 3.0, 1.5)  # |G|^2 = 1, tr(Sigma) = 16
  state = ns.init()
  for t in range(1, 4):
    state = ns.update(state, info)
    chex.assert_trees_all_close((ns.grad_sq_norm(state), ns.trace_cov(state)),
                                (np.float32(1.0), np.float32(16.0)), rtol=1e-5)
    chex.assert_trees_all_close(state.grad_sq_norm_ema, np.float32(1 - 0.9**t), rtol=1e-5)


def test_scan_over_steps_equals_the_python_loop():
  ns = jaxaccum.NoiseScale(decay=0.8)
  infos = [make_info(*s) for s in STEPS]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *infos)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def scan(state, stacked):
    return jax.lax.scan(lambda s, i: (ns.update(s, i), ns.b_simple(ns.update(s, i))),
                        state, stacked)

  final, b_simples = scan(ns.init(), stacked)
  state = ns.init()
  for i, info in enumerate(infos):
    state = ns.update(state, info)
    chex.assert_trees_all_close(b_simples[i], ns.b_simple(state), rtol=1e-6)
  chex.assert_trees_all_close(final, state, rtol=1e-6)


@pytest.mark.parametrize(("decay", "error", "match"), [
    (1.0, ValueError, r"decay must be in \[0, 1\).*got decay=1.0"),
    (-0.1, ValueError, r"got decay=-0.1"),
    ("0.9", TypeError, r"decay must be a float in \[0, 1\), got '0.9'"),
    (True, TypeError, r"got True of type bool"),
])
def test_bad_decay_is_rejected(decay, error, match):
  with pytest.raises(error, match=match):
    jaxaccum.NoiseScale(decay=decay)


def test_update_needs_an_accum_info_of_one_step():
  ns = jaxaccum.NoiseScale()
  with pytest.raises(TypeError, match=r"takes the step's jaxaccum.AccumInfo.*got dict"):
    ns.update(ns.init(), {"b_simple": 1.0})
  batched = jax.tree.map(lambda *x: jnp.stack(x), make_info(*STEPS[0]), make_info(*STEPS[1]))
  with pytest.raises(TypeError, match=r"AccumInfo of one step.*shape \(2,\)"):
    ns.update(ns.init(), batched)
