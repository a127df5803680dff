"""DP-SGD's surroundings: the noise's place, per-example randomness, padding, mixed losses.

Each behaviour against a reference that does not go through the code under test: the
noise drawn by hand from the documented keys, dropout masks drawn from keys folded by
hand (or by ``nnx.Rngs`` itself), per-example ``jax.grad`` loops over rows sliced on the
host, and hand-sliced micro-batches (``x[i::N]``). The option pairs and the micro-batches
whose every example has a clip factor of 0 run on every program of the clip path
(materialised, ghost book-keeping, ghost second pass, ghost inside a scan body, and
``"auto"``'s materialised leaves).
"""

import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum
from jaxaccum._per_example import _ghost

C = 0.5


def _close(a, b, rtol=1e-5, atol=1e-6):
  chex.assert_trees_all_close(jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b),
                              rtol=rtol, atol=atol)


def _clip_np(g, c=C):
  """One gradient clipped in float64 NumPy."""
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
  norm = float(np.sqrt(sum(np.sum(x ** 2) for x in leaves)))
  f = min(1.0, c / norm) if norm > 0 else 1.0
  return jax.tree.map(lambda x: np.asarray(x, np.float64) * f, g)


def _sum(trees):
  return jax.tree.map(lambda *g: sum(g), *trees)


def _row(tree, j):
  return jax.tree.map(lambda a: np.asarray(a)[j:j + 1], tree)


# --- 1. The noise in the right place ---------------------------------------------------------


def _params(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(k1, (3, 4)), "b": jax.random.normal(k2, (4,))}


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_clipped": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("seed", range(3))
def test_dp_optimizer_equals_noise_then_optimizer_with_the_same_keys(name, seed):
  params = _params(seed)
  rng = np.random.default_rng(seed)
  sigma = float(rng.uniform(0.5, 2.0))
  batch = int(rng.integers(1, 300))
  key = jax.random.key(seed + 10)
  ours = jaxaccum.dp.dp_optimizer(OPTIMIZERS[name](), l2_norm_clip=C, noise_multiplier=sigma,
                               batch_size=batch, key=key)
  ref = optax.chain(jaxaccum.dp.dp_noise(C, sigma, batch_size=batch, key=key),
                    OPTIMIZERS[name]())
  s1, s2 = ours.init(params), ref.init(params)
  p1 = p2 = params
  for step in range(3):
    g = jax.tree.map(lambda x, step=step: jnp.sin(x * (step + 1)), params)
    u1, s1 = jax.jit(ours.update)(g, s1, p1)
    u2, s2 = jax.jit(ref.update)(g, s2, p2)
    _close(u1, u2, rtol=1e-6, atol=1e-7)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)


@pytest.mark.parametrize("seed", range(4))
def test_dp_optimizer_adds_the_documented_noise_before_the_optimizer(seed):
  # Through plain SGD at lr 1 the update is -(g + noise): the noise drawn by hand from the
  # documented keys (split(key, leaves + 1), the first kept for the next step).
  params = _params(seed)
  rng = np.random.default_rng(seed)
  sigma, batch = float(rng.uniform(0.1, 3.0)), int(rng.integers(1, 64))
  key = jax.random.key(seed)
  tx = jaxaccum.dp.dp_optimizer(optax.sgd(1.0), l2_norm_clip=C, noise_multiplier=sigma,
                             batch_size=batch, key=key)
  state = tx.init(params)
  g = jax.tree.map(jnp.cos, params)
  for _ in range(2):
    updates, state = tx.update(g, state, params)
    leaves, treedef = jax.tree.flatten(g)
    key, *keys = jax.random.split(key, len(leaves) + 1)
    noise = [np.asarray(jax.random.normal(k, x.shape, x.dtype)) * (sigma * C / batch)
             for x, k in zip(leaves, keys, strict=True)]
    expect = jax.tree.unflatten(treedef, [-(np.asarray(x) + n) for x, n in zip(leaves, noise,
                                                                                 strict=True)])
    _close(updates, expect, rtol=1e-5, atol=1e-6)


