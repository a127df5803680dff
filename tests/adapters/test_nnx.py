"""jaxaccum.nnx: NNX models under nnx.jit against full-batch and per-micro-batch references.

References:
* models with per-example layers (Linear, GroupNorm, LayerNorm, attention without dropout,
  BatchNorm in eval mode): plain ``nnx.value_and_grad`` on the full batch;
* models whose forward pass depends on the micro-batch (dropout draws, BatchNorm batch
  statistics): a Python loop over the micro-batches sliced by hand (``x[i::N]`` is
  micro-batch ``i`` of ``N``; inputs have distinct rows) that calls ``nnx.value_and_grad``
  on each micro-batch in order on a clone of the model, so RNG streams and running
  statistics advance exactly as the accumulated step must advance them.
Both sides run under ``nnx.jit``; tolerances are ``tests._util.assert_close``'s float32
1e-5 relative to each leaf's largest entry.
"""

import functools
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum
from tests._problems import micro_batch, micro_batches
from tests._util import assert_close

VOCAB, SEQ = 13, 6


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


class CNN(nnx.Module):
  """Conv -> GroupNorm or BatchNorm -> relu -> mean pool -> Dropout -> Linear."""

  def __init__(self, norm, rngs, *, dropout=0.0, use_running_average=False):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    if norm == "group":
      self.norm = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    else:
      self.norm = nnx.BatchNorm(4, use_running_average=use_running_average, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.norm(self.conv(x)))
    return self.head(self.drop(h.mean(axis=(1, 2))))


