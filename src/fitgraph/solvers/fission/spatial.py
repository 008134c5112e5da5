"""Spatial fission candidates: halo regions grown where input gradients are separated.

A convolution's backward makes its input and its weight gradient in one node. Split along the
rows, that node ends every spatial region: its weight gradient is a partial sum over a part's
own rows while the next backward needs its input gradient on more rows than that (the halo).
``transform.fission_halo_grads.separate_input_grads`` rewrites it as two nodes, and then one
region runs a whole convolution chain, forward and backward, part by part — the split that
cuts a conv chain's peak. ``spatial_candidates`` grows regions from the search's starts in the
separated graph and keeps those that are spatial (``Region.halo``) and hold a separated half
(the others are grown in the graph itself already). Each comes with the graph it is a region
of: the input graph with only the backward nodes whose halves the region holds separated
(``separated_for``), so that a plan splitting something else runs the graph as captured.

Regions still end where no op has a rule along the rows: training-mode batch norm and group
norm (statistics over all rows), transposed convolutions, ceil-mode pooling. That is why a
U-Net (GroupNorm after every convolution) gains little here.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.solvers.fission.spatial import spatial_candidates
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(),
    ...                             torch.nn.Conv2d(4, 2, 3, padding=1))
    >>> g = fitgraph.capture(model, (torch.randn(1, 2, 32, 32),), lambda m, b: m(b[0]).sum())
    >>> relu = next(n for n in g.nodes if n.target == "aten.relu.default").outputs[0]
    >>> [(len(r.nodes), r.halo, base.meta["separated_grads"])
    ...  for base, r in spatial_candidates(g, [(relu, 2)], (0.0,))]
    [(11, True, ['convolution_backward.input', 'convolution_backward.weight'])]
"""

from __future__ import annotations

from ...graph.analysis import new_storages
from ...graph.dim_region import Region, RegionIndex, grow_region
from ...graph.ir import Graph
from ...transform.fission_halo_grads import separate_input_grads
from ...transform.fission_loss import counting_nodes
from .peak_regions import trimmed

__all__ = ["separated_for", "spatial_candidates"]

_SEPARATED = "separated_grads"


def spatial_candidates(graph: Graph, starts: list[tuple[int, int]],
                       shares: tuple[float, ...]) -> list[tuple[Graph, Region]]:
    """(graph to split, region of it) for every spatial region grown from ``starts`` (value
    ids of ``graph``) in ``graph`` with its backward nodes separated, whole and trimmed at each
    share, that holds a separated half; deduplicated, in the order of ``starts``."""
    sep = separate_input_grads(graph)
    if sep is graph:
        return []
    _check_same_values(graph, sep)
    halves = set(sep.meta[_SEPARATED]) - set(graph.meta.get(_SEPARATED, []))
    index = RegionIndex(sep)
    edges = (index.succ, index.pred)
    fresh = new_storages(sep)
    exclude = counting_nodes(sep)
    seen: set[tuple[int, ...]] = set()
    bases: dict[tuple[str, ...], Graph] = {}
    out: list[tuple[Graph, Region]] = []
    for vid, dim in starts:
        r = grow_region(sep, vid, dim, exclude=exclude, index=index)
        if len(r.nodes) < 2 or r.length < 2 or not r.halo:
            continue
        for share in shares:
            t = trimmed(sep, r, share, edges) if share > 0 else r
            held = tuple(sorted({sep.nodes[n].name for n in t.nodes} & halves))
            # NOTE: without a separated half the graph itself grows this region (or a larger)
            if not held or not t.halo or t.nodes in seen or not any(fresh[n] for n in t.nodes):
                continue
            seen.add(t.nodes)
            if held not in bases:
                bases[held] = separated_for(graph, held)
            out.append((bases[held], _moved(t, sep, bases[held])))
    return out


def separated_for(graph: Graph, halves: tuple[str, ...]) -> Graph:
    """``graph`` with only the backward nodes that ``halves`` (``<name>.input`` /
    ``<name>.weight``) come from separated."""
    whole = {h.rsplit(".", 1)[0] for h in halves}
    ids = [n.id for n in graph.nodes if n.name in whole]
    if len(ids) != len(whole):
        missing = sorted(whole - {graph.nodes[i].name for i in ids})
        raise ValueError(f"no node {missing[0]} to separate in the graph")
    return separate_input_grads(graph, ids)


def _check_same_values(graph: Graph, sep: Graph) -> None:
    """Separating adds nodes, never values: a value of ``graph`` has the same id in ``sep``,
    so starts (value ids) and regions' dims carry over unchanged."""
    if [v.name for v in graph.values] != [v.name for v in sep.values]:
        raise AssertionError("separate_input_grads renumbered the values of the graph: "
                             "spatial fission candidates would start from the wrong values")


def _moved(region: Region, src: Graph, dst: Graph) -> Region:
    """``region`` of ``src`` as the same region of ``dst``: a graph with the same values
    (separated in fewer places) holding every node of the region under its name.

    NOTE: still convex in ``dst``: a path through a whole backward node outside the region
    passes through one of its halves in ``src`` (both read the same inputs).
    """
    if dst is src:
        return region
    ids = {n.name: n.id for n in dst.nodes}
    move = {nid: ids[src.nodes[nid].name] for nid in
            set(region.nodes) | set(region.boundary) | {region.anchor} - {-1}
            if src.nodes[nid].name in ids}
    lost = [src.nodes[n].name for n in region.nodes if n not in move]
    if lost:
        raise AssertionError(f"region node {lost[0]} is not in the graph it was moved to")
    splits = dict(sorted((move[n], s) for n, s in region.splits.items()))
    boundary = dict(sorted((move[n], why) for n, why in region.boundary.items() if n in move))
    return Region(region.start, tuple(sorted(move[n] for n in region.nodes)), splits,
                  region.dims, region.units, boundary, region.length,
                  move.get(region.anchor, -1), region.outers)
