"""``jaxaccum.cached_value_and_grad``: losses that couple the rows of their batch, accumulated.

A contrastive loss (CLIP's InfoNCE, in-batch negatives), a loss on the batch's statistics of
its embeddings (VICReg, Barlow Twins) or a balancing loss over the global batch (MoE) is not
a sum of per-row losses, so splitting its batch into micro-batches changes what it computes.
The rows it couples are only those of the *representations*, though: the encoder that makes
them is row-independent. :func:`cached_value_and_grad` splits the model there, into
``encode(params, batch, ...) -> reps`` (one row per example) and
``loss(params, reps, batch, ...) -> scalar``, and runs three passes inside the caller's
``jit`` (GradCache's scheme, Gao et al. 2021, without its Python loop):

a. ``encode`` forward only, micro-batch by micro-batch: the core's forward-only run
   (:func:`jaxaccum.evaluate`'s), its reps put back in batch order by the core's merge
   (``aux_reduce="concat"``);
b. ``loss``'s value and gradient with respect to the differentiated arguments and to the
   reps, once, on the whole batch's reps;
c. ``encode`` again, micro-batch by micro-batch, differentiated against its slice of the
   reps' cotangent: the core's accumulation (:func:`jaxaccum.value_and_grad`'s) of
   ``sum(reps * cotangent)``, whose gradient is ``encode``'s VJP of the cotangent, with
   the cotangent split as the batch is.

The gradient is (b)'s plus (c)'s, the full batch's. Both encoder passes are the core's own
runs, so the split (micro-batch ``i`` holds rows ``i, i + N, ...``), the keys (micro-batch
``i`` gets ``fold_in(key, i)``, the same in (a) and (c)), ``remat``, the float32
accumulator and the data-parallel driver are the core's. Under ``data_axis`` each pass runs
per data shard (:func:`jaxaccum._parallel._data_parallel.data_parallel`): the reps leave (a)
in global batch order, are replicated (one all-gather) for the loss, and (c) reduces its
gradients once, after its loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxaccum import _transforms
from jaxaccum._core import _options, _outputs, _reduce, _roles, _split, _stats, _validate
from jaxaccum._core._options import Options
from jaxaccum._core._types import ArgNums, DTypeLike, PyTree
from jaxaccum._core._validate import describe
from jaxaccum._parallel import _axes, _data_parallel
from jaxaccum._parallel._axes import DataParallel

# The keyword under which pass (c) passes the reps' cotangent, split as a batch argument.
_COTANGENT = "_jaxaccum_reps_cotangent"
_WHERE = "cached_value_and_grad"


def cached_value_and_grad(
    encode: Callable[..., Any],
    loss: Callable[..., Any],
    *,
    num_micro_batches: int | None = None,
    micro_batch_size: int | None = None,
    argnums: ArgNums = 0,
    has_aux: bool = False,
    batch_argnums: ArgNums = 1,
    rng_argnums: ArgNums = (),
    state_argnums: ArgNums | None = None,
    accumulator_dtype: DTypeLike | None = None,
    grads_dtype: DTypeLike | None = None,
    remat: bool | Callable[..., bool] = False,
    unroll: int | bool = 1,
    data_axis: str | Sequence[str] | DataParallel | None = None,
) -> CachedValueAndGrad:
  """:func:`jax.value_and_grad` of a loss that couples the rows of its batch, accumulated.

  The model is split into a row-independent encoder and a loss on its representations:
  ``encode(params, batch, *args) -> reps``, a pytree whose leaves have one row per example
  (a leading axis of the batch's rows), and ``loss(params, reps, batch, *args) -> scalar``
  (``(scalar, aux)`` with ``has_aux``), which sees the whole batch's reps in batch order and
  the whole batch. The result is the full batch's::

    jax.value_and_grad(lambda p, b, *a: loss(p, encode(p, b, *a), b, *a))(params, batch, ...)

  loss, aux and gradients, the gradient through what ``loss`` itself uses of ``params`` (a
  learned temperature) included, while ``encode`` holds one micro-batch of activations at
  a time. Three passes run inside the caller's ``jit``, with no Python loop: ``encode``
  forward over the micro-batches (the reps gathered in batch order), ``loss``'s value and
  gradient with respect to the reps once, and ``encode`` again over the micro-batches under
  :func:`jax.vjp` with each micro-batch's slice of the reps' cotangent, summed into a
  float32 accumulator. The cost is one more forward pass of ``encode`` than
  :func:`jaxaccum.value_and_grad`. See the guide "Losses that couple examples".

  Args:
    encode: the encoder, ``encode(params, batch, *args) -> reps``. It must be
      row-independent (each row of reps depends only on its own example; no BatchNorm):
      :meth:`CachedValueAndGrad.check_encode` checks it on a sample batch.
    loss: the loss on the reps, ``loss(params, reps, batch, *args)``: the first argument,
      the reps, then the other arguments as ``encode`` takes them.
    num_micro_batches: the number ``N`` of micro-batches ``encode`` runs in; micro-batch
      ``i`` holds rows ``i, i + N, ...``.
    micro_batch_size: alternatively, the rows per micro-batch. Give exactly one of the two.
    argnums: the argument(s) to differentiate, as in :func:`jax.grad`.
    has_aux: ``loss`` returns ``(value, aux)``; aux is computed on the whole batch.
    batch_argnums: the positional argument(s) holding the batch, split along their leading
      axis (default 1).
    rng_argnums: positional argument(s) holding a PRNG key (or a pytree of keys): micro-batch
      ``i``'s ``encode`` gets ``jax.random.fold_in(key, i)`` in both passes (the same
      dropout masks), ``loss`` the key itself.
    state_argnums: refused: mutable state in the encoder (BatchNorm's batch statistics)
      couples the rows of each micro-batch, which no split can keep exact.
    accumulator_dtype: dtype of the gradient accumulator; ``None`` accumulates
      bfloat16/float16 gradients in float32 and wider ones in their own dtype.
    grads_dtype: dtype of the returned gradients; ``None`` gives each its parameter's dtype.
    remat: ``True`` checkpoints each micro-batch's ``encode`` in the gradient pass
      (:func:`jax.checkpoint`); a :mod:`jax.checkpoint_policies` policy does so with it.
    unroll: passed to both scans (:func:`jax.lax.scan`).
    data_axis: data-parallel mode, as for :func:`jaxaccum.value_and_grad`: a mesh axis name
      (names, or ``"auto"``) the batch is sharded over, or a :class:`jaxaccum.DataParallel`
      with replicated parameters. Each device encodes its own rows, the reps are all-gathered
      so that ``loss`` sees the global batch, and the gradients are reduced once per step.

  Returns:
    A :class:`CachedValueAndGrad`: called with ``encode``'s arguments it returns
    ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``.

  Raises:
    ValueError, TypeError: at construction for bad options (``state_argnums`` included),
      and at trace time for a batch that cannot be split, reps without the micro-batch's
      rows or a ``loss`` that returns no scalar.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> def encode(w, x):  # one row of reps per example
  ...   return jnp.tanh(x @ w["enc"])
  >>> def loss(w, z, x):  # every row against every other: InfoNCE, learned temperature
  ...   logits = (z @ z.T) * jnp.exp(w["t"]) - 1e9 * jnp.eye(len(z))
  ...   return jnp.mean(jax.nn.logsumexp(logits, axis=1))
  >>> w = {"enc": jnp.ones((3, 2)) / 4, "t": jnp.zeros(())}
  >>> x = jnp.arange(24.0).reshape(8, 3) / 24
  >>> step = jax.jit(jaxaccum.cached_value_and_grad(encode, loss, num_micro_batches=4))
  >>> value, grads = step(w, x)
  >>> ref_value, ref_grads = jax.value_and_grad(lambda w, x: loss(w, encode(w, x), x))(w, x)
  >>> bool(jnp.allclose(value, ref_value)), bool(jnp.allclose(grads["t"], ref_grads["t"]))
  (True, True)
  """
  for name, fn, sig in (("encode", encode, "encode(params, batch, *args) -> reps"),
                        ("loss", loss, "loss(params, reps, batch, *args) -> scalar")):
    if not callable(fn):
      raise TypeError(f"{_WHERE}: {name} must be a callable {sig}, got {describe(fn)}.")
  if state_argnums is not None:
    raise ValueError(
        f"{_WHERE} takes no state_argnums (got state_argnums={state_argnums!r}): mutable "
        "state in the encoder, such as BatchNorm's batch statistics, couples the rows of "
        "each micro-batch inside encode, and encode must be row-independent for the "
        "micro-batches to give the full batch's reps. Use GroupNorm or LayerNorm in the "
        "encoder (per-example statistics), or put what couples the batch into loss, which "
        "sees the whole batch's reps.")
  common = dict(num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size,
                batch_argnums=batch_argnums, rng_argnums=rng_argnums,
                accumulator_dtype=accumulator_dtype, unroll=unroll, data_axis=data_axis)
  _check_replicated(data_axis)
  rows = _Encode(encode, _roles.normalize_argnums("batch_argnums", batch_argnums,
                                                  allow_empty=False))
  forward = _options.make_options(rows, dict(common, has_aux=True, aux_reduce="concat"),
                                  evaluate=True, where=_WHERE,
                                  parallel=_axes.KEYWORDS)
  backward = _options.make_options(
      _EncodeVJP(rows.encode, rows.batch_argnums),
      dict(common, argnums=argnums, batch_argnames=(_COTANGENT,), reduce="sum",
           grads_dtype=grads_dtype, remat=remat), where=_WHERE, parallel=_axes.KEYWORDS)
  return CachedValueAndGrad(encode, loss, forward, backward,
                            has_aux=_validate.check_bool("has_aux", has_aux))


def _check_replicated(data_axis: Any) -> None:
  """The FSDP placements are refused: the loss pass runs outside the data-parallel driver,
  on replicated parameters."""
  if isinstance(data_axis, DataParallel) and not data_axis.reduces_only:
    raise ValueError(
        f"{_WHERE} takes data_axis=DataParallel(axis, mesh=...) with replicated "
        f"parameters only, got {data_axis!r}: param_gather, grad_scatter and "
        "overlap_grad_reduce place the collectives of FSDP parameters, which this transform "
        "does not support yet. Drop them and keep the parameters replicated over the data "
        "axes.")


@dataclasses.dataclass(frozen=True)
class _Encode:
  """Pass (a)'s ``fun``: ``(0, reps)``, the reps checked to have the micro-batch's rows (the
  core's forward-only run reduces the value, and merges the reps as ``"concat"`` aux)."""

  encode: Callable[..., Any]
  batch_argnums: tuple[int, ...]

  def __call__(self, *args: Any, **kwargs: Any) -> tuple[jax.Array, PyTree]:
    return jnp.zeros((), jnp.float32), self.reps(args, kwargs)

  def reps(self, args: tuple, kwargs: dict) -> PyTree:
    reps = self.encode(*args, **kwargs)
    batch = {j: args[j] for j in _roles.resolve_argnums("batch_argnums", self.batch_argnums,
                                                        len(args))}
    check_reps(reps, _split.batch_size(batch))
    return reps


class _EncodeVJP(_Encode):
  """Pass (c)'s ``fun``: ``sum(reps * cotangent)``, whose gradient is ``encode``'s VJP of the
  micro-batch's slice of the reps' cotangent (a batch argument, split as the batch is)."""

  def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:  # type: ignore[override]
    cotangent = kwargs.pop(_COTANGENT)
    reps = _inexact_leaves(self.reps(args, kwargs))
    return sum((jnp.sum(r * c) for r, c in zip(reps, cotangent, strict=True)),
               jnp.zeros((), jnp.float32))


class CachedValueAndGrad:
  """What :func:`cached_value_and_grad` returns: ``encode`` and ``loss`` with the validated
  options of the two encoder passes (frozen :class:`jaxaccum._core._options.Options`).

  Calling it takes ``encode``'s arguments and returns ``(value, grads)`` (``((value, aux),
  grads)`` with ``has_aux``), the full batch's; :meth:`check_encode` checks on a sample
  batch that ``encode`` is row-independent.
  """

  def __init__(self, encode: Callable[..., Any], loss: Callable[..., Any], forward: Options,
               backward: Options, *, has_aux: bool):
    self.encode, self.loss = encode, loss
    self.forward, self.backward, self.has_aux = forward, backward, has_aux

  def __repr__(self) -> str:
    return f"<jaxaccum.cached_value_and_grad of {self.encode!r} and {self.loss!r}>"

  def roles(self, args: tuple, kwargs: dict) -> _options.Roles:
    """The call's argument roles (differentiated, batch, keys), resolved and checked."""
    return self.backward.roles.resolve(len(args), {**kwargs, _COTANGENT: None})

  # --- One call --------------------------------------------------------------------------

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with jax.named_scope(f"jaxaccum.{_WHERE}"):
      roles = self.roles(args, kwargs)
      forward, backward = self._resolved(args, roles)
      _, reps, _, _ = _transforms.Evaluate(forward).run(args, kwargs, None)
      reps = _placed(reps, forward, sharded=False)
      value, aux, loss_grads, cotangent = self._loss_pass(args, kwargs, roles.diff, reps)
      cotangent = _placed(cotangent, forward, sharded=True)
      params = [args[j] for j in roles.diff]
      backward = dataclasses.replace(backward, numerics=dataclasses.replace(
          backward.numerics, grads_dtype=_summed_dtype(params,
                                                       backward.numerics.accumulator_dtype)))
      _, _, encoder_grads, _ = _transforms.ValueAndGrad(backward).run(
          args, {**kwargs, _COTANGENT: cotangent}, None)
      grads = jax.tree.map(
          lambda e, g, p: (e + g.astype(e.dtype)).astype(
              self.backward.numerics.grads_dtype or p.dtype),
          encoder_grads, tuple(loss_grads), tuple(params))
    grads = grads[0] if self.backward.roles.argnums_is_int else grads
    return _outputs.pack(value, aux, grads, None, has_extra=self.has_aux, with_info=False)

  def _resolved(self, args: tuple, roles: _options.Roles) -> tuple[Options, Options]:
    """Both passes' options with ``data_axis="auto"`` resolved from the batch, once: pass
    (c) has the reps' cotangent as a batch argument too, replicated for the loss."""
    if self.forward.parallel is None or self.forward.parallel.axis != _axes.AUTO:
      return self.forward, self.backward
    batches = {self.forward.label(j): args[j] for j in roles.batch}
    forward = _data_parallel.resolve_auto(self.forward, batches,
                                          _split.batch_axes(batches, self.forward.split.batch_axis))
    return forward, dataclasses.replace(self.backward, parallel=forward.parallel)

  def _loss_pass(self, args: tuple, kwargs: dict, diff: tuple[int, ...], reps: PyTree):
    """Pass (b): ``loss``'s value, aux, gradient with respect to the differentiated
    arguments and cotangent of the reps' inexact leaves, once, on the whole batch."""
    flat, treedef = jax.tree.flatten(reps)
    inexact = [_is_inexact(x) for x in flat]

    def of(params, float_reps):
      call = list(args)
      for j, p in zip(diff, params, strict=True):
        call[j] = p
      it = iter(float_reps)
      whole = jax.tree.unflatten(treedef, [next(it) if m else x
                                           for x, m in zip(flat, inexact, strict=True)])
      return check_loss_output(self.loss(call[0], whole, *call[1:], **kwargs), self.has_aux)

    value, vjp, aux = jax.vjp(of, [args[j] for j in diff], _inexact_leaves(reps),
                              has_aux=True)
    loss_grads, cotangent = vjp(jnp.ones_like(value))
    return value, aux, loss_grads, cotangent

  # --- The opt-in check ------------------------------------------------------------------

  def check_encode(self, *args: Any, rtol: float = 1e-4, **kwargs: Any) -> dict[str, float]:
    """Checks on a sample batch that ``encode`` is row-independent.

    The rule of :func:`jaxaccum.dp.check_per_example_loss`, applied to the encoder: what is
    computed from each example alone must equal what is computed from the whole batch.
    ``encode`` runs on the whole batch and, through this transform's own encoder passes,
    on micro-batches of one row each; the reps, and ``encode``'s VJP of a fixed random
    cotangent, are compared (relative L2 differences). An encoder that mixes rows
    (BatchNorm's batch statistics, a normalisation over the batch, attention across
    examples) differs, and under accumulation its micro-batches would give other reps than
    the full batch. Run it once, outside the training step, on a small batch, with the
    arguments the step takes (one micro-batch per row: one scan step per example).

    Args:
      *args: ``encode``'s arguments (a sample batch).
      rtol: the largest relative difference accepted.
      **kwargs: ``encode``'s keyword arguments.

    Returns:
      ``{"reps": ..., "grads": ...}``, the relative differences found.

    Raises:
      ValueError: a difference above ``rtol``, or the transform has ``rng_argnums`` (the
        batch and each row alone would draw different numbers: check with dropout off).

    >>> import jax.numpy as jnp
    >>> import jaxaccum
    >>> def centred(w, x):  # subtracts the batch's mean: mixes the rows
    ...   z = x @ w
    ...   return z - jnp.mean(z, axis=0)
    >>> step = jaxaccum.cached_value_and_grad(centred, lambda w, z, x: jnp.sum(z ** 2),
    ...                                       num_micro_batches=2)
    >>> step.check_encode(jnp.ones((3, 2)), jnp.arange(12.0).reshape(4, 3))
    Traceback (most recent call last):
    ...
    ValueError: check_encode: encode's reps computed from each example alone differ ...
    """
    if self.forward.roles.rng_argnums:
      raise ValueError(
          f"check_encode: this transform has rng_argnums={self.forward.roles.rng_argnums!r}, but "
          "the batch and each row alone draw different random numbers, so their reps differ "
          "for that reason alone. Check a deterministic version of encode (dropout off): "
          "build the check's transform without rng_argnums.")
    if not (_validate.is_real(rtol) and rtol > 0):
      raise ValueError(f"check_encode: rtol must be a positive number, got rtol={rtol!r}.")
    forward, backward = (
        dataclasses.replace(o, split=dataclasses.replace(o.split, count=None, size=1),
                            parallel=None) for o in (self.forward, self.backward))
    roles = self.roles(args, kwargs)
    params = [args[j] for j in roles.diff]
    whole, vjp = jax.vjp(lambda ps: self.encode(*_with(args, roles.diff, ps), **kwargs),
                         params)
    rng = np.random.default_rng(0)
    cotangent = [jnp.asarray(rng.standard_normal(np.shape(x)), x.dtype)
                 for x in _inexact_leaves(whole)]
    float_whole, rebuild = _inexact_parts(whole)
    (grads_whole,) = vjp(rebuild(cotangent))
    _, rows, _, _ = _transforms.Evaluate(forward).run(args, kwargs, None)
    _, _, grads_alone, _ = _transforms.ValueAndGrad(backward).run(
        args, {**kwargs, _COTANGENT: cotangent}, None)
    found = {"reps": _stats.relative_difference(_inexact_leaves(rows), float_whole),
             "grads": _stats.relative_difference(grads_alone, grads_whole)}
    if not _stats.within(found, float(rtol)):
      raise ValueError(
          "check_encode: encode's reps computed from each example alone differ from the "
          f"batch's (relative difference {found['reps']:.3g} in the reps and "
          f"{found['grads']:.3g} in their VJP, above rtol={rtol:g}), so encode mixes the "
          "rows of its batch (BatchNorm's batch statistics, a normalisation over the "
          "batch, attention across examples). cached_value_and_grad encodes each "
          "micro-batch alone, where such an encoder computes something else: make it "
          "row-independent (GroupNorm or LayerNorm for BatchNorm) and move what couples the "
          "rows into loss, which sees the whole batch's reps.")
    return found


# --- Checks and helpers --------------------------------------------------------------------


def check_reps(reps: PyTree, rows: int) -> None:
  """Every leaf of ``reps`` is an array with a leading axis of the micro-batch's ``rows``."""
  leaves = jax.tree_util.tree_leaves_with_path(reps)
  if not leaves:
    raise TypeError(
        f"encode must return reps, a pytree of arrays with one row per example, got "
        f"{describe(reps)}.")
  for path, leaf in leaves:
    shape = getattr(leaf, "shape", None)
    if shape is None or getattr(leaf, "dtype", None) is None:
      raise TypeError(
          f"encode must return reps whose leaves are arrays with one row per example, but "
          f"leaf {jax.tree_util.keystr(path) or '(root)'} is {describe(leaf)}.")
    if not shape or shape[0] != rows:
      raise ValueError(
          f"encode must return reps whose every leaf has a leading axis of the micro-batch's "
          f"{rows} rows (one row per example), but leaf "
          f"{jax.tree_util.keystr(path) or '(root)'} has shape {tuple(shape)}. Return "
          "per-example representations of shape (rows, ...), and compute what depends on "
          "the whole batch (its means, its statistics) in loss, which sees every row's reps.")


def check_loss_output(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
  """``(value, aux)`` from what ``loss`` returned, checked: a floating scalar value."""
  aux = None
  if has_aux:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
          f"loss must return (value, aux) with has_aux=True, got {describe(out)}. Return a "
          "pair, or pass has_aux=False.")
    out, aux = out
  shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
  if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    hint = (" It is a pair: if loss returns (value, aux), pass has_aux=True."
            if isinstance(out, (tuple, list)) and len(out) == 2 and not has_aux else
            " Reduce it over the batch inside loss (e.g. jnp.mean)." if shape else "")
    raise TypeError(
        f"loss must return a floating scalar (the whole batch's loss) to be differentiated, "
        f"got {describe(out)}.{hint}")
  return out, aux


def _is_inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _inexact_leaves(tree: PyTree) -> list:
  """The leaves that carry a gradient (integer reps, such as a token count, carry none)."""
  return [x for x in jax.tree.leaves(tree) if _is_inexact(x)]


def _inexact_parts(tree: PyTree) -> tuple[list, Callable[[list], PyTree]]:
  """The inexact leaves of ``tree``, and how to put cotangents for them back into its
  structure (``float0`` zeros for the others, as :func:`jax.vjp` takes them)."""
  flat, treedef = jax.tree.flatten(tree)

  def rebuild(values: list) -> PyTree:
    it = iter(values)
    return jax.tree.unflatten(treedef, [
        next(it) if _is_inexact(x) else np.zeros(np.shape(x), jax.dtypes.float0)
        for x in flat])

  return [x for x in flat if _is_inexact(x)], rebuild


def _with(args: tuple, positions: tuple[int, ...], values: Sequence[Any]) -> list:
  out = list(args)
  for j, v in zip(positions, values, strict=True):
    out[j] = v
  return out


def _summed_dtype(params: list, accumulator_dtype: Any) -> Any:
  """The dtype pass (c) returns its accumulated gradients in, for (b)'s to be added before
  the one cast: the widest accumulator dtype of the parameters (the core's rule)."""
  dtypes = [_reduce.accumulator_dtype_for(jnp.result_type(x), accumulator_dtype)
            for x in jax.tree.leaves(params) if _is_inexact(x)]
  return jnp.result_type(*dtypes) if dtypes else None


def _placed(tree: PyTree, opts: Options, *, sharded: bool) -> PyTree:
  """Under ``data_axis``: ``tree`` replicated over the mesh (the reps, all-gathered so that
  ``loss`` sees the global batch), or (``sharded``, the reps' cotangent for pass (c)) with
  its rows over the data axes as the batch's, where the mesh's types say so (``Explicit``
  axes: a local slice of the replicated cotangent); with ``Auto`` axes the cotangent stays
  replicated, so that the compiler runs ``loss``'s backward pass whole, and pass (c) takes
  its rows."""
  dp = opts.parallel
  if dp is None:
    return tree
  axes = dp.axis

  def one(x):
    typed = jax.typeof(x).sharding.mesh
    if not typed.empty and typed.explicit_axes:  # the type names the mesh
      spec = PartitionSpec(axes) if sharded else PartitionSpec()
      return jax.sharding.reshard(x, NamedSharding(typed, spec))
    mesh = dp.mesh
    if mesh is None and isinstance(getattr(x, "sharding", None), NamedSharding):
      mesh = x.sharding.mesh  # placed, outside jit (data_axis="auto")
    if isinstance(mesh, jax.sharding.Mesh):
      return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))
    if jax.sharding.get_abstract_mesh().empty:
      return x  # no mesh in context: nothing is sharded
    return jax.lax.with_sharding_constraint(x, PartitionSpec())

  return jax.tree.map(one, tree)
