"""Shared test helpers: comparisons with a full-batch reference, and counting compiles."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np


def assert_close(actual, expected, *, rtol=1e-5, atol=1e-7, err_msg=""):
  """Asserts two pytrees have the same structure and are close, leaf by leaf.

  The tolerance is relative to the largest magnitude of each expected leaf, so a small
  entry of a large gradient is not held to a tighter bound than float32 round-off allows.
  """
  a_leaves, a_def = jax.tree.flatten(actual)
  e_leaves, e_def = jax.tree.flatten(expected)
  assert a_def == e_def, f"structures differ: {a_def} vs {e_def} {err_msg}"
  for path_and_e, a in zip(jax.tree_util.tree_leaves_with_path(expected), a_leaves,
                           strict=True):
    path, e = path_and_e
    a = np.asarray(jnp.asarray(a, jnp.float32) if jnp.asarray(a).dtype == jnp.bfloat16 else a)
    e = np.asarray(jnp.asarray(e, jnp.float32) if jnp.asarray(e).dtype == jnp.bfloat16 else e)
    assert a.shape == e.shape, f"{jax.tree_util.keystr(path)}: {a.shape} vs {e.shape}"
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    np.testing.assert_allclose(
        a, e, rtol=0, atol=atol + rtol * scale,
        err_msg=f"leaf {jax.tree_util.keystr(path)} {err_msg}")


@contextlib.contextmanager
def count_compiles():
  """Counts XLA backend compilations (jax's own monitoring event) inside the block."""
  names = []

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      names.append(kwargs.get("fun_name"))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def scan_lengths(jaxpr) -> list[int]:
  """The ``length`` of every scan in a jaxpr, outermost first; inner jaxprs (shard_map, jit,
  a ClosedJaxpr's jaxpr) included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      out.append(eqn.params["length"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out += scan_lengths(inner)
  return out
