"""What DP-SGD's sensitivity bound rests on: the ghost analysis's numerical forms and
per-layer clip norms, each against an independent reference over generated cases.

The references never go through the library's norms: float64 NumPy for the wide squared
norms and the direct products, and ``jax.grad`` on each example alone (sliced by hand) for
the clipped sums. ``tests/per_example/test_dp_fuzz.py`` checks the whole path on generated
models; here each rule is checked on its own, where a wrong rule shows directly.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum
from jaxaccum._per_example import _ghost
from jaxaccum._per_example._ghost import _norms

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("seed", range(6))
def test_wide_squared_norms_over_every_scale(seed):
  # s * prod(factors) read back as a norm, for factors from 1e-30 to 1e30 (products far
  # outside float32's range on both sides), against float64: the wide form neither
  # underflows to 0 (tiny activations times a huge output gradient) nor overflows.
  rng = np.random.default_rng(seed)
  for _ in range(40):
    k = int(rng.integers(1, 5))
    factors = 10.0 ** rng.uniform(-30, 30, size=k)
    s = float(rng.uniform(0.01, 100.0))
    want = np.sqrt(s * np.prod(factors, dtype=np.float64))
    got = float(_norms.wide_norm(_norms.wide(jnp.float32(s), *map(jnp.float32, factors))))
    if 1e-37 < want < 1e37:  # a norm float32 holds
      np.testing.assert_allclose(got, want, rtol=2e-6)
  for scale in 10.0 ** np.arange(-40, 36, 3.0):  # sums of squares of entries of any size
    x = (rng.normal(size=7) * scale).astype(np.float32)
    want = np.sqrt(np.sum(np.asarray(x, np.float64) ** 2))
    if np.min(np.abs(x)) > np.finfo(np.float32).tiny:  # XLA may flush subnormal entries
      np.testing.assert_allclose(float(_norms.wide_norm(_norms.wide_sum_sq(jnp.asarray(x)))),
                                 want, rtol=2e-6)


def test_wide_norms_keep_nan_and_inf():
  nan = _norms.wide_norm(_norms.wide_sum_sq(jnp.array([1.0, jnp.nan])))
  inf = _norms.wide_norm(_norms.wide_sum_sq(jnp.array([1.0, jnp.inf])))
  assert np.isnan(nan) and np.isposinf(inf)


def test_wide_forms_of_constant_zeros_read_zero():
  # Zeros known when compiling (the cotangent of a result the loss does not read): XLA
  # gathers the wide forms' constant scales into one that overflows (0 * 2^128), which read
  # NaN; every form reads 0, its norm 0, and a NaN entry still reads NaN.
  zero = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
  forms = {"sum_sq": lambda: _norms.wide_sum_sq(zero(4, 4)),
           "wide": lambda: _norms.wide(jnp.float32(0), *[jnp.float32(1)] * 4),
           "gram": lambda: _norms.sq_outer(zero(1, 3, 8), zero(1, 3, 8)),
           "direct": lambda: _norms.sq_outer(zero(1, 5, 2), zero(1, 5, 2)),
           "one_position": lambda: _norms.sq_outer(zero(1, 1, 4), zero(1, 1, 4))}
  got = jax.jit(lambda: {k: f() for k, f in forms.items()})()
  for k, w in got.items():
    np.testing.assert_array_equal(np.asarray(w), 0.0, err_msg=k)
    assert float(_norms.wide_norm(w)) == 0.0, k
  nan = jax.jit(lambda: _norms.wide_sum_sq(zero(4).at[1].set(jnp.nan)))()
  assert np.all(np.isnan(np.asarray(nan)))


# --- uses whose result the objective does not read -------------------------------------------

# A use of a leaf whose result the loss drops (or reads only through stop_gradient): its
# site's output cotangent is a zero that JAX instantiates as a constant, which XLA then
# folds with the wide forms' scales (``(0 * 2^64)^2`` read as ``0 * 2^128 = NaN``).
_D = 4
_CONST = np.random.default_rng(7).normal(size=(_D, _D)).astype(np.float32)
_UNREAD_USES = {
    "add": lambda w, x, ids: w + _CONST,  # param_gather="micro_batch"'s form
    "dot": lambda w, x, ids: x @ w,
    "dot_const": lambda w, x, ids: _CONST @ w,  # both operands example-independent
    "gather": lambda w, x, ids: jnp.take(w, ids, axis=0),
    "slice": lambda w, x, ids: w[1:3] * 2.0,
    "mul": lambda w, x, ids: w * x[..., :1, :],
    "sin": lambda w, x, ids: jnp.sin(w),  # no rule: materialised by "auto"
}


def _unread_case(seed):
  """A generated loss ``(p, x, ids, wt)`` with uses whose result it does not read, some of
  its leaves passed through ``p + const`` first (read), and its parameters."""
  rng = np.random.default_rng(seed)
  names = ("w", "b", "emb", "head", "unused")
  unread = [(str(rng.choice(names)), str(rng.choice(list(_UNREAD_USES))),
             bool(rng.random() < 0.3)) for _ in range(int(rng.integers(1, 4)))]
  added = {k: rng.normal(size=s).astype(np.float32)
           for k, s in (("w", (_D, _D)), ("b", (_D,)), ("head", (_D,))) if rng.random() < 0.5}

  def loss(p, x, ids, wt):  # one example: x (1, T, D), ids (1, T), wt (1,)
    for k, use, stop in unread:
      w = p[k] if p[k].ndim == 2 else jnp.broadcast_to(p[k], (_D, _D))
      y = _UNREAD_USES[use](w, x, ids)
      if stop:  # read, but not differentiated
        wt = wt + 0.0 * jnp.sum(jax.lax.stop_gradient(y))
    p = {k: v + added[k] if k in added else v for k, v in p.items()}
    h = jnp.tanh(x @ p["w"] + p["b"]) + jnp.take(p["emb"], ids, axis=0)
    return jnp.sum(jnp.sum(h @ p["head"], axis=-1) * wt)

  k = jax.random.split(jax.random.key(seed), 5)
  params = {"w": jax.random.normal(k[0], (_D, _D)), "b": jax.random.normal(k[1], (_D,)),
            "emb": jax.random.normal(k[2], (_D, _D)), "head": jax.random.normal(k[3], (_D,)),
            "unused": jax.random.normal(k[4], (_D, _D))}
  return loss, params, unread, added


@pytest.mark.parametrize("seed", range(6))
def test_uses_whose_result_is_not_read_add_nothing(seed):
  # Generated losses with uses whose results are dropped or read through stop_gradient
  # (adds of a constant, products, gathers, slices, scales, a use without a rule), of
  # leaves used otherwise or not at all, leaves read through p + const, and examples of
  # weight 0 (a zero gradient): method="auto" and both ghost programs against per-example
  # jax.grad (jax.vmap) clipped by hand, min(1, C / |g_e|), summed in float64.
  loss, params, _, _ = _unread_case(seed)
  rng = np.random.default_rng(seed)
  n, t = 6, 3
  x = rng.normal(size=(n, 1, t, _D)).astype(np.float32)
  ids = rng.integers(0, _D, size=(n, 1, t)).astype(np.int32)
  wt = (rng.random(size=(n, 1)) < 0.5).astype(np.float32) * rng.uniform(0.5, 2, size=(n, 1))
  wt[0] = 1.0  # one live example at least
  wt = wt.astype(np.float32)
  @jax.jit
  def run(params, x, ids, wt, frac):
    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0, 0))(params, x, ids, wt)
    c = frac * jnp.max(jnp.sqrt(sum(jnp.sum(jnp.square(g.reshape(n, -1)), axis=1)
                                    for g in jax.tree.leaves(grads))))
    clip = jaxaccum.dp.clip_per_example(c, "auto")
    out = {"auto": jaxaccum.grad(loss, num_micro_batches=2, reduce="sum", batch_argnums=(1, 2, 3),
                                 per_example=clip)(params, x, ids, wt)}
    for program in ("book", "second"):
      ghost = _ghost.clipped_sum(
          lambda d, b: (loss(d[0], *b), ()), (params,), (x, ids, wt), 0, clip.factors,
          strict=False, norms=True, program=program)
      assert ghost is not None  # (auto=False)
      out[program] = ghost[1][0]
    return grads, c, out

  # some examples clipped, some not
  grads, c, got = run(params, x, ids, wt, jnp.float32(rng.uniform(0.3, 1.0)))
  grads, c = jax.tree.map(lambda g: np.asarray(g, np.float64), grads), float(c)
  norms = np.sqrt(sum(np.sum(g.reshape(n, -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
  f = np.where(norms > c, c / np.where(norms > 0, norms, 1.0), 1.0)
  want = jax.tree.map(lambda g: np.einsum("e,e...->...", f, g), grads)
  for name, g in got.items():
    chex.assert_trees_all_close(g, want, rtol=2e-5, atol=2e-5 * c, custom_message=name)


@pytest.mark.parametrize("seed", range(5))
def test_chunked_direct_form_against_float64(seed):
  # sum_h |sum_j X_jh^T Y_jh|^2 over chunks of X's columns, dense and one-hot sides, any
  # chunk size (columns not a multiple of it included), against NumPy in float64.
  rng = np.random.default_rng(seed)
  h, m, n = int(rng.integers(1, 3)), int(rng.integers(1, 9)), int(rng.integers(1, 6))
  pairs, want = [], np.zeros((h, m, n))
  for _ in range(int(rng.integers(1, 4))):
    t = int(rng.integers(1, 6))
    y = rng.normal(size=(h, t, n)).astype(np.float32)
    if rng.random() < 0.5:
      x = rng.normal(size=(h, t, m)).astype(np.float32)
      pairs.append(("dense", jnp.asarray(x), jnp.asarray(y)))
    else:
      i = rng.integers(-1, m + 2, size=(h, t)).astype(np.int32)  # -1 and past the end: none
      x = (i[..., None] == np.arange(m)).astype(np.float64)
      pairs.append(("index", jnp.asarray(i), jnp.asarray(y)))
    want += np.einsum("htm,htn->hmn", np.asarray(x, np.float64), np.asarray(y, np.float64))
  for budget in (1, 7, 1000):
    got = float(_norms.chunked_sq(pairs, m, budget))
    np.testing.assert_allclose(got, np.sum(want ** 2), rtol=1e-5)


@pytest.mark.parametrize("cancel", [0.0, 1e-3, 1e-5])
def test_the_gram_guard_takes_the_direct_form_where_positions_cancel(cancel):
  # Two positions whose outer products cancel to 1e-5 of their size: the Gram form
  # <A A^T, B B^T> has lost its digits (it read 0.89 for 3.0, or a negative number), the
  # guard sees it and the direct form gives the norm to float32's rounding of |A^T B|.
  a = RNG.normal(size=(4, 1, 2, 16)).astype(np.float32)
  b = RNG.normal(size=(4, 1, 2, 16)).astype(np.float32)
  a[:, :, 1] = -a[:, :, 0] * (1 + cancel) + (0 if cancel else a[:, :, 1])
  b[:, :, 1] = b[:, :, 0]
  assert _norms.gram_cheaper(2, 16, 16)
  got = jax.vmap(lambda a, b: _norms.wide_norm(_norms.sq_outer(a, b)),
                 axis_name=_norms.EXAMPLES)(jnp.asarray(a), jnp.asarray(b))
  want = np.sqrt(np.sum(np.einsum("ehtp,ehtq->ehpq", a.astype(np.float64),
                                  b.astype(np.float64)) ** 2, axis=(1, 2, 3)))
  # the direct form's float32 rounding, about 2^-24 of the terms' size (1 / cancel of the norm)
  np.testing.assert_allclose(np.asarray(got), want, rtol=4 * 2.0 ** -24 / cancel if cancel
                             else 1e-5)


# One micro-batch of one example per case (each case takes its own branch of the guard),
# compiled once for every generated case.
_GUARDED_NORMS = jax.jit(jax.vmap(jax.vmap(
    lambda a, b: _norms.wide_norm(_norms.sq_outer(a, b)), axis_name=_norms.EXAMPLES)))


@pytest.mark.parametrize("seed", range(2))
def test_the_gram_guard_threshold_over_generated_cancellations(seed):
  # Two positions whose outer products cancel so that S / |A^T B|^2 (S: the squared sum of
  # the terms' sizes, sum_t |a_t| |b_t|) spans 1e2 to 1e5, across the trust threshold
  # (1e3) and ten times it (1e4), or add (b's second row flipped), at scales from 1e-6 to
  # 1e6. Against float64: where the ratio is under 1e3 the Gram form is trusted, its
  # rounding (about ratio * 2^-24 of the norm) under 1e-4; above it the direct form is
  # taken, whose rounding is about sqrt(ratio) * 2^-24 (measured at most 0.34 of it).
  # Between 1e3 and 1e4 the Gram form read norms up to 2.8e-4 off, the direct form 1.6e-6.
  rng = np.random.default_rng(seed)
  n, p = 256, 16
  a = rng.normal(size=(n, 1, 1, 2, p))
  b = rng.normal(size=(n, 1, 1, 2, p))
  cancel = 2 / np.sqrt(10.0 ** rng.uniform(2, 5, size=n))  # S / |A^T B|^2 ~ 4 / cancel^2
  a[..., 1, :] = -a[..., 0, :] * (1 + cancel[:, None, None, None])
  b[..., 1, :] = b[..., 0, :] * rng.choice([-1.0, 1.0], size=(n, 1, 1, 1))
  a *= 10.0 ** rng.uniform(-6, 6, size=(n, 1, 1, 1, 1))
  b *= 10.0 ** rng.uniform(-6, 6, size=(n, 1, 1, 1, 1))
  a, b = a.astype(np.float32), b.astype(np.float32)
  assert _norms.gram_cheaper(2, p, p)
  got = np.asarray(_GUARDED_NORMS(jnp.asarray(a), jnp.asarray(b)), np.float64)[:, 0]
  a64, b64 = a.astype(np.float64)[:, 0], b.astype(np.float64)[:, 0]
  want = np.sqrt(np.sum(np.einsum("ehtp,ehtq->ehpq", a64, b64) ** 2, axis=(1, 2, 3)))
  terms = np.sum(np.sum(np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1), -1) ** 2,
                 -1)
  ratio = terms / want ** 2
  err = np.abs(got - want) / want
  # the guard reads the ratio in float32: within 1% of the threshold either form may be taken
  direct = ratio > 1.01e3  # the documented threshold (docs/dp-sgd.md)
  assert 20 < np.sum(direct & (ratio < 1e4)) and 20 < np.sum(ratio < 1e3)
  assert np.all(err[~direct] <= 1e-4), np.max(err[~direct])
  bound = 2 * np.sqrt(ratio[direct]) * 2.0 ** -24
  worst = np.argmax(err[direct] / bound)
  assert np.all(err[direct] <= bound), (ratio[direct][worst], err[direct][worst])


# --- per-layer clip norms --------------------------------------------------------------------


def _mlp(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["enc"]["w"] + p["enc"]["b"])
  return jnp.sum((h @ p["head"] - y) ** 2)


def _gelu_scan(p, batch):  # sites in a scan body: a second backward pass per clip group
  x, y = batch
  h, _ = jax.lax.scan(lambda h, w: (jax.nn.gelu(h @ w), None), x, p["enc"]["w"])
  return jnp.sum((h @ p["head"] - y) ** 2)


def _mlp_params(seed, scan=False):
  k = jax.random.split(jax.random.key(seed), 3)
  enc = ({"w": 0.5 * jax.random.normal(k[0], (2, 4, 4))} if scan else
         {"w": jax.random.normal(k[0], (4, 6)), "b": jax.random.normal(k[1], (6,))})
  return {"enc": enc, "head": jax.random.normal(k[2], (4 if scan else 6, 3))}


@functools.cache
def _jgrad(loss):
  """``jax.jit(jax.grad(loss))``, one per loss: compiled once for the rows and the seeds."""
  return jax.jit(jax.grad(loss))


def _per_layer_reference(loss, params, batch, limits):
  """sum_e of each group's gradient clipped to its own norm, example by example."""
  total = None
  rows = jax.tree.leaves(batch)[0].shape[0]
  for j in range(rows):
    g = _jgrad(loss)(params, jax.tree.map(lambda a, j=j: np.asarray(a)[j:j + 1], batch))
    clipped = {}
    for name, c in limits.items():
      leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g[name])]
      norm = np.sqrt(sum(np.sum(x ** 2) for x in leaves))
      f = min(1.0, c / norm) if norm > 0 else 1.0
      clipped[name] = jax.tree.map(lambda x, f=f: np.asarray(x, np.float64) * f, g[name])
    total = clipped if total is None else jax.tree.map(np.add, total, clipped)
  return total


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("loss,scan", [(_mlp, False), (_gelu_scan, True)])
def test_per_layer_clip_norms_every_method(seed, loss, scan):
  params = _mlp_params(seed, scan)
  rng = np.random.default_rng(seed)
  batch = (rng.normal(size=(8, 4)).astype(np.float32),
           rng.normal(size=(8, 3)).astype(np.float32))
  limits = {"enc": float(rng.uniform(0.2, 1.0)), "head": float(rng.uniform(0.5, 2.0))}
  want = _per_layer_reference(loss, params, batch, limits)
  for method in ("materialize", "auto", "ghost"):
    clip = jaxaccum.dp.clip_per_example(limits, method)
    got = jax.jit(jaxaccum.grad(loss, num_micro_batches=2, reduce="sum",
                                per_example=clip))(params, batch)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    # Each example alone adds at most sqrt(sum C_g^2), each group C_g: one program for both.
    alone = jax.jit(jaxaccum.grad(loss, num_micro_batches=1, reduce="sum",
                                  per_example=clip))
    for j in range(2):
      one = alone(params, jax.tree.map(lambda a, j=j: a[j:j + 1], batch))
      for name, c in limits.items():
        norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                           for x in jax.tree.leaves(one[name])))
        assert norm <= c * (1 + 1e-5), (method, name, norm, c)


