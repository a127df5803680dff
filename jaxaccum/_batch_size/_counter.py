"""The exact sample counter: the samples (rows or tokens) seen, in two int32 words.

``count = samples_hi * 2**24 + samples_lo`` with ``0 <= samples_lo < 2**24``: every word is
an exact int32, and float32 holds each step's addend below ``2**24`` exactly, so a step's
samples are added without rounding. The count saturates at ``2**55 - 1`` (about ``3.6e16``).
A state holds a counter in its ``samples_hi`` and ``samples_lo`` fields
(:class:`jaxaccum.contrib.AdaptiveBatchState`, :class:`jaxaccum.contrib.SeesawState`); everything
that adds to it or reads it is here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._core import _validate

LO_BITS = 24  # the low word's bits
LO = 1 << LO_BITS  # the high word's unit


def has_counter(x: Any) -> bool:
  """Whether ``x`` is a state holding a counter (a ``NamedTuple`` with ``samples_hi`` and
  ``samples_lo`` fields)."""
  return isinstance(x, tuple) and hasattr(x, "samples_hi") and hasattr(x, "samples_lo")


def add_samples(hi: jax.Array, lo: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(hi, lo)`` plus ``x`` samples (a float32 integer, below ``2**55``), exactly."""
  x_hi = jnp.floor(x / LO)  # exact: a power of two
  x_lo = (x - x_hi * LO).astype(jnp.int32)  # exact integer in [0, 2**24)
  lo = lo + x_lo  # < 2**25: no overflow
  carry = lo >> LO_BITS
  lo = lo & (LO - 1)
  room = _validate.INT32_MAX - hi
  add = jnp.minimum(x_hi, jnp.float32(2.0 ** 31 - 128)).astype(jnp.int32) + carry
  full = add > room
  return (jnp.where(full, _validate.INT32_MAX, hi + jnp.where(full, 0, add)),
          jnp.where(full, LO - 1, lo))


def samples(state: Any) -> jax.Array:
  """A state's count as float32 (relative error below ``6e-8``), for schedules."""
  return (jnp.asarray(state.samples_hi, jnp.float32) * jnp.float32(LO)
          + jnp.asarray(state.samples_lo, jnp.float32))


def sample_count(state: Any) -> int:
  """A concrete state's exact count as a Python int."""
  return int(state.samples_hi) * LO + int(state.samples_lo)


def words31(state: Any) -> tuple[jax.Array, jax.Array]:
  """A state's count as ``(high, low)`` int32 words of ``high * 2**31 + low`` (the words of
  :func:`jaxaccum.batch_size_ramp_by_count`), negative words read as 0."""
  hi = jnp.maximum(jnp.asarray(state.samples_hi, jnp.int32), 0)
  lo = jnp.clip(jnp.asarray(state.samples_lo, jnp.int32), 0, LO - 1)
  shift = 31 - LO_BITS
  return hi >> shift, ((hi & ((1 << shift) - 1)) << LO_BITS) | lo

