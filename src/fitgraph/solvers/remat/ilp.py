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
HiGHS, and the Solution reports the proven gap (``optimal``/``gap``). ``FG_HIGHS_LOG=1`` shows
HiGHS's log; ``FG_HIGHS_OPTIONS="name=value,..."`` sets more HiGHS options (experiments).

Example:
    >>> from fitgraph.solvers.remat.ilp import solve_ilp
    >>> from fitgraph.solvers.base import SOLVERS
    >>> SOLVERS["ilp"] is solve_ilp
    True
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ...graph.ir import Graph
from ...plan.instructions import Compute, Plan, Recompute
from ...plan.staged import staged_plan
from ...sim.simulate import simulate
from ..base import BudgetInfeasible, Problem, Solution, dominated_by, register
from .stages import StageGraph, stage_graph

__all__ = ["IlpResult", "plan_to_stages", "solve_ilp", "solve_stages"]

MS = 1e-3          # NOTE: time in ms keeps HiGHS's objective coefficients near 1
LARGEST_COEF = 2.0**12  # NOTE: the largest storage, in the MILP's byte unit (see _byte_unit)
FEAS_TOL = 1e-7    # HiGHS's default primal feasibility tolerance
MIP_REL_GAP = 1e-4  # NOTE: of the whole step time (or peak): 'optimal' is within 0.01%
REPAIRS = 3        # NOTE: re-solves allowed to undo an overshoot within HiGHS's tolerance
START_SHARE = 0.2  # NOTE: share of the time budget the warm start may take


@dataclass
class _Model:
    """A sparse MILP under construction: variables by key, rows of (coefs, lo, hi)."""

    index: dict = field(default_factory=dict)
    integral: list = field(default_factory=list)
    upper: list = field(default_factory=list)
    rows: list = field(default_factory=list)

    def var(self, key, binary: bool, upper: float = 1.0) -> int:
        self.index[key] = len(self.integral)
        self.integral.append(1 if binary else 0)
        self.upper.append(upper)
        return self.index[key]

    def row(self, terms: dict[int, float], const: float, lo: float, hi: float) -> None:
        """lo <= sum(terms) + const <= hi; a row without variables must already hold."""
        terms = {k: v for k, v in terms.items() if v != 0.0}
        if not terms:
            if not lo - 1e-9 <= const <= hi + 1e-9:
                raise AssertionError(f"constant row violated: {lo} <= {const} <= {hi}")
            return
        self.rows.append((terms, lo - const, hi - const))


@dataclass(frozen=True)
class IlpResult:
    recompute: list[list[int]]     # stage -> units recomputed before the stage's own unit
    status: str                    # "optimal", "time limit", "infeasible"
    objective: float               # seconds (budget mode) or bytes (latency mode)
    gap: float                     # proven relative gap (0 when optimal)
    variables: int
    rows: int
    tolerance_bytes: float = 0.0   # how far HiGHS's row tolerance can put memory over the budget


def _byte_unit(sg: StageGraph) -> float:
    """The MILP's unit of memory: a power of two that puts the largest storage near
    ``LARGEST_COEF``. NOTE: HiGHS accepts rows violated by its tolerance (1e-7 units, more after
    its scaling); with bytes as the unit on small graphs that is far under a byte, so the
    schedule is exact; on large graphs a few bytes over are possible and ``solve_ilp`` repairs
    them (``IlpResult.tolerance_bytes`` bounds what can be explained that way)."""
    largest = max([*sg.value_bytes, *(u.nbytes + u.kept_bytes for u in sg.units), 1])
    return float(2.0 ** max(0, int(np.floor(np.log2(largest / LARGEST_COEF)))))


