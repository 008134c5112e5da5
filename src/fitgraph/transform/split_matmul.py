"""A packed projection split back into one matmul per part (the inverse of merging).

GPT-2 makes ``q, k, v`` with one matmul (``c_attn``: ``[tokens, 3 * hidden]``) and splits its
result into three views: the packed tensor lives while any part does — ``q`` and ``k`` are read
(copied per head) right away, ``v`` only after the softmax, so all three stay until then, and a
remat plan can only re-make the three together. Here each part is made by its own matmul on a
slice of the weight (a view: nothing is copied) and of the bias: every part is a tensor of its
own, dying — or recomputed — alone, at the cost of reading the input once per part.

Matched: ``mm(x, w)`` / ``addmm(b, x, w)`` whose result (through views that keep its last
dimension) is read by one ``split`` / ``split_with_sizes`` of the last dimension alone. A part
made on its own is contiguous where it was a strided slice, so every view read from it is laid
out again (``relayout``), and the match is refused unless ATen can make each of those views and
every other reader's output does not depend on its input's strides (matmuls, clones to
contiguous; e.g. not ``scaled_dot_product_attention``, whose gradients follow its inputs'
strides). Values: each part is the same dot products, blocked otherwise by BLAS: allclose.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.transform.split_matmul import find_packed_matmuls, split_packed_matmuls
    >>> class Packed(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__(); self.qkv = torch.nn.Linear(8, 24)
    ...     def forward(self, x):
    ...         q, k, v = self.qkv(x).split(8, dim=-1)
    ...         return ((q @ k.T).softmax(-1) @ v).sum()
    >>> g = fitgraph.capture(Packed(), torch.randn(16, 8))
    >>> [m.parts for m in find_packed_matmuls(g)]
    [3]
    >>> g2 = split_packed_matmuls(g)
    >>> sum(n.target == "aten.addmm.default" for n in g2.nodes)
    3
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..graph.analysis import storage_accesses, users
from ..graph.ir import Graph, ValueRef, contiguous_strides
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec
from .relayout import add_view, relaid_views_ok, rewrite_nodes

__all__ = ["PackedMatmul", "find_packed_matmuls", "split_packed_matmuls"]

_MATMULS = ("aten.mm.default", "aten.addmm.default")
_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default")
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


@dataclass(frozen=True)
class PackedMatmul:
    """One packed matmul to split: the matmul, the views to its split, the split, the column
    range of each part, and what it changes (``bytes_saved``: 0, the bytes are the same; the
    parts' lifetimes are what change)."""

    matmul: int
    views: tuple[int, ...]
    split: int
    ranges: tuple[tuple[int, int], ...]
    bytes_saved: int = 0
    flops_saved: float = 0.0

    @property
    def parts(self) -> int:
        return len(self.ranges)


def find_packed_matmuls(graph: Graph) -> list[PackedMatmul]:
    """Every packed matmul whose parts can be made apart (module doc)."""
    readers = users(graph)
    touched = storage_accesses(graph)
    outputs = {graph.values[v].storage for v in graph.outputs.values()}
    found = []
    for n in graph.nodes:
        if n.target not in _MATMULS or n.mutates or n.kwargs:
            continue
        p = graph.values[n.outputs[0]]
        if len(p.shape) != 2 or p.storage in outputs:
            continue
        chain, cur = [], p
        while len(readers.get(cur.id, [])) == 1:
            nxt = graph.nodes[readers[cur.id][0]]
            if nxt.target not in _VIEWS or graph.values[nxt.outputs[0]].shape[-1] != p.shape[-1]:
                break
            chain.append(nxt.id)
            cur = graph.values[nxt.outputs[0]]
        rd = readers.get(cur.id, [])
        if len(rd) != 1 or graph.nodes[rd[0]].target not in _SPLITS:
            continue
        split = graph.nodes[rd[0]]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim not in (-1, len(cur.shape) - 1) or len(split.outputs) < 2:
            continue
        if set(touched.get(p.storage, ())) - {n.id, *chain, split.id} - _part_readers(
                graph, split, readers):
            continue
        sizes = [graph.values[o].shape[-1] for o in split.outputs]
        ranges = tuple((sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes)))
        if not all(relaid_views_ok(graph, o, Meta(graph.values[o].shape, contiguous_strides(
                graph.values[o].shape), 0), readers) for o in split.outputs):
            continue
        found.append(PackedMatmul(n.id, tuple(chain), split.id, ranges))
    return found


def _part_readers(graph: Graph, split, readers) -> set[int]:
    """Every node reading a part (through views): they touch the packed storage too."""
    out, todo = set(), [o for o in split.outputs if o is not None]
    while todo:
        v = todo.pop()
        for r in readers.get(v, []):
            out.add(r)
            if graph.values[v].storage in {graph.values[o].storage
                                           for o in graph.nodes[r].outputs if o is not None}:
                todo.extend(o for o in graph.nodes[r].outputs if o is not None)
    return out


def split_packed_matmuls(graph: Graph, matches: list[PackedMatmul] | None = None) -> Graph:
    """A copy of ``graph`` with every packed matmul of ``find_packed_matmuls`` (or those of
    ``matches``, some of them) made part by part (module doc); ``graph`` itself where there is
    none."""
    matches = {m.matmul: m for m in (find_packed_matmuls(graph) if matches is None
                                     else matches)}
    if not matches:
        return graph
    skipped = {m.split for m in matches.values()} | {v for m in matches.values() for v in m.views}
    return rewrite_nodes(graph, {k: partial(_write_parts, graph=graph, m=m)
                                 for k, m in matches.items()}, skipped)


def _write_parts(w: GraphWriter, *, graph: Graph, m: PackedMatmul) -> None:
    """Per part: the weight's (and bias's) columns sliced, the matmul, the views again with the
    part's width; the split's outputs mapped to them."""
    mm, split = graph.nodes[m.matmul], graph.nodes[m.split]
    p = graph.values[mm.outputs[0]]
    refs = [w.whole[r.id] for r in mm.args]
    for i, ((lo, hi), part) in enumerate(zip(m.ranges, split.outputs)):
        name = f"{mm.name}.part{i}"
        args = list(refs)
        args[-1] = add_view(w, "aten.slice.Tensor", refs[-1], (1, lo, hi), f"{name}.w", mm)
        if mm.target == "aten.addmm.default":
            bias = w.values[refs[0]]
            if bias.shape and bias.shape[-1] == p.shape[-1]:
                args[0] = add_view(w, "aten.slice.Tensor", refs[0], (len(bias.shape) - 1, lo, hi),
                                   f"{name}.b", mm)
        shape = (p.shape[0], hi - lo)
        out = graph.values[part]
        spec = OutSpec(name, Meta(shape, contiguous_strides(shape), 0), p.dtype, role=out.role)
        cur = w.add_node(name, mm.target, tuple(ValueRef(a) for a in args), {}, [spec],
                         phase=mm.phase, module=mm.module, device=w.device_of(refs[1]),
                         flops=mm.flops * (hi - lo) / p.shape[-1])[0]
        for vid in m.views:   # NOTE: the same views, at the part's width
            view = graph.nodes[vid]
            cur = add_view(w, view.target, cur, (list(view.args[1][:-1]) + [hi - lo],),
                           f"{view.name}.part{i}", view)
        w.whole[part] = cur
