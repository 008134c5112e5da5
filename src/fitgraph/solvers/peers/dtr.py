"""``dtr``: Dynamic Tensor Rematerialization's greedy eviction (Kirisame et al., ICLR 2021), as a
planner — a classic peer, own code from the paper.

DTR runs the step in its given order and, whenever an allocation would exceed the budget,
evicts the resident tensor with the least ``h = cost / (bytes × staleness)``: ``cost`` is the
time to recompute it plus that of its evicted inputs (the paper's ``h_DTR`` with the evicted
neighbourhood's cost, one level deep), ``staleness`` the time since it was last touched. A read
of an evicted tensor recomputes it first, recursively. Only what ``graph.recompute_rules.recomputable``
allows is evicted (never a random op replayed without its RNG state, a backward value or a step
output); tensors whose last reader has run are freed, as refcounting does.

Here DTR plays the step on the stage graph (``solvers.remat.stages``) ahead of time: its evictions and
recomputes become a staged schedule (stage -> units recomputed before it) and ``plan.staged``
turns that into a Plan, whose frees are never later than DTR's. The simulator is the judge: if
the plan peaks over the budget (workspaces, views, frees DTR cannot see), DTR replays with that
much less, a few times. With a ``latency_limit`` it bisects the budget for the least peak whose
plan stays within the limit. Deterministic (ties break on the lowest value id).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers import Problem, solve
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> batch = torch.randn(256, 64)
    >>> g = fitgraph.capture(model, batch, lambda m, b: m(b).square().mean())
    >>> cm = RooflineCostModel(get_device("rtx3090"))
    >>> eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
    >>> s = solve(Problem(g, cm, budget_bytes=int(0.7 * eager.peak_bytes)), "dtr")
    >>> s.sim.peak_bytes <= 0.7 * eager.peak_bytes, s.notes["evictions"] > 0
    (True, True)
"""

from __future__ import annotations

import time

from ...plan.staged import staged_plan
from ...sim.simulate import SimResult, simulate
from ..base import BudgetInfeasible, Problem, Solution, dominated_by, register
from ..remat.stages import StageGraph, stage_graph

__all__ = ["DtrRun", "dtr_schedule", "solve_dtr"]

REPLAYS = 6        # NOTE: replays with a lower internal budget when the simulator disagrees
BISECTIONS = 14    # latency mode: budget bisection steps (1/16k of the eager peak)


class _OutOfMemory(Exception):
    """Nothing evictable is left and the allocation still does not fit."""


class DtrRun:
    """One play of the step under ``budget`` bytes: ``recompute[t]`` (units, in order) and
    the eviction count."""

    def __init__(self, sg: StageGraph, budget: int) -> None:
        self.sg, self.budget = sg, budget
        n = len(sg.units)
        self.recompute: list[list[int]] = [[] for _ in range(n)]
        self.evictions = 0
        self.resident: dict[int, int] = {}     # value -> last access (clock)
        self.evicted: set[int] = set()
        self.pinned: set[int] = set()
        self.clock = 0
        self.used = sg.resident_bytes
        # NOTE: a value's direct readers still to come, to free it when the last one ran
        self.pending = [len(us) for us in sg.value_users]
        self.stage = 0

    def play(self) -> DtrRun:
        for t in range(len(self.sg.units)):
            self.stage = t
            self._run(t, recompute=False)
            for v in self.sg.units[t].reads:
                self.pending[v] -= 1
                if self.pending[v] == 0 and v in self.resident:
                    self._release(v)
            for v in self.sg.units[t].values:  # NOTE: made and never read: dead at once
                if self.pending[v] == 0 and v in self.resident:
                    self._release(v)
        return self

    def _release(self, v: int) -> None:
        del self.resident[v]
        self.used -= self.sg.value_bytes[v]

    def _run(self, u: int, recompute: bool) -> None:
        unit = self.sg.units[u]
        reads = unit.reads
        self.pinned.update(reads)
        try:
            for v in reads:
                if v not in self.resident:
                    self._rematerialize(v)
                self.resident[v] = self.clock
            ws = unit.recompute_workspace if recompute else unit.workspace
            self._make_room(unit.nbytes + (0 if recompute else unit.kept_bytes) + ws)
        finally:
            self.pinned.difference_update(reads)
        if not recompute:
            self.used += unit.kept_bytes
        for v in unit.values:
            if v in self.resident:   # NOTE: an earlier copy still resident: replaced
                self._release(v)
            self.resident[v] = self.clock
            self.evicted.discard(v)
            self.used += self.sg.value_bytes[v]
        self.clock += 1
        if recompute:
            self.recompute[self.stage].append(u)
        for v in reads:  # NOTE: an input re-made only for this recompute dies with it
            if self.pending[v] == 0 and v in self.resident and v not in self.pinned:
                self._release(v)

    def _rematerialize(self, v: int) -> None:
        p = self.sg.value_unit[v]
        if not self.sg.units[p].recomputable:
            raise _OutOfMemory(f"value {v} of unit {p} is gone and cannot be recomputed")
        self._run(p, recompute=True)

    def _make_room(self, nbytes: int) -> None:
        while self.used + nbytes > self.budget:
            victim = self._victim()
            if victim is None:
                raise _OutOfMemory(f"{self.used + nbytes - self.budget} bytes over, nothing "
                                   "left to evict")
            self._release(victim)
            self.evicted.add(victim)
            self.evictions += 1

    def _victim(self) -> int | None:
        sg, best, best_h = self.sg, None, None
        for v, last in self.resident.items():
            p = sg.value_unit[v]
            if v in self.pinned or not sg.units[p].recomputable or not sg.value_bytes[v]:
                continue
            cost = sg.units[p].seconds + sum(
                sg.units[sg.value_unit[r]].seconds for r in sg.units[p].reads
                if r in self.evicted)
            h = cost / (sg.value_bytes[v] * (self.clock - last + 1))
            if best_h is None or h < best_h:
                best, best_h = v, h
        return best


