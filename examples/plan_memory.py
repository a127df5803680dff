"""Print a memory plan: the fewest micro-batches whose MLP train step fits a budget.

Nothing is allocated and nothing runs: parameters, optimizer state and batch are
``jax.ShapeDtypeStruct`` s, and ``jaxaccum.plan_step`` only lowers and compiles the jitted
train step (accumulated value-and-grad plus an Adam update, parameters and optimizer state
donated) for a few micro-batch counts, reading each program's memory from XLA.

  python examples/plan_memory.py                        # 48 MiB budget, binary search
  python examples/plan_memory.py --budget-mib 32 --all  # compile every divisor
  python examples/plan_memory.py --grads-only           # jaxaccum.plan: value-and-grad only
  python examples/plan_memory.py --device-limit         # the device's own limit (GPU/TPU)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import jaxaccum


def init_params(key, sizes):
  params = []
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
    key, sub = jax.random.split(key)
    params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) / fan_in**0.5,
                   "b": jnp.zeros(fan_out)})
  return params


def loss_fn(params, batch):
  x, labels = batch
  for layer in params[:-1]:
    x = jax.nn.gelu(x @ layer["w"] + layer["b"])
  logits = x @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch-size", type=int, default=1024)
  parser.add_argument("--features", type=int, default=256)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--depth", type=int, default=3, help="hidden layers")
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--budget-mib", type=float, default=48.0,
                      help="memory budget per device, MiB")
  parser.add_argument("--device-limit", action="store_true",
                      help="use the device's bytes_limit less the planner's margin (not CPU)")
  parser.add_argument("--all", action="store_true", help="compile every divisor")
  parser.add_argument("--grads-only", action="store_true",
                      help="plan the value-and-grad alone (jaxaccum.plan), not the train step")
  args = parser.parse_args(argv)

  sizes = [args.features] + [args.width] * args.depth + [args.classes]
  # Shapes only: jax.eval_shape traces the initialisers without allocating anything.
  params = jax.eval_shape(lambda: init_params(jax.random.key(0), sizes))
  batch = (jax.ShapeDtypeStruct((args.batch_size, args.features), jnp.float32),
           jax.ShapeDtypeStruct((args.batch_size,), jnp.int32))
  budget = None if args.device_limit else int(args.budget_mib * 2**20)
  search = "all" if args.all else "binary"
  n_params = sum(p.size for p in jax.tree.leaves(params))
  print(f"MLP {sizes} ({n_params:,} parameters), batch {args.batch_size}, "
        f"{jax.devices()[0].platform}, jax {jax.__version__}")

  start = time.perf_counter()
  if args.grads_only:
    plan = jaxaccum.plan(loss_fn, params, batch, memory_budget_bytes=budget, search=search)
  else:
    optimizer = optax.adam(1e-3)
    opt_state = jax.eval_shape(optimizer.init, params)

    def make_step(num_micro_batches):
      grad_fn = jaxaccum.value_and_grad(loss_fn, num_micro_batches=num_micro_batches)

      def train_step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

      return jax.jit(train_step, donate_argnums=(0, 1))

    plan = jaxaccum.plan_step(make_step, params, opt_state, batch, batch_argnums=2,
                              memory_budget_bytes=budget, search=search)
  seconds = time.perf_counter() - start
  print(plan)
  print(f"planned in {seconds:.1f} s; run it with plan.compiled(params, opt_state, batch)"
        if not args.grads_only else
        f"planned in {seconds:.1f} s; run it with plan.compiled(params, batch)")
  return plan


if __name__ == "__main__":
  main()
