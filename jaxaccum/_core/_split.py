"""The column-major micro-batch split: counts, split, take and merge.

Micro-batch ``i`` of ``N`` holds rows ``i, i + N, i + 2N, ...`` of the batch. A batch
leaf of shape ``(B, ...)`` is reshaped (row-major, a free bitcast) to ``(B // N, N, ...)``
and micro-batch ``i`` is the slice ``[:, i]``. When the batch axis is sharded in
contiguous blocks over ``D`` devices and ``D`` divides ``B // N``, every row of
micro-batch ``i`` already lives on the device that holds it after the split, so the
split moves no data: the sharding lands on the micro-batch-size axis, never on the
scan axis (optax's ``reshape_batch_axis`` uses the same order).

The batch axis need not be the leading one (``batch_axis``): axis ``a`` of size ``B`` is
reshaped to ``(B // N, N)`` in place and micro-batch ``i`` is index ``i`` along the new minor
axis, so ``fun`` sees the axis where it was, with ``B // N`` rows. :func:`split`,
:func:`take` and :func:`merge` are the one split and merge of the project: the core, the
pipeline, :func:`split_micro_batches`, :func:`merge_micro_batches` and ``aux_reduce="concat"``
use them.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._core._types import PyTree
from jaxaccum._core._validate import describe as describe
from jaxaccum._core._validate import is_int


@overload
def check_count(name: str, value: Any, *, required: Literal[True]) -> int: ...
@overload
def check_count(name: str, value: Any, *, required: bool = False) -> int | None: ...
def check_count(name: str, value: Any, *, required: bool = False) -> int | None:
  """Returns ``value`` as an int, or raises if it is not a positive integer; ``None`` passes
  unless ``required``."""
  if value is None:
    if required:
      raise TypeError(f"{name} must be a positive Python int, got None. Pass a static "
                      f"integer such as {name}=8.")
    return None
  if not is_int(value):
    raise TypeError(
        f"{name} must be a positive Python int, got {value!r} of type "
        f"{type(value).__name__}. Pass a static integer such as {name}=8; a traced "
        "value cannot set the length of the scan."
    )
  if value < 1:
    raise ValueError(f"{name} must be a positive integer, got {name}={value}.")
  return int(value)


def check_batch_axis(value: Any, num_batch_args: int | None = None) -> int | tuple:
  """Validates ``batch_axis``: an int, or a tuple with one entry per batch argument.

  Each entry of a tuple is an int or a pytree prefix of its argument with int leaves (as
  :func:`jax.vmap`'s ``in_axes``). ``num_batch_args`` (when the batch arguments are known
  when the transform is built) is the length a tuple must have.
  """
  def bad(got):
    return TypeError(
        "batch_axis must be an int (the batch axis of every batch argument), or a tuple "
        "with one entry per batch argument (batch_argnums in order, then batch_argnames), "
        "each an int or a pytree prefix of that argument with int leaves, as jax.vmap's "
        f"in_axes; got batch_axis={got!r}.")
  if is_int(value):
    return int(value)
  if not isinstance(value, tuple):
    raise bad(value)
  for entry in value:
    for leaf in jax.tree.leaves(entry, is_leaf=lambda x: x is None):
      if leaf is None:
        raise TypeError(
            f"batch_axis={value!r} has a None entry: every leaf of a batch argument is split "
            "along its batch axis. Pass an array that is not to be split as a non-batch "
            "argument instead.")
      if not is_int(leaf):
        raise bad(value)
  if num_batch_args is not None and len(value) != num_batch_args:
    raise ValueError(
        f"batch_axis={value!r} has {len(value)} entries, but there are {num_batch_args} batch "
        "arguments: give one entry per batch argument (batch_argnums in order, then "
        "batch_argnames in order), or one int for all of them.")
  return tuple(value)


def _check_entry(batch_axis: Any, what: str) -> None:
  """Validates the ``batch_axis`` of one pytree: an int, or a pytree prefix of it with ints."""
  leaves = jax.tree.leaves(batch_axis, is_leaf=lambda x: x is None)
  if not leaves or not all(is_int(a) for a in leaves):
    raise TypeError(
        f"batch_axis must be an int or a pytree prefix of {what} with an int at each leaf (as "
        f"jax.vmap's in_axes), got batch_axis={batch_axis!r}.")


def common_axis(batch_axis: int | tuple) -> int:
  """The axis that per-example (``"concat"``) aux rows come back along.

  ``batch_axis`` itself when it is one int, or when every entry names the same int; axis 0
  when the batch arguments have different batch axes.
  """
  if isinstance(batch_axis, int):
    return batch_axis
  values = set(jax.tree.leaves(batch_axis))
  return values.pop() if len(values) == 1 else 0


def _label(key: Any) -> str:
  return key if isinstance(key, str) else f"argument {key}"


def batch_axes(batch_args: dict[Any, PyTree], batch_axis: int | tuple = 0) -> dict[Any, PyTree]:
  """Per batch argument, a tree like it holding each leaf's batch axis (non-negative).

  ``batch_args`` is ordered as ``batch_axis``'s entries: the ``batch_argnums`` arguments,
  then the ``batch_argnames`` ones. A negative axis counts from the end of each leaf's shape.
  """
  keys = list(batch_args)
  if isinstance(batch_axis, tuple):
    if len(batch_axis) != len(keys):
      raise ValueError(
          f"batch_axis={batch_axis!r} has {len(batch_axis)} entries, but the call has "
          f"{len(keys)} batch argument(s): {', '.join(map(_label, keys)) or 'none'}. Give one "
          "entry per batch argument (batch_argnums in order, then batch_argnames in order), "
          "or one int for all of them.")
    entries = dict(zip(keys, batch_axis, strict=True))
  else:
    entries = dict.fromkeys(keys, batch_axis)
  return {key: _leaf_axes(_label(key), tree, entries[key], batch_axis)
          for key, tree in batch_args.items()}


def _leaf_axes(label: str, tree: PyTree, entry: Any, batch_axis: Any) -> PyTree:
  """``entry`` (an int or a pytree prefix of ``tree``) broadcast to ``tree``'s leaves."""
  try:
    axes = jax.tree.map(lambda a, sub: jax.tree.map(lambda _: a, sub), entry, tree)
  except ValueError:
    raise ValueError(
        f"batch_axis={batch_axis!r} gives the batch {label} the entry {entry!r}, which is not "
        f"a pytree prefix of the argument (structure {jax.tree.structure(tree)}). Give an int "
        "for the whole argument, or a pytree with its structure and an int at each leaf (or "
        "subtree), as jax.vmap's in_axes.") from None

  def one(path, leaf, a):
    shape = np.shape(leaf)
    if not -len(shape) <= a < len(shape):
      where = f"{label}{jax.tree_util.keystr(path)}"
      if not shape:
        return a  # a scalar: batch_size says it has no batch axis
      raise ValueError(
          f"batch_axis={a} is out of range for batch leaf {where} of shape {tuple(shape)} "
          f"(rank {len(shape)}): valid axes are {-len(shape)}..{len(shape) - 1}. Give this "
          "argument its own entry in batch_axis (a tuple, one entry per batch argument, each "
          "an int or a pytree prefix of it).")
    return a % len(shape)

  return jax.tree_util.tree_map_with_path(one, tree, axes)