def dtr_schedule(sg: StageGraph, budget: int) -> list[list[int]] | None:
    """DTR's staged schedule within ``budget`` bytes (its own accounting), or None."""
    try:
        return DtrRun(sg, budget).play().recompute
    except _OutOfMemory:
        return None


def _fit(problem: Problem, sg: StageGraph, budget: int) -> tuple[SimResult, object, int] | None:
    """(simulation, plan, evictions) of DTR's schedule simulating within ``budget``, or None."""
    g, cm = problem.graph, problem.cost_model
    inner = budget
    for _ in range(REPLAYS):
        try:
            run = DtrRun(sg, inner).play()
        except _OutOfMemory:
            return None
        plan = staged_plan(g, sg, run.recompute)
        sim = simulate(g, plan, cm)
        if sim.peak_bytes <= budget:
            return sim, plan, run.evictions
        inner -= sim.peak_bytes - budget   # NOTE: what DTR's accounting missed
    return None


@register("dtr")
def solve_dtr(problem: Problem) -> Solution:
    t0 = time.perf_counter()
    g, cm = problem.graph, problem.cost_model
    sg = stage_graph(g, cm)
    eager_plan = staged_plan(g, sg, [[] for _ in sg.units])
    eager = simulate(g, eager_plan, cm)
    if problem.budget_bytes is not None:
        got = _fit(problem, sg, problem.budget_bytes)
        if got is None:
            # NOTE: DTR is not monotone in its budget: a lower one may play out within this one
            got = _lowest(problem, sg, eager, t0)
            if got[0].peak_bytes > problem.budget_bytes:
                err = BudgetInfeasible(problem.budget_bytes, got[0].peak_bytes,
                                       dominated_by(got[0]), "dtr")
                err.solution = _solution(got, sg, t0)   # NOTE: the plan at its least peak
                raise err
    else:
        got = _lowest(problem, sg, eager, t0)
    return _solution(got, sg, t0)


def _solution(got: tuple, sg: StageGraph, t0: float) -> Solution:
    sim, plan, evictions = got
    return Solution(plan, sim, "dtr", time.perf_counter() - t0,
                    notes={"evictions": evictions, "recomputes": plan.meta["recomputes"],
                           "units": len(sg.units)})


def _lowest(problem: Problem, sg: StageGraph, eager: SimResult, t0: float):
    """The lowest budget (bisection) whose DTR plan fits it and, with a latency limit, stays
    within it. Eager's own plan when nothing lower works."""
    limit = (problem.latency_limit or float("inf")) * eager.latency_s
    best = (eager, staged_plan(problem.graph, sg, [[] for _ in sg.units]), 0)
    lo, hi = sg.resident_bytes, eager.peak_bytes
    for _ in range(BISECTIONS):
        if hi - lo <= max(1, eager.peak_bytes >> 14) or (
                time.perf_counter() - t0 > problem.time_budget_s):
            break
        mid = (lo + hi) // 2
        got = _fit(problem, sg, mid)
        if got is not None and got[0].latency_s <= limit * (1 + 1e-9):
            best, hi = got, min(mid, got[0].peak_bytes)
        else:
            lo = mid
    return best
