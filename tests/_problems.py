"""Test problems shared by the test files: an MLP, a CNN and a small causal transformer LM.

Each problem is plain JAX (parameters are nested dicts of arrays) and has

* ``<name>_params(key, ...)``: the parameters;
* ``<name>_batch(key, batch_size, ...)``: a batch, a dict of arrays with a leading batch
  axis whose rows are all distinct (so a test sees which rows went where), with a 0/1
  float ``"mask"`` of rows (MLP, CNN) or tokens (LM) for the weighted form;
* its loss in three forms, ``<name>_loss(params, batch, form)``: ``"mean"`` (a mean over
  the rows, for ``reduce="mean"``), ``"sum"`` (a sum over the rows, for ``reduce="sum"``)
  and ``"weighted"`` (``(sum of masked losses, number of unmasked rows/tokens)`` for
  ``reduce="weighted"``).

:func:`make` bundles one of them as a :class:`Problem`. The references a test compares with:

* :func:`full_batch`: the full batch through plain ``jax.value_and_grad`` under ``jax.jit``
  (for ``"weighted"``: the full batch's numerator over its denominator);
* :func:`micro_batch` / :func:`micro_batches`: micro-batches for a hand-written loop, made
  by explicit slicing, micro-batch ``i`` of ``N`` being rows ``i, i + N, ...`` (``x[i::N]``).
  They do not use ``jaxaccum.split_micro_batches``, so a wrong split in the library cannot
  also be in the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
FORMS = ("mean", "sum", "weighted")


def _cast(tree: PyTree, dtype: Any) -> PyTree:
  return jax.tree.map(
      lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _mask(key: jax.Array, batch_size: int) -> jax.Array:
  """Rows kept with probability 0.6, and row 0 always kept (so the total weight is > 0)."""
  keep = jax.random.uniform(key, (batch_size,)) < 0.6
  return keep.at[0].set(True).astype(jnp.float32)


def _reduce_rows(per_row: jax.Array, mask: jax.Array, form: str):
  """A per-row loss in one of the three forms."""
  if form == "mean":
    return jnp.mean(per_row)
  if form == "sum":
    return jnp.sum(per_row)
  if form == "weighted":
    return jnp.sum(per_row * mask), jnp.sum(mask)
  raise ValueError(f"form must be one of {FORMS}, got {form!r}")


# --------------------------------------------------------------------------------------- MLP


# The makers run as one jitted program each (not op by op): the same numbers, fewer compiles.


@functools.partial(jax.jit, static_argnames=("sizes", "bias", "dtype"))
def mlp_params(key: jax.Array, sizes=(5, 7, 3), *, bias: bool = True,
               dtype: Any = jnp.float32) -> PyTree:
  """``{"layers": [{"w": (d_in, d_out), "b": (d_out,)}, ...]}``, scaled to O(1) outputs."""
  keys = jax.random.split(key, len(sizes) - 1)
  layers = []
  for k, (d_in, d_out) in zip(keys, zip(sizes[:-1], sizes[1:], strict=True), strict=True):
    layer = {"w": jax.random.normal(k, (d_in, d_out)) / jnp.sqrt(d_in)}
    if bias:
      layer["b"] = jnp.full((d_out,), 0.1)
    layers.append(layer)
  return _cast({"layers": layers}, dtype)


@functools.partial(jax.jit, static_argnames=("batch_size", "d_in", "d_out", "dtype"))
def mlp_batch(key: jax.Array, batch_size: int = 16, d_in: int = 5, d_out: int = 3, *,
              dtype: Any = jnp.float32) -> PyTree:
  """``{"x": (B, d_in), "y": (B, d_out), "label": (B,) int32, "mask": (B,)}``."""
  kx, ky, kl, km = jax.random.split(key, 4)
  batch = {
      "x": jax.random.normal(kx, (batch_size, d_in)),
      "y": jax.random.normal(ky, (batch_size, d_out)),
      "label": jax.random.randint(kl, (batch_size,), 0, d_out),
      "mask": _mask(km, batch_size),
  }
  return _cast(batch, dtype)


def mlp_problem(seed: int, sizes=(5, 7, 3), batch_size: int = 16, *, bias: bool = True,
                dtype: Any = jnp.float32) -> tuple[PyTree, PyTree]:
  """``(mlp_params, mlp_batch)`` drawn from ``seed``: an MLP of ``sizes`` and a batch that fits
  it."""
  kp, kb = jax.random.split(jax.random.key(seed))
  return (mlp_params(kp, sizes, bias=bias, dtype=dtype),
          mlp_batch(kb, batch_size, sizes[0], sizes[-1], dtype=dtype))


def mlp_apply(params: PyTree, x: jax.Array) -> jax.Array:
  """tanh hidden layers, a linear output layer."""
  layers = params["layers"]
  for i, layer in enumerate(layers):
    x = x @ layer["w"] + layer["b"] if "b" in layer else x @ layer["w"]
    if i < len(layers) - 1:
      x = jnp.tanh(x)
  return x


def mlp_loss(params: PyTree, batch: PyTree, form: str = "mean"):
  """Squared error, averaged over the outputs of a row, in ``form``."""
  per_row = jnp.mean((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
  return _reduce_rows(per_row, batch["mask"].astype(per_row.dtype), form)


def mlp_nll(params: PyTree, batch: PyTree) -> tuple[jax.Array, jax.Array]:
  """Per-row cross-entropy of ``batch["label"]`` and the logits (a classifier MLP)."""
  logits = mlp_apply(params, batch["x"])
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, batch["label"][:, None], axis=1)[:, 0], logits


# --------------------------------------------------------------------------------------- CNN

IMAGE, CHANNELS, CLASSES = 6, 4, 3


@functools.partial(jax.jit, static_argnames="dtype")
def cnn_params(key: jax.Array, *, dtype: Any = jnp.float32) -> PyTree:
  """A 3x3 convolution to 4 channels and a linear head to 3 classes."""
  k1, k2 = jax.random.split(key)
  return _cast({
      "conv": {"w": jax.random.normal(k1, (3, 3, 1, CHANNELS)) / 3.0,
               "b": jnp.full((CHANNELS,), 0.1)},
      "head": {"w": jax.random.normal(k2, (CHANNELS, CLASSES)) / 2.0,
               "b": jnp.zeros((CLASSES,))},
  }, dtype)


@functools.partial(jax.jit, static_argnames=("batch_size", "dtype"))
def cnn_batch(key: jax.Array, batch_size: int = 8, *, dtype: Any = jnp.float32) -> PyTree:
  """``{"image": (B, 6, 6, 1), "label": (B,) int32, "mask": (B,)}``."""
  kx, kl, km = jax.random.split(key, 3)
  return _cast({
      "image": jax.random.normal(kx, (batch_size, IMAGE, IMAGE, 1)),
      "label": jax.random.randint(kl, (batch_size,), 0, CLASSES),
      "mask": _mask(km, batch_size),
  }, dtype)


def cnn_apply(params: PyTree, image: jax.Array) -> jax.Array:
  h = jax.lax.conv_general_dilated(image, params["conv"]["w"], (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  h = jax.nn.relu(h + params["conv"]["b"]).mean(axis=(1, 2))
  return h @ params["head"]["w"] + params["head"]["b"]


def cnn_loss(params: PyTree, batch: PyTree, form: str = "mean"):
  """Cross-entropy of the labels, in ``form``."""
  logp = jax.nn.log_softmax(cnn_apply(params, batch["image"]))
  per_row = -jnp.take_along_axis(logp, batch["label"][:, None], axis=1)[:, 0]
  return _reduce_rows(per_row, batch["mask"].astype(per_row.dtype), form)


# ---------------------------------------------------------------------------------------- LM

VOCAB, DIM, SEQ, HEADS = 11, 16, 12, 2


@functools.partial(jax.jit, static_argnames="dtype")
def lm_params(key: jax.Array, *, dtype: Any = jnp.float32) -> PyTree:
  """One pre-LayerNorm causal attention + MLP block with learned positions."""
  k = jax.random.split(key, 7)
  n = lambda kk, shape, fan: jax.random.normal(kk, shape) / jnp.sqrt(fan)  # noqa: E731
  return _cast({
      "embed": n(k[0], (VOCAB, DIM), 1.0),
      "pos": n(k[1], (SEQ, DIM), 4.0),
      "qkv": n(k[2], (DIM, 3 * DIM), DIM),
      "proj": n(k[3], (DIM, DIM), DIM),
      "mlp": (n(k[4], (DIM, 2 * DIM), DIM), n(k[5], (2 * DIM, DIM), 2 * DIM)),
      "ln": {"scale": jnp.ones(DIM), "bias": jnp.zeros(DIM)},
      "out": n(k[6], (DIM, VOCAB), DIM),
  }, dtype)


@functools.partial(jax.jit, static_argnames="batch_size")
def lm_batch(key: jax.Array, batch_size: int = 16, lengths=None) -> PyTree:
  """``{"tokens": (B, SEQ) int32, "mask": (B, SEQ) bool}``: right-padded sequences.

  ``lengths`` defaults to random lengths in ``[2, SEQ]``: very uneven, some sequences
  almost all padding. Padding positions hold token 0.
  """
  k1, k2 = jax.random.split(key)
  if lengths is None:
    lengths = jax.random.randint(k2, (batch_size,), 2, SEQ + 1)
  lengths = jnp.asarray(lengths)
  tokens = jax.random.randint(k1, (batch_size, SEQ), 1, VOCAB)
  mask = jnp.arange(SEQ)[None, :] < lengths[:, None]
  return {"tokens": jnp.where(mask, tokens, 0), "mask": mask}


def layer_norm(x: jax.Array, p: PyTree) -> jax.Array:
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def lm_logits(params: PyTree, tokens: jax.Array) -> jax.Array:
  b, t = tokens.shape
  x = params["embed"][tokens] + params["pos"][:t]
  q, k, v = jnp.split(layer_norm(x, params["ln"]) @ params["qkv"], 3, axis=-1)
  heads = lambda a: a.reshape(b, t, HEADS, DIM // HEADS)  # noqa: E731
  att = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / jnp.sqrt(DIM // HEADS)
  causal = jnp.tril(jnp.ones((t, t), bool))
  att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1)
  x = x + jnp.einsum("bhqk,bkhd->bqhd", att, heads(v)).reshape(b, t, DIM) @ params["proj"]
  x = x + jax.nn.gelu(x @ params["mlp"][0]) @ params["mlp"][1]
  return x @ params["out"]


def lm_token_losses(params: PyTree, batch: PyTree) -> tuple[jax.Array, jax.Array]:
  """Next-token negative log-likelihoods ``(B, SEQ - 1)`` and their 0/1 float mask."""
  logits = lm_logits(params, batch["tokens"][:, :-1])
  targets = batch["tokens"][:, 1:]
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return nll, batch["mask"][:, 1:].astype(nll.dtype)


def lm_loss(params: PyTree, batch: PyTree, form: str = "weighted"):
  """``"weighted"``: (summed masked token losses, real tokens); ``"mean"``: the mean over
  rows of each row's summed masked token losses; ``"sum"``: their sum."""
  nll, mask = lm_token_losses(params, batch)
  if form == "weighted":
    return jnp.sum(nll * mask), jnp.sum(mask)
  return _reduce_rows(jnp.sum(nll * mask, axis=1), None, form)


