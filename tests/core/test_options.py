"""The options of value_and_grad as records: DataParallel, Terms, a policy remat,
per_example_value_and_grad; the schema as data; the deprecated keywords."""

import ast
import dataclasses
import inspect
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum
from jaxaccum._core import _options

API = pathlib.Path(jaxaccum.__file__).parent / "_api.py"


def _function(name):
  tree = ast.parse(API.read_text())
  return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_value_and_grad_has_at_most_20_keyword_options():
  fn = _function("value_and_grad")
  assert len(fn.args.kwonlyargs) <= 20, [a.arg for a in fn.args.kwonlyargs]
  doc = ast.get_docstring(fn)
  assert doc is not None and len(doc.splitlines()) <= 100


def test_the_signature_matches_the_schema():
  for fun, skip in ((jaxaccum.value_and_grad, set()),
                    (jaxaccum.evaluate, _options.GRADIENT_OPTIONS)):
    params = {p.name: p.default for p in inspect.signature(fun).parameters.values()
              if p.kind is p.KEYWORD_ONLY}
    assert params == {k: v for k, v in _options.DEFAULTS.items() if k not in skip}


def mesh8():
  return jax.make_mesh((8,), ("data",))


def loss(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def terms_loss(w, batch):
  x, y = batch
  err = (jnp.tanh(x @ w) - y) ** 2
  return {"mse": jnp.mean(err), "total": jnp.sum(err)}


def data(seed=0, rows=16):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k1, (3, 2)),
          (jax.random.normal(k2, (rows, 3)), jax.random.normal(k3, (rows, 2))))


# (old keywords, new keywords, fun): each old form must warn and give identical results.
def _cases():
  mesh = mesh8()
  policy = jax.checkpoint_policies.dots_saveable
  clip = jaxaccum.dp.clip_per_example(0.5)
  return {
      "mesh": (dict(data_axis="data", mesh=mesh),
               dict(data_axis=jaxaccum.DataParallel("data", mesh=mesh)), loss),
      "overlap_grad_reduce": (
          dict(data_axis="data", mesh=mesh, overlap_grad_reduce=True),
          dict(data_axis=jaxaccum.DataParallel("data", mesh=mesh, overlap_grad_reduce=True)),
          loss),
      "param_gather": (dict(data_axis="data", mesh=mesh, param_gather="step"),
                       dict(data_axis=jaxaccum.DataParallel("data", mesh=mesh)), loss),
      "grad_scatter": (dict(data_axis="data", mesh=mesh, grad_scatter="micro_batch"),
                       dict(data_axis=jaxaccum.DataParallel("data", mesh=mesh)), loss),
      "loss_weights": (dict(reduce={"mse": "mean", "total": "sum"},
                            loss_weights={"total": 0.25}),
                       dict(reduce=jaxaccum.Terms({"mse": "mean", "total": "sum"},
                                                  weights={"total": 0.25})), terms_loss),
      "remat_policy": (dict(remat_policy=policy), dict(remat=policy), loss),
      "per_example_transform": (dict(per_example_transform=clip), dict(per_example=clip), loss),
  }


@pytest.mark.parametrize("name", sorted(_cases()))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_deprecated_keyword_warns_and_matches_the_record(name, seed):
  old, new, fun = _cases()[name]
  w, batch = data(seed)
  with pytest.warns(DeprecationWarning) as record:
    old_step = jaxaccum.value_and_grad(fun, num_micro_batches=2, **old)
  assert sorted(str(r.message).split("(")[1].split("=")[0] for r in record) == sorted(
      k for k in old if k in _options.DEPRECATED)
  assert any(f"value_and_grad({name}=...) is deprecated" in str(r.message) for r in record)
  new_step = jaxaccum.value_and_grad(fun, num_micro_batches=2, **new)
  assert old_step.options == new_step.options
  chex.assert_trees_all_equal(jax.jit(old_step)(w, batch), jax.jit(new_step)(w, batch))
  # And both are the full-batch result (an independent reference), where one exists.
  if name != "per_example_transform":
    weights = {"total": 0.25}
    ref_fun = (fun if fun is loss else
               lambda w, b: sum(v * weights.get(k, 1.0) for k, v in fun(w, b).items()))
    ref = jax.value_and_grad(ref_fun)(w, batch)
    got = jax.jit(new_step)(w, batch)
    got_value = got[0]  # a dict reduce returns the weighted total
    chex.assert_trees_all_close((got_value, got[1]), ref, rtol=1e-5, atol=1e-6)