class Transformer(nnx.Module):
  """One pre-LayerNorm causal block with attention and residual dropout."""

  def __init__(self, rngs, *, dropout=0.1):
    self.embed = nnx.Embed(VOCAB, 8, rngs=rngs)
    self.pos = nnx.Param(0.1 * jax.random.normal(rngs.params(), (SEQ, 8)))
    self.ln1 = nnx.LayerNorm(8, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, dropout_rate=dropout, deterministic=dropout == 0.0,
        decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(8, rngs=rngs)
    self.ff1 = nnx.Linear(8, 16, rngs=rngs)
    self.ff2 = nnx.Linear(16, 8, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.out = nnx.Linear(8, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
    h = h + self.drop(self.attn(self.ln1(h), mask=nnx.make_causal_mask(tokens)))
    h = h + self.drop(self.ff2(jax.nn.gelu(self.ff1(self.ln2(h)))))
    return self.out(h)


def classify_loss(model, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def lm_loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make(name, seed=0):
  rngs = nnx.Rngs(seed)
  if name == "mlp":
    return MLP(rngs), classify_loss
  if name == "cnn_group":
    return CNN("group", rngs), classify_loss
  if name == "cnn_group_dropout":
    return CNN("group", rngs, dropout=0.5), classify_loss
  if name == "cnn_batch":
    return CNN("batch", rngs), classify_loss
  if name == "cnn_batch_eval":
    return CNN("batch", rngs, use_running_average=True), classify_loss
  if name == "transformer":
    return Transformer(rngs, dropout=0.0), lm_loss
  if name == "transformer_dropout":
    return Transformer(rngs, dropout=0.2), lm_loss
  raise ValueError(name)


def data(name, step, batch_size=8):
  key = jax.random.fold_in(jax.random.key(42), step)
  kx, ky = jax.random.split(key)
  if name.startswith("transformer"):
    return jax.random.randint(kx, (batch_size, SEQ + 1), 0, VOCAB)
  shape = (batch_size, 4) if name == "mlp" else (batch_size, 6, 6, 1)
  return jax.random.normal(kx, shape), jax.random.randint(ky, (batch_size,), 0, 3)


TX = optax.sgd(0.1, momentum=0.9)  # one object, so that nnx.jit caches across models


@functools.cache
def jitted_step(vg):
  @nnx.jit
  def step(model, optimizer, batch):
    loss, grads = vg(model, batch)
    optimizer.update(model, grads)
    return loss, grads

  return step


def train(model, vg, batches):
  """nnx.Optimizer steps under nnx.jit with ``vg``, accumulated or full-batch."""
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
  step = jitted_step(vg)
  return [step(model, optimizer, b) for b in batches]


@functools.cache
def _jitted_value_and_grad(loss_fn, **kwargs):
  """``nnx.jit(nnx.value_and_grad(loss_fn))``, built once per loss: the references of
  several steps then run one compiled program (a new nnx.jit object compiles again)."""
  return nnx.jit(nnx.value_and_grad(loss_fn, **kwargs))


def sequential_reference(model, loss_fn, batch, num_micro_batches, **kwargs):
  """Mean loss and grads of nnx.value_and_grad on each micro-batch, in order, under nnx.jit.

  ``model`` is updated in place micro-batch after micro-batch (RNG streams, statistics).
  """
  vg = _jitted_value_and_grad(loss_fn, **kwargs)
  outs = [vg(model, mb) for mb in micro_batches(batch, num_micro_batches)]
  return jax.tree.map(lambda *xs: sum(xs) / num_micro_batches, *outs), outs


def params(model):
  return nnx.state(model, nnx.Param)


def arrays(model, *filters):
  """The model's state as arrays, with PRNG keys as their raw key data, for comparisons."""
  def raw(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  return jax.tree.map(raw, nnx.to_pure_dict(nnx.state(model, *filters)))


@pytest.mark.parametrize("name,n", [
    ("mlp", 1), ("mlp", 4), ("mlp", 8),
    ("cnn_group", 2),
    ("cnn_batch_eval", 4),
])
def test_optimizer_steps_equal_full_batch(name, n):
  acc_model, loss_fn = make(name)
  ref_model, _ = make(name)
  batches = [data(name, s) for s in range(3)]
  acc = train(acc_model, jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=n), batches)
  ref = train(ref_model, nnx.value_and_grad(loss_fn), batches)
  for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(acc, ref, strict=True)):
    assert_close(loss, ref_loss, err_msg=f"loss, step {step}")
    assert_close(grads, ref_grads, err_msg=f"grads, step {step}")
  assert_close(params(acc_model), params(ref_model), err_msg="params after 3 steps")
  assert_close(arrays(acc_model), arrays(ref_model), err_msg="whole model state")


class GradEquivalenceTest(chex.TestCase):
  """jaxaccum.nnx.grad with aux equals nnx.grad on the full batch, jitted or not."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_grad_and_has_aux_equal_full_batch(self):
    model, _ = make("mlp")
    batch = data("mlp", 0)

    def loss_fn(model, batch):
      logits = model(batch[0])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
      return loss, {"logit_mean": logits.mean(), "logits": logits}

    grad_fn = jaxaccum.nnx.grad(loss_fn, num_micro_batches=4, has_aux=True,
                                aux_reduce={"logit_mean": "mean", "logits": "stack"})
    graphdef, state = nnx.split(model)  # the state crosses the (possibly jitted) boundary
    grads, aux = self.variant(lambda state, batch: grad_fn(nnx.merge(graphdef, state), batch))(
        state, batch)
    ref_grads, ref_aux = nnx.jit(nnx.grad(loss_fn, has_aux=True))(model, batch)
    chex.assert_trees_all_close(
        (grads, aux["logit_mean"]), (ref_grads, ref_aux["logit_mean"]), rtol=1e-5, atol=1e-6)
    # Stacked aux: micro-batch i holds rows i, i + 4.
    chex.assert_trees_all_close(
        aux["logits"], jnp.stack([ref_aux["logits"][i::4] for i in range(4)]), rtol=1e-5,
        atol=1e-6)


def test_transformer_weighted_token_loss_steps_equal_full_batch():
  """A transformer LM without dropout, reduce='weighted' with uneven padding: several
  nnx.Optimizer steps equal the full-batch token mean's steps."""
  model, _ = make("transformer")
  ref_model, _ = make("transformer")
  batches = []
  for s in range(3):
    lengths = jax.random.randint(jax.random.key(s), (8,), 2, SEQ + 2)
    mask = (jnp.arange(SEQ)[None, :] < lengths[:, None] - 1).astype(jnp.float32)
    batches.append((data("transformer", s), mask))

  def token_losses(model, batch):
    tokens, mask = batch
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]) * mask

  def weighted(model, batch):
    return token_losses(model, batch).sum(), batch[1].sum()

  def full(model, batch):
    return token_losses(model, batch).sum() / batch[1].sum()

  acc = train(model, jaxaccum.nnx.value_and_grad(weighted, num_micro_batches=4,
                                                 reduce="weighted"), batches)
  ref = train(ref_model, nnx.value_and_grad(full), batches)
  for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(acc, ref, strict=True)):
    assert_close(loss, ref_loss, err_msg=f"loss, step {step}")
    assert_close(grads, ref_grads, err_msg=f"grads, step {step}")
  assert_close(arrays(model), arrays(ref_model), err_msg="model after 3 steps")