def batch_size(batch_args: dict[Any, PyTree], hint: str = "",
               axes: dict[Any, PyTree] | None = None) -> int:
  """The common size of every leaf of the batch arguments along its batch axis.

  ``batch_args`` maps an argument's position (named "argument j" in errors) or its name
  (e.g. "batch") to the pytree passed there; ``axes`` (from :func:`batch_axes`) gives each
  leaf's batch axis, the leading one by default. An argument without leaves (``None``, an
  empty container) is passed as it is to every micro-batch, as :func:`jax.vmap` does; at
  least one argument must have leaves.
  """
  sizes: dict[str, int] = {}
  along: dict[str, int] = {}
  for key, tree in batch_args.items():
    label = _label(key)
    leaf_axes = jax.tree.leaves(axes[key]) if axes is not None else None
    for k, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(tree)):
      where = f"{label}{jax.tree_util.keystr(path)}"
      shape = np.shape(leaf)
      if len(shape) == 0:
        raise ValueError(
            f"batch leaf {where} is a scalar (shape ()), so it has no batch axis to split. "
            "Every leaf of a batch argument needs a leading batch axis; pass per-step "
            f"constants as a separate, non-batch argument.{hint}"
        )
      a = leaf_axes[k] if leaf_axes is not None else 0
      sizes[where] = shape[a]
      along[where] = a
  if not sizes:
    key, tree = next(iter(batch_args.items()))
    raise ValueError(
        f"the batch {_label(key)} has no array leaves, got {type(tree).__name__} {tree!r}. "
        "Pass the data to split into micro-batches there, e.g. (x, y) or "
        f"{{'image': x, 'label': y}}.{hint}"
    )
  if len(set(sizes.values())) > 1:
    groups: dict[int, list[str]] = {}
    leading = not any(along.values())
    for where, size in sizes.items():
      groups.setdefault(size, []).append(where if leading else f"{where} (axis {along[where]})")
    listing = "; ".join(
        f"{size} at {', '.join(paths[:4])}{f' and {len(paths) - 4} more' if len(paths) > 4 else ''}"
        for size, paths in groups.items())
    if leading:
      raise ValueError(
          "batch leaves must share the leading batch axis, but their leading sizes differ: "
          f"{listing}. Give every leaf of the batch arguments the same first dimension."
      )
    raise ValueError(
        "batch leaves must share the batch size, but their sizes along their batch axes "
        f"(batch_axis) differ: {listing}. Give every leaf the same size along its batch axis, "
        "or fix batch_axis (one int for all batch arguments, or one entry per argument)."
    )
  return next(iter(sizes.values()))


