"""The core's three steps carry their jax.named_scope in the compiled program's metadata.

Each step of :func:`jaxaccum._transform.accumulate` runs under a scope starting with
``jaxaccum/`` (``micro_batches``: the loop, ``reduce``: the cross-device reduction under
``data_axis``, ``finalize``: the division after it). The test reads the ``op_name`` of
every instruction of the compiled HLO text and checks that ops of the loop body and of the
finalize step sit under those names, which is what a profiler trace shows.
"""

import re

import jax
import jax.numpy as jnp
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
