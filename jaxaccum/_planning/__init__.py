"""The planning wing: reading and predicting compiled programs, without running them.

``_collectives`` reads the collectives of a compiled program (and where they sit in its
loops) from its HLO text; ``_gpu_target`` compiles for described GPUs (the ``gpu-plan``
extra); ``_plan`` picks the fewest micro-batches whose compiled step fits a memory budget
(``plan``, ``plan_step``).
"""
