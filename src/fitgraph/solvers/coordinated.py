"""``search``: the coordinated search — rewrite rules, then remat, offloading, fission and the
exact scheduler on each rewritten graph, best first (issue 30, MAGIS's "coordinated graph
transformation and scheduling").

MAGIS mutates the graph with rules, schedules each candidate for memory, simulates it and keeps
the best, in a relaxed best-first search under a time budget. Here a candidate is a graph made
from the captured one by composing rewrite rules (``transform.rules.RULES``: each rewrites all
its matches at once), planned by ``auto`` (which itself composes hotspot's remat and reordering,
masks as bits, offloading and operator fission) and judged by the simulator. The first candidate
is the captured graph itself, planned by ``auto`` with ``AUTO_SHARE`` of the time budget:
``search`` is never worse than that plan. Every later candidate is planned by auto within
``CANDIDATE_S`` (or that share, where less): a larger budget tries more candidates. The frontier
is expanded best first (budget mode: the fastest plan within the budget; latency mode: the least
peak within the limit; an infeasible candidate ranks by the least peak it reached); each
expansion first takes the graph the candidate's plan runs, where auto rewrote it (fission's
splits, masks as bits, chunked updates), as a candidate of its own (``AGAIN``: auto plans it
again, on its measured costs, and its fission may split the parts further), then its graph
planned with the choice auto made greedily the other way (``MASKS``: the dropout masks kept as
bits, or kept full, on which fission then splits; descendants keep the choice), then applies
every rule not yet applied on that path that matches — to the graph the candidate's plan runs
where auto rewrote it and the rule matches there (``ON_PLANNED``: auto's splits kept), else to
the candidate's graph — those whose matches save the most bytes first — where a rule with two
or more matches does not pay on that candidate, on the half of them that save the most bytes
(``HALF``: MAGIS mutates a match at a time). The captured graph's
expansion also takes fission's other first-round splits (``SPLIT``: each region's best part
count, ``solvers.fission.first_splits``; auto's fission commits greedily to one), each planned
by auto — where the cost model measures, on its eager step timed against the captured
graph's: its plans' simulated steps, and those of every candidate made from it, are scaled by
what the simulator missed there (``CALIBRATED``) — and the captured graph planned by auto for the other kind of constraint (``PROBE``:
latency mode, budgets below its own plan's peak; budget mode, limits at and below its own plan's
step), each plan judged by the problem's own; a graph seen before (``graph_fingerprint``,
with the constraint a probe planned it for) is skipped. Where auto's plan misses the budget
but its error carries a plan at its least peak, fission's single splits of the regions live at
that plan's peak (``AT_LEAST_PEAK``: the fission search grows its regions from the eager
plan's) are planned first, whatever time auto's fallbacks left. A rewritten graph's plan
replaces the best only where it is better by the simulator — in budget mode by ``TIME_MARGIN``
of the step time, since simulated times are estimates and peaks are not — and a rewritten graph
is planned without auto's minutes-long fallbacks for a missed budget (``split_backward``;
DTR's plan, seconds, it does get),
so the search keeps to its deadline. Then the best plan's drop set is re-planned over the exact
scheduler's order (``hotspot(exact=True)``, ``plan.exact_order``), where that plan is hotspot's
(or fission's remat on its split graph). Last, where the cost model measures on this machine,
the best plan and the next best that simulate better than auto's (``MEASURED`` in all) are
timed in paired rounds: in budget mode each against auto's step, the fastest measured kept
where it measures ``MEASURED_MARGIN`` faster, else the lowest peak ``HEADROOM_MIN`` under
auto's plan's that simulates as fast and measures ``HEADROOM_MEASURED`` of auto's step
(``HEADROOM``); in latency mode against the eager plan's step, lowest peak first, the first
measured within the limit less ``STEP_MARGIN`` (``optimize``'s latency check's margin) kept
— where none is, the lowest peak's graph is planned again for the limit its measured step
leaves (``RETRY``) and kept where it measures within, and where the plan kept (auto's too)
measures under it, planned again for the looser limit that leaves (``SLACK``), kept where its
peak is lower and it measures within; where none holds the limit and auto's plan measures
over it too, the lowest peak no slower than auto's plan (``NO_SLOWER``) — the one chosen timed
again before it is kept; else auto's plan (``search_timing``, ``notes["confirmed"]``).
The moves are ``solvers.search_moves``'s. ``notes["candidates"]`` lists every candidate (its
rules, what each rule's matches change, its peak and latency or why it failed),
``notes["rules"]`` the winner's rules, ``notes["winner"]`` what made its plan.

Deterministic as its parts: only the deadline (``time_budget_s``, on the planning clock:
``cost.clock``) cuts it short, and the measured check decides on this machine's timings.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers import Problem, solve
    >>> class Scores(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__(); self.w = torch.nn.Parameter(torch.randn(8, 4))
    ...     def forward(self, x):
    ...         q = x @ self.w
    ...         return ((q @ q.T) * 0.5).softmax(-1).sum()
    >>> g = fitgraph.capture(Scores(), torch.randn(256, 8))
    >>> cm = RooflineCostModel(get_device("cpu-generic"))
    >>> s = solve(Problem(g, cm, latency_limit=1.0, time_budget_s=20), "search")
    >>> s.notes["rules"], s.sim.peak_bytes < solve(Problem(g, cm, latency_limit=1.0), "auto").sim.peak_bytes
    (['scale_across_matmul'], True)
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import progress
from ..cost.clock import planning_now
from ..graph.analysis import graph_fingerprint
from ..graph.ir import Graph
from ..plan.eager import eager_plan
from ..sim.simulate import simulate
from ..transform.rules import RULES
from .base import BudgetInfeasible, Problem, Solution, register
from .portfolio import solve_auto
from .remat.hotspot import solve_hotspot
from .search_moves import (
    PROBE,
    _held,
    _least_peak_split_moves,
    _Move,
    _moves,
    _probe_moves,
    _split_moves,
)
from .search_timing import CALIBRATED, confirmed_choice, measured_over_simulated, measures

__all__ = ["solve_search"]

# NOTE: the first candidate (the captured graph planned by auto) gets this share of the time
# budget; every later candidate at most as much, and at most CANDIDATE_S
AUTO_SHARE = 1 / 3
# NOTE: fission's search runs to its deadline, so a candidate given a share of the budget takes
# all of it: a larger budget would plan the same few candidates longer, not try more (the
# zoo's small models, 10 s each: a median of 4 candidates per case in 30 s, 8 in 90 s; auto's
# plans on their graphs come within 10 s)
CANDIDATE_S = 10.0
# NOTE: a candidate planned in less than this only gets hotspot's first moves
MIN_CANDIDATE_S = 1.0
# NOTE: budget mode: a rewritten graph's plan replaces a plan only where it simulates this
# much faster — simulated step times are estimates (a few % off when measured), peaks are not
# (so in latency mode any lower peak counts): GPT-2 small at 0.4, measured, a plan simulated
# 2.3% faster ran 3% slower
TIME_MARGIN = 0.02


@dataclass(order=True)
class _Candidate:
    rank: tuple
    graph: Graph = field(compare=False)
    rules: tuple[str, ...] = field(compare=False)
    solution: Solution | None = field(compare=False)
    error: str | None = field(compare=False)
    changes: dict = field(compare=False, default_factory=dict)
    # NOTE: auto's own error where it missed the budget (its least-peak plan rides on it)
    infeasible: BudgetInfeasible | None = field(compare=False, default=None)
    # NOTE: its graph's eager step measured over simulated (``search_timing.CALIBRATED``):
    # measured for fission's first splits, inherited by every candidate made from one
    factor: float = field(compare=False, default=1.0)

    @property
    def step_s(self) -> float:
        """Its plan's simulated step, scaled by what the simulator missed on its graph."""
        return self.solution.sim.latency_s * self.factor

    @property
    def dead_end(self) -> bool:
        """The search does not expand it: no plan and no least peak (its eager step is over
        the latency limit: Llama small within 1.05x, six rules' candidates on three such
        graphs, every one over the limit too), or a probe's plan (``PROBE``) on the captured
        graph as it is, or none: its moves would be the first candidate's (ViT-B/16 small at
        0.6, two such probes' rules planned again as the first's, 30 s of the search's 90)."""
        if self.rules and self.rules[-1].startswith(PROBE):
            return self.solution is None or self.solution.graph is None
        return self.solution is None and self.rank[1] == float("inf")

    def summary(self) -> dict:
        out: dict = {"rules": list(self.rules), "changes": self.changes}
        if self.solution is not None:
            out.update(peak_bytes=self.solution.sim.peak_bytes,
                       latency_s=self.solution.sim.latency_s,
                       winner=self.solution.notes.get("winner", self.solution.solver))
        else:
            out["failed"] = self.error
        return out