# ----------------------------------------------------------------------------- BatchNorm


def test_batchnorm_is_ghost_batch_with_sequential_running_stats():
  """Statistics per micro-batch; running averages updated once per micro-batch, in order."""
  n = 4
  model, loss_fn = make("cnn_batch")
  ref_model, _ = make("cnn_batch")
  batch = data("cnn_batch", 0)
  loss, grads = nnx.jit(jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=n))(model, batch)
  (ref_loss, ref_grads), _ = sequential_reference(ref_model, loss_fn, batch, n)
  assert_close(loss, ref_loss)
  assert_close(grads, ref_grads)
  assert_close(nnx.state(model, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat))

  # The running statistics are N sequential momentum updates with micro-batch statistics.
  # The conv parameters are unchanged (no optimizer step), so its output is the input to
  # BatchNorm that every micro-batch saw.
  h = nnx.jit(ref_model.conv)(batch[0])
  mean, var = jnp.zeros(4), jnp.ones(4)
  for i in range(n):
    m = 0.99  # nnx.BatchNorm's default momentum
    mean = m * mean + (1 - m) * h[i::n].mean(axis=(0, 1, 2))
    var = m * var + (1 - m) * h[i::n].var(axis=(0, 1, 2))
  assert_close(model.norm.mean[...], mean)
  assert_close(model.norm.var[...], var)


def test_batchnorm_gradient_differs_from_full_batch():
  """Ghost-batch statistics change the loss and the gradients: not the full-batch answer."""
  model, loss_fn = make("cnn_batch")
  ref_model, _ = make("cnn_batch")
  batch = data("cnn_batch", 0)
  loss, grads = nnx.jit(jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=4))(model, batch)
  ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(loss_fn))(ref_model, batch)
  g = np.asarray(grads["conv"]["kernel"][...])
  ref = np.asarray(ref_grads["conv"]["kernel"][...])
  rel = np.max(np.abs(g - ref)) / np.max(np.abs(ref))
  assert rel > 1e-2, f"ghost-batch gradient unexpectedly equals the full batch (rel={rel})"
  assert abs(float(loss) - float(ref_loss)) > 1e-4
  # One full-batch update of the running mean is not what accumulation does either.
  assert not np.allclose(model.norm.mean[...], ref_model.norm.mean[...], rtol=1e-3, atol=0)


# ----------------------------------------------------------------------------- Dropout / RNG


class DropLinear(nnx.Module):
  def __init__(self, rngs, *, keep_rngs=True):
    self.lin = nnx.Linear(16, 16, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs if keep_rngs else None)

  def __call__(self, x, rngs=None):
    return self.drop(self.lin(x), rngs=rngs)


def drop_loss(model, x, *args):
  y = model(x, *args)
  return jnp.mean(y**2), y


