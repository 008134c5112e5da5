"""Partial sums accumulated straight into the running sum they are added to.

A fission region that runs a weight gradient in parts accumulates the parts' products in a
whole-size accumulator (``acc = mm(a0, b0); acc.addmm_(a1, b1); ...``, see
``fission_combine``), which the graph then adds to the gradient so far: ``s = add(p, acc)``.
A weight used several times (ALBERT's one layer applied at every depth, a tied embedding) has
such a running sum ``p`` per use, and the accumulator lives beside it through the whole
region: three of ALBERT's were 0.75 MiB at its smallest peak. Eager autograd adds in place
into the gradient so far instead (its input buffers).

Here, where ``p`` is read by that ``add`` alone, the chain writes into ``p`` itself:
``p.addmm_(a0, b0); p.addmm_(a1, b1); ...`` (a chain made by another op: that op's result is
added into ``p`` in place first), and the ``add`` is gone. The accumulator's storage no longer
exists. So too where ``p`` takes the chain in place, ``p.add_(acc)`` (fission sums a region's
partial sums so, part by part) and nothing touches ``p`` from the chain's start to that add:
every part's products then go into ``p``. A running sum that an earlier chain was written
into takes a later chain after it.

Values: ``p + a0 b0 + a1 b1 ...`` in that order, where the graph summed the products first:
allclose, not bitwise, which is why only fission's (allclose) graphs get it. Only backward
sums are folded: ``p``'s producer cannot be recomputed once ``p`` is written in place
(``graph.recompute_rules.recomputable``), and backward nodes are not.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Phase, Role
    >>> from fitgraph.transform.sums_in_place import sums_in_place
    >>> b = GraphBuilder()
    >>> x, y, p0 = (b.add_input(n, (4, 4), "float32", Role.INPUT) for n in ("x", "y", "p0"))
    >>> bw = dict(phase=Phase.BACKWARD)
    >>> p = b.add_node("aten.mul.Tensor", [p0, p0], [((4, 4), "float32")], name="p", **bw)[0]
    >>> acc = b.add_node("aten.mm.default", [x, y], [((4, 4), "float32")], name="acc", **bw)[0]
    >>> acc1 = b.add_node("aten.addmm_.default", [acc, y, x], [((4, 4), "float32")],
    ...                   mutates=(acc,), alias_of={0: acc}, name="acc1", **bw)[0]
    >>> s = b.add_node("aten.add.Tensor", [p, acc1], [((4, 4), "float32")], name="s", **bw)[0]
    >>> g = sums_in_place(b.finish({"loss": s}))
    >>> [(n.name, n.target) for n in g.nodes]
    [('p', 'aten.mul.Tensor'), ('acc', 'aten.addmm_.default'), ('acc1', 'aten.addmm_.default')]
    >>> len({g.values[v].storage for n in g.nodes for v in n.outputs})
    1
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..graph.analysis import new_storages, storage_accesses, verify_graph
from ..graph.ir import Graph, Node, Phase, ValueRef
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["sums_in_place"]

_ADD = "aten.add.Tensor"
# NOTE: a product that starts a chain becomes its accumulating form, into the running sum
_FUSED = {"aten.mm.default": "aten.addmm_.default", "aten.bmm.default": "aten.baddbmm_.default"}
# NOTE: in-place writers that add into what they write (alpha / beta left at 1)
_ADDS_INTO = frozenset({"aten.addmm_.default", "aten.baddbmm_.default", "aten.add_.Tensor"})


@dataclass(frozen=True)
class _Fold:
    """One ``s = add(p, acc)`` to fold: the add, the value that made the running sum's storage,
    the chain's creator, and the accumulator as the add reads it (what ``s`` becomes)."""

    add: int
    base: int
    creator: int
    last: int


def sums_in_place(graph: Graph, verify: bool = True) -> Graph:
    """A copy of ``graph`` where each backward accumulation chain added to a running sum read
    by that add alone accumulates into the running sum (module doc); ``graph`` itself where
    there is none."""
    folds = _folds(graph)
    if not folds:
        return graph
    by_creator = {f.creator: f for f in folds}
    by_add = {f.add: f for f in folds}
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.id in by_creator:
            _write_creator(w, graph, n, by_creator[n.id])
        elif n.id in by_add:
            f = by_add[n.id]
            s = graph.values[n.outputs[0]]
            w.whole[s.id] = w.whole[f.last]
            w.storage_map[s.storage] = w.values[w.whole[f.last]].storage
        else:
            w.copy_node(n)
    out = w.finish(dict(graph.meta))
    if verify:
        verify_graph(out)
    return out