@pytest.mark.parametrize("program", ["book", "second"])
def test_per_layer_clip_norms_under_both_ghost_programs(program):
  params = _mlp_params(3)
  rng = np.random.default_rng(3)
  batch = (rng.normal(size=(6, 1, 4)).astype(np.float32),
           rng.normal(size=(6, 1, 3)).astype(np.float32))
  limits = {"enc": 0.3, "head": 1.1}
  clip = jaxaccum.dp.clip_per_example(limits)
  groups = clip.leaf_groups(params)
  got = jax.jit(lambda p, b: _ghost.clipped_sum(
      lambda d, x: (_mlp(d[0], x), ()), (p,), b, 0, clip.factors, strict=True, norms=True,
      program=program, groups=groups))(params, batch)[1][0]
  want = _per_layer_reference(_mlp, params, (batch[0][:, 0], batch[1][:, 0]), limits)
  chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)


def _scaled_mlp(p, batch):  # each layer's scale under sin: no rule, materialised by "auto"
  x, y = batch
  h = jnp.tanh(x @ p["l0"]["w"]) * jnp.sin(p["l0"]["s"])
  h = jnp.tanh(h @ p["l1"]["w"]) * jnp.sin(p["l1"]["s"])
  return jnp.sum((h @ p["l2"]["w"] - y) ** 2)


