"""The batch-size wing: how many micro-batches a step runs, and how the batch is fed.

``_noise`` smooths each step's :class:`jaxaccum.AccumInfo` estimates of ``|G|^2`` and
``tr(Sigma)`` into the noise scale (``NoiseScale``); ``_multisteps`` accumulates across calls,
one optimizer step per window of ``k`` calls, like ``optax.MultiSteps`` (``MultiSteps``);
``_counter`` counts the samples (rows or tokens) seen, exactly, in two int32 words of a
state; ``_adaptive`` is a controller on ``NoiseScale`` that moves ``k``
(``active_micro_batches`` or a ``MultiSteps`` window) as the noise says a larger batch pays,
with a counter (``AdaptiveBatch``); ``_ramp`` gives ``k`` as a schedule of the step or of the
samples seen, reading any state's counter (``batch_size_ramp``, ``batch_size_ramp_by_count``);
``_seesaw`` turns a reference schedule's learning-rate decay into a ramp of ``k`` read by
``_ramp``, with a counter of its own and a guard on ``NoiseScale`` (``seesaw``); ``_rows``
feeds the loader's fresh rows only to the ``k`` micro-batches that run (``place_active_rows``,
``RowFeeder``). Their scalar checks are ``jaxaccum._core._validate``'s. The wing sits below the
API: ``AdaptiveBatch.check`` reads a transform's ``options`` without importing ``_api``.
The package re-exports the core's names only; ``jaxaccum.contrib`` holds the controllers'.
"""

from jaxaccum._batch_size._multisteps import MultiSteps as MultiSteps
from jaxaccum._batch_size._multisteps import MultiStepsState as MultiStepsState
from jaxaccum._batch_size._noise import NoiseScale as NoiseScale
from jaxaccum._batch_size._noise import NoiseScaleState as NoiseScaleState
from jaxaccum._batch_size._ramp import batch_size_ramp as batch_size_ramp
from jaxaccum._batch_size._ramp import batch_size_ramp_by_count as batch_size_ramp_by_count
