"""The core's three steps carry their jax.named_scope in the compiled program's metadata.

Each step of :func:`jaxaccum._core._transform.accumulate` runs under a scope starting with
``jaxaccum/`` (``micro_batches``: the loop, ``reduce``: the cross-device reduction under
``data_axis``, ``finalize``: the division after it). The test reads the ``op_name`` of
every instruction of the compiled HLO text and checks that ops of the loop body and of the
finalize step sit under those names, which is what a profiler trace shows. The whole call
runs under one more scope, named after the public transform (``jaxaccum.value_and_grad``),
for every reduction kind, on one device and under ``data_axis``.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxaccum


def loss(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)


W = jnp.ones((3, 2))
X = jax.random.normal(jax.random.key(0), (16, 3))


def op_names(compiled_text: str) -> set[str]:
  return set(re.findall(r'op_name="([^"]*)"', compiled_text))


def scoped(names: set[str], scope: str) -> set[str]:
  """The op names under ``scope`` (with the jit and scope prefix removed)."""
  return {n.split(scope + "/", 1)[1] for n in names if scope + "/" in n}


def test_loop_and_finalize_under_their_scopes():
  f = jaxaccum.value_and_grad(loss, num_micro_batches=4)
  names = op_names(jax.jit(f).lower(W, X).compile().as_text())
  loop = scoped(names, "jaxaccum/micro_batches")
  # The scan's while loop, and in its body the forward (tanh) and backward (dot) ops.
  assert any(n.startswith("while") for n in loop), sorted(names)
  assert any("while/body" in n and "tanh" in n for n in loop), sorted(loop)
  assert any("while/body" in n and "dot_general" in n for n in loop), sorted(loop)
  # The division by the micro-batch count after the loop.
  assert any("div" in n or "mul" in n for n in scoped(names, "jaxaccum/finalize")), \
      sorted(names)
  assert not scoped(names, "jaxaccum/reduce")  # one device: no cross-device reduction


def test_cross_device_reduction_under_its_scope():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  x = jax.random.normal(jax.random.key(1), (32, 3))
  f = jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis="data")
  with jax.set_mesh(mesh):
    text = jax.jit(f).lower(W, jax.sharding.reshard(x, P("data"))).compile().as_text()
  names = op_names(text)
  reduce = scoped(names, "jaxaccum/reduce")
  assert any("psum" in n or "all-reduce" in n or "all_reduce" in n for n in reduce), \
      sorted(reduce)
  assert scoped(names, "jaxaccum/micro_batches") and scoped(names, "jaxaccum/finalize")
  # Every all-reduce of the step is the one after the loop.
  for line in text.splitlines():
    if re.search(r"= \S+ all-reduce(-start)?\(", line):
      assert "jaxaccum/reduce" in line, line


def test_evaluate_under_the_same_scopes():
  ev = jaxaccum.evaluate(loss, num_micro_batches=4)
  names = op_names(jax.jit(ev).lower(W, X).compile().as_text())
  assert any("while/body" in n and "tanh" in n for n in scoped(names, "jaxaccum/micro_batches"))
  assert scoped(names, "jaxaccum/finalize")


def sum_loss(w, x):
  return jnp.sum(jnp.tanh(x @ w) ** 2)


def weighted_loss(w, x):
  return jnp.sum(jnp.tanh(x @ w) ** 2), jnp.float32(x.shape[0])


def terms_loss(w, x):
  return {"ce": weighted_loss(w, x), "reg": jnp.mean(w ** 2)}


# Each reduction kind (and a loss of two terms); "sum" divides by nothing, so its finalize
# step computes only the cast to grads_dtype asked for here (without one it has no op).
KINDS = {
    "mean": (loss, {"reduce": "mean"}),
    "sum": (sum_loss, {"reduce": "sum", "grads_dtype": jnp.bfloat16}),
    "weighted": (weighted_loss, {"reduce": "weighted"}),
    "terms": (terms_loss, {"reduce": jaxaccum.Terms({"ce": "weighted", "reg": "mean"},
                                                    weights={"reg": 0.1})}),
}


def traced_names(text: str, fn_name: str) -> set[str]:
  """The op names traced from the jitted function (those that start with its jit)."""
  return {n for n in op_names(text) if n.startswith(f"jit({fn_name})/")}


@pytest.mark.parametrize("data_axis", [None, "data"], ids=["one-device", "data-axis"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_reduction_shows_its_steps_inside_one_scope_for_the_call(kind, data_axis):
  fun, options = KINDS[kind]
  f = jaxaccum.value_and_grad(fun, num_micro_batches=2, data_axis=data_axis, **options)
  if data_axis is None:
    text = jax.jit(f).lower(W, X).compile().as_text()
  else:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.random.normal(jax.random.key(1), (32, 3))
    with jax.set_mesh(mesh):
      text = jax.jit(f).lower(W, jax.sharding.reshard(x, P("data"))).compile().as_text()
  names = traced_names(text, fun.__name__)
  call = f"jit({fun.__name__})/jaxaccum.value_and_grad/"
  assert names and all(n.startswith(call) for n in names), sorted(names)
  steps = {"micro_batches", "finalize"} | ({"reduce"} if data_axis else set())
  for step in steps:
    assert scoped(names, f"jaxaccum/{step}"), (step, sorted(names))
  # The loop body holds the loss: fun's forward pass is under the loop's scope.
  assert any("while/body" in n and "tanh" in n
             for n in scoped(names, "jaxaccum/micro_batches")), sorted(names)


def test_grad_and_evaluate_name_their_call():
  for build, name in ((jaxaccum.grad, "value_and_grad"), (jaxaccum.evaluate, "evaluate")):
    text = jax.jit(build(loss, num_micro_batches=2)).lower(W, X).compile().as_text()
    names = traced_names(text, "loss")
    assert names and all(n.startswith(f"jit(loss)/jaxaccum.{name}/") for n in names), names


def test_local_value_and_grad_names_its_call():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  f = jaxaccum.local_value_and_grad(loss, data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (32, 3)),
                     jax.sharding.NamedSharding(mesh, P("data")))
  names = traced_names(jax.jit(f).lower(W, x).compile().as_text(), f.__name__)
  assert names and all(n.startswith(f"jit({f.__name__})/jaxaccum.local_value_and_grad/")
                       for n in names), sorted(names)
