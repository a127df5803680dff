"""The per-example wing: each example's gradient transformed (DP-SGD's clip) before the sum.

``_rule`` is what the core sees: its ``attach`` makes the ``per_example=`` transform given to the
options a ``PerExampleRule``, the core's micro-batch rule for one micro-batch's
examples under ``vmap`` (it brings its own carry entry: the per-example norms); ``_clip`` is
DP-SGD's clip (``clip_per_example`` and its record ``ClipPerExample``), which the rule
recognises; ``_ghost`` forms the clipped sum from per-example norms read from the traced
program (one walk of sub-programs, a table of site rules), without the
per-example gradients (a sub-package; its README.md holds the design notes); ``_dp`` holds
DP-SGD's noise (``dp_noise``, ``dp_optimizer``) and its checks. Only this wing imports the
ghost analysis (``tests/test_architecture.py``).
"""
