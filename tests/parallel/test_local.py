"""``local_value_and_grad``: keys and keyword arguments, against a hand-folded reference.

Each data shard ``d`` holds the contiguous block ``d`` of the batch's rows; a key given through
``rng_argnums`` / ``rng_argnames`` reaches shard ``d`` as ``fold_in(key, d)`` (as under
``value_and_grad(data_axis=...)``), and micro-batch ``i`` of the shard's rows (``x_d[i::N]``)
as ``fold_in(fold_in(key, d), i)``. The reference computes each shard's piece with plain
``jax.value_and_grad`` on rows and keys sliced and folded by hand: a mean loss's pieces are
divided by ``D`` (and its micro-batches averaged), a sum's kept as they are (and summed).
"""

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

D, ROWS = 8, 32


def dropout_loss(w, x, key):
  keep = jax.random.bernoulli(key, 0.5, (x.shape[0],))
  return jnp.mean(jnp.where(keep, (x @ w) ** 2, 0.0))


def keyword_loss(w, *, batch, key):
  return dropout_loss(w, batch, key)


def dropout_sum_loss(w, x, key):
  return dropout_loss(w, x, key) * x.shape[0]  # the sum over the rows


REFERENCES = {"mean": jax.jit(jax.value_and_grad(dropout_loss)),
              "sum": jax.jit(jax.value_and_grad(dropout_sum_loss))}


def hand_pieces(w, x, key, num_micro_batches, reduce="mean"):
  """Shard d's (value, grads) piece: its rows' mean loss over its micro-batches, / D; or,
  for a sum, its micro-batches' sum as it is."""
  reference = REFERENCES[reduce]
  rows = x.shape[0] // D
  values, grads = [], []
  for d in range(D):
    x_d, key_d = x[d * rows:(d + 1) * rows], jax.random.fold_in(key, d)
    if num_micro_batches is None:
      v, g = reference(w, x_d, key_d)
    else:
      parts = [reference(w, x_d[i::num_micro_batches], jax.random.fold_in(key_d, i))
               for i in range(num_micro_batches)]
      v, g = jax.tree.map(lambda *a: sum(a), *parts)
      if reduce == "mean":
        v, g = v / num_micro_batches, g / num_micro_batches
    values.append(v / D if reduce == "mean" else v)
    grads.append(g / D if reduce == "mean" else g)
  return jnp.stack(values), jnp.stack(grads)


@pytest.fixture(scope="module")
def problem():
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Explicit,))
  kw, kx = jax.random.split(jax.random.key(0))
  w = jax.random.normal(kw, (3,))
  x = jax.random.normal(kx, (ROWS, 3))
  placed = (jax.device_put(w, NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P("data"))))
  return mesh, w, x, placed, jax.random.key(7)


@pytest.mark.parametrize("num_micro_batches", [None, 2], ids=["one-pass", "micro-batches"])
def test_keys_are_folded_per_shard(problem, num_micro_batches):
  mesh, w, x, (pw, px), key = problem
  accumulate = {} if num_micro_batches is None else {"num_micro_batches": num_micro_batches}
  fn = jax.jit(jaxaccum.local_value_and_grad(dropout_loss, data_axis=jaxaccum.DataParallel("data",
               mesh=mesh), rng_argnums=2, **accumulate))
  value, grads = fn(pw, px, key)
  chex.assert_trees_all_close((value, grads), hand_pieces(w, x, key, num_micro_batches),
                              rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_micro_batches", [None, 2, 4])
def test_sum_pieces_are_each_shards_sum(problem, num_micro_batches):
  """reduce="sum": shard d's piece is its rows' summed loss and gradient (its micro-batches'
  sum), not divided by D, so the pieces sum to the whole batch's sum."""
  mesh, w, x, (pw, px), key = problem
  accumulate = {} if num_micro_batches is None else {"num_micro_batches": num_micro_batches}
  fn = jax.jit(jaxaccum.local_value_and_grad(
      dropout_sum_loss, data_axis=jaxaccum.DataParallel("data", mesh=mesh), reduce="sum",
      rng_argnums=2, **accumulate))
  value, grads = fn(pw, px, key)
  chex.assert_trees_all_close((value, grads),
                              hand_pieces(w, x, key, num_micro_batches, reduce="sum"),
                              rtol=1e-5, atol=1e-6)


def test_keyword_batch_and_key(problem):
  mesh, w, x, (pw, px), key = problem
  local = jaxaccum.local_value_and_grad(keyword_loss, data_axis=jaxaccum.DataParallel("data",
                                        mesh=mesh), batch_argnums=(), batch_argnames="batch",
                                        rng_argnames="key", num_micro_batches=2)
  value, grads = jax.jit(local)(pw, batch=px, key=key)
  chex.assert_trees_all_close((value, grads), hand_pieces(w, x, key, 2), rtol=1e-5, atol=1e-7)
  # The pieces sum to what value_and_grad(data_axis=) reduces: the same keys on each shard.
  reduced = jaxaccum.value_and_grad(keyword_loss, data_axis=jaxaccum.DataParallel("data",
                                    mesh=mesh), batch_argnums=(), batch_argnames="batch",
                                    rng_argnames="key", num_micro_batches=2)
  chex.assert_trees_all_close((value.sum(), grads.sum(0)),
                              jax.jit(reduced)(pw, batch=px, key=key), rtol=1e-5, atol=1e-6)


def test_keyword_arguments_errors(problem):
  mesh, _, _, (pw, px), key = problem
  local = jaxaccum.local_value_and_grad(keyword_loss, data_axis=jaxaccum.DataParallel("data",
                                        mesh=mesh), batch_argnums=(), batch_argnames="batch",
                                        rng_argnames="key")
  with pytest.raises(ValueError, match=r"rng_argnames=\('key',\) names keyword argument\(s\) "
                     r"\['key'\], but the function was called with keyword arguments \['batch'\]"):
    local(pw, batch=px)
  with pytest.raises(TypeError, match=r"rng_argnames names keyword argument 'key', but its "
                     r"leaf .* not a single PRNG key"):
    local(pw, batch=px, key=pw)
  with pytest.raises(ValueError, match=r"rng_argnames=\('batch',\) and "
                     r"batch_argnames=\('batch',\) both name \['batch'\]"):
    jaxaccum.local_value_and_grad(keyword_loss, data_axis="data", batch_argnames="batch",
                                  rng_argnames="batch")


@pytest.mark.parametrize("extra", [{}, {"num_micro_batches": 2}])
def test_state_argnums_is_refused_by_name_with_the_way_out(extra):
  """Each shard would thread its own copy of the state, with nothing to join the copies: a
  ValueError naming the argument, the value and the fix, when the transform is built (a
  state overlapping the batch is still reported as the overlap it is)."""
  def stateful(w, x, s):
    return jnp.mean((x @ w) ** 2), s + 1

  with pytest.raises(ValueError, match=r"local_value_and_grad takes no state_argnums \(got "
                     r"state_argnums=2\).*Drop state_argnums and return the state in aux"):
    jaxaccum.local_value_and_grad(stateful, data_axis="data", state_argnums=2, **extra)
  with pytest.raises(ValueError, match=r"batch_argnums=\(1,\) and state_argnums=\(1,\) "
                     r"overlap"):
    jaxaccum.local_value_and_grad(stateful, data_axis="data", state_argnums=1, **extra)