@pytest.mark.parametrize("seed", range(3))
def test_per_layer_clip_norms_with_a_materialised_leaf_in_each_group(seed):
  # Generated clip groups (a layer as one group, or its weight and its scale apart) over a
  # model whose scales are materialised by "auto" while its weights take ghost norms: each
  # materialised leaf gets its own group's factor, against per-example jax.grad clipped by
  # hand.
  rng = np.random.default_rng(seed)
  k = jax.random.split(jax.random.key(seed), 5)
  params = {"l0": {"w": jax.random.normal(k[0], (4, 5)), "s": jax.random.normal(k[1], (5,))},
            "l1": {"w": jax.random.normal(k[2], (5, 5)) / 2,
                   "s": jax.random.normal(k[3], (5,))},
            "l2": {"w": jax.random.normal(k[4], (5, 3))}}
  batch = (rng.normal(size=(8, 4)).astype(np.float32),
           rng.normal(size=(8, 3)).astype(np.float32))
  groups = {}  # the clip norms by group: a layer ("l0"), or one leaf of a layer ("l0.s")
  for name, apart in zip(("l0", "l1"), [(True, True), (False, True), (True, False)][seed],
                         strict=True):
    if apart:
      groups[f"{name}.s"] = float(rng.uniform(0.05, 0.5))
      groups[f"{name}.w"] = float(rng.uniform(0.2, 1.0))
    else:
      groups[name] = float(rng.uniform(0.1, 1.0))
  groups["l2"] = float(rng.uniform(0.5, 2.0))
  clip = jaxaccum.dp.clip_per_example(_merged(groups))  # max_norm as a prefix of params
  assert len(set(clip.leaf_groups(params))) == len(groups)
  rules = _ghost.rules(lambda d, x: (_scaled_mlp(d[0], x), ()), (params,),
                       jax.tree.map(lambda a: a[:, None], batch), 0)
  assert {k: v.split(":")[0] for k, v in rules.items()} == {
      f"[0]['{n}']['{leaf}']": "materialize" if leaf == "s" else "ghost"
      for n in ("l0", "l1", "l2") for leaf in ("s", "w") if (n, leaf) != ("l2", "s")}
  want = _per_layer_reference(_grouped_mlp, _grouped(params, groups), batch, groups)
  got = jax.jit(jaxaccum.grad(_scaled_mlp, num_micro_batches=2, reduce="sum",
                              per_example=clip))(params, batch)
  chex.assert_trees_all_close(_grouped(got, groups), want, rtol=2e-5, atol=2e-5)