def test_dropout_fresh_mask_per_micro_batch_and_stream_advances():
  n = 4
  model, ref_model = DropLinear(nnx.Rngs(0)), DropLinear(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, 16))  # distinct rows
  step = nnx.jit(jaxaccum.nnx.value_and_grad(drop_loss, num_micro_batches=n, has_aux=True,
                                             aux_reduce="stack"))
  outs = []
  for s in range(2):
    (loss, ys), grads = step(model, x)
    ((ref_loss, _), ref_grads), ref_outs = sequential_reference(ref_model, drop_loss, x, n,
                                                                has_aux=True)
    assert_close(loss, ref_loss, err_msg=f"step {s}")
    assert_close(grads, ref_grads, err_msg=f"step {s}")
    assert_close(ys, jnp.stack([out[0][1] for out in ref_outs]), err_msg=f"step {s}")
    # Each micro-batch drew its own mask: no two micro-batches share one.
    masks = np.asarray(ys == 0).reshape(n, -1)
    for i in range(n):
      for j in range(i):
        assert (masks[i] != masks[j]).any(), f"micro-batches {i} and {j} share a mask"
    # The stream advanced once per micro-batch, like the sequential reference.
    assert int(model.drop.rngs.count[...]) == n * (s + 1)
    assert_close(arrays(model, nnx.RngState), arrays(ref_model, nnx.RngState))
    outs.append(masks)
  assert (outs[0] != outs[1]).any(), "the second step reused the first step's masks"


def test_same_seed_same_result_different_seed_different_result():
  vg = jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=4)

  def run(seed):
    model = CNN("group", nnx.Rngs(params=0, dropout=seed), dropout=0.5)
    out = train(model, vg, [data("cnn", s) for s in range(2)])
    return [loss for loss, _ in out], params(model)

  losses_a, params_a = run(1)
  losses_b, params_b = run(1)
  losses_c, _ = run(2)
  np.testing.assert_array_equal(np.asarray(losses_a), np.asarray(losses_b))
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)
  assert not np.allclose(losses_a[1], losses_c[1])


def test_call_time_rngs_are_threaded_and_updated_in_place():
  """fun(model, batch, rngs): an nnx.Rngs argument advances like the model's own streams."""
  n = 4
  model = DropLinear(nnx.Rngs(0), keep_rngs=False)
  ref_model = DropLinear(nnx.Rngs(0), keep_rngs=False)
  rngs, ref_rngs = nnx.Rngs(dropout=7), nnx.Rngs(dropout=7)
  x = jax.random.normal(jax.random.key(2), (8, 16))
  step = nnx.jit(jaxaccum.nnx.value_and_grad(drop_loss, num_micro_batches=n, has_aux=True,
                                             aux_reduce="stack"))
  (loss, ys), grads = step(model, x, rngs)
  vg = nnx.jit(nnx.value_and_grad(drop_loss, has_aux=True))
  ref = [vg(ref_model, mb, ref_rngs) for mb in micro_batches(x, n)]
  assert_close(loss, sum(r[0][0] for r in ref) / n)
  assert_close(ys, jnp.stack([r[0][1] for r in ref]))
  assert_close(grads, jax.tree.map(lambda *g: sum(g) / n, *[r[1] for r in ref]))
  assert int(rngs.dropout.count[...]) == n == int(ref_rngs.dropout.count[...])


def test_rng_argnums_folds_a_plain_key_per_micro_batch():
  n = 2
  model = DropLinear(nnx.Rngs(0), keep_rngs=False)
  key = jax.random.key(3)
  x = jax.random.normal(jax.random.key(4), (4, 16))
  (loss, ys), _ = nnx.jit(jaxaccum.nnx.value_and_grad(
      drop_loss, num_micro_batches=n, has_aux=True, aux_reduce="stack", rng_argnums=2))(
          model, x, key)
  for i in range(n):
    _, ref_y = nnx.jit(drop_loss)(model, micro_batch(x, i, n), jax.random.fold_in(key, i))
    assert_close(ys[i], ref_y)


def test_transformer_with_dropout_matches_sequential_micro_batches():
  """Several nnx.Optimizer steps with attention and residual dropout under nnx.jit."""
  n = 4
  model, loss_fn = make("transformer_dropout")
  ref_model, _ = make("transformer_dropout")
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
  ref_optimizer = nnx.Optimizer(ref_model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=n)(model, tokens)
    optimizer.update(model, grads)
    return loss, grads

  update = nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))
  for s in range(2):
    tokens = data("transformer_dropout", s)
    loss, grads = step(model, optimizer, tokens)
    (ref_loss, ref_grads), _ = sequential_reference(ref_model, loss_fn, tokens, n)
    update(ref_model, ref_optimizer, ref_grads)
    assert_close(loss, ref_loss, err_msg=f"step {s}")
    assert_close(grads, ref_grads, err_msg=f"step {s}")
  assert_close(arrays(model), arrays(ref_model))
  # The residual-dropout stream advanced twice (two Dropout calls) per micro-batch and step.
  assert int(model.drop.rngs.count[...]) == 2 * n * 2