def test_dp_optimizer_without_noise_is_the_optimizer_alone():
  params = _params(7)
  tx = jaxaccum.dp.dp_optimizer(optax.adam(1e-2), l2_norm_clip=C, noise_multiplier=0.0,
                             batch_size=32, key=jax.random.key(0))
  ref = optax.adam(1e-2)
  s1, s2 = tx.init(params), ref.init(params)
  for step in range(3):
    g = jax.tree.map(lambda x, step=step: x * (step - 1.5), params)
    u1, s1 = tx.update(g, s1, params)
    u2, s2 = ref.update(g, s2, params)
    _close(u1, u2, rtol=1e-6, atol=1e-8)


def test_dp_optimizer_passes_extra_arguments_to_the_optimizer():
  params = _params(1)
  tx = jaxaccum.dp.dp_optimizer(optax.polyak_sgd(), l2_norm_clip=C, noise_multiplier=0.0,
                             batch_size=8, key=jax.random.key(0))
  g = jax.tree.map(jnp.ones_like, params)
  u, _ = tx.update(g, tx.init(params), params, value=jnp.float32(2.0))
  ref, _ = optax.polyak_sgd().update(g, optax.polyak_sgd().init(params), params,
                                     value=jnp.float32(2.0))
  _close(u, ref)


