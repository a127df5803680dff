"""jaxaccum.evaluate against the full batch through ``fun`` and against hand-sliced loops.

``evaluate`` runs the core of ``value_and_grad`` with nothing differentiated, so every
reduction rule is checked here against what ``fun`` returns on the whole batch, or, where
the rule is about micro-batches (state threaded in order, keys folded, skipped or inactive
micro-batches, per-shard rules), against a Python loop over micro-batches taken by explicit
slicing (``x[i::N]`` is micro-batch ``i`` of ``N``). Tolerances: float32, rtol 1e-5 (the
same terms summed in another order).

The last part translates the tests of ``optax.microbatch`` (optax's
``microbatching/_microbatching_test.py``) that have a counterpart: optax reduces every output
with an accumulator, jaxaccum reduces a scalar value by ``reduce`` and the rest as aux, so
each translated function returns its outputs as aux next to a scalar value.
"""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests import _problems
from tests._problems import micro_batch, micro_batches
from tests.core.test_reduce import optax_accumulator

RTOL, ATOL = 1e-5, 1e-6


def close(actual, expected, rtol=RTOL, atol=ATOL):
  chex.assert_trees_all_close(jax.tree.map(np.asarray, actual),
                              jax.tree.map(np.asarray, expected), rtol=rtol, atol=atol)


def mlp_metrics(params, batch):
  """Mean loss, with per-example and summary metrics as aux."""
  x, y = batch["x"], batch["y"]
  pred = _problems.mlp_apply(params, x)
  per_row = jnp.sum((pred - y) ** 2, axis=-1)
  return jnp.mean(per_row), {
      "rows": per_row,  # concat
      "pred": pred,  # concat, 2-D rows
      "max": jnp.max(per_row),
      "min": jnp.min(per_row),
      "big": jnp.sum(per_row > 1.0),  # int scalar: summed by default
      "all_finite": jnp.all(jnp.isfinite(per_row)),  # bool scalar: AND by default
      "any_big": jnp.any(per_row > 3.0),
      "total": jnp.sum(per_row),
  }


AUX_KINDS = {"rows": "concat", "pred": "concat", "max": "max", "min": "min", "big": None,
             "all_finite": None, "any_big": "any", "total": "sum"}


