"""``jaxaccum.contrib``: research, or measured as not winning; experimental.

What is here works and is tested as the rest of the package is, but has not earned the top
level (``docs/contributing.md``, "Inclusion criteria"): each name's docstring says, in its
first paragraph, what was measured. Names here may change or leave without a deprecation
release; one that wins its measurement graduates to the top level.

- :class:`AdaptiveBatch` (with :class:`AdaptiveBatchState`): a controller that moves the
  number of micro-batches as the gradient noise says a larger batch pays;
- :func:`seesaw` (with :class:`Seesaw`, :class:`SeesawState`): a learning-rate decay turned
  into a ramp of the batch size;
- :class:`RowFeeder` and :func:`place_active_rows`: feed fresh rows only to the micro-batches
  that run when the count varies;
- :func:`pipeline` and :func:`pipeline_schedule`: GPipe and circular pipelines over a stage
  axis.

``DataParallel(overlap_grad_reduce=True)`` is experimental in the same sense (see its
docstring), though it is an option of the core's record.
"""

from jaxaccum._batch_size._adaptive import AdaptiveBatch as AdaptiveBatch
from jaxaccum._batch_size._adaptive import AdaptiveBatchState as AdaptiveBatchState
from jaxaccum._batch_size._rows import RowFeeder as RowFeeder
from jaxaccum._batch_size._rows import place_active_rows as place_active_rows
from jaxaccum._batch_size._seesaw import Seesaw as Seesaw
from jaxaccum._batch_size._seesaw import SeesawState as SeesawState
from jaxaccum._batch_size._seesaw import seesaw as seesaw
from jaxaccum._parallel._pipeline import pipeline as pipeline
from jaxaccum._parallel._pipeline import pipeline_schedule as pipeline_schedule

__all__ = (
    "AdaptiveBatch",
    "AdaptiveBatchState",
    "RowFeeder",
    "Seesaw",
    "SeesawState",
    "pipeline",
    "pipeline_schedule",
    "place_active_rows",
    "seesaw",
)
