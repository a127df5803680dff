"""``jaxaccum.cached_value_and_grad``: losses that couple rows, against the full batch.

Every result is compared with the full batch through plain ``jax.value_and_grad`` of
``loss(p, encode(p, b, *a), b, *a)`` (or, with dropout keys, a hand loop over ``x[i::N]``
with ``fold_in(key, i)``, merged back by hand), float32 within 1e-5 relative to each
leaf's largest entry, 8 devices included. The problems are the losses the transform exists
for: CLIP's symmetric InfoNCE with a learned temperature, a VICReg variance/covariance
penalty with aux, and a global-batch MoE load-balancing loss with a token-mean NLL of
padded sequences; their shapes and micro-batch counts are drawn by a seeded generator.
Each configuration is compiled once.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

RTOL = 1e-5


def close(actual, expected, rtol=RTOL):
  """Same structure, shapes and dtypes, and each leaf within ``rtol`` of its largest entry.
  Returns the largest relative error found."""
  chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
  worst = 0.0
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    err = float(np.max(np.abs(a - e))) / scale if scale else float(np.max(np.abs(a)))
    worst = max(worst, err)
  assert worst <= rtol, f"largest relative error {worst:.3g} > {rtol:g}"
  return worst


def full_batch(encode, loss, has_aux=False, argnums=0):
  """The reference: the full batch through plain jax.value_and_grad."""
  return jax.jit(jax.value_and_grad(lambda *a: loss(a[0], encode(*a), *a[1:]),
                                    argnums=argnums, has_aux=has_aux))


# --- CLIP: two towers, symmetric InfoNCE, learned temperature --------------------------------


def clip_encode(p, batch):
  def tower(w, x):
    z = jnp.tanh(x @ w[0]) @ w[1]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)
  return {"img": tower(p["img"], batch["img"]), "txt": tower(p["txt"], batch["txt"])}


def clip_loss(p, reps, batch):
  del batch
  logits = jnp.exp(p["log_t"]) * reps["img"] @ reps["txt"].T
  diag = jnp.diagonal(logits)
  rows = jnp.mean(jax.nn.logsumexp(logits, axis=1) - diag)
  cols = jnp.mean(jax.nn.logsumexp(logits, axis=0) - diag)
  return (rows + cols) / 2


def clip_problem(seed, batch, d_img=6, d_txt=5, hidden=8, dim=4, dtype=jnp.float32):
  k = jax.random.split(jax.random.key(seed), 6)
  p = {"img": [jax.random.normal(k[0], (d_img, hidden)) / np.sqrt(d_img),
               jax.random.normal(k[1], (hidden, dim)) / np.sqrt(hidden)],
       "txt": [jax.random.normal(k[2], (d_txt, hidden)) / np.sqrt(d_txt),
               jax.random.normal(k[3], (hidden, dim)) / np.sqrt(hidden)],
       "log_t": jnp.asarray(np.log(5.0), jnp.float32)}
  b = {"img": jax.random.normal(k[4], (batch, d_img)),
       "txt": jax.random.normal(k[5], (batch, d_txt))}
  return jax.tree.map(lambda x: x.astype(dtype), (p, b))


def _cases(seed, count, batches):
  """Seeded (batch, N) cases: a batch size from ``batches`` and one of its divisors."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    b = int(rng.choice(batches))
    divs = [d for d in range(1, b + 1) if b % d == 0]
    out.append((b, int(rng.choice(divs))))
  return out


def _clip_cases(seed, count):
  """Seeded CLIP cases: (batch, N) as :func:`_cases`, and the towers' widths."""
  rng = np.random.default_rng(seed + 100)
  return [(b, n, tuple(int(w) for w in rng.integers(2, 9, 4)))
          for b, n in _cases(seed, count, (6, 8, 10, 16))]


