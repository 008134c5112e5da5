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
node (regions whose axis has fewer than ``PARTS`` units last; a re-made region by its largest
tensors' bytes, trimmed tightest first); the first ``SCREEN`` of a round (half of each kind,
one trim of a start) are made and screened — the split graph priced with the current plan's
drops carried over, no search — and the ``TRIES`` best-screened are planned by hotspot (least
peak); the one that lowers it most is kept, and rounds go on while one does and time is left.
Where they end, the search goes on from the lowest of up to ``BRANCHES`` runners-up (tries
planned below their round's start and not kept), and keeps the lowest peak of every path.
The graph it returns has its dropout masks as bits (``compact_masks``: a copy must not draw
again) and its saved views copied out of packed projections (``copy_saved_views``). Results are allclose to eager's, as fission's (parts), so ``exact`` problems never
get here.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers import Problem
    >>> from fitgraph.solvers.fission_backward import split_backward
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
import time

from ..cost.scaled import original_name
from ..graph.analysis import GraphError, new_storages
from ..graph.dim_region import Region, grow_region
from ..graph.ir import Graph, Phase
from ..plan.instructions import Recompute
from ..sim.remat_eval import RematError, RematEvaluator
from ..sim.simulate import SimResult
from ..transform.compact_masks import compact_masks
from ..transform.fission import FissionError, split_region
from ..transform.fission_loss import count_targets_apart
from ..transform.fission_shift import unshift_losses
from ..transform.recompute_copies import (
    COPY_SUFFIX,
    CopyError,
    copy_set,
    first_reader,
    recompute_copies,
)
from ..transform.saved_views import copy_saved_views
from ..transform.scatter_sums import stack_scatter_sums
from ..transform.view_chains import collapse_view_chains
from .base import BudgetInfeasible, EvaluatorMismatch, Problem, Solution
from .fission_regions import peak_starts, shared_regions, trimmed
from .hotspot import solve_hotspot

__all__ = ["split_backward"]

# NOTE: parts per split: 4 cuts a block's attention to a quarter; a later round may split again
PARTS = 8
# NOTE: candidates made and screened per round (half of each kind), and the best-screened
# planned (each a hotspot solve: seconds)
SCREEN = 4
TRIES = 2
ROUNDS = 6
# NOTE: runners-up kept to go on from where the greedy rounds end (lowest peak first)
BRANCHES = 3
PLAN_SHARE = 0.25
PLAN_MIN_S = 1.0
MAX_STORAGES = 3
# NOTE: 1.0 keeps the nodes of the largest tensors and the paths between them: a block's MLP
# interior (grown along the tokens, a region runs on through the residual into the next
# block's projections, which copied with it were kept whole in the backward)
SHARES = (0.0, 0.25, 1.0)
# NOTE: the kinds of candidate, each with half the screens of a round
COPIES, PLAIN = "copies", "plain"
# NOTE: a latency limit no plan reaches: hotspot then minimises the peak alone
_UNBOUNDED = 1e9


def split_backward(problem: Problem) -> Solution | None:
    """hotspot's least-peak plan on ``problem.graph`` (masks as bits) lowered by rounds of
    backward splits (see the module doc), within ``problem.time_budget_s``; None where hotspot
    finds no plan. ``notes``: ``splits`` (what each round did), ``tried`` (each candidate and
    the peak it reached), ``least_peak_before`` (the peak before the first split)."""
    t0 = time.perf_counter()
    deadline = t0 + problem.time_budget_s
    cm = problem.cost_model
    # NOTE: as fission reads the graph: a loss counts its targets apart and reads every
    # position of a shifted loss, and reshape round trips are read through, so a chunked loss
    # (logits, loss and gradient in one region) is a candidate
    # NOTE: and a view saved for the backward (nn.MultiheadAttention's values) is copied out of
    # the packed projection it views, which then dies in the forward
    graph = stack_scatter_sums(collapse_view_chains(count_targets_apart(unshift_losses(
        compact_masks(copy_saved_views(problem.graph))))))
    best = _least(graph, cm, deadline, t0, problem.time_budget_s)
    if best is None:
        return None
    before, tried = best.sim.peak_bytes, []
    path = (graph, best, [])
    final, others = path, []
    while True:
        path, left = _rounds(path, cm, deadline, t0, problem.time_budget_s, tried)
        others = sorted(others + left, key=lambda o: o[1].sim.peak_bytes)[:BRANCHES]
        if path[1].sim.peak_bytes < final[1].sim.peak_bytes:
            final = path
        if not others or time.perf_counter() > deadline:
            break
        # NOTE: rounds are greedy: where they end, go on from the lowest runner-up a round
        # planned. On Swin, once remat dropped the packed projections (chains through views),
        # round 1's best (the MLP backward along its rows) led to no second split, where the
        # runner-up (its MLP re-made along the tokens) leads to three (1.39x -> 1.27x)
        path, others = others[0], others[1:]
    graph, best, done = final
    notes = dict(best.notes, splits=done, tried=tried, least_peak_before=before,
                 masks="bits" if graph is not problem.graph else "as captured")
    return dataclasses.replace(best, solver="split_backward", notes=notes,
                               solve_s=time.perf_counter() - t0,
                               graph=None if graph is problem.graph else graph)


def _rounds(path: tuple[Graph, Solution, list[str]], cm, deadline: float, t0: float,
            total: float, tried: list[str]
            ) -> tuple[tuple[Graph, Solution, list[str]], list[tuple[Graph, Solution, list[str]]]]:
    """Rounds from ``path`` (graph, its plan, the splits that made it) while one lowers the
    peak: (where they end, the runners-up: candidates planned below their round's start peak
    and not kept)."""
    graph, best, done = path
    left = []
    while len(done) < ROUNDS:
        screened = _screened(graph, best, cm, deadline, tried)
        better, below = None, []
        for peak, _, what, g2 in _to_plan(screened):
            if time.perf_counter() > deadline:
                break
            sol = _least(g2, cm, deadline, t0, total)
            tried.append(f"{what}: screened {peak:,} B, planned "
                         + (f"{sol.sim.peak_bytes:,} B" if sol else "no plan"))
            if sol is None or sol.sim.peak_bytes >= best.sim.peak_bytes:
                continue
            # NOTE: every try of a round is planned, a large gain too: on Swin the first
            # (4.3%: the MLP backward along its rows) ended round 1 before its MLP re-made
            # along the tokens was planned, and no later round went below it
            below.append((g2, sol, [*done, what]))
            if better is None or sol.sim.peak_bytes < better[1].sim.peak_bytes:
                better = below[-1]
        if better is None:
            break
        left += [b for b in below if b is not better]
        graph, best, done = better
    return (graph, best, done), left


def _least(graph: Graph, cm, deadline: float, t0: float, total: float) -> Solution | None:
    if hasattr(cm, "profile"):
        cm.profile(graph)  # NOTE: measured costs: the parts' new shapes, once each
    left = max(deadline - time.perf_counter(), 1.0)
    try:
        # NOTE: a share of the whole per plan: each round plans several candidates
        return solve_hotspot(Problem(graph, cm, latency_limit=_UNBOUNDED,
                                     time_budget_s=min(left, max(PLAN_MIN_S, total * PLAN_SHARE))))
    except BudgetInfeasible:
        return None
    except EvaluatorMismatch:
        # NOTE: hotspot proves its plan on the simulator and refuses one its fast evaluator
        # priced otherwise; seen on split graphs whose backward slices a forward view (BERT's
        # attention mask, dropped per use): that candidate is passed over, never run unproven
        return None


def _screened(graph: Graph, best: Solution, cm, deadline: float,
              tried: list[str]) -> list[tuple[int, int, str, str, Graph]]:
    """(screened peak, rank, what, kind, split graph) of the round's first ``SCREEN`` candidates
    that can be made, lowest screened peak first.

    A screen is the split graph's peak with ``best``'s drops carried over (by name: a part
    drops where its whole did), priced by the evaluator without a search: a tenth of a
    second where planning one takes ten, and on Bloom's first round it ranks eight candidates
    as their plans do (each about 0.6 MB above its plan). Planning in the order of the
    heuristic ranks alone spent the round's tries on splits whose parts keep forward tensors
    for the backward (Bloom's attention split whole: 40 MB against 17 unsplit)."""
    dropped = _dropped_names(graph, best)
    out: list[tuple[int, int, str, str, Graph]] = []
    made, starts = {COPIES: 0, PLAIN: 0}, set()
    for rank, (what, kind, start, make) in enumerate(_candidates(graph, best)):
        if time.perf_counter() > deadline or sum(made.values()) >= SCREEN:
            break
        # NOTE: one share of a start per round: its other shares took the tries from every
        # other start (HuBERT's convolution backward along the channels, twice, before the
        # one along the time that runs its 6.2 MiB workspace in parts); each kind half the
        # screens (a re-made region costs seconds to make: every block's copies)
        if made[kind] >= SCREEN // 2 or (kind, start) in starts:
            continue
        try:
            g2 = make(deadline)
        except (FissionError, CopyError, GraphError, StopIteration) as e:
            tried.append(f"{what}: {type(e).__name__}: {e}"[:200])
            continue
        starts.add((kind, start))
        made[kind] += 1
        out.append((_screen(g2, cm, dropped), rank, what, kind, g2))
    out.sort(key=lambda c: c[:2])
    return out


def _to_plan(screened: list[tuple[int, int, str, str, Graph]]) -> list[tuple[int, int, str, Graph]]:
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
    picked += [c for c in screened if c not in picked][:TRIES - len(picked)]
    return [(peak, rank, what, g2) for peak, rank, what, _, g2 in picked]


def _dropped_names(graph: Graph, sol: Solution) -> set[str]:
    """The names of the nodes ``sol``'s plan recomputes."""
    return {graph.nodes[ins.node].name for ins in sol.plan if isinstance(ins, Recompute)}


def _screen(graph: Graph, cm, dropped: set[str]) -> int:
    """``graph``'s peak with the nodes named in ``dropped`` (or whose whole was: ``.part<i>``
    suffixes taken off) dropped; a peak above every other where that drop set cannot be
    planned."""
    if hasattr(cm, "profile"):
        cm.profile(graph)  # NOTE: measured costs: the parts' workspaces, once each shape
    drop = {n.id for n in graph.nodes if original_name(n.name) in dropped}
    try:
        return RematEvaluator(graph, cm).evaluate(drop).peak_bytes
    except RematError:
        return 1 << 62


def _parts(region: Region) -> int:
    """``PARTS``, or fewer where the split axis has fewer units: a linear layer's rows are
    its batch and tokens merged, cut only along the batch (two units at batch 2)."""
    return min(PARTS, region.length)


def _held(graph: Graph, region: Region, sim: SimResult, peak_node: int | None = None) -> int:
    """Bytes live at the peak in storages the region holds along its split dim, and the peak
    node's workspace where the region runs that node in parts."""
    live = sim.peak_live
    sts = {graph.values[v].storage for v, d in region.dims.items() if isinstance(d, int)}
    held = sum(graph.storages[st].nbytes for st in sts & live)
    # NOTE: HuBERT's peak is a convolution's backward whose workspace (6.2 MiB) is larger than
    # any tensor live beside it: a region along the time that runs it in parts was ranked below
    # two along the channels that did not, and never planned (1.93x -> 1.74x once planned)
    if peak_node is not None and peak_node in region.nodes:
        held += sim.breakdown.get("workspace", 0)
    return held


def _candidates(graph: Graph, best: Solution) -> list[tuple[str, str, tuple[int, int], object]]:
    """(what, kind (``COPIES`` or ``PLAIN``), the (value, dim) its region grows from (a
    re-made region: the forward one), make(deadline) the split graph) for the regions at
    ``best``'s peak, best-ranked first."""
    starts = peak_starts(graph, best.plan, best.sim, MAX_STORAGES)
    pc = best.sim.peak_instruction
    peak_node = getattr(best.plan[pc], "node", None) if pc >= 0 else None
    ranked = []
    seen: set = set()
    for i, (r, share) in enumerate(shared_regions(graph, starts, SHARES)):
        held = _held(graph, r, best.sim, peak_node)
        if not held or r.length < 2:
            continue
        # NOTE: regions cut in PARTS first, then by what the parts take off: a region split in
        # halves along the batch, tried first, took the tries from one along the rows in
        # eighths (BEiT's and Gemma-2's attention, kept at a higher peak)
        few = _parts(r) < PARTS
        held -= held // _parts(r)
        v = graph.values[r.start[0]]
        start = _forward_start(graph, r)
        if start is not None:
            u = graph.values[start[0]]
            key = ("copies", graph.nodes[u.producer].target, u.shape, start[1], share)
            if key not in seen:
                seen.add(key)
                what = (f"{u.name} dim {start[1]} re-made in the backward in up to {PARTS} "
                        f"parts, in every block alike (share {share})")
                # NOTE: ranked by what its largest tensors hold, the tightest region first:
                # every share of one start holds them, and a larger region copies more
                big = _held(graph, trimmed(graph, r, 1.0), best.sim, peak_node)
                ranked.append((few, -(big - big // _parts(r)), -share, i, what, COPIES, start,
                               _alike_maker(graph, start, share)))
        what = f"{len(r.nodes)} nodes from {v.name} dim {r.start[1]} in {_parts(r)} parts"
        alike = _alike_starts(graph, v.id)
        # NOTE: not from a part of an earlier split (its alikes are every block's parts)
        if (len(alike) > 1 and ".part" not in v.name
                and all(graph.nodes[n].phase is Phase.BACKWARD for n in r.nodes)):
            # NOTE: each block's backward peaks alike: splitting one per round only moves the
            # peak to the next block's (BERT's MLP backward, four rounds for four blocks)
            ranked.append((few, -held, 0, i - 0.5, what + ", in every block alike", PLAIN,
                           r.start, _alike_split_maker(graph, r.start, share)))
        ranked.append((few, -held, 0, i, what, PLAIN, r.start,
                       lambda deadline, r=r: split_region(graph, r, _parts(r), verify=True)))
    ranked.sort(key=lambda c: c[:4])
    return [c[4:] for c in ranked]


def _forward_start(graph: Graph, region: Region) -> tuple[int, int] | None:
    """The largest forward value the region runs in parts, and its dim (None: none)."""
    found = [(graph.values[v].nbytes, -v, d) for v, d in region.dims.items()
             if isinstance(d, int) and graph.values[v].producer is not None
             and graph.nodes[graph.values[v].producer].phase is Phase.FORWARD]
    if not found:
        return None
    _, v, d = max(found)
    return -v, d


def _alike_maker(graph: Graph, start: tuple[int, int], share: float):
    """Re-makes the forward region grown from ``start`` in the backward, in parts, and so for
    every alike start (each its own region: blocks differ in their edges, as BERT's first
    layer reads the expanded attention mask the others share)."""
    return _for_each_alike(graph, start, lambda g, v: _copied_in_parts(g, v, start[1], share))


def _alike_split_maker(graph: Graph, start: tuple[int, int], share: float):
    """Splits the region grown from ``start`` (trimmed to ``share``) and so the region of every
    alike start."""
    def split(g: Graph, v: int) -> Graph:
        r = grow_region(g, v, start[1])
        r = trimmed(g, r, share) if share else r
        if r.length < 2:
            raise FissionError(f"{g.values[v].name}: {r.length} units")
        return split_region(g, r, _parts(r), verify=True)
    return _for_each_alike(graph, start, split)


def _for_each_alike(graph: Graph, start: tuple[int, int], rewrite):
    """Makes ``rewrite(g, value id)`` applied to ``start``'s value and, in turn, to each alike
    start's (found by name in the graph the last rewrite returned); an alike start that cannot
    be rewritten is left as it is, ``start``'s own error is raised, and FissionError past the
    deadline."""
    names = [graph.values[v].name for v in _alike_starts(graph, start[0])]
    own = graph.values[start[0]].name

    def make(deadline: float) -> Graph:
        g = graph
        for k, name in enumerate(names):
            # NOTE: each rewrite walks the whole graph: an unrolled GRU's 256 steps are alike
            # (23,615 nodes: hours for one candidate)
            if time.perf_counter() > deadline:
                raise FissionError(f"out of time after {k} of {len(names)} alike starts")
            try:
                g = rewrite(g, next(v.id for v in g.values if v.name == name))
            except (FissionError, CopyError, GraphError, StopIteration):
                if name == own:
                    raise
        return g
    return make


def _alike_starts(graph: Graph, vid: int) -> list[int]:
    """Values made by the same op in the same phase, of the same shape, at the same output
    index."""
    v = graph.values[vid]
    n = graph.nodes[v.producer]
    at = n.outputs.index(vid)
    out = []
    for m in graph.nodes:
        if (m.phase is n.phase and m.target == n.target and len(m.outputs) > at
                and m.outputs[at] is not None and graph.values[m.outputs[at]].shape == v.shape):
            out.append(m.outputs[at])
    return out


def _full_length(graph: Graph, vid: int, dim: int, **kw) -> Region:
    """The region grown from ``vid`` along ``dim``; where it makes the axis coarser (a
    reshape ties the flattened tokens to the batch), the one that keeps every unit.

    NOTE: re-made in the backward, Gemma-2's MLP along its flattened tokens ran on through the
    3-D norms and residuals and was cut in 2 parts along the batch (31.2 MB planned against
    23.0 unsplit); kept to the 2-D MLP, it runs in up to ``PARTS`` parts."""
    r = grow_region(graph, vid, dim, **kw)
    if r.length >= graph.values[vid].shape[dim]:
        return r
    fine = grow_region(graph, vid, dim, keep_length=True, **kw)
    return fine if len(fine.nodes) >= 2 else r


def _forward_nodes(graph: Graph, vid: int, dim: int, share: float) -> list[int]:
    r = _full_length(graph, vid, dim)
    r = trimmed(graph, r, share) if share else r
    fwd = {n for n in r.nodes if graph.nodes[n].phase is Phase.FORWARD}
    return sorted(_linked(graph, graph.values[vid].producer, fwd))


def _linked(graph: Graph, start: int, nodes: set[int]) -> set[int]:
    """The nodes of ``nodes`` that ``start`` leads to (through tensors one makes and another
    reads), and those that lead to ``start`` or to them. A region also takes the other readers
    of a tensor it reads along its dim (every block's attention mask, made from one shared
    mask): those belong to other blocks, and copied or split with this one they would be
    kept whole from the forward to the backward."""
    readers: dict[int, set[int]] = {n: set() for n in nodes}
    makers: dict[int, set[int]] = {n: set() for n in nodes}
    for n in nodes:
        for v in graph.nodes[n].inputs:
            m = graph.values[v].producer
            if m in nodes and m != n:
                readers[m].add(n)
                makers[n].add(m)
    after = _closure({start}, readers)
    return _closure(after, makers)


def _closure(seeds: set[int], edges: dict[int, set[int]]) -> set[int]:
    seen, todo = set(seeds), list(seeds)
    while todo:
        for m in edges.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _copied_in_parts(graph: Graph, vid: int, dim: int, share: float) -> Graph:
    """``graph`` with the forward region grown from ``vid`` along ``dim`` re-made in the
    backward and run there in up to ``PARTS`` parts with the backward ops that read it."""
    nodes = copy_set(graph, _forward_nodes(graph, vid, dim, share))
    name = graph.values[vid].name + COPY_SUFFIX
    g = recompute_copies(graph, nodes)
    copy = next(v.id for v in g.values if v.name == name)
    # NOTE: the copies go in right before their first reader; the backward nodes before them
    # are later blocks' (nn.MultiheadAttention's backward is row-wise along the tokens from
    # block to block: grown through them, the region's convexity cut took this block's own)
    first = first_reader(graph, nodes)
    outside = {n.id: "not in the backward" for n in g.nodes if n.phase is not Phase.BACKWARD}
    region = _backward_region(g, copy, dim, outside, first)
    out = split_region(g, region, _parts(region), verify=True)
    _check_views(out)
    return _forward_in_parts(out, graph.values[vid].name, dim)


def _backward_region(graph: Graph, copy: int, dim: int, outside: dict[int, str],
                     first: int) -> Region:
    """The region grown from the copies' value ``copy`` along ``dim`` in the backward.

    Backward nodes that run before the copies (before node ``first``) stay out: the backward
    of nn.MultiheadAttention is row-wise along the tokens from block to block, and grown
    through a later block's, the region's convexity cut took this block's own. Except a node
    that only feeds the region along the split dim: the gradient of a block's MLP hidden
    (``dY @ W2``, 1 MiB on nn.TransformerEncoder) runs just before the first reader of the
    hidden's copy, and left out it stayed whole at the peak."""
    before = {n.id: "runs before the copies (a later block's backward)"
              for n in graph.nodes[:first] if n.phase is Phase.BACKWARD}
    region = _full_length(graph, copy, dim, exclude=outside | before)
    inside = set(region.nodes)
    fed = {graph.values[v].producer for v, d in region.dims.items() if isinstance(d, int)}
    fed &= before.keys()
    if not fed:
        return region
    readers: dict[int, set[int]] = {}
    for n in graph.nodes:
        for u in n.inputs:
            readers.setdefault(graph.values[u].storage, set()).add(n.id)
    feed = {p for p in fed if all(readers.get(graph.values[o].storage, set()) <= inside
                                  for o in graph.nodes[p].outputs if o is not None)}
    if not feed:
        return region
    wider = _full_length(graph, copy, dim, exclude=outside | {
        n: why for n, why in before.items() if n not in feed})
    return wider if inside < set(wider.nodes) else region


def _forward_in_parts(graph: Graph, name: str, dim: int) -> Graph:
    """``graph`` with the forward region grown from value ``name`` along ``dim`` (forward
    nodes only) run in up to ``PARTS`` parts too; ``graph`` itself where it cannot be.

    Once the backward reads the copies, the forward region's own tensors are read by forward
    nodes alone: its parts die in the forward, so splitting it costs no saved tensor and cuts
    the forward's peak (a block's scores and softmax, whole, in every forward)."""
    vid = next((v.id for v in graph.values if v.name == name), None)
    if vid is None:
        return graph
    out_of_forward = {n.id: "not in the forward" for n in graph.nodes
                      if n.phase is not Phase.FORWARD}
    # NOTE: a forward node whose storages the backward reads (through any view) stays whole:
    # its parts would be saved for the backward
    later = {graph.values[v].storage for n in graph.nodes if n.phase is not Phase.FORWARD
             for v in n.inputs}
    saved = {n.id: "read by the backward" for n in graph.nodes if n.phase is Phase.FORWARD
             and any(graph.values[o].storage in later for o in n.outputs if o is not None)}
    if graph.values[vid].producer in saved:
        return graph
    region = grow_region(graph, vid, dim, exclude=out_of_forward | saved)
    own = _linked(graph, graph.values[vid].producer, set(region.nodes))
    if len(own) < len(region.nodes):
        others = {n: "another block's" for n in region.nodes if n not in own}
        region = grow_region(graph, vid, dim, exclude=out_of_forward | saved | others)
    if region.length < 2:
        return graph
    try:
        out = split_region(graph, region, _parts(region), verify=True)
        _check_views(out)
    except (FissionError, CopyError, GraphError):
        return graph
    return out


def _check_views(graph: Graph) -> None:
    """A node that allocates nothing and writes nothing (a view) must return tensors in the
    storages it reads; CopyError where one does not (the planner would free the wrong
    storage)."""
    fresh = new_storages(graph)
    for n in graph.nodes:
        if fresh[n.id] or n.mutates:
            continue
        read = {graph.values[v].storage for v in n.inputs}
        for o in n.outputs:
            if o is not None and graph.values[o].storage not in read:
                raise CopyError(f"{n.name} returns {graph.values[o].name} in a storage it "
                                "does not read")
