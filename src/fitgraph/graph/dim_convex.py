"""Keeping a fission region convex: no path may leave it and come back.

A region runs as one block (its parts one after the other), so a node outside it cannot run
both after some region node and before another. When growth made such a path (a forward region
that reached the backward through the loss, whose seed gradient is computed outside), one side
of the outside nodes on those paths is cut away: the side that does not hold the region's start.

Example:
    >>> from fitgraph.graph.dim_convex import convexity_cut
    >>> succ = {0: [1, 2], 1: [2], 2: []}        # 0 -> 1 -> 2 and 0 -> 2
    >>> pred = {0: [], 1: [0], 2: [0, 1]}
    >>> convexity_cut({0, 2}, 0, succ, pred)      # region {0, 2} leaves through 1 and comes back
    {1: 1, 2: 1}
"""

from __future__ import annotations

from .dim_rules import SHAPE_ONLY
from .ir import Graph

__all__ = ["convexity_cut", "order_edges"]


# NOTE: the fission search grows regions of one graph and splits it a hundred times, and every
# split orders its block by these edges: computed once per graph (the last few graphs kept,
# each held so that its id is not reused while cached)
_CACHED_GRAPHS = 4
_cache: dict[tuple[int, int, int], tuple[Graph, tuple[dict, dict]]] = {}


def order_edges(graph: Graph) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(successors, predecessors) of every node: the orders a region must keep (shared
    between callers for the same graph: read them, do not change them).

    A node follows the producers of what it reads, and a write in place follows every earlier
    access to its storage (a read, the last write before it). Left out, unlike
    ``deps.dependencies``: the draw order of random ops (a region holds no drawing op: sdpa is
    tagged random but splits only with dropout_p=0) and the inputs of shape-only ops
    (empty_like reads no values: dim_rules.SHAPE_ONLY)."""
    key = (id(graph), id(graph.nodes), len(graph.nodes))
    hit = _cache.get(key)
    if hit is None:
        if len(_cache) >= _CACHED_GRAPHS:
            del _cache[next(iter(_cache))]
        hit = _cache[key] = (graph, _edges(graph))
    return hit[1]


def _edges(graph: Graph) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    pred: dict[int, set[int]] = {n.id: set() for n in graph.nodes}
    accesses: dict[int, list[int]] = {}   # storage -> nodes touching it so far
    last_write: dict[int, int] = {}
    for n in graph.nodes:
        reads = () if n.target in SHAPE_ONLY else n.inputs
        pred[n.id].update(p for v in reads if (p := graph.values[v].producer) is not None)
        written = {graph.values[v].storage for v in n.mutates}
        touched = {graph.values[v].storage for v in reads}
        touched |= {graph.values[o].storage for o in n.outputs if o is not None}
        for st in sorted(touched):
            if st in written:
                pred[n.id].update(accesses.get(st, ()))
            elif st in last_write:
                pred[n.id].add(last_write[st])
            accesses.setdefault(st, []).append(n.id)
        for st in written:
            last_write[st] = n.id
        pred[n.id].discard(n.id)
    succ: dict[int, list[int]] = {n.id: [] for n in graph.nodes}
    for nid in sorted(pred):
        for p in sorted(pred[nid]):
            succ[p].append(nid)
    return succ, {nid: sorted(ps) for nid, ps in pred.items()}


def _reach(starts, edges: dict[int, list[int]], through=None) -> set[int]:
    """Nodes reachable from ``starts`` (not included) along ``edges``, passing only through
    nodes for which ``through`` holds (default: any)."""
    seen: set[int] = set()
    stack = [s for n in starts for s in edges[n]]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if through is None or through(n):
            stack.extend(s for s in edges[n] if s not in seen)
    return seen


def convexity_cut(inside: set[int], anchor: int, succ: dict[int, list[int]],
                  pred: dict[int, list[int]], saved: set[int] = frozenset()) -> dict[int, int]:
    """Nodes to leave out so that ``inside`` becomes convex -> the outside node whose path
    forces it; {} when it is convex. ``anchor`` (a region node) stays: the cut is the side of
    the re-entry paths it is not on. ``saved``: outside nodes whose outputs the region reads as
    they were made before it ran (a forward region re-made in the backward reads a forward
    node outside it as saved): a path through one of them does not re-enter."""
    outside = lambda n: n not in inside  # noqa: E731
    below = {n for n in _reach(inside, succ, outside) if outside(n)}
    above = {n for n in _reach(inside, pred, outside) if outside(n)}
    # NOTE: outside nodes on a path out of and back into it
    between = sorted((below & above) - saved)
    if not between:
        return {}
    # NOTE: the side is chosen per re-entry node: an outside node upstream of the anchor loses
    # its producers, one downstream of it its users (one choice for all cut the anchor's side
    # when a region re-entered both above and below it)
    upstream = _reach([anchor], pred)
    cut: dict[int, int] = {}
    for x in between:  # NOTE: sorted, and first come first named: deterministic causes
        if x in cut:
            continue
        edges = pred if x in upstream else succ
        cut[x] = x
        stack = [x]
        while stack:
            for n in edges[stack.pop()]:
                if n not in cut:
                    cut[n] = x
                    stack.append(n)
    return dict(sorted(cut.items()))
