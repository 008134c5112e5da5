"""Views saved for the backward copied out of the larger tensor they view.

A fused projection read in pieces keeps the whole projection for one piece: in
``nn.MultiheadAttention`` (and GPT-2-style fused QKV) the values ``v`` are a view of the packed
``q, k, v`` projection, and the backward of ``attn @ v`` reads ``v``, so the whole packed tensor
(three times ``v``) lives from the forward to that block's backward — 0.5 MiB more than ``v`` per
block on the sweep's nn.TransformerEncoder, at its peak.

``copy_saved_views`` copies each such view right after the forward makes it (``aten.clone``,
with the view's own strides) and lets every later reader read the copy: the larger tensor dies
in the forward. A tensor qualifies where the backward reads it only through views (made in the
forward) that together hold at most half its bytes, none of it is written in place, and each
view is dense (a clone keeps its strides, so every reader sees the same layout and the step's
results stay bitwise eager's).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.saved_views import copy_saved_views
    >>> m = torch.nn.Linear(8, 3 * 8)
    >>> def loss_fn(m, x):   # NOTE: packed as nn.MultiheadAttention packs it
    ...     q, k, v = m(x).unflatten(-1, (3, 8)).movedim(-2, 0).contiguous()
    ...     return ((q + k).softmax(-1) * v).sum()
    >>> g = fitgraph.capture(m, torch.randn(4, 8), loss_fn)
    >>> g2 = copy_saved_views(g)
    >>> [n.target for n in g2.nodes if n.name.endswith(".saved")]
    ['aten.clone.default']
    >>> x = torch.randn(4, 8)
    >>> bool(torch.equal(execute(g2, fitgraph.eager_plan(g2), m, x), loss_fn(m, x)))
    True
"""

from __future__ import annotations

import dataclasses

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Phase, Value, ValueRef
from .fission_meta import Meta, is_dense
from .fission_writer import GraphWriter, OutSpec

__all__ = ["copy_saved_views"]

# NOTE: the views' bytes over the tensor's at most: a copy of more would hold nearly as much
MAX_SHARE = 0.5
SUFFIX = ".saved"


def copy_saved_views(graph: Graph) -> Graph:
    """A copy of ``graph`` where each view saved for the backward out of a tensor at least twice
    its size is cloned in the forward (see the module doc); ``graph`` itself where none is."""
    chosen = _saved_views(graph)
    if not chosen:
        return graph
    w = GraphWriter(graph)
    base: dict[int, int] = {}   # NOTE: a clone's storage -> the offset its view had
    clones: set[int] = set()
    for n in graph.nodes:
        w.copy_node(n)
        for o in n.outputs:
            if o in chosen:
                clone = _write_clone(w, graph, graph.values[o])
                clones.add(clone)
                base[w.values[clone].storage] = graph.values[o].storage_offset
    # NOTE: views of a clone were copied with their offsets in the tensor it was cut from; the
    # clone starts at 0 (the transpose of nn.MultiheadAttention's values sat 2/3 in)
    for i, v in enumerate(w.values):
        shift = base.get(v.storage, 0)
        if shift and i not in clones:
            w.values[i] = dataclasses.replace(v, storage_offset=v.storage_offset - shift)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _saved_views(graph: Graph) -> set[int]:
    """The forward values to clone: per qualifying storage, its views the backward reads."""
    forward = {n.id for n in graph.nodes if n.phase in (Phase.FORWARD, Phase.LOSS)}
    written = {graph.values[v].storage for n in graph.nodes for v in n.mutates}
    # NOTE: as_strided names its offset in the storage: a clone would move it
    strided = {graph.values[v].storage for n in graph.nodes if n.target.startswith("aten.as_strided")
               for v in n.inputs}
    made_by = {}   # NOTE: storage -> the forward node that allocates it
    for n in graph.nodes:
        if n.id in forward:
            for o in n.outputs:
                if o is not None:
                    made_by.setdefault(graph.values[o].storage, n.id)
    later: dict[int, set[int]] = {}   # storage -> its forward values read after the forward
    for n in graph.nodes:
        if n.id in forward:
            continue
        for v in n.inputs:
            val = graph.values[v]
            if val.producer in forward:
                later.setdefault(val.storage, set()).add(v)
    outputs = set(graph.outputs.values())
    chosen: set[int] = set()
    for st, views in later.items():
        maker = made_by.get(st)
        if maker is None or st in written or st in strided:
            continue
        # NOTE: only views: the tensor the storage's maker returns is read whole otherwise
        if any(graph.values[v].producer == maker for v in views):
            continue
        if any(v in outputs or not is_dense(graph.values[v].shape, graph.values[v].stride) for v in views):
            continue
        if sum(graph.values[v].nbytes for v in views) > MAX_SHARE * graph.storages[st].nbytes:
            continue
        chosen |= views
    return chosen


def _write_clone(w: GraphWriter, graph: Graph, v: Value) -> int:
    """``aten.clone(v)`` right after ``v`` is made, read from then on in its place; its id."""
    src = w.whole[v.id]
    spec = OutSpec(v.name + SUFFIX, Meta(v.shape, v.stride, 0), v.dtype, role=v.role)
    maker = graph.nodes[v.producer]
    w.whole[v.id] = w.add_node(v.name + SUFFIX, "aten.clone.default", (ValueRef(src),), {}, [spec],
                               phase=maker.phase, module=maker.module,
                               device=w.device_of(src))[0]
    return w.whole[v.id]

