"""A cluster: nodes of identical devices, a link inside a node and one between nodes.

A ``Link`` is what the α–β model of a collective reads (``dist.collectives``): ``latency_s``
(α, per message step) and ``bandwidth`` (β⁻¹: bytes/s one device can send on it, one direction,
at the rate collectives reach). A group of devices within one node talks over the node's link
(NVLink); a group that spans nodes over the slower of the two, the network — each device
sending through its own NIC share (a DGX A100 has 8 × 200 Gb/s HDR InfiniBand, one per GPU).
Constants come from datasheets, set once here (``LINKS``), never fitted per measurement.

Example:
    >>> from fitgraph.dist.cluster import dgx_a100
    >>> c = dgx_a100(nodes=4)
    >>> c.devices, c.link([0, 1, 2, 3]).name, c.link([0, 8]).name
    (32, 'nvlink3', 'hdr-ib')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cost.devices import DeviceSpec, get_device

__all__ = ["LINKS", "Cluster", "Link", "dgx_a100"]

GIGA = 1e9


@dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` bytes/s per device, one direction; ``latency_s`` per
    message step."""

    name: str
    bandwidth: float
    latency_s: float
    description: str = ""

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency_s < 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0 and latency >= 0")


# NOTE: NVLink 3 (A100): 12 links x 25 GB/s per direction = 300 GB/s per GPU each way (the
# datasheet's "600 GB/s" counts both directions); HDR InfiniBand: 200 Gb/s = 25 GB/s per port,
# one port per GPU on a DGX A100. Latencies: a few microseconds per step (NCCL's published
# base latencies are of this order); both are datasheet constants, not fits.
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink3", 300 * GIGA, 3e-6, "NVLink 3 (A100 SXM): 300 GB/s per GPU per direction"),
    Link("hdr-ib", 25 * GIGA, 5e-6, "HDR InfiniBand 200 Gb/s, one port per GPU"),
    # NOTE: measured once, not a datasheet: gloo over TCP loopback between two processes on
    # the 2-core CI-class machine (python -m fitgraph.bench.gloo_link; docs/dist/
    # gloo_link.json): 1 KiB one way in 121 us, 16-64 MiB at 2.3-2.6 GB/s
    Link("gloo-loopback", 2.49 * GIGA, 121e-6,
         "gloo (TCP loopback) between local CPU processes, measured"),
)}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``devices_per_node`` devices ``device``; ``intra`` links the devices of
    a node, ``inter`` the nodes. Device ``i`` is on node ``i // devices_per_node``."""

    device: DeviceSpec
    devices_per_node: int
    nodes: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ValueError("a cluster needs at least one node of at least one device")

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    def node_of(self, device: int) -> int:
        if not 0 <= device < self.devices:
            raise ValueError(f"device {device} is not in a cluster of {self.devices}")
        return device // self.devices_per_node

    def link(self, group: Sequence[int]) -> Link:
        """The link a collective over ``group`` (device indices) is bound by: the node's where
        every device is on one node, else the network."""
        return self.intra if len({self.node_of(d) for d in group}) <= 1 else self.inter


def dgx_a100(nodes: int = 1, device: str = "a100-80gb") -> Cluster:
    """DGX A100 nodes: 8 GPUs on NVLink 3, one HDR InfiniBand port per GPU (the cluster of
    Megatron-LM's SC'21 measurements)."""
    return Cluster(get_device(device), 8, nodes, LINKS["nvlink3"], LINKS["hdr-ib"])
