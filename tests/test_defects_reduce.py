"""Aux reductions: what each kind gives back, checked against the full batch and by-hand loops.

Each test here failed on the code before its fix: a (b*T,) or (T,) leaf under "concat"
came back interleaved; a bool aux came back summed as int32.
"""

import re

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxaccum

N = 4


def _data(rows=8, tokens=3):
  x = jax.random.normal(jax.random.key(0), (rows, tokens, 2))
  y = jax.random.normal(jax.random.key(1), (rows, tokens))
  return jnp.array([0.5, -1.0]), (x, y)


def _per_token(w, batch):
  x, y = batch
  return (x @ w - y) ** 2  # (rows, tokens)


@pytest.mark.parametrize(("leaf", "shape"), [
    (lambda t: t.reshape(-1), (6,)),  # per-token values flattened to (rows * tokens,)
    (lambda t: t.mean(0), (3,)),  # one value per token position
])
def test_concat_of_a_leaf_without_the_rows_axis_is_rejected(leaf, shape):
  def loss(w, batch):
    t = _per_token(w, batch)
    return jnp.mean(t), {"tok": leaf(t)}

  step = jaxaccum.value_and_grad(loss, num_micro_batches=N, has_aux=True,
                                 aux_reduce={"tok": "concat"})
  w, batch = _data()
  msg = (rf"aux leaf \['tok'\] has shape {re.escape(str(shape))}.*micro-batch's 2 rows"
         r".*'stack'")
  with pytest.raises(ValueError, match=msg):
    step(w, batch)


def test_concat_of_rows_first_leaves_is_the_full_batch():
  def loss(w, batch):
    t = _per_token(w, batch)
    return jnp.mean(t), {"tok": t, "row": t.sum(1)}

  w, batch = _data()
  step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, has_aux=True,
                                         aux_reduce="concat"))
  chex.assert_trees_all_close(step(w, batch), jax.value_and_grad(loss, has_aux=True)(w, batch),
                              rtol=1e-6)
