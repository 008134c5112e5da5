"""A ``Chip`` as the planners' device and cluster: the single-device and multi-device planners
plan for a candidate chip unchanged.

``chip_device`` is a ``DeviceSpec`` (HBM capacity and bandwidth; the arrays' peak for 16-bit
matmuls, the vector units' for the rest) that also times a GEMM by its shape
(``gemm_seconds``: ``hw.gemm``'s loop-nest model), which ``dist.block_cost`` uses for the ops
that carry their GEMMs' shapes (``Op.gemms``: a GPT by its shape); ``chip_cluster`` is
``devices`` such chips joined by their links: a group of a torus talks over one dimension's
ring (two links, one each way round, so twice a link's bandwidth), a switched group (NVSwitch)
over all the chip's links.

Example:
    >>> from fitgraph.hw.chip import CHIPS
    >>> c = chip_cluster(CHIPS["tpuv4"], 1024)
    >>> c.devices, round(c.device.peak("bfloat16") / 1e12), round(c.intra.bandwidth / 1e9)
    (1024, 275, 100)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.devices import DeviceSpec
from ..dist.cluster import Cluster, Link
from .chip import Chip
from .gemm import gemm_seconds

__all__ = ["ChipDevice", "chip_cluster", "chip_device"]

# NOTE: a host link of PCIe Gen4 x16 (31.5 GB/s one way) for every chip: what offloading reads
HOST_BANDWIDTH = 31.5e9
# NOTE: a compiled accelerator program runs its ops back to back: a fixed cost per op of the
# order of a pipeline fill, far below an eager GPU launch (~5 us); an assumption, said so
OP_OVERHEAD_S = 1e-6


@dataclass(frozen=True)
class ChipDevice(DeviceSpec):
    """A ``DeviceSpec`` of ``chip`` that times GEMMs by their shapes."""

    chip: Chip | None = field(default=None, compare=True)

    def gemm_seconds(self, m: int, n: int, k: int, batch: int = 1) -> float:
        return max(gemm_seconds(self.chip, m, n, k, batch), self.kernel_overhead_s)


def chip_device(chip: Chip) -> ChipDevice:
    """``chip`` as the planners' device."""
    peak = chip.peak_flops()
    return ChipDevice(
        name=chip.name, memory_bytes=chip.hbm_bytes,
        peak_flops={"float32": chip.vector_flops(), "bfloat16": peak, "float16": peak},
        mem_bandwidth=chip.hbm_bandwidth, host_bandwidth=HOST_BANDWIDTH,
        kernel_overhead_s=OP_OVERHEAD_S, description=chip.description, chip=chip)


def chip_link(chip: Chip) -> Link:
    """The link a group of ``chip``s talks over (see the module's note)."""
    lanes = chip.links if chip.topology == "switch" else min(2, chip.links)
    return Link(f"{chip.name}-{chip.topology}", lanes * chip.link_bandwidth,
                chip.link_latency_s, f"{lanes} x {chip.link_bandwidth / 1e9:.1f} GB/s")


def chip_cluster(chip: Chip, devices: int) -> Cluster:
    """``devices`` chips, one network of the chip's links (no slower tier between nodes)."""
    link = chip_link(chip)
    return Cluster(chip_device(chip), devices, 1, link, link)
