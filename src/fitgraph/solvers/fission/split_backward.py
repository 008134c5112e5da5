"""Split the remat plan's peak: re-make forward regions in the backward, in parts, in every block.

Below what remat alone reaches, a transformer's peak is one block's recomputed attention in the
backward: the softmax, the dropout mask, the gradient of the probabilities and its product with
the mask, four ``[batch, heads, T, T]`` tensors at once, beside every gradient made so far.
``fission`` grows its regions from the eager plan's peak, where no such region is convex (a
block's forward and backward have every later block between them). Here each round looks at the
remat plan's peak (hotspot, least peak), grows regions from what is live there, and tries:

- re-making a forward region in the backward and running it there in parts, with the backward
  ops that read it (``transform.recompute_copies``, then ``split_region``) — in every block
  alike at once (the same ops from an alike start), since each block's backward peaks alike
  and splitting one only moves the peak to the next;
- a plain split of a region the peak holds (a chunked loss: its logits and their gradient).

Candidates are ranked by the bytes live at the peak that the region holds along its split
dim, less a part's share of them, and the peak node's workspace where the region runs that
node (regions whose axis has fewer than half ``PARTS`` units last; a re-made region by its largest
tensors' bytes, trimmed tightest first); the first ``SCREEN`` of a round (half of each kind,
one trim of a start) are made and screened — the split graph priced with the current plan's
drops carried over, no search — and the ``TRIES`` best-screened are planned by hotspot (least
peak); the one that lowers it most is kept, and rounds go on while one does and time is left.
Where none does, each region the path re-makes is made again with its next looser trim (where
that re-makes more nodes; a later split whose start it took in left out) and planned; a lower
one is the round's gain (``_widened``). Where that is not lower either, the round screens its
next candidates, up to ``PAGES`` pages.
Where they end, the search goes on from the lowest of up to ``BRANCHES`` runners-up (tries
planned below their round's start and not kept, and detours: tries at most ``DETOUR`` above it
whose peak moved elsewhere, where a later split may cut it), and keeps the lowest peak of
every path. Given a ``target``, the search stops at the first plan within it
(a budget set to a peak this search reported is reached again without the whole search).
Where a path's rounds end, its splits are made again from the start in ``REPLAY_PARTS`` parts
(the candidates' recipes, ``solvers.fission.backward_regions``) and planned once; where that is lower,
the rounds go on from it.
The path kept has each part's products summed in place (``backward_regions.products_folded``:
attention's input gradient in head parts makes one whole tensor per projection) and is planned
again; that plan is kept where it is lower (and not tried where a target is met).
The graph it returns has its dropout masks as bits (``compact_masks``: a copy must not draw
again), its saved views copied out of packed projections (``copy_saved_views``) and each
convolution that reads a concatenation run once per operand, forward and backward
(``transform.per_operand_convolution``). Results are allclose to eager's, as fission's (parts),
so ``exact`` problems never get here.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers import Problem
    >>> from fitgraph.solvers.fission.split_backward import split_backward
    >>> _ = torch.manual_seed(0)
    >>> mlp = lambda: torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.GELU(),
    ...                                   torch.nn.Linear(512, 16))
    >>> model = torch.nn.Sequential(*(mlp() for _ in range(3)))
    >>> g = fitgraph.capture(model, torch.randn(256, 16), lambda m, x: m(x).square().mean())
    >>> cm = RooflineCostModel(get_device("cpu-generic"))
    >>> s = split_backward(Problem(g, cm, latency_limit=1e9, time_budget_s=10))
    >>> s.sim.peak_bytes < s.notes["least_peak_before"], s.graph is not None
    (True, True)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ...cost.clock import planning_now
from ...cost.scaled import original_name
from ...graph.analysis import GraphError
from ...graph.ir import Graph
from ...plan.instructions import Recompute
from ...sim.remat_eval import RematError, RematEvaluator
from ...transform.fission import FissionError
from ...transform.recompute_copies import COPY_SUFFIX, CopyError
from ...transform.registry import FISSION_READS, fission_reads
from ..base import BudgetInfeasible, EvaluatorMismatch, Problem, Solution
from ..remat.hotspot import solve_hotspot
from .backward_regions import COPIES, PARTS, PLAIN, Recipe, candidates, products_folded

__all__ = ["prepared", "split_backward"]

# NOTE: candidates made and screened per round (half of each kind), and the best-screened
# planned (each a hotspot solve: seconds)
SCREEN = 4
TRIES = 2
# NOTE: where a round's first page plans nothing lower (its kept regions tried wider too), its
# next candidates are screened, up to this many pages: BEiT's first round planned two
# candidates and, with no runner-up, ended its 240 s search in 24 s
PAGES = 3
ROUNDS = 6
# NOTE: runners-up kept to go on from where the greedy rounds end (lowest peak first)
BRANCHES = 3
# NOTE: a try planned above its round's start peak is a runner-up (a detour) where its peak
# moved elsewhere and is at most this share higher: on Gemma-2, re-making the MLP in parts
# moved the peak from block 0's MLP backward (22.98 MB) to the loss (23.97 MB), which a
# chunked loss then cut to 22.66; the greedy rounds never kept it
DETOUR = 0.10
PLAN_SHARE = 0.25
PLAN_MIN_S = 1.0
# NOTE: the path found, made again from its start in twice the parts: planned once, where
# planning every candidate in them costs each round its tries (Falcon: 4 tries in 60 s against
# 12, Gemma-2's 1,446 nodes 2)
REPLAY_PARTS = 2 * PARTS
# NOTE: a latency limit no plan reaches: hotspot then minimises the peak alone
_UNBOUNDED = 1e9


class _Path(NamedTuple):
    """A graph the search reached, its least-peak plan, the splits that made it (described)
    and their recipes."""
    graph: Graph
    sol: Solution
    splits: list[str]
    recipes: list[Recipe]


def split_backward(problem: Problem, target_bytes: int | None = None) -> Solution | None:
    """hotspot's least-peak plan on ``problem.graph`` (masks as bits) lowered by rounds of
    backward splits (see the module doc), within ``problem.time_budget_s`` and until a plan
    peaks within ``target_bytes`` (where given); None where hotspot finds no plan.
    ``notes``: ``splits`` (what each round did), ``tried`` (each candidate and the peak it
    reached), ``least_peak_before`` (the peak before the first split)."""
    t0 = planning_now()
    deadline = t0 + problem.time_budget_s
    cm = problem.cost_model
    # NOTE: as fission reads the graph: a loss counts its targets apart and reads every
    # position of a shifted loss, and reshape round trips are read through, so a chunked loss
    # (logits, loss and gradient in one region) is a candidate
    # NOTE: and a view saved for the backward (nn.MultiheadAttention's values) is copied out of
    # the packed projection it views, which then dies in the forward
    # NOTE: and a mask made alike for every batch row (an expand) is made once and expanded,
    # as is a bidirectional mask (its ``q_idx >= 0``, true everywhere, folded)
    # NOTE: and a convolution that reads a concatenation runs once per operand, forward and
    # backward: neither the concatenation nor its whole input gradient is made
    graph = prepared(problem.graph)
    total = problem.time_budget_s
    best = _least(graph, cm, deadline, t0, total)
    if best is None:
        return None
    before, tried = best.sim.peak_bytes, []
    # NOTE: a plan's time is kept for making a path again in more parts where it ends
    search_end = deadline - (_plan_s(total) if REPLAY_PARTS > PARTS else 0.0)
    target = target_bytes if target_bytes is not None else -1
    path = _Path(graph, best, [], [])
    final, others = path, []
    while best.sim.peak_bytes > target:
        path, left = _rounds(path, cm, search_end, t0, total, tried, target, graph)
        again = path
        if path.sol.sim.peak_bytes > target:
            again = _replayed(path, graph, cm, deadline, t0, total, tried)
        if again is not path:
            # NOTE: in more parts the peak moves on (Falcon's from the attention to the MLP
            # backward of block 0): the rounds go on from there
            path, more = _rounds(again, cm, search_end, t0, total, tried, target, graph)
            left += more
        others = sorted(others + left, key=lambda o: o.sol.sim.peak_bytes)[:BRANCHES]
        if path.sol.sim.peak_bytes < final.sol.sim.peak_bytes:
            final = path
        if (not others or planning_now() > search_end
                or final.sol.sim.peak_bytes <= target):
            break
        # NOTE: rounds are greedy: where they end, go on from the lowest runner-up a round
        # planned. On Swin, once remat dropped the packed projections (chains through views),
        # round 1's best (the MLP backward along its rows) led to no second split, where the
        # runner-up (its MLP re-made along the tokens) leads to three (1.39x -> 1.27x)
        path, others = others[0], others[1:]
    graph, best, done, _ = final
    # NOTE: a budget met needs no lower peak: the search stopped at its first plan within it
    folded = graph if best.sim.peak_bytes <= target else products_folded(graph)
    if folded is not graph:
        # NOTE: summed in place once the path is made: folded as the path went, later splits
        # grew otherwise (ALBERT's MLP re-made in parts kept two whole [512, 512] tensors once
        # its attention ran in head parts). Planned in a plan's time, past the deadline where
        # the search used it all
        sol = _least(folded, cm, max(deadline, planning_now() + _plan_s(total)), t0,
                     total)
        if sol is not None and sol.sim.peak_bytes < best.sim.peak_bytes:
            graph, best = folded, sol
            done = [*done, "each part's products summed in place"]
    notes = dict(best.notes, splits=done, tried=tried, least_peak_before=before,
                 masks="bits" if graph is not problem.graph else "as captured")
    return dataclasses.replace(best, solver="split_backward", notes=notes,
                               solve_s=planning_now() - t0,
                               graph=None if graph is problem.graph else graph)


def prepared(graph: Graph) -> Graph:
    """``graph`` as split_backward reads it (see the notes in ``split_backward``)."""
    return fission_reads(graph, FISSION_READS)


def _replayed(final: _Path, start: Graph, cm, deadline: float, t0: float, total: float,
              tried: list[str]) -> _Path:
    """``final``'s splits (where a path's rounds end) made again from ``start`` in up to
    ``REPLAY_PARTS`` parts and planned: that path where its peak is lower, else ``final``.

    NOTE: a split's parts hold a share of its region's tensors at a time (Falcon's attention
    re-made in 8 parts holds an eighth of its scores, softmax and their gradients at once);
    twice the parts halve it, and the search's rounds choose the splits in ``PARTS``."""
    if REPLAY_PARTS <= PARTS or not final.recipes or planning_now() > deadline:
        return final
    n = len(final.recipes)
    what = (f"the {n} splits" if n > 1 else "the split") + f" again in up to {REPLAY_PARTS} parts"
    g = start
    try:
        for recipe in final.recipes:
            g = recipe(g, REPLAY_PARTS, deadline)
    except (FissionError, CopyError, GraphError) as e:
        tried.append(f"{what}: {type(e).__name__}: {e}"[:200])
        return final
    sol = _least(g, cm, deadline, t0, total)
    tried.append(f"{what}: planned " + (f"{sol.sim.peak_bytes:,} B" if sol else "no plan"))
    if sol is None or sol.sim.peak_bytes >= final.sol.sim.peak_bytes:
        return final
    return _Path(g, sol, [*final.splits, what], final.recipes)