def test_evaluate_and_grad_take_the_records_and_warn_on_mesh():
  w, batch = data()
  mesh = mesh8()
  with pytest.warns(DeprecationWarning, match=r"evaluate\(mesh=\.\.\.\) is deprecated"):
    old = jaxaccum.evaluate(loss, num_micro_batches=2, data_axis="data", mesh=mesh)
  new = jaxaccum.evaluate(loss, num_micro_batches=2,
                          data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  chex.assert_trees_all_equal(jax.jit(old)(w, batch), jax.jit(new)(w, batch))
  chex.assert_trees_all_close(jax.jit(new)(w, batch), loss(w, batch), rtol=1e-6)
  with pytest.raises(TypeError, match=r"param_gather, grad_scatter and overlap_grad_reduce"):
    jaxaccum.evaluate(loss, num_micro_batches=2,
                      data_axis=jaxaccum.DataParallel("data", overlap_grad_reduce=True))
  with pytest.raises(TypeError, match=r"^evaluate takes no remat_policy= option: it is about"):
    jaxaccum.evaluate(loss, num_micro_batches=2, remat_policy=None)
  g = jaxaccum.grad(loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  chex.assert_trees_all_close(jax.jit(g)(w, batch), jax.grad(loss)(w, batch), rtol=1e-5)


def test_record_and_old_keyword_together_is_an_error():
  with pytest.raises(TypeError, match=r"give mesh inside data_axis=DataParallel"), \
      pytest.warns(DeprecationWarning):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, mesh=mesh8(),
                            data_axis=jaxaccum.DataParallel("data"))
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'nope'"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, nope=1)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(axis=None), TypeError, r"DataParallel needs the mesh axis"),
    (dict(axis=0), TypeError, r"data_axis must be a mesh axis name"),
    (dict(axis="data", mesh="m"), TypeError, r"mesh must be a jax.sharding.Mesh"),
    (dict(axis="data", param_gather="layer"), ValueError, r"param_gather must be one of"),
    (dict(axis="data", grad_scatter=1), ValueError, r"grad_scatter must be one of"),
    (dict(axis="data", overlap_grad_reduce=1), TypeError, r"overlap_grad_reduce must be a bool"),
])
def test_data_parallel_validates_itself(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxaccum.DataParallel(**kwargs)


def test_terms_validates_itself():
  with pytest.raises(TypeError, match=r"Terms takes a dict of loss terms"):
    jaxaccum.Terms("mean")
  with pytest.raises(ValueError, match=r"reduce must be one of"):
    jaxaccum.Terms({"a": "median"})
  with pytest.raises(ValueError, match=r"^weights names \['zz'\], which are not terms"):
    jaxaccum.Terms({"a": "mean"}, weights={"zz": 1.0})
  with pytest.raises(TypeError, match=r"^weights\['a'\] must be a Python or NumPy number"):
    jaxaccum.Terms({"a": "mean"}, weights={"a": "heavy"})
  with pytest.raises(TypeError, match=r"^weights must be a dict"):
    jaxaccum.Terms({"a": "mean"}, weights=[1.0])


def test_a_plain_value_means_the_record():
  """Generated cases: a plain data_axis / dict reduce / bool remat is the record's default."""
  rng = np.random.default_rng(0)
  for _ in range(6):
    axis = ["data", ("data",), "auto"][rng.integers(3)]
    kinds = {k: ["mean", "sum", "weighted"][rng.integers(3)] for k in ("a", "b")}
    remat = bool(rng.integers(2))
    plain = jaxaccum.value_and_grad(loss, num_micro_batches=2, data_axis=axis, reduce=kinds,
                                    remat=remat).options
    record = jaxaccum.value_and_grad(
        loss, num_micro_batches=2, data_axis=jaxaccum.DataParallel(axis),
        reduce=jaxaccum.Terms(kinds), remat=remat).options
    assert plain == record


def test_plan_reads_the_validated_options():
  """plan takes the mesh from DataParallel (not from a raw mesh= keyword): with an unplaced
  batch the mesh alone says there are 8 data shards, so every candidate splits each shard's
  4 rows."""
  w = jax.ShapeDtypeStruct((3, 2), jnp.float32)
  batch = (jax.ShapeDtypeStruct((32, 3), jnp.float32),
           jax.ShapeDtypeStruct((32, 2), jnp.float32))
  p = jaxaccum.plan(loss, w, batch, memory_budget_bytes=2**30, search="all",
                    data_axis=jaxaccum.DataParallel("data", mesh=mesh8()))
  assert sorted(c.num_micro_batches for c in p.candidates) == [1, 2, 4]


def test_local_value_and_grad_takes_data_parallel_and_warns_on_mesh():
  mesh = mesh8()
  w, batch = data(rows=16)
  with pytest.warns(DeprecationWarning, match=r"local_value_and_grad\(mesh=\.\.\.\) is deprecated"):
    old = jaxaccum.local_value_and_grad(loss, data_axis="data", mesh=mesh)
  new = jaxaccum.local_value_and_grad(loss, data_axis=jaxaccum.DataParallel("data", mesh=mesh))
  out_old, out_new = jax.jit(old)(w, batch), jax.jit(new)(w, batch)
  chex.assert_trees_all_equal(out_old, out_new)
  value, grads = out_new  # the pieces sum to the full batch's value and gradients
  ref_value, ref_grads = jax.value_and_grad(loss)(w, batch)
  chex.assert_trees_all_close((value.sum(), grads.sum(0)), (ref_value, ref_grads), rtol=1e-5,
                              atol=1e-6)
  with pytest.raises(TypeError, match=r"takes DataParallel\(axis, mesh=\.\.\.\) only"):
    jaxaccum.local_value_and_grad(loss, data_axis=jaxaccum.DataParallel("data",
                                                                        grad_scatter="step"))


# --- each record of Options validates itself: a seeded fuzz against a table ---------------

def _policy(*_, **__):
  return True


# Per record and field: good values with what the record stores, and bad values with the
# error's type and the three things its message names (the argument, the value, the fix).
# The good values of different fields are chosen so that no two of them clash.
_OK = object()
RECORDS = {
    _options.Split: {
        "count": ([(2, 2), (np.int32(3), 3)],
                  [(0, ValueError, ("num_micro_batches", "=0", "positive integer")),
                   (2.0, TypeError, ("num_micro_batches", "2.0", "num_micro_batches=8")),
                   (True, TypeError, ("num_micro_batches", "True", "num_micro_batches=8"))]),
        "batch_axis": ([(0, 0), (np.int64(1), 1), ((0, {"a": 1}), (0, {"a": 1}))],
                       [("x", TypeError, ("batch_axis", "'x'", "jax.vmap's in_axes")),
                        ((0, None), TypeError, ("batch_axis", "(0, None)",
                                                "as a non-batch argument")),
                        (1.0, TypeError, ("batch_axis", "1.0", "jax.vmap's in_axes"))]),
    },
    _options.RoleSpec: {
        "argnums": ([(0, (0,)), ((0,), (0,)), ([0, np.int64(2)], (0, 2))],
                    [("a", TypeError, ("argnums", "'a'", "an int or a tuple of ints")),
                     ((0, 0), ValueError, ("argnums", "(0, 0)", "names an argument twice")),
                     (1, ValueError, ("argnums=(1,)", "batch_argnums=(1", "different positions"))]),
        "batch_argnums": ([(1, (1,)), ((1, 3), (1, 3))],
                          [("x", TypeError, ("batch_argnums", "'x'", "a tuple of ints")),
                           (0, ValueError, ("batch_argnums=(0,)", "argnums=(0", "different"))]),
        "batch_argnames": ([(None, ()), ("b", ("b",)), (["b", "c"], ("b", "c"))],
                           [(3, TypeError, ("batch_argnames", "3", "tuple of names"))]),
        "rng_argnums": ([(None, ()), (4, (4,)), ((4, 5), (4, 5))],
                        [(1.5, TypeError, ("rng_argnums", "1.5", "a tuple of ints")),
                         (1, ValueError, ("rng_argnums=(1,)", "batch_argnums=(1", "different"))]),
        "rng_argnames": ([(None, ()), ("k", ("k",))],
                         [(3, TypeError, ("rng_argnames", "3", "tuple of names")),
                          ("b", ValueError, ("rng_argnames=('b',)", "batch_argnames=('b'",
                                             "per-example keys"))]),
        "state_argnums": ([(None, ()), (6, (6,)), ((6,), (6,))],
                          [("s", TypeError, ("state_argnums", "'s'", "a tuple of ints")),
                           (0, ValueError, ("state_argnums=(0,)", "argnums=(0", "different"))]),
    },
    _options.Numerics: {
        "accumulator_dtype": ([(None, None), ("float32", np.dtype("float32")),
                               (jnp.bfloat16, jnp.dtype(jnp.bfloat16))],
                              [("int32", TypeError, ("accumulator_dtype", "'int32'",
                                                     "such as jnp.float32")),
                               ("nope", TypeError, ("accumulator_dtype", "'nope'",
                                                    "jnp.float32"))]),
        "grads_dtype": ([(None, None), (jnp.float16, np.dtype("float16"))],
                        [(int, TypeError, ("grads_dtype", "int", "such as jnp.float32"))]),
        "remat": ([(False, False), (True, True), (_policy, True)],
                  [(1, TypeError, ("remat=1", "1", "jax.checkpoint policy")),
                   ("yes", TypeError, ("remat='yes'", "yes", "dots_saveable"))]),
        "remat_policy": ([(None, None)],
                         [(3, TypeError, ("remat_policy", "3", "dots_saveable"))]),
        "unroll": ([(1, 1), (4, 4), (True, True), (np.int64(2), 2)],
                   [(0, TypeError, ("unroll=0", "0", "as for jax.lax.scan")),
                    (1.5, TypeError, ("unroll=1.5", "1.5", "positive int or a bool")),
                    ("2", TypeError, ("unroll='2'", "2", "positive int or a bool"))]),
    },
}


def _stored(record, field, drawn):
  """What ``record`` holds for ``field`` given the drawn good values (the table's, where the
  table says it; the derived and policy fields from their rules)."""
  if isinstance(record, _options.Numerics) and field == "remat_policy":
    return _policy if drawn["remat"][0] is _policy else None
  return drawn[field][1]


@pytest.mark.parametrize("record", list(RECORDS), ids=lambda r: r.__name__)
def test_each_record_validates_its_fields(record):
  """Every bad value of the table once, with the other fields drawn from their good values,
  and 8 draws of good values only: each bad one raises its error naming the argument, the
  value and the fix; each good one is stored as the table says."""
  rng = np.random.default_rng(51)
  table = RECORDS[record]
  cases = [(f, bad) for f, (_, bads) in table.items() for bad in bads] + [(None, None)] * 8
  for field, bad in cases:
    drawn = {f: goods[rng.integers(len(goods))] for f, (goods, _) in table.items()}
    kwargs = {f: v for f, (v, _) in drawn.items()}
    if field is not None:
      value, error, names = bad
      kwargs[field] = value
      with pytest.raises(error) as info:
        record(**kwargs)
      message = str(info.value)
      assert all(n in message for n in names), (field, value, message)
      continue
    made = record(**kwargs)
    for f in table:
      got, want = getattr(made, f), _stored(made, f, drawn)
      assert got == want and type(got) is type(want), (f, kwargs[f], got, want)


def test_the_derived_role_flags_follow_the_values_as_given():
  spec = _options.RoleSpec(argnums=(0,), batch_argnames="b", state_argnums=(2,))
  assert (spec.argnums_is_int, spec.batch_optional, spec.state_is_tuple) == (False, True, True)
  spec = _options.RoleSpec(argnums=0, batch_argnums=1, batch_argnames="b", state_argnums=2)
  assert (spec.argnums_is_int, spec.batch_optional, spec.state_is_tuple) == (True, False, False)
  # a copy keeps them: the stored tuples no longer say how they were given
  assert dataclasses.replace(spec, rng_argnums=3).argnums_is_int is True


def test_the_split_needs_exactly_one_count():
  for kwargs in ({}, {"count": 2, "size": 3}):
    with pytest.raises(ValueError, match="exactly one of num_micro_batches and micro_batch_size"):
      _options.Split(**kwargs)
  assert (_options.Split(size=np.int64(4)).count, _options.Split(size=4).size) == (None, 4)


def test_options_checks_what_joins_two_records():
  split, roles = _options.Split(2, batch_axis=(0, 0)), _options.RoleSpec()
  with pytest.raises(ValueError, match=r"batch_axis=\(0, 0\)"):
    _options.Options(lambda p, x: 0.0, split, roles)
  with pytest.raises(ValueError, match="has_aux=False: set has_aux=True"):
    _options.Options(lambda p, x: 0.0, _options.Split(2), roles, aux_reduce="concat")
  with pytest.raises(TypeError, match="with_info must be a bool, got with_info=1"):
    _options.Options(lambda p, x: 0.0, _options.Split(2), roles, with_info=1)


def test_data_parallel_default_placement():
  assert jaxaccum.DataParallel("data").default_placement
  for placement in ({"param_gather": "micro_batch"}, {"grad_scatter": "step"}):
    assert not jaxaccum.DataParallel("data", **placement).default_placement
  overlap = jaxaccum.DataParallel("data", overlap_grad_reduce=True)
  assert overlap.default_placement and not overlap.reduces_only