def _grouped(tree, groups):
  """``tree``'s subtrees by clip group (``"l0"``: a layer, ``"l0.s"``: one of its leaves)."""
  return {g: tree[g.split(".")[0]][g.split(".")[1]] if "." in g else tree[g] for g in groups}


def _merged(q):
  """The tree whose clip groups are ``q`` (:func:`_grouped`'s inverse)."""
  out: dict = {}
  for g, v in q.items():
    if "." in g:
      n, leaf = g.split(".")
      out.setdefault(n, {})[leaf] = v
    else:
      out[g] = v
  return out


def _grouped_mlp(q, batch):
  return _scaled_mlp(_merged(q), batch)


def test_per_layer_clip_norms_errors():
  with pytest.raises(ValueError, match="prefix of the gradient"):
    jax.jit(jaxaccum.grad(_mlp, num_micro_batches=1, per_example=(
        jaxaccum.dp.clip_per_example({"encoder": 1.0, "head": 1.0}))))(
            _mlp_params(0), (np.zeros((2, 4), np.float32), np.zeros((2, 3), np.float32)))
  with pytest.raises(ValueError, match="holds no clip norm"):
    jaxaccum.dp.clip_per_example({})
  with pytest.raises(ValueError, match="max_norm must be positive"):
    jaxaccum.dp.clip_per_example({"enc": 1.0, "head": -1.0})


