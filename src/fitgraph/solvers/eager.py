"""The ``eager`` baseline: what eager PyTorch does (captured order, free after last use)."""

from __future__ import annotations

import time

from ..plan.eager import eager_plan
from ..sim.simulate import simulate
from .base import BudgetInfeasible, Problem, Solution, dominated_by, register

__all__ = ["solve_eager"]


@register("eager")
def solve_eager(problem: Problem) -> Solution:
    """Example:
        >>> from fitgraph.solvers.base import Problem
        >>> from fitgraph.solvers.eager import solve_eager
        >>> solve_eager.__name__
        'solve_eager'
    """
    t0 = time.perf_counter()
    plan = eager_plan(problem.graph)
    sim = simulate(problem.graph, plan, problem.cost_model)
    if problem.budget_bytes is not None and sim.peak_bytes > problem.budget_bytes:
        raise BudgetInfeasible(problem.budget_bytes, sim.peak_bytes, dominated_by(sim), "eager")
    return Solution(plan, sim, "eager", time.perf_counter() - t0)