def size_note(batch_args: dict[Any, PyTree], axes: dict[Any, PyTree]) -> str:
  """`` (axis a of <leaf> of shape s)`` for messages about the batch size, when the batch
  axis is not the leading one; empty otherwise."""
  for key, tree in batch_args.items():
    for (path, leaf), a in zip(jax.tree_util.tree_leaves_with_path(tree),
                               jax.tree.leaves(axes[key]), strict=True):
      if a:
        return (f" (the size of batch_axis={a} of batch leaf "
                f"{_label(key)}{jax.tree_util.keystr(path)}, shape {tuple(np.shape(leaf))})")
  return ""


def is_key(leaf: Any) -> bool:
  """Whether ``leaf`` is one PRNG key: a scalar typed key or a raw uint32 key."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return np.ndim(leaf) == 0
  # A raw key: uint32 of shape (2,) (threefry) or (4,) (rbg).
  return dtype == jnp.uint32 and np.shape(leaf) in ((2,), (4,))


def divisors(n: int) -> list[int]:
  """All divisors of ``n`` in increasing order."""
  small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


def _near(options: list[int], target: int) -> str:
  below = [d for d in options if d < target][-2:]
  above = [d for d in options if d > target][:2]
  return ", ".join(str(d) for d in below + above)


def resolve_count(size: int, num_micro_batches: int | None, micro_batch_size: int | None,
                  shards: int = 1, where: str = "", of: str = "") -> int:
  """The micro-batch count for a batch of ``size`` rows, with a clear error if none fits.

  With ``shards > 1`` (data-parallel mode over ``where``) each of the ``shards`` data
  shards splits its own ``size // shards`` rows, so the count must divide those. ``of``
  (:func:`size_note`) says which axis the size was read from.
  """
  if size == 0:
    raise ValueError(
        "batch size 0: the batch arguments have no rows to split into micro-batches. Pass "
        "a non-empty batch.")
  if shards == 1:
    divs = divisors(size)
    if num_micro_batches is not None:
      if size % num_micro_batches:
        raise ValueError(
            f"batch size {size}{of} is not divisible by num_micro_batches={num_micro_batches}. "
            f"Valid counts near it: {_near(divs, num_micro_batches)} (all divisors of {size}: "
            f"{', '.join(map(str, divs))})."
        )
      return num_micro_batches
    if micro_batch_size is None:
      raise ValueError("pass exactly one of num_micro_batches and micro_batch_size.")
    if size % micro_batch_size:
      raise ValueError(
          f"batch size {size}{of} is not divisible by micro_batch_size={micro_batch_size}. "
          f"Valid sizes near it: {_near(divs, micro_batch_size)} (all divisors of {size}: "
          f"{', '.join(map(str, divs))})."
      )
    return size // micro_batch_size
  if size % shards:
    raise ValueError(
        f"batch size {size}{of} is not divisible by the data-axis size {shards} "
        f"(data_axis over {where}): every data shard needs the same number of rows. Use a "
        f"batch size that is a multiple of {shards}."
    )
  local = size // shards
  count = num_micro_batches
  if count is not None:
    if size // count < shards and size % count == 0:
      raise ValueError(
          f"num_micro_batches={count} makes micro-batches of {size} / {count} = "
          f"{size // count} rows, smaller than the {shards} data shards (data_axis over "
          f"{where}). Use at most {local} micro-batches: valid counts are the divisors of "
          f"{local} (batch {size} / {shards} shards): {divisors(local)}."
      )
    if local % count:
      raise ValueError(
          f"batch size {size}{of} is not divisible by the data-axis size {shards} x "
          f"num_micro_batches={count} = {shards * count} (data_axis over {where}). Valid "
          f"counts are the divisors of {local} (batch {size} / {shards} shards): "
          f"{divisors(local)}."
      )
    return count
  micro = micro_batch_size
  if micro is None:
    raise ValueError("pass exactly one of num_micro_batches and micro_batch_size.")
  if micro < shards:
    raise ValueError(
        f"micro_batch_size={micro} is smaller than the {shards} data shards (data_axis "
        f"over {where}): each shard needs at least one row of every micro-batch. Use a "
        f"micro_batch_size that is a multiple of {shards} and divides {size}."
    )
  if micro % shards or size % micro:
    valid = [shards * d for d in divisors(local)]
    raise ValueError(
        f"micro_batch_size={micro} does not split batch size {size} evenly over the "
        f"{shards} data shards (data_axis over {where}): it must divide {size} and be a "
        f"multiple of {shards}. Valid sizes: {valid}."
    )
  return size // micro


def _per_leaf(axis: int | PyTree, tree: PyTree) -> PyTree:
  """``axis`` as a tree like ``tree`` (an int applies to every leaf)."""
  return jax.tree.map(lambda _: axis, tree) if isinstance(axis, int) else axis


def split(tree: PyTree, n: int, axis: int | PyTree = 0) -> PyTree:
  """Reshapes each leaf's batch axis ``a`` of size ``B`` to ``(B // n, n)``: a bitcast, no
  data moves. ``axis`` is an int or a tree like ``tree`` of non-negative ints."""
  def one(x, a):
    return x.reshape(x.shape[:a] + (x.shape[a] // n, n) + x.shape[a + 1:])
  return jax.tree.map(one, tree, _per_leaf(axis, tree))


def take(tree: PyTree, i: jax.Array, axis: int | PyTree = 0) -> PyTree:
  """Micro-batch ``i`` of a tree made by :func:`split`: rows ``i, i + n, ...`` along each
  leaf's batch axis, which keeps its place (with ``B // n`` rows)."""
  return jax.tree.map(lambda x, a: lax.dynamic_index_in_dim(x, i, axis=a + 1, keepdims=False),
                      tree, _per_leaf(axis, tree))


