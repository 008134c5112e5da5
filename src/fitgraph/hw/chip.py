"""An accelerator described by its parts (no torch): tensor cores (systolic arrays), vector
cores, on-chip SRAM, HBM (capacity and bandwidth), clocks and chip-to-chip links.

The template is Phaze's (N tensor cores of W×D processing elements, M vector cores, one
on-chip buffer) with what Phaze leaves out: HBM bandwidth, the links, and a vector clock apart
from the arrays' where the vendor quotes one. Every preset's peak is its datasheet's, derived
from its parts (one multiply-accumulate = 2 FLOPs per processing element per cycle):

- TPUv4: 2 TensorCores × 4 MXUs of 128×128 at 1,050 MHz → 275 TFLOP/s bf16; 32 GiB HBM2 at
  1,200 GB/s; 128 MiB CMEM; 6 ICI links, 2,400 Gbit/s per chip in all (Jouppi et al., ISCA'23;
  Google Cloud TPU v4 documentation).
- TPUv5e: 1 TensorCore × 4 MXUs of 128×128 at 1,500 MHz → 197 TFLOP/s; 16 GiB HBM2e at
  819 GB/s; 4 ICI links, 1,600 Gbit/s per chip (Google Cloud TPU v5e documentation).
- TPUv5p: 2 TensorCores × 4 MXUs of 128×128 at 1,750 MHz → 459 TFLOP/s; 95 GiB HBM2e at
  2,765 GB/s; 6 ICI links, 4,800 Gbit/s per chip (Google Cloud TPU v5p documentation).
- A100 SXM4 80GB: 108 SMs × 4 tensor cores of 256 FMA/cycle (16×16) at 1,410 MHz → 312
  TFLOP/s bf16 dense; 108 × 64 FP32 lanes → 19.5 TFLOP/s; 2,039 GB/s; 40 MiB L2 + 108 ×
  192 KiB L1/shared; NVLink3: 12 links × 25 GB/s per direction (NVIDIA A100 whitepaper).
- H100 SXM5: 132 SMs × 4 tensor cores of 512 FMA/cycle (16×32) at 1,830 MHz → 989.4 TFLOP/s
  bf16 dense; 132 × 128 FP32 lanes at 1,980 MHz → 66.9 TFLOP/s; 3,350 GB/s; 50 MiB L2 + 132 ×
  228 KiB shared; NVLink4: 18 links × 25 GB/s per direction (NVIDIA H100 whitepaper).

TPU on-chip memory other than v4's CMEM is not published: v5e/v5p carry v4's 128 MiB, marked
so in their descriptions.

Example:
    >>> round(CHIPS["tpuv4"].peak_flops() / 1e12, 1)
    275.3
    >>> round(CHIPS["h100"].peak_flops() / 1e12, 1), round(CHIPS["h100"].vector_flops() / 1e12, 1)
    (989.4, 66.9)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["CHIPS", "Chip", "get_chip"]

KiB, MiB, GiB = 2**10, 2**20, 2**30
GBPS = 1e9            # bytes per second
GBIT = 1e9 / 8        # a gigabit per second, in bytes per second


@dataclass(frozen=True)
class Chip:
    """One accelerator chip.

    Attributes:
        name: registry name.
        tensor_cores: systolic arrays (N).
        array_rows, array_cols: processing elements per array (W × D); a weight-stationary
            array holds a ``rows × cols`` tile of the weight (reduction × output columns).
        vector_cores, vector_lanes: vector units (M) and the FP32 lanes of each (an FMA
            per lane per cycle).
        sram_bytes: on-chip memory a kernel tiles into (buffer, CMEM, L2 and shared memory).
        hbm_bytes, hbm_bandwidth: device memory and its bandwidth (bytes/s).
        clock_hz: the arrays' clock; ``vector_clock_hz`` the vector units' (None: the same).
        links, link_bandwidth: chip-to-chip links and each one's bandwidth per direction
            (bytes/s); ``link_latency_s`` per message; ``topology``: "torus3d", "torus2d",
            "ring" or "switch" (every pair one hop, as NVSwitch).
        dataflow: "weight-stationary" (TPU MXU) or "output-stationary".
        sram_bank_bytes, sram_port_bytes: the on-chip memory is banks of this size, each
            reading or writing ``sram_port_bytes`` per cycle (``sram_bandwidth``): a compiled
            SRAM macro of 1,024 words of 256 bits, one access per cycle, an assumption (the
            vendors do not publish their banking), so that more SRAM feeds more arrays.
        description: where the numbers come from.
    """

    name: str
    tensor_cores: int
    array_rows: int
    array_cols: int
    vector_cores: int
    vector_lanes: int
    sram_bytes: int
    hbm_bytes: int
    hbm_bandwidth: float
    clock_hz: float
    links: int
    link_bandwidth: float
    vector_clock_hz: float | None = None
    link_latency_s: float = 1e-6
    topology: str = "torus3d"
    dataflow: str = "weight-stationary"
    sram_bank_bytes: int = 32 * KiB
    sram_port_bytes: int = 32
    description: str = ""

    def __post_init__(self) -> None:
        for f in ("tensor_cores", "array_rows", "array_cols", "vector_cores", "vector_lanes",
                  "sram_bytes", "hbm_bytes", "hbm_bandwidth", "clock_hz", "links",
                  "link_bandwidth"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Chip {self.name!r}: {f} must be > 0")
        if self.dataflow not in ("weight-stationary", "output-stationary"):
            raise ValueError(f"Chip {self.name!r}: dataflow {self.dataflow!r}")
        if self.topology not in ("torus3d", "torus2d", "ring", "switch"):
            raise ValueError(f"Chip {self.name!r}: topology {self.topology!r}")

    @property
    def pes(self) -> int:
        """Processing elements (multiply-accumulators) of all the arrays."""
        return self.tensor_cores * self.array_rows * self.array_cols

    def peak_flops(self) -> float:
        """The arrays' peak: 2 FLOPs per processing element per cycle (16-bit inputs)."""
        return 2.0 * self.pes * self.clock_hz

    def vector_flops(self) -> float:
        """The vector units' FP32 peak: an FMA per lane per cycle."""
        return 2.0 * self.vector_cores * self.vector_lanes * (self.vector_clock_hz
                                                              or self.clock_hz)

    @property
    def sram_bandwidth(self) -> float:
        """Bytes/s the on-chip memory moves to and from the arrays, all banks at once."""
        banks = max(1, self.sram_bytes // self.sram_bank_bytes)
        return banks * self.sram_port_bytes * self.clock_hz

    @property
    def injection_bandwidth(self) -> float:
        """Bytes/s a chip sends over all its links at once (one direction)."""
        return self.links * self.link_bandwidth

    def replace(self, **changes) -> Chip:
        return dataclasses.replace(self, **changes)


CHIPS: dict[str, Chip] = {}


def _register(chip: Chip) -> None:
    CHIPS[chip.name] = chip


# NOTE: a TPU TensorCore's vector unit: 8 sublanes × 128 lanes of FP32 (Jouppi et al.
# ISCA'23, TPUv4 "VPU"); per chip the cores' units together.
_register(Chip(
    name="tpuv4", tensor_cores=8, array_rows=128, array_cols=128, vector_cores=2,
    vector_lanes=1024, sram_bytes=128 * MiB, hbm_bytes=32 * GiB, hbm_bandwidth=1200 * GBPS,
    clock_hz=1.05e9, links=6, link_bandwidth=2400 * GBIT / 6, topology="torus3d",
    description="Google TPU v4 (ISCA'23; Cloud TPU docs): 275 TFLOP/s bf16"))
_register(Chip(
    name="tpuv5e", tensor_cores=4, array_rows=128, array_cols=128, vector_cores=1,
    vector_lanes=1024, sram_bytes=128 * MiB, hbm_bytes=16 * GiB, hbm_bandwidth=819 * GBPS,
    clock_hz=1.5e9, links=4, link_bandwidth=1600 * GBIT / 4, topology="torus2d",
    description="Google TPU v5e (Cloud TPU docs): 197 TFLOP/s bf16; on-chip memory not "
                "published (v4's 128 MiB assumed)"))
_register(Chip(
    name="tpuv5p", tensor_cores=8, array_rows=128, array_cols=128, vector_cores=2,
    vector_lanes=1024, sram_bytes=128 * MiB, hbm_bytes=95 * GiB, hbm_bandwidth=2765 * GBPS,
    clock_hz=1.75e9, links=6, link_bandwidth=4800 * GBIT / 6, topology="torus3d",
    description="Google TPU v5p (Cloud TPU docs): 459 TFLOP/s bf16; on-chip memory not "
                "published (v4's 128 MiB assumed)"))
_register(Chip(
    name="a100", tensor_cores=432, array_rows=16, array_cols=16, vector_cores=108,
    vector_lanes=64, sram_bytes=40 * MiB + 108 * 192 * KiB, hbm_bytes=80 * GiB,
    hbm_bandwidth=2039 * GBPS, clock_hz=1.41e9, links=12, link_bandwidth=25 * GBPS,
    topology="switch", dataflow="output-stationary",
    description="NVIDIA A100 SXM4 80GB (A100 whitepaper): 312 TFLOP/s bf16 dense"))
_register(Chip(
    name="h100", tensor_cores=528, array_rows=16, array_cols=32, vector_cores=132,
    vector_lanes=128, sram_bytes=50 * MiB + 132 * 228 * KiB, hbm_bytes=80 * GiB,
    hbm_bandwidth=3350 * GBPS, clock_hz=1.83e9, vector_clock_hz=1.98e9, links=18,
    link_bandwidth=25 * GBPS, topology="switch", dataflow="output-stationary",
    description="NVIDIA H100 SXM5 (H100 whitepaper): 989.4 TFLOP/s bf16 dense at 1.83 GHz, "
                "66.9 TFLOP/s FP32 at 1.98 GHz"))


def get_chip(name: str) -> Chip:
    key = name.lower()
    if key not in CHIPS:
        raise KeyError(f"unknown chip {name!r}: one of {sorted(CHIPS)}")
    return CHIPS[key]