# ------------------------------------------------------------------------- problems, references


class Problem(NamedTuple):
  """A problem: parameters, a batch and its loss as ``loss(params, batch, form)``."""

  name: str
  params: PyTree
  batch: PyTree
  loss: Callable[..., Any]

  def fun(self, form: str) -> Callable[[PyTree, PyTree], Any]:
    """The loss in ``form`` as ``fun(params, batch)``."""
    return lambda params, batch: self.loss(params, batch, form)


def make(name: str, seed: int = 0, batch_size: int | None = None) -> Problem:
  """``"mlp"`` (16 rows), ``"cnn"`` (8 images) or ``"lm"`` (16 sequences)."""
  kp, kb = jax.random.split(jax.random.key(seed))
  if name == "mlp":
    return Problem(name, mlp_params(kp), mlp_batch(kb, batch_size or 16), mlp_loss)
  if name == "cnn":
    return Problem(name, cnn_params(kp), cnn_batch(kb, batch_size or 8), cnn_loss)
  if name == "lm":
    return Problem(name, lm_params(kp), lm_batch(kb, batch_size or 16), lm_loss)
  raise ValueError(f"unknown problem {name!r}")


def ratio(value: Any) -> jax.Array:
  """A weighted loss ``(numerator, denominator)`` as the number it stands for."""
  num, den = value
  return num / den