def _said(c: _Candidate) -> str:
    if c.solution is None:
        return "no plan"
    sim = c.solution.sim
    return f"{sim.peak_bytes / 2**20:,.1f} MiB in {sim.latency_s * 1e3:,.1f} ms"


def _better(a: _Candidate, b: _Candidate, budget_mode: bool) -> bool:
    """Whether ``a``'s plan replaces ``b``'s: a lower rank, and in budget mode a simulated step
    ``TIME_MARGIN`` faster (where both have plans)."""
    if a.solution is None or b.solution is None or not budget_mode:
        return a < b
    return a.step_s < (1 - TIME_MARGIN) * b.step_s


def _rank(sol: Solution | None, least: int | None, budget_mode: bool,
          factor: float = 1.0) -> tuple:
    """Lower is better: a plan within the budget (limit) by time (peak; the simulated step
    scaled by ``factor``, its graph's ``CALIBRATED``), then an infeasible candidate by the
    least peak it reached."""
    if sol is None:
        return (1, least if least is not None else float("inf"), 0.0)
    if budget_mode:
        return (0, sol.sim.latency_s * factor, sol.sim.peak_bytes)
    return (0, sol.sim.peak_bytes, sol.sim.latency_s)


@register("search")
def solve_search(problem: Problem) -> Solution:
    """Plan ``problem`` by the coordinated search (see the module doc)."""
    t0 = planning_now()
    deadline = t0 + problem.time_budget_s
    first_s = AUTO_SHARE * problem.time_budget_s
    each_s = min(first_s, CANDIDATE_S)
    budget_mode = problem.budget_bytes is not None
    rules = [r for r in RULES.values() if r.exact or not problem.exact]
    cm = problem.cost_model
    cm.prepare(problem.graph)
    eager_s = simulate(problem.graph, eager_plan(problem.graph), cm).latency_s
    limit_s = None if budget_mode else problem.latency_limit * eager_s
    with progress.stage("search: auto on the captured graph"):
        first = _plan(problem, problem.graph, (), {}, first_s, limit_s, budget_mode,
                      fallback=True)
    # NOTE: latency mode, where the cost model measures: the moves stop a candidate's time
    # before the deadline, left to the plan made again for its measured step (``RETRY``): the
    # search runs to its deadline on most rows (GPT-2 small within 1.05x, 89.4 s of 90)
    moves_until = deadline - (each_s if limit_s is not None and measures(cm) else 0.0)
    left = min(each_s, moves_until - planning_now())
    # NOTE: the moves only the captured graph takes (SPLIT, PROBE), after its own
    from_captured = _split_moves(problem, first, left) if left > MIN_CANDIDATE_S else []
    from_captured += _probe_moves(problem, first, eager_s)
    seen = {_seen_key(problem.graph, ())}
    frontier, tried, best = [first], [first], first

    def take(child: _Candidate) -> None:
        """``child`` tried, on the frontier unless a dead end, the best where better."""
        nonlocal best
        tried.append(child)
        if not child.dead_end:
            heapq.heappush(frontier, child)
        if _better(child, best, budget_mode):
            best = child

    for move in _least_peak_split_moves(problem, first):
        # NOTE: whatever the deadline left (auto's fallbacks may have spent it): each within
        # a candidate's time
        child = _child(problem, first, move, seen, each_s, limit_s, budget_mode, eager_s)
        if child is not None:
            take(child)
    while frontier and moves_until - planning_now() > MIN_CANDIDATE_S:
        parent = heapq.heappop(frontier)
        for move in _moves(parent, rules) + (from_captured if parent is first else []):
            child = None
            for m in (move, move.half):
                # NOTE: a rule's half only where the whole rule did not pay on this parent
                if m is None or (child is not None and _better(child, parent, budget_mode)):
                    break
                left = moves_until - planning_now()
                if left <= MIN_CANDIDATE_S:
                    break
                child = _child(problem, parent, m, seen, min(each_s, left), limit_s,
                               budget_mode, eager_s)
                if child is None:
                    continue
                take(child)
                if progress.enabled():
                    progress.note(f"search: {' + '.join(child.rules)}: {_said(child)}; best so "
                                  f"far {' + '.join(best.rules) or 'auto'}: {_said(best)}")
    best = _schedule_exactly(problem, best, moves_until, limit_s, budget_mode)
    best, confirmed = confirmed_choice(problem, first, best, tried,
                                       _again_until(problem, deadline), limit_s)
    if best.solution is None:
        # NOTE: auto's error on the captured graph, with the plan at its least peak (a budget
        # of "smallest" takes it: solvers.smallest), unless a rewritten graph reached lower
        if first.infeasible is not None and first.rank[1] <= best.rank[1]:
            own = first.infeasible
            err = BudgetInfeasible(own.budget_bytes, own.smallest_peak_bytes, own.dominated_by,
                                   "search")
            err.solution, err.estimated = own.solution, own.estimated
            raise err from own
        raise BudgetInfeasible(problem.budget_bytes, int(best.rank[1]),
                               f"{len(tried)} candidate graph(s) searched; on the captured "
                               f"one: {first.error}", "search")
    sol = best.solution
    notes = dict(sol.notes, winner=sol.notes.get("winner", sol.solver), rules=list(best.rules),
                 candidates=[c.summary() for c in tried], auto=first.summary())
    if confirmed is not None:
        notes["confirmed"] = confirmed
    sol.plan.meta["solver"] = "search"
    return Solution(sol.plan, sol.sim, "search", planning_now() - t0, sol.optimal, sol.gap,
                    notes, sol.graph_for(best.graph) if best.rules or sol.graph else None)