def _widened(final: _Path, start: Graph, cm, deadline: float, t0: float, total: float,
              tried: list[str]) -> _Path:
    """``final`` with each region it re-makes in the backward widened to the next looser trim
    (``backward_regions.copies_recipe``), one at a time, made again from ``start`` in up to
    ``PARTS`` parts and planned: the lowest of those paths and ``final``.

    NOTE: a round screens one trim of each start, the tightest first (a larger region copies
    more), and a start once re-made is not offered again. On BEiT the tightest re-made the
    attention's scores from ``add`` on, and its relative position bias (1 MiB a block, a
    gather from a table) was recomputed whole and read in slices at the peak: the next trim
    re-makes the gather in parts too."""
    best = final
    for i in range(len(final.recipes)):
        if i >= len(best.recipes):
            break   # NOTE: a wider region kept left a later split out
        wider = getattr(best.recipes[i], "wider", None)
        if wider is None or planning_now() > deadline:
            continue
        # NOTE: a looser trim that re-makes the same nodes costs a plan for nothing (Swin's
        # MLP, twice: 1.16x -> 1.19x, its runners-up short of time)
        if not best.recipes[i].widens(start):
            continue
        recipe = wider()
        what = f"split {i + 1} re-made wider (share {recipe.share})"
        g, recipes, failed = start, [], False
        for j, r in enumerate([*best.recipes[:i], recipe, *best.recipes[i + 1:]]):
            try:
                g = r(g, PARTS, deadline)
            except (FissionError, CopyError, GraphError, StopIteration) as e:
                # NOTE: a later split whose start the wider region took in is left out: on
                # BEiT the scores re-made wider ran the forward's dropout in parts, the start
                # of the next split (17.76 MB with it, 17.21 without)
                left = f": split {j + 1} left out" if j > i else ""
                tried.append(f"{what}{left}: {type(e).__name__}: {e}"[:200])
                failed = j <= i
                if failed:
                    break
                continue
            recipes.append(r)
        if failed:
            continue
        sol = _least(g, cm, deadline, t0, total)
        tried.append(f"{what}: planned " + (f"{sol.sim.peak_bytes:,} B" if sol else "no plan"))
        if sol is not None and sol.sim.peak_bytes < best.sol.sim.peak_bytes:
            best = _Path(g, sol, [*final.splits, what], recipes)
    return best


