"""Which forward nodes a region re-made in the backward re-makes (``backward_regions``).

From a forward value and a dim, the region grown along it (kept to every unit of the axis
where a reshape would make it coarser: ``full_length``), trimmed to a share, kept to the
nodes its start leads to and those that lead to them (``linked_nodes``: not another block's
readers of a shared mask), plus what those nodes save for the backward off that path (a
``detach`` of a tanh's output), less the nodes whose output the parts would make as partial
sums.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.graph.ir import Phase
    >>> from fitgraph.solvers.fission.forward_regions import forward_nodes
    >>> mlp = lambda: torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
    ...                                   torch.nn.Linear(64, 16))
    >>> g = fitgraph.capture(torch.nn.Sequential(mlp(), mlp()), torch.randn(64, 16),
    ...                      lambda m, x: m(x).square().mean())
    >>> gelu = next(n for n in g.nodes if "gelu" in n.target and n.phase is Phase.FORWARD)
    >>> nodes, _ = forward_nodes(g, gelu.outputs[0], 0, 1.0, 8)
    >>> gelu.id in nodes and all(g.nodes[n].phase is Phase.FORWARD for n in nodes)
    True
"""

from __future__ import annotations

from ...graph.dim_region import Region, grow_region
from ...graph.dim_types import Reduced
from ...graph.ir import Graph, Phase
from ...transform.recompute_copies import first_reader
from .peak_regions import trimmed

__all__ = ["forward_nodes", "full_length", "linked_nodes"]


def full_length(graph: Graph, vid: int, dim: int, min_length: int = 0, **kw) -> Region:
    """The region grown from ``vid`` along ``dim``; where it makes the axis coarser (a
    reshape ties the flattened tokens to the batch), the one that keeps every unit (with
    ``min_length``: the one that keeps at least that many).

    NOTE: re-made in the backward, Gemma-2's MLP along its flattened tokens ran on through the
    3-D norms and residuals and was cut in 2 parts along the batch (31.2 MB planned against
    23.0 unsplit); kept to the 2-D MLP, it runs in up to ``PARTS`` parts (``backward_regions``)."""
    if min_length:
        return grow_region(graph, vid, dim, min_length=min_length, **kw)
    r = grow_region(graph, vid, dim, **kw)
    if r.length >= graph.values[vid].shape[dim]:
        return r
    fine = grow_region(graph, vid, dim, keep_length=True, **kw)
    return fine if len(fine.nodes) >= 2 else r


def forward_nodes(graph: Graph, vid: int, dim: int, share: float,
                  min_units: int) -> tuple[list[int], int]:
    """The forward nodes of the region grown from ``vid`` along ``dim`` to re-make in the
    backward (not one whose output the parts make as partial sums), and the least length
    that region keeps the axis at (0: its whole length; see ``full_length``).

    NOTE: HuBERT's first convolution layer (convolution, a GroupNorm per channel, GELU) runs
    along its channels, and the next convolution sums over them. Re-made with the rest, that
    sum must be whole before the next layer's activation backward reads it, which runs before
    this layer's backward: the region in the backward stopped at the copies, all of them
    whole (2.35x the lower bound against 1.93 unsplit). Left to the forward, the layer runs
    in parts: 1.56x."""
    fine = full_length(graph, vid, dim, re_made=True)
    nodes = _forward_part(graph, vid, fine, share)
    if first_reader(graph, nodes) is not None:
        return nodes, 0
    # NOTE: the region that keeps every unit can stop at a reshape before anything the
    # backward reads: Swin's ``probs @ v`` is [windows x heads, ...] and is read back as
    # [windows, tokens, heads x dim] (o_proj's input); that one re-made nothing. The one that
    # keeps at least ``min_units`` units (the windows) runs on to o_proj, and the backward's
    # region then keeps as many (the windows, not 16 rows of them)
    coarse = grow_region(graph, vid, dim, min_length=min_units, re_made=True)
    if coarse.nodes != fine.nodes:
        return _forward_part(graph, vid, coarse, share), coarse.length
    return nodes, 0


def _forward_part(graph: Graph, vid: int, region: Region, share: float) -> list[int]:
    r = trimmed(graph, region, share) if share else region
    partial = {graph.values[v].producer for v, d in r.dims.items() if isinstance(d, Reduced)}
    fwd = {n for n in r.nodes if graph.nodes[n].phase is Phase.FORWARD and n not in partial}
    linked = linked_nodes(graph, graph.values[vid].producer, fwd)
    return sorted(linked | _saved_branches(graph, linked, fwd - linked))


def _saved_branches(graph: Graph, linked: set[int], rest: set[int]) -> set[int]:
    """The nodes of ``rest`` that read only what ``linked`` nodes make (of the region's
    forward nodes) and whose outputs a backward node reads: what a region's own nodes save
    for the backward off the path to its start.

    NOTE: Gemma-2 caps its scores with a tanh, whose backward reads the tanh's output through
    a ``detach``. Re-made from the softmax, the region took the tanh (on the path to it) and not
    the detach (a reader off the path): the backward read the forward's whole tanh, which the
    plan recomputed whole with the scores (24.0 MB; from the tanh, 21.3)."""
    later: set[int] = set()
    for n in graph.nodes:
        if n.phase is not Phase.FORWARD:
            later.update(n.inputs)
    out: set[int] = set()
    for nid in sorted(rest):
        n = graph.nodes[nid]
        made = [graph.values[v].producer for v in n.inputs]
        inside = [m for m in made if m in linked or m in rest]
        if (inside and all(m in linked or m in out for m in inside)
                and any(o in later for o in n.outputs if o is not None)):
            out.add(nid)
    return out


def linked_nodes(graph: Graph, start: int, nodes: set[int]) -> set[int]:
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