def _live_ranges(sg: StageGraph) -> tuple[list[int], list[int], list[int]]:
    """(value -> its last direct reader, value -> the last stage it may be needed, through
    recomputable readers, unit -> the last stage it may be recomputed)."""
    n = len(sg.units)
    direct = [max(us, default=sg.value_unit[v]) for v, us in enumerate(sg.value_users)]
    extended = list(direct)
    unit_last = list(range(n))
    for i in range(n - 1, -1, -1):
        for v in sg.units[i].values:
            for k in sg.value_users[v]:
                if sg.units[k].recomputable:
                    extended[v] = max(extended[v], unit_last[k])
            unit_last[i] = max(unit_last[i], extended[v])
    return direct, extended, unit_last


def _use_stages(sg: StageGraph) -> list[set[int]]:
    """unit -> the stages where something that reads it may run: its own, its non-recomputable
    readers', and (recursively) those of its recomputable readers. A unit is recomputed only in
    such a stage (just in time), never to be held through stages that do not read it."""
    n = len(sg.units)
    when: list[set[int]] = [set() for _ in range(n)]
    for i in range(n - 1, -1, -1):
        when[i].add(i)
        for v in sg.units[i].values:
            for k in sg.value_users[v]:
                when[i] |= when[k] if sg.units[k].recomputable else {k}
    return when


