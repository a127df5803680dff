"""jaxaccum.value_and_grad and its adapters against the reference model of tests/_reference.py.

Hypothesis draws option combinations (a reduce kind or a dict of loss terms with weights,
aux kinds with float and integer leaves, state, PRNG keys, skip_nonfinite with NaN put in
chosen micro-batches, with_info, active_micro_batches, remat, micro-batches of one row),
runs the jitted library on a tiny model and compares every output, leaf by leaf and dtype
by dtype, with the reference: a plain Python loop over micro-batches sliced by hand
(``x[i::N]``) that applies the documented rules. Smaller draws run the NNX, Linen and
Equinox adapters, and ``data_axis`` on the 8 CPU devices. ``@example`` rows pin the option
combinations that single-point mistakes in the core hide behind (named in each row).

Aux also holds a bool scalar (default ``"all"``, or ``"any"``) and, on one shard, a leaf
reduced by a user-defined ``optax.microbatching.Accumulator`` whose carry is a pytree and
whose update reads the micro-batch index.

Tolerances: float32 against a float64 reference, rtol 1e-5 and atol 1e-5 (entries near
zero are round-off of larger terms that cancel).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests._reference import Rules, reference
from tests._util import scan_lengths

RTOL = ATOL = 1e-5
D_IN, D_OUT = 3, 2
TERM_KINDS = {"mean": "mean", "sum": "sum", "w1": "weighted", "w2": "weighted"}
SINGLE_TERM = {"mean": "mean", "sum": "sum", "weighted": "w1"}
# Aux leaves and the kinds each may be given (None: the default).
AUX_KINDS = {
    "f_mean": (None, "mean", "sum", "max", "min", "stack"),  # float scalar
    "f_sum": (None, "sum", "stack"),  # float scalar
    "i_count": (None, "sum", "mean", "max", "min", "stack"),  # int32 scalar
    "i_max": ("max", "min", "stack"),  # int32 scalar
    "f_vec": ("mean", "sum", "max", "stack"),  # float (2,)
    "rows": ("concat", "stack"),  # float (b, 2): per example
    "i_rows": ("concat",),  # int32 (b,): per example
    "b_flag": (None, "all", "any"),  # bool scalar
    "f_user": ("user",),  # float scalar, reduced by USER_ACC (one shard only)
}


def _user_update(carry, value, index):
  total, by_index = carry
  return total + value, by_index + jnp.asarray(index + 1, value.dtype) * value


# A user reduction: a pytree carry, and an update that reads the micro-batch index.
USER_ACC = optax.microbatching.Accumulator(
    init=lambda s: (jnp.zeros(s.shape, s.dtype), jnp.zeros(s.shape, s.dtype)),
    update=_user_update,
    finalize=lambda carry: 0.5 * carry[0] + carry[1],
    aggregate=lambda x: x)


@dataclasses.dataclass(frozen=True)
class Case:
  """One drawn option combination (hashable: compiled steps are cached by it)."""

  n: int = 4
  rows: int = 2  # per micro-batch (per shard)
  by_size: bool = False  # pass micro_batch_size instead of num_micro_batches
  reduce: Any = "mean"  # a kind, or a tuple of term names (a dict reduce)
  weights: tuple = ()  # (term, weight) pairs
  aux: tuple = ()  # (leaf, kind) pairs
  state: bool = False
  rng: bool = False
  skip: bool = False
  nan: tuple = ()  # micro-batches (of every shard) holding a NaN row
  info: bool = False
  active: int | None = None
  remat: bool = False
  shards: int = 1
  adapter: str = "core"

  @property
  def reduce_option(self):
    return self.reduce if isinstance(self.reduce, str) else {t: TERM_KINDS[t] for t in self.reduce}

  @property
  def loss_weights(self):
    return dict(self.weights) if self.weights else None

  @property
  def aux_reduce(self):
    return {k: USER_ACC if v == "user" else v for k, v in self.aux} if self.aux else None


# --- The loss ---------------------------------------------------------------------------------


def body(w, b, batch, key, state):
  """Every term, the new state and every aux leaf of one micro-batch."""
  x = batch["x"]
  if state is not None:
    x = x - 0.5 * state["mu"]
  if key is not None:
    x = x + 0.1 * jax.random.normal(key, x.shape)
  pred = jnp.tanh(x @ w + b)
  err = jnp.sum((pred - batch["y"]) ** 2, axis=-1)
  terms = {
      "mean": jnp.mean(err),
      "sum": jnp.sum(pred[:, 0] ** 2),
      "w1": (jnp.sum(err * batch["m1"]), jnp.sum(batch["m1"])),
      "w2": (jnp.sum(pred[:, 1] ** 2 * batch["m2"]), jnp.sum(batch["m2"]).astype(jnp.int32)),
  }
  new_state = None if state is None else {
      "mu": 0.8 * state["mu"] + 0.2 * jnp.mean(x, axis=0), "count": state["count"] + 1}
  aux = {
      "f_mean": jnp.mean(err),
      "f_sum": jnp.sum(pred),
      "i_count": jnp.sum(batch["m1"] > 0).astype(jnp.int32),
      "i_max": jnp.max(batch["label"]),
      "f_vec": jnp.mean(pred, axis=0),
      "rows": pred,
      "i_rows": batch["label"],
      "b_flag": jnp.any(batch["m2"] > 0),
      "f_user": jnp.mean(err),
  }
  return terms, new_state, aux


def pack(case: Case, terms, new_state, aux):
  """fun's output for the case: its value form, then state and aux as the options say."""
  if isinstance(case.reduce, str):
    value = terms[SINGLE_TERM[case.reduce]]
  else:
    value = {t: terms[t] for t in case.reduce}
  aux = {k: aux[k] for k, _ in case.aux}
  if case.state and case.aux:
    return value, (new_state, aux)
  if case.state:
    return value, new_state
  if case.aux:
    return value, aux
  return value