def full_batch(fun: Callable[..., Any], params: PyTree, batch: PyTree, *args,
               form: str = "mean", has_aux: bool = False):
  """``(value, grads)`` of the whole batch through plain ``jax.value_and_grad`` under jit.

  For ``form="weighted"`` the value differentiated is numerator / denominator.
  """
  if form == "weighted":
    if has_aux:
      def target(*a):
        value, aux = fun(*a)
        return ratio(value), aux
    else:
      def target(*a):
        return ratio(fun(*a))
  else:
    target = fun
  return jax.jit(jax.value_and_grad(target, has_aux=has_aux))(params, batch, *args)


def micro_batch(batch: PyTree, i: int, n: int) -> PyTree:
  """Micro-batch ``i`` of ``n`` by explicit slicing: rows ``i, i + n, i + 2n, ...``.

  Outside a trace the rows are sliced on the host (NumPy arrays), so each slice is not an
  eagerly compiled op; inside one (a jitted reference loop) they are sliced as traced.
  """
  def rows(x):
    if isinstance(x, jax.core.Tracer) or jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return x[i::n]
    return np.asarray(x)[i::n]
  return jax.tree.map(rows, batch)


def micro_batches(batch: PyTree, n: int) -> list[PyTree]:
  """All ``n`` micro-batches, by explicit slicing."""
  return [micro_batch(batch, i, n) for i in range(n)]


# A one-hidden-layer tanh regression, the per-example and DP tests' problem: its parameters
# have a weight matrix, a bias and a weight vector (each a different ghost-norm rule).
TANH_D, TANH_H = 3, 4


def tanh_problem(seed: int = 0, rows: int = 16, bias_scale: float = 0.0):
  """``(params, (x, y))`` of the tanh regression, ``rows`` rows, from ``seed``."""
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
  params = {"w1": jax.random.normal(k1, (TANH_D, TANH_H)),
            "b1": bias_scale * jax.random.normal(k5, (TANH_H,)),
            "w2": jax.random.normal(k2, (TANH_H,))}
  x = jax.random.normal(k3, (rows, TANH_D))
  y = 3.0 * jax.random.normal(k4, (rows,))
  return params, (x, y)


def tanh_pred(p: PyTree, x: jax.Array) -> jax.Array:
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def tanh_mean_loss(p: PyTree, batch: PyTree) -> jax.Array:
  x, y = batch
  return jnp.mean((tanh_pred(p, x) - y) ** 2)