NOISE = functools.partial(jaxaccum.dp.dp_noise, C, 1.1, batch_size=16, key=jax.random.key(0))
BEFORE = {
    "adam": lambda: optax.adam(1e-3),
    "sgd": lambda: optax.sgd(0.1),
    "scale": lambda: optax.scale(-0.1),
    "clip_by_global_norm": lambda: optax.clip_by_global_norm(1.0),
    "identity": optax.identity,
    "a chain of one": lambda: optax.chain(optax.identity()),
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_check_dp_chain_refuses_a_transform_before_the_noise(name):
  params = _params(0)
  with pytest.raises(ValueError, match=r"dp_noise is transform 1 of an optax.chain .*"
                                       r"not private.*dp_optimizer"):
    jaxaccum.dp.check_dp_chain(optax.chain(BEFORE[name](), NOISE()), params)
  # Deeper in a nested chain, or later in a named chain: the same.
  with pytest.raises(ValueError, match="transform 2 of an optax.chain"):
    jaxaccum.dp.check_dp_chain(optax.chain(optax.identity(), BEFORE[name](), NOISE()), params)
  with pytest.raises(ValueError, match="transform 1 of an optax.named_chain"):
    jaxaccum.dp.check_dp_chain(optax.named_chain(("opt", BEFORE[name]()), ("noise", NOISE())),
                            params)
  # Noise first passes, nested or not, and so does dp_optimizer.
  jaxaccum.dp.check_dp_chain(optax.chain(NOISE(), BEFORE[name]()), params)
  jaxaccum.dp.check_dp_chain(optax.chain(optax.chain(NOISE(), BEFORE[name]()), optax.sgd(1.0)),
                          params)
  jaxaccum.dp.check_dp_chain(jaxaccum.dp.dp_optimizer(
      BEFORE[name](), l2_norm_clip=C, noise_multiplier=1.0, batch_size=4,
      key=jax.random.key(1)), params)


def test_check_dp_chain_refuses_no_noise_and_noise_twice_and_warns_inside_wrappers():
  params = _params(0)
  with pytest.raises(ValueError, match="adds no jaxaccum.dp.dp_noise"):
    jaxaccum.dp.check_dp_chain(optax.adam(1e-3), params)
  with pytest.raises(ValueError, match="adds jaxaccum.dp.dp_noise 2 times"):
    jaxaccum.dp.check_dp_chain(optax.chain(NOISE(), optax.adam(1e-3), NOISE()), params)
  with pytest.warns(UserWarning, match="sits inside MultiStepsState.*cannot be checked"):
    jaxaccum.dp.check_dp_chain(optax.MultiSteps(optax.chain(NOISE(), optax.sgd(0.1)), 2),
                            params)
  with pytest.raises(TypeError, match="tx must be an optax.GradientTransformation"):
    jaxaccum.dp.check_dp_chain("adam", params)


def test_dp_optimizer_refuses_noise_inside_and_bad_input():
  params = _params(0)
  tx = jaxaccum.dp.dp_optimizer(optax.chain(optax.sgd(0.1), NOISE()), l2_norm_clip=C,
                             noise_multiplier=1.0, batch_size=8, key=jax.random.key(0))
  with pytest.raises(ValueError, match="holds a jaxaccum.dp.dp_noise of its own.*twice"):
    tx.init(params)
  with pytest.raises(TypeError, match="got jaxaccum.dp.dp_noise, which dp_optimizer adds"):
    jaxaccum.dp.dp_optimizer(NOISE(), l2_norm_clip=C, noise_multiplier=1.0, batch_size=8,
                          key=jax.random.key(0))
  with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
    jaxaccum.dp.dp_optimizer(optax.adam, l2_norm_clip=C, noise_multiplier=1.0, batch_size=8,
                          key=jax.random.key(0))
  for kw, err, pat in [({"l2_norm_clip": 0.0}, ValueError, "l2_norm_clip must be a finite float"),
                       ({"noise_multiplier": -1.0}, ValueError, "noise_multiplier must be"),
                       ({"batch_size": "8"}, TypeError, "batch_size must be a float"),
                       ({"l2_norm_clip": float("nan")}, ValueError, "l2_norm_clip=nan")]:
    args = {"l2_norm_clip": C, "noise_multiplier": 1.0, "batch_size": 8, **kw}
    with pytest.raises(err, match=pat):
      jaxaccum.dp.dp_optimizer(optax.sgd(0.1), key=jax.random.key(0), **args)


def test_the_chain_the_guide_once_showed_is_refused():
  # The noise after Adam: the update released is Adam's of the un-noised clipped gradient.
  w = jnp.zeros(3)
  wrong = optax.chain(optax.adam(1e-3), jaxaccum.dp.dp_noise(1.0, 1.1, batch_size=8,
                                                          key=jax.random.key(0)))
  with pytest.raises(ValueError, match="transform 1 of an optax.chain"):
    jaxaccum.dp.check_dp_chain(wrong, w)


# --- 2. Per-example randomness ---------------------------------------------------------------

D = 6


def _mask_loss(w, x, key):
  keep = jax.random.bernoulli(key, 0.5, x.shape)
  out = jnp.where(keep, x * w, 0.0)
  return jnp.mean(out), keep


CASES = [(n, b, seed) for seed, (n, b) in enumerate([(1, 8), (2, 4), (4, 2), (8, 1), (3, 5)])]


@pytest.mark.parametrize("n,b,seed", CASES)
def test_positional_and_keyword_keys_give_each_example_its_own_fold(n, b, seed):
  rows = n * b
  x = jnp.ones((rows, D))
  w = jnp.ones(D)
  key = jax.random.key(seed)
  clip = jaxaccum.dp.clip_per_example(C, "materialize")
  pos = jaxaccum.dp.per_example_value_and_grad(_mask_loss, clip, num_micro_batches=n, has_aux=True,
                                aux_reduce="concat", rng_argnums=2)
  kw = jaxaccum.dp.per_example_value_and_grad(lambda w, x, *, key: _mask_loss(w, x, key), clip,
                                           num_micro_batches=n,
                               has_aux=True, aux_reduce="concat", rng_argnames="key")
  (_, m_pos), _ = pos(w, x, key)
  (_, m_kw), _ = kw(w, x, key=key)
  # Row j is example r = j // N of micro-batch i = j % N: fold_in(fold_in(key, i), r).
  ref = np.stack([np.asarray(jax.random.bernoulli(
      jax.random.fold_in(jax.random.fold_in(key, j % n), j // n), 0.5, (1, D)))[0]
      for j in range(rows)])
  np.testing.assert_array_equal(m_pos, ref)
  np.testing.assert_array_equal(m_kw, ref)
  if b > 1:
    assert len({tuple(r) for r in np.asarray(m_pos)[:n * 2].tolist()}) > 1


@pytest.mark.parametrize("method,remat", [("materialize", False), ("auto", False),
                                          ("ghost", False), ("materialize", True),
                                          ("auto", True)])
@pytest.mark.parametrize("n,b,seed", CASES[1:4])
def test_nnx_rngs_held_in_the_model_draw_a_mask_per_example(method, remat, n, b, seed):
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(params=seed))
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.lin(x))

  def loss(m, x):
    out = m(x)
    return jnp.mean(out ** 2), out != 0

  rows = n * b
  model = Model(nnx.Rngs(dropout=100 + seed))
  key0 = nnx.state(model, nnx.RngKey)["drop"]["rngs"]["key"][...]
  x = jax.random.normal(jax.random.key(seed), (rows, D)) + 3.0  # no output exactly 0
  step = jaxaccum.nnx.value_and_grad(
      loss, num_micro_batches=n, has_aux=True, aux_reduce="concat", remat=remat,
      per_example=jaxaccum.dp.clip_per_example(C, method))
  (_, masks), _ = step(model, x)
  # The documented rule: example r of micro-batch i draws with its stream's key folded
  # with r, at the stream's count of micro-batch i (the count advances once per
  # micro-batch). nnx.Rngs itself draws the reference.
  ref = []
  for j in range(rows):
    i, r = j % n, j // n
    rngs = nnx.Rngs(dropout=0)
    rngs.dropout.key[...] = jax.random.fold_in(key0, r)
    rngs.dropout.count[...] = jnp.uint32(i)
    ref.append(np.asarray(nnx.Dropout(0.5)(jnp.ones((1, D)), rngs=rngs))[0] != 0)
  np.testing.assert_array_equal(masks, np.stack(ref))
  # The state is threaded as without per-example clipping: the key kept, the count + N.
  st = nnx.state(model, nnx.RngState)["drop"]["rngs"]
  assert jnp.array_equal(jax.random.key_data(st["key"][...]), jax.random.key_data(key0))
  assert int(st["count"][...]) == n
  assert len({tuple(m) for m in np.asarray(masks).tolist()}) > rows // 2


def test_a_plain_state_key_is_folded_and_a_state_key_fun_replaces_is_refused():
  def loss(w, x, state):  # a key, and a stack of keys (one per scanned layer)
    keep = jax.random.bernoulli(state["key"], 0.5, x.shape)
    also = jax.random.bernoulli(state["layers"][1], 0.5, x.shape)
    return jnp.mean(jnp.where(keep, x * w, 0.0)), ({**state, "n": state["n"] + 1},
                                                   (keep, also))

  x, w = jnp.ones((4, D)), jnp.ones(D)
  state = {"key": jax.random.key(3), "layers": jax.random.split(jax.random.key(4), 3),
           "n": jnp.int32(0)}
  step = jaxaccum.dp.per_example_value_and_grad(loss, jaxaccum.dp.clip_per_example(C),
                                             num_micro_batches=2, state_argnums=2, has_aux=True,
                                 aux_reduce="concat")
  (_, (new, (keep, also))), _ = step(w, x, state)
  for got, key in ((keep, state["key"]), (also, state["layers"][1])):
    ref = np.stack([np.asarray(jax.random.bernoulli(jax.random.fold_in(key, j // 2), 0.5,
                                                    (1, D)))[0] for j in range(4)])
    np.testing.assert_array_equal(got, ref)
  assert int(new["n"]) == 2
  np.testing.assert_array_equal(jax.random.key_data(new["layers"]),
                                jax.random.key_data(state["layers"]))

  def advancing(w, x, state):  # the key replaced by one drawn from the example's
    new_key, sub = jax.random.split(state["key"])
    keep = jax.random.bernoulli(sub, 0.5, x.shape)
    return jnp.mean(jnp.where(keep, x * w, 0.0)), {"key": new_key, "n": state["n"]}

  bad = jaxaccum.dp.per_example_value_and_grad(advancing, jaxaccum.dp.clip_per_example(C),
                                            num_micro_batches=2, state_argnums=2)
  with pytest.raises(TypeError,
                     match=r"state_argnums=\(2,\) depends on the example.*PRNG key held"):
    bad(w, x, state)


# --- 3. Losses that mix examples -------------------------------------------------------------


def _contrastive(w, z):
  e = z @ w
  s = e @ e.T
  return jnp.mean(jax.nn.logsumexp(s, axis=1) - jnp.diagonal(s))


def _batch_norm_loss(w, batch):
  x, y = batch
  h = x @ w
  h = (h - jnp.mean(h, axis=0)) / jnp.sqrt(jnp.var(h, axis=0) + 1e-5)
  return jnp.mean((jnp.sum(h, axis=1) - y) ** 2)


def _row_loss(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w).sum(axis=1) - y) ** 2)


def _row_sum_loss(w, batch):
  x, y = batch
  return jnp.sum((jnp.tanh(x @ w).sum(axis=1) - y) ** 2)


def _weighted_row_loss(w, batch):
  x, y, t = batch
  return jnp.sum(t * (jnp.tanh(x @ w).sum(axis=1) - y) ** 2), jnp.sum(t)


@pytest.mark.parametrize("seed", range(4))
def test_check_per_example_loss_passes_row_losses_and_refuses_mixed_ones(seed):
  rng = np.random.default_rng(seed)
  rows = int(rng.integers(2, 9))
  x = jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(rows,)), jnp.float32)
  t = jnp.asarray(rng.integers(1, 4, size=(rows,)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
  for fun, batch, kw in [(_row_loss, (x, y), {}),
                         (_row_sum_loss, (x, y), {"reduce": "sum"}),
                         (_weighted_row_loss, (x, y, t), {"reduce": "weighted"}),
                         (lambda w, b: (_row_loss(w, b), {"n": jnp.sum(b[1])}), (x, y),
                          {"has_aux": True})]:
    found = jaxaccum.dp.check_per_example_loss(
        fun, per_example=jaxaccum.dp.clip_per_example(C), **kw)(w, batch)
    assert found["value"] < 1e-5 and found["grads"] < 1e-4, found
  with pytest.raises(ValueError, match="mixes the rows of its batch"):
    jaxaccum.dp.check_per_example_loss(_contrastive)(w, x)
  with pytest.raises(ValueError, match="mixes the rows of its batch"):
    jaxaccum.dp.check_per_example_loss(_batch_norm_loss)(w, (x, y))


def _gradient_mixes_rows(w, batch):
  # Each example alone has the batch's value (the mixing term is 0 in value: m - m), but
  # the gradient of m, the squared mean over the rows, mixes them.
  m = jnp.mean(jnp.tanh(batch[0] @ w)) ** 2
  return _row_loss(w, batch) + m - jax.lax.stop_gradient(m)


def test_check_per_example_loss_compares_the_gradient_not_only_the_value():
  # Against per-example jax.grad in float64, over generated batches: the relative difference
  # of the mean of the examples' gradients from the batch's gradient, which
  # check_per_example_loss must report (raising above rtol), while the values agree.
  grad = jax.jit(jax.grad(_gradient_mixes_rows))
  strict = jaxaccum.dp.check_per_example_loss(_gradient_mixes_rows)
  for seed in range(3):
    rng = np.random.default_rng(seed)
    batch = (jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
             jnp.asarray(rng.normal(size=(6,)), jnp.float32))
    w = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    whole = np.asarray(grad(w, batch), np.float64)
    alone = np.mean([np.asarray(grad(w, _row(batch, j)), np.float64) for j in range(6)], 0)
    want = np.linalg.norm(alone - whole) / np.linalg.norm(whole)
    assert want > 1e-3
    if seed < 2:
      with pytest.raises(ValueError, match=r"difference 0 in the value and (\S+) in the gradi"
                                           r"ent, above rtol=0.0001") as err:
        strict(w, batch)
      got = float(re.search(r"and (\S+) in the gradient", str(err.value)).group(1))
      np.testing.assert_allclose(got, want, rtol=5e-3)  # printed to 3 digits
    else:
      found = jaxaccum.dp.check_per_example_loss(_gradient_mixes_rows, rtol=2 * want)(w, batch)
      assert found["value"] == 0.0
      np.testing.assert_allclose(found["grads"], want, rtol=1e-4)


def test_check_per_example_loss_bad_options():
  with pytest.raises(ValueError, match="rng_argnums=2 is set"):
    jaxaccum.dp.check_per_example_loss(_row_loss, rng_argnums=2)
  with pytest.raises(ValueError, match="keep_batch_dim=False"):
    jaxaccum.dp.check_per_example_loss(
        _row_loss, per_example=jaxaccum.dp.clip_per_example(C, keep_batch_dim=False))
  with pytest.raises(ValueError, match="example_mask='m'"):
    jaxaccum.dp.check_per_example_loss(
        _row_loss, per_example=jaxaccum.dp.clip_per_example(C, example_mask="m"))
  with pytest.raises(ValueError, match="rtol must be a positive number"):
    jaxaccum.dp.check_per_example_loss(_row_loss, rtol=0)


# --- 4. The option pairs and every-factor-zero micro-batches, on every program ---------------

H = 5


def _mlp_params(seed):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {"w1": jax.random.normal(k1, (D, H)) / 2, "b1": jax.random.normal(k2, (H,)) / 4,
          "w2": jax.random.normal(k3, (H,)) / 2}


def _mlp_rows(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def _mlp_loss(p, batch):
  x, y = batch
  return jnp.mean((_mlp_rows(p, x) - y) ** 2)


def _mlp_weighted(p, batch):
  x, y, t = batch
  return jnp.sum(t * (_mlp_rows(p, x) - y) ** 2), jnp.sum(t)


def _scan_params(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"ws": jax.random.normal(k1, (2, D, D)) / 3, "v": jax.random.normal(k2, (D,)) / 2}


def _scan_loss(p, batch):  # the layers in a lax.scan: the ghost path's scan-body program
  x, y = batch

  def layer(h, w):
    return jnp.tanh(h @ w), None

  h, _ = jax.lax.scan(layer, x, p["ws"])
  return jnp.mean((h @ p["v"] - y) ** 2)


def _sin_loss(p, batch):  # w2 under sin: "auto" materialises that leaf alone
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ jnp.sin(p["w2"]) - y) ** 2)


# (name, method, the ghost program forced, loss, params)
PROGRAMS = [
    ("materialize", "materialize", None, _mlp_loss, _mlp_params),
    ("ghost book-keeping", "ghost", "book", _mlp_loss, _mlp_params),
    ("ghost second pass", "ghost", "second", _mlp_loss, _mlp_params),
    ("ghost scan body", "ghost", None, _scan_loss, _scan_params),
    ("auto, a materialised leaf", "auto", None, _sin_loss, _mlp_params),
]


@pytest.fixture
def program(request, monkeypatch):
  name, method, forced, loss, params = request.param
  if forced is not None:
    monkeypatch.setattr(_ghost, "clipped_sum",
                        functools.partial(_ghost.clipped_sum, program=forced))
  return name, method, loss, params


# Each program's steps, jitted once and shared by the seeds (same shapes: compiled once).
# Keyed by the program's name, so a step is traced under its own program's patch.
_STEPS = {}


def _shared_step(key, build):
  if key not in _STEPS:
    _STEPS[key] = jax.jit(build())
  return _STEPS[key]


def _data(seed, rows, nan_rows=(), weighted=False):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, D)).astype(np.float32)
  y = rng.normal(size=(rows,)).astype(np.float32)
  x[list(nan_rows)] = np.nan
  if not weighted:
    return x, y
  t = rng.integers(0, 4, size=(rows,)).astype(np.float32)
  return x, y, t


