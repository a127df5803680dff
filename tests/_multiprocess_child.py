"""One process of the multi-process test: ``python _multiprocess_child.py ADDR N_PROC ID OUT``.

``OUT`` set to ``die`` makes the process exit with code 3 at once (to test the harness).

Started by ``tests/parallel/test_multiprocess.py`` with 2 CPU devices per process. Joins the JAX
distributed runtime (gloo CPU collectives), builds a global batch sharded over every
process's devices, runs one accumulated step with and without ``data_axis``, and writes
the (replicated) loss and gradients that this process sees to ``OUT`` as an ``.npz``.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

BATCH, FEATURES, HIDDEN, CLASSES = 32, 6, 8, 3
NUM_MICRO_BATCHES = 4


def problem():
  """The parameters and the global batch; every process builds the same arrays."""
  rng = np.random.default_rng(0)
  params = {
      "w1": rng.normal(size=(FEATURES, HIDDEN)).astype(np.float32),
      "w2": rng.normal(size=(HIDDEN, CLASSES)).astype(np.float32),
  }
  x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
  labels = rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32)
  mask = (rng.uniform(size=(BATCH,)) < 0.7).astype(np.float32)
  return params, (x, labels, mask)


def token_loss(params, batch):
  """Summed masked cross-entropy and the number of real rows (reduce='weighted')."""
  x, labels, mask = batch
  logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]
  return jnp.sum(nll * mask), jnp.sum(mask)


def mean_loss(params, batch):
  x, labels, _ = batch
  logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def main(address: str, num_processes: int, process_id: int, out: str) -> None:
  if out == "die":
    print(f"process {process_id}: exiting on purpose", file=sys.stderr)
    sys.exit(3)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=60)
  assert jax.process_count() == num_processes, jax.process_count()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  params, batch = problem()
  replicated = NamedSharding(mesh, P())
  rows = NamedSharding(mesh, P("data"))

  def place(x, sharding):
    # Each process supplies only the rows its own devices hold.
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  params = jax.tree.map(lambda a: place(a, replicated), params)
  batch = jax.tree.map(lambda a: place(a, rows), batch)
  results = {}
  for name, fun, reduce in (("mean", mean_loss, "mean"), ("weighted", token_loss, "weighted")):
    parallel = {"data_axis": jaxaccum.DataParallel("data", mesh=mesh)}
    for mode, options in (("plain", {}), ("data_axis", parallel)):
      step = jax.jit(jaxaccum.value_and_grad(
          fun, num_micro_batches=NUM_MICRO_BATCHES, reduce=reduce, **options))
      loss, grads = step(params, batch)
      # The outputs are replicated: this process's first shard holds the whole value.
      results[f"{name}/{mode}/loss"] = np.asarray(loss.addressable_data(0))
      for key, g in grads.items():
        assert g.sharding.is_fully_replicated, (name, mode, key, g.sharding)
        results[f"{name}/{mode}/{key}"] = np.asarray(g.addressable_data(0))
  np.savez(out, **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
