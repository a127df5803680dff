"""Bad input gets a clear ValueError/TypeError naming the argument, the value and the fix."""

import re

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxaccum


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


W = jnp.ones(3)
BATCH = (jnp.ones((12, 3)), jnp.ones(12))


def call(fun=loss, args=(W, BATCH), **options):
  options.setdefault("num_micro_batches", 2)
  return jax.jit(jaxaccum.value_and_grad(fun, **options))(*args)


def test_batch_size_not_divisible_lists_valid_counts():
  with pytest.raises(ValueError, match=re.escape(
      "batch size 12 is not divisible by num_micro_batches=5. Valid counts near it: 3, 4, 6, "
      "12 (all divisors of 12: 1, 2, 3, 4, 6, 12)")):
    call(num_micro_batches=5)
  with pytest.raises(ValueError, match="not divisible by micro_batch_size=5. Valid sizes"):
    call(num_micro_batches=None, micro_batch_size=5)


def test_leaves_with_different_leading_sizes_are_named():
  batch = {"x": jnp.ones((12, 3)), "y": jnp.ones(10)}
  with pytest.raises(ValueError, match=re.escape(
      "leading sizes differ: 12 at argument 1 ('b')['x']; 10 at argument 1 ('b')['y']")):
    call(fun=lambda w, b: jnp.mean(b["x"] @ w), args=(W, batch))
  with pytest.raises(ValueError, match=r"12 at argument 1 \('b'\)\[0\], argument 1 "
                     r"\('b'\)\[1\]; 6 at argument 2 \('c'\)"):
    call(fun=lambda w, b, c: jnp.mean(b[0] @ w) + jnp.mean(c), args=(W, BATCH, jnp.ones(6)),
         batch_argnums=(1, 2))


@pytest.mark.parametrize("options", [{}, {"num_micro_batches": 2, "micro_batch_size": 6}])
def test_exactly_one_count(options):
  opts = {"num_micro_batches": None, **options}
  with pytest.raises(ValueError, match="pass exactly one of num_micro_batches and "
                     "micro_batch_size, got num_micro_batches="):
    jaxaccum.value_and_grad(loss, **opts)


@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_count(bad):
  with pytest.raises(ValueError, match=f"num_micro_batches must be a positive integer, got "
                     f"num_micro_batches={bad}"):
    jaxaccum.value_and_grad(loss, num_micro_batches=bad)
  with pytest.raises(ValueError, match=f"micro_batch_size={bad}"):
    jaxaccum.value_and_grad(loss, micro_batch_size=bad)


@pytest.mark.parametrize("bad", [2.0, "4", True, jnp.int32(2)])
def test_non_integer_count(bad):
  with pytest.raises(TypeError, match="num_micro_batches must be a positive Python int, got"):
    jaxaccum.value_and_grad(loss, num_micro_batches=bad)


def test_unknown_reduce():
  with pytest.raises(ValueError, match="reduce must be one of 'mean', 'sum', 'weighted', or a "
                     "dict of them for a loss of several terms, got "
                     "reduce='avg'"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, reduce="avg")


def test_weighted_needs_numerator_and_denominator():
  with pytest.raises(TypeError, match=r"reduce='weighted' needs fun to return its value as "
                     r"\(numerator, denominator\).*got an array of shape \(\) and dtype float32"):
    call(reduce="weighted")
  with pytest.raises(TypeError, match=r"with aux as \(\(numerator, denominator\), aux\)"):
    call(fun=lambda w, b: (loss(w, b), {}), reduce="weighted", has_aux=True)


def test_weighted_parts_must_be_scalars():
  def vector_den(w, b):
    return jnp.sum(b[0] @ w), jnp.ones(2)

  with pytest.raises(TypeError, match=r"the denominator of reduce='weighted' must be a scalar"):
    call(fun=vector_den, reduce="weighted")


def test_non_scalar_loss():
  with pytest.raises(TypeError, match=r"the value returned by fun must be a scalar \(the loss "
                     r"mean\), got an array of shape \(6,\).*jnp.mean"):
    call(fun=lambda w, b: (b[0] @ w - b[1]) ** 2)


def test_integer_loss():
  with pytest.raises(TypeError, match="must have a floating dtype to be differentiated"):
    call(fun=lambda w, b: jnp.sum(b[1]).astype(jnp.int32) + 0 * w.sum().astype(jnp.int32))


