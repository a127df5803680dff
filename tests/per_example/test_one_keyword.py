"""One spelling for the per-example job: ``per_example=`` on every front end.

Properties: (1) every front end (``value_and_grad``, ``grad``, the NNX, Linen and Equinox
adapters, the planner, ``check_per_example_loss``, and ``per_example_value_and_grad`` as
sugar) takes ``per_example=`` without a warning and returns the per-example reference (a
Python loop of ``jax.grad`` over ``x[j:j+1]``, transformed by hand, then the mean) over
generated cases; (2) the old ``per_example_transform=`` gives the bit-identical result with
one ``DeprecationWarning`` that names ``per_example=``; (3) each error names what the
caller typed.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum
from jaxaccum._per_example import _rule

D = 3


def loss(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)


def _case(seed):
  """A generated case: widths, rows, micro-batch count, clip bound and a transform."""
  rng = np.random.default_rng(seed)
  h, n = int(rng.integers(2, 6)), int(rng.choice([1, 2, 4]))
  rows = n * int(rng.integers(1, 4))
  k = jax.random.split(jax.random.key(seed), 4)
  w = {"a": jax.random.normal(k[0], (D, h)), "b": jax.random.normal(k[1], (h,))}
  batch = (jax.random.normal(k[2], (rows, D)), jax.random.normal(k[3], (rows,)))
  c = float(rng.uniform(0.05, 2.0))
  if rng.integers(2):
    scale = float(rng.uniform(-2.0, 2.0))
    return w, batch, n, (lambda g: jax.tree.map(lambda v: scale * v, g)), None
  return w, batch, n, jaxaccum.dp.clip_per_example(c), c


_row_grad = jax.jit(jax.grad(loss))


def _reference(w, batch, transform, c):
  """The mean over rows of each row's gradient, transformed by hand (the clip written out)."""
  grads = []
  for j in range(batch[0].shape[0]):
    g = _row_grad(w, (batch[0][j:j + 1], batch[1][j:j + 1]))
    if c is None:
      g = transform(g)
    else:
      norm = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in jax.tree.leaves(g)))
      factor = min(1.0, c / max(norm, 1e-30))
      g = {k: v * factor for k, v in g.items()}
    grads.append(g)
  return jax.tree.map(lambda *g: sum(g) / len(g), *grads)


def _front_ends():
  """Each front end as ``build(keyword, transform, n) -> (w, batch) -> grads``."""

  def vg(kw, t, n):
    step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=n, **{kw: t}))
    return lambda w, b: step(w, b)[1]

  def grad(kw, t, n):
    return jax.jit(jaxaccum.grad(loss, num_micro_batches=n, **{kw: t}))

  def linen(kw, t, n):
    def linen_loss(params, batch, model_state, rngs):
      del rngs
      return loss(params, batch), model_state
    step = jax.jit(jaxaccum.linen.value_and_grad(linen_loss, num_micro_batches=n, **{kw: t}))
    return lambda w, b: step(w, b, {}, {})[1]

  def eqx(kw, t, n):
    return jax.jit(jaxaccum.eqx.filter_grad(lambda w, b: loss(w, b), num_micro_batches=n,
                                            **{kw: t}))

  def nnx(kw, t, n):
    from flax import nnx as fnnx

    class Model(fnnx.Module):
      def __init__(self, w):
        self.a, self.b = fnnx.Param(w["a"]), fnnx.Param(w["b"])

    def nnx_loss(m, batch):
      return loss({"a": m.a[...], "b": m.b[...]}, batch)
    step = jaxaccum.nnx.grad(nnx_loss, num_micro_batches=n, **{kw: t})

    def run(w, b):
      g = step(Model(w), b)
      return {"a": g["a"][...], "b": g["b"][...]}
    return run

  def plan(kw, t, n):
    del n  # the planner chooses the count: a budget this large takes N = 1

    def run(w, b):
      p = jaxaccum.plan(loss, w, b, verbose=False, memory_budget_bytes=2**30, **{kw: t})
      return p.jitted(w, b)[1]
    return run

  return {"value_and_grad": vg, "grad": grad, "linen": linen, "eqx": eqx, "nnx": nnx,
          "plan": plan}


FRONT_ENDS = sorted(_front_ends())


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_every_front_end_takes_per_example_and_matches_the_loop(front):
  build = _front_ends()[front]
  for seed in range(3):  # generated cases: a clip or a scaling, widths, B, N
    w, batch, n, transform, c = _case(100 * FRONT_ENDS.index(front) + seed)
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # the one spelling warns nowhere
      got = build("per_example", transform, n)(w, batch)
    chex.assert_trees_all_close(got, _reference(w, batch, transform, c), rtol=2e-5,
                                atol=1e-6)


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_the_old_keyword_warns_once_and_gives_the_same_bits(front):
  build = _front_ends()[front]
  w, batch, n, transform, _ = _case(7)
  new = build("per_example", transform, n)(w, batch)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    old = build("per_example_transform", transform, n)(w, batch)
  messages = [str(r.message) for r in caught if issubclass(r.category, DeprecationWarning)]
  assert len(messages) == 1 and "(per_example_transform=...) is deprecated" in messages[0]
  assert "use per_example=transform" in messages[0], messages
  chex.assert_trees_all_equal(old, new)


