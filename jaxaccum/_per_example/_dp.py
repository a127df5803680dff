"""``dp_noise``: the Gaussian noise of DP-SGD, added to an accumulated clipped gradient.

:func:`jaxaccum.dp.clip_per_example` gives the mean (or sum) of the clipped per-example
gradients; DP-SGD then adds Gaussian noise of standard deviation ``noise_multiplier *
l2_norm_clip`` to the sum, that is ``noise_multiplier * l2_norm_clip / batch_size`` to the
mean. ``optax.contrib.dpsgd`` does both steps on per-example gradients (a leading batch
axis); :func:`dp_noise` is its noise step alone, for gradients that are already clipped and
reduced, as an optax transformation to chain before the optimizer.

The noise must be added to the clipped gradient itself: a transform before it (an
optimizer, a rescaling) releases a function of the un-noised clipped gradient, and nothing
is private. :func:`dp_optimizer` builds the chain in that order by construction, and
:func:`check_dp_chain` reads a chain built by hand and refuses the wrong order.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum._core import _validate


class DpNoiseState(NamedTuple):
  """The state of :func:`dp_noise`: the key of the next step's noise."""

  rng_key: jax.Array


def dp_noise(l2_norm_clip: float, noise_multiplier: float, *, batch_size: float,
             key: jax.Array) -> optax.GradientTransformation:
  """Adds DP-SGD's Gaussian noise to a mean of clipped per-example gradients.

  Each update leaf gets ``noise_multiplier * l2_norm_clip / batch_size`` times a standard
  normal draw: the noise that ``optax.contrib.differentially_private_aggregate`` adds to
  the sum of the clipped per-example gradients before dividing by the batch size, with the
  same keys (``optax.chain(dp_noise(C, sigma, batch_size=B, key=k), optax.sgd(lr))`` on the
  mean that ``clip_per_example(C)`` gives equals ``optax.contrib.dpsgd(lr, C, sigma, ...)``
  on the per-example gradients, started from key ``k``). It must come first, before any
  transform of the updates: :func:`dp_optimizer` puts it there, and :func:`check_dp_chain`
  refuses a chain built by hand with another transform before it (``dp_noise`` alone
  cannot tell what ran before it).

  Args:
    l2_norm_clip: the clip norm ``C`` of :func:`jaxaccum.dp.clip_per_example`.
    noise_multiplier: the ratio of the noise's standard deviation (on the sum) to ``C``.
    batch_size: what the gradient is a mean over (``B``, or the expected batch size under
      Poisson sampling); ``1`` for a sum (``reduce="sum"``).
    key: a PRNG key; each update splits it (the new state keeps the first part).

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`DpNoiseState`.

  Raises:
    TypeError: a value that is not a number.
    ValueError: ``l2_norm_clip`` or ``batch_size`` not positive and finite, or
      ``noise_multiplier`` negative or not finite.

  >>> import jax, jax.numpy as jnp, optax
  >>> import jaxaccum
  >>> tx = optax.chain(jaxaccum.dp.dp_noise(1.0, 1.1, batch_size=256, key=jax.random.key(0)),
  ...                  optax.sgd(0.1))
  >>> grads = {"w": jnp.zeros(3)}
  >>> updates, state = tx.update(grads, tx.init(grads))
  >>> updates["w"].shape
  (3,)
  """
  clip = _validate.check_float("dp_noise", "l2_norm_clip", l2_norm_clip, low=0.0, strict=True,
                               what="the clip norm C", example="1.0")
  sigma = _validate.check_float("dp_noise", "noise_multiplier", noise_multiplier, low=0.0,
                                strict=False, what="sigma: the noise's std is sigma * C",
                                example="1.1")
  size = _validate.check_float("dp_noise", "batch_size", batch_size, low=0.0, strict=True,
                               what="the expected batch size the noise is divided by",
                               example="256")
  std = clip * sigma

  def init_fn(params):
    del params
    return DpNoiseState(rng_key=key)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    new_key, *keys = jax.random.split(state.rng_key, len(leaves) + 1)
    noised = [g + std * jax.random.normal(k, g.shape, g.dtype) / size
              for g, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, noised), DpNoiseState(rng_key=new_key)

  return DpNoise(init_fn, update_fn)