def _seen_key(graph: Graph, rules: tuple[str, ...], probe: tuple | None = None) -> tuple:
    """A candidate's identity: its graph, the choices auto is held to on it and the
    constraint it was planned for where a probe's (``PROBE``)."""
    return graph_fingerprint(graph), tuple(sorted(_held(rules).items())), probe


def _child(problem: Problem, parent: _Candidate, move: _Move, seen: set[tuple], time_s: float,
           limit_s: float | None, budget_mode: bool, eager_s: float) -> _Candidate | None:
    """The graph ``move`` makes from ``parent``'s, planned (its simulated steps scaled by
    ``parent``'s factor, or by its own where the move calibrates: ``CALIBRATED``, against the
    captured graph's eager step simulated ``eager_s``); None where that graph was planned so
    (held to the same choices) before."""
    graph, rules = move.make(), parent.rules + (move.name,)
    key = _seen_key(graph, rules, move.probe)
    if key in seen:
        return None
    seen.add(key)
    changes = dict(parent.changes)
    changes[move.name] = move.change
    factor = parent.factor
    if move.calibrate:
        factor = measured_over_simulated(problem, graph, eager_s)
        changes[move.name] = dict(move.change, **{CALIBRATED: round(factor, 4)})
    return _plan(problem, graph, rules, changes, time_s, limit_s, budget_mode,
                 probe=move.probe, factor=factor)