def test_per_layer_clip_called_on_one_gradient():
  clip = jaxaccum.dp.clip_per_example({"a": 1.0, "b": 10.0})
  got = clip({"a": jnp.array([3.0, 4.0]), "b": jnp.array([3.0, 4.0])})
  chex.assert_trees_all_close(got, {"a": jnp.array([0.6, 0.8]), "b": jnp.array([3.0, 4.0])})


@pytest.mark.parametrize("method", ["auto", "ghost"])
def test_the_gram_guard_under_data_axis(method):
  # Under shard_map each example takes its own form (a collective over the examples' vmap
  # axis is refused there): positions that cancel still get their norms right.
  mesh = jax.make_mesh((8,), ("data",))
  rng = np.random.default_rng(7)
  params = {"w": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32),
            "v": jnp.asarray(rng.normal(size=(16,)), jnp.float32)}
  x = rng.normal(size=(16, 2, 16)).astype(np.float32)
  x[::2, 1] = -x[::2, 0] * (1 + 1e-3)  # every other example's two positions cancel

  def loss(p, x):
    return jnp.sum((x @ p["w"]) @ p["v"])

  step = jax.jit(jaxaccum.grad(loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel("data",
                 mesh=mesh), reduce="sum", with_info=True,
                               per_example=jaxaccum.dp.clip_per_example(1.0, method)))
  with jax.set_mesh(mesh):
    _, info = step(params, x)
  want = [np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(
      jax.grad(loss)(params, x[j:j + 1])))) for j in range(16)]
  np.testing.assert_allclose(np.asarray(info.example_grad_norms), want, rtol=1e-4)


