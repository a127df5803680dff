"""Train steps written in the style of four widely used Flax example programs, each ported
to jaxaccum by changing a few lines (marked ``# port:``; docs/porting.md shows the diffs).

1. NNX CNN classifier: BatchNorm + Dropout, an ``nnx.Rngs`` argument, ``(loss, logits)``
   aux feeding an ``nnx.MultiMetric`` (logits come back with ``aux_reduce="concat"``).
2. Linen transformer LM: padding weights, ``(loss_sum, weight_sum)``, metric sums and a
   dropout key folded with ``state.step``.
3. Linen ResNet-like model: ``batch_stats`` with cross-replica BatchNorm under ``jax.pmap``
   over 2 devices, ported with ``make_train_step(axis_name="batch")``.
4. NNX decoder LM: a token-mean loss over real tokens (``reduce="weighted"``).

Each port equals the original step on the full batch where that is defined (BatchNorm in
eval mode, dropout off), and equals the original step's loss run on the micro-batches one
after the other (rows ``i::N`` by explicit slicing, state carried from one to the next)
where it is not. float32, 1e-5 relative to each leaf's largest entry.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax import lax

import jaxaccum
from tests._problems import micro_batch
from tests._util import assert_close

N = 4


def micro(tree, i, n=N):
  """Micro-batch ``i`` of ``n``, rows ``i::n`` (sliced on the host outside a trace)."""
  return micro_batch(tree, i, n)


def mean_of(trees):
  """The mean of a list of pytrees, in float32 NumPy on the host (no program per leaf)."""
  return jax.tree.map(lambda *a: sum(np.asarray(x) for x in a) / len(a), *trees)


def unsplit(pieces):
  """Rows of micro-batch ``i`` (rows ``i::N``) put back in the original order."""
  n = len(pieces)
  out = np.empty((pieces[0].shape[0] * n,) + pieces[0].shape[1:], pieces[0].dtype)
  for i, p in enumerate(pieces):
    out[i::n] = np.asarray(p)
  return out


# --- 1. NNX CNN classifier ------------------------------------------------------------------


class CNN(nnx.Module):
  def __init__(self, *, rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.dropout = nnx.Dropout(0.25)
    self.linear = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x, rngs=None):
    x = nnx.relu(self.bn(self.conv(x)))
    x = self.dropout(x.mean(axis=(1, 2)), rngs=rngs)
    return self.linear(x)


def cnn_loss_fn(model, rngs, batch):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


@nnx.jit
def cnn_train_step(model, optimizer, metrics, rngs, batch):  # the original
  grad_fn = nnx.value_and_grad(cnn_loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def cnn_ported_train_step(model, optimizer, metrics, rngs, batch):
  grad_fn = jaxaccum.nnx.value_and_grad(  # port: the accumulated transform
      cnn_loss_fn, has_aux=True, num_micro_batches=N, batch_argnums=2, aux_reduce="concat")
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def cnn_micro_grads(model, rngs, batch):
  return nnx.value_and_grad(cnn_loss_fn, has_aux=True)(model, rngs, batch)


def cnn_setup(train):
  model = CNN(rngs=nnx.Rngs(0))
  if not train:  # BatchNorm on running statistics, dropout off
    model.bn.use_running_average = True
    model.dropout.deterministic = True
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  return model, optimizer, metrics, nnx.Rngs(dropout=1)


def cnn_batch(step):
  kx, ky = jax.random.split(jax.random.key(100 + step))
  return {"image": jax.random.normal(kx, (16, 6, 6, 1)),
          "label": jax.random.randint(ky, (16,), 0, 3)}


def nnx_arrays(*objs):
  def one(a):
    return jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a
  return [jax.tree.map(one, nnx.to_pure_dict(nnx.state(o))) for o in objs]


def test_nnx_cnn_classifier_eval_mode_equals_full_batch():
  ref, port = cnn_setup(train=False), cnn_setup(train=False)
  for step in range(2):
    cnn_train_step(*ref, cnn_batch(step))
    cnn_ported_train_step(*port, cnn_batch(step))
  assert_close(nnx_arrays(*port[:2]), nnx_arrays(*ref[:2]))
  assert_close(port[2].compute(), ref[2].compute())


def test_nnx_cnn_classifier_train_mode_equals_micro_batches_in_order():
  (model, optimizer, metrics, rngs) = cnn_setup(train=True)
  (rmodel, roptimizer, rmetrics, rrngs) = cnn_setup(train=True)
  batch = cnn_batch(0)
  cnn_ported_train_step(model, optimizer, metrics, rngs, batch)

  outs = [cnn_micro_grads(rmodel, rrngs, micro(batch, i)) for i in range(N)]
  loss = mean_of([o[0][0] for o in outs])
  grads = mean_of([o[1] for o in outs])
  logits = unsplit([o[0][1] for o in outs])
  nnx.jit(lambda m, o, g: o.update(m, g))(rmodel, roptimizer, grads)
  rmetrics.update(loss=loss, logits=jnp.asarray(logits), labels=batch["label"])

  assert_close(nnx_arrays(model, optimizer, rngs), nnx_arrays(rmodel, roptimizer, rrngs))
  assert_close(metrics.compute(), rmetrics.compute())


# --- 2. Linen transformer LM ----------------------------------------------------------------

V, T = 11, 6


class LM(nn.Module):
  deterministic: bool = False

  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(V, 16)(tokens)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, dropout_rate=0.2,
                             deterministic=self.deterministic)(
        nn.LayerNorm()(h), mask=nn.make_causal_mask(tokens))
    ff = nn.Dense(16)(nn.gelu(nn.LayerNorm()(h)))
    h = h + nn.Dropout(0.2, deterministic=self.deterministic)(ff)
    return nn.Dense(V)(h)


def compute_weighted_cross_entropy(logits, targets, weights):
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights
  return loss.sum(), weights.sum()


def compute_metrics(logits, targets, weights):
  loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights)
  accuracy = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
  return {"loss": loss, "accuracy": accuracy, "denominator": weight_sum}


def lm_train_step(state, batch, dropout_rng):  # the original
  inputs, targets = batch["inputs"], batch["targets"]
  weights = jnp.where(targets > 0, 1.0, 0.0)
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, rngs={"dropout": dropout_rng})
    loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights)
    return loss / weight_sum, logits

  (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  return new_state, compute_metrics(logits, targets, weights)


def lm_ported_train_step(state, batch, dropout_rng):
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params, batch, model_state, rngs):  # port: the batch and keys are arguments
    inputs, targets = batch["inputs"], batch["targets"]
    weights = jnp.where(targets > 0, 1.0, 0.0)
    logits = state.apply_fn({"params": params}, inputs, rngs=rngs)
    loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights)
    return (loss, weight_sum), (model_state, compute_metrics(logits, targets, weights))  # port

  grad_fn = jaxaccum.linen.value_and_grad(  # port
      loss_fn, num_micro_batches=N, has_aux=True, reduce="weighted", aux_reduce="sum")
  (_, (_, metrics)), grads = grad_fn(state.params, batch, {}, {"dropout": dropout_rng})
  new_state = state.apply_gradients(grads=grads)
  return new_state, metrics


def lm_setup(deterministic):
  model = LM(deterministic=deterministic)
  key = jax.random.key(7)
  lengths = jnp.array([6, 2, 5, 1, 6, 6, 3, 4, 2, 6, 5, 1, 6, 4, 3, 2])  # uneven padding
  tokens = jax.random.randint(key, (16, T + 1), 1, V)
  tokens = jnp.where(jnp.arange(T + 1) <= lengths[:, None], tokens, 0)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = jax.jit(model.init)(jax.random.key(8), batch["inputs"])["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.sgd(0.1, momentum=0.9))
  return state, batch


def test_linen_lm_dropout_off_equals_full_batch():
  state, batch = lm_setup(deterministic=True)
  ref_state, ref_metrics = jax.jit(lm_train_step)(state, batch, jax.random.key(9))
  new_state, metrics = jax.jit(lm_ported_train_step)(state, batch, jax.random.key(9))
  assert_close(new_state.params, ref_state.params)
  assert_close(metrics, ref_metrics)


def test_linen_lm_dropout_equals_micro_batches_in_order():
  state, batch = lm_setup(deterministic=False)
  rng = jax.random.fold_in(jax.random.key(9), state.step)

  @jax.jit
  def micro_step(params, mb, key):  # the original loss's numerator on one micro-batch
    def num(params):
      targets = mb["targets"]
      weights = jnp.where(targets > 0, 1.0, 0.0)
      logits = state.apply_fn({"params": params}, mb["inputs"], rngs={"dropout": key})
      return compute_weighted_cross_entropy(logits, targets, weights)[0], (
          compute_metrics(logits, targets, weights))
    return jax.grad(num, has_aux=True)(params)

  outs = [micro_step(state.params, micro(batch, i), jax.random.fold_in(rng, i))
          for i in range(N)]
  # The sums on the host and the update jitted (eagerly, each op of each leaf's shape
  # would compile a program of its own).
  ref_metrics = jax.tree.map(lambda *m: sum(np.asarray(x) for x in m), *(o[1] for o in outs))
  ref_grads = jax.tree.map(lambda *g: sum(np.asarray(x) for x in g) / ref_metrics["denominator"],
                           *(o[0] for o in outs))
  ref_state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, ref_grads)

  new_state, metrics = jax.jit(lm_ported_train_step)(state, batch, jax.random.key(9))
  assert_close(new_state.params, ref_state.params)
  assert_close(metrics, ref_metrics)


# --- 3. Linen ResNet-like model under jax.pmap ----------------------------------------------


class ResNetLike(nn.Module):
  train: bool = True

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(nn.BatchNorm, use_running_average=not self.train, momentum=0.9,
                             axis_name="batch" if self.train else None)
    x = nn.relu(norm()(nn.Conv(4, (3, 3), use_bias=False)(x)))
    y = norm()(nn.Conv(4, (3, 3), use_bias=False)(x))
    x = nn.relu(x + y)
    return nn.Dense(3)(x.mean(axis=(1, 2)))


class TrainState(train_state.TrainState):
  batch_stats: dict


def cross_entropy_loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def resnet_train_step(state, batch):  # the original, under jax.pmap(axis_name="batch")
  def loss_fn(params):
    logits, new_model_state = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, batch["image"],
        mutable=["batch_stats"])
    return cross_entropy_loss(logits, batch["label"]), (new_model_state, logits)

  (loss, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params)
  grads = lax.pmean(grads, axis_name="batch")
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  metrics = lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name="batch")
  new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
  return new_state, metrics


def resnet_loss_fn(params, batch, model_state, rngs):  # port: a loss of its arguments
  logits, new_model_state = RESNET.apply(
      {"params": params, **model_state}, batch["image"], mutable=["batch_stats"])
  loss = cross_entropy_loss(logits, batch["label"])
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  return loss, (new_model_state, {"loss": loss, "accuracy": accuracy})


RESNET = ResNetLike()
resnet_ported_train_step = jaxaccum.linen.make_train_step(  # port: replaces resnet_train_step
    resnet_loss_fn, num_micro_batches=2, has_aux=True, axis_name="batch")


def resnet_setup(train):
  global RESNET
  RESNET = ResNetLike(train=train)
  kx, ky = jax.random.split(jax.random.key(11))
  batch = {"image": jax.random.normal(kx, (16, 6, 6, 1)),
           "label": jax.random.randint(ky, (16,), 0, 3)}
  variables = jax.jit(ResNetLike(train=False).init)(jax.random.key(12), batch["image"])
  state = TrainState.create(apply_fn=RESNET.apply, params=variables["params"],
                            tx=optax.sgd(0.1, momentum=0.9),
                            batch_stats=jax.tree.map(lambda s: s + 0.1, variables["batch_stats"]))
  return state, batch


DEVICES = jax.devices()[:2]


# The pmap glue in NumPy on the host: an eager jnp op compiles a program per leaf shape.
def shard(tree):
  return jax.tree.map(lambda a: np.asarray(a).reshape((2, a.shape[0] // 2) + a.shape[1:]),
                      tree)


def replicate(tree):
  return jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (2,) + np.shape(a)), tree)


def replica(tree, r):
  return jax.tree.map(lambda a: np.asarray(a)[r], tree)


def run_ported(state, batch):
  def step(state, batch):
    return resnet_ported_train_step(state, batch, {})
  new, (loss, metrics) = jax.pmap(step, axis_name="batch", devices=DEVICES)(
      replicate(state), shard(batch))
  return new, loss, metrics


def test_linen_resnet_pmap_eval_mode_equals_full_batch():
  state, batch = resnet_setup(train=False)
  ref_state, ref_metrics = jax.pmap(resnet_train_step, axis_name="batch", devices=DEVICES[:1])(
      replicate_1(state), replicate_1(batch))  # the full batch on one device
  new, loss, metrics = run_ported(state, batch)
  for r in range(2):
    assert_close(replica(new.params, r), replica(ref_state.params, 0))
    assert_close(replica(new.batch_stats, r), replica(ref_state.batch_stats, 0))
    assert_close(replica(metrics, r), replica(ref_metrics, 0))
    assert_close(loss[r], ref_metrics["loss"][0])


def replicate_1(tree):
  return jax.tree.map(lambda a: np.asarray(a)[None], tree)


def test_linen_resnet_pmap_train_mode_equals_micro_batches_in_order():
  state, batch = resnet_setup(train=True)

  def reference(state, batch):  # the original step's loss, micro-batch after micro-batch
    stats, grads, metrics = state.batch_stats, [], []
    for i in range(2):
      mb = micro(batch, i, 2)

      def loss_fn(params, stats=stats, mb=mb):
        logits, new = state.apply_fn({"params": params, "batch_stats": stats}, mb["image"],
                                     mutable=["batch_stats"])
        loss = cross_entropy_loss(logits, mb["label"])
        return loss, (new["batch_stats"], jnp.mean(jnp.argmax(logits, -1) == mb["label"]))

      (loss, (stats, acc)), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
      grads.append(g)
      metrics.append({"loss": loss, "accuracy": acc})
    grads = lax.pmean(jax.tree.map(lambda a, b: (a + b) / 2, *grads), "batch")
    metrics = lax.pmean(jax.tree.map(lambda a, b: (a + b) / 2, *metrics), "batch")
    return state.apply_gradients(grads=grads, batch_stats=lax.pmean(stats, "batch")), metrics

  ref_state, ref_metrics = jax.pmap(reference, axis_name="batch", devices=DEVICES)(
      replicate(state), shard(batch))
  new, loss, metrics = run_ported(state, batch)
  for r in range(2):
    assert_close(replica(new.params, r), replica(ref_state.params, 0))
    assert_close(replica(new.batch_stats, r), replica(ref_state.batch_stats, 0))
    assert_close(replica(metrics, r), replica(ref_metrics, 0))


# --- 4. NNX decoder with a token-mean loss --------------------------------------------------


class Decoder(nnx.Module):
  def __init__(self, *, rngs, rate=0.2):
    self.embed = nnx.Embed(V, 16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, dropout_rate=rate,
                                       deterministic=rate == 0.0, decode=False, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.out = nnx.Linear(16, V, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    h = h + self.drop(self.attn(self.norm(h), mask=nnx.make_causal_mask(tokens)))
    return self.out(h)


def decoder_loss_fn(model, batch):  # the original: mean over real tokens
  logits = model(batch["inputs"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["targets"] > 0
  return jnp.sum(ce * mask) / jnp.sum(mask)


def decoder_ported_loss_fn(model, batch):
  logits = model(batch["inputs"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["targets"] > 0
  return jnp.sum(ce * mask), jnp.sum(mask)  # port: (numerator, denominator)


@nnx.jit
def decoder_train_step(model, optimizer, batch):
  loss, grads = nnx.value_and_grad(decoder_loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def decoder_ported_train_step(model, optimizer, batch):
  loss, grads = jaxaccum.nnx.value_and_grad(  # port
      decoder_ported_loss_fn, num_micro_batches=N, reduce="weighted")(model, batch)
  optimizer.update(model, grads)
  return loss


def decoder_setup(rate):
  model = Decoder(rngs=nnx.Rngs(params=0, dropout=1), rate=rate)
  return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def test_nnx_decoder_token_mean_dropout_off_equals_full_batch():
  _, batch = lm_setup(deterministic=True)
  ref, port = decoder_setup(0.0), decoder_setup(0.0)
  for _ in range(2):
    ref_loss = decoder_train_step(*ref, batch)
    loss = decoder_ported_train_step(*port, batch)
    assert_close(loss, ref_loss)
  assert_close(nnx_arrays(*port), nnx_arrays(*ref))


def test_nnx_decoder_token_mean_dropout_equals_micro_batches_in_order():
  _, batch = lm_setup(deterministic=True)
  port, (rmodel, roptimizer) = decoder_setup(0.2), decoder_setup(0.2)
  loss = decoder_ported_train_step(*port, batch)

  num_grad = nnx.jit(nnx.value_and_grad(lambda m, b: decoder_ported_loss_fn(m, b)[0]))
  outs = [num_grad(rmodel, micro(batch, i)) for i in range(N)]
  den = float(np.sum(np.asarray(batch["targets"]) > 0))
  ref_loss = sum(np.asarray(o[0]) for o in outs) / den  # on the host, as the grads
  grads = jax.tree.map(lambda *g: sum(np.asarray(x) for x in g) / den, *(o[1] for o in outs))
  nnx.jit(lambda m, o, g: o.update(m, g))(rmodel, roptimizer, grads)
  assert_close(loss, ref_loss)
  assert_close(nnx_arrays(*port), nnx_arrays(rmodel, roptimizer))
