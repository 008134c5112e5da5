"""The coordinated search's moves: how one candidate graph is made from another
(``solvers.coordinated``, the search over them).

From a candidate: the graph its plan ran where auto rewrote it (``AGAIN``), its graph planned
with auto's mask choice the other way (``MASKS``), each matching rewrite rule not yet on its
path, those that save the most bytes first, whole or on the better half of its matches
(``HALF``). From the captured graph also: fission's other first-round splits (``SPLIT``),
auto's plans for the other kind of constraint (``PROBE``), and where auto's plan misses the
budget, splits of the regions at its least-peak plan's peak (``AT_LEAST_PEAK``). A move makes
its graph lazily: a rule's rewrite only when its turn comes.

Example:
    >>> from fitgraph.solvers.search_moves import HALF, _half
    >>> class M:   # a rule's match: the bytes and FLOPs it saves
    ...     def __init__(self, b): self.bytes_saved, self.flops_saved = b, 0.0
    >>> [m.bytes_saved for m in _half([M(1), M(5), M(3)])]
    [5, 3]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import progress
from ..cost.clock import planning_now
from ..graph.ir import Graph
from ..transform.rules import Rule
from .base import Problem
from .fission.first_splits import first_splits, splits_at

# NOTE: a candidate of the search (``coordinated._Candidate``: its graph, the moves on its
# path, auto's plan of it); not imported, the search imports this module
_Candidate = Any

# NOTE: the move that takes a candidate's plan's own graph (auto's splits, masks as bits,
# chunked updates) as a candidate graph: auto plans once, its fission greedy stops where its
# estimates say, and a second plan on the split graph, measured, may split deeper or drop less
AGAIN = "auto_rewrite_again"
# NOTE: the moves that plan a candidate's graph with the choice auto made greedily the other
# way: its dropout masks as bits (or kept full) whatever hotspot's two plans said. auto picks
# the graph every later option (fission) plans on by hotspot's plans on both; fission may
# split the other graph further (ViT-B/16 small within 1.05x, one process's measured costs:
# auto planned on the bits, hotspot's plan at 131.1 MiB, fission finding no better split
# there; the same graph with the masks kept full, fission split it: 102.1 MiB)
MASKS = {True: "masks_as_bits", False: "masks_kept_full"}
# NOTE: a rule on the half of its matches that save the most bytes, where the whole rule does
# not pay (MAGIS mutates one match at a time; all at once can cost more time than a latency
# limit leaves: ResNet-50 within 1.05x, every BatchNorm through its residual sum); its name
# on the path gets this suffix
HALF = " (half)"
# NOTE: the moves from the captured graph that take one of fission's first-round splits other
# than the one auto's fission went on with (``first_splits``: each region's best part count),
# planned by auto (which may split its parts further): fission's greedy commits to the split
# its estimates rank first, and near-equal estimates rank differently from run to run (Llama
# small within 1.05x: 701 nodes grown from the loss in 4 parts, 0.38 of eager's peak, in one
# process; the loss's 12 nodes in 4 parts, 0.59, in the next). Their names on the path: this
# prefix + the split
SPLIT = "fission: "
# NOTE: at most this many of them (one each from the best-ranked regions)
SPLITS = 3
# NOTE: the moves from the captured graph that plan it by auto for the other kind of
# constraint, and keep the plan where it holds the problem's own (``PROBE``): auto's two modes
# are heuristics apart, and one finds plans the other misses. Latency mode: auto for a budget
# of these fractions of its own plan's peak, kept where it simulates within the limit (UNet
# small within 1.05x, one process's costs: auto's latency plan at 0.84 of eager's peak, 0.2025
# s; its budget plan at 0.8, fission's split, 0.56 and 0.1994 s; the search had stopped at
# 33 s of 90, its frontier spent). Budget mode: auto for a latency limit of these fractions of
# its own plan's simulated step, kept where its peak is within the budget — the first, its own
# step, for the least peak as fast (``search_timing.HEADROOM``)
PROBE_PEAKS = (0.8, 0.6)
PROBE_STEPS = (1.0, 0.97, 0.93)
# NOTE: their names on the path: this prefix + the constraint
PROBE = "auto for "
# NOTE: a rule rewrites the graph its parent's plan runs where auto rewrote it (fission's
# splits, masks as bits; where the rule matches there), not the parent's own: a candidate gets
# at most CANDIDATE_S, in which auto on the rule's rewrite of the captured graph seldom gets as
# far as fission again (GPT-2 small within 1.05x: scale_across_matmul on the captured graph,
# 0.77 of eager's peak, hotspot alone in 10 s; on auto's split graph 0.43 in 4.5 s, auto's 0.43)
ON_PLANNED = "the graph auto's plan ran"


def _promising_first(parent: _Candidate, rules: list[Rule]
                     ) -> list[tuple[Rule, Graph, list]]:
    """The rules not yet applied on ``parent``'s path (whole or half) that match, each with
    the graph it rewrites and its matches there — the graph ``parent``'s plan runs where auto
    rewrote it (``ON_PLANNED``), else ``parent``'s own — those that save the most bytes first
    (then the most FLOPs; ties in registry order): where the deadline leaves time for a few
    candidates only, they are the ones that can move the peak (or the step)."""
    applied = {name.removesuffix(HALF) for name in parent.rules}
    sol = parent.solution
    graphs = [g for g in (sol.graph if sol is not None else None, parent.graph) if g is not None]
    found = []
    for r in rules:
        if r.name in applied:
            continue
        on = next(((g, ms) for g in graphs if (ms := r.find(g))), None)
        if on is not None:
            found.append((r, *on))
    return sorted(found, key=lambda f: (-sum(m.bytes_saved for m in f[2]),
                                        -sum(m.flops_saved for m in f[2])))


def _half(matches: list) -> list:
    """The half of ``matches`` (rounded up) that save the most bytes (then FLOPs)."""
    ranked = sorted(matches, key=lambda m: (-m.bytes_saved, -m.flops_saved))
    return ranked[:(len(ranked) + 1) // 2]


@dataclass(frozen=True)
class _Move:
    """One move from a candidate: its name on the path, the graph it makes (lazily: a rule's
    rewrite only when its turn comes), what it changes; for a rule with two or more matches,
    the same rule on the half of them that save the most bytes (``HALF``), tried where the
    whole rule does not pay."""

    name: str
    make: Callable[[], Graph]
    change: dict
    half: _Move | None = None
    # NOTE: ``PROBE``: auto plans for this constraint instead ("budget", bytes) or ("latency",
    # seconds), and the plan is judged by the problem's own
    probe: tuple[str, float] | None = None
    # NOTE: ``SPLIT``: the graph's eager step is timed before it is planned, and its plans'
    # simulated steps scaled by what the simulator missed there (``search_timing.CALIBRATED``)
    calibrate: bool = False


def _moves(parent: _Candidate, rules: list[Rule]) -> list[_Move]:
    """The moves from ``parent``: first the graph its plan runs where auto rewrote it
    (``AGAIN``: fission's splits, masks as bits, chunked updates, planned again by auto,
    whose fission may split the parts further), then its graph planned with auto's mask
    choice the other way (``MASKS``), then each matching rule not yet on its path applied
    (``_promising_first``'s order), each with its half."""
    moves = []
    sol = parent.solution
    if sol is not None and sol.graph is not None:
        moves.append(_Move(AGAIN, lambda: sol.graph, {
            "planned_by": sol.notes.get("winner", sol.solver),
            "splits": list(sol.notes.get("splits", []))}))
    if (sol is not None and "masks_as_bits" not in _held(parent.rules)
            and isinstance(sol.notes.get("compact_masks"), dict)):
        # NOTE: only where auto weighed the bits (hotspot planned them): elsewhere (the eager
        # plan fits, remat is eager-fast) forcing them changes nothing
        on = not sol.notes.get("masks_as_bits", False)
        moves.append(_Move(MASKS[on], lambda: parent.graph, {"masks_as_bits": on}))

    def rewrite(rule: Rule, graph: Graph, matches: list, suffix: str = "",
                half: _Move | None = None):
        change = {"matches": len(matches), "bytes_saved": sum(m.bytes_saved for m in matches),
                  "flops_saved": sum(m.flops_saved for m in matches)}
        if graph is not parent.graph:
            change["on"] = ON_PLANNED
        return _Move(rule.name + suffix, lambda: rule.rewrite(graph, matches=matches), change,
                     half)

    for rule, graph, matches in _promising_first(parent, rules):
        half = rewrite(rule, graph, _half(matches), HALF) if len(matches) > 1 else None
        moves.append(rewrite(rule, graph, matches, half=half))
    return moves


def _split_moves(problem: Problem, first: _Candidate, time_s: float) -> list[_Move]:
    """The moves from the captured graph to fission's other first-round splits (``SPLIT``),
    weighed within ``time_s``; none where the problem is exact (fission sums in parts).

    NOTE: in budget mode too where auto's plan is as fast as the eager plan: no split plan is
    faster, but one may be as fast in less memory (``search_timing.HEADROOM``; Llama small at
    0.6 of its peak, 701 nodes grown from the loss in 4 parts, 0.75 of auto's plan's peak,
    simulated 1.3% faster); there the search had stopped at 9 s of 90, its frontier spent."""
    sol = first.solution
    if problem.exact:
        return []
    own = tuple(sol.notes.get("splits", [])[:1]) if sol is not None else ()
    with progress.stage("search: fission's first splits"):
        found = first_splits(problem, deadline=planning_now() + time_s, n=SPLITS, skip=own)
    return [_Move(SPLIT + what, lambda g=g: g, {"split": what}, calibrate=True)
            for what, g in found]


# NOTE: the moves from the captured graph, where auto's plan misses the budget, to single
# splits of the regions live at its least-peak plan's peak (``first_splits.splits_at``), at
# most this many, planned even where auto's fallbacks spent the search's deadline (the budget
# is unmet otherwise); their names on the path: SPLIT + the split + this
AT_LEAST_PEAK = " at the least peak"
SPLITS_AT_LEAST_PEAK = 3


def _least_peak_split_moves(problem: Problem, first: _Candidate) -> list[_Move]:
    """Where ``first`` (auto on the captured graph) has no plan within the budget but a plan
    at its least peak (on its error), fission's single splits of the regions live at that
    plan's peak (``AT_LEAST_PEAK``); none where the problem is exact (fission sums in parts).

    NOTE: the fission search grows its regions from the eager plan's peak; below every remat
    plan's reach the peak is elsewhere (ResNet-50 small at 0.4 of its peak: DTR's least-peak
    plan 55.4 MiB for 54.4 asked, in layer2.0's backward; its downsample convolution's
    backward in 2 parts, planned by auto, 53.5 MiB)."""
    least = first.infeasible.solution if first.infeasible is not None else None
    if problem.exact or first.solution is not None or least is None:
        return []
    graph = least.graph_for(first.graph)
    with progress.stage("search: splits at auto's least peak"):
        found = splits_at(graph, least.plan, least.sim, n=SPLITS_AT_LEAST_PEAK)
    return [_Move(SPLIT + what + AT_LEAST_PEAK, lambda g=g: g, {"split": what,
                                                                "at": "the least peak"})
            for what, g in found]


def _probe_moves(problem: Problem, first: _Candidate, eager_s: float) -> list[_Move]:
    """The moves that plan the captured graph by auto for the other kind of constraint
    (``PROBE``): latency mode, a budget of ``PROBE_PEAKS`` of auto's plan's peak; budget mode,
    a limit of ``PROBE_STEPS`` of its simulated step, where that is not under the eager step
    (``eager_s``). None where auto found no plan."""
    sol = first.solution
    if sol is None:
        return []
    def probe(what: str, kind: str, value: float) -> _Move:
        return _Move(PROBE + what, lambda: problem.graph, {kind: value}, probe=(kind, value))

    if problem.budget_bytes is None:
        return [probe(f"a budget of {f:g}x its peak", "budget", int(f * sol.sim.peak_bytes))
                for f in PROBE_PEAKS]
    return [probe(f"a limit of {f:g}x its step", "latency", f * sol.sim.latency_s)
            for f in PROBE_STEPS if f * sol.sim.latency_s >= eager_s]


def _held(rules: tuple[str, ...]) -> dict:
    """The choices of auto's a path of moves holds it to (``MASKS``: its descendants keep it)."""
    on = [choice for choice, name in MASKS.items() if name in rules]
    return {"masks_as_bits": on[0]} if on else {}
