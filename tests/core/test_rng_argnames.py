"""rng_argnames: keyword PRNG keys folded per micro-batch, against a hand loop with fold_in.

The reference slices micro-batch ``i`` of ``N`` by hand (``x[i::N]``), calls the loss with
``jax.random.fold_in(key, i)`` for each keyword key (a pytree of keys: every leaf folded),
and averages the values and gradients of the ``N`` micro-batches (equal sizes, so the mean
of means is the full-batch mean).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxaccum

N = 4
X = jax.random.normal(jax.random.key(0), (16, 3))
W = jnp.array([0.5, -1.0, 2.0])


def loss(w, x, *, keys, scale=1.0):
  """A dropout-like mask from keys["mask"], a noise term from keys["noise"]."""
  keep = jax.random.bernoulli(keys["mask"], 0.7, x.shape)
  noise = jax.random.normal(keys["noise"], ())
  pred = jnp.tanh((x * keep) @ w)
  return jnp.mean(pred ** 2) * scale + 0.1 * noise * jnp.sum(w)


KEYS = {"mask": jax.random.key(1), "noise": jax.random.key(2)}


@functools.partial(jax.jit, static_argnames="n")
def hand_loop(w, x, keys, n=N):
  """The mean over micro-batches ``x[i::n]`` with keys ``fold_in(key, i)``, by hand."""
  outs = [jax.value_and_grad(loss)(w, x[i::n],
                                   keys=jax.tree.map(lambda k, i=i: jax.random.fold_in(k, i),
                                                     keys))
          for i in range(n)]
  return jax.tree.map(lambda *v: jnp.mean(jnp.stack(v), 0), *outs)


def close(a, b):
  chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)


class RngArgnamesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_value_and_grad_folds_keyword_keys(self):
    f = self.variant(jaxaccum.value_and_grad(loss, num_micro_batches=N, rng_argnames="keys"))
    close(f(W, X, keys=KEYS), hand_loop(W, X, KEYS))

  @chex.variants(with_jit=True, without_jit=True)
  def test_grad_folds_keyword_keys_next_to_a_batch_keyword(self):
    def loss_kw(w, *, x, keys):
      return loss(w, x, keys=keys)

    g = self.variant(jaxaccum.grad(loss_kw, num_micro_batches=N, batch_argnums=(),
                                   batch_argnames="x", rng_argnames=("keys",)))
    close(g(W, x=X, keys=KEYS), hand_loop(W, X, KEYS)[1])

  def test_same_as_rng_argnums(self):
    by_pos = jaxaccum.value_and_grad(lambda w, x, keys: loss(w, x, keys=keys),
                                     num_micro_batches=N, rng_argnums=2)
    by_name = jaxaccum.value_and_grad(loss, num_micro_batches=N, rng_argnames="keys")
    close(by_name(W, X, keys=KEYS), by_pos(W, X, KEYS))

  def test_raw_uint32_keys(self):
    raw = jax.tree.map(jax.random.key_data, KEYS)  # uint32 (2,) keys, as PRNGKey gives
    f = jaxaccum.value_and_grad(loss, num_micro_batches=N, rng_argnames="keys")
    close(f(W, X, keys=raw), hand_loop(W, X, raw))

  def test_under_data_axis_folds_the_shard_then_the_micro_batch(self):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    n, d = 2, 8
    x = jax.random.normal(jax.random.key(3), (32, 3))
    f = jaxaccum.value_and_grad(loss, num_micro_batches=n, rng_argnames="keys",
                                data_axis="data")
    with jax.set_mesh(mesh):
      out = jax.jit(f)(W, jax.sharding.reshard(x, P("data")), keys=KEYS)
    # Shard s holds rows 4s..4s+3 and folds its keys with s, then with i.
    parts = [hand_loop(W, x[4 * s:4 * (s + 1)],
                       jax.tree.map(lambda k, s=s: jax.random.fold_in(k, s), KEYS), n)
             for s in range(d)]
    close(jax.tree.map(np.asarray, out),
          jax.tree.map(lambda *v: np.mean(np.stack(v), 0), *parts))


def test_errors():
  with pytest.raises(ValueError, match=r"rng_argnames=\('key',\) and batch_argnames"):
    jaxaccum.value_and_grad(loss, num_micro_batches=N, batch_argnames="key",
                            rng_argnames="key")
  with pytest.raises(TypeError, match="rng_argnames must be"):
    jaxaccum.value_and_grad(loss, num_micro_batches=N, rng_argnames=3)
  f = jaxaccum.value_and_grad(loss, num_micro_batches=N, rng_argnames="keys")
  with pytest.raises(ValueError, match=r"rng_argnames=\('keys',\) names keyword argument"):
    f(W, X)
  # Per-example keys are batch data: the message says to name them in batch_argnames.
  per_example = {"mask": jax.random.split(jax.random.key(0), 16), "noise": KEYS["noise"]}
  with pytest.raises(TypeError, match=r"rng_argnames names keyword argument 'keys'.*"
                     r"batch_argnames=\('keys',\)"):
    f(W, X, keys=per_example)
  with pytest.raises(TypeError, match="not a single PRNG key"):
    f(W, X, keys={"mask": jnp.ones(3), "noise": KEYS["noise"]})
