"""Copying nodes after a rewrite that changed a tensor's layout: views laid out again.

A rule may make a value again with another layout than the captured one — a part of a packed
projection made on its own is contiguous where it was a strided slice; a part of a merged one
sits at another offset. The views read from it then have other strides or offsets too, and
the IR must say what ATen will make (the executor's views, the profiler's tensors). Nodes that
are not views make fresh tensors, whose layout the rules check does not depend on their
inputs' (``layout_free``).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Node, Role
    >>> from fitgraph.transform.fission_meta import Meta
    >>> b = GraphBuilder()
    >>> mm = Node(0, "mm", "aten.mm.default", (), {}, (), (), (), "forward", "")
    >>> layout_free(mm), relaid_views_ok(b.finish({}), 0, Meta((4,), (1,), 0), {})
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Node, Value, ValueRef, contiguous_strides
from .fission_meta import VIEW_TARGETS, Meta, view_meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["LAYOUT_FREE", "add_view", "copy_relaid", "layout_free", "relaid_views_ok",
           "rewrite_nodes"]

# NOTE: ops whose outputs are laid out the same whatever their inputs' strides (a matmul's
# result is dense row-major; a clone to contiguous_format is contiguous): where a rule changes
# an input's layout, only these (and views) may read it
LAYOUT_FREE = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                         "aten.baddbmm.default"})


def layout_free(node: Node) -> bool:
    """Whether ``node``'s outputs keep their layout when its inputs' layouts change."""
    if node.target in LAYOUT_FREE:
        return True
    if node.target == "aten.clone.default":
        fmt = node.kwargs.get("memory_format")
        return fmt is not None and str(fmt) == "torch.contiguous_format"
    return False


def rewrite_nodes(graph: Graph, at: dict[int, Callable[[GraphWriter], None]],
                  skipped: set[int]) -> Graph:
    """A copy of ``graph`` (checked): at each node of ``at`` its writer runs in the node's
    place; the nodes in ``skipped`` (which a writer may add to: nodes it copied ahead) go;
    every other node is copied, its views laid out again (``copy_relaid``). The one loop of
    every rewrite rule."""
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.id in at:
            at[n.id](w)
        elif n.id not in skipped:
            copy_relaid(w, graph, n)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def add_view(w: GraphWriter, target: str, src: int, rest: tuple, name: str, like: Node) -> int:
    """A new view ``target(src, *rest)`` in ``src``'s storage, laid out as ATen lays it out,
    in ``like``'s phase and module; its value id."""
    v = w.values[src]
    meta = view_meta(target, (None, *rest), [Meta(v.shape, v.stride, v.storage_offset)])
    spec = OutSpec(name, meta, v.dtype, storage=v.storage, role=v.role)
    return w.add_node(name, target, (ValueRef(src), *rest), {}, [spec], phase=like.phase,
                      module=like.module, device=w.device_of(src))[0]


def copy_relaid(w: GraphWriter, graph: Graph, node: Node) -> int:
    """Copy ``node`` into ``w``: a view of a value now laid out otherwise gets the layout ATen
    gives it; every other node is copied as it is. Returns the new node's id."""
    if node.target not in VIEW_TARGETS or not node.inputs:
        return w.copy_node(node)
    src = w.whole[node.inputs[0]]
    sv, ov = w.values[src], graph.values[node.inputs[0]]
    if (sv.shape, sv.stride, sv.storage_offset) == (ov.shape, ov.stride, ov.storage_offset):
        return w.copy_node(node)
    ins = [Meta(sv.shape, sv.stride, sv.storage_offset)]
    outs = []
    for i, o in enumerate(node.outputs):
        if o is None:
            outs.append(None)
            continue
        v = graph.values[o]
        meta = view_meta(node.target, node.args, ins, i)
        if meta is None:
            raise RuntimeError(f"{node.name}: ATen cannot view {sv.name} laid out as "
                               f"{sv.stride} (a rule changed its layout; a bug in its check)")
        outs.append(OutSpec(v.name, meta, v.dtype, storage=sv.storage, role=v.role))
    args, kwargs = w.remapped(node.args, node.kwargs)
    new = w.add_node(node.name, node.target, args, kwargs, outs, phase=node.phase,
                     module=node.module, device=w.device_of(src), flops=node.flops,
                     out_is_tuple=node.out_is_tuple)
    for o, n in zip(node.outputs, new):
        if o is not None:
            w.whole[o] = n
    return len(w.nodes) - 1


def _rows_alike(old: Value, new: Meta) -> bool:
    """Whether any op reading ``old`` laid out as ``new`` lays its outputs out as before:
    ``new`` is contiguous and ``old`` row-major in order (ATen's elementwise ops order their
    outputs' strides as their inputs', so both make contiguous outputs)."""
    dims = [i for i, n in enumerate(new.shape) if n != 1]
    if [new.stride[i] for i in dims] != [contiguous_strides(new.shape)[i] for i in dims]:
        return False
    strides = [old.stride[i] for i in dims]
    return all(a >= b for a, b in zip(strides, strides[1:]))


def relaid_views_ok(graph: Graph, value: int, meta: Meta, readers: dict[int, list[int]],
                    any_reader: bool = False) -> bool:
    """Whether every view read (transitively) from ``value``, laid out as ``meta``, is one ATen
    can make, and every other reader of them is ``layout_free`` or reads a contiguous tensor
    where it read a row-major one (``any_reader``: any op may read them — only the offset
    moved, the strides are the captured ones)."""
    todo = [(value, meta)]
    while todo:
        vid, m = todo.pop()
        for r in readers.get(vid, []):
            node = graph.nodes[r]
            if node.target not in VIEW_TARGETS:
                if not (any_reader or layout_free(node) or _rows_alike(graph.values[vid], m)):
                    return False
                continue
            if node.inputs[0] != vid or any(isinstance(a, ValueRef) for a in node.args[1:]):
                return False
            for i, o in enumerate(node.outputs):
                if o is None:
                    continue
                out = view_meta(node.target, node.args, [m], i)
                if out is None:
                    return False
                todo.append((o, out))
    return True