def core_fun(case: Case):
  def fun(params, batch, *rest):
    rest = list(rest)
    key = rest.pop(0) if case.rng else None
    state = rest.pop(0) if case.state else None
    return pack(case, *body(params["w"], params["b"], batch, key, state))
  return fun


MAX_ROWS = 4 * 2 * 8  # n * rows * shards at most


@functools.cache
def _pool():
  """Random data for the largest batch drawn, on the host: each case takes its first rows
  (drawn once, so the cases do not run eager random ops for every batch size)."""
  k = jax.random.split(jax.random.key(0), 8)
  return jax.tree.map(np.asarray, {
      "x": jax.random.normal(k[0], (MAX_ROWS, D_IN)),
      "y": jax.random.normal(k[1], (MAX_ROWS, D_OUT)),
      "m1": jax.random.uniform(k[2], (MAX_ROWS,)) < 0.6,
      "m2": jax.random.uniform(k[3], (MAX_ROWS,)) < 0.4,
      "label": jax.random.randint(k[4], (MAX_ROWS,), 0, 7),
      "w": jax.random.normal(k[5], (D_IN, D_OUT)) / 2,
      "mu": jax.random.normal(k[6], (D_IN,)) * 0.1,
  })


def make_data(case: Case):
  pool = _pool()
  size = case.n * case.rows * case.shards
  assert size <= MAX_ROWS, size
  m1, m2 = pool["m1"][:size].copy(), pool["m2"][:size].copy()
  m1[0], m2[-1] = True, True
  x = pool["x"][:size].copy()
  # Local row i of every shard opens its micro-batch i.
  block = size // case.shards
  nan_rows = [d * block + i for d in range(case.shards) for i in case.nan]
  x[nan_rows, 0] = np.nan
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(pool["y"][:size]),
           "m1": jnp.asarray(m1.astype(np.float32)), "m2": jnp.asarray(m2.astype(np.float32)),
           "label": jnp.asarray(pool["label"][:size])}
  params = {"w": jnp.asarray(pool["w"]), "b": jnp.full((D_OUT,), 0.1)}
  args = [params, batch]
  if case.rng:
    args.append(jax.random.key(7))
  if case.state:
    args.append({"mu": jnp.asarray(pool["mu"]), "count": jnp.int32(0)})
  return tuple(args)


def rules(case: Case) -> Rules:
  return Rules(
      num_micro_batches=case.n, reduce=case.reduce_option, loss_weights=case.loss_weights,
      has_aux=bool(case.aux), aux_reduce=case.aux_reduce,
      rng_argnums=(2,) if case.rng else (),
      state_argnum=(3 if case.rng else 2) if case.state else None,
      skip_nonfinite=case.skip, with_info=case.info, active=case.active, shards=case.shards)


def options(case: Case) -> dict[str, Any]:
  count = ({"micro_batch_size": case.rows} if case.by_size else {"num_micro_batches": case.n})
  reduce = (case.reduce_option if case.loss_weights is None else
            jaxaccum.Terms(case.reduce_option, weights=case.loss_weights))
  return dict(count, reduce=reduce,
              has_aux=bool(case.aux), aux_reduce=case.aux_reduce,
              skip_nonfinite=case.skip, with_info=case.info, remat=case.remat)