def dp_optimizer(optimizer: optax.GradientTransformation, *, l2_norm_clip: float,
                 noise_multiplier: float, batch_size: float,
                 key: jax.Array) -> optax.GradientTransformationExtraArgs:
  """DP-SGD's optimizer: the calibrated noise added first, then ``optimizer``.

  The same as ``optax.chain(dp_noise(l2_norm_clip, noise_multiplier,
  batch_size=batch_size, key=key), optimizer)``, the only safe order: the noise goes on
  the clipped gradient itself, and ``optimizer`` (Adam's moments, momentum, weight
  decay, a learning-rate schedule) only post-processes the noised gradient. Its ``init``
  refuses an ``optimizer`` that holds a :func:`dp_noise` of its own (the noise would be
  added twice, and the second time after the first transform). Extra keyword arguments of
  ``update`` reach ``optimizer`` (``optax.chain``'s rule).

  Args:
    optimizer: an ``optax.GradientTransformation`` (``optax.adam(1e-3)``, a chain).
    l2_norm_clip: the clip norm ``C`` of :func:`jaxaccum.dp.clip_per_example`.
    noise_multiplier: the ratio of the noise's standard deviation (on the sum) to ``C``.
    batch_size: what the gradient is a mean over (``B``, or the expected batch size under
      Poisson sampling); ``1`` for a sum (``reduce="sum"``).
    key: a PRNG key for the noise (:func:`dp_noise`'s).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``(DpNoiseState,
    optimizer's state)``.

  Raises:
    TypeError: ``optimizer`` is not an optax transformation; a bad number (as
      :func:`dp_noise`).
    ValueError: at ``init``, ``optimizer`` holds a :func:`dp_noise`.

  >>> import jax, jax.numpy as jnp, optax
  >>> import jaxaccum
  >>> tx = jaxaccum.dp.dp_optimizer(optax.adam(1e-3), l2_norm_clip=1.0, noise_multiplier=1.1,
  ...                            batch_size=256, key=jax.random.key(0))
  >>> params = {"w": jnp.zeros(3)}
  >>> updates, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
  >>> updates["w"].shape
  (3,)
  """
  if not isinstance(optimizer, optax.GradientTransformation) or isinstance(
      optimizer, DpNoise):
    what = ("jaxaccum.dp.dp_noise, which dp_optimizer adds itself" if isinstance(
        optimizer, DpNoise) else type(optimizer).__name__)
    raise TypeError(
        "dp_optimizer: optimizer must be an optax.GradientTransformation such as "
        f"optax.adam(1e-3), got {what}.")
  noise = dp_noise(l2_norm_clip, noise_multiplier, batch_size=batch_size, key=key)
  chained = optax.chain(noise, optimizer)

  def init_fn(params):
    inner = optimizer.init(params)
    if _noise_paths(inner):
      raise ValueError(
          "dp_optimizer: the optimizer passed in holds a jaxaccum.dp.dp_noise of its own, so "
          "the noise would be added twice, the second time after another transform. "
          "Pass the optimizer without dp_noise: dp_optimizer adds the noise, first.")
    return (noise.init(params), inner)

  return optax.GradientTransformationExtraArgs(init_fn, chained.update)


class DpNoise(optax.GradientTransformation):
  """What :func:`dp_noise` returns: an ``optax.GradientTransformation`` that
  :func:`dp_optimizer` and :func:`check_dp_chain` recognise."""

  __slots__ = ()


def _noise_paths(state: Any, path: tuple = ()) -> list[tuple]:
  """Where :class:`DpNoiseState`\\ s sit in an optimizer state: per state, its path of
  ``(container, index)`` steps from the root."""
  if isinstance(state, DpNoiseState):
    return [path]
  found: list[tuple] = []
  if isinstance(state, dict):
    for i, k in enumerate(state):
      found += _noise_paths(state[k], (*path, ("dict", i)))
  elif isinstance(state, (tuple, list)):
    kind = "chain" if type(state) in (tuple, list) else type(state).__name__
    for i, s in enumerate(state):
      found += _noise_paths(s, (*path, (kind, i)))
  return found


