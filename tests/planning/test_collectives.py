"""Tests for ``jaxaccum.planning.collectives``: the collectives of a compiled program, never run.

Every count is checked against the compiled HLO text read independently (plain regular
expressions over ``compiled.as_text()``), every size against ``prod(shape) * itemsize``, and
the loop nesting against the ``while`` ops of the text. The older spellings of device groups
and the asynchronous pairs that only GPU programs print are checked on HLO text written here.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._planning import _collectives

KIND_RE = {k: re.compile(rf"\s{k}(?:-start)?\(") for k in _collectives.KINDS}


def text_count(text, kind):
  """How many ops of ``kind`` the text holds (an async pair's ``-start`` counts once)."""
  return len(KIND_RE[kind].findall(text))


def body_of_entry_loops(text):
  """The computations named as ``body=`` by the while ops of the ENTRY computation."""
  entry = text[text.index("\nENTRY "):]
  entry = entry[:entry.index("\n}")]
  return set(re.findall(r"\swhile\(.*?\bbody=%?([\w.\-]+)", entry))


def computation_of(text, line):
  """The name of the computation whose body holds ``line``."""
  head = None
  for raw in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", raw)
    if m:
      head = m.group(1)
    elif raw.strip() == line:
      return head
  raise AssertionError(f"line not found: {line}")


def itemsize(dtype):
  return jnp.dtype(dtype).itemsize


def mesh_of(shape, names, axis_type=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def sds(shape, dtype, mesh=None, spec=None):
  sharding = None if mesh is None else NamedSharding(mesh, spec)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


# --------------------------------------------------------------- known programs


def test_psum_in_shard_map_is_one_all_reduce_outside_any_loop():
  mesh = mesh_of((8,), ("data",))
  f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x * 2, "data"), mesh=mesh,
                            in_specs=P("data"), out_specs=P()))
  x = sds((64, 3), jnp.float32, mesh, P("data"))
  got = jaxaccum.planning.collectives(f, x)
  text = f.lower(x).compile().as_text()
  assert text_count(text, "all-reduce") == 1
  assert got.count() == got.count("all-reduce") == 1 and len(got) == 1
  (c,) = got
  assert c.kind == "all-reduce" and not c.in_loop and c.loop_depth == 0
  assert c.dtype == "float32" and c.shape == (8, 3) and not c.is_tuple
  assert c.bytes == 8 * 3 * 4 == got.bytes() == got.bytes("all-reduce", in_loop=False)
  assert c.executions == 1
  assert c.mesh_axes == ("data",) and c.replica_groups == (tuple(range(8)),)
  assert got.num_loops == 0 and got.in_loop.count() == 0


def test_psum_inside_a_fori_loop_is_in_the_loop():
  mesh = mesh_of((8,), ("data",))

  def body(x):
    # The reduction depends on the carry, so XLA cannot hoist it out of the loop.
    return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.psum(c * x, "data"), x)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                            check_vma=False))
  x = sds((16,), jnp.float32, mesh, P("data"))
  got = jaxaccum.planning.collectives(f, x)
  text = f.lower(x).compile().as_text()
  assert text_count(text, "all-reduce") == got.count() == 1
  (c,) = got
  assert c.in_loop and c.loop_depth == 1 and c.executions == 5
  assert computation_of(text, c.line) in body_of_entry_loops(text)
  assert got.in_loop.ops == got.ops and got.count(in_loop=True) == 1
  assert got.count(in_loop=False) == 0 and got.num_loops == 1
  assert c.shape == (2,) and c.bytes == 2 * 4


def test_nested_loops_give_depth_two():
  mesh = mesh_of((8,), ("data",))

  def body(x):
    def outer(i, c):
      inner = jax.lax.fori_loop(0, 3, lambda j, d: jax.lax.psum(d * x, "data"), c)
      return inner + 1.0
    return jax.lax.fori_loop(0, 4, outer, x)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                            check_vma=False))
  x = sds((16,), jnp.float32, mesh, P("data"))
  got = jaxaccum.planning.collectives(f, x)
  text = f.lower(x).compile().as_text()
  assert text_count(text, "all-reduce") == got.count() == 1
  (c,) = got
  assert c.loop_depth == 2 and c.in_loop and c.executions == 3 * 4
  # Independently: the op's computation is the body of a while that sits in the body of the
  # ENTRY computation's while.
  outer_bodies = body_of_entry_loops(text)
  home = computation_of(text, c.line)
  assert home not in outer_bodies
  inner_whiles = [raw for raw in text.splitlines() if re.search(rf"\bbody=%?{re.escape(home)}\b",
                                                                raw)]
  assert len(inner_whiles) == 1 and computation_of(text, inner_whiles[0].strip()) in outer_bodies
  assert got.num_loops == 2