def test_no_retrace_on_second_step():
  model = CNN("batch", nnx.Rngs(0), dropout=0.5)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  vg = jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=4)
  chex.clear_trace_counter()

  @nnx.jit
  @chex.assert_max_traces(n=1)
  def step(model, optimizer, batch):
    loss, grads = vg(model, batch)
    optimizer.update(model, grads)
    return loss

  for s in range(3):
    step(model, optimizer, data("cnn", s))


@pytest.mark.parametrize(("option", "value", "rows"), [
    ("num_micro_batches", 2, 4), ("micro_batch_size", 2, 2)])
def test_fun_sees_micro_batches_of_the_requested_shape(option, value, rows):
  traced_shapes = []

  def loss_fn(model, batch):
    traced_shapes.append(batch[0].shape)
    return classify_loss(model, batch)

  model, ref_model = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
  batch = data("mlp", 0)
  loss, grads = nnx.jit(jaxaccum.nnx.value_and_grad(loss_fn, **{option: value}))(model, batch)
  assert traced_shapes and set(traced_shapes) == {(rows, 4)}, traced_shapes
  ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(classify_loss))(ref_model, batch)
  assert_close((loss, grads), (ref_loss, ref_grads))


def test_import_jaxaccum_does_not_import_flax():
  code = ("import sys, jaxaccum; assert 'flax' not in sys.modules; "
          "jaxaccum.nnx; assert 'flax.nnx' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu"})


# ----------------------------------------------------------------------------- bad input


class OnlyStats(nnx.Module):
  def __init__(self):
    self.stat = nnx.BatchStat(jnp.zeros(3))

  def __call__(self, x):
    return x * self.stat[...]


def test_model_without_wrt_variables():
  vg = jaxaccum.nnx.value_and_grad(lambda m, x: jnp.mean(m(x)), num_micro_batches=2)
  with pytest.raises(ValueError, match=r"OnlyStats has no variables matching wrt=.*Param"):
    vg(OnlyStats(), jnp.ones((4, 3)))
  vg = jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=2, wrt=nnx.BatchStat)
  with pytest.raises(ValueError, match=r"MLP has no variables matching wrt=.*BatchStat"):
    vg(MLP(nnx.Rngs(0)), data("mlp", 0))


def test_fun_not_shaped_model_batch():
  with pytest.raises(TypeError, match=r"fun\(model, batch, \.\.\.\).*signature \(model\)"):
    jaxaccum.nnx.value_and_grad(lambda model: 0.0, num_micro_batches=2)

  def kw_batch(model, *, batch):
    return 0.0

  with pytest.raises(TypeError, match=r"first two positional arguments"):
    jaxaccum.nnx.value_and_grad(kw_batch, num_micro_batches=2)
  with pytest.raises(TypeError, match=r"fun must be a callable"):
    jaxaccum.nnx.value_and_grad("loss", num_micro_batches=2)

  vg = jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=2)
  model, batch = MLP(nnx.Rngs(0)), data("mlp", 0)
  with pytest.raises(TypeError, match=r"first argument \(model\) must be an NNX object.*dict"):
    vg(nnx.to_pure_dict(nnx.state(model)), batch)
  with pytest.raises(TypeError, match=r"second argument \(batch\).*NNX object MLP"):
    vg(model, model)
  with pytest.raises(ValueError, match=r"batch_argnums=1 is out of range: the function was "
                     r"called with 1 positional argument"):
    vg(model)


def test_mismatched_batch_leaves():
  vg = jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=2)
  x, y = data("mlp", 0)
  with pytest.raises(ValueError,
                     match=r"8 at argument 1 \('batch'\)\[0\]; 6 at argument 1 \('batch'\)\[1\]"):
    vg(MLP(nnx.Rngs(0)), (x, y[:6]))
  with pytest.raises(ValueError, match=r"batch leaf argument 1 \('batch'\)\[1\] is a scalar"):
    vg(MLP(nnx.Rngs(0)), (x, y[0]))
  with pytest.raises(ValueError, match=r"not divisible by num_micro_batches=3"):
    jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=3)(MLP(nnx.Rngs(0)), (x, y))


