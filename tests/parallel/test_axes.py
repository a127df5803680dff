"""``data_axis="auto"``: the data axes read from how the batch is sharded, on 8 CPU devices.

Under ``Explicit`` mesh axes the batch's type says which axes its leading axis is sharded
over, inside ``jax.jit`` too; under ``Auto`` axes only a placed (concrete) array says it, so
``"auto"`` works outside ``jax.jit`` and gives a clear error inside. Results are compared with
the full batch through plain ``jax.value_and_grad`` (float32, 1e-5 relative) and with the same
transform given the axes by name, which must compile to the same program: identical numbers.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests import _problems
from tests._util import assert_close

SIZES = (8, 16, 8)
BATCH, N = 64, 4


def loss(params, batch):
  return _problems.mlp_loss(params, batch, "mean")


def _problem():
  return _problems.mlp_problem(11, SIZES, BATCH)


def _numpy(tree):
  return jax.tree.map(np.asarray, tree)


MESHES = [pytest.param((8,), ("data",), "data", id="1d"),
          pytest.param((4, 2), ("data", "fsdp"), ("data", "fsdp"), id="2d")]


@pytest.mark.parametrize(("shape", "names", "batch_axes"), MESHES)
def test_explicit_axes_inside_jit(shape, names, batch_axes):
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
  params, batch = _problem()
  ref = jax.jit(jax.value_and_grad(loss))(params, batch)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  batch = jax.device_put(batch, NamedSharding(mesh, P(batch_axes)))
  auto = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, data_axis="auto"))
  named = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, data_axis=batch_axes))
  # No mesh=... and no jax.set_mesh: "auto" takes the batch's mesh as well.
  out = auto(params, batch)
  with jax.set_mesh(mesh):
    want = named(params, batch)
  chex.assert_trees_all_equal(_numpy(out), _numpy(want))
  assert_close(out, ref)
  # The same communication as the named axes: one reduction per step, none in the loop.
  colls = jaxaccum.planning.collectives(auto, params, batch)
  assert colls.count("all-reduce") >= 1 and not colls.in_loop, str(colls)


def test_auto_axes_outside_jit_from_placed_arrays():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  params, batch = _problem()
  ref = jax.jit(jax.value_and_grad(loss))(params, batch)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  out = jaxaccum.value_and_grad(loss, num_micro_batches=N, data_axis="auto")(params, batch)
  want = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N,
                 data_axis=jaxaccum.DataParallel("data", mesh=mesh)))(params, batch)
  assert_close(out, ref)
  assert_close(out, want)


def test_auto_axes_inside_jit_ask_for_the_name():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  params, batch = _problem()
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, data_axis="auto"))
  with pytest.raises(ValueError, match=r"data_axis='auto' cannot read how batch leaf argument "
                     r"1 \('batch'\)\['label'\] .* is sharded: inside jax.jit an array on a mesh "
                     r"with Auto axes carries no sharding.*data_axis='data'.*Explicit"):
    step(params, batch)


def test_a_batch_not_sharded_on_its_leading_axis():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _problem()
  step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, data_axis="auto"))
  replicated = jax.device_put(batch, NamedSharding(mesh, P()))
  with pytest.raises(ValueError, match=r"needs the batch sharded over mesh axes on its batch "
                     r"axis \(axis 0\), but batch leaf argument 1 \('batch'\)\['label'\] "
                     r"\(shape \(64,\)\) is not \(spec P\(None,?\)\)"):
    step(params, replicated)
  # Sharded, but on another axis than the leading one.
  x = jax.device_put(batch["x"], NamedSharding(mesh, P(None, "data")))
  with pytest.raises(ValueError, match=r"batch leaf argument 1 \('batch'\)\['x'\] .* is not "
                     r"\(spec P\(None, 'data'\)\)"):
    step(params, dict(jax.device_put(batch, NamedSharding(mesh, P("data"))), x=x))
  # Not placed on a mesh at all.
  with pytest.raises(ValueError, match=r"is not \(not placed on a mesh\)"):
    jaxaccum.value_and_grad(loss, num_micro_batches=N, data_axis="auto")(
        params, _numpy(batch))


def test_batch_leaves_that_disagree_are_named():
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
  params, batch = _problem()
  batch = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp"))))
  batch["y"] = jax.device_put(batch["y"], NamedSharding(mesh, P("data")))
  step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N, data_axis="auto"))
  with pytest.raises(ValueError, match=r"sharded over different mesh axes.*\['x'\]: "
                     r"\('data', 'fsdp'\).*\['y'\]: \('data',\)"):
    step(params, batch)


def test_auto_with_fsdp_placement_and_a_mesh_given():
  """``"auto"`` composes with the FSDP options and with ``mesh=``."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _problem()
  ref = jax.jit(jax.value_and_grad(loss))(params, batch)
  params = jax.device_put(params, NamedSharding(mesh, P("data")))
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  step = jax.jit(jaxaccum.value_and_grad(loss, num_micro_batches=N,
                 data_axis=jaxaccum.DataParallel("auto", mesh=mesh, param_gather="micro_batch",
                                                 grad_scatter="step")))
  colls = jaxaccum.planning.collectives(step, params, batch)
  assert colls.count("all-gather", in_loop=True) >= 1, str(colls)
  assert colls.count("reduce-scatter", in_loop=False) >= 1, str(colls)
  assert_close(step(params, batch), ref)


def test_auto_is_accepted_by_the_options_and_other_strings_are_axis_names():
  jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis="auto")
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel("auto",
                          mesh=mesh))
  with pytest.raises(ValueError, match=r"data_axis='batch' names mesh axis 'batch'"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel("batch",
                            mesh=mesh))
  params, _ = _problem()
  with pytest.raises(ValueError, match=r"found no array in the batch arguments"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis="auto")(
        params, {"x": jnp.ones(())})
