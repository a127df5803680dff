"""jaxaccum: exact gradient accumulation for JAX.

One jitted ``lax.scan`` over micro-batches inside your train step returns exactly the
full-batch loss and gradients (mean, sum and token-weighted losses), with float32
accumulation, per-micro-batch RNG keys and mutable state threaded through.
"""

from typing import TYPE_CHECKING

from jaxaccum._api import evaluate as evaluate
from jaxaccum._api import grad as grad
from jaxaccum._api import per_example_value_and_grad as per_example_value_and_grad
from jaxaccum._api import value_and_grad as value_and_grad
from jaxaccum._batch_size import AdaptiveBatch as AdaptiveBatch
from jaxaccum._batch_size import AdaptiveBatchState as AdaptiveBatchState
from jaxaccum._batch_size import MultiSteps as MultiSteps
from jaxaccum._batch_size import MultiStepsState as MultiStepsState
from jaxaccum._batch_size import NoiseScale as NoiseScale
from jaxaccum._batch_size import NoiseScaleState as NoiseScaleState
from jaxaccum._batch_size import RowFeeder as RowFeeder
from jaxaccum._batch_size import Seesaw as Seesaw
from jaxaccum._batch_size import SeesawState as SeesawState
from jaxaccum._batch_size import batch_size_ramp as batch_size_ramp
from jaxaccum._batch_size import batch_size_ramp_by_count as batch_size_ramp_by_count
from jaxaccum._batch_size import place_active_rows as place_active_rows
from jaxaccum._batch_size import seesaw as seesaw
from jaxaccum._core._info import AccumInfo as AccumInfo
from jaxaccum._core._options import DataParallel as DataParallel
from jaxaccum._core._options import Terms as Terms
from jaxaccum._core._split import merge_micro_batches as merge_micro_batches
from jaxaccum._core._split import split_micro_batches as split_micro_batches
from jaxaccum._core._transform import BatchBroadcastWarning as BatchBroadcastWarning
from jaxaccum._coupled import cached_value_and_grad as cached_value_and_grad
from jaxaccum._parallel._local import local_value_and_grad as local_value_and_grad
from jaxaccum._parallel._pipeline import pipeline as pipeline
from jaxaccum._parallel._pipeline import pipeline_schedule as pipeline_schedule
from jaxaccum._per_example._clip import ClipPerExample as ClipPerExample
from jaxaccum._per_example._clip import clip_per_example as clip_per_example
from jaxaccum._per_example._dp import DpNoiseState as DpNoiseState
from jaxaccum._per_example._dp import check_dp_chain as check_dp_chain
from jaxaccum._per_example._dp import check_per_example_loss as check_per_example_loss
from jaxaccum._per_example._dp import dp_noise as dp_noise
from jaxaccum._per_example._dp import dp_optimizer as dp_optimizer
from jaxaccum._per_example._dp import place_padding_last as place_padding_last
from jaxaccum._planning._collectives import Collective as Collective
from jaxaccum._planning._collectives import Collectives as Collectives
from jaxaccum._planning._collectives import collectives as collectives
from jaxaccum._planning._gpu_target import capture_gpu_target as capture_gpu_target
from jaxaccum._planning._gpu_target import target_mesh as target_mesh
from jaxaccum._planning._plan import Plan as Plan
from jaxaccum._planning._plan import PlanCandidate as PlanCandidate
from jaxaccum._planning._plan import plan as plan
from jaxaccum._planning._plan import plan_step as plan_step

__version__ = "0.1.0"

_SUBMODULES = ("nnx", "linen", "eqx")

if TYPE_CHECKING:  # what `__getattr__` returns, for type checkers and editors
  from jaxaccum import eqx as eqx
  from jaxaccum import linen as linen
  from jaxaccum import nnx as nnx


def __getattr__(name: str):
  # The Flax adapters import flax; load them only when first used, so that
  # `import jaxaccum` needs only jax, optax and numpy.
  if name in _SUBMODULES:
    import importlib

    return importlib.import_module(f"jaxaccum.{name}")
  raise AttributeError(f"module 'jaxaccum' has no attribute {name!r}")


__all__ = (
    "AccumInfo",
    "AdaptiveBatch",
    "AdaptiveBatchState",
    "BatchBroadcastWarning",
    "ClipPerExample",
    "Collective",
    "Collectives",
    "DataParallel",
    "DpNoiseState",
    "MultiSteps",
    "MultiStepsState",
    "NoiseScale",
    "NoiseScaleState",
    "Plan",
    "PlanCandidate",
    "RowFeeder",
    "Seesaw",
    "SeesawState",
    "Terms",
    "batch_size_ramp",
    "batch_size_ramp_by_count",
    "cached_value_and_grad",
    "capture_gpu_target",
    "check_dp_chain",
    "check_per_example_loss",
    "clip_per_example",
    "collectives",
    "dp_noise",
    "dp_optimizer",
    "evaluate",
    "grad",
    "local_value_and_grad",
    "merge_micro_batches",
    "per_example_value_and_grad",
    "pipeline",
    "pipeline_schedule",
    "place_active_rows",
    "place_padding_last",
    "plan",
    "plan_step",
    "seesaw",
    "split_micro_batches",
    "target_mesh",
    "value_and_grad",
)

# Modules whose names start with an underscore are private: they are not public API and
# may change without notice.
