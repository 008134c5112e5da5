"""The backward region of a forward region re-made in the backward, and its readers past it.

``backward_regions.copies_recipe`` copies a forward region's nodes into the backward
(``recompute_copies``) and splits the backward region grown from the copies. Two things end
that region early on a convolution stack (wav2vec2's and HuBERT's feature encoder, re-made
along the time):

- a convolution's backward makes its input and weight gradients in one node; split along the
  time, its input gradient's parts overlap (a window reaches past a part's rows) and are added
  into a whole tensor, which the next layer's backward reads whole. With the two halves
  separated (``fission_halo_grads``), a part gathers the rows its input gradient needs and the
  region runs on through the whole stack: the halves are separated where the region grown in
  the separated graph is larger.
- a backward node that cannot join the region (it reads a sum over the whole time: the second
  term of the first layer's weight gradient after a group norm, ``group_norm_stats``) reads
  the copies whole, so the parts were assembled into a whole tensor for it. Such readers
  re-make their own copies instead, in a region of their own (``late_copies``), and the first
  region's copies are read by its own nodes alone.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.solvers.fission.backward_regions import copies_recipe
    >>> model = torch.nn.Sequential(torch.nn.Conv1d(1, 8, 10, 5), torch.nn.GELU(),
    ...                             torch.nn.Conv1d(8, 8, 3, 2), torch.nn.GELU(),
    ...                             torch.nn.Conv1d(8, 4, 3, 2))
    >>> g = fitgraph.capture(model, torch.randn(2, 1, 400), lambda m, x: m(x).square().mean())
    >>> gelu = [n for n in g.nodes if n.target == "aten.gelu.default"][1]
    >>> split = copies_recipe(g.values[gelu.outputs[0]].name, 2, 0.0)(g, 4, float("inf"))
    >>> sorted({n.name.rsplit(".", 1)[0] for n in split.nodes if ".input.part" in n.name})
    ['convolution_backward.input', 'convolution_backward_1.input']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...graph.dim_region import Region
from ...graph.ir import Graph, Phase
from ...transform.fission import split_region
from ...transform.fission_halo_grads import separable, separate_input_grads
from ...transform.recompute_copies import COPY_SUFFIX, CopyError, copy_set, recompute_copies
from .forward_regions import full_length
from .spatial import separated_for

__all__ = ["Copies", "backward_region", "copies_region", "late_copies"]


@dataclass(frozen=True)
class Copies:
    """A graph with a forward region's copies in the backward, the backward region grown from
    them, and the readers past it that re-make their own (``late``: names; ``dims``: the
    forward values they read -> the dim the region splits their copies along)."""

    graph: Graph
    region: Region
    late: tuple[str, ...] = ()
    dims: dict[str, int] = field(default_factory=dict)


def copies_region(graph: Graph, nodes: set[int], name: str, dim: int, min_length: int = 0,
                  late: bool = True) -> Copies:
    """``graph`` with ``nodes`` copied into the backward and the region grown from the copy
    named ``name`` along ``dim`` (see the module doc); ``late``: readers past the region
    re-make their own copies (``late_copies`` makes them)."""
    copied = {graph.nodes[i].name for i in nodes}
    g = recompute_copies(graph, nodes)
    g, region = _grown(g, name, dim, copied, min_length)
    past = _past(g, region, copied) if late else set()
    if not past:
        return Copies(g, region)
    made = {o for i in nodes for o in graph.nodes[i].outputs if o is not None}
    readers = {n.id for n in graph.nodes if n.phase is not Phase.FORWARD
               and n.name not in past and any(v in made for v in n.inputs)}
    try:
        g2 = recompute_copies(graph, nodes, readers)
        g2, region2 = _grown(g2, name, dim, copied, min_length)
    except CopyError:
        return Copies(g, region)
    if _names(g2, region2) != _names(g, region):
        return Copies(g, region)
    # NOTE: a copy is named after its original (``recompute_copies``)
    dims = {g2.values[v].name.removesuffix(COPY_SUFFIX): d for v, d in region2.dims.items()
            if isinstance(d, int) and g2.values[v].producer in _copy_nodes(g2, copied)}
    return Copies(g2, region2, tuple(sorted(past)), dims)


def late_copies(graph: Graph, made: Copies, parts: int) -> Graph:
    """``graph`` (``made``'s, its region split) with ``made.late``'s readers re-making the
    forward values they read in a region of their own, split in up to ``parts`` parts."""
    late = {n.id for n in graph.nodes if n.name in made.late}
    wanted = sorted({v for i in late for v in graph.nodes[i].inputs
                     if graph.values[v].name in made.dims
                     and graph.values[v].phase is Phase.FORWARD})
    if not wanted:
        raise CopyError(f"{sorted(made.late)[0]} reads no re-made forward value")
    nodes = copy_set(graph, {graph.values[v].producer for v in wanted})
    start = max(wanted, key=lambda v: graph.values[v].nbytes)
    name = graph.values[start].name
    copied = {graph.nodes[i].name for i in nodes}
    g = recompute_copies(graph, nodes, late)
    g, region = _grown(g, name + COPY_SUFFIX, made.dims[name], copied)
    return split_region(g, region, min(parts, region.length), verify=True)


def backward_region(graph: Graph, copy: int, dim: int, outside: dict[int, str],
                    first: int, min_length: int = 0) -> Region:
    """The region grown from the copies' value ``copy`` along ``dim`` in the backward (as
    ``full_length`` grows it, with ``min_length``).

    Backward nodes that run before the copies (before node ``first``) stay out: the backward
    of nn.MultiheadAttention is row-wise along the tokens from block to block, and grown
    through a later block's, the region's convexity cut took this block's own. Except a node
    that only feeds the region along the split dim: the gradient of a block's MLP hidden
    (``dY @ W2``, 1 MiB on nn.TransformerEncoder) runs just before the first reader of the
    hidden's copy, and left out it stayed whole at the peak."""
    before = {n.id: "runs before the copies (a later block's backward)"
              for n in graph.nodes[:first] if n.phase is Phase.BACKWARD}
    region = full_length(graph, copy, dim, min_length, exclude=outside | before)
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
    wider = full_length(graph, copy, dim, min_length, exclude=outside | {
        n: why for n, why in before.items() if n not in feed})
    return wider if inside < set(wider.nodes) else region