@pytest.mark.parametrize("seed", range(4))
def test_the_sugar_is_value_and_grad_with_per_example(seed):
  w, batch, n, transform, c = _case(200 + seed)
  sugar = jaxaccum.dp.per_example_value_and_grad(loss, transform, num_micro_batches=n)
  plain = jaxaccum.value_and_grad(loss, num_micro_batches=n, per_example=transform)
  assert sugar.options == plain.options
  chex.assert_trees_all_equal(jax.jit(sugar)(w, batch), jax.jit(plain)(w, batch))
  chex.assert_trees_all_close(jax.jit(sugar)(w, batch)[1], _reference(w, batch, transform, c),
                              rtol=2e-5, atol=1e-6)


def test_check_per_example_loss_takes_per_example_and_warns_on_the_old_keyword():
  w, batch, _, _, _ = _case(3)
  clip = jaxaccum.dp.clip_per_example(0.5)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    new = jaxaccum.dp.check_per_example_loss(loss, per_example=clip)(w, batch)
  with pytest.warns(DeprecationWarning, match=r"check_per_example_loss\(per_example_transform"):
    old = jaxaccum.dp.check_per_example_loss(loss, per_example_transform=clip)(w, batch)
  assert new == old and max(new.values()) < 1e-5
  with pytest.raises(ValueError, match=r"clip_per_example\(keep_batch_dim=False\)"):
    jaxaccum.dp.check_per_example_loss(
        loss, per_example=jaxaccum.dp.clip_per_example(1.0, keep_batch_dim=False))


def state_loss(w, batch, state):
  """A loss whose new state depends on its rows (a batch statistic)."""
  return loss(w, batch), state + jnp.sum(batch[0])


def _errors(typed):
  """The errors of a bad transform, a mixed reduce and a wrong output, given as ``typed``."""
  def build(transform, fun=loss, **kw):
    if typed == "per_example_value_and_grad":
      return jaxaccum.dp.per_example_value_and_grad(fun, transform, num_micro_batches=2, **kw)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return jaxaccum.value_and_grad(fun, num_micro_batches=2, **{typed: transform}, **kw)
  return build


@pytest.mark.parametrize("typed, named", [
    ("per_example", "per_example="), ("per_example_transform", "per_example_transform="),
    ("per_example_value_and_grad", "per_example_value_and_grad's transform")])
def test_each_error_names_what_the_caller_typed(typed, named):
  build = _errors(typed)
  w, batch, _, _, _ = _case(1)
  with pytest.raises(TypeError, match=f"^{named} must be a function"):
    build(1.0)
  with pytest.raises(ValueError, match=rf"^{named} is given, but reduce=.* mixes the kinds"):
    build(jaxaccum.dp.clip_per_example(1.0), reduce={"a": "mean", "b": "sum"})
  with pytest.raises(TypeError, match=f"^{named} must return a gradient with"):
    jax.jit(build(lambda g: (g, g)))(w, batch)
  state_step = build(lambda g: g, state_loss, state_argnums=2)
  with pytest.raises(TypeError, match=f"^{named} runs fun on one example at a time"):
    jax.jit(state_step)(w, batch, jnp.zeros(()))


def test_a_front_end_without_the_rule_refuses_it_by_name():
  with pytest.raises(TypeError, match=r"local_value_and_grad\(\) takes no per_example= option"):
    jaxaccum.local_value_and_grad(loss, data_axis="data", num_micro_batches=2,
                                  per_example=jaxaccum.dp.clip_per_example(1.0))
  with pytest.raises(TypeError, match=r"^evaluate takes no per_example= option: it is about"):
    jaxaccum.evaluate(loss, num_micro_batches=2, per_example=lambda g: g)
  with pytest.raises(TypeError, match=r"got per_example_transform= and per_example= both"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      jaxaccum.value_and_grad(loss, num_micro_batches=2, per_example=lambda g: g,
                              per_example_transform=lambda g: g)
  with pytest.raises(TypeError, match=r"takes the transform once, as its second argument"):
    jaxaccum.dp.per_example_value_and_grad(loss, None, num_micro_batches=2)
  with pytest.raises(TypeError, match=r"takes the transform once, as its second argument"):
    jaxaccum.dp.per_example_value_and_grad(loss, lambda g: g, per_example=lambda g: g)


def test_the_rule_is_not_a_transform_and_no_request_is_left():
  step = jaxaccum.value_and_grad(loss, num_micro_batches=2, per_example=lambda g: g)
  rule = step.options.per_example
  assert isinstance(rule, _rule.PerExampleRule) and not callable(rule)
  assert not hasattr(_rule, "Request")
