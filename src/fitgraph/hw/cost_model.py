"""A candidate chip as a cost model of captured graphs: the single-device planner
(``fitgraph.optimize(cost_model=...)``) and the multi-device one on any captured model
(``dist.GraphModel(graph, ChipCostModel(chip), ...)``) plan for it unchanged.

Matrix multiplications and convolutions run on the arrays, timed by their GEMM shapes
(``hw.gemm``): ``mm``, ``addmm``, ``bmm``, ``baddbmm`` as they are; a convolution as its
im2col GEMM (``M`` = batch × output pixels, ``N`` = output channels per group, ``K`` =
input channels per group × kernel, one GEMM per group); a convolution's backward as the two
GEMMs of its input and weight gradients. Every other node is the roofline of the chip's vector
units and HBM (``cost.RooflineCostModel`` on ``hw.device.chip_device``). The arrays take
float32 GEMMs at their 16-bit rate (no multi-pass emulation, an optimistic assumption).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.hw.chip import CHIPS
    >>> from fitgraph.hw.gemm import gemm_seconds
    >>> g = fitgraph.capture(torch.nn.Linear(256, 512), torch.randn(64, 256),
    ...                      lambda m, x: m(x).sum())
    >>> cm = ChipCostModel(CHIPS["tpuv4"])
    >>> mm = next(n for n in g.nodes if n.target == "aten.addmm.default")
    >>> cm.node_cost(g, mm).seconds == max(gemm_seconds(CHIPS["tpuv4"], 64, 512, 256,
    ...                                                 itemsize=4), cm.device.kernel_overhead_s)
    True
"""

from __future__ import annotations

import math

from ..cost.base import NodeCost
from ..cost.roofline import RooflineCostModel, node_dtype
from ..graph.ir import Graph, Node, ValueRef
from .chip import Chip
from .device import chip_device
from .gemm import gemm_seconds

__all__ = ["ChipCostModel", "node_gemms"]

_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


class ChipCostModel(RooflineCostModel):
    """Node times on ``chip``: GEMMs on its arrays, the rest on its vector units and HBM."""

    def __init__(self, chip: Chip) -> None:
        super().__init__(chip_device(chip))
        self.chip = chip
        self.name = f"{chip.name} (arrays + roofline)"

    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        gemms = node_gemms(graph, node)
        if not gemms:
            return super().node_cost(graph, node)
        size = _ITEMSIZE.get(node_dtype(graph, node), 2)
        seconds = sum(gemm_seconds(self.chip, m, n, k, b, itemsize=size)
                      for m, n, k, b in gemms)
        return NodeCost(max(seconds, self.device.kernel_overhead_s), 0)

    def __repr__(self) -> str:
        return f"ChipCostModel({self.chip.name!r})"


def _shape(graph: Graph, arg) -> tuple[int, ...] | None:
    return tuple(graph.value(arg).shape) if isinstance(arg, ValueRef) else None


def node_gemms(graph: Graph, node: Node) -> list[tuple[int, int, int, int]]:
    """The GEMMs ``(M, N, K, batch)`` a node runs on the arrays (empty: not a GEMM)."""
    op = node.target.split(".")[1] if node.target.startswith("aten.") else ""
    args = node.args
    shapes = [_shape(graph, a) for a in args]
    if op == "mm" and len(shapes) >= 2 and shapes[0] and shapes[1]:
        (m, k), (_, n) = shapes[0], shapes[1]
        return [(m, n, k, 1)]
    if op == "addmm" and len(shapes) >= 3 and shapes[1] and shapes[2]:
        (m, k), (_, n) = shapes[1], shapes[2]
        return [(m, n, k, 1)]
    if op in ("bmm", "baddbmm"):
        a, b = (shapes[0], shapes[1]) if op == "bmm" else (shapes[1], shapes[2])
        if a and b:
            return [(a[1], b[2], a[2], a[0])]
    if op == "convolution" and shapes[0] and shapes[1]:
        out = [graph.values[v].shape for v in node.outputs if v is not None]
        groups = args[8] if len(args) > 8 and isinstance(args[8], int) else 1
        return _conv(shapes[0], shapes[1], tuple(out[0]) if out else None, groups)
    if op == "convolution_backward" and len(shapes) >= 3 and shapes[0] and shapes[1]:
        # NOTE: (grad_output, input, weight, ...): the input and weight gradients' GEMMs
        groups = args[9] if len(args) > 9 and isinstance(args[9], int) else 1
        mask = args[10] if len(args) > 10 and isinstance(args[10], (list, tuple)) else (1, 1)
        fwd = _conv(shapes[1], shapes[2], shapes[0], groups)
        # NOTE: only the gradients asked for (output_mask: input, weight, bias)
        return [g for m, n, k, b in fwd
                for g, wanted in (((m, k, n, b), mask[0]), ((k, n, m, b), mask[1])) if wanted]
    return []


def _conv(x, w, out, groups: int) -> list[tuple[int, int, int, int]]:
    if out is None or len(x) < 3 or groups < 1:
        return []
    m = out[0] * math.prod(out[2:])
    n = w[0] // groups
    k = w[1] * math.prod(w[2:])
    return [(m, n, k, groups)]
