"""Pairs of ops that undo each other removed: a concatenation of a split's parts, a split of a
concatenation, a permutation of a permutation.

``cat(x.split(...))`` in order along the split's dimension is ``x``: the copy it makes (``x``'s
bytes, a pass over them) goes, and its readers read ``x``. ``cat([a, b]).split(...)`` at the
pieces' sizes gives back ``a`` and ``b``: the readers of the parts read the pieces, and the
concatenation goes where nothing else reads it. ``permute(permute(x, p), q)`` with ``q`` undoing
``p`` (``t(t(w))``, ``transpose`` twice) is ``x``: views cost no bytes, but each is a node to run.
A piece laid out otherwise than the part it replaces is only taken where every view read from
it can be made and every other reader lays its outputs out alike (``relayout``). Nothing is
computed differently: the values are bitwise the same.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.transform.inverse_pairs import find_inverse_pairs, remove_inverse_pairs
    >>> class Halves(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__(); self.w = torch.nn.Parameter(torch.randn(4, 8))
    ...     def forward(self, x):
    ...         a, b = (x @ self.w).split(4, dim=1)
    ...         return torch.cat([a, b], dim=1).tanh().sum()
    >>> g = fitgraph.capture(Halves(), torch.randn(3, 4))
    >>> [m.kind for m in find_inverse_pairs(g) if m.kind != "permutations"]
    ['cat of a split']
    >>> "aten.cat.default" in {n.target for n in remove_inverse_pairs(g).nodes if n.phase.value == "forward"}
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..graph.analysis import users
from ..graph.ir import Graph, ValueRef
from .fission_meta import Meta, _norm
from .fission_writer import GraphWriter
from .relayout import relaid_views_ok, rewrite_nodes

__all__ = ["InversePair", "find_inverse_pairs", "remove_inverse_pairs"]

_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default")
_PERMUTES = ("aten.permute.default", "aten.transpose.int", "aten.t.default")


@dataclass(frozen=True)
class InversePair:
    """One pair to remove: its ``kind``, the nodes that go (where nothing else reads them), the
    values read in place of others (old value -> the value it equals), the bytes no longer
    made."""

    kind: str
    nodes: tuple[int, ...]
    replaced: tuple[tuple[int, int], ...]
    bytes_saved: int
    flops_saved: float = 0.0


def _dim(node) -> int:
    """The dimension a split or a concatenation works along (as written)."""
    at = 2 if node.target in _SPLITS else 1
    return node.args[at] if len(node.args) > at else 0


def _axes(node, rank: int) -> list[int]:
    """The permutation a permuting view applies."""
    if node.target == "aten.permute.default":
        return [_norm(d, rank) for d in node.args[1]]
    order = list(range(rank))
    if node.target == "aten.t.default":
        return order[::-1]
    a, b = _norm(node.args[1], rank), _norm(node.args[2], rank)
    order[a], order[b] = order[b], order[a]
    return order


def find_inverse_pairs(graph: Graph) -> list[InversePair]:
    """Every pair of ops undoing each other that can be removed (module doc)."""
    ctx = _Context(graph)
    found = []
    for n in graph.nodes:
        if n.target == "aten.cat.default" and not n.kwargs:
            pair = _cat_of_split(ctx, n)
        elif n.target in _SPLITS and isinstance(n.args[0], ValueRef):
            pair = _split_of_cat(ctx, n)
        elif n.target in _PERMUTES and isinstance(n.args[0], ValueRef):
            pair = _permutations(ctx, n)
        else:
            continue
        if pair is not None:
            found.append(pair)
    return _disjoint(found)


class _Context:
    """What every pattern asks of the graph: its readers, written storages, outputs."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.readers = users(graph)
        self.written = {graph.values[v].storage for n in graph.nodes for v in n.mutates}
        self.outputs = set(graph.outputs.values())

    def producer(self, vid: int):
        p = self.graph.values[vid].producer
        return None if p is None else self.graph.nodes[p]

    def takes(self, old: int, new: int) -> bool:
        """Whether ``old``'s readers can read ``new`` in its place."""
        g = self.graph
        if old in self.outputs or {g.values[old].storage, g.values[new].storage} & self.written:
            return False
        v = g.values[new]
        return relaid_views_ok(g, old, Meta(v.shape, v.stride, v.storage_offset), self.readers)


