"""``joint``: rematerialization and offloading weighed together, per tensor, by the simulator.

Recompute costs compute time on the critical path; an offload costs nothing when its copies hide
under compute, and exposed seconds when they do not. So the planner asks ``hotspot`` for a remat
plan at a looser budget B' >= B (fewer recomputes), then offloads storages of that plan until
the peak is back within B (``solvers.offload.fit``: hidden copies first, then bytes per exposed
second; offloads the plan fits without are pruned). B' walks a ladder between B and the eager
peak, then is refined by bisection around the fastest rung; the two ends are ``hotspot`` alone
at B and offloading alone on the eager plan. Every candidate is judged by ``simulate``; the best
by (fits, latency, peak) wins, so ``joint`` is never slower than ``hotspot`` at the same budget
(when neither runs out of time).

With a ``latency_limit`` it minimises the peak instead: remat plans from ``hotspot`` (its
least-peak plan within the limit, and looser ones along a ladder), each offloaded as low as the
limit allows.

Deterministic; anytime: each stage checks the deadline (``time_budget_s``), the best plan so far
is returned and ``notes["timed_out"]`` says the search was cut short. If nothing fits,
``BudgetInfeasible`` names the smallest peak reached (remat at its lowest, then offloaded).

Example:
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.graph.ir import GraphBuilder, Phase, Role
    >>> from fitgraph.solvers import Problem, solve
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Cost(BaseCostModel):  # 1 ms per node, 0.1 ms per copy: offloading hides, recompute does not
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    ...     def copy_seconds(self, nbytes): return 1e-4
    >>> b = GraphBuilder(); v = [b.add_input("x", (64,), "float32", Role.INPUT)]
    >>> for i in range(4): v += b.add_node("aten.relu.default", [v[-1]], [((64,), "float32")])
    >>> gr = b.add_node("aten.sum.default", [v[-1]], [((64,), "float32")])[0]
    >>> for i in range(4, 0, -1):
    ...     gr = b.add_node("aten.mul.Tensor", [gr, v[i]], [((64,), "float32")],
    ...                     phase=Phase.BACKWARD)[0]
    >>> g = b.finish({"loss": gr})
    >>> j = solve(Problem(g, Cost(), budget_bytes=1280), "joint")
    >>> h = solve(Problem(g, Cost(), budget_bytes=1280), "hotspot")
    >>> j.sim.peak_bytes <= 1280, j.sim.latency_s < h.sim.latency_s, j.notes["recomputes"], h.notes["recomputes"]
    (True, True, 0, 2)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...plan.eager import eager_plan
from ...plan.instructions import Plan
from ...sim.simulate import SimResult, simulate
from ..base import BudgetInfeasible, Problem, Solution, dominated_by, register
from ..remat.hotspot import solve_hotspot
from .fit import offload_to_fit

__all__ = ["solve_joint"]

# NOTE: B' = B + f × (eager peak - B) at these f; f = 0 is hotspot alone, the eager plan is f = 1
LADDER = (0.0, 0.125, 0.25, 0.5, 0.75)
LATENCY_LADDER = (0.0, 0.25, 0.5)
REFINE_STEPS = 2          # bisections of B' around the fastest rung
HOTSPOT_SHARE = 0.5       # the first hotspot run may use this share of the time budget
RUNG_SHARE = 0.1          # each later hotspot run, this share
FINAL_SHARE = 0.05        # kept for building the solution
LEAST_PEAK = 1e9          # a latency limit that lets hotspot lower the peak as far as it can


@dataclass(frozen=True)
class _Cand:
    plan: Plan
    sim: SimResult
    offloaded: int
    base: str                 # where the remat plan came from
    base_budget: int | None   # the B' it was planned at (None: eager plan, or latency mode)
    remat_timed_out: bool = False
    offload_timed_out: bool = False


@register("joint")
def solve_joint(problem: Problem) -> Solution:
    """Plan ``problem`` (see the module doc) with remat and offloading together."""
    t0 = time.perf_counter()
    g, cm = problem.graph, problem.cost_model
    deadline = t0 + (1 - FINAL_SHARE) * problem.time_budget_s
    eager = eager_plan(g)
    eager_sim = simulate(g, eager, cm)
    search = (_budget_search if problem.budget_bytes is not None else _latency_search)
    cands, timed_out = search(problem, eager, eager_sim, t0, deadline)
    best = min(cands, key=lambda c: _key(problem, c))
    if problem.budget_bytes is not None and best.sim.peak_bytes > problem.budget_bytes:
        raise BudgetInfeasible(problem.budget_bytes, best.sim.peak_bytes,
                               dominated_by(best.sim), "joint")
    best.plan.meta["solver"] = "joint"
    counts = best.plan.counts()
    return Solution(best.plan, best.sim, "joint", time.perf_counter() - t0, notes={
        "offloaded": best.offloaded, "recomputes": counts.get("recompute", 0),
        "base": best.base, "base_budget_bytes": best.base_budget,
        "host_peak_bytes": best.sim.host_peak_bytes, "stall_s": best.sim.stall_s,
        "candidates": len(cands), "timed_out": timed_out or best.remat_timed_out,
        "eager_latency_s": eager_sim.latency_s})


def _key(problem: Problem, c: _Cand):
    if problem.budget_bytes is not None:
        if c.sim.peak_bytes <= problem.budget_bytes:
            return (0, c.sim.latency_s, c.sim.peak_bytes)
        return (1, c.sim.peak_bytes, c.sim.latency_s)  # NOTE: none fits: report the least peak
    return (c.sim.peak_bytes, c.sim.latency_s)


def _hotspot(problem: Problem, share: float, deadline: float, **kw
             ) -> tuple[Plan, SimResult, bool] | BudgetInfeasible:
    """hotspot on ``problem`` with the settings in ``kw``: (plan, sim, timed out), or the
    BudgetInfeasible it raised."""
    budget = min(share * problem.time_budget_s, max(0.0, deadline - time.perf_counter()))
    try:
        s = solve_hotspot(Problem(problem.graph, problem.cost_model, time_budget_s=budget, **kw))
    except BudgetInfeasible as e:
        return e
    return s.plan, s.sim, bool(s.notes.get("timed_out"))


def _offloaded(problem: Problem, plan: Plan, sim: SimResult, label: str, at: int | None,
               target: int, cap_s: float, deadline: float, remat_to: bool,
               give_up_s: float = float("inf")) -> _Cand:
    if sim.peak_bytes <= target:  # NOTE: fits already: no copy is worth any stall
        return _Cand(plan, sim, 0, label, at, remat_to)
    fit = offload_to_fit(problem.graph, plan, problem.cost_model, target_bytes=target,
                         latency_cap_s=cap_s, give_up_above_s=give_up_s, deadline=deadline)
    return _Cand(fit.plan, fit.sim, len(fit.offloaded), label, at, remat_to, fit.timed_out)


def _budget_search(problem: Problem, eager: Plan, eager_sim: SimResult, t0: float,
                   deadline: float) -> tuple[list[_Cand], bool]:
    B, E = problem.budget_bytes, eager_sim.peak_bytes
    inf = float("inf")
    if E <= B:
        return [_Cand(eager, eager_sim, 0, "eager plan", None)], False
    cands: list[_Cand] = []
    tried: dict[int, float] = {}  # B' -> latency reached from it (inf: hotspot cannot fit B')

    def fastest() -> float:
        """The incumbent: an offload search slower than it is given up at once."""
        return min((c.sim.latency_s for c in cands if c.sim.peak_bytes <= B), default=inf)

    def rung(b: int, share: float, first: bool = False) -> int | None:
        """Remat at B' = b, offloaded to fit B; the smallest peak hotspot reached if not b."""
        if b in tried or (time.perf_counter() > deadline and not first):
            return None
        r = _hotspot(problem, share, deadline, budget_bytes=b)
        if isinstance(r, BudgetInfeasible):
            tried[b] = inf
            return r.smallest_peak_bytes
        c = _offloaded(problem, *r[:2], f"hotspot at {b:,} B", b, B, inf, deadline, r[2],
                       fastest())
        cands.append(c)
        tried[b] = c.sim.latency_s if c.sim.peak_bytes <= B else inf
        return None

    lowest = rung(B, HOTSPOT_SHARE, first=True)  # NOTE: hotspot alone, however short the time
    if lowest is not None:  # NOTE: remat alone cannot fit B: offload its least-peak plan
        if rung(lowest, RUNG_SHARE) is not None:
            r = _hotspot(problem, RUNG_SHARE, deadline, latency_limit=LEAST_PEAK)
            if not isinstance(r, BudgetInfeasible):
                cands.append(_offloaded(problem, *r[:2], "hotspot, least peak", None, B, inf,
                                        deadline, r[2]))
    for f in LADDER[1:]:
        rung(B + int(f * (E - B)), RUNG_SHARE)
    for _ in range(REFINE_STEPS):  # NOTE: bisect B' on both sides of the fastest rung
        keys = sorted(tried)
        if all(tried[b] == inf for b in keys):
            break
        best = min(keys, key=lambda b: (tried[b], b))
        i = keys.index(best)
        for j in (i - 1, i + 1):
            if 0 <= j < len(keys):
                rung((best + keys[j]) // 2, RUNG_SHARE)
    if time.perf_counter() <= deadline or not cands:  # NOTE: offloading alone: the far end
        cands.append(_offloaded(problem, eager, eager_sim, "eager plan", None, B, inf, deadline,
                                False, fastest()))
    return cands, time.perf_counter() > deadline


def _latency_search(problem: Problem, eager: Plan, eager_sim: SimResult, t0: float,
                    deadline: float) -> tuple[list[_Cand], bool]:
    cap = problem.latency_limit * eager_sim.latency_s
    cands = [_Cand(eager, eager_sim, 0, "eager plan", None)]
    # NOTE: remat first: offloading the eager plan may search until the deadline, and hotspot
    # given no time is no better than eager (issue: joint lost to hotspot in latency mode)
    r = _hotspot(problem, HOTSPOT_SHARE, deadline, latency_limit=problem.latency_limit)
    if not isinstance(r, BudgetInfeasible):
        cands.append(_Cand(r[0], r[1], 0, "hotspot, least peak in the limit", None, r[2]))
        cands.append(_offloaded(problem, *r[:2], "hotspot, least peak in the limit", None, 0,
                                cap, deadline, r[2]))
        low, high = r[1].peak_bytes, eager_sim.peak_bytes
        for f in LATENCY_LADDER[1:]:
            if time.perf_counter() > deadline:
                break
            b = low + int(f * (high - low))
            rb = _hotspot(problem, RUNG_SHARE, deadline, budget_bytes=b)
            if not isinstance(rb, BudgetInfeasible) and rb[1].latency_s <= cap:
                cands.append(_offloaded(problem, *rb[:2], f"hotspot at {b:,} B", b, 0, cap,
                                        deadline, rb[2]))
    if time.perf_counter() <= deadline:  # NOTE: offloading alone: the far end
        cands.append(_offloaded(problem, eager, eager_sim, "eager plan", None, 0, cap, deadline,
                                False))
    return cands, time.perf_counter() > deadline
