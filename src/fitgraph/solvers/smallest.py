"""The plan at the smallest peak a solver reaches: what ``budget="smallest"`` plans.

A budget of the bytes that exist before the step starts (weights, optimizer state, batch) is
one no plan meets: every solver then searches as low as it can and reports the least peak it
found (``BudgetInfeasible``), keeping the plan at that peak on the error (``solution``), which
is returned as is, not searched for again at its peak (a time-bound search may not walk the
same path twice). Where no plan was kept, the solver's least-peak plan (a latency limit no plan
reaches) is returned.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers import Problem, solve
    >>> from fitgraph.solvers.smallest import solve_smallest
    >>> model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    >>> g = fitgraph.capture(model, torch.randn(512, 64), lambda m, x: m(x).square().mean())
    >>> cm = RooflineCostModel(get_device("cpu-generic"))
    >>> s = solve_smallest(g, cm, lambda p: solve(p, "hotspot"), time_budget_s=5)
    >>> eager = solve(Problem(g, cm, latency_limit=1.0), "eager")
    >>> s.sim.peak_bytes < eager.sim.peak_bytes, s.notes["smallest"].startswith("searched")
    (True, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..cost.base import CostModel
from ..graph.ir import Graph
from ..units import format_bytes
from .base import BudgetInfeasible, Problem, Solution

__all__ = ["solve_smallest"]

# NOTE: a latency limit no plan reaches: a solver then minimises the peak alone
_UNBOUNDED = 1e9


def resident_bytes(graph: Graph) -> int:
    """Bytes of the graph's inputs (weights, optimizer state, batch): what exists before the
    step starts, below which no plan peaks."""
    return sum(graph.storages[st].nbytes for st in set(graph.input_storages()))


def solve_smallest(graph: Graph, cost_model: CostModel, solve_fn: Callable[[Problem], Solution],
                   *, time_budget_s: float = 30.0, exact: bool = False) -> Solution:
    """``solve_fn``'s plan at the smallest peak it reaches on ``graph`` (see the module doc);
    ``notes["smallest"]`` says how it was found."""
    floor = resident_bytes(graph)
    problem = Problem(graph, cost_model, budget_bytes=floor, time_budget_s=time_budget_s,
                      exact=exact)
    try:
        sol = solve_fn(problem)
        how = f"the resident bytes ({format_bytes(floor)}) are within reach"
        return dataclasses.replace(sol, notes=dict(sol.notes, smallest=how))
    except BudgetInfeasible as e:
        err = e
    why = f"searched below the resident bytes ({format_bytes(floor)})"
    if err.solution is not None:
        return _noted(err.solution, f"{why}: the least peak found, kept by the solver")
    # NOTE: not planned again at the peak reported: an impossible budget costs the whole
    # search again (split_backward's minutes), and a time-bound search need not reach it twice
    least = solve_fn(dataclasses.replace(problem, budget_bytes=None, latency_limit=_UNBOUNDED))
    return _noted(least, f"{why}: the least-peak plan (a latency limit no plan reaches; "
                         f"{format_bytes(err.smallest_peak_bytes)} reported, its plan not kept)")


def _noted(sol: Solution, how: str) -> Solution:
    return dataclasses.replace(sol, notes=dict(sol.notes, smallest=how))