def test_fsdp_all_gather_and_reduce_scatter():
  mesh = mesh_of((4, 2), ("data", "fsdp"))

  def body(w, x):
    full = jax.lax.all_gather(w, "fsdp", tiled=True)          # (8, 4) from (4, 4) shards
    y = x @ full.T
    g = jax.lax.psum_scatter(jnp.ones_like(full) * y.sum(), "fsdp", tiled=True)
    return g

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P(("data", "fsdp"))),
                            out_specs=P("fsdp"), check_vma=False))
  w = sds((8, 4), jnp.float32, mesh, P("fsdp"))
  x = sds((32, 4), jnp.float32, mesh, P(("data", "fsdp")))
  got = jaxaccum.planning.collectives(f, w, x)
  text = f.lower(w, x).compile().as_text()
  for kind in ("all-gather", "reduce-scatter"):
    assert got.count(kind) == text_count(text, kind) == 1, (kind, got)
  (gather,) = got.select("all-gather")
  (scatter,) = got.select("reduce-scatter")
  assert gather.shape == (8, 4) and scatter.shape == (4, 4)
  for c in (gather, scatter):
    assert c.dtype == "float32" and c.bytes == math.prod(c.shape) * itemsize(jnp.float32)
    assert c.mesh_axes == ("fsdp",)
    assert sorted(c.replica_groups) == [(0, 1), (2, 3), (4, 5), (6, 7)]
  assert got.count(("all-gather", "reduce-scatter")) == 2


def test_a_tuple_all_reduce_is_one_op_whose_bytes_are_the_sum():
  mesh = mesh_of((4, 2), ("data", "fsdp"))

  def body(x, w):
    return jax.lax.psum((x.sum(), w * 2), "data")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(),
                            check_vma=False))
  x = sds((16, 8), jnp.float32, mesh, P("data"))
  w = sds((256, 512), jnp.float32, mesh, P())
  got = jaxaccum.planning.collectives(f, x, w)
  text = f.lower(x, w).compile().as_text()
  assert text_count(text, "all-reduce") == got.count() == 1
  (c,) = got
  assert c.is_tuple and c.shape == ((), (256, 512)) and c.dtype == ("float32", "float32")
  assert [o.bytes for o in c.operands] == [4, 256 * 512 * 4]
  assert c.bytes == 4 + 256 * 512 * 4
  assert c.mesh_axes == ("data",)


def test_other_kinds_and_their_axes():
  mesh = mesh_of((4, 2), ("data", "fsdp"))

  def body(x):
    p = jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])
    t = jax.lax.all_to_all(x, "fsdp", 0, 0, tiled=True)
    return p, t

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "fsdp"),
                            out_specs=P("data", "fsdp"), check_vma=False))
  x = sds((16, 8), jnp.float32, mesh, P("data", "fsdp"))
  got = jaxaccum.planning.collectives(f, x)
  text = f.lower(x).compile().as_text()
  for kind in ("collective-permute", "all-to-all"):
    assert got.count(kind) == text_count(text, kind) == 1
  (permute,) = got.select("collective-permute")
  assert permute.mesh_axes == ("data",) and permute.replica_groups is None
  # Device (d, f) of the (4, 2) mesh has id 2 * d + f; data shard d sends to d + 1.
  assert sorted(permute.source_target_pairs) == sorted(
      (2 * d + f, 2 * ((d + 1) % 4) + f) for d in range(4) for f in range(2))
  (a2a,) = got.select("all-to-all")
  assert a2a.mesh_axes == ("fsdp",)
  assert sum(o.bytes for o in a2a.operands) == a2a.bytes == 4 * 4 * 4