def solve_stages(sg: StageGraph, budget_bytes: int | None = None,
                 latency_limit_s: float | None = None,
                 time_limit_s: float = 60.0,
                 start: list[list[int]] | None = None, relaxed: bool = False) -> IlpResult:
    """Solve Checkmate's MILP on a stage graph: least compute time within ``budget_bytes``, or
    least peak within ``latency_limit_s`` (seconds of total compute). ``start``: a known
    schedule (stage -> recomputed units) HiGHS starts from; it never changes the optimum.
    ``relaxed``: the LP relaxation instead (every binary in [0, 1]): its objective is the
    root bound branch-and-bound starts from; its ``recompute`` is not a schedule.

    Memory is per storage (a unit's outputs are freed one by one, as the simulator does):
    ``S[t,v]`` keeps storage ``v``; ``R[t,i]`` (re)makes all of unit ``i``'s storages."""
    units, n = sg.units, len(sg.units)
    vunit, vbytes, vusers = sg.value_unit, sg.value_bytes, sg.value_users
    direct, last, unit_last = _live_ranges(sg)
    when = _use_stages(sg)
    byte_unit = _byte_unit(sg)
    m = _Model()
    for i, u in enumerate(units):
        if u.recomputable:
            for t in sorted(when[i]):
                if i < t <= unit_last[i]:
                    m.var(("R", t, i), True)
    for v, p in enumerate(vunit):
        for t in range(p + 1, last[v] + 1):
            if units[p].recomputable or t > direct[v]:
                m.var(("S", t, v), True)

    def R(t: int, i: int):
        """(var index or None, constant)."""
        if t == i:
            return None, 1.0
        k = m.index.get(("R", t, i))
        return (k, 0.0) if k is not None else (None, 0.0)

    def S(t: int, v: int):
        if not vunit[v] < t <= last[v]:
            return None, 0.0
        k = m.index.get(("S", t, v))
        return (k, 0.0) if k is not None else (None, 1.0)

    def add(terms: dict, const: float, ref, coef: float) -> float:
        k, c = ref
        if k is None:
            return const + coef * c
        terms[k] = terms.get(k, 0.0) + coef
        return const

    # a storage is kept only if it existed in the stage before
    for v, p in enumerate(vunit):
        for t in range(p + 1, last[v] + 1):
            terms: dict[int, float] = {}
            const = add(terms, 0.0, S(t, v), 1.0)
            const = add(terms, const, R(t - 1, p), -1.0)
            const = add(terms, const, S(t - 1, v), -1.0)
            m.row(terms, const, -np.inf, 0.0)
    # a unit runs only when what it reads is there
    points: list[list[int]] = [[] for _ in range(n)]
    for t in range(n):
        points[t] = [k for k in range(t + 1) if R(t, k) != (None, 0.0)]
        for k in points[t]:
            for v in units[k].reads:
                terms = {}
                const = add(terms, 0.0, R(t, k), 1.0)
                const = add(terms, const, R(t, vunit[v]), -1.0)
                const = add(terms, const, S(t, v), -1.0)
                m.row(terms, const, -np.inf, 0.0)
    # memory
    latency_mode = budget_bytes is None
    peak_var = m.var(("B",), False, upper=np.inf) if latency_mode else None
    cap = np.inf if latency_mode else (budget_bytes - sg.resident_bytes) / byte_unit
    kept_before = np.concatenate([[0], np.cumsum([u.kept_bytes for u in units])])
    alive_at: list[list[int]] = [[] for _ in range(n)]
    for v, p in enumerate(vunit):
        for t in range(p + 1, last[v] + 1):
            alive_at[t].append(v)
    for t in range(n):
        frees: dict[int, list[tuple[int, float]]] = {}
        in_stage = set(points[t])
        for k in points[t]:
            for v in sorted({*units[k].reads, *units[k].values}):
                if vbytes[v] == 0:
                    continue
                s_next = S(t + 1, v) if t + 1 < n else (None, 0.0)
                later = [R(t, j) for j in vusers[v] if k < j <= t and j in in_stage]
                if s_next == (None, 1.0) or (None, 1.0) in later:
                    continue  # NOTE: still needed after k in this stage or kept: never freed
                f = m.var(("F", t, v, k), False)
                if t != k:   # FREE <= R[t,k]
                    terms = {f: 1.0}
                    m.row(terms, add(terms, 0.0, R(t, k), -1.0), -np.inf, 0.0)
                for ref in [s_next, *later]:   # FREE <= 1 - S[t+1,v], FREE <= 1 - R[t,j]
                    terms = {f: 1.0}
                    m.row(terms, add(terms, 0.0, ref, 1.0), -np.inf, 1.0)
                frees.setdefault(k, []).append((f, vbytes[v] / byte_unit))
        prev = None
        for pos, k in enumerate(points[t]):
            u = m.var(("U", t, k), False, upper=np.inf)
            terms = {u: 1.0}
            const = add(terms, 0.0, R(t, k), -units[k].nbytes / byte_unit)
            if t == k:
                const -= units[k].kept_bytes / byte_unit
            if prev is None:
                const -= kept_before[t] / byte_unit
                for v in alive_at[t]:
                    if vbytes[v]:
                        const = add(terms, const, S(t, v), -vbytes[v] / byte_unit)
            else:
                terms[prev] = -1.0
                for f, size in frees.get(points[t][pos - 1], ()):
                    terms[f] = terms.get(f, 0.0) + size
            m.row(terms, const, 0.0, 0.0)
            ws = units[k].workspace if t == k else units[k].recompute_workspace
            terms = {u: 1.0}
            const = add(terms, 0.0, R(t, k), ws / byte_unit)
            if latency_mode:
                terms[peak_var] = -1.0
            m.row(terms, const, -np.inf, 0.0 if latency_mode else cap)
            prev = u
    if not latency_mode:
        _stage_end_knapsacks(m, sg, t_count=n, cap=cap, byte_unit=byte_unit,
                             kept_before=kept_before, alive_at=alive_at, S=S, add=add)
    # objective
    c = np.zeros(len(m.integral))
    recompute_terms: dict[int, float] = {}
    for key, k in m.index.items():
        if key[0] == "R":
            recompute_terms[k] = units[key[2]].seconds / MS
    base_s = sum(u.seconds for u in units)
    if latency_mode:
        c[peak_var] = 1.0
        m.row(recompute_terms, 0.0, -np.inf, (latency_limit_s - base_s) / MS)
    else:
        for k, v in recompute_terms.items():
            c[k] = v
    chain = max(map(len, points), default=0) + 2
    if relaxed:
        m.integral = [0] * len(m.integral)
    return _run(m, c, sg, n, time_limit_s, latency_mode, base_s,
                _start(m, sg, start) if start is not None else None, byte_unit,
                byte_unit * FEAS_TOL * 10 * chain)


