"""jaxaccum.eqx against equinox: filter_value_and_grad and filter_grad under eqx.filter_jit.

References: ``eqx.filter_value_and_grad`` / ``eqx.filter_grad`` on the full batch for
per-example models (an MLP, a small CNN), and on each micro-batch built by explicit slicing
(``x[i::N]``) with its own key ``fold_in(key, i)`` for dropout. float32, 1e-5 relative to
each leaf's largest entry (``tests._util.assert_close``).
"""

import subprocess
import sys

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum
from tests._util import assert_close

B, N = 16, 4


def data(seed=0, shape=(4,)):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (B, *shape)), jax.random.randint(ky, (B,), 0, 3)


def mlp_loss(model, x, y):
  logits = jax.vmap(model)(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class CNN(eqx.Module):
  conv: eqx.nn.Conv2d
  head: eqx.nn.Linear
  act: object = eqx.field(static=True)
  steps: jax.Array  # an integer array: not differentiated, gradient None

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(1, 4, 3, key=k1)
    self.head = eqx.nn.Linear(4, 3, key=k2)
    self.act = jax.nn.relu
    self.steps = jnp.zeros((), jnp.int32)

  def __call__(self, x):
    return self.head(self.act(self.conv(x)).mean(axis=(1, 2)))


def cnn_loss(model, batch):
  x, y = batch
  logits = jax.vmap(model)(x)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, {"logits": logits, "correct": jnp.sum(jnp.argmax(logits, -1) == y)}


class MLPEquivalenceTest(chex.TestCase):
  """The accumulated MLP step equals equinox's full batch, jitted or not."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_mlp_equals_equinox_on_the_full_batch(self):
    model = eqx.nn.MLP(4, 3, 16, depth=2, key=jax.random.key(0))
    x, y = data()
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(mlp_loss))(model, x, y)
    # The arrays cross the (possibly jitted) boundary, the activations stay static.
    arrays, static = eqx.partition(model, eqx.is_array)
    vg = jaxaccum.eqx.filter_value_and_grad(mlp_loss, num_micro_batches=N, batch_argnums=(1, 2))
    step = self.variant(lambda arrays, x, y: vg(eqx.combine(arrays, static), x, y))
    chex.assert_trees_all_close(step(arrays, x, y), (ref_loss, ref_grads), rtol=1e-5,
                                atol=1e-6)
    # filter_grad, and the decorator form.
    grad_fn = jaxaccum.eqx.filter_grad(micro_batch_size=2, batch_argnums=(1, 2))(mlp_loss)
    grads = self.variant(lambda arrays, x, y: grad_fn(eqx.combine(arrays, static), x, y))(
        arrays, x, y)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_cnn_with_static_fields_aux_and_info_equals_equinox():
  model = CNN(jax.random.key(1))
  batch = data(2, shape=(1, 6, 6))
  (ref_loss, ref_aux), ref_grads = eqx.filter_jit(
      eqx.filter_value_and_grad(cnn_loss, has_aux=True))(model, batch)
  step = eqx.filter_jit(jaxaccum.eqx.filter_value_and_grad(
      cnn_loss, num_micro_batches=N, has_aux=True,
      aux_reduce={"logits": "concat", "correct": "sum"}, with_info=True))
  (loss, aux), grads, info = step(model, batch)
  assert grads.steps is None and ref_grads.steps is None
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)
  assert_close(aux["logits"], ref_aux["logits"])  # rows in the original order
  assert int(aux["correct"]) == int(ref_aux["correct"])
  assert isinstance(info, jaxaccum.AccumInfo) and int(info.num_micro_batches) == N


def test_dropout_key_folded_per_micro_batch_matches_sequential_equinox():
  model = (eqx.nn.Linear(4, 8, key=jax.random.key(3)), eqx.nn.Dropout(0.5),
           eqx.nn.Linear(8, 3, key=jax.random.key(4)))
  x, y = data(5)
  key = jax.random.key(6)

  def loss_fn(model, x, y, key):
    l1, drop, l2 = model
    keys = jax.random.split(key, x.shape[0])
    h = jax.vmap(lambda xi, k: drop(jnp.tanh(l1(xi)), key=k))(x, keys)
    logits = jax.vmap(l2)(h)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  ref_grad = eqx.filter_jit(eqx.filter_grad(loss_fn))
  ref = [ref_grad(model, x[i::N], y[i::N], jax.random.fold_in(key, i)) for i in range(N)]
  ref_grads = jax.tree.map(lambda *g: sum(g) / N, *ref)
  grads = eqx.filter_jit(jaxaccum.eqx.filter_grad(
      loss_fn, num_micro_batches=N, batch_argnums=(1, 2), rng_argnums=3))(model, x, y, key)
  assert_close(grads, ref_grads)
  assert not np.allclose(grads[0].weight, ref[0][0].weight)  # the masks differ per micro-batch


def test_argnums_is_refused_and_import_jaxaccum_needs_no_equinox():
  for name in jaxaccum.eqx.__all__:
    assert getattr(jaxaccum.eqx, name).__doc__, name
  with pytest.raises(TypeError, match=r"takes no argnums= option.*first argument"):
    jaxaccum.eqx.filter_value_and_grad(mlp_loss, num_micro_batches=2, argnums=1)
  code = ("import sys; import jaxaccum, jaxaccum.nnx; "
          "assert 'equinox' not in sys.modules, 'equinox imported'; "
          "import jaxaccum.eqx; assert 'equinox' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)


class WithBatchNorm(eqx.Module):
  lin: eqx.nn.Linear
  bn: eqx.nn.BatchNorm

  def __init__(self, key):
    self.lin = eqx.nn.Linear(4, 3, key=key)
    self.bn = eqx.nn.BatchNorm(3, axis_name="batch", momentum=0.5, mode="batch")


def bn_loss(model, x, state):
  def one(xi, state):
    return model.bn(model.lin(xi), state)
  out, state = jax.vmap(one, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
  return jnp.mean(out ** 2), state


def test_eqx_state_is_threaded_through_the_micro_batches_in_order():
  model, state = eqx.nn.make_with_state(WithBatchNorm)(jax.random.key(0))
  x, _ = data(7)
  ref_vg = eqx.filter_jit(eqx.filter_value_and_grad(bn_loss, has_aux=True))
  ref_state, losses, grads = state, [], []
  for i in range(N):
    (loss, ref_state), g = ref_vg(model, x[i::N], ref_state)
    losses.append(loss)
    grads.append(g)
  vg = eqx.filter_jit(jaxaccum.eqx.filter_value_and_grad(
      bn_loss, num_micro_batches=N, state_argnums=2))
  (loss, new_state), grads_acc = vg(model, x, state)
  assert_close(loss, sum(losses) / N)
  assert_close(grads_acc, jax.tree.map(lambda *g: sum(g) / N, *grads))
  assert_close(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), new_state),
               jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), ref_state))


def test_nested_call_inside_another_accumulated_loss():
  """An accumulated function called inside another's loss (re-entrant): each call combines
  its own model's static part (relu for the student, tanh for the teacher)."""
  n, m = 2, 2
  student = eqx.nn.MLP(4, 3, 8, depth=1, activation=jax.nn.relu, key=jax.random.key(0))
  teacher = eqx.nn.MLP(4, 3, 8, depth=1, activation=jnp.tanh, key=jax.random.key(1))

  def teacher_loss(teacher, x):
    return jnp.mean(jax.vmap(teacher)(x) ** 2)

  inner = jaxaccum.eqx.filter_value_and_grad(teacher_loss, num_micro_batches=m)

  def student_loss(model, x, teacher, vg):
    t_loss, t_grads = vg(teacher, x)
    g2 = sum(jnp.sum(g ** 2) for g in jax.tree.leaves(t_grads))
    return jnp.mean(jax.vmap(model)(x) ** 2) * (1.0 + g2) + t_loss

  def ref_inner(teacher, x):  # the inner accumulation by hand: x[j::m]
    outs = [eqx.filter_value_and_grad(teacher_loss)(teacher, x[j::m]) for j in range(m)]
    return jax.tree.map(lambda *o: sum(o) / m, *outs)

  x, _ = data(3)
  step = eqx.filter_jit(jaxaccum.eqx.filter_value_and_grad(
      lambda model, x, teacher: student_loss(model, x, teacher, inner), num_micro_batches=n))
  loss, grads = step(student, x, teacher)
  ref_vg = eqx.filter_jit(eqx.filter_value_and_grad(
      lambda model, x, teacher: student_loss(model, x, teacher, ref_inner)))
  refs = [ref_vg(student, x[i::n], teacher) for i in range(n)]
  chex.assert_trees_all_close((loss, grads), jax.tree.map(lambda *r: sum(r) / n, *refs),
                              rtol=1e-5, atol=1e-6)