def _scan_model(num_layers=3, width=16, rows=64):
  def loss_fn(params, batch):
    x, y = batch

    def layer(h, p):
      return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, x, params["layers"])
    return jnp.mean((h @ params["head"] - y) ** 2)

  params = {"layers": {"w": sds((num_layers, width, width), jnp.float32),
                       "b": sds((num_layers, width), jnp.float32)},
            "head": sds((width, 1), jnp.float32)}
  batch = (sds((rows, width), jnp.float32), sds((rows, 1), jnp.float32))
  return loss_fn, params, batch


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_value_and_grad_with_and_without_data_axis(axis_type):
  mesh = mesh_of((8,), ("data",), axis_type)
  loss_fn, params, batch = _scan_model()
  place = lambda tree, spec: jax.tree.map(  # noqa: E731
      lambda a: sds(a.shape, a.dtype, mesh, spec), tree)
  params, batch = place(params, P()), place(batch, P("data"))
  plain = jax.jit(jaxaccum.value_and_grad(loss_fn, num_micro_batches=4))
  once = jax.jit(jaxaccum.value_and_grad(loss_fn, num_micro_batches=4,
                 data_axis=jaxaccum.DataParallel("data", mesh=mesh)))
  for fn in (plain, once):
    got = jaxaccum.planning.collectives(fn, params, batch)
    text = fn.lower(params, batch).compile().as_text()
    assert got.count("all-reduce") == text_count(text, "all-reduce") == got.count()
    for c in got:
      assert c.bytes == sum(math.prod(s) * 4 for s in c.shapes) and c.mesh_axes == ("data",)
    loops = body_of_entry_loops(text)
    outside = [c for c in got if not c.in_loop]
    assert all(computation_of(text, c.line) not in loops for c in outside)
    if fn is once:
      # One reduction of loss and gradients after the loop, none inside it.
      assert got.count(in_loop=True) == 0 and got.count() == 1
      assert got[0].executions == 1
    else:
      # XLA reduces each layer's gradients inside the layer scan inside the micro-batch scan.
      deep = [c for c in got if c.loop_depth == 2]
      assert deep and all(c.executions == 4 * 3 for c in deep), got
      assert got.count(in_loop=True) == len(got.in_loop) > 0


# --------------------------------------------------------------- conditionals


def branch_names(text):
  """The computations the text's conditionals run as branches, one set per conditional."""
  return [{n.strip().lstrip("%") for n in group.split(",")}
          for group in re.findall(r"\sconditional\(.*?branch_computations=\{([^}]*)\}", text)]


def test_two_branches_of_one_cond_run_one_all_reduce():
  mesh = mesh_of((8,), ("data",))

  def body(p, x):
    s = jax.lax.psum(x, "data")  # always runs
    return jax.lax.cond(p[0] > 0, lambda: jax.lax.psum(x * 2, "data"),
                        lambda: jax.lax.psum(x * 3, "data")) + s

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  args = sds((1,), jnp.float32, mesh, P()), sds((16, 3), jnp.float32, mesh, P("data"))
  got = jaxaccum.planning.collectives(f, *args)
  text = f.lower(*args).compile().as_text()
  (branches,) = branch_names(text)  # one conditional, both its branches all-reduce
  assert got.count() == text_count(text, "all-reduce") == 3
  in_branch = sorted(computation_of(text, c.line) in branches for c in got)
  assert in_branch == [False, True, True]
  assert [c.conditional for c in got] == [computation_of(text, c.line) in branches
                                          for c in got]
  assert all(c.executions == 1 for c in got)  # each op, if its branch is taken
  assert got.max_executions() == 2  # the unconditional one and one of the branches
  assert got.max_executions(in_loop=False) == 2 and got.select("all-gather").max_executions() == 0
  table = str(got)
  row = table.splitlines()[2].split()
  assert row[0] == "all-reduce" and row[-1] == "≤2", table
  assert table.splitlines()[-1].startswith("≤: at most"), table
  assert "in a conditional branch" in repr(got)