@functools.cache
def mesh8():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@functools.lru_cache(maxsize=64)
def core_step(case: Case):
  """The jitted library step for the case's options (its data does not matter)."""
  case = dataclasses.replace(case, nan=())
  extra: dict[str, Any] = {}
  if case.rng:
    extra["rng_argnums"] = 2
  if case.state:
    extra["state_argnums"] = 3 if case.rng else 2
  if case.shards > 1:
    extra.update(data_axis=jaxaccum.DataParallel("data", mesh=mesh8()))
  f = jaxaccum.value_and_grad(core_fun(case), **options(case), **extra)
  return jax.jit(lambda args, k: f(*args, active_micro_batches=k))


def call_step(step, case: Case, args):
  return step(args, None if case.active is None else jnp.int32(case.active))


def compare(out, ref, case: Case):
  chex.assert_trees_all_close(out, ref, rtol=RTOL, atol=ATOL)
  chex.assert_trees_all_equal_dtypes(out, ref)


def check_core(case: Case):
  args = make_data(case)
  if case.shards > 1:
    mesh = mesh8()
    args = (jax.device_put(args[0], NamedSharding(mesh, P())),
            jax.device_put(args[1], NamedSharding(mesh, P("data"))),
            *jax.device_put(args[2:], NamedSharding(mesh, P())))
  out = call_step(core_step(case), case, args)
  compare(out, reference(core_fun(case), make_data(case), rules(case)), case)


# --- What is drawn --------------------------------------------------------------------------


@st.composite
def cases(draw, *, shards=1, adapter="core"):
  n = draw(st.sampled_from([1, 2, 3, 4]))
  rows = draw(st.sampled_from([1, 2]))
  reduce = draw(st.one_of(
      st.sampled_from(["mean", "sum", "weighted"]),
      st.lists(st.sampled_from(sorted(TERM_KINDS)), min_size=2, max_size=4,
               unique=True).map(lambda ts: tuple(sorted(ts)))))
  weights = ()
  if not isinstance(reduce, str) and draw(st.booleans()):
    weights = tuple((t, draw(st.sampled_from([0.5, 2.0, 3.0]))) for t in reduce
                    if draw(st.booleans()))
  names = sorted(k for k in AUX_KINDS if shards == 1 or "user" not in AUX_KINDS[k])
  leaves = draw(st.lists(st.sampled_from(names), max_size=4, unique=True))
  aux = tuple((k, draw(st.sampled_from(AUX_KINDS[k]))) for k in sorted(leaves))
  skip = draw(st.booleans())
  nan = tuple(sorted(draw(st.sets(st.integers(0, n - 1), max_size=n)))) if skip else ()
  active = draw(st.one_of(st.none(), st.integers(1, n)))
  return Case(
      n=n, rows=rows, by_size=draw(st.booleans()), reduce=reduce, weights=weights, aux=aux,
      state=draw(st.booleans()), rng=draw(st.booleans()), skip=skip, nan=nan,
      info=draw(st.booleans()), active=active, remat=draw(st.booleans()), shards=shards,
      adapter=adapter)


# Each row pins what one single-point mistake in the core would change.
MUTANT_ROWS = [
    # info.num_micro_batches counts the skipped micro-batches too; a skipped micro-batch
    # leaves out its flag and a user reduction's update (which reads micro-batch indices).
    Case(n=4, skip=True, nan=(1,), info=True, aux=(("b_flag", "any"), ("f_user", "user"))),
    Case(n=4, rows=1, aux=(("b_flag", None), ("f_user", "user")), active=3),
    # Under reduce="sum", G_B divides by the rows of every kept micro-batch.
    Case(n=4, reduce="sum", info=True),
    # Mean terms folded into the sum group divide by the micro-batches that ran...
    Case(n=4, reduce=("mean", "sum"), active=2),
    # ... and are not folded under skip_nonfinite, where the count is known after the loop.
    Case(n=4, reduce=("mean", "sum"), skip=True, nan=(2,)),
    # Each weighted term divides by its own total denominator.
    Case(n=4, reduce=("w1", "w2"), weights=(("w2", 2.0),)),
    Case(n=2, rows=1, reduce=("mean", "w1", "w2"), aux=(("f_mean", None),), skip=True,
         nan=(0,), info=True),
    # Every micro-batch skipped; micro-batches of one row; stacked zeros past k.
    Case(n=3, rows=1, reduce="weighted", aux=(("f_mean", None), ("rows", "concat")),
         skip=True, nan=(0, 1, 2), info=True),
    Case(n=4, rows=1, by_size=True, aux=(("i_count", None), ("f_vec", "stack"),
                                          ("i_rows", "concat")), state=True, rng=True,
         active=3, remat=True),
]