def merge(stacked: jax.Array, axis: int = 0) -> jax.Array:
  """``(N, ...)`` micro-batch entries, rows along ``axis`` of an entry, back to one array
  whose ``axis`` holds the ``N * b`` rows in batch order: the inverse of :func:`split`
  followed by :func:`take` for every ``i``."""
  n = stacked.shape[0]
  a = axis % (stacked.ndim - 1)
  shape = stacked.shape[1:]
  return jnp.moveaxis(stacked, 0, a + 1).reshape(shape[:a] + (shape[a] * n,) + shape[a + 1:])


def split_micro_batches(
    batch: PyTree, *, num_micro_batches: int | None = None, micro_batch_size: int | None = None,
    batch_axis: int | PyTree = 0,
) -> PyTree:
  """Splits a batch into stacked micro-batches, the way the transforms do.

  Micro-batch ``i`` of ``N`` holds rows ``i, i + N, i + 2N, ...`` (the column-major
  split), which keeps a sharded batch axis sharded without moving data. Useful to feed
  :class:`jaxaccum.MultiSteps` or a reference loop with exactly the micro-batches that
  :func:`jaxaccum.value_and_grad` would use.

  Args:
    batch: a pytree whose leaves share a batch axis of size ``B``.
    num_micro_batches: the number ``N`` of micro-batches; ``B`` must be divisible by it.
    micro_batch_size: alternatively, the rows per micro-batch (``N = B // size``).
    batch_axis: the batch axis: an int for every leaf, or a pytree prefix of ``batch``
      with an int at each leaf (negative axes count from the end), as the transforms'
      ``batch_axis`` entry for one argument. Default 0.

  Returns:
    The same pytree with a new leading axis of size ``N`` on every leaf and its batch axis,
    in its place, of size ``B // N``: index ``[i]`` is micro-batch ``i``, what ``fun``
    sees (``x[:, i::N]`` for ``batch_axis=1``).

  Raises:
    ValueError: neither or both counts given, ``B`` not divisible, a batch axis out of
      range or leaves whose sizes along it differ.

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> jaxaccum.split_micro_batches(jnp.arange(6), num_micro_batches=2)
  Array([[0, 2, 4],
         [1, 3, 5]], dtype=int32)
  >>> jaxaccum.split_micro_batches(jnp.zeros((5, 6, 3)), num_micro_batches=2,
  ...                              batch_axis=1).shape
  (2, 5, 3, 3)
  """
  count, size = check_counts(num_micro_batches, micro_batch_size)
  _check_entry(batch_axis, "batch")
  args = {"batch": batch}
  axes = batch_axes(args, (batch_axis,))
  n = resolve_count(batch_size(args, axes=axes), count, size, of=size_note(args, axes))
  return jax.tree.map(lambda x, a: jnp.moveaxis(x, a + 1, 0), split(batch, n, axes["batch"]),
                      axes["batch"])