@functools.cache
def _jgrad(fun):
  return jax.jit(jax.grad(fun))


def _ref(loss, params, batch, rows, divisor):
  """The clipped sum over ``rows`` from per-example jax.grad, divided by ``divisor``."""
  grads = [_clip_np(_jgrad(loss)(params, _row(batch, j))) for j in rows]
  return jax.tree.map(lambda g: g / divisor, _sum(grads))


@pytest.mark.parametrize("program", PROGRAMS, ids=[p[0] for p in PROGRAMS], indirect=True)
@pytest.mark.parametrize("seed", range(2))
def test_a_micro_batch_whose_every_factor_is_zero_adds_exactly_zero(program, seed):
  name, method, loss, init = program
  n, b = 4, 3
  rows = n * b
  params = init(seed)
  dead = int(np.random.default_rng(seed).integers(0, n))  # micro-batch `dead`: rows dead::n
  dead_rows = list(range(dead, rows, n))
  # Padding: every row of micro-batch `dead` masked out (and holding NaN).
  x, y = _data(seed, rows, nan_rows=dead_rows)
  mask = np.ones(rows, bool)
  mask[dead_rows] = False
  step = _shared_step((name, "zero: mask"), lambda: jaxaccum.grad(
      loss, num_micro_batches=n, batch_argnames="mask",
      per_example=jaxaccum.dp.clip_per_example(C, method, example_mask="mask")))
  live = [j for j in range(rows) if mask[j]]
  grads = step(params, (x, y), mask=jnp.asarray(mask))
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  _close(grads, _ref(loss, params, (x, y), live, len(live)))
  # nan_safe: every example of micro-batch `dead` is not finite.
  safe = _shared_step((name, "zero: nan_safe"), lambda: jaxaccum.grad(
      loss, num_micro_batches=n,
      per_example=jaxaccum.dp.clip_per_example(C, method, nan_safe=True)))
  grads = safe(params, (x, y))
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  _close(grads, _ref(loss, params, (x, y), live, rows))
  # The micro-batch alone, as a batch of one micro-batch: exactly zero.
  alone = jax.tree.map(lambda a: a[dead::n], (x, y))
  zero = _shared_step((name, "zero: alone"), lambda: jaxaccum.grad(
      loss, num_micro_batches=1, reduce="sum",
      per_example=jaxaccum.dp.clip_per_example(C, method, nan_safe=True)))(params,
                                                                                 alone)
  for g in jax.tree.leaves(zero):
    np.testing.assert_array_equal(g, np.zeros_like(g))


