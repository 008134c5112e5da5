"""Device datasheets for the roofline cost model (no torch): peak FLOP/s, bandwidths, memory.

A ``DeviceSpec`` describes hardware you may not have, so that fitgraph can plan for it. Numbers
are vendor datasheet peaks (dense, no sparsity); a roofline built on them is a lower bound on
latency. ``flop_efficiency`` / ``bandwidth_efficiency`` scale the peaks to what kernels achieve,
if you know it; they default to 1.0 (pure datasheet) because any other default would be a guess.

Example:
    >>> from fitgraph.cost.devices import get_device
    >>> a100 = get_device("A100-80GB")
    >>> a100.memory_bytes // 2**30, a100.peak("bfloat16") / 1e12
    (80, 312.0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["DEVICES", "DeviceSpec", "get_device"]

GiB = 2**30
TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One device, as the roofline model sees it.

    Attributes:
        name: registry name ("a100-80gb").
        memory_bytes: device memory usable for tensors.
        peak_flops: dtype name -> FLOP/s of the fastest unit for that dtype (tensor cores for
            matmuls). The key ``"tf32"`` is float32 matmuls on tensor cores (used only with
            ``RooflineCostModel(allow_tf32=True)``).
        mem_bandwidth: device memory bandwidth, bytes/s.
        host_bandwidth: device<->host copy bandwidth, bytes/s, one direction (PCIe).
        kernel_overhead_s: fixed cost of every node that runs a kernel (dispatch + launch).
        flop_efficiency: fraction of ``peak_flops`` kernels achieve (1.0 = datasheet).
        bandwidth_efficiency: fraction of ``mem_bandwidth`` kernels achieve (1.0 = datasheet).
        description: where the numbers come from.
        host_memory_apart: the device's memory is apart from the host's (a GPU), so an
            offloaded tensor frees device memory and a copy engine moves it beside compute;
            False on a CPU, where "host" is the same RAM and a copy is a memcpy in line.
    """

    name: str
    memory_bytes: int
    peak_flops: dict[str, float] = field(hash=False)
    mem_bandwidth: float
    host_bandwidth: float
    kernel_overhead_s: float
    flop_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    description: str = ""
    host_memory_apart: bool = True

    def __post_init__(self) -> None:
        if "float32" not in self.peak_flops:
            raise ValueError(f"DeviceSpec {self.name!r}: peak_flops needs a 'float32' entry")
        for what in ("memory_bytes", "mem_bandwidth", "host_bandwidth"):
            if getattr(self, what) <= 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {what} must be > 0")
        if not (0 < self.flop_efficiency <= 1 and 0 < self.bandwidth_efficiency <= 1):
            raise ValueError(f"DeviceSpec {self.name!r}: efficiencies must be in (0, 1]")

    def peak(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype`` (float32's when the device lists no such dtype)."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"]) * self.flop_efficiency

    @property
    def bandwidth(self) -> float:
        """Achievable device memory bandwidth, bytes/s."""
        return self.mem_bandwidth * self.bandwidth_efficiency

    def replace(self, **changes) -> DeviceSpec:
        """A copy with some fields changed, e.g. ``spec.replace(flop_efficiency=0.7)``."""
        return dataclasses.replace(self, **changes)


# NOTE: per-node overhead of eager PyTorch on a GPU: CPU-side ATen dispatch plus the CUDA kernel
# launch is a few microseconds per op (launch latency alone is ~2-5 us on recent drivers). This
# is an order-of-magnitude figure, not a datasheet number; calibrate it with a measured model
# (ProfiledCostModel) when it matters.
_GPU_OVERHEAD_S = 5e-6
# NOTE: PCIe one-direction peaks: Gen4 x16 = 16 GT/s * 16 lanes * 128/130 / 8 = 31.5 GB/s,
# Gen5 x16 = 63 GB/s (NVIDIA datasheets quote the bidirectional 64 / 128 GB/s).
_PCIE4_X16 = 31.5 * GIGA
_PCIE5_X16 = 63.0 * GIGA

DEVICES: dict[str, DeviceSpec] = {}


def _register(spec: DeviceSpec) -> None:
    DEVICES[spec.name] = spec


# NOTE: GeForce RTX 3090: NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix table
# (FP32 35.6 TFLOPS; tensor FP16/BF16 with FP32 accumulate 71 TFLOPS dense — what PyTorch uses;
# TF32 35.6 dense; FP64 1/64 rate), 24 GB GDDR6X at 936 GB/s, PCIe Gen4 x16.
_register(DeviceSpec(
    name="rtx3090", memory_bytes=24 * GiB,
    peak_flops={"float64": 0.556 * TERA, "float32": 35.6 * TERA, "tf32": 35.6 * TERA,
                "float16": 71 * TERA, "bfloat16": 71 * TERA},
    mem_bandwidth=936 * GIGA, host_bandwidth=_PCIE4_X16, kernel_overhead_s=_GPU_OVERHEAD_S,
    description="NVIDIA GeForce RTX 3090 (GA102 whitepaper)"))

# NOTE: A100: NVIDIA A100 Tensor Core GPU datasheet (FP64 9.7 / FP64 tensor 19.5, FP32 19.5,
# TF32 156, BF16/FP16 312 TFLOPS dense; 40GB HBM2 1,555 GB/s; 80GB SXM HBM2e 2,039 GB/s;
# PCIe Gen4 x16).
_A100_FLOPS = {"float64": 19.5 * TERA, "float32": 19.5 * TERA, "tf32": 156 * TERA,
               "float16": 312 * TERA, "bfloat16": 312 * TERA}
_register(DeviceSpec(
    name="a100-40gb", memory_bytes=40 * GiB, peak_flops=dict(_A100_FLOPS),
    mem_bandwidth=1555 * GIGA, host_bandwidth=_PCIE4_X16, kernel_overhead_s=_GPU_OVERHEAD_S,
    description="NVIDIA A100 40GB (A100 datasheet)"))
_register(DeviceSpec(
    name="a100-80gb", memory_bytes=80 * GiB, peak_flops=dict(_A100_FLOPS),
    mem_bandwidth=2039 * GIGA, host_bandwidth=_PCIE4_X16, kernel_overhead_s=_GPU_OVERHEAD_S,
    description="NVIDIA A100 80GB SXM (A100 datasheet)"))

# NOTE: H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet (FP64 tensor 67, FP32 67,
# TF32 494.5, BF16/FP16 989.5, FP8 1979 TFLOPS dense — the datasheet's headline figures are
# with 2:4 sparsity, twice these; HBM3 3.35 TB/s; PCIe Gen5 x16).
_register(DeviceSpec(
    name="h100", memory_bytes=80 * GiB,
    peak_flops={"float64": 67 * TERA, "float32": 67 * TERA, "tf32": 494.5 * TERA,
                "float16": 989.5 * TERA, "bfloat16": 989.5 * TERA,
                "float8_e4m3fn": 1979 * TERA, "float8_e5m2": 1979 * TERA},
    mem_bandwidth=3350 * GIGA, host_bandwidth=_PCIE5_X16, kernel_overhead_s=_GPU_OVERHEAD_S,
    description="NVIDIA H100 SXM5 80GB (H100 datasheet)"))

# NOTE: cpu-generic is an *assumed* small x86-64 server (a 2-vCPU cloud VM / CI runner), not a
# datasheet: 2 cores at 2.5 GHz with AVX2 and two FMA units = 2 * 2.5e9 * (2 units * 8 fp32
# lanes * 2 FLOP) = 160 GFLOP/s fp32 (float64 half that). float16/bfloat16 have no native AVX2
# arithmetic (PyTorch computes in fp32), so they get the fp32 peak. Two cores cannot saturate a
# socket's DRAM: ~10 GB/s per core (STREAM triad on Skylake-SP/Zen class cores) -> 20 GB/s. A
# "host copy" on a CPU is a memcpy inside the same DRAM (read + write), so half that. 8 GiB RAM.
# Eager ATen dispatch costs a few microseconds per op on such a core.
_register(DeviceSpec(
    name="cpu-generic", memory_bytes=8 * GiB,
    peak_flops={"float64": 80 * GIGA, "float32": 160 * GIGA, "float16": 160 * GIGA,
                "bfloat16": 160 * GIGA},
    mem_bandwidth=20 * GIGA, host_bandwidth=10 * GIGA, kernel_overhead_s=5e-6,
    description="generic 2-core AVX2 x86-64 server CPU, fp32 (assumed, see NOTE in devices.py)",
    host_memory_apart=False))


def get_device(name: str) -> DeviceSpec:
    """The registered DeviceSpec called ``name`` (case-insensitive)."""
    spec = DEVICES.get(name.strip().lower())
    if spec is None:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(sorted(DEVICES))} "
                         "(or build a DeviceSpec yourself)")
    return spec
