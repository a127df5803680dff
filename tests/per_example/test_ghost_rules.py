"""The ghost analysis's two tables: the site rules and the walk into sub-programs.

Every kind of site in ``_rules.SITE_RULES`` is picked where its form appears and gives the
norms and the clipped sum of per-example ``jax.grad`` (generated shapes, seeded); the one walk
(``_walk.Walk``) reaches equations inside ``jit``, ``checkpoint`` and ``lax.scan`` bodies,
nested, and the analysis finds its sites there.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccum._per_example import _ghost
from jaxaccum._per_example._ghost import _analysis, _rules, _walk

E = 4  # examples


def weigh(sq):
  return 1.0 / (1.0 + sq)


def reference(f, diff, xs):
  """Per-example ``jax.grad``: each example's squared norm and ``sum_e weigh(sq_e) g_e``."""
  grads = jax.vmap(lambda x: jax.grad(lambda d: f(d, x)[0])(diff))(xs)
  sq = sum(jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)))
           for g in jax.tree.leaves(grads))
  return jax.tree.map(lambda g: jnp.einsum("e,e...->...", weigh(sq), g), grads), sq


def site_kinds(f, diff, xs):
  """Each leaf's path -> the sorted names of its sites' rules."""
  leaves, treedef = jax.tree.flatten(diff)
  closed, _, _ = _analysis.trace(f, leaves, treedef, xs, 0)
  taps, probes, _, _ = _analysis.decide(closed, leaves, _analysis.mapped(xs, 0))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(diff)[0]]
  kinds: dict[str, list[str]] = {}
  for s in (*taps.values(), *probes.values()):
    kinds.setdefault(paths[s.leaf], []).append(s.rule.name)
  return {k: sorted(v) for k, v in kinds.items()}