@pytest.mark.parametrize("program", PROGRAMS, ids=[p[0] for p in PROGRAMS], indirect=True)
@pytest.mark.parametrize("seed", range(2))
def test_nan_safe_with_a_mask_keeps_a_real_nan_example_out_of_the_value(program, seed):
  name, method, loss, init = program
  n, b = 2, 4
  rows = n * b
  rng = np.random.default_rng(seed)
  params = init(seed)
  bad, pad = rng.choice(rows, 2, replace=False)
  x, y = _data(seed, rows, nan_rows=[bad, pad])
  mask = np.ones(rows, bool)
  mask[pad] = False
  step = _shared_step((name, "nan_safe + mask"), lambda: jaxaccum.dp.per_example_value_and_grad(
      loss, jaxaccum.dp.clip_per_example(C, method, nan_safe=True,
                                                      example_mask="mask"), num_micro_batches=n,
                                                          batch_argnames="mask", with_info=True))
  value, grads, info = step(params, (x, y), mask=jnp.asarray(mask))
  real = [j for j in range(rows) if mask[j]]
  live = [j for j in real if j != bad]
  # The NaN example adds zero to the value and the gradient and still counts in the mean.
  expect = sum(float(loss(params, _row((x, y), j))) for j in live) / len(real)
  assert np.isfinite(value)
  _close(value, expect, rtol=1e-5)
  _close(grads, _ref(loss, params, (x, y), live, len(real)))
  assert np.isnan(info.example_grad_norms[bad])