def _plan(problem: Problem, graph: Graph, rules: tuple[str, ...], changes: dict, time_s: float,
          limit_s: float | None, budget_mode: bool, fallback: bool = False,
          probe: tuple[str, float] | None = None, factor: float = 1.0) -> _Candidate:
    """``graph`` planned by ``auto`` (held to the choices its path ``rules`` fixed: ``_held``)
    for ``problem``'s budget or latency limit (the limit in seconds of the captured graph's
    eager step, as a factor of this graph's own, its simulated steps scaled by ``factor``:
    ``CALIBRATED``) — or for ``probe``'s constraint, the plan judged by the problem's
    (``PROBE``); only the captured graph gets auto's fallbacks where the budget is missed
    (``split_backward`` searches for minutes)."""
    cm = problem.cost_model
    sub = dataclasses.replace(problem, graph=graph, time_budget_s=time_s)
    own = None
    if not budget_mode or probe is not None:
        cm.prepare(graph)
        own = simulate(graph, eager_plan(graph), cm).latency_s * factor
    if not budget_mode and limit_s < own:
        return _Candidate(_rank(None, None, budget_mode), graph, rules, None,
                          "its eager step is over the latency limit", changes)
    if probe is not None:
        kind, value = probe
        sub = dataclasses.replace(sub, budget_bytes=int(value) if kind == "budget" else None,
                                  latency_limit=value / own if kind == "latency" else None)
    elif not budget_mode:
        sub = dataclasses.replace(sub, latency_limit=limit_s / own)
    try:
        # NOTE: a rewritten graph's own options are not said: one line per candidate is
        with progress.listening(False if rules else None):
            sol = solve_auto(sub, fallback=fallback, **_held(rules))
    except BudgetInfeasible as e:
        return _Candidate(_rank(None, e.smallest_peak_bytes, budget_mode), graph, rules, None,
                          str(e), changes, infeasible=e, factor=factor)
    if not budget_mode and sol.sim.latency_s * factor > limit_s * (1 + 1e-9):
        return _Candidate(_rank(None, sol.sim.peak_bytes, budget_mode), graph, rules, None,
                          "over the latency limit", changes, factor=factor)
    if budget_mode and sol.sim.peak_bytes > problem.budget_bytes:
        return _Candidate(_rank(None, sol.sim.peak_bytes, budget_mode), graph, rules, None,
                          "over the budget", changes, factor=factor)
    return _Candidate(_rank(sol, None, budget_mode, factor), graph, rules, sol, None, changes,
                      factor=factor)