def _rounds(path: _Path, cm, deadline: float, t0: float, total: float, tried: list[str],
            target: int = -1, start: Graph | None = None) -> tuple[_Path, list[_Path]]:
    """Rounds from ``path`` while one lowers the peak, until it is within ``target``: (where
    they end, the runners-up: candidates planned below their round's start peak and not
    kept). Where no candidate lowers it, the regions the path re-makes are tried wider
    (``_widened``, made again from ``start``), then the round's next page of candidates
    (``_round``, up to ``PAGES``), and the rounds go on from a lower one."""
    graph, best, done, recipes = path
    left = []
    while len(done) < ROUNDS and best.sim.peak_bytes > target:
        ranked, seen = candidates(graph, best), set()
        better, below = None, []
        for page in range(PAGES):
            if (better is not None or planning_now() > deadline
                    or (page and len(seen) >= len(ranked))):
                break
            better = _round(graph, best, done, recipes, ranked, seen, cm, deadline, t0, total,
                            tried, below, left)
            if better is None and page == 0 and start is not None:
                wider = _widened(_Path(graph, best, done, recipes), start, cm, deadline, t0,
                                 total, tried)
                if wider.sol.sim.peak_bytes < best.sim.peak_bytes:
                    better = wider
        if better is None:
            break
        left += [b for b in below if b is not better]
        graph, best, done, recipes = better
    return _Path(graph, best, done, recipes), left


