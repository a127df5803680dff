"""jaxaccum.contrib.place_active_rows and RowFeeder: every row of a stream runs exactly once while k
changes, and each step's gradient is the full-batch gradient over exactly its fresh rows.

The rows that ran are read back by hand (``batch[i::N]`` for ``i < k``), never with the
library's split; each row carries an id.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum

N, B = 4, 2  # micro-batches per batch, rows per micro-batch
KS = (1, 3, 4, 2, 4, 1)  # the run's k per step: sum(KS) * B = 30 rows
ROWS = sum(KS) * B


def _stream(total=ROWS):
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(total, 3)).astype(np.float32),
          "y": rng.normal(size=(total,)).astype(np.float32),
          "id": np.arange(total, dtype=np.int32)}


def _loss(w, batch):
  # A row with id 0 must count too: the id takes no part in the loss.
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


_vg = jaxaccum.value_and_grad(_loss, num_micro_batches=N)


@jax.jit
@chex.assert_max_traces(n=1)
def _step(w, batch, k):
  return _vg(w, batch, active_micro_batches=k)


_full = jax.jit(jax.value_and_grad(_loss))


def _ran(batch, k, n=N):
  """The rows micro-batches 0..k-1 hold, by hand: rows i, i + n, ... of micro-batch i."""
  return {key: np.concatenate([np.asarray(v)[i::n] for i in range(k)]) for key, v in
          batch.items()}


@pytest.mark.parametrize("source", ["array", "iterator"])
@pytest.mark.parametrize("fill", ["zeros", "repeat"])
def test_every_row_runs_once_and_the_gradient_is_the_full_batch_of_those_rows(source, fill):
  stream = _stream()
  rows = stream if source == "array" else (
      {key: v[r] for key, v in stream.items()} for r in range(ROWS))
  feeder = jaxaccum.contrib.RowFeeder(rows, num_micro_batches=N, micro_batch_size=B, fill=fill)
  w = jnp.array([0.5, -1.0, 2.0])
  seen, start = [], 0
  for k in KS:
    batch = feeder.next_batch(k)
    assert all(np.shape(v)[0] == N * B for v in batch.values())
    assert all(isinstance(v, np.ndarray) for v in batch.values())
    ran = _ran(batch, k)
    seen.append(ran["id"])
    fresh = {key: v[start:start + k * B] for key, v in stream.items()}
    # The rows that run are exactly the next k * B of the stream.
    assert sorted(ran["id"]) == list(range(start, start + k * B))
    value, grads = _step(w, batch, jnp.int32(k))
    chex.assert_trees_all_close((value, grads), _full(w, fresh), rtol=1e-5, atol=1e-6)
    inactive = np.asarray(batch["id"]).reshape(B, N)[:, k:]
    if fill == "zeros":
      assert not inactive.any() and not np.asarray(batch["x"]).reshape(B, N, 3)[:, k:].any()
    else:  # filler repeats this step's own rows, never later ones
      assert set(inactive.ravel()) <= set(ran["id"])
    start += k * B
    w = w - 0.1 * grads
  ids = np.concatenate(seen)
  assert len(ids) == ROWS and sorted(ids) == list(range(ROWS))  # none missed, none twice
  assert feeder.position == ROWS
  with pytest.raises(StopIteration, match="the step needs 2|the stream ended after 30 rows"):
    feeder.next_batch(1)


def test_controller_driven_run_uses_every_row_once_and_resumes_at_its_position():
  # k from an AdaptiveBatch (it grows on this noisy problem), read on the host each step.
  n, b = 8, 2
  stream = _stream(400)
  ab = jaxaccum.contrib.AdaptiveBatch(n, theta=0.5, warmup_steps=1, cooldown_steps=0)
  vg = jaxaccum.value_and_grad(_loss, num_micro_batches=n, with_info=True)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(w, state, batch):
    _, grads, info = vg(w, batch, active_micro_batches=ab.micro_batches(state))
    return w - 0.05 * grads, ab.update(state, info)

  feeder = jaxaccum.contrib.RowFeeder(stream, num_micro_batches=n, micro_batch_size=b)
  # From the least-squares fit the gradient is mostly noise: B_simple is large, k grows.
  w = jnp.asarray(np.linalg.lstsq(stream["x"], stream["y"], rcond=None)[0])
  state, ids, ks = ab.init(), [], []
  for t in range(12):
    if t == 6:  # resume from the saved position: a new feeder continues the stream
      feeder = jaxaccum.contrib.RowFeeder(stream, num_micro_batches=n, micro_batch_size=b,
                                  position=feeder.position)
    k = int(ab.micro_batches(state))
    ks.append(k)
    batch = feeder.next_batch(k)
    ids.append(_ran(batch, k, n)["id"])
    w, state = step(w, state, batch)
  ids = np.concatenate(ids)
  assert len(set(ks)) > 1, ks  # k did change
  assert sorted(ids) == list(range(sum(ks) * b))  # each row once, none skipped
  assert feeder.position == sum(ks) * b == ab.sample_count(state)


def test_place_active_rows_layout():
  rows = np.arange(1, 7)
  # k = 2 of N = 3, b = 3: micro-batch 0 holds rows[0::2], micro-batch 1 rows[1::2].
  placed = jaxaccum.contrib.place_active_rows(rows, num_micro_batches=3, active_micro_batches=2)
  np.testing.assert_array_equal(placed, [1, 2, 0, 3, 4, 0, 5, 6, 0])
  np.testing.assert_array_equal(placed[0::3], rows[0::2])
  np.testing.assert_array_equal(placed[1::3], rows[1::2])
  repeat = jaxaccum.contrib.place_active_rows(rows, num_micro_batches=3, active_micro_batches=2,
                                      fill="repeat")
  np.testing.assert_array_equal(repeat, [1, 2, 1, 3, 4, 3, 5, 6, 5])
  # k = N: the batch is the rows themselves; JAX input stays JAX, trailing axes kept.
  x = jnp.arange(24.0).reshape(8, 3)
  same = jaxaccum.contrib.place_active_rows(x, num_micro_batches=4, active_micro_batches=4)
  assert isinstance(same, jax.Array)
  np.testing.assert_array_equal(same, x)
  k1 = jaxaccum.contrib.place_active_rows({"a": x[:2]}, num_micro_batches=4,
                                  active_micro_batches=np.int64(1))
  np.testing.assert_array_equal(k1["a"][::4], x[:2])
  assert k1["a"].shape == (8, 3) and not np.asarray(k1["a"]).reshape(2, 4, 3)[:, 1:].any()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"active_micro_batches": 5}, ValueError,
     "active_micro_batches must be at least 1 and at most num_micro_batches=4, got "
     "active_micro_batches=5"),
    ({"active_micro_batches": 0}, ValueError, "got active_micro_batches=0"),
    ({"active_micro_batches": 2.0}, TypeError, "active_micro_batches must be a positive int"),
    ({"active_micro_batches": 3}, ValueError,
     "place_active_rows got 8 rows for active_micro_batches=3: the rows that run are k * b "
     "(b rows per micro-batch), so k must divide them; pass 6 or 9 rows"),
    ({"active_micro_batches": 2, "fill": "nan"}, ValueError,
     "fill must be 'zeros' (the rows of inactive micro-batches are zeros) or 'repeat'"),
    ({"active_micro_batches": 2, "num_micro_batches": 0}, ValueError,
     "num_micro_batches must be at least 1"),
])
def test_place_active_rows_errors(kwargs, error, match):
  kwargs = {"num_micro_batches": 4, **kwargs}
  with pytest.raises(error, match=re.escape(match)):
    jaxaccum.contrib.place_active_rows(np.zeros((8, 2)), **kwargs)


def test_feeder_errors():
  with pytest.raises(ValueError, match=re.escape("different numbers of rows [3, 4]")):
    jaxaccum.contrib.place_active_rows({"a": np.zeros(4), "b": np.zeros(3)}, num_micro_batches=2,
                               active_micro_batches=1)
  with pytest.raises(ValueError, match="holds a scalar"):
    jaxaccum.contrib.RowFeeder({"a": np.float32(1)}, num_micro_batches=2, micro_batch_size=1)
  with pytest.raises(ValueError, match=re.escape("position=11 is beyond the stream's 10 rows")):
    jaxaccum.contrib.RowFeeder(np.zeros(10), num_micro_batches=2, micro_batch_size=1, position=11)
  with pytest.raises(ValueError, match="position must be a non-negative int"):
    jaxaccum.contrib.RowFeeder(np.zeros(10), num_micro_batches=2, micro_batch_size=1, position=-1)
  feeder = jaxaccum.contrib.RowFeeder(np.zeros(10), num_micro_batches=2, micro_batch_size=3)
  with pytest.raises(TypeError, match="must be a concrete int on the host, got a traced"):
    jax.jit(feeder.next_batch)(jnp.int32(1))
  feeder.next_batch(2)
  with pytest.raises(StopIteration, match="4 rows left at position 6; the step needs 6"):
    feeder.next_batch(2)
  assert feeder.position == 6  # nothing taken
  # An iterator resumes by skipping rows.
  it = jaxaccum.contrib.RowFeeder(iter(range(10)), num_micro_batches=2, micro_batch_size=2,
                          position=4)
  np.testing.assert_array_equal(it.next_batch(2), [4, 5, 6, 7])


def test_repeat_fill_copies_micro_batch_i_mod_k_into_every_inactive_slot():
  # Generated (N, k, b): inactive micro-batch i >= k holds the rows of micro-batch i % k,
  # read back by hand with [i::N]; several inactive slots (N - k up to 7).
  rng = np.random.default_rng(3)
  cases = [(8, 3, 2), (7, 2, 1), (5, 1, 3)] + [
      (int(n), int(rng.integers(1, n + 1)), int(rng.integers(1, 4)))
      for n in rng.integers(2, 9, size=30)]
  for n, k, b in cases:
    rows = np.arange(1, k * b + 1) * 10 + rng.integers(0, 10, size=k * b)
    placed = jaxaccum.contrib.place_active_rows(rows, num_micro_batches=n, active_micro_batches=k,
                                        fill="repeat")
    assert placed.shape == (n * b,)
    for i in range(n):
      np.testing.assert_array_equal(placed[i::n], rows[i % k::k], err_msg=f"{n, k, b, i}")


def test_feeder_stream_forms_and_resume_positions():
  # A Python list of rows would be read as a pytree of separate arrays: refused.
  rows = [np.full(16, r, np.float32) for r in range(50)]
  with pytest.raises(TypeError, match=re.escape(
      "RowFeeder got a Python list of 50 items as its stream. A list is a pytree") +
      r".* pass the rows stacked into arrays \(np.stack\(rows\)\), or iter\(rows\)"):
    jaxaccum.contrib.RowFeeder(rows, num_micro_batches=2, micro_batch_size=2)
  # The two forms the message offers serve the same batches, rows whole.
  stacked = jaxaccum.contrib.RowFeeder(np.stack(rows), num_micro_batches=2, micro_batch_size=2)
  one_by_one = jaxaccum.contrib.RowFeeder(iter(rows), num_micro_batches=2, micro_batch_size=2)
  for k in (1, 2, 2):
    a, b = stacked.next_batch(k), one_by_one.next_batch(k)
    assert a.shape == (4, 16)
    np.testing.assert_array_equal(a, b)
  # position = the stream's length is a feeder at its end (array or iterator): accepted,
  # and its next batch says the stream is used up.
  for length in (1, 7, 10):
    for source in (np.arange(length), iter(range(length))):
      end = jaxaccum.contrib.RowFeeder(source, num_micro_batches=2, micro_batch_size=1,
                               position=length)
      assert end.position == length
      with pytest.raises(StopIteration, match="RowFeeder: the stream"):
        end.next_batch(1)
  # An iterator resumed past its end says so, with the position and the fix.
  with pytest.raises(ValueError, match=re.escape(
      "RowFeeder: position=12 is beyond the end of the iterator, which held only 10 rows; "
      "resume at a position within the stream")):
    jaxaccum.contrib.RowFeeder(iter(range(10)), num_micro_batches=2, micro_batch_size=1,
                               position=12)


def test_a_traced_active_count_out_of_range_is_clipped_as_documented():
  # Concrete values out of 1..N raise; traced ones are clipped: 0 runs micro-batch 0 only,
  # N + 2 runs all N. Compared with the full-batch gradient over the rows by hand.
  vg = jaxaccum.value_and_grad(_loss, num_micro_batches=N, with_info=True)
  batch = {key: jnp.asarray(v) for key, v in _stream(N * B).items()}
  w = jnp.array([0.5, -1.0, 2.0])
  step = jax.jit(lambda k: vg(w, batch, active_micro_batches=k))
  for k, runs in ((0, 1), (-3, 1), (N + 2, N), (1, 1), (N, N)):
    value, grads, info = step(jnp.int32(k))
    ref_value, ref_grads = _full(w, _ran(batch, runs))
    chex.assert_trees_all_close((value, grads), (ref_value, ref_grads), rtol=1e-5, atol=1e-6)
    assert int(info.num_micro_batches) == runs
  for k in (0, N + 2):
    with pytest.raises(ValueError, match=rf"active_micro_batches={k} is out of range"):
      vg(w, batch, active_micro_batches=k)
