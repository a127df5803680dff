"""What ``fun`` returns, checked and taken apart: the loss terms, new state and aux.

:func:`unpack` splits one call's output into the terms' numerators and denominators, the
new state and aux, raising a ``TypeError`` that names what is wrong and how to fix it;
:func:`check_state` checks the new state against the state passed in.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._core import _reduce
from jaxaccum._core._options import Options
from jaxaccum._core._validate import describe as _describe


def _check_scalar(name: str, value: Any, what: str, hint: str = "") -> jax.Array:
  shape = getattr(value, "shape", None)
  dtype = getattr(value, "dtype", None)
  if shape is None or dtype is None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return jnp.asarray(value)  # a Python number, e.g. x.shape[0] as a denominator
    raise TypeError(f"{name} must be a scalar array {what}, got {_describe(value)}.{hint}")
  if shape != ():
    raise TypeError(
        f"{name} must be a scalar {what}, got {_describe(value)}. Reduce it over the "
        "micro-batch inside fun (e.g. jnp.mean) before returning it.")
  return value


def _check_real(name: str, value: jax.Array, evaluating: bool = False) -> None:
  if not jnp.issubdtype(value.dtype, jnp.floating):
    why = ("to be reduced as a loss term (means divide it)" if evaluating else
           "to be differentiated")
    hint = (" An integer count belongs in aux (has_aux=True), where it is summed." if
            evaluating else "")
    raise TypeError(
        f"{name} must have a floating dtype {why}, got {_describe(value)}. "
        f"Cast it with .astype(jnp.float32).{hint}")


def _term_value(opts: Options, term: _reduce.Term, value: Any):
  """One term's (numerator, denominator-or-None) from fun's value."""
  where = "the value returned by fun" if not term.path else f"loss term {term.label}"
  if term.kind.pair:
    what = f"reduce={term.kind!r}" if not term.path else f"loss term {term.label}"
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
      raise TypeError(
          f"{what} needs fun to return "
          f"{'its value' if not term.path else 'the term'} as (numerator, denominator), "
          "e.g. (summed token loss, number of real tokens)"
          f"{' with aux as ((numerator, denominator), aux)' if opts.has_extra else ''}; "
          f"got {_describe(value)}.")
    num = _check_scalar(f"the numerator of {what}", value[0], "(the summed loss)")
    _check_real(f"the numerator of {what}", num, opts.evaluating)
    den = _check_scalar(f"the denominator of {what}", value[1], "(the count or total weight)")
    if not (jnp.issubdtype(den.dtype, jnp.integer) or jnp.issubdtype(den.dtype, jnp.floating)):
      raise TypeError(
          f"the denominator of {what} must be a number, got dtype {den.dtype}.")
    return num, lax.stop_gradient(den)
  hint = ""
  if isinstance(value, (tuple, list)):
    hint = (
        f" It is a {type(value).__name__} of {len(value)}: if fun returns (loss, aux), pass "
        "has_aux=True; if it returns (numerator, denominator) such as (summed token loss, "
        "token count), pass reduce='weighted'.")
  num = _check_scalar(where, value, term.kind.returns, hint)
  _check_real(where, num, opts.evaluating)
  return num, None


def _check_unnamed_terms(reduce: dict, value: dict, path: tuple = (), top: Any = None) -> None:
  """Raises if ``value`` holds a loss term that the dict ``reduce`` does not name."""
  top = reduce if top is None else top
  for key in value:
    if key not in reduce:
      label = "".join(f"[{k!r}]" for k in (*path, key)) if path else repr(key)
      example = (f"reduce={{{', '.join(f'{k!r}: {v!r}' for k, v in top.items())}, "
                 f"{key!r}: ...}}" if not path else f"reduce{label[:-len(repr(key)) - 2]}"
                 f"[{key!r}] = ...")
      raise TypeError(
          f"fun returned loss term {label}, which reduce={top!r} does not name, so it "
          f"would be dropped. Name it in reduce ({example}), or drop it from the returned "
          "dict; a value to report but not train on goes in aux (has_aux=True).")
    if isinstance(reduce[key], dict) and isinstance(value[key], dict):
      _check_unnamed_terms(reduce[key], value[key], (*path, key), top)


def unpack(opts: Options, out: Any):
  """Splits fun's output into (term numerators, term denominators, new_state, aux)."""
  if opts.has_extra:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      wants = ("(value, aux)" if opts.has_aux and not opts.roles.state_argnums else
               "(value, new_state)" if not opts.has_aux else "(value, (new_state, aux))")
      raise TypeError(
          f"fun must return {wants} because "
          f"{'has_aux=True' if opts.has_aux else 'state_argnums is set'}, got {_describe(out)}.")
    value, extra = out
  else:
    value, extra = out, None
  if opts.single_term:
    pairs = [_term_value(opts, opts.terms[0], value)]
  else:
    if not isinstance(value, dict):
      raise TypeError(
          f"reduce={opts.reduce!r} is a dict of loss terms, so fun must return its value as a "
          f"dict with the same keys, got {_describe(value)}.")
    pairs = []
    for term in opts.terms:
      try:
        v = _reduce.get_path(value, term.path)
      except (KeyError, IndexError, TypeError):
        raise TypeError(
            f"reduce names loss term {term.label}, but the value fun returned has keys "
            f"{sorted(value)}. Return every term that reduce names.") from None
      pairs.append(_term_value(opts, term, v))
    _check_unnamed_terms(opts.reduce, value)
  nums, dens = zip(*pairs, strict=True)
  if opts.roles.state_argnums:
    if opts.has_aux:
      if not (isinstance(extra, (tuple, list)) and len(extra) == 2):
        got = _describe(extra) if hasattr(extra, "shape") else type(extra).__name__
        raise TypeError(
            "with state_argnums and has_aux=True, fun must return (value, (new_state, aux)), "
            f"got (value, {got}). If fun returns (value, new_state) with no aux, drop "
            "has_aux=True.")
      new_state, aux = extra
    else:
      new_state, aux = extra, None
  else:
    new_state, aux = None, extra
  for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) and not isinstance(
        leaf, (int, float, complex, np.generic)):
      raise TypeError(
          f"aux leaf {jax.tree_util.keystr(path) or '(root)'} is {_describe(leaf)}, not an "
          "array: every leaf of aux must be a JAX array (a string or other Python object "
          "cannot leave the compiled loop). Return it outside the accumulated function, or "
          "as an array.")
  return nums, dens, new_state, aux