def _round(graph: Graph, best: Solution, done: list[str], recipes: list[Recipe], ranked: list,
           seen: set[int], cm, deadline: float, t0: float, total: float, tried: list[str],
           below: list[_Path], left: list[_Path]) -> _Path | None:
    """Screens the next page of ``ranked`` (the ranks not in ``seen``) and plans its ``TRIES``
    best: the lowest path planned below ``best`` (None: none), every such path added to
    ``below`` and each detour to ``left``."""
    screened = _screened(graph, best, cm, deadline, tried, ranked, seen)
    better = None
    at = _peak_at(graph, best)
    for peak, _, what, g2, recipe in _to_plan(screened):
        if planning_now() > deadline:
            break
        sol = _least(g2, cm, deadline, t0, total)
        tried.append(f"{what}: screened {peak:,} B, planned "
                     + (f"{sol.sim.peak_bytes:,} B" if sol else "no plan"))
        if sol is None:
            continue
        if sol.sim.peak_bytes >= best.sim.peak_bytes:
            if (sol.sim.peak_bytes <= best.sim.peak_bytes * (1 + DETOUR)
                    and _peak_at(g2, sol) not in (None, at)):
                left.append(_Path(g2, sol, [*done, what + " (a detour)"],
                                  [*recipes, recipe]))
            continue
        # NOTE: every try of a round is planned, a large gain too: on Swin the first
        # (4.3%: the MLP backward along its rows) ended round 1 before its MLP re-made
        # along the tokens was planned, and no later round went below it
        below.append(_Path(g2, sol, [*done, what], [*recipes, recipe]))
        if better is None or sol.sim.peak_bytes < better.sol.sim.peak_bytes:
            better = below[-1]
    return better


def _peak_at(graph: Graph, sol: Solution) -> str | None:
    """The name of the node at ``sol``'s peak, its parts' and copies' suffixes taken off
    (None: the peak is before the first instruction, or not at a node)."""
    pc = getattr(sol.sim, "peak_instruction", -1)
    node = getattr(sol.plan[pc], "node", None) if pc >= 0 else None
    if node is None:
        return None
    name = original_name(graph.nodes[node].name)
    return name.removesuffix(COPY_SUFFIX)


def _least(graph: Graph, cm, deadline: float, t0: float, total: float) -> Solution | None:
    try:
        cm.prepare(graph)  # NOTE: measured costs: the parts' new shapes, once each
    except RuntimeError:
        return None  # NOTE: an op of the split graph cannot run: no plan
    left = max(deadline - planning_now(), 1.0)
    try:
        # NOTE: a share of the whole per plan: each round plans several candidates
        return solve_hotspot(Problem(graph, cm, latency_limit=_UNBOUNDED,
                                     time_budget_s=min(left, _plan_s(total))))
    except BudgetInfeasible:
        return None
    except EvaluatorMismatch:
        # NOTE: hotspot proves its plan on the simulator and refuses one its fast evaluator
        # priced otherwise; seen on split graphs whose backward slices a forward view (BERT's
        # attention mask, dropped per use): that candidate is passed over, never run unproven
        return None