def test_micro_batch_loop_under_traced_active_micro_batches_is_an_upper_bound():
  mesh = mesh_of((8,), ("data",))
  loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)  # noqa: E731
  vg = jaxaccum.value_and_grad(loss_fn, num_micro_batches=4)
  w, x = sds((3,), jnp.float32, mesh, P()), sds((64, 3), jnp.float32, mesh, P("data"))
  traced = jax.jit(lambda w, x, k: vg(w, x, active_micro_batches=k))
  got = jaxaccum.planning.collectives(traced, w, x, sds((), jnp.int32))
  text = traced.lower(w, x, sds((), jnp.int32)).compile().as_text()
  branches = set().union(*branch_names(text))
  # The loop's body runs micro-batch i only while i < k: its all-reduce is in a branch.
  assert got.count() == text_count(text, "all-reduce") >= 1
  assert all(c.conditional and computation_of(text, c.line) in branches for c in got), got
  assert all(c.loop_depth == 1 and c.executions == 4 for c in got), got
  assert got.max_executions() == 4 * got.count()
  assert str(got).splitlines()[2].split()[-1] == f"≤{4 * got.count()}", str(got)
  # Without active_micro_batches every micro-batch runs: exact counts, nothing conditional.
  plain = jaxaccum.planning.collectives(jax.jit(vg), w, x)
  assert plain.count() >= 1 and not any(c.conditional for c in plain), plain
  assert plain.max_executions() == sum(c.executions for c in plain) == 4 * plain.count()
  assert "≤" not in str(plain)


def test_runs_add_up_over_call_sites_and_take_the_larger_branch():
  shared = ("%shared (p: f32[8]) -> f32[8] {",
            "  ROOT %r = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={}, to_apply=%add",
            "}")
  text = "\n".join([
      "HloModule m", "",
      "%add (a: f32[], b: f32[]) -> f32[] {", "  ROOT %s = f32[] add(f32[] %a, f32[] %b)", "}",
      *shared,
      "%twice (p: f32[8]) -> f32[8] {",  # a branch that reduces twice
      "  %t1 = f32[8]{0} call(f32[8]{0} %p), to_apply=%shared",
      "  ROOT %t2 = f32[8]{0} call(f32[8]{0} %t1), to_apply=%shared", "}",
      "%none (p: f32[8]) -> f32[8] {", "  ROOT %n = f32[8]{0} negate(f32[8]{0} %p)", "}",
      "%body (p: f32[8]) -> f32[8] {",
      "  ROOT %b = f32[8]{0} call(f32[8]{0} %p), to_apply=%shared", "}",
      "%cond (p: f32[8]) -> pred[] {", "  ROOT %c = pred[] constant(true)", "}",
      "ENTRY %main (p: f32[8], i: pred[]) -> f32[8] {",
      "  %a = f32[8]{0} call(f32[8]{0} %p), to_apply=%shared",
      "  %w = f32[8]{0} while(f32[8]{0} %a), condition=%cond, body=%body, "
      'backend_config={"known_trip_count":{"n":"3"}}',
      "  ROOT %k = f32[8]{0} conditional(pred[] %i, f32[8]{0} %w, f32[8]{0} %w), "
      "true_computation=%twice, false_computation=%none", "}"])
  # one op, in a computation called from 4 sites
  (c,) = jaxaccum.planning.Collectives.from_text(text)
  # Once from ENTRY, 3 times from the loop's body, twice from the true branch.
  assert c.executions == 1 + 3 + 2 and c.conditional and c.loop_depth == 1
  got = jaxaccum.planning.Collectives.from_text(text)
  assert got.max_executions() == 1 + 3 + 2  # the true branch runs more than the false one
  assert str(got).splitlines()[2].split()[-1] == "≤6"
  # Without the conditional every run is certain.
  exact = jaxaccum.planning.Collectives.from_text(text.replace(
      "conditional(pred[] %i, f32[8]{0} %w, f32[8]{0} %w), true_computation=%twice, "
      "false_computation=%none", "call(f32[8]{0} %w), to_apply=%body"))
  assert [(c.executions, c.conditional) for c in exact] == [(1 + 3 + 1, False)]
  assert exact.max_executions() == 5 and "≤" not in str(exact)


# --------------------------------------------------------------- never runs fn


