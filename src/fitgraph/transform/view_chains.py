"""Collapse reshape round trips: ``x.view(a).view(b)`` reads ``x`` directly, ``x.view(b)``.

``nn.Linear`` on a 3-D input is captured as ``view`` to 2-D, ``mm``, ``_unsafe_view`` back to
3-D; a token loss then flattens the logits to 2-D again (``logits.flatten(0, 1)``), and the
backward makes the same round trip in reverse. The 3-D tensor in between is a view only, but
to operator fission it is a wall: its dimension rules tie the flattened token axis (batch x
sequence) to the batch dimension alone, so a region along the tokens that passes through it is
cut in at most ``batch`` parts. Reading the base directly, the lm-head matmul, the log-softmax,
the loss and their gradients stay on the token axis end to end (the classic chunked
cross-entropy). Results are unchanged bit for bit: a view of a view of a contiguous tensor is
that tensor's view. Intermediate views nobody reads any more are dropped.

A cast between the two reshapes (``logits.float()`` on the 3-D logits of a bfloat16 model, and
its gradient cast back) is a wall too; a cast read only by a reshape is moved past it
(``x.view(a).float().view(b)`` becomes ``x.view(a).view(b).float()``: the same elements in the
same order), and the round trip collapses.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.view_chains import collapse_view_chains
    >>> model = torch.nn.Linear(8, 5)
    >>> batch = (torch.randn(2, 3, 8), torch.tensor([[0, 1, 2], [3, 4, 0]]))
    >>> def loss_fn(m, b):
    ...     return torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())
    >>> g = fitgraph.capture(model, batch, loss_fn)
    >>> g2 = collapse_view_chains(g)
    >>> len(g2.nodes) < len(g.nodes)
    True
    >>> bool(execute(g2, fitgraph.eager_plan(g2), model, batch) == loss_fn(model, batch))
    True
"""

from __future__ import annotations

from dataclasses import replace

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Node, ValueRef, contiguous_strides
from .elementwise_views import RESHAPE_VIEWS, elementwise_before_reshapes
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["RESHAPE_VIEWS", "collapse_view_chains"]


def collapse_view_chains(graph: Graph) -> Graph:
    """A copy of ``graph`` where each reshape view of a reshape view of a contiguous tensor
    reads that tensor directly, and views left unread are gone; ``graph`` itself if there is
    no such chain."""
    # NOTE: elementwise ops between the reshapes (a cast, Gemma-2's logit soft-capping) run on
    # the tensor the first reshape views, so that the round trip is one of views only
    graph = _casts_after_reshapes(elementwise_before_reshapes(graph))
    source = {n.id: _base(graph, n) for n in graph.nodes if n.target in RESHAPE_VIEWS}
    source = {nid: vid for nid, vid in source.items() if vid != graph.nodes[nid].inputs[0]}
    if not source:
        return graph
    outputs = set(graph.outputs.values())
    readers = _readers_after(graph, source, outputs)
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.target in RESHAPE_VIEWS and readers[n.outputs[0]] == 0 \
                and n.outputs[0] not in outputs:
            continue  # NOTE: a view nobody reads any more: it only kept its name alive
        w.copy_node(_reading(n, source[n.id]) if n.id in source else n)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


_CAST = "aten._to_copy.default"


def _casts_after_reshapes(graph: Graph) -> Graph:
    """A copy of ``graph`` where each cast of a reshape view read by one reshape view only is
    made after it; ``graph`` itself if there is none."""
    readers: dict[int, list[int]] = {v.id: [] for v in graph.values}
    for n in graph.nodes:
        for v in n.inputs:
            readers[v].append(n.id)
    outputs = set(graph.outputs.values())
    moved: dict[int, int] = {}                    # cast node -> the reshape it moves past
    for n in graph.nodes:
        if n.target != _CAST or set(n.kwargs) - {"dtype", "layout", "device"}:
            continue
        x, y = graph.values[n.inputs[0]], graph.values[n.outputs[0]]
        after = readers[y.id]
        if (len(after) != 1 or y.id in outputs or x.producer is None
                or graph.nodes[x.producer].target not in RESHAPE_VIEWS
                or graph.nodes[after[0]].target not in RESHAPE_VIEWS
                or not (_dense(x) and _dense(y)) or x.storage_offset):
            continue
        moved[n.id] = after[0]
    if not moved:
        return graph
    w = GraphWriter(graph)
    skip = set(moved.values())
    for n in graph.nodes:
        if n.id in skip:
            continue
        if n.id not in moved:
            w.copy_node(n)
            continue
        r = graph.nodes[moved[n.id]]
        out = graph.values[r.outputs[0]]
        x = w.whole[n.inputs[0]]
        kw = dict(phase=n.phase, module=n.module, device=w.device_of(x))
        flat = Meta(out.shape, contiguous_strides(out.shape), w.values[x].storage_offset)
        z = w.add_node(f"{n.name}.reshaped", r.target, (ValueRef(x), list(out.shape)), {},
                       [OutSpec(f"{n.name}.reshaped", flat, w.values[x].dtype,
                                storage=w.values[x].storage, role=w.values[x].role)], **kw)[0]
        old = graph.values[n.outputs[0]]
        cast = OutSpec(old.name, Meta(out.shape, contiguous_strides(out.shape), 0), old.dtype,
                       storage=w.mapped_storage(old.storage), role=old.role)
        w.whole[out.id] = w.add_node(n.name, n.target, (ValueRef(z),), dict(n.kwargs), [cast],
                                     flops=n.flops, **kw)[0]
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _base(graph: Graph, node: Node) -> int:
    """The first tensor up ``node``'s chain of reshape views it can read directly: contiguous,
    at the same offset, of the same dtype."""
    out = graph.values[node.outputs[0]]
    vid = node.inputs[0]
    while True:
        p = graph.values[vid].producer
        if p is None or graph.nodes[p].target not in RESHAPE_VIEWS:
            return vid
        up = graph.values[graph.nodes[p].inputs[0]]
        if not (_dense(up) and up.dtype == out.dtype and up.storage_offset == out.storage_offset):
            return vid
        vid = up.id


def _dense(v) -> bool:
    return v.stride == contiguous_strides(v.shape)


def _reading(node: Node, base: int) -> Node:
    """``node`` reading ``base`` in place of its input (a reshape view's first argument)."""
    args = (ValueRef(base),) + tuple(node.args[1:])
    return replace(node, args=args, inputs=(base,) + tuple(
        v for v in node.inputs[1:] if v != base))


def _readers_after(graph: Graph, source: dict[int, int], outputs: set[int]) -> dict[int, int]:
    """value id -> how many nodes read it once the views in ``source`` read their bases and
    unread views are dropped (graph ``outputs`` are never dropped)."""
    count = {v.id: 0 for v in graph.values}
    for n in graph.nodes:
        reads = (source[n.id],) + n.inputs[1:] if n.id in source else n.inputs
        for v in set(reads):
            count[v] += 1
    # NOTE: dropping a view can leave the view it read unread too (chains of three)
    for n in reversed(graph.nodes):
        if n.target in RESHAPE_VIEWS and count[n.outputs[0]] == 0 and n.outputs[0] not in outputs:
            src = source.get(n.id, n.inputs[0])
            count[src] -= 1
    return count
