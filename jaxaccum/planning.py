"""``jaxaccum.planning``: reading and predicting compiled programs, without running them.

:func:`collectives` reads the collectives of a compiled step (and where they sit in its
loops) from its HLO text; :func:`target_mesh` and :func:`capture_gpu_target` compile for
described GPUs from a host without one (the ``gpu-plan`` extra). :func:`plan` and
:func:`plan_step`, which pick the fewest micro-batches whose compiled step fits a memory
budget, live at the top level and are re-exported here. See the planning guide.
"""

from jaxaccum._planning._collectives import Collective as Collective
from jaxaccum._planning._collectives import Collectives as Collectives
from jaxaccum._planning._collectives import collectives as collectives
from jaxaccum._planning._gpu_target import capture_gpu_target as capture_gpu_target
from jaxaccum._planning._gpu_target import target_mesh as target_mesh
from jaxaccum._planning._plan import Plan as Plan
from jaxaccum._planning._plan import PlanCandidate as PlanCandidate
from jaxaccum._planning._plan import plan as plan
from jaxaccum._planning._plan import plan_step as plan_step

__all__ = (
    "Collective",
    "Collectives",
    "Plan",
    "PlanCandidate",
    "capture_gpu_target",
    "collectives",
    "plan",
    "plan_step",
    "target_mesh",
)
