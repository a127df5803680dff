"""reduce="weighted": token-weighted losses on a small transformer LM with padded sequences;
denominators summed across data shards and accumulated wide from small integer dtypes, on a
linear model over generated token counts."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxaccum
from tests import _problems
from tests._problems import SEQ

init_lm = _problems.lm_params
make_batch = _problems.lm_batch
token_losses = _problems.lm_token_losses


def assert_close(actual, expected):
  """float32: rtol 1e-5, atol 1e-6 for entries near zero (round-off of cancelling terms)."""
  chex.assert_trees_all_close(actual, expected, rtol=1e-5, atol=1e-6)


def weighted_loss(params, batch):
  return _problems.lm_loss(params, batch, "weighted")


def full_batch_token_mean(params, batch):
  return _problems.ratio(weighted_loss(params, batch))


def per_micro_batch_mean(params, batch):
  """The 2024 bug: each micro-batch's own token mean, then a plain mean over micro-batches."""
  return _problems.ratio(weighted_loss(params, batch))


# The full-batch reference: plain jax.value_and_grad of the whole batch's token mean, jitted
# once for the module (one compile per batch shape instead of an eager trace per test).
full_batch_value_and_grad = jax.jit(jax.value_and_grad(full_batch_token_mean))


@jax.jit
def _rel(a, b):
  return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


@pytest.mark.parametrize("n", [1, 16])  # N = 4: test_transform.py
def test_weighted_equals_full_batch_token_mean(n):
  params = init_lm(jax.random.key(0))
  batch = make_batch(jax.random.key(1))
  loss, grads = jax.jit(jaxaccum.value_and_grad(weighted_loss, num_micro_batches=n,
                                                reduce="weighted"))(params, batch)
  ref_loss, ref_grads = full_batch_value_and_grad(params, batch)
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)


def test_averaging_per_micro_batch_means_is_wrong():
  params = init_lm(jax.random.key(2))
  # Micro-batch i holds rows i, i+4, ...: rows 0 mod 4 are long, the rest short.
  lengths = [SEQ if i % 4 == 0 else 3 for i in range(16)]
  batch = make_batch(jax.random.key(3), lengths=lengths)
  ref_loss, ref_grads = full_batch_value_and_grad(params, batch)
  bug_loss, bug_grads = jax.jit(jaxaccum.value_and_grad(per_micro_batch_mean,
                                                        num_micro_batches=4))(params, batch)
  ok_loss, ok_grads = jax.jit(jaxaccum.value_and_grad(weighted_loss, num_micro_batches=4,
                                                      reduce="weighted"))(params, batch)
  assert_close((ok_loss, ok_grads), (ref_loss, ref_grads))
  rel = lambda a, b: float(_rel(a, b))  # noqa: E731
  # Far outside float32 round-off (1e-6): the bug reweights tokens by their micro-batch.
  assert rel(bug_grads["embed"], ref_grads["embed"]) > 1e-2
  assert abs(float(bug_loss - ref_loss)) > 1e-3


def test_weighted_aux_is_averaged_by_the_denominator():
  def loss_with_aux(params, batch):
    nll, mask = token_losses(params, batch)
    num, den = jnp.sum(nll * mask), jnp.sum(mask)
    correct = (nll < 1.0).astype(jnp.float32) * mask
    aux = {"token_acc": jnp.sum(correct) / jnp.maximum(den, 1.0), "tokens": den}
    return (num, den), aux

  params = init_lm(jax.random.key(4))
  batch = make_batch(jax.random.key(5))
  ((loss, aux), grads) = jax.jit(jaxaccum.value_and_grad(
      loss_with_aux, num_micro_batches=4, reduce="weighted", has_aux=True,
      aux_reduce={"token_acc": None, "tokens": "sum"}))(params, batch)
  @jax.jit
  def reference(params, batch):
    nll, mask = token_losses(params, batch)
    return (jnp.sum((nll < 1.0) * mask) / jnp.sum(mask), jnp.sum(mask),
            full_batch_token_mean(params, batch))

  ref_acc, ref_tokens, ref_loss = reference(params, batch)
  assert_close(aux["token_acc"], ref_acc)
  assert_close(aux["tokens"], ref_tokens)
  assert_close(loss, ref_loss)