def test_has_aux_mismatch():
  with pytest.raises(TypeError, match=r"fun must return \(value, aux\) because has_aux=True"):
    call(has_aux=True)


@pytest.mark.parametrize("kw,value", [("argnums", 3), ("batch_argnums", 2),
                                      ("batch_argnums", -3)])
def test_argnums_out_of_range(kw, value):
  with pytest.raises(ValueError, match=re.escape(
      f"{kw}={value} is out of range: the function was called with 2 positional argument(s), "
      "so valid indices are 0..1")):
    call(**{kw: value})


def test_argnums_overlapping():
  with pytest.raises(ValueError, match=re.escape(
      "argnums=(1,) and batch_argnums=(1,) overlap at argument(s) [1]")):
    call(argnums=1)
  with pytest.raises(ValueError, match=re.escape(
      "batch_argnums=(1,) and rng_argnums=(1,) overlap")):
    call(rng_argnums=1)


@pytest.mark.parametrize("bad", [(0, 0), "1", 1.5, None, ()])
def test_argnums_wrong_type(bad):
  with pytest.raises((TypeError, ValueError), match="batch_argnums"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, batch_argnums=bad)


def test_batch_leaf_without_batch_axis():
  batch = {"x": jnp.ones((12, 3)), "temperature": jnp.float32(2.0)}
  with pytest.raises(ValueError, match=re.escape(
      "batch leaf argument 1 ('b')['temperature'] is a scalar (shape ()), so it has no batch")):
    call(fun=lambda w, b: jnp.mean(b["x"] @ w) * b["temperature"], args=(W, batch))


def test_rng_argument_must_be_a_key():
  with pytest.raises(TypeError, match=r"rng_argnums names argument 2 \('k'\), but its leaf "
                     r"\(root\) is "
                     r"an array of shape \(\) and dtype float32, not a single PRNG key"):
    call(fun=lambda w, b, k: loss(w, b), args=(W, BATCH, jnp.float32(0)), rng_argnums=2)
  with pytest.raises(TypeError, match=r"is an array of shape \(3,\) and dtype key<fry>, not a "
                     r"single PRNG key.*no need to split it"):
    call(fun=lambda w, b, k: loss(w, b), args=(W, BATCH, jax.random.split(jax.random.key(0), 3)),
         rng_argnums=2)
  with pytest.raises(TypeError, match=r"shape \(5,\) and dtype uint32, not a single PRNG key"):
    call(fun=lambda w, b, k: loss(w, b), args=(W, BATCH, jnp.zeros(5, jnp.uint32)), rng_argnums=2)


def test_unreducible_aux_and_bad_unroll():
  with pytest.raises(TypeError, match=r"aux leaf \['key'\] has dtype key<fry>, which cannot be "
                     r"reduced with aux_reduce 'mean'. Mark it aux_reduce='stack'"):
    call(fun=lambda w, b, k: (loss(w, b), {"key": k}), args=(W, BATCH, jax.random.key(0)),
         has_aux=True)
  with pytest.raises(TypeError, match="unroll must be a positive int or a bool"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, unroll="a")


def test_state_must_keep_its_structure_and_shape():
  def bad_state(w, b, s):
    return loss(w, b), {"mean": s["mean"], "extra": 1.0}

  with pytest.raises(TypeError, match="the new state returned by fun for state argument 2 "
                     "\\('s'\\) has "
                     "structure"):
    call(fun=bad_state, args=(W, BATCH, {"mean": jnp.zeros(3)}), state_argnums=2)

  def bad_shape(w, b, s):
    return loss(w, b), {"mean": jnp.zeros(4)}

  with pytest.raises(TypeError, match=re.escape(
      "the new state leaf ['mean'] of state argument 2 ('s') is an array of shape (4,)")):
    call(fun=bad_shape, args=(W, BATCH, {"mean": jnp.zeros(3)}), state_argnums=2)

  with pytest.raises(TypeError, match=r"fun must return \(value, new_state\) because "
                     "state_argnums is set"):
    call(args=(W, BATCH, {"mean": jnp.zeros(3)}), fun=lambda w, b, s: loss(w, b),
         state_argnums=2)