def _plan_s(total: float) -> float:
    return max(PLAN_MIN_S, total * PLAN_SHARE)


_Screened = tuple[int, int, str, str, Graph, Recipe]


def _screened(graph: Graph, best: Solution, cm, deadline: float, tried: list[str],
              ranked: list, seen: set[int]) -> list[_Screened]:
    """(screened peak, rank, what, kind, split graph, recipe) of the next ``SCREEN``
    candidates of ``ranked`` (best-ranked first, those whose rank is not in ``seen``: an
    earlier page's) that can be made, lowest screened peak first; their ranks added to
    ``seen``.

    A screen is the split graph's peak with ``best``'s drops carried over (by name: a part
    drops where its whole did), priced by the evaluator without a search: a tenth of a
    second where planning one takes ten, and on Bloom's first round it ranks eight candidates
    as their plans do (each about 0.6 MB above its plan). Planning in the order of the
    heuristic ranks alone spent the round's tries on splits whose parts keep forward tensors
    for the backward (Bloom's attention split whole: 40 MB against 17 unsplit)."""
    dropped = _dropped_names(graph, best)
    out: list[_Screened] = []
    made, starts = {COPIES: 0, PLAIN: 0}, set()
    for rank, (what, kind, start, recipe) in enumerate(ranked):
        if planning_now() > deadline or sum(made.values()) >= SCREEN:
            break
        if rank in seen:
            continue
        # NOTE: one share of a start per round: its other shares took the tries from every
        # other start (HuBERT's convolution backward along the channels, twice, before the
        # one along the time that runs its 6.2 MiB workspace in parts); each kind half the
        # screens (a re-made region costs seconds to make: every block's copies)
        if made[kind] >= SCREEN // 2 or (kind, start) in starts:
            continue
        seen.add(rank)
        try:
            g2 = recipe(graph, PARTS, deadline)
        except (FissionError, CopyError, GraphError, StopIteration) as e:
            tried.append(f"{what}: {type(e).__name__}: {e}"[:200])
            continue
        try:
            screen = _screen(g2, cm, dropped)
        except RuntimeError as e:
            # NOTE: a split graph whose ops cannot run (found by profiling them) is passed over
            # with its error: a candidate never fails the planner
            tried.append(f"{what}: {type(e).__name__}: {e}"[:200])
            continue
        starts.add((kind, start))
        made[kind] += 1
        out.append((screen, rank, what, kind, g2, recipe))
    out.sort(key=lambda c: c[:2])
    return out


def _to_plan(screened: list[_Screened]) -> list[tuple[int, int, str, Graph, Recipe]]:
    """The ``TRIES`` candidates of a round to plan: the best-screened of each kind first, then
    the best-screened of the rest.

    NOTE: a screen carries the current plan's drops over, which suit a plain split (the same
    forward) and not a region re-made in the backward (its forward runs whole, its copies
    later): on Swin the tokens of the MLP re-made screened above the unsplit peak and planned
    at 11.5 MB, where the two best-screened plain splits planned at 13.1 and 12.1 MB and
    the second, kept, led the later rounds to 1.41x the lower bound in place of 1.31x."""
    firsts = {}
    for c in screened:
        firsts.setdefault(c[3], c)
    picked = sorted(firsts.values(), key=lambda c: c[:2])[:TRIES]
    picked += [c for c in screened if all(c is not p for p in picked)][:TRIES - len(picked)]
    return [(peak, rank, what, g2, recipe) for peak, rank, what, _, g2, recipe in picked]


def _dropped_names(graph: Graph, sol: Solution) -> set[str]:
    """The names of the nodes ``sol``'s plan recomputes."""
    return {graph.nodes[ins.node].name for ins in sol.plan if isinstance(ins, Recompute)}


def _screen(graph: Graph, cm, dropped: set[str]) -> int:
    """``graph``'s peak with the nodes named in ``dropped`` (or whose whole was: ``.part<i>``
    suffixes taken off) dropped; a peak above every other where that drop set cannot be
    planned."""
    cm.prepare(graph)  # NOTE: measured costs: the parts' workspaces, once each shape
    drop = {n.id for n in graph.nodes if original_name(n.name) in dropped}
    try:
        return RematEvaluator(graph, cm).evaluate(drop).peak_bytes
    except RematError:
        return 1 << 62


