"""``ilp``: the exact reference — Checkmate's MILP, solved with HiGHS (``scipy.optimize.milp``).

Stage ``t`` of a schedule computes unit ``t`` (``solvers.remat.stages``) after recomputing any earlier
units it chooses. Binary ``R[t,i]``: unit ``i`` is (re)computed in stage ``t``; binary
``S[t,i]``: unit ``i``'s output is kept from stage ``t-1`` into stage ``t``; ``FREE[t,i,k]``:
``i`` is freed right after ``k`` runs in stage ``t`` (continuous: it only lowers memory, so the
solver sets it to the product of its binary conditions, Checkmate's linearisation written as
upper bounds); ``U[t,k]``: bytes live while ``k`` runs in stage ``t``. Constraints: a unit runs
only when every unit it reads is recomputed earlier in the stage or kept; a value is kept only
if it existed in the previous stage; ``U[t,k]`` plus ``k``'s workspace stays within the budget.
Objective: total compute time. With a ``latency_limit`` it minimises the peak instead. One
redundant knapsack row per stage, on the keep binaries alone (``_stage_end_knapsacks``), gives
HiGHS rows to cut on where Checkmate's relaxation is weakest.

Unlike ``remat_plan`` (each dropped value recomputed once, at its first backward use) a unit may
be recomputed in any stage and any number of times, so the optimum bounds every remat solver
working on the same graph and memory model. The schedule becomes a Plan through
``plan.staged``; the simulator checks the budget (the MILP's accounting is never below it).
Variables exist only where they can matter (a unit's live range, extended through the units
that could recompute from it), so graphs of a few hundred units solve; ``time_budget_s`` caps
HiGHS, and the Solution reports the proven gap (``optimal``/``gap``) and which HiGHS ran
(``notes["highs"]``). The model is written in ``ilp_model``, HiGHS run in ``ilp_highs``
(``HighsConfig``: its log, more options for experiments: ``solve_stages(..., highs=...)``).

Example:
    >>> from fitgraph.solvers.remat.ilp import solve_ilp
    >>> from fitgraph.solvers.base import SOLVERS
    >>> SOLVERS["ilp"] is solve_ilp
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ...graph.ir import Graph
from ...plan.instructions import Compute, Plan, Recompute
from ...plan.staged import staged_plan
from ...sim.simulate import simulate
from ..base import BudgetInfeasible, Problem, Solution, dominated_by, register
from .ilp_highs import HighsConfig, solve_milp
from .ilp_model import MS, MilpSchedule, Model
from .stages import StageGraph, stage_graph

__all__ = ["HighsConfig", "IlpResult", "plan_to_stages", "solve_ilp", "solve_stages"]

FEAS_TOL = 1e-7    # HiGHS's default primal feasibility tolerance
DEFAULT_HIGHS = HighsConfig()
REPAIRS = 3        # NOTE: re-solves allowed to undo an overshoot within HiGHS's tolerance
START_SHARE = 0.2  # NOTE: share of the time budget the warm start may take


@dataclass(frozen=True)
class IlpResult:
    recompute: list[list[int]]     # stage -> units recomputed before the stage's own unit
    status: str                    # "optimal", "time limit", "infeasible"
    objective: float               # seconds (budget mode) or bytes (latency mode)
    gap: float                     # proven relative gap (0 when optimal)
    variables: int
    rows: int
    tolerance_bytes: float = 0.0   # how far HiGHS's row tolerance can put memory over the budget
    route: str = ""                # which HiGHS solved it (``ilp_highs``)


def solve_stages(sg: StageGraph, budget_bytes: int | None = None,
                 latency_limit_s: float | None = None,
                 time_limit_s: float = 60.0,
                 start: list[list[int]] | None = None, relaxed: bool = False,
                 highs: HighsConfig = DEFAULT_HIGHS) -> IlpResult:
    """Solve Checkmate's MILP on a stage graph: least compute time within ``budget_bytes``, or
    least peak within ``latency_limit_s`` (seconds of total compute). ``start``: a known
    schedule (stage -> recomputed units) HiGHS starts from; it never changes the optimum.
    ``relaxed``: the LP relaxation instead (every binary in [0, 1]): its objective is the
    root bound branch-and-bound starts from; its ``recompute`` is not a schedule.

    Memory is per storage (a unit's outputs are freed one by one, as the simulator does):
    ``S[t,v]`` keeps storage ``v``; ``R[t,i]`` (re)makes all of unit ``i``'s storages."""
    ms = MilpSchedule(sg)
    points = ms.presence_rows()
    latency_mode = budget_bytes is None
    peak_var = ms.m.var(("B",), False, upper=np.inf) if latency_mode else None
    cap = np.inf if latency_mode else (budget_bytes - sg.resident_bytes) / ms.byte_unit
    ms.memory_rows(points, cap, peak_var)
    if not latency_mode:
        ms.stage_end_knapsacks(cap)
    c, base_s = ms.objective(peak_var, latency_limit_s)
    chain = max(map(len, points), default=0) + 2
    if relaxed:
        ms.m.integral = [0] * len(ms.m.integral)
    return _run(ms.m, c, sg, len(sg.units), time_limit_s, latency_mode, base_s,
                ms.start(start) if start is not None else None, ms.byte_unit,
                ms.byte_unit * FEAS_TOL * 10 * chain, highs)


def _run(m: Model, c, sg: StageGraph, n: int, time_limit_s: float, latency_mode: bool,
         base_s: float, start: dict[int, float] | None, byte_unit: float,
         tolerance_bytes: float, highs: HighsConfig) -> IlpResult:
    from scipy.sparse import coo_matrix

    nv, nr = len(m.integral), len(m.rows)
    rr, cc, vv, lo, hi = [], [], [], [], []
    for r, (terms, a, b) in enumerate(m.rows):
        for k, v in terms.items():
            rr.append(r)
            cc.append(k)
            vv.append(v)
        lo.append(a)
        hi.append(b)
    A = coo_matrix((vv, (rr, cc)), shape=(nr, nv)).tocsc()
    # NOTE: the constant part of the objective (the step's own compute, or the resident
    # bytes) goes in as an offset, so HiGHS's gap is relative to the whole step
    offset = sg.resident_bytes / byte_unit if latency_mode else base_s / MS
    x, status, fun, gap, route = solve_milp(c, A, np.array(lo), np.array(hi),
                                            np.array(m.upper), np.array(m.integral),
                                            time_limit_s, start, offset, highs)
    if x is None:
        return IlpResult([[] for _ in range(n)], status, float("nan"), float("inf"), nv, nr,
                         tolerance_bytes, route)
    recompute: list[list[int]] = [[] for _ in range(n)]
    for key, k in m.index.items():
        if key[0] == "R" and x[k] > 0.5:
            recompute[key[1]].append(key[2])
    for r in recompute:
        r.sort()
    objective = fun * byte_unit if latency_mode else fun * MS
    return IlpResult(recompute, status, objective, gap, nv, nr, tolerance_bytes, route)


def plan_to_stages(graph: Graph, sg: StageGraph, plan: Plan) -> list[list[int]] | None:
    """The staged schedule a Plan runs (stage -> recomputed units), or None when the plan
    computes units in another order than the stages."""
    head = {u.members[0]: i for i, u in enumerate(sg.units)}
    tail = {u.members[-1]: i for i, u in enumerate(sg.units)}
    out: list[list[int]] = [[] for _ in sg.units]
    pending: list[int] = []
    expect = 0
    for ins in plan:
        if isinstance(ins, Recompute) and ins.node in head:
            pending.append(head[ins.node])
        elif isinstance(ins, Compute) and ins.node in tail:
            if tail[ins.node] != expect:
                return None
            out[expect] = sorted(pending)
            pending, expect = [], expect + 1
    return out if expect == len(sg.units) and not pending else None


@register("ilp")
def solve_ilp(problem: Problem) -> Solution:
    t0 = time.perf_counter()
    g, cm = problem.graph, problem.cost_model
    sg = stage_graph(g, cm)
    limit_s = None
    eager = simulate(g, staged_plan(g, sg, [[] for _ in sg.units]), cm)
    if problem.latency_limit is not None:
        limit_s = problem.latency_limit * eager.latency_s
    start = _production_start(problem, sg)
    left = max(problem.time_budget_s - (time.perf_counter() - t0), 1.0)
    res = solve_stages(sg, problem.budget_bytes, limit_s, left, start)
    for _ in range(REPAIRS):
        over = _overshoot(g, sg, res, problem.budget_bytes, cm)
        if not 0 < over <= res.tolerance_bytes:
            break
        # NOTE: over the budget by what HiGHS's tolerance allows: ask again with that much less
        left = max(problem.time_budget_s - (time.perf_counter() - t0), 1.0)
        res = solve_stages(sg, problem.budget_bytes - over, limit_s, left, res.recompute)
    if res.status == "infeasible" and problem.budget_bytes is not None:
        floor = solve_stages(sg, None, float("inf"), left, [[] for _ in sg.units])
        fsim = (simulate(g, staged_plan(g, sg, floor.recompute), cm)
                if floor.status != "infeasible" else eager)
        raise BudgetInfeasible(problem.budget_bytes, fsim.peak_bytes, dominated_by(fsim), "ilp")
    if res.status == "time limit" and res.objective != res.objective:  # NaN: no schedule
        raise BudgetInfeasible(problem.budget_bytes or 0, eager.peak_bytes, dominated_by(eager),
                               "ilp (no schedule found within the time limit)")
    plan = staged_plan(g, sg, res.recompute)
    sim = simulate(g, plan, cm)
    if problem.budget_bytes is not None and sim.peak_bytes > problem.budget_bytes:
        raise AssertionError(f"ilp: the schedule simulates at {sim.peak_bytes} bytes, over the "
                             f"budget {problem.budget_bytes} its model promised: a modelling bug")
    return Solution(plan, sim, "ilp", time.perf_counter() - t0,
                    optimal=res.status == "optimal", gap=res.gap,
                    notes={"status": res.status, "objective": res.objective,
                           "variables": res.variables, "rows": res.rows,
                           "units": len(sg.units), "recomputes": sum(map(len, res.recompute)),
                           "eager_latency_s": eager.latency_s, "highs": res.route})


def _overshoot(g: Graph, sg: StageGraph, res: IlpResult, budget: int | None, cm) -> int:
    """Bytes by which the schedule simulates over ``budget`` (0 when it fits or has none)."""
    if budget is None or res.objective != res.objective:
        return 0
    return max(0, simulate(g, staged_plan(g, sg, res.recompute), cm).peak_bytes - budget)


def _production_start(problem: Problem, sg: StageGraph) -> list[list[int]] | None:
    """The production solver's schedule as HiGHS's first incumbent (a good upper bound early
    lets branch-and-bound prune; the optimum does not depend on it)."""
    from ..base import SOLVERS
    quick = Problem(problem.graph, problem.cost_model, problem.budget_bytes,
                    problem.latency_limit, min(START_SHARE * problem.time_budget_s, 10.0))
    try:  # NOTE: stages follow the captured order: ask for a plan that keeps it
        sol = SOLVERS["hotspot"](quick, reorder=False)
    except BudgetInfeasible:
        return None
    return plan_to_stages(problem.graph, sg, sol.plan)