def test_bad_aux_reduce():
  with pytest.raises(ValueError, match="aux_reduce must be one of 'mean', 'sum', 'max', 'min', "
                     "'all', 'any', 'stack', 'concat' or a pytree prefix"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, has_aux=True, aux_reduce="median")
  with pytest.raises(ValueError, match=r"aux_reduce='sum' was given but has_aux=False"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, aux_reduce="sum")
  with pytest.raises(ValueError, match="aux_reduce entries must be one of"):
    call(fun=lambda w, b: (loss(w, b), {"a": w}), has_aux=True, aux_reduce={"a": "median"})
  with pytest.raises(ValueError, match="aux_reduce must be a string or a pytree prefix of the "
                     "aux"):
    call(fun=lambda w, b: (loss(w, b), {"a": w}), has_aux=True, aux_reduce={"b": "sum"})


def test_bad_dtype_and_remat_options():
  with pytest.raises(TypeError, match="accumulator_dtype must be a floating dtype"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, accumulator_dtype=jnp.int32)
  with pytest.raises(TypeError, match="remat must be a bool"):
    jaxaccum.value_and_grad(loss, num_micro_batches=2, remat="yes")
  with pytest.raises(TypeError, match="fun must be callable"):
    jaxaccum.value_and_grad(3, num_micro_batches=2)


def test_batch_argument_without_arrays():
  with pytest.raises(ValueError, match=r"the batch argument 1 \('b'\) has no array leaves, "
                     r"got dict \{\}"):
    call(fun=lambda w, b: jnp.sum(w), args=(W, {}))


@pytest.mark.parametrize("roles, message", [
    ({"argnums": 1}, "argnums=(1,) and batch_argnums=(1,) overlap at argument(s) [1]"),
    ({"argnums": (0, 2), "batch_argnums": (1, 2)},
     "argnums=(0, 2) and batch_argnums=(1, 2) overlap at argument(s) [2]"),
    ({"rng_argnums": 1}, "batch_argnums=(1,) and rng_argnums=(1,) overlap at argument(s) [1]"),
    ({"state_argnums": -1, "batch_argnums": -1},
     "batch_argnums=(-1,) and state_argnums=(-1,) overlap at argument(s) [-1]"),
    ({"argnums": 2, "rng_argnums": 2}, "argnums=(2,) and rng_argnums=(2,) overlap"),
])
def test_overlapping_roles_raise_when_the_transform_is_built(roles, message):
  """As the docstring says: bad options raise at construction, no call needed."""
  for build in (jaxaccum.value_and_grad, jaxaccum.grad):
    with pytest.raises(ValueError, match=re.escape(message)):
      build(loss, num_micro_batches=2, **roles)
  with pytest.raises(ValueError, match=re.escape(message)):
    jaxaccum.local_value_and_grad(loss, data_axis="data", num_micro_batches=2, **roles)
  if "state_argnums" not in roles:  # its own options, also without micro-batches
    with pytest.raises(ValueError, match=re.escape(message)):
      jaxaccum.local_value_and_grad(loss, data_axis="data", **roles)


def test_overlap_known_only_at_the_call():
  """argnums=-1 and batch_argnums=1 name one argument only when the call has two."""
  fn = jaxaccum.value_and_grad(loss, num_micro_batches=2, argnums=-1)  # builds
  with pytest.raises(ValueError, match=re.escape(
      "argnums=(1,) and batch_argnums=(1,) overlap at argument(s) [1]")):
    fn(W, BATCH)
  mesh = jax.make_mesh((8,), ("data",))
  fn = jaxaccum.local_value_and_grad(loss, data_axis=jaxaccum.DataParallel("data", mesh=mesh),
                                     argnums=-1)
  with pytest.raises(ValueError, match=re.escape(
      "argnums=(1,) and batch_argnums=(1,) overlap at argument(s) [1]")):
    fn(W, BATCH)
  # The default batch argument with batch_argnames applies only where it has no other role.
  fn = jaxaccum.value_and_grad(lambda w, v, *, batch: loss(w + v, batch), num_micro_batches=2,
                               argnums=1, batch_argnames="batch")
  value, grads = fn(W, jnp.zeros(3), batch=BATCH)
  expected = jax.value_and_grad(lambda v: loss(W + v, BATCH))(jnp.zeros(3))
  chex.assert_trees_all_close((value, grads), expected, rtol=1e-6)
