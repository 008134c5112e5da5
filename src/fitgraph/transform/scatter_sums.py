"""Sums of gradients scattered into zeros, made by stacking or concatenating the pieces.

A fused projection read in pieces (``q, k, v = proj[0], proj[1], proj[2]`` in
``nn.MultiheadAttention``; ``qkv[..., :d]``, ``qkv[..., d:2*d]``, ... in fused-QKV models) has, in
its backward, one ``select_backward`` (or ``slice_backward``) per piece: each a zero tensor of the
whole projection's size with one piece's gradient written in, then summed. Three pieces hold
three whole-size buffers at once (2.25 MiB per block on the sweep's nn.MultiheadAttention, live
across the attention backward), where their sum is the pieces side by side: ``stack`` (or
``cat``) of the pieces' gradients, one whole-size buffer made where the sum was.

The rewrite takes a tree of ``add``s whose leaves are such scatters into the same shape along the
same dim, each read by that tree alone, whose pieces cover the dim once each, in any order.
Values are equal to the sum's (a piece plus zeros is the piece; only an exact zero's sign may
differ, ``-0.0 + 0.0`` being ``+0.0``): fission and ``split_backward`` run it (their results are
allclose, not bitwise), exact plans do not.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.scatter_sums import stack_scatter_sums
    >>> m = torch.nn.Linear(8, 3 * 8)
    >>> def loss_fn(m, x):
    ...     qkv = m(x).unflatten(-1, (3, 8)).movedim(-2, 0)
    ...     return (qkv[0] * qkv[1] + qkv[2].exp()).sum()
    >>> g = fitgraph.capture(m, torch.randn(4, 8), loss_fn)
    >>> g2 = stack_scatter_sums(g)
    >>> [n.target for n in g2.nodes if n.target.startswith("aten.stack")]
    ['aten.stack.default']
    >>> x = torch.randn(4, 8)
    >>> bool(torch.allclose(execute(g2, fitgraph.eager_plan(g2), m, x), loss_fn(m, x)))
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Node, ValueRef, contiguous_strides
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["stack_scatter_sums"]

_ADD = "aten.add.Tensor"
_SELECT = "aten.select_backward.default"
_SLICE = "aten.slice_backward.default"


@dataclass(frozen=True)
class _Piece:
    """One scatter: the gradient it writes, the whole shape, the dim, and where ([start, end)
    along the dim; a select's piece has no dim of its own)."""

    grad: int
    shape: tuple[int, ...]
    dim: int
    start: int
    end: int
    select: bool


def stack_scatter_sums(graph: Graph) -> Graph:
    """A copy of ``graph`` where each sum of scatters that covers its dim once is a ``stack``
    (pieces selected) or a ``cat`` (pieces sliced) of their gradients; ``graph`` itself where
    there is none."""
    readers: dict[int, list[int]] = {v.id: [] for v in graph.values}
    for n in graph.nodes:
        for v in set(n.inputs):
            readers[v].append(n.id)
    outputs = set(graph.outputs.values())
    sums: dict[int, list[_Piece]] = {}     # root add -> its pieces, in order along the dim
    gone: set[int] = set()                 # the scatters and inner adds the roots replace
    for n in graph.nodes:
        if n.target != _ADD or n.id in gone:
            continue
        found = _tree(graph, n, readers, outputs)
        if found is None:
            continue
        pieces, inner = found
        root_out = graph.values[n.outputs[0]]
        if root_out.stride != contiguous_strides(root_out.shape) or root_out.storage_offset:
            continue
        # NOTE: trees do not nest: an inner add that covered the dim would leave the outer
        # tree covering it twice
        sums[n.id] = pieces
        gone |= inner
    if not sums:
        return graph
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.id in gone:
            continue
        if n.id in sums:
            _write_stack(w, graph, n, sums[n.id])
        else:
            w.copy_node(n)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _tree(graph: Graph, root: Node, readers: dict, outputs: set[int]):
    """(the pieces in dim order, the scatters and inner adds) of the add tree under ``root``, or
    None where it is not a sum of scatters covering one dim once."""
    if root.kwargs or len(root.inputs) != 2 or len(root.args) != 2:
        return None
    leaves: list[_Piece] = []
    inner: set[int] = set()
    todo = list(root.inputs)
    while todo:
        v = todo.pop()
        p = graph.values[v].producer
        # NOTE: each piece and inner sum read by this tree alone (else it must exist anyway)
        if p is None or len(readers[v]) != 1 or v in outputs:
            return None
        node = graph.nodes[p]
        if node.target == _ADD and not node.kwargs and len(node.args) == 2 \
                and len(node.inputs) == 2:
            inner.add(p)
            todo.extend(node.inputs)
            continue
        piece = _piece(graph, node)
        if piece is None:
            return None
        inner.add(p)
        leaves.append(piece)
    first = leaves[0]
    if len(leaves) < 2 or any((p.shape, p.dim, p.select) != (first.shape, first.dim, first.select)
                              for p in leaves):
        return None
    leaves.sort(key=lambda p: p.start)
    pos = 0
    for p in leaves:
        if p.start != pos or p.end <= p.start:
            return None
        pos = p.end
    if pos != first.shape[first.dim]:
        return None
    out = graph.values[root.outputs[0]]
    if out.shape != first.shape or any(graph.values[p.grad].dtype != out.dtype for p in leaves):
        return None
    return leaves, inner


def _piece(graph: Graph, node: Node) -> _Piece | None:
    """The scatter ``node`` as a piece, or None (another op, a strided slice)."""
    if node.target == _SELECT and len(node.args) == 4:
        grad, shape, dim, index = node.args
        select = True
        size = len(shape)
        dim = dim % size
        index = index % shape[dim]
        start, end = index, index + 1
    elif node.target == _SLICE and len(node.args) == 6:
        grad, shape, dim, start, end, step = node.args
        select = False
        size = len(shape)
        dim = dim % size
        n = shape[dim]
        if step != 1:
            return None
        start = max(0, min(n, start + n if start < 0 else start))
        end = max(0, min(n, end + n if end < 0 else end))
    else:
        return None
    if not isinstance(grad, ValueRef):
        return None
    return _Piece(grad.id, tuple(shape), dim, start, end, select)


def _write_stack(w: GraphWriter, graph: Graph, root: Node, pieces: list[_Piece]) -> None:
    """The root add as a stack (or cat) of the pieces' gradients, in the root's storage."""
    old = graph.values[root.outputs[0]]
    grads = [ValueRef(w.whole[p.grad]) for p in pieces]
    target = "aten.stack.default" if pieces[0].select else "aten.cat.default"
    spec = OutSpec(old.name, Meta(old.shape, contiguous_strides(old.shape), 0), old.dtype,
                   storage=w.mapped_storage(old.storage), role=old.role)
    w.whole[old.id] = w.add_node(f"{root.name}.stacked", target, (grads, pieces[0].dim), {}, [spec],
                                 phase=root.phase, module=root.module,
                                 device=w.device_of(grads[0].id))[0]