def _cnn(p, batch):
  x, y = batch
  dn = ("NHWC", "HWIO", "NHWC")
  h = jax.nn.relu(jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME", dimension_numbers=dn))
  h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["k2"], (1, 1), "SAME",
                                               dimension_numbers=dn))
  return jnp.sum((h.reshape(h.shape[0], -1) @ p["w"] - y) ** 2)


def test_auto_materialises_where_ghost_norms_save_little():
  # Most parameters in a convolution kernel, whose per-example gradient the ghost step forms
  # anyway: "auto" takes the materialised program (no second pass); a dense model keeps
  # ghost norms. Both give the clipped sum of a hand loop.
  rng = np.random.default_rng(1)
  cnn = {"k": jnp.asarray(rng.normal(size=(3, 3, 1, 8)), jnp.float32) / 3,
         "k2": jnp.asarray(rng.normal(size=(3, 3, 8, 8)), jnp.float32) / 9,
         "w": jnp.asarray(rng.normal(size=(4 * 4 * 8, 2)), jnp.float32) / 10}
  cnn_batch = (rng.normal(size=(4, 4, 4, 1)).astype(np.float32),
               rng.normal(size=(4, 2)).astype(np.float32))
  mlp = _mlp_params(1)
  mlp_batch = (rng.normal(size=(4, 4)).astype(np.float32),
               rng.normal(size=(4, 3)).astype(np.float32))
  for loss, params, batch, little in ((_cnn, cnn, cnn_batch, True),
                                      (_mlp, mlp, mlp_batch, False)):
    one = jax.tree.map(lambda a: a[:, None], batch)
    got = _ghost.clipped_sum(lambda d, x, loss=loss: (loss(d[0], x), ()), (params,), one, 0,
                             jaxaccum.dp.clip_per_example(0.5).factors, strict=False,
                             norms=True, auto=True)
    assert (got is None) == little
    auto = jax.jit(jaxaccum.grad(loss, num_micro_batches=2, reduce="sum",
                                 per_example=jaxaccum.dp.clip_per_example(0.5)))
    ref = jax.jit(jaxaccum.grad(loss, num_micro_batches=2, reduce="sum",
                                per_example=jaxaccum.dp.clip_per_example(
                                    0.5, "materialize")))
    chex.assert_trees_all_close(auto(params, batch), ref(params, batch), rtol=1e-5, atol=1e-6)