def _write_creator(w: GraphWriter, graph: Graph, n: Node, f: _Fold) -> None:
    """The chain's first node, writing into the running sum (``write_into``)."""
    base = w.whole[f.base]
    s_role = graph.storages[graph.values[graph.nodes[f.add].outputs[0]].storage].role
    st = w.values[base].storage
    if w.storages[st].role != s_role:
        # NOTE: the running sum becomes the step's gradient where the add made an output
        w.storages[st] = dataclasses.replace(w.storages[st], role=s_role)
    write_into(w, graph, n, base)


def write_into(w: GraphWriter, graph: Graph, n: Node, base: int) -> None:
    """Node ``n`` written into new value ``base``'s storage, in ``n``'s output layout
    (``as_strided`` where ``base`` is laid out otherwise: the add read both alike): fused
    where it is a product (``addmm_`` / ``baddbmm_``), else made as before and added in
    place."""
    out = graph.values[n.outputs[0]]
    st = w.values[base].storage
    meta = Meta(out.shape, out.stride, out.storage_offset)
    kw = dict(phase=n.phase, module=n.module, device=w.storages[st].device)
    spec = OutSpec(out.name, meta, out.dtype, storage=st, role=out.role)
    if w.meta(base) != meta:
        base = w.add_node(f"{n.name}.into", "aten.as_strided.default",
                          (ValueRef(base), list(out.shape), list(out.stride), out.storage_offset),
                          {}, [spec], **kw)[0]
    if n.target in _FUSED:
        args, _ = w.remapped(n.args, n.kwargs)
        new = w.add_node(n.name, _FUSED[n.target], (ValueRef(base), *args), {}, [spec],
                         mutates=(base,), flops=n.flops, **kw)[0]
    else:
        w.copy_node(n)
        made = w.whole[out.id]
        new = w.add_node(f"{n.name}.added", "aten.add_.Tensor", (ValueRef(base), ValueRef(made)),
                         {}, [spec], mutates=(base,), **kw)[0]
    w.whole[out.id] = new
    w.storage_map[out.storage] = st


def _folds(graph: Graph) -> list[_Fold]:
    values = graph.values
    accesses = storage_accesses(graph)
    fresh = new_storages(graph)
    outs = {values[v].storage for v in graph.outputs.values()}
    inputs = {values[v].storage for v in graph.inputs}
    chains: set[int] = set()
    sums: set[int] = set()
    folds: list[_Fold] = []
    for n in graph.nodes:
        if n.phase is not Phase.BACKWARD:
            continue
        if _plain_add(graph, n):
            orders = ((n.inputs[1], n.inputs[0]), (n.inputs[0], n.inputs[1]))
        elif _accumulating_add(graph, n):
            orders = ((n.args[1].id, n.args[0].id),)
        else:
            continue
        nbytes = graph.storages[values[n.outputs[0]].storage].nbytes
        for acc, read in orders:
            chain = _chain(graph, acc, n.id, accesses, fresh)
            if chain is None:
                continue
            if n.mutates:
                base = _accumulator(graph, read, n, chain[0], accesses, fresh)
            else:
                base = _running_sum(graph, read, n, chain[0], accesses, fresh)
            st_acc, st_sum = values[acc].storage, values[read].storage
            # NOTE: an accumulator takes one chain per part (fission's ``acc.add_(part)``)
            if (base is None or st_acc in outs | inputs | chains | sums
                    or st_sum in outs | inputs | chains | (set() if n.mutates else sums)
                    or st_acc == st_sum or any(graph.storages[st].nbytes != nbytes
                                               for st in (st_acc, st_sum))):
                continue
            chains.add(st_acc)
            sums.add(st_sum)
            folds.append(_Fold(n.id, base, chain[0], acc))
            break
    return folds


def _accumulating_add(graph: Graph, n: Node) -> bool:
    """``acc.add_(x)`` of a distinct tensor of ``acc``'s layout and dtype, alpha 1 (fission
    sums a region's partial sums so, part by part)."""
    if (n.target != "aten.add_.Tensor" or n.kwargs or len(n.args) != 2 or len(n.inputs) != 2
            or not all(isinstance(a, ValueRef) for a in n.args)
            or n.mutates != (n.args[0].id,) or n.outputs[0] is None):
        return False
    acc, x = (graph.values[a.id] for a in n.args)
    return (acc.shape == x.shape and acc.stride == x.stride and acc.dtype == x.dtype
            and acc.storage_offset == 0 == x.storage_offset and acc.storage != x.storage)


def _plain_add(graph: Graph, n: Node) -> bool:
    """``add(x, y)`` of two distinct tensors of the output's layout and dtype, alpha 1."""
    if n.target != _ADD or n.mutates or n.kwargs or len(n.args) != 2 or len(n.inputs) != 2:
        return False
    if not all(isinstance(a, ValueRef) for a in n.args) or n.outputs[0] is None:
        return False
    out = graph.values[n.outputs[0]]
    return all(graph.values[v].shape == out.shape and graph.values[v].stride == out.stride
               and graph.values[v].dtype == out.dtype and graph.values[v].storage_offset == 0
               for v in n.inputs) and out.storage_offset == 0


