"""A product added to a tensor that dies at the add accumulates into that tensor in place.

A region that runs a layer's input gradient in head parts makes, in every part, one whole-size
product per projection (``dq_h @ Wq_h``, ``dk_h @ Wk_h``, ``dv_h @ Wv_h``, each ``[tokens,
hidden]``) and sums them with out-of-place adds: ``s = add(add(p_q, p_k), p_v)`` holds three
whole tensors at once where one would do (ALBERT's attention in head parts: 1 MiB against
0.25 at its peak). Eager PyTorch sums them alike (autograd's input buffers).

Here ``s = add(x, y)``, where ``y`` is a product ``mm(a, b)`` (or ``bmm``) read by that add
alone (through views) and ``x`` dies at the add, becomes ``x.addmm_(a, b)`` (``baddbmm_``) in
``x``'s storage, laid out as the product (``as_strided`` where ``x`` is laid out otherwise),
and ``s`` a view of it: the product's storage is never made. A chain of such adds becomes a
chain of in-place products into the first tensor, which ``sums_in_place`` can then fold into
a running sum.

Values: ``x + a b`` fused, where the graph rounded ``a b`` first: allclose, not bitwise, so
only fission's (allclose) graphs get it. Only backward adds are folded: ``x``'s producer
cannot be recomputed once ``x`` is written in place (``graph.recompute_rules.recomputable``).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Phase, Role
    >>> from fitgraph.transform.products_into_sums import products_into_sums
    >>> b = GraphBuilder()
    >>> a, c = (b.add_input(n, (4, 4), "float32", Role.INPUT) for n in ("a", "c"))
    >>> bw = dict(phase=Phase.BACKWARD)
    >>> x = b.add_node("aten.mm.default", [a, a], [((4, 4), "float32")], name="x", **bw)[0]
    >>> y = b.add_node("aten.mm.default", [c, c], [((4, 4), "float32")], name="y", **bw)[0]
    >>> s = b.add_node("aten.add.Tensor", [x, y], [((4, 4), "float32")], name="s", **bw)[0]
    >>> g = products_into_sums(b.finish({"loss": s}))
    >>> [n.target for n in g.nodes]
    ['aten.mm.default', 'aten.addmm_.default']
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph.analysis import new_storages, storage_accesses, verify_graph
from ..graph.ir import Graph, Phase, ValueRef
from .fission_writer import GraphWriter
from .sums_in_place import _FUSED, _is_view, _plain_add, held_until, write_into

__all__ = ["products_into_sums"]


@dataclass(frozen=True)
class _Fold:
    """One ``s = add(x, y)`` to fold: the add, the product node making ``y`` (through views),
    ``y`` as the add reads it, and the value holding ``x``'s storage when the product runs."""

    add: int
    product: int
    y: int
    into: int


def products_into_sums(graph: Graph, verify: bool = True) -> Graph:
    """A copy of ``graph`` where each backward ``add`` of a product read by it alone to a
    tensor that dies there accumulates the product into that tensor (module doc); ``graph``
    itself where there is none."""
    folds = _folds(graph)
    if not folds:
        return graph
    by_product = {f.product: f for f in folds}
    by_add = {f.add: f for f in folds}
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.id in by_product:
            write_into(w, graph, n, w.whole[by_product[n.id].into])
        elif n.id in by_add:
            f = by_add[n.id]
            s = graph.values[n.outputs[0]]
            w.whole[s.id] = w.whole[f.y]
            w.storage_map[s.storage] = w.values[w.whole[f.y]].storage
        else:
            w.copy_node(n)
    out = w.finish(dict(graph.meta))
    if verify:
        verify_graph(out)
    return out


def _folds(graph: Graph) -> list[_Fold]:
    values = graph.values
    accesses = storage_accesses(graph)
    fresh = new_storages(graph)
    kept = {values[v].storage for v in graph.outputs.values()} | {
        values[v].storage for v in graph.inputs}
    folds: list[_Fold] = []
    for n in graph.nodes:
        if n.phase is not Phase.BACKWARD or not _plain_add(graph, n):
            continue
        for y, x in ((n.inputs[1], n.inputs[0]), (n.inputs[0], n.inputs[1])):
            product = _product(graph, y, n.id, accesses, fresh)
            into = None if product is None else _dying(graph, x, n.id, product, accesses,
                                                       fresh)
            sts = {values[x].storage, values[y].storage}
            if into is None or sts & kept or len({graph.storages[st].nbytes
                                                  for st in sts}) != 1:
                continue
            folds.append(_Fold(n.id, product, y, into))
            break
    return folds


def _product(graph: Graph, y: int, add: int, accesses: dict, fresh: dict) -> int | None:
    """The backward product node making ``y`` (through views), where its storage is touched
    by it, views and ``add`` alone."""
    st = graph.values[y].storage
    nodes = accesses.get(st, [])
    if len(nodes) < 2 or nodes[-1] != add:
        return None
    p = graph.nodes[nodes[0]]
    if (p.target not in _FUSED or p.kwargs or p.mutates or len(p.outputs) != 1
            or p.phase is not Phase.BACKWARD or st not in fresh[p.id]
            or not all(isinstance(a, ValueRef) for a in p.args)):
        return None
    if not all(_is_view(graph, nid, fresh) for nid in nodes[1:-1]):
        return None
    return p.id


def _dying(graph: Graph, x: int, add: int, product: int, accesses: dict,
           fresh: dict) -> int | None:
    """The value holding ``x``'s storage when ``product`` runs, where that storage is made by
    one backward node before it, then touched by views, by in-place adders (an earlier fold's
    chain) before it, and last by ``add``."""
    first = accesses.get(graph.values[x].storage, [None])[0]
    if first is None or graph.nodes[first].phase is not Phase.BACKWARD:
        return None
    return held_until(graph, x, add, product, accesses, fresh)