class FullBatchTest(chex.TestCase):
  """evaluate(fun)(*args) equals fun(*args) on the whole batch, jitted or not."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(("mlp", "mean"), ("mlp", "sum"), ("cnn", "mean"), ("lm", "weighted"),
                            ("lm", "mean"))
  def test_reduce_kinds(self, problem, form):
    p = _problems.make(problem)
    fun = p.fun(form)
    ev = self.variant(jaxaccum.evaluate(fun, num_micro_batches=4, reduce=form))
    want = jax.jit(fun)(p.params, p.batch)
    close(ev(p.params, p.batch), _problems.ratio(want) if form == "weighted" else want)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(1, 2, 16)
  def test_aux_kinds_every_count(self, n):
    p = _problems.make("mlp")
    ev = self.variant(jaxaccum.evaluate(mlp_metrics, num_micro_batches=n, has_aux=True,
                                        aux_reduce=AUX_KINDS))
    value, aux = ev(p.params, p.batch)
    want_value, want_aux = jax.jit(mlp_metrics)(p.params, p.batch)
    close(value, want_value)
    close(aux, want_aux)  # concat rows in batch order, max/min/sum/any exact
    self.assertEqual(aux["big"].dtype, jnp.int32)
    self.assertEqual(aux["all_finite"].dtype, jnp.bool_)

  @chex.variants(with_jit=True, without_jit=True)
  def test_token_weighted_loss_and_metrics_exact_with_uneven_tokens(self):
    # Lengths from 1 to 12 real tokens: micro-batches hold very different token counts,
    # so a mean of per-micro-batch means would be wrong.
    p = _problems.make("lm")
    lengths = np.array([2, 12, 3, 12, 2, 2, 11, 12, 2, 3, 12, 4, 12, 2, 5, 12])
    batch = _problems.lm_batch(jax.random.key(3), 16, lengths)

    def metrics(params, batch):
      nll, mask = _problems.lm_token_losses(params, batch)
      logits = _problems.lm_logits(params, batch["tokens"][:, :-1])
      hit = (jnp.argmax(logits, -1) == batch["tokens"][:, 1:]).astype(jnp.float32)
      n = jnp.sum(mask)
      return ({"loss": (jnp.sum(nll * mask), n), "accuracy": (jnp.sum(hit * mask), n)},
              {"row_loss": jnp.sum(nll * mask, 1), "tokens": jnp.sum(mask).astype(jnp.int32)})

    ev = self.variant(jaxaccum.evaluate(
        metrics, num_micro_batches=4, has_aux=True,
        reduce={"loss": "weighted", "accuracy": "weighted"},
        aux_reduce={"row_loss": "concat", "tokens": None}))
    terms, aux = ev(p.params, batch)
    want, want_aux = jax.jit(metrics)(p.params, batch)
    close(terms, {k: _problems.ratio(v) for k, v in want.items()})
    close(aux, want_aux)

  @chex.variants(with_jit=True, without_jit=True)
  def test_aux_mean_weighted_by_the_single_weighted_term(self):
    p = _problems.make("lm")
    lengths = np.array([2, 12, 3, 12, 2, 2, 11, 12, 2, 3, 12, 4, 12, 2, 5, 12])
    batch = _problems.lm_batch(jax.random.key(5), 16, lengths)

    def loss(params, batch):
      nll, mask = _problems.lm_token_losses(params, batch)
      n = jnp.sum(mask)
      return (jnp.sum(nll * mask), n), {"token_mean": jnp.sum(nll * mask) / n}

    ev = self.variant(jaxaccum.evaluate(loss, num_micro_batches=4, reduce="weighted",
                                        has_aux=True))
    value, aux = ev(p.params, batch)
    (num, den), _ = jax.jit(loss)(p.params, batch)
    close(value, num / den)
    close(aux["token_mean"], num / den)  # a token-weighted mean of micro-batch means

  @chex.variants(with_jit=True, without_jit=True)
  def test_dict_reduce_returns_each_term(self):
    p = _problems.make("mlp")

    def terms(params, batch):
      x, y = batch["x"], batch["y"]
      pred = _problems.mlp_apply(params, x)
      return {"mse": jnp.mean((pred - y) ** 2), "abs_sum": jnp.sum(jnp.abs(pred - y))}

    ev = self.variant(jaxaccum.evaluate(terms, micro_batch_size=2,
                                        reduce={"mse": "mean", "abs_sum": "sum"}))
    close(ev(p.params, p.batch), jax.jit(terms)(p.params, p.batch))

  @chex.variants(with_jit=True, without_jit=True)
  def test_stack_and_optax_accumulator_against_a_hand_sliced_loop(self):
    p = _problems.make("mlp")
    n = 4

    def fun(params, batch):
      loss = _problems.mlp_loss(params, batch)
      return loss, {"per_mb": loss, "concat": _problems.mlp_apply(params, batch["x"])}

    acc = optax_accumulator(optax.microbatching.AccumulationType.CONCAT, n)  # optax's own
    ev = self.variant(jaxaccum.evaluate(fun, num_micro_batches=n, has_aux=True,
                                        aux_reduce={"per_mb": "stack", "concat": acc}))
    _, aux = ev(p.params, p.batch)
    loss_of = jax.jit(_problems.mlp_loss)
    close(aux["per_mb"], jnp.stack([loss_of(p.params, mb) for mb in micro_batches(p.batch, n)]))
    close(aux["concat"], jax.jit(_problems.mlp_apply)(p.params, p.batch["x"]))

  @chex.variants(with_jit=True, without_jit=True)
  def test_state_threaded_in_micro_batch_order(self):
    p = _problems.make("mlp")
    n = 4

    def fun(params, batch, state):
      x = batch["x"]
      loss = _problems.mlp_loss(params, batch)
      # Order-dependent: an exponential moving average of each micro-batch's mean input.
      new = {"ema": 0.5 * state["ema"] + jnp.mean(x, 0), "calls": state["calls"] + 1}
      return loss, (new, {"loss": loss})

    state0 = {"ema": jnp.zeros(5), "calls": jnp.int32(0)}
    ev = self.variant(jaxaccum.evaluate(fun, num_micro_batches=n, has_aux=True,
                                        state_argnums=2))
    value, (state, aux) = ev(p.params, p.batch, state0)
    s = state0
    fun_jit = jax.jit(fun)
    for i in range(n):
      _, (s, _) = fun_jit(p.params, micro_batch(p.batch, i, n), s)
    close(state, s)
    close(value, jax.jit(_problems.mlp_loss)(p.params, p.batch))
    close(aux["loss"], value)

    ev_state_only = self.variant(jaxaccum.evaluate(
        lambda w, b, st: (fun(w, b, st)[0], fun(w, b, st)[1][0]), num_micro_batches=n,
        state_argnums=2))
    value2, state2 = ev_state_only(p.params, p.batch, state0)
    close((value2, state2), (value, s))

  @chex.variants(with_jit=True, without_jit=True)
  def test_keys_folded_per_micro_batch_by_position_and_by_name(self):
    n = 4
    x = jnp.arange(8.0)

    def fun(w, x, key, *, kw_key):
      draw = jax.random.normal(key, ()) + 10 * jax.random.normal(kw_key["k"], ())
      return jnp.mean(x * w), draw

    key, kw = jax.random.key(1), {"k": jax.random.key(2)}
    ev = self.variant(jaxaccum.evaluate(fun, num_micro_batches=n, has_aux=True,
                                        rng_argnums=2, rng_argnames="kw_key",
                                        aux_reduce="stack"))
    _, draws = ev(2.0, x, key, kw_key=kw)
    fun_jit = jax.jit(fun)
    want = jnp.stack([fun_jit(2.0, x[i::n], jax.random.fold_in(key, i),
                              kw_key={"k": jax.random.fold_in(kw["k"], i)})[1]
                      for i in range(n)])
    close(draws, want)

  @chex.variants(with_jit=True, without_jit=True)
  def test_skip_nonfinite_drops_the_bad_micro_batches(self):
    p = _problems.make("mlp")
    n = 4
    # Row 5 is in micro-batch 1 (rows 1, 5, 9, 13).
    batch = {**p.batch, "x": p.batch["x"].at[5].set(jnp.nan)}
    ev = self.variant(jaxaccum.evaluate(mlp_metrics, num_micro_batches=n, has_aux=True,
                                        skip_nonfinite=True,
                                        aux_reduce={**AUX_KINDS, "rows": "stack",
                                                    "pred": "stack"}))
    value, aux = ev(p.params, batch)
    kept = [i for i in range(n) if i != 1]
    metrics_of = jax.jit(mlp_metrics)
    outs = [metrics_of(p.params, micro_batch(batch, i, n)) for i in kept]
    close(value, np.mean([o[0] for o in outs]))
    close(aux["total"], np.sum([o[1]["total"] for o in outs]))
    close(aux["max"], np.max([o[1]["max"] for o in outs]))
    self.assertEqual(int(aux["big"]), sum(int(o[1]["big"]) for o in outs))
    # Stacked entries stay as returned, the skipped micro-batch's (row 5 NaN) included.
    close(aux["rows"], jnp.stack([metrics_of(p.params, micro_batch(batch, i, n))[1]["rows"]
                                  for i in range(n)]))
    self.assertTrue(bool(jnp.isnan(aux["rows"][1, 1])))

  def test_skip_nonfinite_every_micro_batch_gives_nan(self):
    ev = jaxaccum.evaluate(lambda w, x: jnp.mean(x * w), num_micro_batches=2,
                           skip_nonfinite=True)
    self.assertTrue(bool(jnp.isnan(ev(1.0, jnp.full(4, jnp.inf)))))

  @chex.variants(with_jit=True, without_jit=True)
  def test_active_micro_batches(self):
    p = _problems.make("mlp")
    n, k = 4, 3
    ev = self.variant(jaxaccum.evaluate(mlp_metrics, num_micro_batches=n, has_aux=True,
                                        aux_reduce=AUX_KINDS))
    value, aux = ev(p.params, p.batch, active_micro_batches=k)
    metrics_of = jax.jit(mlp_metrics)
    outs = [metrics_of(p.params, micro_batch(p.batch, i, n)) for i in range(k)]
    close(value, np.mean([o[0] for o in outs]))
    close(aux["total"], np.sum([o[1]["total"] for o in outs]))
    # Rows of micro-batches that did not run are zeros, the others in batch order.
    rows = np.zeros(16, np.float32)
    for i in range(k):
      rows[i::n] = outs[i][1]["rows"]
    close(aux["rows"], rows)

  def test_active_micro_batches_traced(self):
    p = _problems.make("mlp")
    ev = jaxaccum.evaluate(_problems.mlp_loss, num_micro_batches=4)
    f = jax.jit(lambda k: ev(p.params, p.batch, active_micro_batches=k))
    loss_of = jax.jit(_problems.mlp_loss)
    for k in (1, 2, 4):
      close(f(jnp.int32(k)), np.mean([loss_of(p.params, mb)
                                      for mb in micro_batches(p.batch, 4)[:k]]))

  def test_linen_evaluate_threads_state_and_folds_keys(self):
    n = 4
    x = jnp.arange(16.0).reshape(8, 2)

    def fun(params, batch, model_state, rngs):
      noise = jax.random.uniform(rngs["dropout"], ())
      new = {"count": model_state["count"] + batch.shape[0]}
      return jnp.mean(batch @ params) + noise, new

    ev = jaxaccum.linen.evaluate(fun, num_micro_batches=n)
    rngs, state0 = {"dropout": jax.random.key(0)}, {"count": jnp.int32(0)}
    value, state = jax.jit(ev)(jnp.ones(2), x, state0, rngs)
    s, values = state0, []
    fun_jit = jax.jit(fun)
    for i in range(n):
      v, s = fun_jit(jnp.ones(2), x[i::n], s,
                     {"dropout": jax.random.fold_in(rngs["dropout"], i)})
      values.append(v)
    close((value, state), (np.mean(values), s))
    with pytest.raises(TypeError, match="takes no state_argnums"):
      jaxaccum.linen.evaluate(fun, num_micro_batches=2, state_argnums=2)


# ------------------------------------------------------------------------------- data_axis


def test_data_axis_on_8_devices_matches_the_per_shard_rules():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  p = _problems.make("lm", batch_size=32)
  n, d = 2, 8

  def fun(params, batch, key):
    nll, mask = _problems.lm_token_losses(params, batch)
    return (jnp.sum(nll * mask), jnp.sum(mask)), {
        "row_loss": jnp.sum(nll * mask, 1), "max": jnp.max(nll),
        "draw": jax.random.uniform(key, ())}

  key = jax.random.key(7)
  ev = jaxaccum.evaluate(fun, num_micro_batches=n, reduce="weighted", has_aux=True,
                         rng_argnums=2, aux_reduce={"row_loss": "concat", "max": "max",
                                                    "draw": "mean"}, data_axis="data")
  with jax.set_mesh(mesh):
    batch = jax.tree.map(lambda a: jax.sharding.reshard(a, P("data")), p.batch)
    value, aux = jax.jit(ev)(p.params, batch, key)
  (num, den), want = jax.jit(fun)(p.params, p.batch, key)
  close(value, num / den)
  close(aux["row_loss"], want["row_loss"])
  close(aux["max"], want["max"])
  # Shard s holds the contiguous block s of B / D rows; its micro-batch i gets
  # fold_in(fold_in(key, s), i). The aux mean is weighted by the tokens of each piece.
  @jax.jit  # the loop by hand, compiled as one program
  def draws_and_weights(batch, key):
    draws, weights = [], []
    for s in range(d):
      block = jax.tree.map(lambda a, s=s: a[s * 4:(s + 1) * 4], batch)
      for i in range(n):
        k = jax.random.fold_in(jax.random.fold_in(key, s), i)
        draws.append(jax.random.uniform(k, ()))
        weights.append(jnp.sum(micro_batch(block, i, n)["mask"][:, 1:]))
    return jnp.stack(draws), jnp.stack(weights)

  draws, weights = draws_and_weights(p.batch, key)
  close(aux["draw"], np.average(np.array(draws), weights=np.array(weights)))


# -------------------------------------------------------------------------------- memory


def test_compiled_temp_memory_holds_one_micro_batch_of_activations():
  # A forward pass whose activations (B x 4096 floats per layer) dwarf the parameters.
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k1, (64, 4096)) / 8,
            "w2": jax.random.normal(k2, (4096, 4096)) / 64,
            "w3": jax.random.normal(k3, (4096, 1)) / 64}
  x = jnp.ones((1024, 64))

  def score(params, x):
    h = jnp.tanh(x @ params["w1"])
    h = jnp.tanh(h @ params["w2"])
    return jnp.mean(h @ params["w3"])

  def temp(f):
    return jax.jit(f).lower(params, x).compile().memory_analysis().temp_size_in_bytes

  full = temp(score)
  micro = temp(jaxaccum.evaluate(score, num_micro_batches=8))
  assert full > 16 * 2**20, full  # (1024, 4096) float32 activations: 16 MiB each
  assert micro < 0.5 * full, (micro, full)


# ---------------------------------------------------------------------------------- errors


def test_errors_name_the_option():
  with pytest.raises(TypeError, match="remat"):
    jaxaccum.evaluate(lambda w, x: x, num_micro_batches=2, remat=True)  # type: ignore
  with pytest.raises(TypeError, match="argnums"):
    jaxaccum.evaluate(lambda w, x: x, num_micro_batches=2, argnums=0)  # type: ignore
  with pytest.raises(ValueError, match="num_micro_batches"):
    jaxaccum.evaluate(lambda w, x: x)
  with pytest.raises(TypeError, match="has_aux=True"):
    jaxaccum.evaluate(lambda w, x: (jnp.mean(x), x), num_micro_batches=2)(1.0, jnp.ones(4))
  with pytest.raises(TypeError, match="integer count belongs in aux"):
    jaxaccum.evaluate(lambda w, x: jnp.sum(x > 0), num_micro_batches=2,
                      reduce="sum")(1.0, jnp.ones(4))
  with pytest.raises(TypeError, match="must be a scalar"):
    jaxaccum.evaluate(lambda w, x: x * w, num_micro_batches=2)(1.0, jnp.ones(4))
  with pytest.raises(ValueError, match="divisible|does not divide|divide"):
    jaxaccum.evaluate(lambda w, x: jnp.mean(x), num_micro_batches=3)(1.0, jnp.ones(4))
  assert "evaluate" in repr(jaxaccum.evaluate(jnp.mean, num_micro_batches=2))


# ------------------------------------------------ optax.microbatch's tests, translated

NONBATCH_SHAPE, BATCH_SHAPE = (), (10, 3)


def _optax_args(seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.array(rng.normal(size=NONBATCH_SHAPE), jnp.float32),
          jnp.array(rng.normal(size=BATCH_SHAPE), jnp.float32),
          jnp.array(rng.normal(size=BATCH_SHAPE), jnp.float32))


def sum_mean_per_example_function(nonbatch_arg, batch_arg1, batch_arg2):
  """optax's function of the same name, its outputs as aux next to a scalar mean."""
  per_example = (batch_arg1 * batch_arg2, batch_arg1 / batch_arg2 * nonbatch_arg)
  summed = jnp.sum(nonbatch_arg + batch_arg1 + 2 * batch_arg2, axis=0)
  mean = (jnp.mean(nonbatch_arg * batch_arg1), {"key": jnp.mean(batch_arg2)})
  return jnp.mean(batch_arg1), {"per_example": per_example, "sum": summed, "mean": mean}