def _bf16_scan(p, batch):
  x, y = batch
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.astype(jnp.bfloat16)), None),
                      x.astype(jnp.bfloat16), p["enc"]["w"])
  return jnp.sum(((h @ p["head"].astype(jnp.bfloat16)).astype(jnp.float32) - y) ** 2)


def _bf16_layers(act):
  """A loss whose stacked weight ``p["w"]`` (float32, ``(layers, d, d)``) is scanned over in
  bfloat16: ``h = act(h @ w_l)`` from bfloat16 inputs, then ``sum(h * y)``."""
  def loss(p, batch):
    x, y = batch
    h, _ = jax.lax.scan(lambda h, w: (act(h @ w.astype(jnp.bfloat16)), None),
                        x.astype(jnp.bfloat16), p["w"])
    return jnp.sum(h.astype(jnp.float32) * y)

  return loss


@functools.cache
def _bf16_alone(act, method):
  """One example's clipped gradient (a batch of one, ``reduce="sum"``), the clip norm
  ``c`` traced: one program per shape."""
  return jax.jit(lambda params, row, c: jaxaccum.grad(
      _bf16_layers(act), num_micro_batches=1, reduce="sum",
      per_example=jaxaccum.dp.clip_per_example(c, method))(params, row))


def _narrow_cases(count=8, examples=16):
  """Generated bfloat16 scanned programs: layers, width, activation, the inputs' scale (how
  far tanh saturates) and each example's clip norm, a fraction of its own gradient's norm
  (so that every example with a gradient is clipped)."""
  rng = np.random.default_rng(2027)
  for _ in range(count):
    layers, width = int(rng.integers(1, 4)), int(rng.integers(2, 7))
    act = (jnp.tanh, jnp.sin)[int(rng.random() < 0.25)]
    scale = float(10.0 ** rng.uniform(-0.3, 1.0))
    params = {"w": jnp.asarray(rng.normal(size=(layers, width, width)) / np.sqrt(width)
                               * rng.uniform(1.0, 3.0), jnp.float32)}
    x = (rng.normal(size=(examples, 1, width)) * scale).astype(np.float32)
    y = rng.normal(size=(examples, 1, width)).astype(np.float32)
    yield act, params, x, y, rng.uniform(0.2, 0.99, size=examples)