def with_examples(rows):
  def deco(f):
    for row in reversed(rows):
      f = example(case=row)(f)
    return f
  return deco


@settings(deadline=None, derandomize=True, max_examples=12)
@given(case=cases())
@with_examples(MUTANT_ROWS)
def test_core_matches_the_reference_model(case):
  check_core(case)


# --- data_axis on 8 devices -----------------------------------------------------------------


@settings(deadline=None, derandomize=True, max_examples=1)  # 8 devices: a compile costs most
@given(case=cases(shards=8).map(lambda c: dataclasses.replace(c, by_size=False)))
@with_examples([
    # Mean terms folded into the sum group divide by the micro-batches of every shard;
    # info.num_micro_batches counts the micro-batches run on every shard (k * D).
    Case(n=2, rows=1, reduce=("mean", "sum", "w1"), aux=(("b_flag", None),), active=1,
         info=True, shards=8),
    Case(n=2, reduce=("mean", "w1"), aux=(("b_flag", "any"), ("f_mean", None),
                                          ("rows", "concat"), ("f_vec", "stack")),
         state=True, rng=True, skip=True, nan=(1,), info=True, shards=8),
])
def test_data_axis_matches_the_reference_model(case):
  check_core(case)


# --- The adapters -----------------------------------------------------------------------------


def _split_params(case: Case, args):
  """(params, batch, key or None, state or None) of the core's argument layout."""
  params, batch, *rest = args
  key = rest.pop(0) if case.rng else None
  state = rest.pop(0) if case.state else None
  return params, batch, key, state


def run_nnx(case: Case, args):
  from flax import nnx  # noqa: PLC0415 (an optional extra)

  params, batch, key, state = _split_params(case, args)

  class Tiny(nnx.Module):
    def __init__(self):
      self.w, self.b = nnx.Param(params["w"]), nnx.Param(params["b"])
      if state is not None:
        self.mu, self.count = nnx.BatchStat(state["mu"]), nnx.BatchStat(state["count"])

  def fun(model, batch, *key):
    st_in = {"mu": model.mu[...], "count": model.count[...]} if case.state else None
    terms, new_state, aux = body(model.w[...], model.b[...], batch, key[0] if key else None,
                                 st_in)
    if case.state:
      model.mu[...], model.count[...] = new_state["mu"], new_state["count"]
    return pack(dataclasses.replace(case, state=False), terms, None, aux)

  model = Tiny()
  f = jaxaccum.nnx.value_and_grad(fun, **options(case), **(
      {"rng_argnums": 2} if case.rng else {}))
  step = nnx.jit(lambda m, b, *k, active: f(m, b, *k, active_micro_batches=active))
  out = step(model, batch, *([key] if case.rng else []),
             active=None if case.active is None else jnp.int32(case.active))
  grads = nnx.to_pure_dict(out[1])
  # The core's layout: the threaded state comes back in the aux position.
  value = out[0]
  if case.state:
    new_state = {"mu": model.mu[...], "count": model.count[...]}
    value = (value[0], (new_state, value[1])) if case.aux else (value, new_state)
  return (value, grads, *out[2:])


def run_linen(case: Case, args):
  """Linen's layout: fun(params, batch, model_state, rngs), the state always threaded."""
  params, batch, key, state = _split_params(case, args)
  model_state = {"stats": state}
  rngs = {"dropout": key} if case.rng else {}

  def fun(params, batch, model_state, rngs):
    terms, new_state, aux = body(params["w"], params["b"], batch, rngs.get("dropout"),
                                 model_state["stats"])
    return pack(case, terms, {"stats": new_state}, aux)

  f = jaxaccum.linen.value_and_grad(fun, **options(case))
  step = jax.jit(lambda *a, k: f(*a, active_micro_batches=k))
  out = step(params, batch, model_state, rngs,
             k=None if case.active is None else jnp.int32(case.active))
  (value, extra), grads, *info = out
  if case.aux:
    extra = (extra[0]["stats"], extra[1])
  else:
    extra = extra["stats"]
  return ((value, extra), grads, *info)


def run_eqx(case: Case, args):
  import equinox as eqx  # noqa: PLC0415 (an optional extra)

  params, batch, key, _ = _split_params(case, args)

  class Tiny(eqx.Module):
    w: jax.Array
    b: jax.Array
    act: Any = eqx.field(static=True, default=jnp.tanh)  # a static field: not differentiated

  def fun(model, batch, *key):
    terms, _, aux = body(model.w, model.b, batch, key[0] if key else None, None)
    return pack(case, terms, None, aux)

  f = jaxaccum.eqx.filter_value_and_grad(fun, **options(case),
                                         **({"rng_argnums": 2} if case.rng else {}))
  step = eqx.filter_jit(lambda m, b, *k, active: f(m, b, *k, active_micro_batches=active))
  out = step(Tiny(params["w"], params["b"]), batch, *([key] if case.rng else []),
             active=None if case.active is None else jnp.int32(case.active))
  return (out[0], {"w": out[1].w, "b": out[1].b}, *out[2:])