def _stage_end_knapsacks(m: _Model, sg: StageGraph, *, t_count: int, cap: float,
                         byte_unit: float, kept_before, alive_at, S, add) -> None:
    """One redundant row per stage, on binaries only: while unit ``t`` runs (the last point of
    stage ``t``), every storage kept into stage ``t+1`` is live (nothing runs after ``t`` in
    its stage), and so are ``t``'s reads, outputs and workspace:
    ``sum(S[t+1,v] * bytes(v)) + reads + outputs + workspace + kept outputs <= cap``.

    NOTE: the model already implies it through ``U`` and the continuous frees, but there the
    relaxation can keep 90% of a tensor through a binding stage and top it up after with a
    10% recompute (a fractional knapsack at every stage). Written on the keep binaries alone it
    is a knapsack row HiGHS derives cover cuts from: on GPT-2 (2 blocks, 116 units) at 60% the
    gap after 120 s went from 6.8% to 1.9%, and the incumbent from hotspot's 1.192x of eager
    to 1.149x."""
    units, vbytes = sg.units, sg.value_bytes
    for t in range(t_count - 1):
        own, reads = set(units[t].values), set(units[t].reads)
        const = (kept_before[t] + units[t].kept_bytes + units[t].nbytes + units[t].workspace
                 + sum(vbytes[v] for v in reads if v not in own)) / byte_unit
        terms: dict[int, float] = {}
        for v in alive_at[t + 1]:
            if v in own or v in reads or not vbytes[v]:
                continue
            const = add(terms, const, S(t + 1, v), vbytes[v] / byte_unit)
        if terms:  # NOTE: a constant over the cap: the U rows make the model infeasible already
            m.row(terms, const, -np.inf, cap)


def _start(m: _Model, sg: StageGraph, recompute: list[list[int]]) -> dict[int, float] | None:
    """The binaries (R, S) of a known schedule, for HiGHS to start from; None if the schedule
    does not fit this model's variables."""
    n = len(sg.units)
    runs = [{t} for t in range(n)]            # unit -> stages where it is (re)computed
    for t, us in enumerate(recompute):
        for u in us:
            runs[u].add(t)
    keep: dict[tuple, float] = {}
    for v, p in enumerate(sg.value_unit):
        made = sorted(runs[p])
        uses = {t for k in sg.value_users[v] for t in runs[k] if t not in runs[p]}
        for t in uses:
            q0 = max((q for q in made if q < t), default=None)
            if q0 is None:
                return None
            for q in range(q0 + 1, t + 1):
                keep[("S", q, v)] = 1.0
    out: dict[int, float] = {}
    for key, k in m.index.items():
        if key[0] == "R":
            out[k] = 1.0 if key[1] in runs[key[2]] else 0.0
        elif key[0] == "S":
            out[k] = keep.pop(key, 0.0)
    for (_, q, v) in keep:   # fixed-1 keeps are fine; a keep outside the model is not
        if not sg.value_unit[v] < q or sg.units[sg.value_unit[v]].recomputable:
            return None
    for t, us in enumerate(recompute):
        if any(("R", t, u) not in m.index for u in us):
            return None
    return out


