"""The NNX adapter resolves argument roles with the core's resolver (``Options.roles``).

Over generated layouts (``batch_argnums``, ``batch_argnames``, ``rng_argnums``, the number of
positional arguments of a call), the roles that ``jaxaccum.nnx`` resolves in ``fun``'s
positions, and those that its core resolves with the threaded state appended (shifted
positions, ``state_argnums=-1``), both equal a small reference written here.
"""

import hypothesis
import hypothesis.strategies as st
import pytest
from flax import nnx

import jaxaccum
from jaxaccum._core import _options


class Empty(nnx.Module):
  pass


def reference(nargs, batch, default, names, rng):
  """``(batch, rng)`` positions of a call with ``nargs`` positional arguments (the model is
  argument 0), or None where the call (or the transform) must be refused."""
  if 0 in batch and not (default and names) or 0 in rng:
    return None  # the model is never split nor folded
  if not (default and names) and set(batch) & set(rng):
    return None  # same position twice, refused when the transform is built
  if any(not -nargs <= j < nargs for j in rng):
    return None
  rng = tuple(j % nargs for j in rng)
  if default and names:  # the default argument 1 is the batch only where it is passed, free
    batch = (1,) if nargs > 1 and 1 not in rng else ()
  else:
    if any(not -nargs <= j < nargs for j in batch):
      return None
    batch = tuple(j % nargs for j in batch)
  if set(batch) & set(rng) or 0 in batch + rng:
    return None
  return batch, rng


positions = st.lists(st.integers(-5, 4), max_size=3, unique=True).map(tuple)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(nargs=st.integers(1, 5), batch=positions, default=st.booleans(),
                  names=st.sampled_from(((), ("a",), ("a", "b"))), rng=positions)
def test_nnx_roles_equal_core_roles_and_reference(nargs, batch, default, names, rng):
  if default:
    batch = (1,)
  if not batch and not names:
    batch = (1,)  # the core refuses a layout without a batch; not about positions
  expected = reference(nargs, batch, default, names, rng)
  options = dict(num_micro_batches=1, batch_argnames=names or None, rng_argnums=rng)
  if not default:
    options["batch_argnums"] = batch
  try:
    vg = jaxaccum.nnx.value_and_grad(lambda *args, **kwargs: 0.0, **options)
  except ValueError:
    assert expected is None, (nargs, batch, default, names, rng)
    return
  args = (Empty(), *range(1, nargs))
  kwargs = {k: 0 for k in names}

  if expected is None:
    with pytest.raises(ValueError):
      vg._check_call(args, kwargs)
    with pytest.raises(ValueError):
      vg.core.options.roles.resolve(nargs + 1, kwargs)  # the core refuses the shifted positions too
    return
  roles = vg.options.roles.resolve(nargs, kwargs)
  assert (roles.batch, roles.rng) == expected
  assert vg._check_call(args, kwargs) == expected[0] + expected[1]
  core = vg.core.options.roles.resolve(nargs + 1, kwargs)  # fun's arguments, then the state
  assert (core.diff, core.batch, core.rng, core.state) == ((0,), *expected, (nargs,))
  assert core.batch_names == tuple(names)


def test_appended_state_shifts_only_negative_positions():
  opts = jaxaccum.value_and_grad(lambda p, x, k: 0.0, num_micro_batches=1,
                                 batch_argnums=(1, -3), rng_argnums=-1).options
  shifted = opts.with_appended_state().roles
  assert (shifted.argnums, shifted.batch_argnums, shifted.rng_argnums, shifted.state_argnums
          ) == ((0,), (1, -4), (-2,), (-1,))
  assert shifted.batch_optional is opts.roles.batch_optional and not shifted.state_is_tuple
  assert _options.BATCH_ARGNUMS == 1