def _is_view(graph: Graph, nid: int, fresh: dict) -> bool:
    """A plain view: no allocation, no write, one input, outputs in the storage it reads
    (``t``/``view`` of a weight gradient before it is summed)."""
    n = graph.nodes[nid]
    if fresh[nid] or n.mutates or n.random or len(n.inputs) != 1:
        return False
    st = graph.values[n.inputs[0]].storage
    return all(o is None or graph.values[o].storage == st for o in n.outputs)


def _chain(graph: Graph, read: int, add: int, accesses: dict, fresh: dict) -> list[int] | None:
    """The nodes that make the accumulator ``add`` reads as ``read`` (a creator, then at
    least one in-place adder each writing the one before's value, and views of it anywhere
    after the creator: fission views a product's first part as it leaves, ``_direct_sums``),
    where its storage is touched by them and ``add`` alone."""
    st = graph.values[read].storage
    nodes = accesses[st]
    if len(nodes) < 3 or nodes[-1] != add:
        return None
    creator, *rest = nodes[:-1]
    c = graph.nodes[creator]
    if st not in fresh[creator] or c.mutates or c.random or len(c.outputs) != 1 \
            or c.phase is not Phase.BACKWARD:
        return None
    writers = []
    for nid in rest:
        wn = graph.nodes[nid]
        if _is_view(graph, nid, fresh):
            continue
        # NOTE: a writer may write through a view of the chain (``as_strided``: a product's
        # layout, ``products_into_sums``)
        into = wn.mutates[0] if len(wn.mutates) == 1 else None
        if (wn.target not in _ADDS_INTO or wn.kwargs or into is None
                or graph.values[into].storage != st or not wn.args
                or wn.args[0] != ValueRef(into) or len(wn.outputs) != 1):
            return None
        if any(isinstance(a, ValueRef) and a.id != into and graph.values[a.id].storage == st
               for a in wn.args[1:]):
            return None
        writers.append(nid)
    return [creator, *writers] if writers else None


def _running_sum(graph: Graph, read: int, add: Node, creator: int, accesses: dict,
                 fresh: dict) -> int | None:
    """The value that holds the running sum ``add`` reads as ``read`` before ``creator``: its
    storage is made by one node, then touched by views, by in-place adders (an earlier use's
    chain folded into it) that run before ``creator``, and ``add`` alone; the last adder's
    value, else the one its producer makes there.

    NOTE: ``split_backward`` splits one block at a time, and each split is folded as it is
    made: ALBERT's block 1 chain had been written into the running sum when block 0's was
    split, and block 0's accumulators were then held whole beside it (0.5 MiB at its least
    peak)."""
    return held_until(graph, read, add.id, creator, accesses, fresh)


def held_until(graph: Graph, vid: int, last_reader: int, before: int, accesses: dict,
               fresh: dict) -> int | None:
    """The value holding ``vid``'s storage just before node ``before``, where that storage
    is made by one node before it, then touched by views, by in-place adders (``_ADDS_INTO``,
    perhaps through a view: a chain's layout) before it, and last by ``last_reader``: the last
    adder's value, else the one its producer makes there; None otherwise."""
    st = graph.values[vid].storage
    nodes = accesses.get(st, [])
    if len(nodes) < 2 or nodes[-1] != last_reader or nodes[0] >= before:
        return None
    p = graph.nodes[nodes[0]]
    made = [o for o in p.outputs if o is not None and graph.values[o].storage == st]
    if st not in fresh[p.id] or p.mutates or len(made) != 1:
        return None
    last = made[0]
    for nid in nodes[1:-1]:
        if _is_view(graph, nid, fresh):
            continue
        wn = graph.nodes[nid]
        if (nid >= before or wn.target not in _ADDS_INTO or len(wn.mutates) != 1
                or graph.values[wn.mutates[0]].storage != st or len(wn.outputs) != 1
                or graph.values[wn.outputs[0]].storage != st):
            return None
        last = wn.outputs[0]
    return last


def _accumulator(graph: Graph, acc: int, add: Node, creator: int, accesses: dict,
                 fresh: dict) -> int | None:
    """``acc`` where ``add`` adds a chain into it in place (``acc.add_(chain)``) and nothing
    touches ``acc``'s storage from the chain's ``creator`` to ``add`` but views: the chain
    can then write into ``acc`` from its start."""
    st = graph.values[acc].storage
    maker = graph.values[acc].producer
    if maker is None or maker >= creator:
        return None
    between = [nid for nid in accesses.get(st, []) if creator < nid < add.id]
    if not all(_is_view(graph, nid, fresh) for nid in between):
        return None
    return acc