def merge_micro_batches(stacked: PyTree, *, batch_axis: int | PyTree = 0) -> PyTree:
  """Puts stacked micro-batches back into one batch: the inverse of :func:`split_micro_batches`.

  Row ``r`` of micro-batch ``i`` of ``N`` was row ``r * N + i`` of the batch (the
  column-major split); this puts it back there. Useful for per-example outputs collected
  per micro-batch (``aux_reduce="stack"``), or for the micro-batches of a reference loop.

  Args:
    stacked: a pytree whose leaves share a leading axis of ``N`` micro-batches, each with
      ``b`` rows along its batch axis.
    batch_axis: the batch axis of one micro-batch (not counting the leading ``N``), as
      :func:`split_micro_batches` takes it: an int, or a pytree prefix of ``stacked``.

  Returns:
    The same pytree without the leading axis, each batch axis holding the ``N * b`` rows in
    the batch's order.

  Raises:
    ValueError: a leaf without a batch axis after the leading one, a batch axis out of
      range, or leaves whose ``N`` or ``b`` differ.

  >>> import jax.numpy as jnp
  >>> import jaxaccum
  >>> stacked = jaxaccum.split_micro_batches(jnp.arange(6), num_micro_batches=2)
  >>> jaxaccum.merge_micro_batches(stacked)
  Array([0, 1, 2, 3, 4, 5], dtype=int32)
  """
  leaves = jax.tree_util.tree_leaves_with_path(stacked)
  if not leaves:
    raise ValueError(f"stacked has no array leaves, got {describe(stacked)}.")
  _check_entry(batch_axis, "stacked")
  for path, leaf in leaves:
    if len(np.shape(leaf)) < 2:
      raise ValueError(
          f"stacked leaf {jax.tree_util.keystr(path) or '(root)'} has shape {np.shape(leaf)}; "
          "every leaf needs the leading axes (num_micro_batches, micro_batch_size, ...), as "
          "jaxaccum.split_micro_batches returns them.")
  # The batch axes of one micro-batch: leaf [0] of each stacked leaf.
  first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.float32), stacked)
  axes = batch_axes({"stacked": first}, (batch_axis,))["stacked"]
  lead = None
  for (path, leaf), a in zip(leaves, jax.tree.leaves(axes), strict=True):
    shape = np.shape(leaf)
    got = (shape[0], shape[a + 1])
    if lead is None:
      lead = got
    elif got != lead:
      what = ("leading (num_micro_batches, micro_batch_size) axes" if not batch_axis else
              f"(num_micro_batches, micro_batch_size) sizes (axis 0 and batch_axis={batch_axis})")
      raise ValueError(
          f"stacked leaves must share their {what}, got {lead} and {got} at "
          f"{jax.tree_util.keystr(path)}.")
  return jax.tree.map(merge, stacked, axes)


def check_counts(
    num_micro_batches: Any, micro_batch_size: Any
) -> tuple[int | None, int | None]:
  """Validates that exactly one of the two counts is given, as a positive int."""
  if (num_micro_batches is None) == (micro_batch_size is None):
    raise ValueError(
        "pass exactly one of num_micro_batches and micro_batch_size, got "
        f"num_micro_batches={num_micro_batches!r} and micro_batch_size={micro_batch_size!r}."
    )
  return (check_count("num_micro_batches", num_micro_batches),
          check_count("micro_batch_size", micro_batch_size))
