"""Ghost norms (``jaxaccum._per_example._ghost``): each recognised form against brute force.

The reference differentiates every example on its own (``jax.vmap`` of ``jax.grad``),
takes each example's squared norm over all leaves, weighs each example's gradient by
``weigh(norm^2)`` and sums: what the ghost path must return without forming those
gradients. ``weigh(s) = 1 / (1 + s)`` gives every example its own factor, so a wrong norm
shows in the sum too. Each test also checks which rule the analysis picked, so a form that
silently fell back to materialising would fail.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum
from jaxaccum._per_example import _ghost
from jaxaccum._per_example._ghost import _analysis, _norms, _program

E = 5  # examples


def weigh(sq):
  return 1.0 / (1.0 + sq)


def reference(f, diff, xs, in_axes=0):
  def one(x):
    (_, out), g = jax.value_and_grad(lambda d: f(d, x), has_aux=True)(diff)
    return out, g

  outs, grads = jax.vmap(one, in_axes=(in_axes,))(xs)
  sq = sum(jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)))
           for g in jax.tree.leaves(grads))
  c = weigh(sq)
  return outs, jax.tree.map(lambda g: jnp.einsum("e,e...->...", c, g), grads), sq


def in_scan(f, diff, xs, in_axes=0):
  """Whether a site of ``f``'s leaves sits in a scan body (then the clipped sum is always a
  second backward pass)."""
  leaves, treedef = jax.tree.flatten(diff)
  closed, _, _ = _analysis.trace(f, leaves, treedef, xs, in_axes)
  taps, probes, _, _ = _analysis.decide(closed, leaves, _analysis.mapped(xs, in_axes))
  return any(s.view.in_scan for s in (*taps.values(), *probes.values()))


def check(f, diff, xs, in_axes=0, *, rules=(), strict=True, more=()):
  """Ghost against brute force, both jitted; ``rules``: the expected rule per leaf path
  (``"ghost"`` where not given). Where no site sits in a scan body, both programs are
  checked: book-keeping and a second backward pass. ``more``: further examples of ``xs``'s
  shapes and dtypes (generated cases), checked by the same compiled programs."""
  got = _ghost.rules(f, diff, xs, in_axes)
  expect = {k: dict(rules).get(k, "ghost") for k in got}
  assert {k: v.split(":")[0] for k, v in got.items()} == expect, got
  ref = jax.jit(lambda d, x: reference(f, d, x, in_axes))
  for program in ("second",) if in_scan(f, diff, xs, in_axes) else ("book", "second"):
    ghost = jax.jit(lambda d, x, program=program: _ghost.clipped_sum(
        f, d, x, in_axes, weigh, strict=strict, program=program))
    for case in (xs, *more):
      ref_outs, ref_grads, ref_sq = ref(diff, case)
      outs, grads, sq = ghost(diff, case)
      chex.assert_trees_all_close(sq, ref_sq, rtol=1e-5)
      chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(outs, ref_outs, rtol=1e-6)
      assert jax.tree.structure(grads) == jax.tree.structure(diff)


def normal(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape)


def mlp_params():
  return {"w1": normal(0, (4, 6)), "b1": normal(1, (6,)), "w2": normal(2, (6, 3), 0.5),
          "b2": normal(3, (3,)), "unused": normal(4, (2,))}


def mlp(d, batch):
  (p,) = d
  x, y = batch
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2), jnp.sum(h, axis=-1)


MLP_DATA = (normal(5, (E, 1, 4)), normal(6, (E, 1, 3)))


def test_dense_and_bias():
  # dot_general with the weight on the right (one row: the Gram form is |a|^2 |g|^2) and
  # broadcast adds; an unused leaf has norm 0 and a zero gradient.
  check(mlp, (mlp_params(),), MLP_DATA, rules={"[0]['unused']": "none"})


@pytest.mark.parametrize("t", [2, 16])
def test_dense_over_a_sequence(t):
  # T(P + Q) <= PQ picks the Gram form <A A^T, G G^T> at t = 2, the direct |A^T G|^2 at 16.
  assert _norms.gram_cheaper(t, 4, 4) == (t == 2)
  w = {"w": normal(0, (4, 4)), "v": normal(1, (4,))}

  def f(d, x):
    h = jnp.einsum("btd,de->bte", x, d[0]["w"])
    return jnp.sum(jnp.sin(h) @ d[0]["v"]), ()

  check(f, (w,), normal(2, (E, 1, t, 4)))


def test_weight_on_the_left_and_shared_batch_dims():
  # Equinox's W @ x under a vmap inside the loss (the weight is the left operand), also
  # used transposed on the right (two sites: cross terms), and per-head weights that share
  # a batch dimension with the activation.
  p = {"w": normal(0, (3, 4)), "heads": normal(1, (2, 3, 5))}

  def f(d, x):
    h = jax.vmap(lambda r: d[0]["w"] @ r)(x)  # (1, 3)
    per_head = jnp.einsum("bhtd,hde->bhte", jnp.stack([x @ d[0]["w"].T] * 2, 1)[:, :, None],
                          d[0]["heads"])
    return jnp.sum(jnp.tanh(h)) + jnp.sum(per_head ** 2), ()

  check(f, (p,), normal(2, (E, 1, 4)), rules={"[0]['w']": "cross"})


def test_elementwise_scale_and_layernorm():
  # Flax's _normalize: mul = rsqrt(var + eps) * scale (a broadcast multiply), y += bias.
  p = {"scale": 1.0 + normal(0, (4,), 0.1), "bias": normal(1, (4,), 0.1), "g": normal(2, (4,))}

  def f(d, x):
    q = d[0]
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    mul = jax.lax.rsqrt(v + 1e-6) * q["scale"].reshape(1, 1, 4)
    y = (x - m) * mul + q["bias"].reshape(1, 1, 4)
    return jnp.sum(jnp.tanh(y * q["g"]) ** 2), ()  # g: a scale of a 3-d activation

  check(f, (p,), normal(3, (E, 1, 3, 4)))


@pytest.mark.parametrize("rows, t, mode", [(50, 3, "fill"), (3, 8, "clip")])
def test_embedding_gather(rows, t, mode):
  # The gradient is a scatter-add of the cotangent's rows; its norm by the Gram of index
  # equality (50 rows, 3 tokens) or by segment sums (3 rows, 8 tokens, repeats certain).
  # mode="clip" with indices past the end: they read (and get gradient into) the last row.
  assert _norms.index_gram_cheaper(t, 2, rows) == (rows == 50)
  p = {"emb": normal(0, (rows, 2)), "w": normal(1, (2,))}
  top = rows + 2 if mode == "clip" else rows

  def f(d, ids):
    e = jnp.take(d[0]["emb"], ids, axis=0, mode=mode)  # (1, t, 2)
    return jnp.sum(jnp.tanh(e @ d[0]["w"]) * jnp.arange(t)), ()

  ids = jax.random.randint(jax.random.key(3), (E, 1, t), -rows if mode == "fill" else 0, top)
  check(f, (p,), ids)


def test_embedding_indices_out_of_range_add_nothing():
  # JAX's default indexing (table[ids], promise_in_bounds) and mode="fill" read a row for an
  # index out of range (the nearest one, or the fill value), and their transposes drop its
  # gradient: an index one past the end, further out, or below -rows (after jnp's wrap of
  # negative indices) adds nothing to the norm, by the index-equality Gram (50 rows, 3
  # tokens: "emb") and by segment sums (3 rows: "fill"). A table tied as the output head
  # ("tied"): its cross term drops those positions too.
  assert _norms.index_gram_cheaper(3, 2, 50) and not _norms.index_gram_cheaper(3, 2, 3)
  p = {"emb": normal(0, (50, 2)), "fill": normal(1, (3, 2)), "tied": normal(2, (3, 2)),
       "w": normal(3, (2,))}

  def f(d, ids):
    q = d[0]
    big, small = ids
    e = q["emb"][big] + jnp.take(q["fill"], small, axis=0, mode="fill", fill_value=0.0)
    s = jnp.tanh(e @ q["w"])  # (1, 3)
    h = s[..., None] * q["tied"][small]
    return jnp.sum(s * jnp.arange(3)) + jnp.sum(jnp.sin(h @ q["tied"].T)), ()

  def ids(seed):
    rng = np.random.default_rng(seed)
    out = []
    for rows in (50, 3):
      i = rng.integers(-rows - 2, rows + 3, size=(E, 1, 3))
      i[rng.random(i.shape) < 0.4] = rows  # one past the end, often twice in an example
      i[0, 0, :2] = rows
      out.append(jnp.asarray(i, jnp.int32))
    return tuple(out)

  check(f, (p,), ids(0), rules={"[0]['tied']": "cross"}, more=[ids(s) for s in range(1, 4)])


def test_slices():
  # dynamic_slice at an index taken from the example, and a static slice: one window each,
  # so the norm is the window cotangent's. The static slice, and the positional table
  # gathered at fixed indices, do not depend on the example (unbatched under vmap).
  p = {"table": normal(0, (6, 3)), "bank": normal(1, (8,)), "pos": normal(2, (4, 3))}

  def f(d, x):
    pos, v = x
    row = jax.lax.dynamic_slice(d[0]["table"], (pos[0], 0), (2, 3))
    at = jnp.take(d[0]["pos"], jnp.arange(2), axis=0)
    return jnp.sum(jnp.sin((row + at) * v[0, :3]) + d[0]["bank"][2:5] * v[0, 3:]), ()

  xs = (jax.random.randint(jax.random.key(2), (E, 1), 0, 6), normal(3, (E, 1, 6)))
  check(f, (p,), xs)


def test_tied_embeddings():
  # The same table is gathered (input embedding) and multiplied (output head): its norm is
  # |G_in|^2 + |G_out|^2 + 2 <G_in, G_out>, the cross term from both sites' factors.
  p = {"emb": normal(0, (7, 3)), "w": normal(1, (3, 3))}

  def f(d, ids):
    h = jnp.tanh(jnp.take(d[0]["emb"], ids, axis=0) @ d[0]["w"])  # (1, 4, 3)
    logits = h @ d[0]["emb"].T
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0]), ()

  ids = jax.random.randint(jax.random.key(2), (E, 1, 4), 0, 7)
  check(f, (p,), ids, rules={"[0]['emb']": "cross"})


def test_negated_views_keep_their_sign_in_the_cross_terms():
  # A leaf used twice, once through a negation: |G_1 - G_2|^2 = |G_1|^2 + |G_2|^2
  # - 2 <G_1, G_2>, the cross term's sign the negation's. x @ w beside cos(x) @ (-w) (two
  # matrix products), and a table gathered through a double negation (the sign back to +)
  # and tied as the output head negated ((-emb).T: a gather's and a product's factors).
  # Generated inputs through the same compiled programs.
  p = {"w": normal(0, (3, 3)), "emb": normal(1, (6, 3))}

  def f(d, batch):
    q = d[0]
    x, ids = batch
    h = x @ q["w"] + jnp.cos(x) @ (-q["w"])  # (1, 3)
    e = jnp.take(jnp.negative(-q["emb"]), ids, axis=0)  # (1, 4, 3)
    logits = jnp.tanh(e + h[:, None]) @ (-q["emb"]).T
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0]), ()

  def batch(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(E, 1, 3)) * 10.0 ** rng.uniform(-0.5, 0.5, size=(E, 1, 1))
    return (jnp.asarray(x, jnp.float32),
            jnp.asarray(rng.integers(0, 6, size=(E, 1, 4)), jnp.int32))

  check(f, (p,), batch(0), rules={"[0]['w']": "cross", "[0]['emb']": "cross"},
        more=[batch(s) for s in range(1, 4)])


def test_scan_over_stacked_layers():
  # A stacked weight entering lax.scan as xs: each iteration uses its own slice, so the
  # iterations' norms add. A weight entering as a constant is used by every iteration:
  # its per-example gradient is materialised (auto) or refused (strict).
  p = {"w": normal(0, (3, 4, 4), 0.5), "b": normal(1, (3, 4)), "shared": normal(2, (4,))}

  def f(d, x):
    def layer(h, wb):
      w, b = wb
      return jnp.tanh(h @ w + b) * d[0]["shared"], None
    h, _ = jax.lax.scan(layer, x, (d[0]["w"], d[0]["b"]))
    return jnp.sum(h ** 2), ()

  xs = normal(3, (E, 1, 4))
  check(f, (p,), xs, rules={"[0]['shared']": "materialize"}, strict=False)
  with pytest.raises(ValueError, match=r"\[0\]\['shared'\].*scan \(as a constant\)"):
    _ghost.clipped_sum(f, (p,), xs, 0, weigh, strict=True)


def test_a_stacked_weight_used_twice_in_a_scan_body_falls_back_for_that_leaf():
  # Cross terms are formed outside scan bodies only: a slice used twice in one iteration
  # (tied within the layer) materialises that leaf (auto) and is named (strict).
  p = {"w": normal(0, (3, 4, 4), 0.5), "b": normal(1, (3, 4))}

  def f(d, x):
    def layer(h, wb):
      w, b = wb
      return jnp.tanh(jnp.tanh(h @ w + b) @ w.T), None
    h, _ = jax.lax.scan(layer, x, (d[0]["w"], d[0]["b"]))
    return jnp.sum(h ** 2), ()

  xs = normal(3, (E, 1, 4))
  check(f, (p,), xs, rules={"[0]['w']": "materialize"}, strict=False)
  with pytest.raises(ValueError, match=r"\[0\]\['w'\].*2 uses .*cross terms have no rule"):
    _ghost.clipped_sum(f, (p,), xs, 0, weigh, strict=True)


def test_disjoint_static_slices_of_one_leaf_add_their_norms():
  # A stacked weight indexed in a Python loop (w[i]), a matrix split into column halves, its
  # even and odd rows (strided), and halves of each scanned layer's weight (one through two
  # transposes): the slices' gradients have disjoint supports, so
  # the sites are tapped one by one with no cross terms. Overlapping slices have cross terms
  # without a rule: that leaf alone is materialised.
  p = {"w": normal(0, (3, 4, 4), 0.5), "split": normal(1, (4, 6), 0.5),
       "stack": normal(2, (2, 4, 4), 0.5), "overlap": normal(3, (3, 4), 0.5),
       "strided": normal(5, (4, 4), 0.5)}

  def f(d, x):
    q = d[0]
    h = x
    for i in range(3):
      h = jnp.tanh(h @ q["w"][i])
    h = jnp.concatenate([h @ q["split"][:, :3], jnp.sin(h @ q["split"][:, 3:])], -1)[..., :4]
    h = jnp.tanh(jnp.concatenate([h @ q["strided"][::2].T, h @ q["strided"][1::2].T], -1))

    def layer(h, w):
      return jnp.tanh(h[..., :2] @ w[:2] + h[..., 2:] @ w[2:].T.T), None

    h, _ = jax.lax.scan(layer, h, q["stack"])
    h = h @ q["overlap"][:2].T + h @ q["overlap"][1:].T
    return jnp.sum(h ** 2), ()

  xs = normal(4, (E, 1, 4))
  check(f, (p,), xs, rules={"[0]['overlap']": "materialize"}, strict=False)
  with pytest.raises(ValueError, match=r"\[0\]\['overlap'\].*2 uses"):
    _ghost.clipped_sum(f, (p,), xs, 0, weigh, strict=True)


def test_remat_and_nested_jit():
  # Sites inside jax.checkpoint (a policy kept) and inside a nested jit.
  p = mlp_params()

  @jax.jit
  def head(h, w, b):
    return h @ w + b

  def f(d, batch):
    q = d[0]
    x, y = batch
    h = jax.checkpoint(lambda x: jnp.tanh(x @ q["w1"] + q["b1"]),
                       policy=jax.checkpoint_policies.nothing_saveable)(x)
    return jnp.mean((head(h, q["w2"], q["b2"]) - y) ** 2), ()

  check(f, (p,), MLP_DATA, rules={"[0]['unused']": "none"})

  # A leaf's layout changed inside a jit that holds no site: the site is outside it.
  def g(d, batch):
    q = d[0]
    x, y = batch
    w1 = jax.jit(jnp.transpose)(q["w1"])
    h = jnp.tanh(x @ w1.T + q["b1"])
    return jnp.mean((h @ q["w2"] + q["b2"] - y) ** 2), ()

  check(g, (p,), MLP_DATA, rules={"[0]['unused']": "none"})


def test_convolution():
  p = {"k": normal(0, (3, 3, 2, 4), 0.3), "kb": normal(1, (4,)), "w": normal(2, (36, 2), 0.1)}

  def f(d, x):
    q = d[0]
    h = jax.lax.conv_general_dilated(x, q["k"], (1, 1), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(h + q["kb"]).reshape(1, -1)
    return jnp.sum(jax.nn.log_softmax(h @ q["w"])[:, 0]), ()

  check(f, (p,), normal(3, (E, 1, 5, 5, 2)))


def test_unrecognised_use_falls_back_for_that_leaf_only():
  def f(d, batch):
    p = d[0]
    x, y = batch
    h = jnp.tanh(x @ jnp.sin(p["w1"]) + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2), ()

  check(f, (mlp_params(),), MLP_DATA, strict=False,
        rules={"[0]['w1']": "materialize", "[0]['unused']": "none"})
  assert _ghost.rules(f, (mlp_params(),), MLP_DATA, 0)["[0]['w1']"] == "materialize: sin"
  with pytest.raises(ValueError, match=r"method='ghost'.*\[0\]\['w1'\].*reaches sin.*"
                                       r"method='auto'"):
    _ghost.clipped_sum(f, (mlp_params(),), MLP_DATA, 0, weigh, strict=True)



@jax.custom_jvp
def rebase(x, at):  # at's value with x's derivative, as the NNX adapter passes parameters
  del x
  return at


rebase.defjvp(lambda primals, tangents: (primals[1], tangents[0]))


@jax.custom_jvp
def twice(x, at):  # at's value with twice x's derivative: not an identity
  del x
  return at


twice.defjvp(lambda primals, tangents: (primals[1], 2.0 * tangents[0]))


def test_custom_jvp_identity_in_the_leaf_is_seen_through():
  # Each leaf reaches its sites through rebase, at values other than its own (the norms are
  # those of the gradients at `at`); relu (a custom_jvp, not an identity) and twice are not
  # seen through.
  at = jax.tree.map(lambda a: a + 0.5, mlp_params())

  def over(wrap):
    def f(d, x):
      return mlp((jax.tree.map(wrap, d[0], at),), x)
    return f

  check(over(rebase), (mlp_params(),), MLP_DATA, rules={"[0]['unused']": "none"})
  f = over(lambda w, a: jax.nn.relu(w) if w.ndim == 1 else rebase(w, a))
  check(f, (mlp_params(),), MLP_DATA, strict=False,
        rules={"[0]['b1']": "materialize", "[0]['b2']": "materialize",
               "[0]['unused']": "materialize"})
  assert _ghost.rules(f, (mlp_params(),), MLP_DATA, 0)["[0]['b1']"] == (
      "materialize: custom_jvp_call")
  f = over(lambda w, a: twice(w, a) if w.shape == (6, 3) else rebase(w, a))
  check(f, (mlp_params(),), MLP_DATA, strict=False,
        rules={"[0]['w2']": "materialize", "[0]['unused']": "none"})

def test_inside_a_jitted_micro_batch_loop():
  # As the core calls it: inside lax.scan over micro-batches, closing over traced values.
  p = mlp_params()
  xs = jax.tree.map(lambda a: a.reshape(2, E, *a.shape[1:]),
                    (normal(7, (2 * E, 1, 4)), normal(8, (2 * E, 1, 3))))

  @jax.jit
  def loop(d, xs, scale):
    def body(acc, x):
      f = lambda d, x: (mlp(d, x)[0] * scale, ())  # noqa: E731
      _, g, sq = _ghost.clipped_sum(f, d, x, 0, weigh, strict=True)
      return jax.tree.map(jnp.add, acc, g), sq
    return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, d), xs)

  grads, sq = loop((p,), xs, 2.0)
  scaled = lambda d, x: (mlp(d, x)[0] * 2.0, ())  # noqa: E731
  refs = [reference(scaled, (p,), (xs[0][i], xs[1][i])) for i in range(2)]
  chex.assert_trees_all_close(grads, jax.tree.map(jnp.add, refs[0][1], refs[1][1]), rtol=1e-5)
  chex.assert_trees_all_close(sq, jnp.stack([refs[0][2], refs[1][2]]), rtol=1e-5)


def transformer_params(vocab=11, d=8, layers=2):
  return {"emb": normal(0, (vocab, d)), "ln": {"scale": 1 + normal(1, (d,), 0.1),
                                               "bias": normal(2, (d,), 0.1)},
          "layers": {"ln": 1 + normal(3, (layers, d), 0.1),
                     "q": normal(4, (layers, d, d), 0.3), "k": normal(5, (layers, d, d), 0.3),
                     "v": normal(6, (layers, d, d), 0.3), "o": normal(7, (layers, d, d), 0.3),
                     "mlp": normal(8, (layers, d, 2 * d), 0.3),
                     "mlp_b": normal(9, (layers, 2 * d), 0.1),
                     "out": normal(10, (layers, 2 * d, d), 0.3)}}


def layer_norm(h, scale, bias=0.0):
  m = h.mean(-1, keepdims=True)
  v = ((h - m) ** 2).mean(-1, keepdims=True)
  return (h - m) * jax.lax.rsqrt(v + 1e-5) * scale + bias


def transformer_lm(d, tokens):
  """A causal LM: tied embeddings, LayerNorm, its layers in one lax.scan."""
  p = d[0]
  t = tokens.shape[-1]
  h = jnp.take(p["emb"], tokens, axis=0)  # (1, T, D)
  mask = jnp.tril(jnp.ones((t, t), bool))

  def block(h, w):
    a = layer_norm(h, w["ln"])
    q, k, v = (a @ w[n] for n in ("q", "k", "v"))
    s = jnp.where(mask, jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1]), -1e9)
    h = h + jax.nn.softmax(s, axis=-1) @ v @ w["o"]
    return h + jax.nn.gelu(a @ w["mlp"] + w["mlp_b"]) @ w["out"], None

  h, _ = jax.lax.scan(block, h, p["layers"])
  logits = layer_norm(h, p["ln"]["scale"], p["ln"]["bias"]) @ p["emb"].T
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)), ()


def test_transformer_lm():
  tokens = jax.random.randint(jax.random.key(11), (E, 1, 6), 0, 11)
  check(transformer_lm, (transformer_params(),), tokens, rules={"[0]['emb']": "cross"})


def test_a_scanned_lm_holds_no_more_than_plain_accumulation():
  # Both backward passes read one forward pass; inside the scan over layers, the cheap
  # elementwise values they read are recomputed per iteration, not stacked over the layers.
  p = transformer_params(vocab=32, d=32, layers=4)
  tokens = jax.ShapeDtypeStruct((16, 16), jnp.int32)

  def loss(p, tokens):
    return jnp.mean(jax.vmap(lambda t: transformer_lm((p,), t[None])[0])(tokens))

  def temp(transform=None):
    step = (jaxaccum.value_and_grad(loss, num_micro_batches=2) if transform is None else
            jaxaccum.dp.per_example_value_and_grad(loss, transform, num_micro_batches=2))
    return jax.jit(step).lower(p, tokens).compile().memory_analysis().temp_size_in_bytes

  assert temp(jaxaccum.dp.clip_per_example(1.0, "ghost")) <= temp()


@pytest.mark.parametrize("nan_safe", [False, True])
def test_an_mlp_holds_at_most_half_again_plain_accumulations_temporaries(nan_safe):
  # No site in a scan body: gelu's residuals outweigh the sites' inputs and output
  # gradients, so the clipped sum is formed from those (book-keeping). nan_safe's exact
  # zeros come from masking the kept values; the second backward pass's rerun for them,
  # held beside the first program, took this step to 2.3x.
  sizes = (128, 256, 256, 10)
  p = [{"w": normal(k, (m, n)), "b": jnp.zeros(n)}
       for k, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=False))]
  batch = (jax.ShapeDtypeStruct((32, 128), jnp.float32),
           jax.ShapeDtypeStruct((32,), jnp.int32))

  def loss(p, batch):
    h, labels = batch
    for layer in p[:-1]:
      h = jax.nn.gelu(h @ layer["w"] + layer["b"])
    logits = h @ p[-1]["w"] + p[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def temp(transform=None):
    step = (jaxaccum.value_and_grad(loss, micro_batch_size=8) if transform is None else
            jaxaccum.dp.per_example_value_and_grad(loss, transform, micro_batch_size=8))
    return jax.jit(step).lower(p, batch).compile().memory_analysis().temp_size_in_bytes

  clip = jaxaccum.dp.clip_per_example(1.0, "ghost", nan_safe=nan_safe)
  assert temp(clip) <= 1.5 * temp()


def test_flax_and_equinox_models():
  flax_nnx = pytest.importorskip("flax.nnx")
  linen = pytest.importorskip("flax.linen")
  eqx = pytest.importorskip("equinox")
  x = normal(0, (E, 1, 3))

  class NNX(flax_nnx.Module):
    def __init__(self, rngs):
      self.emb = flax_nnx.Embed(5, 3, rngs=rngs)
      self.lin = flax_nnx.Linear(3, 4, rngs=rngs)
      self.norm = flax_nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x, ids):
      return self.norm(self.lin(x + self.emb(ids)))

  graphdef, state = flax_nnx.split(NNX(flax_nnx.Rngs(0)))
  ids = jax.random.randint(jax.random.key(1), (E, 1), 0, 5)

  def nnx_loss(d, b):
    return jnp.sum(jnp.tanh(flax_nnx.merge(graphdef, d[0])(*b)) ** 2), ()

  check(nnx_loss, (state,), (x, ids))

  class Linen(linen.Module):
    @linen.compact
    def __call__(self, x):
      h = linen.LayerNorm()(linen.Dense(4)(x))
      return linen.Dense(2, use_bias=False)(jnp.tanh(h))

  model = Linen()
  variables = model.init(jax.random.key(2), x[0])

  def linen_loss(d, b):
    return jnp.sum(model.apply(d[0], b) ** 2), ()

  check(linen_loss, (variables,), x)

  net = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(3))
  params, static = eqx.partition(net, eqx.is_inexact_array)

  def eqx_loss(d, b):
    return jnp.sum(jax.vmap(eqx.combine(d[0], static))(b) ** 2), ()

  check(eqx_loss, (params,), x)


def _scanned_mlp(d, batch):  # its sites sit in a scan body: norms tapped, two backward passes
  x, y = batch

  def layer(h, wb):
    w, b = wb
    return jnp.tanh(h @ w + b), None

  h, _ = jax.lax.scan(layer, x, (d[0]["w"], d[0]["b"]))
  return jnp.mean((h - y) ** 2), jnp.sum(h, axis=-1)


@pytest.mark.parametrize("where", ["input", "target"])
@pytest.mark.parametrize("model,program", [("mlp", "book"), ("mlp", "second"),
                                           ("scanned", None)])
def test_an_example_with_factor_zero_adds_zero_even_where_not_finite(model, program, where):
  # nan_safe and padding masks give c_e = 0. A NaN input makes that example's activations
  # NaN, a NaN target its output gradients: 0 * NaN must not poison the sum, whether the
  # clipped sum is formed from kept activations and gradients (book-keeping) or by a
  # reweighted backward pass (the only program for sites in a scan body).
  if model == "mlp":
    f, params, d_out = mlp, mlp_params, 3
  else:
    f, d_out = _scanned_mlp, 4
    params = lambda: {"w": normal(0, (2, 4, 4), 0.5), "b": normal(1, (2, 4))}  # noqa: E731
  x, y = MLP_DATA[0], normal(6, (E, 1, d_out))
  if where == "input":
    x = x.at[2, 0, 1].set(jnp.nan)
  else:
    y = y.at[2].set(jnp.nan)

  def safe(sq):
    return jnp.where(jnp.isfinite(sq), weigh(sq), 0.0)

  _, grads, sq = jax.jit(lambda d, b: _ghost.clipped_sum(
      f, d, b, 0, safe, strict=True, program=program))((params(),), (x, y))
  keep = np.array([0, 1, 3, 4])
  _, ref, ref_sq = reference(f, (params(),), (x[keep], y[keep]))
  assert np.isnan(sq[2])
  chex.assert_trees_all_close(sq[keep], ref_sq, rtol=1e-5)
  chex.assert_trees_all_close(grads, ref, rtol=1e-5, atol=1e-6)


def _gelu_mlp(d, batch):
  (p,) = d
  x, y = batch
  h = jax.nn.gelu(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2), jnp.sum(h, axis=-1)


@pytest.mark.parametrize("f,book", [(mlp, False), (_gelu_mlp, True)])
def test_the_program_that_holds_less_is_picked(monkeypatch, f, book):
  # Book-keeping holds every site's operands and output gradients; a second backward pass
  # holds the forward pass's residuals. A tanh MLP's residuals are its sites' inputs (the
  # second pass holds less), gelu keeps more per layer (book-keeping holds less).
  calls = []
  kept_sum = _program.kept_sum
  monkeypatch.setattr(_program, "kept_sum", lambda *a: calls.append(1) or kept_sum(*a))
  check(f, (mlp_params(),), MLP_DATA, rules={"[0]['unused']": "none"})
  calls.clear()  # check() ran both programs against brute force; which one is the default?
  jax.jit(lambda d, b: _ghost.clipped_sum(f, d, b, 0, weigh, strict=True))(
      (mlp_params(),), MLP_DATA)
  assert bool(calls) == book


def _segment_gather(d, ids):  # 3 rows, 8 tokens: the segment-sum form of a gather's norm
  e = jnp.take(d[0]["emb"], ids, axis=0)
  return jnp.sum(jnp.tanh(e @ d[0]["w"]) * jnp.arange(8)), ()


def _fallback_and_slice(d, batch):  # a leaf under sin (materialised) and a static slice
  x, y = batch
  h = jnp.tanh(x @ jnp.sin(d[0]["w1"]) + d[0]["b1"][:6])
  return jnp.mean((h @ d[0]["w2"] - y) ** 2), ()


_HUGE_CASES = {
    "mlp": (lambda d, b: (mlp(d, b)[0], ()), lambda: (mlp_params(),), lambda: MLP_DATA),
    "lm": (transformer_lm, lambda: (transformer_params(),),
           lambda: jax.random.randint(jax.random.key(11), (E, 1, 6), 0, 11)),
    "segment_gather": (_segment_gather,
                       lambda: ({"emb": normal(0, (3, 2)), "w": normal(1, (2,))},),
                       lambda: jax.random.randint(jax.random.key(3), (E, 1, 8), 0, 3)),
    "fallback_and_slice": (_fallback_and_slice,
                           lambda: ({"w1": normal(0, (4, 6)), "b1": normal(1, (9,)),
                                     "w2": normal(2, (6, 3))},), lambda: MLP_DATA),
}


@pytest.mark.parametrize("case", sorted(_HUGE_CASES))
def test_norms_whose_square_overflows_float32(case):
  # norms=True: weigh gets norms, which stay finite above ~1.8e19 (squares above 3.4e38),
  # for every rule: dense (Gram and direct), bias, scale, gathers (index Gram and segment
  # sums), tied cross terms, slices and a materialised leaf.
  f, diff, xs = _HUGE_CASES[case]
  diff, xs = diff(), xs()

  def huge(d, b):
    return 1e20 * f(d, b)[0], ()

  _, grads, norms = jax.jit(lambda d, b: _ghost.clipped_sum(
      huge, d, b, 0, lambda n: 1.0 / n, strict=False, norms=True))(diff, xs)
  per = jax.jit(jax.vmap(lambda b: jax.grad(lambda d: f(d, b)[0])(diff)))(xs)
  unit = jnp.sqrt(sum(jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)))
                      for g in jax.tree.leaves(per)))
  assert bool(jnp.all(unit > 0))
  chex.assert_trees_all_close(norms, 1e20 * unit, rtol=1e-5)
  chex.assert_trees_all_close(grads, jax.tree.map(
      lambda g: jnp.einsum("e,e...->...", 1.0 / unit, g), per), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_forward_pass_tanh_has_tanhs_derivatives(dtype):
  # The ghost step's tanh reads its derivative as (1 - y)(1 + y): the same values and first
  # derivatives as jnp.tanh's own rule, in the saturated range too (where 1 - y^2 rounds to
  # 0 or to a denormal in float32), and second derivatives to float32 round-off of terms of
  # order 1 (near 0, -2 y y' is their difference; jax 0.12's rule forms it directly). In
  # bfloat16 both forms subtract numbers of order 1 (y rounded to 2**-8 near |y| = 1).
  x = jnp.array([-30.0, -9.0, -2.5, -0.3, 0.0, 1e-4, 0.7, 3.0, 8.5, 40.0], dtype)
  ours, theirs = _program.tanh, jnp.tanh
  for order, fn in enumerate((lambda f: f, jax.grad, lambda f: jax.grad(jax.grad(f)))):
    tol = ({"rtol": 1e-6, "atol": 1e-7 if order == 2 else 0} if dtype == jnp.float32 else
           {"rtol": 2.0**-7, "atol": 2.0**-8})
    chex.assert_trees_all_close(jax.vmap(fn(ours))(x), jax.vmap(fn(theirs))(x), **tol)