def _grown(graph: Graph, name: str, dim: int, copied: set[str], min_length: int = 0
           ) -> tuple[Graph, Region]:
    """The region grown from the copy named ``name`` in ``graph``, or in ``graph`` with the
    backward nodes it holds separated (convolutions', norms') where that region is larger
    (the module doc)."""
    region = _from_copies(graph, name, dim, copied, min_length)
    # NOTE: only where the region stops at a node that separates (a transformer's regions
    # run through its norms' backward whole: separating every one costs a rewrite per try)
    if not any(separable(graph.nodes[n]) for n in region.boundary):
        return graph, region
    sep = separate_input_grads(graph)
    if sep is graph:
        return graph, region
    wider = _from_copies(sep, name, dim, copied, min_length)
    halves = set(sep.meta.get("separated_grads", ())) - set(graph.meta.get("separated_grads", ()))
    held = tuple(sorted(_names(sep, wider) & halves))
    # NOTE: by the nodes of ``graph`` they hold (a separated node's halves are one of them):
    # a norm's backward splits along its rows either way, and separated for nothing it runs
    # as two kernels
    wider_names = {n.rsplit(".", 1)[0] if n in halves else n for n in _names(sep, wider)}
    if not held or len(wider_names) <= len(_names(graph, region)):
        return graph, region
    out = separated_for(graph, held)
    return out, _from_copies(out, name, dim, copied, min_length)


def _from_copies(graph: Graph, name: str, dim: int, copied: set[str], min_length: int
                 ) -> Region:
    copy = next((v.id for v in graph.values if v.name == name), None)
    if copy is None:
        raise CopyError(f"{name.removesuffix(COPY_SUFFIX)} itself is not re-made (its node "
                        "cannot be copied): nothing to run in parts from it")
    first = min(_copy_nodes(graph, copied))
    outside = {n.id: "not in the backward" for n in graph.nodes if n.phase is not Phase.BACKWARD}
    return backward_region(graph, copy, dim, outside, first, min_length)


def _past(graph: Graph, region: Region, copied: set[str]) -> set[str]:
    """Backward nodes past ``region`` that read copies it makes in parts (the parts are
    assembled whole for them)."""
    copies = _copy_nodes(graph, copied)
    held = {v for v, d in region.dims.items()
            if isinstance(d, int) and graph.values[v].producer in copies}
    inside = set(region.nodes)
    return {n.name for n in graph.nodes if n.phase is Phase.BACKWARD and n.id not in inside
            and n.id not in copies and any(v in held for v in n.inputs)}


def _copy_nodes(graph: Graph, copied: set[str]) -> set[int]:
    """Ids of the copies of the nodes named ``copied``."""
    names = {c + COPY_SUFFIX for c in copied}
    return {n.id for n in graph.nodes if n.name in names}


def _names(graph: Graph, region: Region) -> set[str]:
    return {graph.nodes[i].name for i in region.nodes}