@pytest.mark.parametrize(("batch", "n", "widths"), _clip_cases(0, 3))
def test_clip_infonce_with_a_learned_temperature(batch, n, widths):
  d_img, d_txt, hidden, dim = widths
  p, b = clip_problem(batch * 31 + n, batch, d_img, d_txt, hidden, dim)
  ref = full_batch(clip_encode, clip_loss)(p, b)
  out = jax.jit(jaxaccum.cached_value_and_grad(clip_encode, clip_loss,
                                               num_micro_batches=n))(p, b)
  close(out, ref)
  assert float(jnp.abs(out[1]["log_t"])) > 1e-3  # the loss's own gradient is there


def test_every_micro_batch_count_from_one_to_the_batch():
  p, b = clip_problem(3, 8)
  ref = full_batch(clip_encode, clip_loss)(p, b)
  for n in (1, 2, 4):
    close(jax.jit(jaxaccum.cached_value_and_grad(clip_encode, clip_loss,
                                                 num_micro_batches=n))(p, b), ref)
  # N = B = 8: micro-batches of one row, given by their size
  close(jax.jit(jaxaccum.cached_value_and_grad(clip_encode, clip_loss,
                                               micro_batch_size=1))(p, b), ref)


def test_plain_accumulation_of_the_coupled_loss_computes_something_else():
  """What the transform exists for: value_and_grad's per-micro-batch InfoNCE is another
  loss (each micro-batch's negatives only), far from the full batch's."""
  p, b = clip_problem(5, 16)
  ref = full_batch(clip_encode, clip_loss)(p, b)
  plain = jax.jit(jaxaccum.value_and_grad(
      lambda p, b: clip_loss(p, clip_encode(p, b), b), num_micro_batches=4))(p, b)
  assert abs(float(plain[0]) - float(ref[0])) > 0.1 * abs(float(ref[0]))


# --- VICReg: the batch's variance and covariance of the embeddings, with aux ------------------


def vic_encode(p, batch):
  return {v: jnp.tanh(batch[v] @ p["w"]) @ p["proj"] for v in ("a", "b")}


def vic_loss(p, reps, batch):
  del p, batch
  za, zb = reps["a"], reps["b"]
  inv = jnp.mean((za - zb) ** 2)

  def var_cov(z):
    zc = z - jnp.mean(z, axis=0)
    std = jnp.sqrt(jnp.var(z, axis=0) + 1e-4)
    cov = zc.T @ zc / (z.shape[0] - 1)
    off = cov - jnp.diag(jnp.diagonal(cov))
    return jnp.mean(jax.nn.relu(1.0 - std)), jnp.sum(off ** 2) / z.shape[1]

  (va, ca), (vb, cb) = var_cov(za), var_cov(zb)
  aux = {"invariance": inv, "variance": va + vb, "covariance": ca + cb}
  return 25 * inv + 25 * (va + vb) + (ca + cb), aux


@pytest.mark.parametrize(("batch", "n"), _cases(1, 3, (8, 12)))
def test_vicreg_variance_and_covariance_with_aux(batch, n):
  k = jax.random.split(jax.random.key(batch + n), 4)
  p = {"w": jax.random.normal(k[0], (5, 7)) * 0.3, "proj": jax.random.normal(k[1], (7, 3)) * 0.3}
  x = jax.random.normal(k[2], (batch, 5))
  b = {"a": x, "b": x + 0.3 * jax.random.normal(k[3], x.shape)}
  ref = full_batch(vic_encode, vic_loss, has_aux=True)(p, b)
  out = jax.jit(jaxaccum.cached_value_and_grad(vic_encode, vic_loss, num_micro_batches=n,
                                               has_aux=True))(p, b)
  close(out, ref)
  assert float(out[0][1]["variance"]) > 0  # the variance hinge is active


# --- MoE: global-batch load balancing and the token-mean NLL of padded sequences --------------

E, V, T, D = 4, 11, 5, 6


def moe_encode(p, batch):
  h = p["embed"][batch["tokens"]]  # (B, T, D)
  probs = jax.nn.softmax(h @ p["router"], axis=-1)  # (B, T, E)
  experts = jnp.tanh(jnp.einsum("btd,edf->btef", h, p["experts"]))
  top = jax.nn.one_hot(jnp.argmax(probs, axis=-1), E)  # top-1 routing
  out = h + jnp.einsum("bte,btef->btf", top * probs, experts)
  return {"hidden": out, "probs": probs}