ADAPTERS = {"nnx": run_nnx, "linen": run_linen, "eqx": run_eqx}


def check_adapter(case: Case):
  if case.adapter == "linen":
    case = dataclasses.replace(case, state=True)  # Linen threads model_state always
  if case.adapter == "eqx":
    case = dataclasses.replace(case, state=False)  # eqx.nn.State: tests/adapters/test_eqx.py
  args = make_data(case)
  out = ADAPTERS[case.adapter](case, args)
  compare(out, reference(core_fun(case), args, rules(case)), case)


@settings(deadline=None, derandomize=True, max_examples=3)
@given(case=st.sampled_from(sorted(ADAPTERS)).flatmap(lambda a: cases(adapter=a)))
@with_examples([
    Case(n=4, reduce=("mean", "sum"), aux=(("i_count", None), ("rows", "concat")),
         state=True, rng=True, skip=True, nan=(2,), info=True, adapter="nnx"),
    Case(n=2, rows=1, reduce="weighted", aux=(("f_mean", None),), rng=True, active=1,
         adapter="linen"),
    Case(n=4, reduce=("w1", "w2"), aux=(("f_vec", "stack"),), rng=True, info=True,
         remat=True, adapter="eqx"),
])
def test_adapters_match_the_reference_model(case):
  check_adapter(case)


# --- NoiseScale and the pipeline's schedule ---------------------------------------------------


def test_noise_scale_leaves_out_a_step_whose_trace_estimate_alone_overflows():
  ns = jaxaccum.NoiseScale(decay=0.5)

  def info(b, big, micro_sq, batch_sq):
    return jaxaccum.AccumInfo(
        num_micro_batches=jnp.int32(big // b), micro_batch_size=jnp.float32(b),
        batch_size=jnp.float32(big), micro_grad_sq_norm=jnp.float32(micro_sq),
        batch_grad_sq_norm=jnp.float32(batch_sq), num_samples=jnp.int32(big // b),
        skipped=jnp.int32(0))

  # |G|^2 = (B |G_B|^2 - b |G_b|^2) / (B - b), tr = (|G_b|^2 - |G_B|^2) / (1/b - 1/B):
  # b = 8, B = 32, |G_b|^2 = 3, |G_B|^2 = 1.5 give 1 and 16; the EMAs hold half of each.
  good = ns.update(ns.init(), info(8, 32, 3.0, 1.5))
  chex.assert_trees_all_close(tuple(good), (1, 0.5 * 1.0, 0.5 * 16.0))
  # b = 2, B = 4, |G_b|^2 = 1e38: |G|^2 is -1e38 (finite), tr(Sigma) 4e38 (not in float32).
  huge = info(2, 4, 1e38, 0.0)
  assert np.isfinite(huge.grad_sq_norm_estimate())
  assert not np.isfinite(huge.trace_cov_estimate())
  chex.assert_trees_all_equal(tuple(ns.update(good, huge)), tuple(good))


@pytest.mark.parametrize(("s", "m", "r"), [(4, 3, 1), (4, 6, 1), (8, 2, 1), (4, 4, 2)])
def test_pipeline_forward_scan_runs_the_schedules_ticks(s, m, r):
  """The forward scan has one tick per row of pipeline_schedule (M + S - 1 for GPipe)."""
  mesh = jax.make_mesh((s,), ("stage",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:s])
  pipe = jaxaccum.contrib.pipeline(lambda w, x: x + jnp.tanh(x @ w), num_micro_batches=m,
                           mesh=mesh, num_repeats=r)
  lead = (s,) if r == 1 else (r, s)
  w = jax.device_put(np.zeros((*lead, 4, 4), np.float32),
                     NamedSharding(mesh, P("stage") if r == 1 else P(None, "stage")))
  x = jax.device_put(np.zeros((2 * m, 4), np.float32), NamedSharding(mesh, P()))
  ticks = len(jaxaccum.contrib.pipeline_schedule(s, m, num_repeats=r))
  assert scan_lengths(jax.make_jaxpr(pipe)(w, x).jaxpr) == [ticks]
  if r == 1:
    assert ticks == m + s - 1