def check_dp_chain(tx: optax.GradientTransformation, params: Any) -> None:
  """Refuses an optax transformation that does not add :func:`dp_noise` first.

  DP-SGD's noise must go on the clipped gradient itself; ``optax.chain(optax.adam(...),
  dp_noise(...))`` adds it after Adam, so the released update is a function of the
  un-noised gradient and nothing is private, yet it runs without an error. This reads the
  structure of ``tx.init(params)`` (by :func:`jax.eval_shape`: nothing is computed):
  ``optax.chain`` keeps its transforms' states in a tuple in order (``optax.named_chain``
  in a dict), so the noise is first when its state is the first entry at every level.

  What it cannot tell: a transform whose state is not a tuple, a list or a dict holding
  the noise's state (``optax.MultiSteps``, ``optax.masked``, an ``inject_hyperparams``
  wrapper) may transform the updates before the noise; that is reported with a
  ``UserWarning``, not refused. :func:`dp_optimizer` needs no check: it is built in the
  right order.

  Args:
    tx: the transformation to check (a chain, or :func:`dp_optimizer`'s).
    params: the parameters (or their shapes) that ``tx.init`` takes.

  Raises:
    TypeError: ``tx`` has no ``init``.
    ValueError: ``tx`` adds no :func:`dp_noise`, adds it twice, or has a transform before
      it.

  >>> import jax, jax.numpy as jnp, optax
  >>> import jaxaccum
  >>> noise = jaxaccum.dp.dp_noise(1.0, 1.1, batch_size=256, key=jax.random.key(0))
  >>> jaxaccum.dp.check_dp_chain(optax.chain(noise, optax.adam(1e-3)), jnp.zeros(3))
  >>> jaxaccum.dp.check_dp_chain(optax.chain(optax.adam(1e-3), noise), jnp.zeros(3))
  Traceback (most recent call last):
  ...
  ValueError: check_dp_chain: jaxaccum.dp.dp_noise is transform 1 of an optax.chain ...
  """
  if not callable(getattr(tx, "init", None)):
    raise TypeError(
        f"check_dp_chain: tx must be an optax.GradientTransformation (or an object with "
        f"its init, such as optax.MultiSteps), got {type(tx).__name__}.")
  paths = _noise_paths(jax.eval_shape(tx.init, params))
  if not paths:
    raise ValueError(
        "check_dp_chain: tx adds no jaxaccum.dp.dp_noise, so the clipped gradient is released "
        "without noise. Use jaxaccum.dp.dp_optimizer(optimizer, l2_norm_clip=..., "
        "noise_multiplier=..., batch_size=..., key=...).")
  if len(paths) > 1:
    raise ValueError(
        f"check_dp_chain: tx adds jaxaccum.dp.dp_noise {len(paths)} times; add it once, "
        "first: jaxaccum.dp.dp_optimizer(optimizer, ...) does.")
  (path,) = paths
  late = next(((kind, i) for kind, i in path if kind in ("chain", "dict") and i > 0), None)
  if late is not None:
    kind, i = late
    where = "an optax.chain" if kind == "chain" else "an optax.named_chain"
    raise ValueError(
        f"check_dp_chain: jaxaccum.dp.dp_noise is transform {i} of {where} (counting from 0), "
        f"so {'the transform before it sees' if i == 1 else f'the {i} transforms before it see'} "
        "the clipped gradient without noise, and the update released is not private. Put the "
        "noise first: jaxaccum.dp.dp_optimizer(optimizer, l2_norm_clip=..., "
        "noise_multiplier=..., batch_size=..., key=...), or optax.chain(dp_noise(...), "
        "optimizer).")
  wrappers = sorted({kind for kind, _ in path if kind not in ("chain", "dict")})
  if wrappers:
    warnings.warn(
        f"check_dp_chain: jaxaccum.dp.dp_noise sits inside {', '.join(wrappers)}, whose state "
        "does not say what it does to the updates before the noise; the order cannot be "
        "checked there. Prefer jaxaccum.dp.dp_optimizer at the top level.",
        UserWarning, stacklevel=2)


