"""Candidate fission regions for a simulated peak: grown from what is live there, and trimmed.

A region grown by ``grow_region`` is maximal: along the tokens of a transformer it spans the
loss and the last blocks, whose small tensors gain nothing from parts but pay a kernel launch
per part. ``trimmed`` keeps the nodes that touch a large tensor (a share of the region's
largest) and the region nodes between them, so the search can weigh the classic small regions
(logits + loss + its gradient) against the whole.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.dim_region import grow_region
    >>> from fitgraph.solvers.fission.peak_regions import trimmed
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (64, 4), "float32", Role.INPUT)
    >>> w = b.add_input("w", (4, 1024), "float32", Role.PARAMETER)
    >>> h = b.add_node("aten.relu.default", [x], [((64, 4), "float32")])[0]
    >>> y = b.add_node("aten.mm.default", [h, w], [((64, 1024), "float32")])[0]
    >>> z = b.add_node("aten.exp.default", [y], [((64, 1024), "float32")])[0]
    >>> g = b.finish({"loss": z})
    >>> r = grow_region(g, x, 0)
    >>> r.nodes, trimmed(g, r, 0.5).nodes           # relu touches only small tensors
    ((0, 1, 2), (1, 2))
"""

from __future__ import annotations

from collections.abc import Iterator

from ...graph.analysis import new_storages
from ...graph.dim_convex import order_edges
from ...graph.dim_region import Region, RegionIndex, grow_region
from ...graph.dim_types import Reduced
from ...graph.ir import Graph
from ...plan.instructions import Plan
from ...sim.simulate import SimResult

__all__ = ["candidate_regions", "peak_starts", "shared_regions", "trimmed"]


def _node_bytes(graph: Graph, region: Region, nid: int) -> int:
    """The largest tensor a region node reads or writes in parts (or as a partial result)."""
    n = graph.nodes[nid]
    vids = list(n.inputs) + [o for o in n.outputs if o is not None]
    sizes = [graph.values[v].nbytes for v in vids
             if isinstance(region.dims.get(v), (int, Reduced))]
    return max(sizes, default=0)


def trimmed(graph: Graph, region: Region, share: float,
            edges: tuple[dict, dict] | None = None) -> Region:
    """The sub-region of nodes touching a tensor of at least ``share`` of the region's largest,
    plus the region nodes on paths between them (so it stays convex); ``edges``: the graph's
    ``order_edges`` if already known."""
    sizes = {nid: _node_bytes(graph, region, nid) for nid in region.nodes}
    big = max(sizes.values(), default=0)
    keep = {nid for nid, s in sizes.items() if s >= share * big}
    if not keep or keep == set(region.nodes):
        return region
    succ, pred = edges or order_edges(graph)
    inside = set(region.nodes)
    below = _reach(keep, succ, inside)
    above = _reach(keep, pred, inside)
    nodes = tuple(sorted(keep | (below & above)))
    values = {v for nid in nodes for v in graph.nodes[nid].inputs}
    values |= {o for nid in nodes for o in graph.nodes[nid].outputs if o is not None}
    return Region(region.start, nodes, {nid: region.splits[nid] for nid in nodes},
                  {v: d for v, d in region.dims.items() if v in values},
                  {v: u for v, u in region.units.items() if v in values}, {},
                  region.length, nodes[0],
                  {v: o for v, o in region.outers.items() if v in values})


def _reach(starts: set[int], edges: dict, inside: set[int]) -> set[int]:
    seen: set[int] = set()
    stack = [m for s in sorted(starts) for m in edges[s] if m in inside]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(m for m in edges[n] if m in inside and m not in seen)
    return seen


def peak_starts(graph: Graph, plan: Plan, sim: SimResult, max_storages: int,
                peak_inputs: bool = False) -> list[tuple[int, int]]:
    """(value, dim) starts: every dim (of size >= 2) of the largest storages made during the
    step that are live at the peak, largest first, and of what the peak's node makes (and,
    with ``peak_inputs``, of what it reads that the step made)."""
    first_value: dict[int, int] = {}
    for v in graph.values:
        first_value.setdefault(v.storage, v.id)
    made = [st for st in sim.peak_live if not graph.storages[st].role.resident]
    ranked = sorted(made, key=lambda st: (-graph.storages[st].nbytes, st))[:max_storages]
    pc = sim.peak_instruction
    if pc >= 0:
        nid = getattr(plan[pc], "node", None)
        if nid is not None:
            ranked += [graph.values[o].storage for o in graph.nodes[nid].outputs
                       if o is not None and graph.values[o].storage not in ranked]
            if peak_inputs:
                # NOTE: a node whose output splits only as a partial sum (a convolution's
                # backward along the time: its input gradients overlap by the halo and add)
                # is in no region grown from what it makes; one grown from its output
                # gradient runs it in parts (HuBERT: 24.7 -> 23.2 MB, its workspace cut)
                for v in graph.nodes[nid].inputs:
                    st = graph.values[v].storage
                    if st not in ranked and not graph.storages[st].role.resident:
                        ranked.append(st)
    starts = []
    for st in ranked:
        v = graph.values[first_value[st]]
        starts += [(v.id, d) for d, size in enumerate(v.shape) if size >= 2]
    return starts


def candidate_regions(graph: Graph, starts: list[tuple[int, int]], shares: tuple[float, ...],
                      exclude: dict[int, str] | None = None) -> list[Region]:
    """Regions grown from ``starts`` (deduplicated by their nodes), each whole and trimmed at
    each share; regions of one node or of views only are left out (parts would gain nothing)."""
    return [r for r, _ in shared_regions(graph, starts, shares, exclude)]


def shared_regions(graph: Graph, starts: list[tuple[int, int]], shares: tuple[float, ...],
                   exclude: dict[int, str] | None = None) -> Iterator[tuple[Region, float]]:
    """``candidate_regions``' regions, each with the smallest share that trims to it (0: the
    whole region), made one at a time (a caller that needs one stops early: a start's region
    on an unrolled GRU of 23,000 nodes takes a second to grow)."""
    index = RegionIndex(graph)
    edges = (index.succ, index.pred)
    fresh = new_storages(graph)
    # NOTE: keyed by nodes and axis length: trimmed, the maximal region (tokens tied to the
    # batch, length B) can hold the same nodes as the one that keeps every token (length B*T)
    seen: set[tuple[tuple[int, ...], int]] = set()
    for vid, dim in starts:
        r = grow_region(graph, vid, dim, exclude=exclude, index=index)
        grown = [r]
        if r.length < graph.values[vid].shape[dim]:
            # NOTE: the maximal region made the axis coarser (tokens tied to the batch through
            # a reshape): the one that keeps its full length is a candidate too
            grown.append(grow_region(graph, vid, dim, exclude=exclude, index=index,
                                     keep_length=True))
        for g in grown:
            if len(g.nodes) < 2 or g.length < 2:
                continue
            for share in shares:
                t = trimmed(graph, g, share, edges) if share > 0 else g
                # NOTE: a region of views allocates nothing: its parts could only add nodes
                key = (t.nodes, t.length)
                if len(t.nodes) >= 2 and key not in seen and any(fresh[n] for n in t.nodes):
                    seen.add(key)
                    yield t, share