def test_never_runs_fn():
  calls = []

  def count(x):
    calls.append(1)
    return x

  def boom(x):
    raise AssertionError("fn ran")

  def f(x):
    jax.debug.callback(boom, x)
    return jax.pure_callback(count, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2

  x = jnp.ones((8, 2))
  got = jaxaccum.planning.collectives(f, x)
  assert got.count() == 0 and calls == []
  got = jaxaccum.planning.collectives(jax.jit(f), x=x)  # a jitted fn, arguments by keyword
  assert got.count() == 0 and calls == []


def test_lowered_and_compiled_programs_and_keyword_arguments():
  mesh = mesh_of((8,), ("data",))

  def f(x, *, scale):
    return jax.lax.with_sharding_constraint(x * scale, NamedSharding(mesh, P())).sum()

  x = sds((64,), jnp.float32, mesh, P("data"))
  s = sds((), jnp.float32)
  lowered = jax.jit(f).lower(x, scale=s)
  by_fn = jaxaccum.planning.collectives(f, x, scale=s)
  assert by_fn.ops and by_fn == jaxaccum.planning.collectives(lowered)
  assert by_fn == jaxaccum.planning.collectives(lowered.compile())
  text = lowered.compile().as_text()
  assert sum(text_count(text, k) for k in _collectives.KINDS) == by_fn.count()


def test_summary_lists_each_kind_with_its_counts():
  mesh = mesh_of((4, 2), ("data", "fsdp"))

  def body(x, w):
    g = jax.lax.all_gather(w, "fsdp", tiled=True)
    s = jax.lax.fori_loop(0, 2, lambda i, c: jax.lax.psum(c * x, "data"), x)
    return s, g

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("fsdp")),
                            out_specs=(P("data"), P()), check_vma=False))
  got = jaxaccum.planning.collectives(f, sds((16,), jnp.float32, mesh, P("data")),
                             sds((8, 2), jnp.float32, mesh, P("fsdp")))
  text = str(got)
  assert text == got.summary()
  rows = {line.split()[0]: line.split() for line in text.splitlines()[2:]}
  assert set(rows) == {"all-reduce", "all-gather"}
  assert rows["all-reduce"][1:] == ["1", "16", "B", "1", "1", "2"], text
  assert rows["all-gather"][1:] == ["1", "64", "B", "0", "0", "1"], text
  assert text.splitlines()[0].startswith("2 collectives in a program with 1 loop ")
  assert "all-reduce float32[4]" in repr(got) and "loop depth 1" in repr(got)


def test_mesh_axes_from_the_mesh_set_with_set_mesh():
  mesh = mesh_of((2, 4), ("x", "y"), AxisType.Auto)

  def f(a):
    return jax.lax.psum(a, "y")

  g = jax.shard_map(f, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x"), check_vma=False)
  a = np.ones((4, 8), np.float32)  # not placed: the mesh comes from the context
  with jax.set_mesh(mesh):
    got = jaxaccum.planning.collectives(g, a)
  assert [c.mesh_axes for c in got] == [("y",)]


# --------------------------------------------------------------- HLO text spellings


def _module(*lines, header="ENTRY %main (p: f32[8]) -> f32[8] {"):
  return "\n".join(["HloModule m, is_scheduled=true", "", "%add (a: f32[], b: f32[]) -> f32[] {",
                    "  ROOT %s = f32[] add(f32[] %a, f32[] %b)", "}", "", header,
                    *("  " + line for line in lines), "}", ""])


MESH_2x4 = {"a": 2, "b": 4}


@pytest.mark.parametrize("groups, expected, axes", [
    ("{{0,1,2,3},{4,5,6,7}}", ((0, 1, 2, 3), (4, 5, 6, 7)), ("b",)),
    ("{{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7)), ("a",)),
    ("{}", (tuple(range(8)),), ("a", "b")),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7)), ("b",)),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7)), ("a",)),
    ("mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7)), ("a",)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", (tuple(range(8)),), ("a", "b")),
])
def test_replica_group_spellings(groups, expected, axes):
  text = _module(f"ROOT %r = f32[8]{{0}} all-reduce(f32[8]{{0}} %p), channel_id=1, "
                 f"replica_groups={groups}, use_global_device_ids=true, to_apply=%add")
  (c,) = jaxaccum.planning.Collectives.from_text(text, mesh=MESH_2x4)
  assert c.replica_groups == expected and c.mesh_axes == axes and c.groups == groups
  (c,) = jaxaccum.planning.Collectives.from_text(text)  # without a mesh: groups, and named axes
  named = groups.startswith("mesh")
  assert c.mesh_axes == (tuple(re.findall(r"'(\w+)'", groups.split("{")[1])) if named else None)


