"""JAX's reduced-parameters / unreduced-accumulator recipe, tried as the devices guide describes.

JAX's guide (``docs/301/sharding-ad.md``, "Example: microbatch gradient accumulation") keeps
the gradient accumulator of a micro-batch loop unreduced by giving the parameters the
``reduced`` sharding type, so the loop holds no all-reduce and one reduction runs after it.
On the jax releases this project tests, that works for a stack of matmuls and fails with
``ShardingTypeError`` as soon as a reduced parameter meets a batch-sharded activation in an
elementwise op (a bias add here; a LayerNorm scale or an embedding gather likewise), which is
why jaxaccum does not apply the recipe to a user's model (the devices guide says so). The bias
case is a strict xfail: the day a jax release lifts the limit it passes, the suite fails on the
XPASS, and the guide's paragraph (and perhaps the default path) should change.
"""

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum

# Not exported under a public name in jax 0.10 or 0.12.
ShardingTypeError = (getattr(jax.errors, "ShardingTypeError", None)
                     or jax._src.core.ShardingTypeError)

NUM_LAYERS, WIDTH, NUM_MICRO, ROWS = 3, 4, 2, 16


def loss(params, x, bias):
  def layer(h, p):
    h = h @ p["w"]
    if bias:
      h = h + p["b"]  # reduced parameter + batch-sharded activation: elementwise
    return jnp.tanh(h), None
  h, _ = jax.lax.scan(layer, x, params)
  return jnp.sum(h ** 2)


def recipe_step(params, xs, bias):
  """The guide's step: reduced parameters, an unreduced accumulator, one reduction after."""

  def micro_batch(acc, x):
    g = jax.grad(loss)(params, x, bias)
    return jax.tree.map(jnp.add, acc, g), None

  acc = jax.tree.map(lambda p: jax.reshard(jnp.zeros_like(p), P(unreduced={"data"})), params)
  acc, _ = jax.lax.scan(micro_batch, acc, xs)
  return jax.tree.map(lambda a: jax.reshard(a, P()), acc)


def make_params(bias):
  key_w, key_b = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(key_w, (NUM_LAYERS, WIDTH, WIDTH)) / 2}
  if bias:
    params["b"] = jax.random.normal(key_b, (NUM_LAYERS, WIDTH)) / 4
  return params


@pytest.mark.parametrize("bias", [
    False,
    pytest.param(True, marks=pytest.mark.xfail(
        strict=True, raises=ShardingTypeError,
        reason="jax rejects a reduced parameter in an elementwise op with a sharded "
               "activation (jax 0.10.2 and 0.12.0.1)")),
], ids=["matmul_only", "with_bias"])
def test_reduced_params_unreduced_accumulator(bias):
  params = make_params(bias)
  xs = jax.random.normal(jax.random.key(1), (NUM_MICRO, ROWS, WIDTH))
  # The reference: plain jax.grad of the full batch (the loss is a sum over rows), unsharded.
  expected = jax.grad(loss)(params, xs.reshape(NUM_MICRO * ROWS, WIDTH), bias)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  step = jax.jit(recipe_step, static_argnums=2)
  with jax.set_mesh(mesh):
    reduced = jax.tree.map(lambda p: jax.device_put(p, P(reduced={"data"})), params)
    sharded = jax.device_put(xs, P(None, "data", None))
    got = step(reduced, sharded, bias)
    found = jaxaccum.planning.collectives(step.lower(reduced, sharded, bias))
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
  # What the recipe is for: no reduction inside either loop, one after them (XLA combines
  # the gradient leaves into one all-reduce of a tuple).
  assert found.count(in_loop=True) == 0, found
  assert len(found) == found.count("all-reduce") == 1, found
  assert found[0].dtype == "float32", found