def check_state(opts: Options, positions: tuple[int, ...], state_in: tuple,
                 new_state: Any) -> tuple:
  """Checks that fun returned state shaped like its state arguments; returns it as a tuple."""
  if opts.roles.state_is_tuple and (not isinstance(new_state, (tuple, list))
                              or len(new_state) != len(state_in)):
    raise TypeError(
        f"state_argnums={opts.roles.state_argnums} is a tuple, so fun must return the new states "
        f"as a tuple of {len(state_in)}, got {_describe(new_state)}.")
  got = tuple(new_state) if opts.roles.state_is_tuple else (new_state,)
  out = []
  for j, old, new in zip(positions, state_in, got, strict=True):
    s_old, s_new = jax.tree.structure(old), jax.tree.structure(new)
    if s_old != s_new:
      # A FrozenDict passed in comes back as a plain dict from Linen's apply: same leaves.
      if [p for p, _ in jax.tree_util.tree_leaves_with_path(old)] == \
          [p for p, _ in jax.tree_util.tree_leaves_with_path(new)]:
        new = jax.tree.unflatten(s_old, jax.tree.leaves(new))
      else:
        raise TypeError(
            f"the new state returned by fun for state {opts.label(j)} has structure "
            f"{s_new}, but the state passed in has structure {s_old}. Return the updated "
            "state with the same structure as the input.")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new),
                            strict=True):
      if a.shape != b.shape or a.dtype != b.dtype:  # jnp.dtype() rejects PRNG key dtypes
        raise TypeError(
            f"the new state leaf {jax.tree_util.keystr(path)} of state {opts.label(j)} is "
            f"{_describe(b)}, but the input is {_describe(a)}. Keep each state leaf's shape "
            "and dtype.")
    out.append(new)
  return tuple(out)


def pack(value: Any, extra: Any, grads: Any, info: Any, *, has_extra: bool,
         with_info: bool) -> tuple:
  """:func:`jaxaccum.value_and_grad`'s output: ``(value, grads)``, ``((value, extra), grads)``,
  and ``info`` last with ``with_info``. The adapters return theirs through it too."""
  out = ((value, extra), grads) if has_extra else (value, grads)
  return (*out, info) if with_info else out