def test_unread_groups_keep_the_raw_text():
  text = _module("ROOT %r = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups=something new, "
                 "to_apply=%add")
  (c,) = jaxaccum.planning.Collectives.from_text(text, mesh=MESH_2x4)
  assert c.groups == "something new" and c.replica_groups is None and c.mesh_axes is None


def test_async_pairs_count_once_with_the_done_ops_results():
  text = _module(
      "%ars = (f32[], bf16[4,2]{1,0}) all-reduce-start(f32[] %s, bf16[4,2]{1,0} %q), "
      "replica_groups={{0,1}}, to_apply=%add",
      "%ard = (f32[], bf16[4,2]{1,0}) all-reduce-done((f32[], bf16[4,2]{1,0}) %ars)",
      "%ags = (f32[4]{0}, f32[8]{0}) all-gather-start(f32[4]{0} %p), replica_groups={{0,1}}, "
      "dimensions={0}",
      "%agd = f32[8]{0} all-gather-done((f32[4]{0}, f32[8]{0}) %ags), metadata={op_name=\"a(b)\"}",
      "%rss = ((f32[8]{0}), f32[4]{0}) reduce-scatter-start(f32[8]{0} %p), "
      "replica_groups={{0,1}}, dimensions={0}, to_apply=%add",
      "%cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %p), "
      "source_target_pairs={{0,1},{1,0}}",
      "%cpd = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}, u32[], u32[]) %cps)",
      # Whatever else the start's tuple holds, the done op's type is the result.
      "%cps2 = (f32[8]{0}, f32[4]{0}, s32[]) collective-permute-start(f32[8]{0} %p), "
      "source_target_pairs={{0,1}}",
      "%cpd2 = f32[4]{0} collective-permute-done(%cps2)",
      "ROOT %t = (f32[8]{0}) tuple(%agd)")
  got = jaxaccum.planning.Collectives.from_text(text)
  assert [c.kind for c in got] == ["all-reduce", "all-gather", "reduce-scatter",
                                   "collective-permute", "collective-permute"]
  ar, ag, rs, cp, cp2 = got
  assert ar.shape == ((), (4, 2)) and ar.dtype == ("float32", "bfloat16")
  assert ar.bytes == 4 + 4 * 2 * 2
  assert ag.shape == (8,) and ag.bytes == 32  # the done's result, not the start's tuple
  assert rs.shape == (4,) and rs.bytes == 16  # no done: the start's result
  assert cp.shape == (8,) and cp.source_target_pairs == ((0, 1), (1, 0))
  assert cp2.shape == (4,) and cp2.bytes == 16
  assert got.bytes() == ar.bytes + 32 + 16 + 32 + 16


def test_collectives_in_called_computations_and_conditionals():
  text = "\n".join([
      "HloModule m", "",
      "%branch (p: f32[8]) -> f32[8] {",
      "  ROOT %r = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={}, to_apply=%add", "}",
      "%other (p: f32[8]) -> f32[8] {",
      "  ROOT %g = f32[16]{0} all-gather(f32[8]{0} %p), replica_groups={}, dimensions={0}", "}",
      "%dead (p: f32[8]) -> f32[8] {",
      "  ROOT %x = f32[8]{0} all-to-all(f32[8]{0} %p), replica_groups={}", "}",
      "%body (p: f32[8]) -> f32[8] {",
      "  ROOT %c = f32[8]{0} conditional(s32[] %i, f32[8] %p, f32[8] %p), "
      "branch_computations={%branch, %other}", "}",
      "%cond (p: f32[8]) -> pred[] {", "  ROOT %b = pred[] constant(true)", "}",
      "ENTRY %main (p: f32[8]) -> f32[8] {",
      "  ROOT %w = f32[8]{0} while(f32[8]{0} %p), condition=%cond, body=%body", "}"])
  got = jaxaccum.planning.Collectives.from_text(text)
  assert sorted(c.kind for c in got) == ["all-gather", "all-reduce"]  # %dead is not called
  assert all(c.loop_depth == 1 and c.executions is None for c in got)  # no known trip count
  assert "?" in str(got).splitlines()[2]