def place_padding_last(batch: Any, example_mask: Any, *,
                       num_micro_batches: int) -> tuple[Any, Any, Any]:
  """Orders a padded batch so that its padding fills the last micro-batches, to skip them.

  Micro-batch ``i`` of ``N`` holds the batch's rows ``i, i + N, i + 2N, ...``. This puts
  the real rows (``example_mask`` true), in their order, into micro-batches ``0, 1, ...``
  (``b`` rows each) and the padding after them, and returns how many micro-batches hold
  a real row, ``k = max(1, ceil(real / b))``: a step called with
  ``active_micro_batches=k`` and ``clip_per_example(..., example_mask=...)`` then runs no
  micro-batch that holds only padding, and gives the same clipped gradient as the
  unordered batch (the order of examples does not change a sum). Under Poisson sampling,
  padded to a fixed size, this saves the padding's share of the step's time.

  It runs eagerly or inside ``jax.jit`` (``k`` is then traced, which
  ``active_micro_batches`` takes). NumPy inputs stay NumPy (``k`` a Python int), for a
  host-side loader.

  Args:
    batch: a pytree of arrays with a leading axis of ``B`` rows (the batch axis: 0).
    example_mask: ``(B,)`` bools (or numbers, nonzero for a real row).
    num_micro_batches: ``N``, the step's ``num_micro_batches``; it must divide ``B``.

  Returns:
    ``(batch, example_mask, k)``: the rows reordered, the mask reordered with them, and
    the number of micro-batches to run (an int32 scalar, or an int for NumPy inputs).

  Raises:
    TypeError: a mask that is not an array of one bool per row, or a count that is not an
      int.
    ValueError: leaves whose rows differ from the mask's, or ``N`` that does not divide
      ``B``.

  >>> import numpy as np
  >>> import jaxaccum
  >>> x = np.arange(8)
  >>> mask = np.array([1, 0, 1, 0, 0, 1, 0, 0], bool)
  >>> rows, mask, k = jaxaccum.dp.place_padding_last(x, mask, num_micro_batches=4)
  >>> rows, k  # micro-batch i holds rows[i::4]: [0, 2], [5, 1], [3, 4], [6, 7]
  (array([0, 5, 3, 6, 2, 1, 4, 7]), 2)
  """
  if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches,
                                                           (int, np.integer)):
    raise TypeError(
        "place_padding_last: num_micro_batches must be a positive int, got "
        f"num_micro_batches={num_micro_batches!r}.")
  n = int(num_micro_batches)
  dtype = getattr(example_mask, "dtype", None)
  if dtype is None or np.ndim(example_mask) != 1 or not (
      jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.number)):
    raise TypeError(
        "place_padding_last: example_mask must be an array of one bool per row (True: a "
        f"real row), got {type(example_mask).__name__} of shape {np.shape(example_mask)}"
        f"{'' if dtype is None else f' and dtype {dtype}'}.")
  rows = int(np.shape(example_mask)[0])
  if n < 1 or rows % n:
    raise ValueError(
        f"place_padding_last: num_micro_batches={n} must be a positive divisor of the "
        f"batch's {rows} rows (the step splits the batch into that many micro-batches).")
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if np.ndim(leaf) == 0 or np.shape(leaf)[0] != rows:
      raise ValueError(
          f"place_padding_last: batch leaf {jax.tree_util.keystr(path) or '(root)'} has "
          f"shape {np.shape(leaf)}, but the mask has {rows} rows: every leaf needs a "
          "leading axis of one row per example.")
  b = rows // n
  host = isinstance(example_mask, np.ndarray)
  xp = np if host else jnp
  real = xp.asarray(example_mask) != 0
  order = xp.argsort(~real, stable=True)  # the real rows first, each group in its order
  j = np.arange(rows)
  perm = order[(j % n) * b + j // n]  # batch row j holds sorted row (j % N) * b + j // N
  count = xp.sum(real.astype(xp.int32))
  k = xp.maximum(1, -(-count // b))

  def take(x):
    if host and isinstance(x, np.ndarray):
      return x[perm]
    return jnp.take(jnp.asarray(x), jnp.asarray(perm), axis=0)

  return (jax.tree.map(take, batch), take(example_mask),
          int(k) if host else k.astype(jnp.int32))