def check_against_reference(f, diff, xs):
  ref_grads, ref_sq = jax.jit(lambda d, x: reference(f, d, x))(diff, xs)
  for program in ("book", "second"):
    _, grads, sq = jax.jit(lambda d, x, program=program: _ghost.clipped_sum(
        f, d, x, 0, weigh, strict=True, program=program))(diff, xs)
    chex.assert_trees_all_close(sq, ref_sq, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def one_of_each(seed):
  """A loss with one site of each kind (generated shapes): its params, loss and examples."""
  rng = np.random.default_rng(seed)
  t, d, h, rows, win = (int(v) for v in rng.integers(1, 6, size=5))
  rows += win
  params = {"w": rng.normal(size=(d, h)).astype(np.float32),  # dot
            "emb": rng.normal(size=(rows, d)).astype(np.float32),  # gather
            "bank": rng.normal(size=(rows, h)).astype(np.float32),  # slice (a window)
            "b": rng.normal(size=(h,)).astype(np.float32)}  # direct (a bias add)
  xs = {"ids": rng.integers(0, rows, size=(E, t)).astype(np.int32),
        "start": rng.integers(0, rows - win + 1, size=(E,)).astype(np.int32)}

  def f(dd, x):
    p = dd[0]
    e = jnp.take(p["emb"], x["ids"], axis=0)  # (t, d)
    window = jax.lax.dynamic_slice(p["bank"], (x["start"], 0), (win, h))
    y = jnp.tanh(e @ p["w"] + p["b"])  # (t, h)
    return jnp.sum(y ** 2) + jnp.sum(jnp.tanh(window) * jnp.sum(y)), ()

  return (params,), f, xs


@pytest.mark.parametrize("seed", range(3))
def test_every_site_rule_is_picked_and_exact(seed):
  diff, f, xs = one_of_each(seed)
  kinds = site_kinds(f, diff, xs)
  assert kinds == {"[0]['w']": ["dot"], "[0]['emb']": ["gather"], "[0]['bank']": ["slice"],
                   "[0]['b']": ["direct"]}, kinds
  assert {k for v in kinds.values() for k in v} == {r.name for r in _rules.SITE_RULES}
  check_against_reference(f, diff, xs)


def test_a_broadcast_view_takes_the_direct_rule():
  # A matrix product, a gather and a window of a broadcast view are sites too, but their
  # factor forms do not hold after the broadcast: each takes "direct" instead.
  p = {"w": normal(0, (3,)), "emb": normal(1, (3,)), "bank": normal(2, (3,))}

  def f(d, x):
    q = d[0]
    w = jnp.broadcast_to(q["w"][:, None], (3, 2))
    emb = jnp.broadcast_to(q["emb"][:, None], (3, 2))
    bank = jnp.broadcast_to(q["bank"][:, None], (3, 2))
    return (jnp.sum(jnp.tanh(x @ w)) + jnp.sum(jnp.take(emb, jnp.array([0, 2]), axis=0) ** 2)
            + jnp.sum(jax.lax.dynamic_slice(bank, (1, 0), (2, 2)) * x[:2, None])), ()

  diff, xs = (p,), normal(3, (E, 3))
  assert site_kinds(f, diff, xs) == {"[0]['w']": ["direct"], "[0]['emb']": ["direct"],
                                     "[0]['bank']": ["direct"]}
  check_against_reference(f, diff, xs)


def normal(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape)


def nested(d, x):
  """A scan whose body calls a checkpointed function that calls a jitted one (sites at each
  level), and a jitted function around a checkpointed one outside the scan."""
  q = d[0]

  @jax.jit
  def inner(h, w):
    return jnp.tanh(h @ w)

  def layer(h, ws):
    w, scale = ws
    h = jax.checkpoint(lambda h: inner(h, w) * scale)(h)
    return h, ()

  h, _ = jax.lax.scan(layer, x, (q["stack"], q["scales"]))
  h = jax.jit(jax.checkpoint(lambda h: jnp.tanh(h @ q["w"] + q["b"])))(h)
  return jnp.sum(h ** 2), ()


NESTED = ({"stack": normal(0, (3, 4, 4), 0.5), "scales": 1.0 + normal(1, (3, 4), 0.1),
           "w": normal(2, (4, 2)), "b": normal(3, (2,))},)
NESTED_XS = normal(4, (E, 1, 4))


class _Paths(_walk.Walk):
  """A pass that records the path of each equation it does not enter."""

  def __init__(self):
    self.paths = {}

  def visit(self, eqn, ins, here):
    self.paths[here] = eqn.primitive.name
    return [None] * len(eqn.outvars)


def test_the_walk_enters_nested_jit_checkpoint_and_scan_bodies():
  leaves, treedef = jax.tree.flatten(NESTED)
  closed, _, _ = _analysis.trace(nested, leaves, treedef, NESTED_XS, 0)
  walk = _Paths()
  walk.walk(closed.jaxpr, [None] * len(closed.jaxpr.invars))
  # every equation reached: those of the bodies it follows, none of any other program
  followed = [e.primitive.name for e in _walk.eqns(closed.jaxpr)
              if _walk.body(e) is None]
  assert sorted(walk.paths.values()) == sorted(followed)
  # one tanh at depth 4 (scan > checkpoint > jit > tanh), one at depth 3 (jit > checkpoint)
  tanh = sorted(len(p) for p, name in walk.paths.items() if name == "tanh")
  assert tanh == [3, 4], walk.paths
  bodies = {b.kind for e in _walk.eqns(closed.jaxpr) if (b := _walk.body(e)) is not None}
  assert bodies == {"call", "remat", "scan"}


def test_sites_in_nested_bodies_are_found_and_exact():
  kinds = site_kinds(nested, NESTED, NESTED_XS)
  assert kinds == {"[0]['stack']": ["dot"], "[0]['scales']": ["direct"],
                   "[0]['w']": ["dot"], "[0]['b']": ["direct"]}, kinds
  leaves, treedef = jax.tree.flatten(NESTED)
  closed, _, _ = _analysis.trace(nested, leaves, treedef, NESTED_XS, 0)
  taps, _, _, _ = _analysis.decide(closed, leaves, _analysis.mapped(NESTED_XS, 0))
  # each site's depth: scan > checkpoint > jit > dot; scan > checkpoint > mul; jit >
  # checkpoint > dot and add (leaves in key order: b, scales, stack, w)
  assert {s.leaf: len(path) for path, s in taps.items()} == {0: 3, 1: 3, 2: 4, 3: 3}
  assert [s.view.in_scan for s in sorted(taps.values(), key=lambda s: s.leaf)] == [
      False, True, True, False]
  ref_grads, ref_sq = jax.jit(lambda d, x: reference(nested, d, x))(NESTED, NESTED_XS)
  _, grads, sq = jax.jit(lambda d, x: _ghost.clipped_sum(nested, d, x, 0, weigh, strict=True))(
      NESTED, NESTED_XS)
  chex.assert_trees_all_close(sq, ref_sq, rtol=1e-5)
  chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
