"""A product scaled by a number is made from the smaller operand scaled instead (re-association).

Attention scales its scores: ``s = (q @ k^T) * c`` (GPT-2, ViT, BERT: ``c = 1/sqrt(d)``). The
product ``q @ k^T`` is ``[tokens, tokens]`` per head, ``q`` only ``[tokens, d]``: scaling the
product makes a second tensor of the large size and reads and writes it once more, where
``(q * c) @ k^T`` — the same value — scales a tensor ``tokens / d`` times smaller and never holds
two score-sized tensors at once (GPT-2 small at 512 tokens: 8 MiB per layer less at the moment
of the scaling, a quarter of the elementwise traffic).

Here ``y = mul(P, c)`` (or ``div(P, c)``, ``c`` a Python number), where ``P`` is an ``mm`` or
``bmm`` product (through views: ``matmul``'s ``_unsafe_view``) read by nothing else, becomes
``y = mm(mul(a, c), b)`` with ``a`` the operand with fewer elements than the product (the
views re-made on the new product, so ``y`` keeps its shape and strides). The graph is a value
graph (the backward reads what it read: ``a``, ``b``, never ``P``), so the rewrite holds
wherever the pattern stands — forward, backward or optimizer. Values: the scaling rounds
before the product instead of after (exact for a power of two barring underflow): allclose.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.transform.scale_across_matmul import scale_across_matmul, find_scaled_products
    >>> class Scores(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__(); self.w = torch.nn.Parameter(torch.randn(8, 4))
    ...     def forward(self, x):
    ...         q = x @ self.w
    ...         return ((q @ q.T) * 0.5).softmax(-1).sum()
    >>> g = fitgraph.capture(Scores(), torch.randn(32, 8))
    >>> [(m.bytes_saved, m.operand) for m in find_scaled_products(g)]
    [(3584, 0)]
    >>> g2 = scale_across_matmul(g)
    >>> len(g2.nodes) == len(g.nodes)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..graph.analysis import storage_accesses, users
from ..graph.ir import Graph, Node, ValueRef, contiguous_strides
from .fission_meta import Meta, is_dense
from .fission_writer import GraphWriter, OutSpec
from .relayout import rewrite_nodes

__all__ = ["ScaledProduct", "find_scaled_products", "scale_across_matmul"]

_PRODUCTS = ("aten.mm.default", "aten.bmm.default")
_SCALINGS = ("aten.mul.Tensor", "aten.div.Tensor", "aten.mul.Scalar", "aten.div.Scalar")
# NOTE: views between the product and its scaling (matmul's 4-D batch flattened and restored)
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


@dataclass(frozen=True)
class ScaledProduct:
    """One ``scaling(views(product(a, b)), c)`` to re-associate: the nodes, which operand
    (0: ``a``, 1: ``b``) is scaled, and what it saves (the product's bytes not made twice,
    less the scaled operand's)."""

    product: int
    views: tuple[int, ...]
    scaling: int
    operand: int
    bytes_saved: int
    # NOTE: elementwise ops count no FLOPs here (their time is their bytes: cost.roofline)
    flops_saved: float = 0.0


def find_scaled_products(graph: Graph) -> list[ScaledProduct]:
    """Every product scaled by a number that a smaller operand can carry (module doc)."""
    readers = users(graph)
    touched = storage_accesses(graph)
    outputs = set(graph.values[v].storage for v in graph.outputs.values())
    written = {graph.values[v].storage for n in graph.nodes for v in n.mutates}
    found = []
    for n in graph.nodes:
        if n.target not in _PRODUCTS or n.mutates:
            continue
        p = graph.values[n.outputs[0]]
        chain, cur = [], p
        while len(readers.get(cur.id, [])) == 1:
            nxt = graph.nodes[readers[cur.id][0]]
            if nxt.target not in _VIEWS:
                break
            chain.append(nxt.id)
            cur = graph.values[nxt.outputs[0]]
        rd = readers.get(cur.id, [])
        if len(rd) != 1 or not _scales(graph.nodes[rd[0]], cur.id):
            continue
        scaling = graph.nodes[rd[0]]
        y = graph.values[scaling.outputs[0]]
        # NOTE: the product's storage must die into the scaling (nothing else reads or writes
        # it), and the scaled tensor must be laid out as the product's views lay it out
        if p.storage in outputs or p.storage in written or y.storage in written:
            continue
        if y.shape != cur.shape or y.stride != cur.stride or y.dtype != p.dtype:
            continue
        if set(touched.get(p.storage, ())) - {n.id, *chain, scaling.id}:
            continue
        a, b = (graph.values[r.id] for r in n.args[:2])
        operand = 0 if a.numel <= b.numel else 1
        small = (a, b)[operand]
        if small.numel >= p.numel or small.dtype != p.dtype:
            continue
        found.append(ScaledProduct(n.id, tuple(chain), scaling.id, operand,
                                   p.nbytes - small.nbytes))
    return found


def _scales(node: Node, reads: int) -> bool:
    """Whether ``node`` multiplies or divides ``reads`` by a Python number."""
    if node.target not in _SCALINGS or node.kwargs or len(node.args) != 2:
        return False
    a, c = node.args
    return (isinstance(a, ValueRef) and a.id == reads and isinstance(c, (int, float))
            and not isinstance(c, bool))


def scale_across_matmul(graph: Graph, matches: list[ScaledProduct] | None = None) -> Graph:
    """A copy of ``graph`` with every scaled product of ``find_scaled_products`` (or those of
    ``matches``, some of them) made from its scaled operand (module doc); ``graph`` itself
    where there is none."""
    matches = {m.product: m for m in (find_scaled_products(graph) if matches is None
                                      else matches)}
    if not matches:
        return graph
    at = {k: partial(_write, graph=graph, m=m) for k, m in matches.items()}
    # NOTE: the views between product and scaling are copied as they are (the new product is
    # laid out as the old); the scaling's output is read as the last of them
    for m in matches.values():
        last = graph.nodes[m.views[-1]].outputs[0] if m.views else graph.nodes[
            m.product].outputs[0]
        at[m.scaling] = partial(_read_as, y=graph.nodes[m.scaling].outputs[0], last=last)
    return rewrite_nodes(graph, at, set())


def _read_as(w: GraphWriter, *, y: int, last: int) -> None:
    w.whole[y] = w.whole[last]


def _write(w: GraphWriter, *, graph: Graph, m: ScaledProduct) -> None:
    """The scaled operand and the product of it, read in place of the old product."""
    prod, scaling = graph.nodes[m.product], graph.nodes[m.scaling]
    operands = [w.whole[r.id] for r in prod.args[:2]]
    small = w.values[operands[m.operand]]
    strides = small.stride if is_dense(small.shape, small.stride) else contiguous_strides(
        small.shape)   # NOTE: an elementwise op's output keeps a dense input's strides
    meta = Meta(small.shape, tuple(strides), 0)
    spec = OutSpec(f"{scaling.name}.operand", meta, small.dtype, role=graph.values[
        scaling.outputs[0]].role)
    operands[m.operand] = w.add_node(
        f"{scaling.name}.operand", scaling.target, (ValueRef(operands[m.operand]),
                                                    scaling.args[1]), {}, [spec],
        phase=scaling.phase, module=scaling.module, device=w.device_of(operands[m.operand]))[0]
    p = graph.values[prod.outputs[0]]
    spec = OutSpec(p.name, Meta(p.shape, p.stride, 0), p.dtype,
                   role=graph.values[scaling.outputs[0]].role)
    w.whole[p.id] = w.add_node(prod.name, prod.target, tuple(ValueRef(o) for o in operands), {},
                               [spec], phase=prod.phase, module=prod.module,
                               device=w.device_of(operands[0]), flops=prod.flops)[0]