# --------------------------------------------------------------- bad input


def test_fn_that_is_not_callable():
  with pytest.raises(TypeError, match=r"fn must be a function.*got 3 of type int"):
    jaxaccum.planning.collectives(3, jnp.ones(2))


def test_arguments_that_cannot_be_lowered_are_named():
  def f(w, batch):
    return w * batch["x"]

  with pytest.raises(TypeError, match=r"args\[1\]\['name'\] = 'abc' \(of type str\).*"
                     r"jax.ShapeDtypeStruct"):
    jaxaccum.planning.collectives(f, jnp.ones(2), {"x": jnp.ones(2), "name": "abc"})
  with pytest.raises(TypeError, match=r"kwargs\['w'\] = <object object"):
    jaxaccum.planning.collectives(jax.jit(f), w=object(), batch={"x": jnp.ones(2)})


def test_arguments_with_a_compiled_program():
  compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()
  with pytest.raises(TypeError, match="already a Compiled program"):
    jaxaccum.planning.collectives(compiled, jnp.ones(2))


def test_unknown_kind_and_text_without_entry():
  got = jaxaccum.planning.collectives(lambda x: x, jnp.ones(2))
  with pytest.raises(ValueError, match=r"kind='all_reduce' is not a collective kind.*all-reduce"):
    got.count("all_reduce")
  with pytest.raises(ValueError, match="no ENTRY computation"):
    jaxaccum.planning.Collectives.from_text("not HLO")
  with pytest.raises(TypeError, match="mesh must be"):
    jaxaccum.planning.Collectives.from_text(_module("ROOT %c = f32[8] copy(%p)"), mesh=8)


def test_a_loops_condition_runs_once_more_than_its_body():
  # One while line calls two computations, both with an all-reduce: their runs add up, and
  # the condition, evaluated before every iteration and once more to stop, runs trip + 1
  # times. (jax.lax.while_loop whose predicate sums a sharded array compiles to an
  # all-reduce in the condition, but with no known trip count; hence hand-written text.)
  reduce = ", replica_groups={}, to_apply=%add"
  text = "\n".join([
      "HloModule m", "",
      "%add (a: f32[], b: f32[]) -> f32[] {", "  ROOT %s = f32[] add(f32[] %a, f32[] %b)", "}",
      "%body (p: f32[8]) -> f32[8] {",
      f"  ROOT %b = f32[8]{{0}} all-reduce(f32[8]{{0}} %p){reduce}", "}",
      "%cond (p: f32[8]) -> pred[] {",
      f"  %r = f32[8]{{0}} all-reduce(f32[8]{{0}} %p){reduce}",
      "  %z = f32[] constant(0)",
      "  %m = f32[] reduce(f32[8]{0} %r, f32[] %z), dimensions={0}, to_apply=%add",
      "  ROOT %c = pred[] compare(f32[] %m, f32[] %z), direction=GT", "}",
      "ENTRY %main (p: f32[8]) -> f32[8] {",
      "  ROOT %w = f32[8]{0} while(f32[8]{0} %p), condition=%cond, body=%body, "
      'backend_config={"known_trip_count":{"n":"3"}}', "}"])
  got = jaxaccum.planning.Collectives.from_text(text)
  runs = {c.line.split()[0]: (c.executions, c.loop_depth, c.conditional) for c in got}
  assert runs == {"ROOT": (3, 1, False), "%r": (3 + 1, 1, False)}, runs
  assert got.max_executions() == 3 + (3 + 1) and got.select(in_loop=True).count() == 2
  assert str(got).splitlines()[2].split()[-1] == "7", str(got)
  # Unknown trip count: unknown runs, for either op.
  unknown = jaxaccum.planning.Collectives.from_text(text.replace(
      ', backend_config={"known_trip_count":{"n":"3"}}', ""))
  assert [c.executions for c in unknown] == [None, None] and unknown.max_executions() is None
