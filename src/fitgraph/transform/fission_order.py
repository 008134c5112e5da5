"""Where a fissioned region runs: the node order of the rewritten graph, and the part bounds.

The region runs as one block, its parts one after the other, at the place of its first node.
Outside nodes captured between its first and last node run before the block if the region
needs them (directly, through in-place writes, or through the draw order of random ops), and
after it otherwise, in captured order. A region that would need a node which itself needs
the region (a path that leaves and comes back, e.g. through the draw order of dropouts) cannot
run as a block: ``FissionError`` names it.

Example:
    >>> from fitgraph.transform.fission_order import part_bounds
    >>> part_bounds(10, 4)        # units of the split axis -> [start, stop) per part
    [(0, 3), (3, 6), (6, 8), (8, 10)]
"""

from __future__ import annotations

from ..graph.dim_convex import order_edges
from ..graph.ir import Graph

__all__ = ["FissionError", "block_order", "part_bounds", "real_writes"]

# NOTE: ops whose schema declares in-place writes that the mode in their args rules out -> the
# position of that flag (False: no write): batch norm in evaluation reads its running
# statistics and never updates them
_FLAG_WRITES = {"aten.native_batch_norm.default": 5}


class FissionError(ValueError):
    """A region that cannot be run in parts as asked; the message says why."""


def real_writes(node) -> tuple[int, ...]:
    """The values ``node`` writes in place when it runs (its declared ``mutates`` less the
    writes its arguments switch off)."""
    pos = _FLAG_WRITES.get(node.target)
    if pos is not None and len(node.args) > pos and node.args[pos] is False:
        return ()
    return node.mutates


def part_bounds(length: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous parts of ``length`` units, as even as can be (earlier parts larger)."""
    if k < 2:
        raise FissionError(f"k={k}: a region is split into at least 2 parts")
    if length < k:
        raise FissionError(f"the split axis has {length} units: it cannot be cut in {k} parts")
    base, extra = divmod(length, k)
    out, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def block_order(graph: Graph, region_nodes: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(outside nodes before the block, outside nodes after it), each in captured order."""
    inside = set(region_nodes)
    first, last = min(inside), max(inside)
    _, pred = order_edges(graph)
    pred = {nid: list(ps) for nid, ps in pred.items()}
    # NOTE: random ops keep their draw order; region nodes never draw (dims rules refuse)
    prev = None
    for n in graph.nodes:
        if n.random and n.id not in inside:
            if prev is not None:
                pred[n.id].append(prev)
            prev = n.id
    needed: set[int] = set()
    stack = [p for nid in inside for p in pred[nid] if p > first and p not in inside]
    while stack:
        nid = stack.pop()
        if nid in needed:
            continue
        needed.add(nid)
        stack.extend(p for p in pred[nid] if p > first and p not in inside and p not in needed)
    for nid in sorted(needed):
        back = [p for p in pred[nid] if p in inside]
        if back:
            raise FissionError(
                f"the region cannot run as one block: it needs {graph.nodes[nid].name}, which "
                f"needs the region's {graph.nodes[back[0]].name} (order edges or the draw order "
                "of random ops); grow the region with it excluded")
    between = [nid for nid in range(first + 1, last) if nid not in inside]
    before = list(range(first)) + [nid for nid in between if nid in needed]
    after = [nid for nid in between if nid not in needed] + list(range(last + 1, len(graph.nodes)))
    return before, after