def _run(m: _Model, c, sg: StageGraph, n: int, time_limit_s: float, latency_mode: bool,
         base_s: float, start: dict[int, float] | None, byte_unit: float,
         tolerance_bytes: float) -> IlpResult:
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
    x, status, fun, gap = _highs(c, A, np.array(lo), np.array(hi), np.array(m.upper),
                                 np.array(m.integral), time_limit_s, start, offset)
    if x is None:
        return IlpResult([[] for _ in range(n)], status, float("nan"), float("inf"), nv, nr,
                         tolerance_bytes)
    recompute: list[list[int]] = [[] for _ in range(n)]
    for key, k in m.index.items():
        if key[0] == "R" and x[k] > 0.5:
            recompute[key[1]].append(key[2])
    for r in recompute:
        r.sort()
    objective = fun * byte_unit if latency_mode else fun * MS
    return IlpResult(recompute, status, objective, gap, nv, nr, tolerance_bytes)


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS 1.12 prints a debug line from C++ on some MIP starts; keep it off the user's
    terminal (FG_HIGHS_LOG=1 shows HiGHS's own log instead)."""
    if os.environ.get("FG_HIGHS_LOG"):
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _highs(c, A, lo, hi, upper, integral, time_limit_s: float, start: dict[int, float] | None,
           offset: float):
    """Solve with the HiGHS that scipy ships; start from a known schedule when given.
    -> (x or None, status, objective, gap)."""
    try:
        from scipy.optimize._highspy import _core as h
    except ImportError:  # NOTE: scipy without its HiGHS bindings: the public API, no start
        from scipy.optimize import Bounds, LinearConstraint, milp
        res = milp(c, integrality=integral, bounds=Bounds(np.zeros(len(c)), upper),
                   constraints=LinearConstraint(A, lo, hi),
                   options={"time_limit": max(time_limit_s, 1.0), "mip_rel_gap": MIP_REL_GAP,
                            "disp": False})
        status = {0: "optimal", 2: "infeasible"}.get(res.status, "time limit")
        fun = res.fun + offset if res.x is not None else float("nan")
        bound = getattr(res, "mip_dual_bound", None)
        gap = ((fun - bound - offset) / fun if bound is not None and res.x is not None
               else 0.0 if status == "optimal" else np.inf)
        return res.x, status, fun, gap
    lp = h.HighsLp()
    lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = A.shape[1], A.shape[0]
    lp.a_matrix_.format_ = h.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_ = A.indptr, A.indices
    lp.a_matrix_.value_ = A.data
    lp.col_cost_, lp.col_lower_ = c, np.zeros(len(c))
    lp.offset_ = offset
    lp.col_upper_ = np.where(np.isinf(upper), h.kHighsInf, upper)
    lp.row_lower_ = np.where(np.isinf(lo), -h.kHighsInf, lo)
    lp.row_upper_ = np.where(np.isinf(hi), h.kHighsInf, hi)
    lp.integrality_ = [h.HighsVarType(int(i)) for i in integral]
    highs = h._Highs()
    highs.setOptionValue("output_flag", bool(os.environ.get("FG_HIGHS_LOG")))
    highs.setOptionValue("time_limit", float(max(time_limit_s, 1.0)))
    highs.setOptionValue("mip_rel_gap", MIP_REL_GAP)
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("random_seed", 0)
    for item in filter(None, os.environ.get("FG_HIGHS_OPTIONS", "").split(",")):
        name, _, value = item.partition("=")  # NOTE: experiments: "mip_pool_soft_limit=50000"
        highs.setOptionValue(name.strip(), _option_value(value.strip()))
    highs.passModel(lp)
    if start:
        idx = np.array(sorted(start), dtype=np.int32)
        highs.setSolution(len(idx), idx, np.array([start[i] for i in idx], dtype=float))
    with _quiet_stdout():
        highs.run()
    ms = highs.getModelStatus()
    info = highs.getInfo()
    if ms == h.HighsModelStatus.kInfeasible:
        return None, "infeasible", float("nan"), float("inf")
    has_x = info.primal_solution_status == h.kSolutionStatusFeasible
    status = "optimal" if ms == h.HighsModelStatus.kOptimal else "time limit"
    if not has_x:
        return None, status, float("nan"), float("inf")
    gap = max(float(info.mip_gap), 0.0)
    return np.array(highs.getSolution().col_value), status, info.objective_function_value, gap


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
                           "eager_latency_s": eager.latency_s})


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


def _option_value(text: str):
    """A HiGHS option value from text: bool, int, float, else the string.

    Example:
        >>> _option_value("50000"), _option_value("0.5"), _option_value("true"), _option_value("on")
        (50000, 0.5, True, 'on')
    """
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