def moe_loss(p, reps, batch):
  mask = batch["mask"]
  tokens = jnp.sum(mask)
  logp = jax.nn.log_softmax(reps["hidden"] @ p["out"], axis=-1)  # the loss's own weights
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  nll = jnp.sum(nll * mask) / tokens  # the mean over the global batch's real tokens
  probs = reps["probs"]
  chosen = jax.nn.one_hot(jnp.argmax(probs, axis=-1), E) * mask[..., None]
  fraction = jax.lax.stop_gradient(jnp.sum(chosen, axis=(0, 1)) / tokens)
  mean_prob = jnp.sum(probs * mask[..., None], axis=(0, 1)) / tokens
  balance = E * jnp.sum(fraction * mean_prob)
  return nll + 0.1 * balance, {"nll": nll, "balance": balance}


@pytest.mark.parametrize(("batch", "n"), [(8, 4), (12, 3)])
def test_moe_global_load_balancing_and_token_mean_nll(batch, n):
  k = jax.random.split(jax.random.key(batch * n), 7)
  p = {"embed": jax.random.normal(k[0], (V, D)), "router": jax.random.normal(k[1], (D, E)),
       "experts": jax.random.normal(k[2], (E, D, D)) / np.sqrt(D),
       "out": jax.random.normal(k[3], (D, V)) / np.sqrt(D)}
  lengths = jax.random.randint(k[4], (batch,), 1, T + 1)  # padded: 1 to T real tokens
  b = {"tokens": jax.random.randint(k[5], (batch, T), 0, V),
       "targets": jax.random.randint(k[6], (batch, T), 0, V),
       "mask": (jnp.arange(T) < lengths[:, None]).astype(jnp.float32)}
  ref = full_batch(moe_encode, moe_loss, has_aux=True)(p, b)
  out = jax.jit(jaxaccum.cached_value_and_grad(moe_encode, moe_loss, num_micro_batches=n,
                                               has_aux=True))(p, b)
  close(out, ref)
  # The micro-batches hold different numbers of real tokens: per-micro-batch means differ.
  per_mb = [float(jnp.sum(b["mask"][i::n])) for i in range(n)]
  assert len(set(per_mb)) > 1, per_mb


# --- Keys: the same dropout masks in both passes, the loss's key unfolded ---------------------


def drop_encode(p, x, key):
  h = jnp.tanh(x @ p["w"])
  keep = jax.random.bernoulli(key, 0.7, h.shape)
  return jnp.where(keep, h / 0.7, 0.0) @ p["proj"]


def drop_loss(p, z, x, key):
  del x
  weights = jax.random.uniform(key, (z.shape[0],))  # the unfolded key
  logits = jnp.exp(p["log_t"]) * z @ z.T
  per_row = jax.nn.logsumexp(logits - 1e9 * jnp.eye(z.shape[0]), axis=1)
  return jnp.sum(weights * per_row) / jnp.sum(weights)


