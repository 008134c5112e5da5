"""The solver interface: every strategy is ``solve_x(problem) -> Solution``, in one registry.

Example:
    >>> from fitgraph.solvers.base import SOLVERS
    >>> "eager" in SOLVERS and "hotspot" in SOLVERS
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..cost.base import CostModel, check_cost_model
from ..graph.ir import Graph
from ..plan.instructions import Plan
from ..sim.simulate import SimResult
from ..units import format_bytes
from .collector import fewer_collections

__all__ = ["SOLVERS", "STEP_MARGIN", "BudgetInfeasible", "EvaluatorMismatch", "Problem", "Solution",
           "register", "solve"]

# NOTE: what the user's step adds to the executor's on synthetic inputs, which the check times:
# the step's own wrapper, the real batch's inputs bound and read. Pegasus's plan checked at
# 1.087 and measured +10.4% in the sweep; ConvNeXt's at 1.095 and 1.125 in 21 paired rounds
# of its step against eager's. ``latency_check`` keeps a try where it measures within the limit
# less this; a solver that confirms its plan by measurement (``search``) leaves it that margin
STEP_MARGIN = 0.02


class BudgetInfeasible(RuntimeError):
    """No plan this solver can make peaks within the budget. ``smallest_peak_bytes`` is the
    lowest peak it reached; ``dominated_by`` names what fills that peak; ``solution`` is the
    plan at that peak where the solver kept it (else None), so that asking for the smallest
    peak (``solvers.solve_smallest``) does not search again; ``estimated``: that peak is a
    search's estimate, no plan's."""

    def __init__(self, budget_bytes: int, smallest_peak_bytes: int, dominated_by: str,
                 solver: str):
        super().__init__(f"budget {format_bytes(budget_bytes)} is infeasible for solver "
                         f"{solver!r}: the smallest peak it reaches is "
                         f"{format_bytes(smallest_peak_bytes)}, dominated by {dominated_by}")
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest_peak_bytes
        self.dominated_by = dominated_by
        self.solver = solver
        self.solution: Solution | None = None
        # NOTE: a peak priced by a search's estimates (fission's scaled costs), not a plan's
        self.estimated = False


class EvaluatorMismatch(RuntimeError):
    """A solver's fast evaluator priced its plan otherwise than the simulator (a bug in the
    evaluator, never a plan to run): the solver refuses the plan."""


@dataclass(frozen=True)
class Problem:
    """Plan ``graph`` within ``budget_bytes`` (peak, resident included) at least latency, or —
    with ``latency_limit`` (a factor of the eager step's simulated latency) — at least peak."""

    graph: Graph
    cost_model: CostModel
    budget_bytes: int | None = None
    latency_limit: float | None = None
    time_budget_s: float = 30.0
    # NOTE: only plans whose results are eager's bit for bit (remat, reordering, offloading,
    # masks kept as bits); operator fission sums in parts, so its results are only allclose
    exact: bool = False

    def __post_init__(self) -> None:
        check_cost_model(self.cost_model)
        if (self.budget_bytes is None) == (self.latency_limit is None):
            raise ValueError("give exactly one of budget_bytes and latency_limit")
        if self.latency_limit is not None and self.latency_limit < 1.0:
            raise ValueError(f"latency_limit {self.latency_limit} is below 1.0: the limit is a "
                             "factor of the eager step time (1.10 = 10% slower)")


@dataclass(frozen=True)
class Solution:
    """A plan and its simulation. ``graph``: the graph the plan runs on when the solver rewrote
    the problem's graph (operator fission); None means ``problem.graph``."""

    plan: Plan
    sim: SimResult
    solver: str
    solve_s: float
    optimal: bool | None = None      # proven optimal (exact solvers), None when unknown
    gap: float | None = None         # relative optimality gap reported by exact solvers
    notes: dict = field(default_factory=dict)
    graph: Graph | None = None

    def graph_for(self, problem_graph: Graph) -> Graph:
        """The graph to run ``plan`` on: the rewritten one if any, else ``problem_graph``."""
        return problem_graph if self.graph is None else self.graph


SOLVERS: dict[str, Callable[[Problem], Solution]] = {}
# NOTE: solvers whose plans run a rewritten graph that sums in parts (operator fission): their
# results are allclose to eager's; every other solver's are bitwise (DESIGN law 1)
NOT_BITWISE = frozenset({"fission", "fission_splits"})


def register(name: str):
    def deco(fn: Callable[[Problem], Solution]) -> Callable[[Problem], Solution]:
        SOLVERS[name] = fn
        return fn
    return deco


def solve(problem: Problem, solver: str = "hotspot") -> Solution:
    """Run a registered solver; an unknown name is an error listing the known ones."""
    if solver not in SOLVERS:
        raise KeyError(f"unknown solver {solver!r}; known: {sorted(SOLVERS)}")
    if getattr(problem, "exact", False) and solver in NOT_BITWISE:
        raise ValueError(f"solver {solver!r} splits operators (results allclose to eager's, not "
                         "bitwise): use it without exact=True, or solver 'auto' / 'hotspot' / "
                         "'joint' with exact=True")
    # NOTE: the cyclic collector's passes over the whole process were 15-29% of a solve's
    # time (solvers.collector); every solver, the classic planners' included, runs with fewer
    with fewer_collections():
        return SOLVERS[solver](problem)


def dominated_by(sim: SimResult) -> str:
    """'activations 120.0 MiB (top: _log_softmax in <top>)' — what fills a simulated peak."""
    if not sim.breakdown:
        return "nothing"
    group, nbytes = max(sim.breakdown.items(), key=lambda kv: (kv[1], kv[0]))
    top = sim.top_tensors[0] if sim.top_tensors else None
    where = f" (largest: {top.name} in {top.module or '<top>'})" if top else ""
    return f"{group} {format_bytes(nbytes)}{where}"