OPTAX_KINDS = {"per_example": "concat", "sum": "sum", "mean": "mean"}


class OptaxMicrobatchTest(parameterized.TestCase):

  @parameterized.product(microbatch_size=[1, 2, 5, 10])
  def test_microbatch(self, microbatch_size):
    args = _optax_args()
    ev = jaxaccum.evaluate(sum_mean_per_example_function, micro_batch_size=microbatch_size,
                           batch_argnums=(1, 2), has_aux=True, aux_reduce=OPTAX_KINDS)
    close(ev(*args), sum_mean_per_example_function(*args))

  def test_microbatch_with_kwargs(self):
    nonbatch, a, b = _optax_args(1)

    def fun(nonbatch_arg, batch_arg1, *, batch_kwarg2):
      return jnp.float32(0), jnp.sum(nonbatch_arg + batch_arg1 + 2 * batch_kwarg2, axis=0)

    ev = jaxaccum.evaluate(fun, micro_batch_size=2, has_aux=True, aux_reduce="sum",
                           batch_argnames="batch_kwarg2")
    close(ev(nonbatch, a, batch_kwarg2=b), fun(nonbatch, a, batch_kwarg2=b))

  def test_nondecomposable_function(self):
    # Not decomposable over rows: the result shows which rows each micro-batch holds.
    def fun(w, x):
      return x[:-1] @ x[1:] * w

    x = jnp.arange(6.0)
    ev = jaxaccum.evaluate(fun, micro_batch_size=3, reduce="sum")
    close(ev(1.0, x), sum(fun(1.0, x[i::2]) for i in range(2)))  # rows [0, 2, 4], [1, 3, 5]

  def test_raises_on_invalid_microbatches(self):
    ev = jaxaccum.evaluate(sum_mean_per_example_function, micro_batch_size=3,
                           batch_argnums=(1, 2), has_aux=True, aux_reduce=OPTAX_KINDS)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
      ev(*_optax_args())

  @parameterized.parameters(jnp.float16, jnp.bfloat16, jnp.float32)
  def test_correct_dtype_returned(self, dtype):
    args = [a.astype(dtype) for a in _optax_args()]
    ev = jaxaccum.evaluate(sum_mean_per_example_function, micro_batch_size=2,
                           batch_argnums=(1, 2), has_aux=True, aux_reduce=OPTAX_KINDS)
    value, aux = ev(*args)
    self.assertEqual(value.dtype, dtype)
    self.assertEqual(aux["sum"].dtype, dtype)
    close(jax.tree.map(lambda a: a.astype(jnp.float32), (value, aux)),
          jax.tree.map(lambda a: a.astype(jnp.float32), sum_mean_per_example_function(*args)),
          rtol=2e-2, atol=2e-2)

  def test_early_stopping_concat(self):
    x = jnp.arange(12.0) + 1
    ev = jaxaccum.evaluate(lambda w, x: (jnp.mean(x), x), micro_batch_size=3, has_aux=True,
                           aux_reduce="concat")
    _, rows = ev(None, x, active_micro_batches=2)
    # Micro-batches 0 and 1 of 4 ran: rows 0, 4, 8 and 1, 5, 9, in their places.
    close(rows, jnp.where(jnp.arange(12) % 4 < 2, x, 0.0))

  def test_argnums_argnames_invariant(self):
    def fun(a, b, c, *, d, e, f):
      return jnp.sum(a + b + c + d + e + f)

    base = dict(micro_batch_size=2, reduce="sum")
    out1 = jaxaccum.evaluate(fun, batch_argnums=(0, 1), **base)(
        jnp.ones(16), jnp.ones(16), 1, d=2, e=3, f=4)
    out2 = jaxaccum.evaluate(fun, batch_argnums=0, batch_argnames="b", **base)(
        jnp.ones(16), b=jnp.ones(16), c=1, d=2, e=3, f=4)
    out3 = jaxaccum.evaluate(fun, batch_argnums=(), batch_argnames=("b", "a"), **base)(
        a=jnp.ones(16), b=jnp.ones(16), c=1, d=2, e=3, f=4)
    close(out1, fun(jnp.ones(16), jnp.ones(16), 1, d=2, e=3, f=4))
    close(out2, out1)
    close(out3, out1)

  def test_dynamic_steps(self):
    @jax.jit
    def fun(x, steps):
      return jaxaccum.evaluate(lambda w, x: jnp.sum(x), micro_batch_size=4,
                               reduce="sum")(None, x, active_micro_batches=steps)

    x = jnp.arange(128.0)
    # Micro-batch i of 32 holds rows i, i + 32, ...: the first four hold rows i % 32 < 4.
    close(fun(x, 4), jnp.sum(jnp.where(jnp.arange(128) % 32 < 4, x, 0.0)))


def test_parameters_with_the_batch_rows_do_not_warn_at_one_row_micro_batches():
  # Under evaluate nothing is differentiated, yet argument 0 is still the parameters: a
  # (B,) parameter next to one-row micro-batches is no whole-batch broadcast (the suite
  # turns warnings into errors).
  w, x = jnp.arange(8.0), jnp.arange(8.0)
  ev = jaxaccum.evaluate(lambda w, x: jnp.sum(w) * jnp.mean(x), micro_batch_size=1)
  close(ev(w, x), jnp.sum(w) * jnp.mean(x))
  with pytest.warns(jaxaccum.BatchBroadcastWarning, match="keyword argument 'y'"):
    jaxaccum.evaluate(lambda w, x, *, y: jnp.mean(x * y), micro_batch_size=1)(w, x, y=x)
