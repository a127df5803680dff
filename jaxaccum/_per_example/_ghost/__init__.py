"""Per-example clipped gradient sums from ghost norms: the program analysis behind them.

:func:`clipped_sum` computes ``sum_e c_e grad_e`` (``c_e`` from each example's gradient
norm) without forming the examples' gradients where it can; :func:`rules` says, per leaf,
how it gets that leaf's norm. The modules, in the order a call runs through them:
``_walk`` (the one walk into ``jit``, ``checkpoint`` and ``scan`` bodies), ``_analysis``
(which sites, which rule), ``_rules`` (the site rules and cross terms), ``_norms`` (norm
numerics and their guards), ``_program`` (the rewritten program) and ``_clipped`` (the
entry point and its passes). README.md beside this file holds the design notes.
"""

from jaxaccum._per_example._ghost._analysis import rules
from jaxaccum._per_example._ghost._clipped import clipped_sum

__all__ = ["clipped_sum", "rules"]