def test_micro_batch_without_tokens_and_zero_total_weight():
  params = init_lm(jax.random.key(6))
  # Micro-batch 1 of 2 (odd rows) holds only padding: it must contribute nothing.
  lengths = [SEQ if i % 2 == 0 else 0 for i in range(8)]
  batch = make_batch(jax.random.key(7), 8, lengths=lengths)
  f = jax.jit(jaxaccum.value_and_grad(weighted_loss, num_micro_batches=2, reduce="weighted"))
  assert_close(f(params, batch), full_batch_value_and_grad(params, batch))
  empty = make_batch(jax.random.key(8), 8, lengths=[0] * 8)
  loss, grads = f(params, empty)
  assert float(loss) == 0.0
  assert all(not np.any(g) for g in jax.tree.leaves(grads))


class IntegerDenominatorTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_integer_denominator(self):
    def int_den_loss(params, batch):
      num, den = weighted_loss(params, batch)
      return num, jnp.sum(batch["mask"][:, 1:]).astype(jnp.int32)

    params = init_lm(jax.random.key(9))
    batch = make_batch(jax.random.key(10))
    out = self.variant(jaxaccum.value_and_grad(int_den_loss, num_micro_batches=4,
                                               reduce="weighted"))(params, batch)
    assert_close(out, full_batch_value_and_grad(params, batch))


# --- the denominators: summed across data shards, accumulated wide -------------------------
#
# A linear model whose rows carry token counts: fun returns (sum of tokens x squared error,
# sum of tokens), the sum in the dtype of the counts. The reference is plain
# jax.value_and_grad of the whole batch's token mean, the counts as float32.

ROWS = 32
_rng = np.random.default_rng(0)
X = _rng.normal(size=(ROWS, 3)).astype(np.float32)
Y = _rng.normal(size=ROWS).astype(np.float32)
W = np.asarray([0.5, -1.0, 2.0], np.float32)


def token_sum_loss(w, batch):
  x, y, tokens = batch
  num = jnp.sum(tokens.astype(jnp.float32) * (x @ w - y) ** 2)
  return num, jnp.sum(tokens, dtype=tokens.dtype)  # a micro-batch's count, in its own dtype


@jax.jit
def token_mean_reference(w, x, y, tokens):
  def token_mean(w):
    t = tokens.astype(jnp.float32)
    return jnp.sum(t * (x @ w - y) ** 2) / jnp.sum(t)
  return jax.value_and_grad(token_mean)(w)


@functools.cache
def weighted_step(shards, num_micro_batches):
  """One compiled step per layout: ``shards`` data shards (1: no data_axis) of
  ``num_micro_batches`` micro-batches each."""
  data_axis = None if shards == 1 else jaxaccum.DataParallel(
      "data", mesh=jax.make_mesh((shards,), ("data",), devices=jax.devices()[:shards]))
  return jax.jit(jaxaccum.value_and_grad(token_sum_loss, num_micro_batches=num_micro_batches,
                                         reduce="weighted", data_axis=data_axis))


def check_token_mean(shards, num_micro_batches, tokens):
  out = weighted_step(shards, num_micro_batches)(W, (X, Y, tokens))
  assert_close(out, token_mean_reference(W, X, Y, tokens))


@settings(max_examples=10, deadline=None)
@example(shards=8, tokens=[3.0] * 4 + [0.0] * 28)  # one shard holds every token
@given(shards=st.sampled_from([2, 4, 8]),
       tokens=st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0, 7.0]), min_size=ROWS,
                       max_size=ROWS).filter(any))
def test_weighted_denominators_are_summed_across_data_shards(shards, tokens):
  """Under data_axis each shard holds B / D contiguous rows and a different number of
  tokens (a shard may hold none): the token mean divides by the tokens of every shard."""
  check_token_mean(shards, 2, np.asarray(tokens, np.float32))


@settings(max_examples=10, deadline=None)
@given(layout=st.sampled_from([(1, 4), (2, 2)]), dtype=st.sampled_from(["int8", "uint8"]),
       data=st.data())
def test_small_integer_denominators_are_accumulated_wide(layout, dtype, data):
  """Counts in int8 / uint8, each micro-batch's sum (8 rows) within its dtype and the
  step's sum beyond it (int8: 8 to 15 tokens a row, 256 or more in all; uint8: 16 to 31, 512
  or more): the denominator adds up in int32, whatever the dtype fun returns it in."""
  shards, n = layout
  low = {"int8": 8, "uint8": 16}[dtype]
  tokens = data.draw(st.lists(st.integers(low, 2 * low - 1), min_size=ROWS, max_size=ROWS))
  assert sum(tokens) > np.iinfo(dtype).max  # the step's count does not fit the dtype
  check_token_mean(shards, n, np.asarray(tokens, dtype))