def _drop_problem(batch, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  p = {"w": jax.random.normal(k[0], (5, 8)) / 2, "proj": jax.random.normal(k[1], (8, 3)) / 3,
       "log_t": jnp.zeros(())}
  return p, jax.random.normal(k[2], (batch, 5)), jax.random.key(7)


def hand_loop(p, x, key, n, shards=1):
  """Device ``d``'s micro-batch ``i`` (its rows ``x_d[i::n]``) encoded with
  ``fold_in(fold_in(key, d), i)`` (``fold_in(key, i)`` on one device), put back by hand."""
  rows = x.shape[0] // shards
  z = None
  for d in range(shards):
    dev_key = key if shards == 1 else jax.random.fold_in(key, d)
    for i in range(n):
      part = drop_encode(p, x[d * rows:(d + 1) * rows][i::n], jax.random.fold_in(dev_key, i))
      z = jnp.zeros((x.shape[0], part.shape[1]), part.dtype) if z is None else z
      z = z.at[d * rows + i:(d + 1) * rows:n].set(part)
  return drop_loss(p, z, x, key)


@pytest.mark.parametrize("n", [2, 4])
def test_dropout_keys_match_a_hand_loop_over_strided_micro_batches(n):
  p, x, key = _drop_problem(8)
  ref = jax.jit(jax.value_and_grad(hand_loop), static_argnums=3)(p, x, key, n)
  step = jax.jit(jaxaccum.cached_value_and_grad(drop_encode, drop_loss, num_micro_batches=n,
                                                rng_argnums=2, remat=True))
  close(step(p, x, key), ref)


# --- Other arguments, dtypes and reps ------------------------------------------------------


def test_argnums_tuple_with_the_losss_parameters_in_another_argument():
  """``argnums=(0, 2)``: the encoder's weights and the temperature as separate arguments;
  a non-batch argument reaches both functions whole."""
  def encode(w, batch, temp, scale):
    del temp
    return clip_encode(w, batch)

  def loss(w, reps, batch, temp, scale):
    return clip_loss({"log_t": temp * scale}, reps, batch)

  p, b = clip_problem(9, 8)
  temp = p.pop("log_t")
  ref = full_batch(encode, loss, argnums=(0, 2))(p, b, temp, 2.0)
  out = jax.jit(jaxaccum.cached_value_and_grad(encode, loss, num_micro_batches=4,
                                               argnums=(0, 2)))(p, b, temp, 2.0)
  close(out, ref)


def test_bfloat16_compute_accumulates_in_float32():
  """bf16 parameters and inputs: the gradients come back in bf16, accumulated in float32.
  With ``grads_dtype=float32`` the sum is the hand loop's, in float32, of the same bf16
  micro-batch VJPs (1e-5); against the float32 full batch it is within bf16's rounding."""
  p, b = clip_problem(4, 16, dtype=jnp.bfloat16)
  n = 4
  default = jaxaccum.cached_value_and_grad(clip_encode, clip_loss, num_micro_batches=n)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(jax.eval_shape(default, p, b)[1]))
  f32 = jax.jit(jaxaccum.cached_value_and_grad(clip_encode, clip_loss, num_micro_batches=n,
                                               grads_dtype=jnp.float32))(p, b)

  def take(tree, i):
    return jax.tree.map(lambda x: x[i::n], tree)

  def hand(p, b):
    parts = [clip_encode(p, take(b, i)) for i in range(n)]
    reps = jax.tree.map(lambda *xs: jnp.stack(xs, 1).reshape((-1,) + xs[0].shape[1:]),
                        *parts)  # row r * n + i is micro-batch i's row r
    value, vjp = jax.vjp(lambda p, r: clip_loss(p, r, b), p, reps)
    g_loss, cot = vjp(jnp.ones_like(value))
    total = jax.tree.map(lambda g: g.astype(jnp.float32), g_loss)
    for i in range(n):
      _, enc_vjp = jax.vjp(functools.partial(clip_encode, batch=take(b, i)), p)
      (g,) = enc_vjp(take(cot, i))
      total = jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, g)
    return value, total

  close(f32, jax.jit(hand)(p, b))  # the same numbers: float32 sums of the same bf16 VJPs
  up = jax.tree.map(lambda x: x.astype(jnp.float32), (p, b))
  close(jax.tree.map(lambda x: x.astype(jnp.float32), f32), full_batch(clip_encode, clip_loss)(
      *up), rtol=5e-2)


def test_integer_reps_leaves_pass_through_without_a_gradient():
  def encode(w, x):
    return {"z": jnp.tanh(x @ w), "count": jnp.sum(x > 0, axis=1)}

  def loss(w, reps, x):
    z = reps["z"] * reps["count"][:, None]
    return jnp.mean(jax.nn.logsumexp(z @ z.T, axis=1))

  w = jax.random.normal(jax.random.key(0), (4, 3))
  x = jax.random.normal(jax.random.key(1), (8, 4))
  close(jax.jit(jaxaccum.cached_value_and_grad(encode, loss, num_micro_batches=4))(w, x),
        full_batch(encode, loss)(w, x))


