"""Roofline latency of a node on a DeviceSpec (no torch): plan for hardware you don't have.

    seconds = kernel_overhead + max(flops / peak(dtype), bytes_moved / bandwidth)

``Node.flops`` (torch's own FLOP formulas: matmuls, convolutions, attention; elementwise FLOPs
of optimizer updates) and ``Node.bytes_moved`` (bytes read + written) are filled at capture.
Pure view/metadata nodes (``aten.view``, ``t``, ``expand``, ``detach``, ``slice``...) run no
kernel and cost 0. The roofline knows nothing of workspaces: ``workspace_bytes`` is always 0;
use ``ProfiledCostModel`` for measured workspaces.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.cost.devices import get_device
    >>> from fitgraph.cost.roofline import RooflineCostModel
    >>> b = GraphBuilder(); x = b.add_input("x", (1024, 1024), "float32", Role.INPUT)
    >>> y = b.add_node("aten.mm.default", [x, x], [((1024, 1024), "float32")],
    ...                flops=2 * 1024**3)[0]
    >>> g = b.finish({"loss": y})
    >>> cost = RooflineCostModel(get_device("a100-80gb")).node_cost(g, g.nodes[0])
    >>> round(cost.seconds * 1e6)  # 2.1 GFLOP at 19.5 TFLOP/s + 5 us overhead
    115
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from .base import BaseCostModel, NodeCost
from .devices import DeviceSpec

__all__ = ["RooflineCostModel", "is_metadata_node", "node_dtype"]

_FLOATS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
_OPTIMIZER_PREFIX = "fitgraph.optimizer."


def is_metadata_node(graph: Graph, node: Node) -> bool:
    """True for pure views/metadata ops: no FLOPs, no in-place write, and every tensor output
    lives in the storage of one of the node's inputs (so no kernel runs and nothing is
    allocated)."""
    if node.flops or node.mutates or node.target.startswith(_OPTIMIZER_PREFIX):
        return False
    outs = [o for o in node.outputs if o is not None]
    if not outs:
        return False
    read = {graph.values[v].storage for v in node.inputs}
    return all(graph.values[o].storage in read for o in outs)


def node_dtype(graph: Graph, node: Node) -> str:
    """The dtype a node computes in: its first floating output, else first floating input."""
    for vid in (*node.outputs, *node.inputs):
        if vid is not None and graph.values[vid].dtype in _FLOATS:
            return graph.values[vid].dtype
    return "float32"


class RooflineCostModel(BaseCostModel):
    """Latency = overhead + max(compute time, memory time) on a ``DeviceSpec``.

    Args:
        device: the hardware.
        allow_tf32: float32 matmul-class nodes run at the device's ``"tf32"`` peak (what
            ``torch.backends.cuda.matmul.allow_tf32 = True`` gives you). Default False: PyTorch's
            default for matmuls is full fp32 (``torch.get_float32_matmul_precision() ==
            "highest"``), so the fp32 (non-tensor-core) peak applies.

    Matmul-class nodes are the ATen nodes with FLOPs (torch's FLOP formulas exist only for
    matmuls, convolutions and attention); they use ``peak(dtype)`` — tensor cores for half
    types. Optimizer-update nodes are elementwise and use the float32 (vector) peak.
    """

    def __init__(self, device: DeviceSpec, *, allow_tf32: bool = False) -> None:
        self.device = device
        self.allow_tf32 = allow_tf32
        self.name = f"{device.name} (roofline{', tf32' if allow_tf32 else ''})"
        # NOTE: a GPU's copy engine runs beside its compute; a CPU copies in line, into itself
        self.copies_overlap = self.host_memory_apart = device.host_memory_apart

    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        if is_metadata_node(graph, node):
            return NodeCost(0.0, 0)
        dev = self.device
        compute = 0.0
        if node.flops:
            compute = node.flops / dev.peak(self._peak_key(graph, node))
        memory = node.bytes_moved / dev.bandwidth
        return NodeCost(dev.kernel_overhead_s + max(compute, memory), 0)

    def _peak_key(self, graph: Graph, node: Node) -> str:
        if node.target.startswith(_OPTIMIZER_PREFIX):
            return "float32"  # NOTE: elementwise update: vector units, not tensor cores
        dtype = node_dtype(graph, node)
        if dtype == "float32" and self.allow_tf32 and "tf32" in self.device.peak_flops:
            return "tf32"
        return dtype

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self.device.host_bandwidth

    def __repr__(self) -> str:
        return f"RooflineCostModel({self.device.name!r}, allow_tf32={self.allow_tf32})"