@pytest.mark.parametrize("program", PROGRAMS[:3], ids=[p[0] for p in PROGRAMS[:3]],
                         indirect=True)
@pytest.mark.parametrize("seed", range(3))
def test_weighted_with_a_mask_leaves_padding_tokens_out_of_the_denominator(program, seed):
  name, method, _, init = program
  n, b = 3, 2
  rows = n * b
  params = init(seed)
  x, y, t = _data(seed, rows, weighted=True)
  t[0] = 3.0  # a real row with tokens
  rng = np.random.default_rng(seed + 1)
  mask = rng.random(rows) < 0.6
  mask[0] = True
  t[~mask] = 7.0  # padding rows claim tokens: they must not count
  step = _shared_step((name, "weighted + mask"), lambda: jaxaccum.dp.per_example_value_and_grad(
      _mlp_weighted, jaxaccum.dp.clip_per_example(C, method, example_mask="mask"),
                                               num_micro_batches=n, reduce="weighted",
                                                   batch_argnames="mask"))
  value, grads = step(params, (x, y, t), mask=jnp.asarray(mask))
  real = np.flatnonzero(mask)
  tokens = float(t[real].sum())
  nums = [float(_mlp_weighted(params, _row((x, y, t), j))[0]) for j in real]
  _close(value, sum(nums) / tokens, rtol=1e-5)
  grads_ref = [_clip_np(jax.grad(lambda p, bt: _mlp_weighted(p, bt)[0])(
      params, _row((x, y, t), j))) for j in real]
  _close(grads, jax.tree.map(lambda g: g / tokens, _sum(grads_ref)))