# --- Several devices: each encodes its rows, the loss sees the global batch --------------------


def _mesh(kind):
  return jax.make_mesh((8,), ("data",), axis_types=(kind,))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_eight_devices_equal_one_devices_full_batch(kind):
  p, b = clip_problem(2, 32)
  ref = full_batch(clip_encode, clip_loss)(p, b)
  mesh = _mesh(kind)
  data_axis = "data" if kind == AxisType.Explicit else jaxaccum.DataParallel("data", mesh=mesh)
  step = jax.jit(jaxaccum.cached_value_and_grad(clip_encode, clip_loss, num_micro_batches=2,
                                                data_axis=data_axis,
                                                remat=kind == AxisType.Auto))
  with jax.set_mesh(mesh):
    ps = jax.device_put(p, NamedSharding(mesh, P()))
    bs = jax.device_put(b, NamedSharding(mesh, P("data")))
    compiled = step.lower(ps, bs).compile()
    out = compiled(ps, bs)
  close(out, ref)
  # One gradient reduction per step, after the loops; one all-gather per reps leaf.
  colls = jaxaccum.planning.collectives(compiled)
  assert colls.count("all-reduce") == 1 and not colls.in_loop, str(colls)
  assert colls.count("all-gather") == 2, str(colls)


def test_eight_devices_with_dropout_fold_each_devices_key_then_the_micro_batch():
  p, x, key = _drop_problem(32, seed=1)
  n = 2
  ref = jax.jit(jax.value_and_grad(hand_loop), static_argnums=(3, 4))(p, x, key, n, 8)
  mesh = _mesh(AxisType.Explicit)
  step = jax.jit(jaxaccum.cached_value_and_grad(drop_encode, drop_loss, num_micro_batches=n,
                                                rng_argnums=2, data_axis="auto"))
  ps = jax.device_put(p, NamedSharding(mesh, P()))
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  close(step(ps, xs, key), ref)


# --- Bad input: a clear error at trace time -------------------------------------------------


def _w_x(batch=8):
  return jnp.ones((3, 2)), jnp.arange(batch * 3.0).reshape(batch, 3)


def _loss_sq(w, z, x):
  return jnp.sum(z ** 2)


@pytest.mark.parametrize(("encode", "match"), [
    (lambda w, x: jnp.sum(x @ w, axis=0), r"leading axis of the micro-batch's 4 rows.*leaf "
     r"\(root\) has shape \(2,\)"),
    (lambda w, x: {"z": x @ w, "mean": jnp.mean(x @ w)}, r"leading axis .* leaf \['mean'\] "
     r"has shape \(\)"),
    (lambda w, x: (x @ w)[:1], r"leading axis of the micro-batch's 4 rows.*shape \(1, 2\)"),
])
def test_reps_without_the_micro_batchs_rows(encode, match):
  step = jaxaccum.cached_value_and_grad(encode, _loss_sq, num_micro_batches=2)
  with pytest.raises(ValueError, match=r"encode must return reps whose every leaf has a "
                     + match):
    step(*_w_x())


@pytest.mark.parametrize(("loss", "has_aux", "error", "match"), [
    (lambda w, z, x: z ** 2, False, TypeError, r"loss must return a floating scalar .* got an "
     r"array of shape \(8, 2\).*jnp.mean"),
    (lambda w, z, x: (jnp.sum(z), {}), False, TypeError, r"It is a pair: .* has_aux=True"),
    (lambda w, z, x: jnp.sum(z), True, TypeError, r"loss must return \(value, aux\) with "
     r"has_aux=True, got an array of shape \(\)"),
    (lambda w, z, x: jnp.sum(z > 0), False, TypeError, r"floating scalar .* dtype int32"),
])
def test_a_loss_that_returns_no_scalar(loss, has_aux, error, match):
  step = jaxaccum.cached_value_and_grad(lambda w, x: x @ w, loss, num_micro_batches=2,
                                        has_aux=has_aux)
  with pytest.raises(error, match=match):
    step(*_w_x())