def _again_until(problem: Problem, deadline: float) -> Callable:
    """The search's ``plan_again`` for ``search_timing``: a candidate's ``graph`` planned by
    auto for a latency limit of ``target_s`` seconds (its path's rules and ``name``:
    ``search_timing.RETRY`` or ``SLACK``), within
    what ``deadline`` leaves (at most ``CANDIDATE_S``); None where it leaves too little."""
    def plan_again(c: _Candidate, graph: Graph, target_s: float, changes: dict, name: str):
        left = deadline - planning_now()
        if left <= MIN_CANDIDATE_S:
            return None
        # NOTE: ``target_s`` is in the simulator's seconds of ``c``'s plan: on the footing of
        # ``c``'s factor, as the plan made again is judged
        return _plan(problem, graph, c.rules + (name,), changes, min(left, CANDIDATE_S),
                     target_s * c.factor, False, factor=c.factor)
    return plan_again


def _remat_plan(sol: Solution) -> bool:
    """Whether ``sol``'s plan is hotspot's on its graph (fission's split graphs are planned by
    hotspot too; offloading plans are not: re-planning would drop their copies)."""
    winner = str(sol.notes.get("winner", ""))
    return winner.startswith("hotspot") or (winner == "fission" and not sol.plan.counts().get(
        "offload", 0))


def _schedule_exactly(problem: Problem, best: _Candidate, deadline: float,
                      limit_s: float | None, budget_mode: bool) -> _Candidate:
    """``best`` re-planned by hotspot over the exact scheduler's order too, where its plan is
    hotspot's (on its graph: masks as bits, fission's splits); the better of the two."""
    sol = best.solution
    left = deadline - planning_now()
    if sol is None or left <= MIN_CANDIDATE_S or not _remat_plan(sol):
        return best
    graph = sol.graph_for(best.graph)
    sub = dataclasses.replace(problem, graph=graph, time_budget_s=left)
    if not budget_mode:
        sub = dataclasses.replace(sub, latency_limit=limit_s / best.factor / simulate(
            graph, eager_plan(graph), problem.cost_model).latency_s)
        if sub.latency_limit < 1.0:
            return best
    try:
        again = solve_hotspot(sub, exact=True)
    except BudgetInfeasible:
        return best
    if not budget_mode and again.sim.latency_s * best.factor > limit_s * (1 + 1e-9):
        return best
    # NOTE: the plan runs on auto's rewrite of the candidate where auto made one
    again = dataclasses.replace(again, graph=None if graph is best.graph else graph,
                                notes=dict(again.notes, winner="hotspot (exact order)"))
    cand = _Candidate(_rank(again, None, budget_mode, best.factor), best.graph, best.rules, again,
                      None, best.changes, factor=best.factor)
    return cand if _better(cand, best, budget_mode) else best