def test_bad_outputs_and_options():
  model, batch = MLP(nnx.Rngs(0)), data("mlp", 0)
  with pytest.raises(TypeError, match=r"return \(value, aux\) because has_aux=True"):
    jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=2, has_aux=True)(model, batch)
  with pytest.raises(TypeError, match=r"the value returned by fun must be a scalar"):
    jaxaccum.nnx.value_and_grad(lambda m, b: (classify_loss(m, b), 1.0),
                                num_micro_batches=2)(model, batch)
  with pytest.raises(TypeError, match=r"wrt must be an NNX filter.*got wrt=3.14"):
    jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=2, wrt=3.14)
  with pytest.raises(ValueError, match=r"exactly one of num_micro_batches"):
    jaxaccum.nnx.value_and_grad(classify_loss)
  with pytest.raises(ValueError, match=r"batch_argnums=\(1,\) and rng_argnums=\(1,\) overlap "
                     r"at argument\(s\) \[1\]"):
    jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=2, rng_argnums=1)

  def grows(model, batch):
    model.extra = nnx.BatchStat(jnp.zeros(()))
    return classify_loss(model, batch)

  with pytest.raises(ValueError, match=r"fun changed the structure of the model"):
    jaxaccum.nnx.value_and_grad(grows, num_micro_batches=2)(model, batch)


def test_nnx_object_as_keyword_argument_is_threaded():
  model = MLP(nnx.Rngs(0))

  def loss_fn(model, batch, *, rngs):
    return jnp.mean(model(batch[0]) ** 2)

  grad_fn = jaxaccum.nnx.value_and_grad(loss_fn, num_micro_batches=2)
  batch = (jnp.ones((4, 4)), jnp.ones((4, 2)))
  ref = nnx.value_and_grad(lambda model, batch: loss_fn(model, batch, rngs=None))(model, batch)
  assert_close(grad_fn(model, batch, rngs=nnx.Rngs(1)), ref)


class SpectralHead(nnx.Module):
  """A spectrally normalised layer (power iteration written back into its kernel and ``u``)
  and a Param that the forward pass updates in place (an EMA of the inputs)."""

  def __init__(self, rngs):
    self.sn = nnx.SpectralNorm(nnx.Linear(4, 3, rngs=rngs), rngs=rngs)
    self.center = nnx.Param(jnp.zeros(4))

  def __call__(self, x):
    self.center[...] = 0.5 * self.center[...] + 0.5 * jax.lax.stop_gradient(x.mean(0))
    return self.sn(x - self.center[...], update_stats=True)


def test_writes_to_differentiated_variables_are_threaded_like_nnx_value_and_grad():
  """A write to a wrt variable (SpectralNorm's kernel, a Param updated in place) is kept,
  as nnx.value_and_grad keeps it, and micro-batch i + 1 sees micro-batch i's."""
  n = 4
  model, ref_model = SpectralHead(nnx.Rngs(0)), SpectralHead(nnx.Rngs(0))
  x, y = data("mlp", 0, batch_size=8)
  step = nnx.jit(jaxaccum.nnx.value_and_grad(classify_loss, num_micro_batches=n))
  loss, grads = step(model, (x, y))
  (ref_loss, ref_grads), _ = sequential_reference(ref_model, classify_loss, (x, y), n)
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(arrays(model), arrays(ref_model), rtol=1e-5, atol=1e-6)
  # Not the model left by a single step on the full batch.
  full = SpectralHead(nnx.Rngs(0))
  nnx.jit(nnx.value_and_grad(classify_loss))(full, (x, y))
  assert not np.allclose(model.center[...], full.center[...])


class Teacher(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 3, rngs=rngs)
    self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    self.calls[...] += 1
    return self.lin(x)


def teacher_loss(teacher, x):
  return jnp.mean(jnp.tanh(teacher(x)) ** 2)