def test_a_bfloat16_second_pass_is_never_run():
  # Sites in a scan body in bfloat16: the clipped sum would be a second backward pass with
  # cotangents c_e, and a bfloat16 backward pass does not scale with its cotangent (tanh's
  # derivative near y = -1, u + u y, cancels to a few bits), so that pass gave a clipped
  # example up to 1.27 C, which no margin on the factors covered. "auto" materialises such a
  # program, "ghost" refuses it. The reference is each example's own jax.grad of the same
  # bfloat16 program (its float32 gradient), clipped by hand: each example alone (a batch of
  # one, reduce="sum") must add that, and at most C (1 + 1e-5).
  over = []
  for act, params, x, y, frac in _narrow_cases():
    loss = _bf16_layers(act)
    ref = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, (x[:, None], y[:, None]))
    for e, f in enumerate(frac):
      g = np.asarray(ref["w"][e], np.float64)
      norm = np.sqrt(np.sum(g ** 2))  # 0 where every unit saturates to +-1 in bfloat16
      c = np.float32(f * norm if norm > 0 else f)
      want = g * min(1.0, float(c) / norm) if norm > 0 else g
      got = np.asarray(_bf16_alone(act, "auto")(params, (x[e:e + 1], y[e:e + 1]), c)["w"],
                       np.float64)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7 * norm)
      over.append(np.sqrt(np.sum(got ** 2)) / float(c))
    rules = _ghost.rules(lambda d, b, loss=loss: (loss(d[0], b), ()), (params,),
                         (x[:2, None], y[:2, None]), 0)
    assert rules == {"[0]['w']": "materialize: a second backward pass in bfloat16"}, rules
    with pytest.raises(ValueError, match=r"method='ghost'.*lax\.scan.*computes in bfloat16.*"
                                         r"Use method='auto'"):
      _bf16_alone(act, "ghost")(params, (x[:1], y[:1]), jnp.float32(1.0))
  assert np.mean(np.array(over) > 0.5) > 0.9  # nearly every example clipped
  assert max(over) <= 1 + 1e-5, max(over)


def test_a_bfloat16_second_pass_asked_for_is_refused():
  # Outside a scan body a bfloat16 program takes book-keeping; program="second" (for tests)
  # would run the pass the rule forbids: strict refuses it, auto materialises. A float32
  # scanned program keeps its ghost norms.
  params = _mlp_params(3)
  scanned = _mlp_params(3, scan=True)
  rows = (np.ones((2, 1, 4), np.float32), np.ones((2, 1, 3), np.float32))
  assert set(_ghost.rules(lambda d, b: (_gelu_scan(d[0], b), ()), (scanned,), rows,
                          0).values()) == {"ghost"}

  def f(d, b):
    x, y = b
    h = jnp.tanh(x.astype(jnp.bfloat16) @ d[0]["enc"]["w"].astype(jnp.bfloat16))
    return jnp.sum((h.astype(jnp.float32) @ d[0]["head"] - y) ** 2), ()

  rng = np.random.default_rng(3)
  xs = (rng.normal(size=(4, 1, 4)).astype(np.float32),
        rng.normal(size=(4, 1, 3)).astype(np.float32))
  weigh = jaxaccum.dp.clip_per_example(0.5).factors
  with pytest.raises(ValueError, match="program='second' was asked for.*bfloat16"):
    _ghost.clipped_sum(f, (params,), xs, 0, weigh, strict=True, program="second")
  assert _ghost.clipped_sum(f, (params,), xs, 0, weigh, strict=False, program="second",
                            auto=True) is None
  assert _ghost.clipped_sum(f, (params,), xs, 0, weigh, strict=True) is not None  # book


def test_per_layer_norms_in_a_narrow_scanned_program():
  # A second backward pass in bfloat16 is never run, with a pytree of clip norms too (its
  # rounding is relative to the whole gradient, not to each group's part): "ghost" refuses
  # such a program, "auto" materialises it, and each group stays within its own norm.
  params = _mlp_params(4, scan=True)
  rng = np.random.default_rng(4)
  batch = (rng.normal(size=(6, 4)).astype(np.float32),
           rng.normal(size=(6, 3)).astype(np.float32))
  limits = {"enc": 0.05, "head": 2.0}
  with pytest.raises(ValueError, match="cannot bound each example's contribution"):
    jax.jit(jaxaccum.grad(_bf16_scan, num_micro_batches=2, per_example=(
        jaxaccum.dp.clip_per_example(limits, "ghost"))))(params, batch)
  one = jax.jit(jaxaccum.grad(_bf16_scan, num_micro_batches=1, reduce="sum",
                              per_example=jaxaccum.dp.clip_per_example(limits)))
  for j in range(6):
    got = one(params, jax.tree.map(lambda a, j=j: a[j:j + 1], batch))
    for name, c in limits.items():
      norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                         for x in jax.tree.leaves(got[name])))
      assert norm <= c * (1 + 1e-5), (name, norm, c)