@pytest.mark.parametrize("method", ["materialize", "auto", "ghost"])
@pytest.mark.parametrize("seed", range(2))
def test_user_level_clipping_concatenates_a_non_scalar_aux(method, seed):
  users, per_user, n = 6, 3, 3
  rng = np.random.default_rng(seed)
  params = _mlp_params(seed)
  x = rng.normal(size=(users, per_user, D)).astype(np.float32)
  y = rng.normal(size=(users, per_user)).astype(np.float32)

  def unit(p, batch):
    xb, yb = batch
    err = _mlp_rows(p, xb) - yb
    return jnp.mean(err ** 2), {"err": err, "h": jnp.tanh(xb @ p["w1"])}

  (value, aux), grads = jax.jit(jaxaccum.dp.per_example_value_and_grad(
      unit, jaxaccum.dp.clip_per_example(C, method, keep_batch_dim=False), num_micro_batches=n,
                                      has_aux=True, aux_reduce="concat"))(
          params, (x, y))
  ref_aux = [unit(params, (x[u], y[u]))[1] for u in range(users)]
  _close(aux, jax.tree.map(lambda *a: np.stack(a), *ref_aux))
  ref = [_clip_np(jax.grad(lambda p, b: unit(p, b)[0])(params, (x[u], y[u])))
         for u in range(users)]
  _close(grads, jax.tree.map(lambda g: g / users, _sum(ref)))
  _close(value, np.mean([float(unit(params, (x[u], y[u]))[0]) for u in range(users)]))


