"""``fission_splits``: operator fission alone — the splits ``fission`` chooses, no remat on top.

An ablation of ``fission`` for measuring what splitting regions buys by itself (issue 4's
"the loss-region fission alone cuts the peak by 2x"): the same search over regions, parts and
dimensions, scored on the simulator, but nothing is handed to ``hotspot`` afterwards, so the
plan runs the split graph in its captured order with no recomputation. Within a budget the
split graph must fit by itself; otherwise ``BudgetInfeasible`` names the smallest peak.

Example:
    >>> from fitgraph.solvers.base import SOLVERS
    >>> SOLVERS["fission_splits"].__name__
    'solve_fission_splits'
"""

from __future__ import annotations

from dataclasses import replace

from ..base import BudgetInfeasible, Problem, Solution, register
from .search import FissionConfig, solve_fission

__all__ = ["solve_fission_splits"]


@register("fission_splits")
def solve_fission_splits(problem: Problem) -> Solution:
    """``fission`` with ``FissionConfig(remat=False)``."""
    try:
        sol = solve_fission(problem, config=FissionConfig(remat=False))
    except BudgetInfeasible as e:
        raise BudgetInfeasible(e.budget_bytes, e.smallest_peak_bytes, e.dominated_by,
                               "fission_splits") from None
    sol.plan.meta["solver"] = "fission_splits"
    return replace(sol, solver="fission_splits")
