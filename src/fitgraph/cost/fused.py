"""``FusedCostModel``: node costs as inductor runs a graph, its pointwise ops fused.

Inductor compiles the forward and the backward into fused kernels: a chain of pointwise ops
(batch norm's normalize, the ReLU after it, a GELU, a residual add, a dtype cast) runs inside
the kernel of its producer or its consumer, reading and writing no tensor of its own. Its own
partitioner prices recomputing such an op in the backward as free and recomputes every one it
can (ResNet-50 small: 543 pointwise ops and views again in the backward, the convolutions'
outputs saved). A measured cost model prices each of them as the kernel eager PyTorch launches,
so fitgraph's plan for inductor weighed a batch norm's normalize-and-ReLU (four kernels in eager)
against a convolution and recomputed two convolutions at ResNet-50's 0.9 budget; priced fused,
it recomputes pointwise chains only. Measured compiled (``fitgraph bench`` and a side-by-side
at equal budgets, ResNet-50 and U-Net small on the CPU) the two pricings' steps ran within 1%
of each other, within the timing's noise: inductor's kernels, not the choice of recomputes,
make most of the difference there.

This wrapper answers the base model's cost for every node but the fused ones: pointwise ATen
ops (``torch.Tag.pointwise``, and ``_to_copy``, inductor's casts) that write no input in place
and draw no random numbers, and views (``is_metadata_node``), which cost nothing: their work
is the kernels around them, which keep their measured costs. Reductions, matmuls,
convolutions, attention and the rest cost what they are measured to. Memory is not touched:
the simulator still holds each pointwise output as the ATen graph makes it, so a plan's peak is
that of the ATen graph (inductor's measured peak is usually lower).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.cost.fused import FusedCostModel
    >>> b = GraphBuilder(); x = b.add_input("x", (1024, 1024), "float32", Role.INPUT)
    >>> w = b.add_input("w", (1024, 1024), "float32", Role.PARAMETER)
    >>> h = b.add_node("aten.mm.default", [x, w], [((1024, 1024), "float32")],
    ...                flops=2 * 1024**3)[0]
    >>> y = b.add_node("aten.relu.default", [h], [((1024, 1024), "float32")])[0]
    >>> g = b.finish({"loss": y})
    >>> cm = FusedCostModel(RooflineCostModel(get_device("a100-80gb")))
    >>> cm.node_cost(g, g.nodes[1]).seconds, cm.node_cost(g, g.nodes[0]).seconds > 0
    (0.0, True)
"""

from __future__ import annotations

import functools

from ..graph.ir import Graph, Node
from .base import CostModelWrapper, NodeCost
from .roofline import is_metadata_node

__all__ = ["FusedCostModel", "is_fused"]

# NOTE: ATen ops inductor fuses that carry no pointwise tag: dtype casts
_ALSO_FUSED = frozenset({"aten._to_copy.default"})
_FREE = NodeCost(0.0, 0)


@functools.cache
def _pointwise(target: str) -> bool:
    """True for an ATen op tagged pointwise and not random (torch's own op tags)."""
    if target in _ALSO_FUSED:
        return True
    if not target.startswith("aten."):
        return False
    import torch

    _, name, overload = target.split(".")
    try:
        op = getattr(getattr(torch.ops.aten, name), overload)
    except AttributeError:
        return False
    return torch.Tag.pointwise in op.tags and torch.Tag.nondeterministic_seeded not in op.tags


def is_fused(graph: Graph, node: Node) -> bool:
    """True for a node inductor runs inside its neighbours' kernels: a view, or a pointwise op
    that writes no input in place and draws no random numbers."""
    if node.mutates or node.random:
        return False
    return is_metadata_node(graph, node) or _pointwise(node.target)


class FusedCostModel(CostModelWrapper):
    """``base``'s costs with fused nodes (``is_fused``) free; everything else is ``base``'s
    (``profile``, copies, the device's traits)."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.name = f"{base.name}, pointwise fused"

    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        if is_fused(graph, node):
            return _FREE
        return self.base.node_cost(graph, node)

    def __repr__(self) -> str:
        return f"FusedCostModel({self.base!r})"