def test_options_and_batches_that_cannot_work():
  w, x = _w_x(10)
  step = jaxaccum.cached_value_and_grad(lambda w, x: x @ w, _loss_sq, num_micro_batches=4)
  with pytest.raises(ValueError, match=r"batch size 10 is not divisible by "
                     r"num_micro_batches=4. Valid counts near it: 1, 2, 5, 10"):
    step(w, x)
  with pytest.raises(ValueError, match=r"takes no state_argnums \(got state_argnums=2\).*"
                     r"BatchNorm's batch statistics.*GroupNorm or LayerNorm"):
    jaxaccum.cached_value_and_grad(lambda w, x: x, _loss_sq, num_micro_batches=2,
                                   state_argnums=2)
  with pytest.raises(TypeError, match=r"loss must be a callable loss\(params, reps, batch"):
    jaxaccum.cached_value_and_grad(lambda w, x: x, None, num_micro_batches=2)
  with pytest.raises(ValueError, match=r"pass exactly one of num_micro_batches and "
                     r"micro_batch_size"):
    jaxaccum.cached_value_and_grad(lambda w, x: x, _loss_sq)
  with pytest.raises(ValueError, match=r"replicated parameters only.*grad_scatter"):
    jaxaccum.cached_value_and_grad(lambda w, x: x, _loss_sq, num_micro_batches=2,
                                   data_axis=jaxaccum.DataParallel("data", grad_scatter="step"))
  with pytest.raises(TypeError, match=r"has_aux must be a bool, got has_aux=1"):
    jaxaccum.cached_value_and_grad(lambda w, x: x, _loss_sq, num_micro_batches=2, has_aux=1)


def test_check_encode_passes_a_row_independent_encoder_and_names_one_that_mixes_rows():
  p, b = clip_problem(6, 8)
  step = jaxaccum.cached_value_and_grad(clip_encode, clip_loss, num_micro_batches=2)
  found = step.check_encode(p, b)
  assert set(found) == {"reps", "grads"} and max(found.values()) < 1e-5, found
  with pytest.raises(ValueError, match=r"check_encode: rtol must be a positive number, got "
                     r"rtol=0"):
    step.check_encode(p, b, rtol=0)

  def batch_norm(p, batch):  # normalised with the batch's own statistics
    z = clip_encode(p, batch)
    return jax.tree.map(lambda x: (x - jnp.mean(x, 0)) / jnp.sqrt(jnp.var(x, 0) + 1e-3), z)

  mixing = jaxaccum.cached_value_and_grad(batch_norm, clip_loss, num_micro_batches=2)
  with pytest.raises(ValueError, match=r"check_encode: encode's reps computed from each "
                     r"example alone differ .*\(GroupNorm or LayerNorm"):
    mixing.check_encode(p, b)
  keyed = jaxaccum.cached_value_and_grad(drop_encode, drop_loss, num_micro_batches=2,
                                         rng_argnums=2)
  with pytest.raises(ValueError, match=r"rng_argnums=\(2,\).*dropout off"):
    keyed.check_encode(*_drop_problem(4))


def _primitives(jaxpr, names=None):
  """The names of every primitive in a jaxpr, inner jaxprs (scan bodies) included."""
  names = [] if names is None else names
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _primitives(inner, names)
  return names


def test_remat_checkpoints_the_encoder_in_the_gradient_pass_only():
  w, x = _w_x()
  found = {}
  for remat in (False, True):
    step = jaxaccum.cached_value_and_grad(lambda w, x: jnp.tanh(x @ w), _loss_sq,
                                          num_micro_batches=2, remat=remat)
    found[remat] = _primitives(jax.make_jaxpr(step)(w, x).jaxpr)
  def remats(names):  # jax.checkpoint's primitive: remat2 (jax 0.10), checkpoint later
    return sum(name.startswith("remat") or name == "checkpoint" for name in names)

  assert found[False].count("scan") == 2 and not remats(found[False])
  assert remats(found[True]) == 1, found[True]