def test_nested_call_inside_another_accumulated_loss():
  """An accumulated function called inside another's loss (re-entrant): each call keeps its
  own model, and the teacher's gradients and counter thread through both loops."""
  n, m = 2, 2
  inner = jaxaccum.nnx.value_and_grad(teacher_loss, num_micro_batches=m)

  def student_loss(model, x, teacher, vg):
    t_loss, t_grads = vg(teacher, x)
    g2 = sum(jnp.sum(g ** 2) for g in jax.tree.leaves(t_grads))
    return jnp.mean(model(x) ** 2) * (1.0 + g2) + t_loss

  def ref_inner(teacher, x):  # the inner accumulation by hand: x[j::m], in order
    outs = [nnx.value_and_grad(teacher_loss)(teacher, xj) for xj in micro_batches(x, m)]
    return jax.tree.map(lambda *o: sum(o) / m, *outs)

  model, teacher = MLP(nnx.Rngs(0)), Teacher(nnx.Rngs(1))
  ref_model, ref_teacher = MLP(nnx.Rngs(0)), Teacher(nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(5), (8, 4))
  step = nnx.jit(jaxaccum.nnx.value_and_grad(
      lambda model, x, teacher: student_loss(model, x, teacher, inner), num_micro_batches=n))
  loss, grads = step(model, x, teacher)
  ref_vg = nnx.jit(nnx.value_and_grad(
      lambda model, x, teacher: student_loss(model, x, teacher, ref_inner)))
  refs = [ref_vg(ref_model, xi, ref_teacher) for xi in micro_batches(x, n)]
  chex.assert_trees_all_close((loss, grads), jax.tree.map(lambda *r: sum(r) / n, *refs),
                              rtol=1e-5, atol=1e-6)
  assert int(teacher.calls[...]) == n * m == int(ref_teacher.calls[...])


def _dot_shapes(jaxpr):
  """The output shapes of every dot_general in a jaxpr, inner jaxprs included."""
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.add(tuple(eqn.outvars[0].aval.shape))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out |= _dot_shapes(inner)
  return out


def test_a_teacher_passed_to_the_loss_is_not_differentiated():
  """Only the model's (argument 0's) Params are differentiated, as nnx.value_and_grad does:
  another NNX object (a teacher) is threaded, its gradients neither returned nor computed,
  nor counted in with_info's norms."""
  n = 2

  def distill(model, x, teacher):
    return jnp.mean((model(x) - teacher(x)) ** 2)

  x = np.asarray(jax.random.normal(jax.random.key(6), (12, 4)))  # 6 rows per micro-batch
  model, teacher = MLP(nnx.Rngs(0)), Teacher(nnx.Rngs(1))
  vg = nnx.jit(jaxaccum.nnx.value_and_grad(distill, num_micro_batches=n, with_info=True))
  loss, grads, info = vg(model, x, teacher)
  assert int(teacher.calls[...]) == n
  ref_vg = nnx.jit(nnx.value_and_grad(distill))  # argument 0 only
  ref = ref_vg(MLP(nnx.Rngs(0)), x, Teacher(nnx.Rngs(1)))
  chex.assert_trees_all_close((loss, grads), ref, rtol=1e-5, atol=1e-6)
  micro = [ref_vg(MLP(nnx.Rngs(0)), xi, Teacher(nnx.Rngs(1)))[1] for xi in micro_batches(x, n)]
  sq = lambda g: sum(float(jnp.sum(a ** 2)) for a in jax.tree.leaves(g))  # noqa: E731
  chex.assert_trees_all_close(info.batch_grad_sq_norm, sq(ref[1]), rtol=1e-5)
  chex.assert_trees_all_close(info.micro_grad_sq_norm, sum(map(sq, micro)) / n, rtol=1e-5)
  # Nor computed: no product gives the teacher's (4, 3) kernel gradient, while the model's
  # (4, 8) and (8, 3) kernel gradients are there (the micro-batch's 6 rows match neither).
  shapes = _dot_shapes(jax.make_jaxpr(vg)(model, x, teacher).jaxpr)
  assert not shapes & {(4, 3), (3, 4)}, shapes
  assert shapes & {(4, 8), (8, 4)} and shapes & {(8, 3), (3, 8)}, shapes