def _cat_of_split(ctx: _Context, n) -> InversePair | None:
    """``cat(x.split(...))`` in order, along the split's dim: ``x``."""
    g = ctx.graph
    parts = [a.id for a in n.args[0]]
    split = ctx.producer(parts[0])
    if split is None or split.target not in _SPLITS or list(split.outputs) != parts:
        return None
    rank = len(g.values[parts[0]].shape)
    if _norm(_dim(n), rank) != _norm(_dim(split), rank) or not ctx.takes(n.outputs[0],
                                                                           split.inputs[0]):
        return None
    return InversePair("cat of a split", (n.id,), ((n.outputs[0], split.inputs[0]),),
                       g.values[n.outputs[0]].nbytes)


def _split_of_cat(ctx: _Context, n) -> InversePair | None:
    """``cat(pieces).split(...)`` at the pieces' sizes, along the cat's dim: the pieces."""
    g = ctx.graph
    cat = ctx.producer(n.args[0].id)
    if cat is None or cat.target != "aten.cat.default" or cat.kwargs:
        return None
    pieces = [a.id for a in cat.args[0]]
    rank = len(g.values[pieces[0]].shape)
    if _norm(_dim(n), rank) != _norm(_dim(cat), rank) or len(pieces) != len(n.outputs):
        return None
    if any(g.values[p].shape != g.values[o].shape for p, o in zip(pieces, n.outputs)):
        return None
    if not all(ctx.takes(o, p) for o, p in zip(n.outputs, pieces)):
        return None
    alone = ctx.readers.get(cat.outputs[0], []) == [n.id]
    return InversePair("split of a cat", (n.id, cat.id) if alone else (n.id,),
                       tuple(zip(n.outputs, pieces)),
                       g.values[cat.outputs[0]].nbytes if alone else 0)


def _permutations(ctx: _Context, n) -> InversePair | None:
    """A permutation of a permutation it undoes: the first one's input."""
    g = ctx.graph
    first = ctx.producer(n.args[0].id)
    if first is None or first.target not in _PERMUTES:
        return None
    rank = len(g.values[first.inputs[0]].shape)
    p, q = _axes(first, rank), _axes(n, rank)
    if [p[i] for i in q] != list(range(rank)):
        return None
    if n.outputs[0] in ctx.outputs or g.values[n.outputs[0]].storage in ctx.written:
        return None
    alone = ctx.readers.get(first.outputs[0], []) == [n.id]
    return InversePair("permutations", (n.id, first.id) if alone else (n.id,),
                       ((n.outputs[0], first.inputs[0]),), 0)


def _disjoint(found: list[InversePair]) -> list[InversePair]:
    """Pairs sharing no node or value (a chain of three permutations: the first pair only)."""
    nodes: set[int] = set()
    values: set[int] = set()
    out = []
    for m in found:
        vals = {v for pair in m.replaced for v in pair}
        if nodes & set(m.nodes) or values & vals:
            continue
        nodes |= set(m.nodes)
        values |= vals
        out.append(m)
    return out


def remove_inverse_pairs(graph: Graph, matches: list[InversePair] | None = None) -> Graph:
    """A copy of ``graph`` without the pairs of ``find_inverse_pairs`` (or those of
    ``matches``, some of them; module doc); ``graph`` itself where there is none."""
    found = find_inverse_pairs(graph) if matches is None else matches
    if not found:
        return graph
    replaced = {old: new for m in found for old, new in m.replaced}

    def read_instead(w: GraphWriter, node) -> None:
        for o in node.outputs:
            if o in replaced:
                w.whole[o] = w.whole[replaced[o]]

    # NOTE: every node a pair removes goes; its outputs the pair replaces are read as what
    # they equal (made earlier: a split's input, a cat's pieces, a permutation's input)
    return rewrite_nodes(graph, {nid: partial(read_instead, node=graph.nodes[nid])
                                 for m in found for nid in m.nodes}, set())