# --- 5. Padding placed last: its micro-batches skipped ---------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_place_padding_last_fills_the_first_micro_batches_and_keeps_the_gradient(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 5))
  b = int(rng.integers(1, 5))
  rows = n * b
  mask = rng.random(rows) < rng.uniform(0.1, 0.9)
  mask[rng.integers(rows)] = True
  x, y = _data(seed, rows)
  x[~mask] = 1e3  # padding holds garbage
  (xs, ys), m, k = jaxaccum.dp.place_padding_last((x, y), mask, num_micro_batches=n)
  real = int(mask.sum())
  assert k == max(1, -(-real // b))
  # Hand-sliced micro-batches: the first k hold every real row, in order, the rest none.
  held = [np.asarray(xs)[i::n][np.asarray(m)[i::n]] for i in range(n)]
  assert all(len(h) == 0 for h in held[k:])
  order = np.concatenate([np.asarray(xs).reshape(b, n, D).transpose(1, 0, 2).reshape(rows, D)])
  np.testing.assert_array_equal(order[:real], x[mask])
  # The step run on k micro-batches gives the unordered batch's clipped mean.
  params = _mlp_params(seed)
  step = jax.jit(jaxaccum.grad(
      _mlp_loss, num_micro_batches=n, batch_argnames="mask",
      per_example=jaxaccum.dp.clip_per_example(C, "materialize", example_mask="mask")))
  full = step(params, (x, y), mask=jnp.asarray(mask))
  skipped = step(params, (xs, ys), mask=jnp.asarray(m), active_micro_batches=k)
  _close(skipped, full)
  _close(full, _ref(_mlp_loss, params, (x, y), np.flatnonzero(mask), real))
  # Inside jit, on JAX arrays: the same rows and a traced count.
  (xj, yj), mj, kj = jax.jit(functools.partial(jaxaccum.dp.place_padding_last,
                                               num_micro_batches=n))((x, y), jnp.asarray(mask))
  np.testing.assert_array_equal(xj, xs)
  np.testing.assert_array_equal(mj, m)
  assert int(kj) == k and kj.dtype == jnp.int32


def test_place_padding_last_bad_input():
  x = np.zeros((8, 2))
  with pytest.raises(TypeError, match="example_mask must be an array of one bool per row"):
    jaxaccum.dp.place_padding_last(x, [True] * 8, num_micro_batches=2)
  with pytest.raises(TypeError, match="example_mask must be an array"):
    jaxaccum.dp.place_padding_last(x, np.ones((8, 1), bool), num_micro_batches=2)
  with pytest.raises(ValueError, match="num_micro_batches=3 must be a positive divisor"):
    jaxaccum.dp.place_padding_last(x, np.ones(8, bool), num_micro_batches=3)
  with pytest.raises(TypeError, match="num_micro_batches must be a positive int"):
    jaxaccum.dp.place_padding_last(x, np.ones(8, bool), num_micro_batches=2.0)
  with pytest.raises(ValueError, match=r"batch leaf \[1\] has shape \(4,\)"):
    jaxaccum.dp.place_padding_last((x, np.zeros(4)), np.ones(8, bool), num_micro_batches=2)


def test_no_warning_from_the_safe_forms():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jaxaccum.dp.check_dp_chain(optax.chain(NOISE(), optax.adam(1e-3)), _params(0))
