"""``jaxaccum.contrib.place_active_rows`` and ``RowFeeder``: feed exactly the rows that run.

A step built by :func:`jaxaccum.value_and_grad` with ``num_micro_batches=N`` and called with
``active_micro_batches=k`` runs micro-batches ``0..k-1`` only. Micro-batch ``i`` holds rows
``i, i + N, i + 2N, ...`` of the batch (the column-major split of ``_split``), so the rows
that run are those whose index ``r`` has ``r % N < k``; the others are never read. A loader
that fills the batch with fresh rows everywhere wastes ``(N - k) / N`` of its data.
:func:`place_active_rows` puts ``k * b`` fresh rows where they run and filler elsewhere;
:class:`RowFeeder` does it for a stream, so that every row is used exactly once however
``k`` changes.
"""

from __future__ import annotations

import collections.abc
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._core import _split, _validate
from jaxaccum._core._types import PyTree

_FILLS = ("zeros", "repeat")


def _check_fill(fill: Any) -> str:
  if fill not in _FILLS:
    raise ValueError(
        f"fill must be 'zeros' (the rows of inactive micro-batches are zeros) or 'repeat' "
        f"(they repeat active rows, e.g. to keep token ids valid), got fill={fill!r}.")
  return fill


def _rows_of(tree: PyTree, what: str) -> int:
  """The common leading length of the leaves of ``tree``."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise ValueError(f"{what} has no arrays: give a pytree of arrays with a leading row axis.")
  sizes = set()
  for leaf in leaves:
    if np.ndim(leaf) == 0:
      raise ValueError(
          f"{what} holds a scalar ({_validate.describe(leaf)}); every leaf needs a leading "
          "row axis.")
    sizes.add(np.shape(leaf)[0])
  if len(sizes) != 1:
    raise ValueError(
        f"the leaves of {what} have different numbers of rows {sorted(sizes)}; every leaf "
        "needs the same leading row axis.")
  return sizes.pop()


def place_active_rows(
    rows: PyTree, *, num_micro_batches: int, active_micro_batches: int, fill: str = "zeros",
) -> PyTree:
  """Lays out the rows of ``k`` active micro-batches in a batch of ``N`` micro-batches.
  Experimental (:mod:`jaxaccum.contrib`), with the controllers that vary ``k``: its cost is not
  measured yet.

  ``rows`` holds ``k * b`` rows: the rows that will run. The result holds ``N * b`` rows,
  with ``rows`` exactly at the positions of micro-batches ``0..k-1`` (batch rows ``r``
  with ``r % N < k``) and filler in the others, which a step called with
  ``active_micro_batches=k`` does not read. Micro-batch ``i < k`` holds ``rows[i::k]``,
  so with ``k = N`` the batch is ``rows`` itself. NumPy leaves stay NumPy (for a host-side
  loader); others become JAX arrays. The batch axis is the leading one.

  Args:
    rows: a pytree of arrays with a common leading axis of ``k * b`` rows.
    num_micro_batches: ``N``, the ``num_micro_batches`` of the step.
    active_micro_batches: ``k`` in ``1..N``, a concrete int (the value the step gets).
    fill: ``"zeros"`` (default) or ``"repeat"``: inactive micro-batch ``i`` repeats the
      rows of micro-batch ``i % k`` (real data, e.g. valid token ids, never used).

  Returns:
    The batch: ``rows``' pytree with ``N * b`` rows on each leaf.

  Raises:
    TypeError, ValueError: a count that is not a positive int, ``k > N``, a traced ``k``,
      a bad ``fill``, or rows whose number ``k`` does not divide or that differ by leaf.

  >>> import numpy as np
  >>> import jaxaccum
  >>> jaxaccum.contrib.place_active_rows(np.arange(1, 7), num_micro_batches=4,
  ...                            active_micro_batches=2)
  array([1, 2, 0, 0, 3, 4, 0, 0, 5, 6, 0, 0])
  """
  n = _validate.check_host_count("num_micro_batches", num_micro_batches)
  k = _validate.check_host_count("active_micro_batches", active_micro_batches, high=n)
  fill = _check_fill(fill)
  total = _rows_of(rows, "rows")
  if total % k:
    raise ValueError(
        f"place_active_rows got {total} rows for active_micro_batches={k}: the rows that "
        f"run are k * b (b rows per micro-batch), so k must divide them; pass "
        f"{total // k * k or k} or {(total // k + 1) * k} rows.")

  def one(x):
    xp = np if isinstance(x, np.ndarray) else jnp
    x = xp.asarray(x)
    b = x.shape[0] // k
    active = _split.split(x, k)  # (b, k, ...): micro-batch i < k at [:, i], as the step sees
    if fill == "zeros":
      rest = xp.zeros((b, n - k) + x.shape[1:], x.dtype)
    else:
      rest = active[:, np.arange(k, n) % k]
    # (b, N, ...) back to N * b rows: the inverse of the column-major split into N.
    return xp.concatenate([active, rest], axis=1).reshape((b * n,) + x.shape[1:])

  return jax.tree.map(one, rows)


class RowFeeder:
  """Feeds a stream of rows to a step that runs ``k`` of ``N`` micro-batches, each row once.
  Experimental (:mod:`jaxaccum.contrib`), with the controllers that vary ``k``: its cost is not
  measured yet (the tests check that every row runs exactly once).

  Each :meth:`next_batch` call takes the next ``k * micro_batch_size`` rows of the stream
  and returns the ``(N * micro_batch_size, ...)`` batch of :func:`place_active_rows`:
  those rows where micro-batches ``0..k-1`` run, filler elsewhere. Across a run whose ``k``
  changes (a :class:`jaxaccum.contrib.AdaptiveBatch`, a ramp), every row of the stream runs exactly
  once, in stream order, and the batch keeps one shape, so the step compiles once.

  The stream is a pytree of arrays with a common leading row axis (NumPy arrays, read by
  slicing; a tuple or dict of them for several arrays per row), or an iterator (anything
  with ``__next__``) of single rows, each a pytree of arrays without the row axis, stacked
  with NumPy. A Python list is refused: as a pytree its items would be taken for
  separate arrays; stack it (``np.stack(rows)``) or pass ``iter(rows)``.
  :attr:`position` counts the rows taken; to resume, save it with the checkpoint and pass
  it back as ``position=`` (an iterator skips that many rows; ``position`` may be the
  stream's length, a feeder at its end).

  Args:
    rows: the stream: arrays with a leading row axis, or an iterator of rows.
    num_micro_batches: ``N``, the step's ``num_micro_batches``.
    micro_batch_size: ``b``, rows per micro-batch (the batch holds ``N * b`` rows).
    fill: what the inactive micro-batches hold: ``"zeros"`` or ``"repeat"``
      (:func:`place_active_rows`).
    position: rows of the stream already used (to resume), default 0.

  Raises:
    TypeError, ValueError: bad counts or ``fill``, a Python list as the stream, or a
      ``position`` beyond the stream's end (an array's length, or an iterator's rows).

  >>> import numpy as np
  >>> import jaxaccum
  >>> feeder = jaxaccum.contrib.RowFeeder(np.arange(1, 100), num_micro_batches=4,
  ...                             micro_batch_size=2)
  >>> feeder.next_batch(1)
  array([1, 0, 0, 0, 2, 0, 0, 0])
  >>> feeder.next_batch(3)
  array([3, 4, 5, 0, 6, 7, 8, 0])
  >>> feeder.position
  8
  """

  def __init__(self, rows: PyTree | Iterator[PyTree], *, num_micro_batches: int,
               micro_batch_size: int, fill: str = "zeros", position: int = 0):
    self.num_micro_batches = _validate.check_host_count("num_micro_batches", num_micro_batches)
    self.micro_batch_size = _validate.check_host_count("micro_batch_size", micro_batch_size)
    self.fill = _check_fill(fill)
    if not _validate.is_int(position) or position < 0:
      raise ValueError(
          f"RowFeeder: position must be a non-negative int (rows already used), got "
          f"position={position!r}.")
    if isinstance(rows, list):
      raise TypeError(
          f"RowFeeder got a Python list of {len(rows)} items as its stream. A list is a "
          "pytree, whose items would be read as separate arrays each with its own row "
          "axis, not as rows; pass the rows stacked into arrays (np.stack(rows)), or "
          "iter(rows) to read them one at a time. (Several arrays per row: a tuple or "
          "dict of arrays with a common leading row axis.)")
    self._iterator = isinstance(rows, collections.abc.Iterator)
    self._rows = rows
    self._position = 0
    if self._iterator:
      for skipped in range(position):
        try:
          next(rows)  # type: ignore[call-overload]
        except StopIteration:
          raise ValueError(
              f"RowFeeder: position={position} is beyond the end of the iterator, which "
              f"held only {skipped} rows; resume at a position within the stream (the "
              "feeder's saved position), or pass an iterator of the whole stream from "
              "its start.") from None
    else:
      length = _rows_of(rows, "the RowFeeder stream")
      if position > length:
        raise ValueError(
            f"RowFeeder: position={position} is beyond the stream's {length} rows; pass "
            f"a position in 0..{length} (the feeder's saved position).")
      self._length = length
    self._position = int(position)

  @property
  def position(self) -> int:
    """The rows of the stream used so far (save it to resume)."""
    return self._position

  def _take(self, count: int) -> PyTree:
    if self._iterator:
      taken: list[PyTree] = []
      stream: Iterable[PyTree] = self._rows
      for row in stream:
        taken.append(row)
        if len(taken) == count:
          break
      if len(taken) < count:
        raise StopIteration(
            f"RowFeeder: the stream ended after {self._position + len(taken)} rows; the "
            f"step needed {count} more and got {len(taken)}.")
      return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *taken)
    start, stop = self._position, self._position + count
    if stop > self._length:
      raise StopIteration(
          f"RowFeeder: the stream has {self._length - start} rows left at position {start}; "
          f"the step needs {count}.")
    return jax.tree.map(lambda x: x[start:stop], self._rows)

  def next_batch(self, active_micro_batches: int) -> PyTree:
    """The batch for a step that runs ``k = active_micro_batches`` micro-batches.

    Args:
      active_micro_batches: ``k`` in ``1..N``, a concrete int: the value the step is
        called with.

    Returns:
      A pytree like the stream's rows with ``N * micro_batch_size`` rows on each leaf.

    Raises:
      StopIteration: fewer than ``k * micro_batch_size`` rows are left (an array stream
        keeps its position; an iterator has been read to its end).
      TypeError, ValueError: ``k`` is not a concrete int in ``1..N``.
    """
    k = _validate.check_host_count("active_micro_batches", active_micro_batches,
                                   high=self.num_micro_batches)
    rows = self._take(k * self.micro_batch_size)
    self._position += k * self.micro_batch_size
    return place_active_rows(rows, num_micro_batches=self.num_micro_batches,
                             active_micro_batches=k, fill=self.fill)
