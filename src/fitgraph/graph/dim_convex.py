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

import dataclasses

from .deps import dependencies
from .dim_rules import SHAPE_ONLY
from .ir import Graph

__all__ = ["convexity_cut", "order_edges"]


def order_edges(graph: Graph) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(successors, predecessors) of every node under the dependencies a region must keep.

    NOTE: the draw-order edges between random ops are left out: a region holds no drawing op
    (sdpa is tagged random but splits only with dropout_p=0), so it never reorders draws. So are
    the edges into shape-only ops (empty_like): they read no values (dim_rules.SHAPE_ONLY)."""
    quiet = dataclasses.replace(graph, nodes=[
        dataclasses.replace(n, random=False, inputs=() if n.target in SHAPE_ONLY else n.inputs)
        for n in graph.nodes])
    succ: dict[int, list[int]] = {n.id: [] for n in graph.nodes}
    pred: dict[int, list[int]] = {n.id: [] for n in graph.nodes}
    for nid, before in dependencies(quiet).items():
        for p in sorted(before):
            succ[p].append(nid)
            pred[nid].append(p)
    return succ, pred


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
                  pred: dict[int, list[int]]) -> dict[int, int]:
    """Nodes to leave out so that ``inside`` becomes convex -> the outside node whose path
    forces it; {} when it is convex. ``anchor`` (a region node) stays: the cut is the side of
    the re-entry paths it is not on."""
    outside = lambda n: n not in inside  # noqa: E731
    below = {n for n in _reach(inside, succ, outside) if outside(n)}
    above = {n for n in _reach(inside, pred, outside) if outside(n)}
    between = sorted(below & above)       # outside nodes on a path out of and back into it
    if not between:
        return {}
    downstream = anchor in _reach(between, succ)
    edges = pred if downstream else succ
    cut: dict[int, int] = {}
    for x in between:  # NOTE: sorted, and first come first named: deterministic causes
        if x in cut:
            continue
        cut[x] = x
        stack = [x]
        while stack:
            for n in edges[stack.pop()]:
                if n not in cut:
                    cut[n] = x
                    stack.append(n)
    return dict(sorted(cut.items()))
