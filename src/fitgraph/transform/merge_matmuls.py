"""Projections of one input merged into one batched matmul (TASO's merge of shared-input GEMMs).

BERT and Llama make ``q``, ``k`` and ``v`` (Llama's MLP: ``gate`` and ``up``) as separate
matmuls of the same input: ``x @ Wq^T``, ``x @ Wk^T``, ``x @ Wv^T``. Here they become one
``bmm`` of the input (expanded: a view, nothing copied) with the weights stacked
(``[k, in, out]``; with biases, ``baddbmm`` on the stacked biases), and each projection is a
``select`` of its result — the same shape and strides as before, so every reader reads it as it
did (its views laid out again at the new offset: ``relayout``). One launch instead of ``k``;
in training the stacked weights are made every step (``k * in * out`` elements, a temporary)
and the parts share one storage, which lives until the last of them dies: the search keeps the
rewrite only where the simulated plan is better.

Matched: ``mm(x, w_i)`` / ``addmm(b_i, x, w_i)`` in the forward reading the same ``x`` (the same
value, or views of one value laid out alike), their weights all ``[in, out]`` of one dtype
made from the step's inputs by views alone (so that they can be stacked where the first
matmul runs), biases all 1-D or all absent, no result a graph output or written in place.
Values: the same dot products in one batched kernel: allclose.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.transform.merge_matmuls import find_shared_matmuls, merge_shared_matmuls
    >>> class QKV(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))
    ...     def forward(self, x):
    ...         return ((self.q(x) @ self.k(x).T).softmax(-1) @ self.v(x)).sum()
    >>> g = fitgraph.capture(QKV(), torch.randn(16, 8))
    >>> [len(m.matmuls) for m in find_shared_matmuls(g)]
    [3]
    >>> g2 = merge_shared_matmuls(g)
    >>> [n.target for n in g2.nodes if "mm" in n.target and n.phase.value == "forward"]
    ['aten.baddbmm.default', 'aten.mm.default', 'aten.mm.default']
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..graph.analysis import users
from ..graph.ir import Graph, Node, Phase, Role, ValueRef, contiguous_strides
from .fission_meta import VIEW_TARGETS, Meta
from .fission_writer import GraphWriter, OutSpec
from .relayout import add_view, relaid_views_ok, rewrite_nodes

__all__ = ["SharedMatmuls", "find_shared_matmuls", "merge_shared_matmuls"]

_MATMULS = ("aten.mm.default", "aten.addmm.default")


@dataclass(frozen=True)
class SharedMatmuls:
    """Matmuls of one input to merge, in graph order, and what merging changes
    (``bytes_saved``: less the stacked weights made every step, a negative number)."""

    matmuls: tuple[int, ...]
    bytes_saved: int
    flops_saved: float = 0.0


def _root(graph: Graph, vid: int) -> int:
    """The value ``vid`` views (through view ops), or ``vid`` itself."""
    while True:
        p = graph.values[vid].producer
        if p is None or graph.nodes[p].target not in VIEW_TARGETS:
            return vid
        vid = graph.nodes[p].inputs[0]


def _from_inputs(graph: Graph, vid: int) -> bool:
    """Whether ``vid`` is a graph input or views of one (a weight, its transpose)."""
    return graph.values[_root(graph, vid)].producer is None


def find_shared_matmuls(graph: Graph) -> list[SharedMatmuls]:
    """Every group of forward matmuls of one input that can be merged (module doc)."""
    readers = users(graph)
    outputs = {graph.values[v].storage for v in graph.outputs.values()}
    written = {graph.values[v].storage for n in graph.nodes for v in n.mutates}
    groups: dict[tuple, list[int]] = {}
    for n in graph.nodes:
        if (n.target not in _MATMULS or n.phase != Phase.FORWARD or n.kwargs or n.mutates
                or not all(isinstance(a, ValueRef) for a in n.args)):
            continue
        *bias, x, wt = (a.id for a in n.args)
        xv, wv, out = graph.values[x], graph.values[wt], graph.values[n.outputs[0]]
        if not _from_inputs(graph, wt) or out.storage in outputs or out.storage in written:
            continue
        if bias and (len(graph.values[bias[0]].shape) != 1 or not _from_inputs(graph, bias[0])):
            continue
        key = (n.target, _root(graph, x), xv.shape, xv.stride, xv.storage_offset, wv.shape,
               wv.dtype)
        groups.setdefault(key, []).append(n.id)
    found = []
    for members in groups.values():
        if len(members) < 2:
            continue
        outs = [graph.values[graph.nodes[m].outputs[0]] for m in members]
        if not all(relaid_views_ok(graph, o.id, Meta(o.shape, o.stride, i * o.numel), readers,
                                   any_reader=True) for i, o in enumerate(outs)):
            continue
        wv = graph.values[graph.nodes[members[0]].args[-1].id]
        found.append(SharedMatmuls(tuple(members), -len(members) * wv.nbytes))
    return found


def merge_shared_matmuls(graph: Graph, matches: list[SharedMatmuls] | None = None) -> Graph:
    """A copy of ``graph`` with every group of ``find_shared_matmuls`` (or those of
    ``matches``, some of them) made by one batched matmul (module doc); ``graph`` itself where
    there is none."""
    groups = find_shared_matmuls(graph) if matches is None else matches
    if not groups:
        return graph
    # NOTE: the merged matmuls go, and the weight views copied ahead, where the merged matmul
    # runs (its writer adds them)
    skipped = {m for g in groups for m in g.matmuls}
    return rewrite_nodes(graph, {g.matmuls[0]: partial(_write_merged, graph=graph, group=g,
                                                       early=skipped) for g in groups}, skipped)


def _ahead(w: GraphWriter, graph: Graph, vid: int, early: set[int]) -> int:
    """``vid`` in the new graph, its producing views (of a graph input) copied now if they
    have not been yet."""
    if vid not in w.whole:
        p = graph.nodes[graph.values[vid].producer]
        for v in p.inputs:
            _ahead(w, graph, v, early)
        w.copy_node(p)
        early.add(p.id)
    return w.whole[vid]


def _node(w: GraphWriter, name: str, target: str, args: tuple, meta: Meta, dtype: str,
          like: Node, device: str, *, flops: float = 0.0) -> int:
    """One new node of one fresh output laid out as ``meta``, in ``like``'s phase and
    module."""
    role = Role.ACTIVATION if like.phase in (Phase.FORWARD, Phase.LOSS) else Role.TEMPORARY
    spec = OutSpec(name, meta, dtype, role=role)
    return w.add_node(name, target, args, {}, [spec], phase=like.phase, module=like.module,
                      device=device, flops=flops)[0]


def _write_merged(w: GraphWriter, *, graph: Graph, group: SharedMatmuls, early: set[int]) -> None:
    """The stacked weights (and biases), the expanded input, the batched matmul, one select per
    projection read in its place."""
    nodes = [graph.nodes[m] for m in group.matmuls]
    lead = nodes[0]
    k = len(nodes)
    x = w.whole[lead.args[-2].id]
    xv = w.values[x]
    dev = w.device_of(x)
    ws = [_ahead(w, graph, n.args[-1].id, early) for n in nodes]
    wv = w.values[ws[0]]
    cin, cout = wv.shape
    name = f"{lead.name}.merged"
    shape = (k, cin, cout)
    stacked = _node(w, f"{name}.w", "aten.stack.default", ([ValueRef(v) for v in ws], 0),
                    Meta(shape, contiguous_strides(shape), 0), wv.dtype, lead, dev)
    x1 = add_view(w, "aten.unsqueeze.default", x, (0,), f"{name}.x1", lead)
    n_rows = xv.shape[0]
    xe = add_view(w, "aten.expand.default", x1, ([k, n_rows, cin],), f"{name}.x", lead)
    out_shape = (k, n_rows, cout)
    out_meta = Meta(out_shape, contiguous_strides(out_shape), 0)
    flops = sum(n.flops for n in nodes)
    if lead.target == "aten.addmm.default":
        bs = [_ahead(w, graph, n.args[0].id, early) for n in nodes]
        bshape = (k, cout)
        bstack = _node(w, f"{name}.b", "aten.stack.default", ([ValueRef(v) for v in bs], 0),
                       Meta(bshape, contiguous_strides(bshape), 0), wv.dtype, lead, dev)
        b3 = add_view(w, "aten.unsqueeze.default", bstack, (1,), f"{name}.b3", lead)
        y = _node(w, name, "aten.baddbmm.default", (ValueRef(b3), ValueRef(xe),
                                                    ValueRef(stacked)),
                  out_meta, wv.dtype, lead, dev, flops=flops)
    else:
        y = _node(w, name, "aten.bmm.default", (ValueRef(xe), ValueRef(stacked)), out_meta,
                  wv.dtype, lead, dev, flops=flops)
    for i, n in enumerate(nodes):   # NOTE: each laid out as its matmul's, at another offset
        w.whole[n.outputs[0]] = add_view(w, "aten.select.int", y, (0, i), f"{n.name}.part", n)
