"""jaxaccum: exact gradient accumulation for JAX.

One jitted ``lax.scan`` over micro-batches inside your train step returns exactly the
full-batch loss and gradients (mean, sum and token-weighted losses), with float32
accumulation, per-micro-batch RNG keys and mutable state threaded through.

The top level is the accumulation core. Three public modules hold the rest, each loaded on
first use: :mod:`jaxaccum.dp` (DP-SGD: per-example clipping, noise, the checks),
:mod:`jaxaccum.planning` (the planner's tools: collectives, described GPUs) and
:mod:`jaxaccum.contrib` (research, or measured as not winning). The framework adapters are
``jaxaccum.nnx``, ``jaxaccum.linen`` and ``jaxaccum.eqx``.
"""

import importlib
import warnings
from typing import TYPE_CHECKING

from jaxaccum._api import evaluate as evaluate
from jaxaccum._api import grad as grad
from jaxaccum._api import value_and_grad as value_and_grad
from jaxaccum._core._info import AccumInfo as AccumInfo
from jaxaccum._core._options import Terms as Terms
from jaxaccum._core._split import merge_micro_batches as merge_micro_batches
from jaxaccum._core._split import split_micro_batches as split_micro_batches
from jaxaccum._core._transform import BatchBroadcastWarning as BatchBroadcastWarning
from jaxaccum._parallel._axes import DataParallel as DataParallel

__version__ = "0.1.0"

if TYPE_CHECKING:  # what `__getattr__` returns, for type checkers and editors
  from jaxaccum import contrib as contrib
  from jaxaccum import dp as dp
  from jaxaccum import eqx as eqx
  from jaxaccum import linen as linen
  from jaxaccum import nnx as nnx
  from jaxaccum import planning as planning
  from jaxaccum._batch_size._multisteps import MultiSteps as MultiSteps
  from jaxaccum._batch_size._multisteps import MultiStepsState as MultiStepsState
  from jaxaccum._batch_size._noise import NoiseScale as NoiseScale
  from jaxaccum._batch_size._noise import NoiseScaleState as NoiseScaleState
  from jaxaccum._batch_size._ramp import batch_size_ramp as batch_size_ramp
  from jaxaccum._batch_size._ramp import batch_size_ramp_by_count as batch_size_ramp_by_count
  from jaxaccum._coupled import cached_value_and_grad as cached_value_and_grad
  from jaxaccum._parallel._local import local_value_and_grad as local_value_and_grad
  from jaxaccum._planning._plan import Plan as Plan
  from jaxaccum._planning._plan import PlanCandidate as PlanCandidate
  from jaxaccum._planning._plan import plan as plan
  from jaxaccum._planning._plan import plan_step as plan_step

# The public modules, loaded on first use: the adapters import their framework, the tiers
# their wings, so that `import jaxaccum` loads the accumulation core only.
_SUBMODULES = ("nnx", "linen", "eqx", "dp", "planning", "contrib")

# Core names defined in modules that `import jaxaccum` does not load (name -> module).
_LAZY = {
    "MultiSteps": "jaxaccum._batch_size._multisteps",
    "MultiStepsState": "jaxaccum._batch_size._multisteps",
    "NoiseScale": "jaxaccum._batch_size._noise",
    "NoiseScaleState": "jaxaccum._batch_size._noise",
    "batch_size_ramp": "jaxaccum._batch_size._ramp",
    "batch_size_ramp_by_count": "jaxaccum._batch_size._ramp",
    "cached_value_and_grad": "jaxaccum._coupled",
    "local_value_and_grad": "jaxaccum._parallel._local",
    "Plan": "jaxaccum._planning._plan",
    "PlanCandidate": "jaxaccum._planning._plan",
    "plan": "jaxaccum._planning._plan",
    "plan_step": "jaxaccum._planning._plan",
}

# Names that left the top level (name -> their public module). They keep working for one
# release, with a DeprecationWarning naming the new place, once per name per process.
_MOVED = {
    **dict.fromkeys(
        ("per_example_value_and_grad", "ClipPerExample", "clip_per_example", "dp_noise",
         "DpNoiseState", "dp_optimizer", "check_dp_chain", "check_per_example_loss",
         "place_padding_last"), "jaxaccum.dp"),
    **dict.fromkeys(
        ("collectives", "Collective", "Collectives", "capture_gpu_target", "target_mesh"),
        "jaxaccum.planning"),
    **dict.fromkeys(
        ("AdaptiveBatch", "AdaptiveBatchState", "Seesaw", "SeesawState", "seesaw",
         "RowFeeder", "place_active_rows", "pipeline", "pipeline_schedule"),
        "jaxaccum.contrib"),
}
_WARNED: set[str] = set()


def __getattr__(name: str):
  if name in _SUBMODULES:
    return importlib.import_module(f"jaxaccum.{name}")
  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later reads find it without this hook
    return value
  if name in _MOVED:
    home = _MOVED[name]
    if name not in _WARNED:
      _WARNED.add(name)
      warnings.warn(
          f"jaxaccum.{name} moved to {home}.{name}; the old name will be removed in the "
          f"next release: use {home}.{name} (from {home} import {name}).",
          DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)
  raise AttributeError(f"module 'jaxaccum' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_SUBMODULES, *_LAZY})


__all__ = (
    "AccumInfo",
    "BatchBroadcastWarning",
    "DataParallel",
    "MultiSteps",
    "MultiStepsState",
    "NoiseScale",
    "NoiseScaleState",
    "Plan",
    "PlanCandidate",
    "Terms",
    "batch_size_ramp",
    "batch_size_ramp_by_count",
    "cached_value_and_grad",
    "evaluate",
    "grad",
    "local_value_and_grad",
    "merge_micro_batches",
    "plan",
    "plan_step",
    "split_micro_batches",
    "value_and_grad",
)

# Modules whose names start with an underscore are private: they are not public API and
# may change without notice.
