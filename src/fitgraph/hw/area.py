"""Area (mm²) and peak power (W) of a ``Chip``, for keeping co-searched architectures under an
area budget and ranking them by throughput per mm² and per W (no torch).

As Phaze (ICML'24) takes per-component area and energy from Accelergy tables, every component
here costs a constant set once, for one process node (TSMC N7, TPUv4's and A100's), from a
published figure named in its ``NOTE`` with the arithmetic; nothing is fitted to a preset:

- arrays: one bf16 multiply-accumulate processing element (PE) per ``array_rows × array_cols``
  cell of each of the ``tensor_cores`` arrays;
- vector: one FP32 FMA unit per lane;
- sram: the on-chip buffer, per MiB (a real buffer's density, banking and wiring included);
- hbm_phy: the HBM PHYs, as many 1024-bit HBM2E interfaces as the bandwidth needs (capacity
  costs no die area: it sits in the stacks);
- links: SerDes PHY area in proportion to each link's bandwidth;
- other: control, on-chip network, memory controllers, I/O: a fixed share of the die.

Every chip is modelled at N7 whatever its real node (the H100 is TSMC 4N), so a preset's
estimate is not its die; the model leaves out what the template has no field for (a GPU's
register files, schedulers, FP64/INT32 units, L2 tags and crossbars), so it underestimates GPUs
most. What it gives for the presets, against their published dies and TDPs:

=========  ===========  ==================  ==========  ======================
preset     model (mm²)  published die       model (W)   published power
=========  ===========  ==================  ==========  ======================
tpuv4      216          not published [1]   112         192 max, 170 mean [2]
tpuv5e     172          not published       80          not published
tpuv5p     292          not published       205         not published
a100       188          826 [3] (0.23×)     166         400 TDP (SXM4) [3]
h100       327          814 [4] (0.40×)     384         700 TDP (SXM5) [4]
=========  ===========  ==================  ==========  ======================

[1] no TPUv4 die size was found in the sources searched (TPUv4i, a different chip, is
<400 mm² per Jouppi et al. ISCA'21). [2] Google Cloud TPU v4 documentation: measured
min/mean/max power 90/170/192 W. [3] NVIDIA A100 whitepaper (826 mm², TSMC N7). [4] NVIDIA H100
whitepaper (814 mm², TSMC 4N).

Example:
    >>> from fitgraph.hw.chip import CHIPS
    >>> for name in ("tpuv4", "tpuv5e", "tpuv5p", "a100", "h100"):
    ...     chip = CHIPS[name]
    ...     print(f"{name:6s} {chip_area(chip).total:4.0f} mm2 {chip_power(chip):4.0f} W")
    tpuv4   216 mm2  112 W
    tpuv5e  172 mm2   80 W
    tpuv5p  292 mm2  205 W
    a100    188 mm2  166 W
    h100    327 mm2  384 W
    >>> a = chip_area(TPUV4_LIKE)
    >>> round(a.arrays, 1), round(a.sram, 1), round(a.total, 1)
    (34.5, 86.4, 215.9)
    >>> area_budget("tpuv4") == a.total, area_budget("600")
    (True, 600.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .chip import CHIPS, Chip

__all__ = ["TPUV4_LIKE", "Area", "area_budget", "chip_area", "chip_power"]

_MIB = 2**20

# --- area constants (TSMC N7) -----------------------------------------------------------------

# NOTE: N7 logic density 96.3 Mtransistors/mm² (Khan & Mann, "AI Chips", CSET 2020, as used by
# LLMCompass, Zhang et al. ISCA'24, cost_model/supply_chain).
_LOGIC_MTR_PER_MM2 = 96.3
# NOTE: a 64-bit FPU is 685,300 transistors (Ariane / OpenPiton), and a narrower FPU scales with
# its mantissa squared (LLMCompass ISCA'24, cost_model.py, which validates its A100 SM area on
# the GA100 die shot). A 16-bit (10-bit mantissa) FMA PE: 685,300 × (10/52)² = 25,344
# transistors / 96.3e6 per mm² = 263.2 µm². Cross-check: TPUv1's MXU is 24% of a ≤331 mm² 28 nm
# die for 65,536 int8 MACs (Jouppi et al. ISCA'17) = 1,212 µm², × 15.3/96.3 (CSET 28 nm → N7
# density) = 193 µm² per int8 PE, the same order. Logic only (no pipeline registers): likely low.
PE_MM2 = 685_300 * (10 / 52) ** 2 / (_LOGIC_MTR_PER_MM2 * 1e6)
# NOTE: an FP32 FMA lane: 685,300 × (23/52)² = 134,069 transistors / 96.3e6 = 1,392 µm²
# (LLMCompass ISCA'24's FP32 FPU); a lane's register file and control are in ``other``.
VECTOR_LANE_MM2 = 685_300 * (23 / 52) ** 2 / (_LOGIC_MTR_PER_MM2 * 1e6)
# NOTE: TSMC N7's high-density bit cell is 0.027 µm² (Chang et al., ISSCC'17, "A 7nm 256Mb
# SRAM"); a chip's buffer holds its bits at a lower array efficiency: TPUv1's 24 MiB Unified
# Buffer is 29% of a ≤331 mm² die (Jouppi et al. ISCA'17) in TSMC 28 nm, whose 6T cell is
# 0.16 µm² (Chipworks, TSMC 28HP), so efficiency = 24 × 2^23 bits × 0.16 µm² / (0.29 × 331 mm²)
# = 0.336, and at N7: 2^23 bits × 0.027 µm² / 0.336 = 0.675 mm² per MiB (a CACTI-style macro
# alone is ~0.43 mm²/MiB; GA100's L2, tags included, 2.49 mm²/MiB on its die shot).
SRAM_MM2_PER_MIB = 2**23 * 0.027e-6 * (0.29 * 331) / (24 * 2**23 * 0.16e-6)
# NOTE: one 1024-bit HBM2E PHY is 10.45 mm² (LLMCompass ISCA'24, from die shots; PHYs do not
# shrink with the node); it carries 1024 pins × 3.2 Gbit/s / 8 = 409.6 GB/s (JEDEC HBM2E).
HBM_PHY_MM2_PER_STACK = 10.45
HBM_STACK_BANDWIDTH = 1024 * 3.2e9 / 8
# NOTE: one NVLink3 link's PHY (4 lanes × 50 Gbit/s, 25 GB/s per direction) is 1.888 mm²
# (LLMCompass ISCA'24); a link costs its SerDes lanes, in proportion to its bandwidth.
LINK_PHY_MM2 = 1.888
LINK_REF_BANDWIDTH = 25e9
# NOTE: GA100's die shot (LLMCompass ISCA'24, Fig. 6 data: cores 476.25, on-chip interconnect
# 76.44, L2 119.31, HBM PHY 58, memory controllers 31.77, NVLink PHY 20.95, other 40 mm²): what
# the template has no part for (interconnect + controllers + other) is 148.21 / 822.72 = 18.0%.
OTHER_SHARE = (76.44 + 31.77 + 40.0) / (476.25 + 76.44 + 119.31 + 58.0 + 31.77 + 20.95 + 40.0)

# --- energy constants -------------------------------------------------------------------------

# NOTE: 45 nm energies (Horowitz, ISSCC'14 "Computing's energy problem"): 16-bit FP multiply
# 1.1 pJ, 32-bit FP add 0.9 pJ, 32-bit FP multiply 3.7 pJ, a 64-bit read of a 32 KB SRAM 20 pJ;
# to N7 at first order by the feature size (C ∝ L, V about the same): × 7/45. Assumption: the
# scaling is ours, not a published 7 nm table.
_TO_N7 = 7 / 45
# NOTE: a bf16 MAC (bf16 multiply ≤ FP16 multiply, FP32 accumulate): (1.1 + 0.9) × 7/45 pJ.
MAC_PJ = (1.1 + 0.9) * _TO_N7
# NOTE: an FP32 FMA: (3.7 + 0.9) × 7/45 pJ.
FMA32_PJ = (3.7 + 0.9) * _TO_N7
# NOTE: SRAM, per bit: 20 pJ / 64 bits × 7/45. Assumption: per array and cycle, one 16-bit
# operand is read per PE row and one 32-bit result written per PE column (stationary weights'
# reloads are amortised and left out).
SRAM_PJ_PER_BIT = 20.0 / 64 * _TO_N7
# NOTE: HBM2, ~3.9 pJ per bit moved, DRAM core and I/O (O'Connor et al., MICRO'17, "Fine-Grained
# DRAM"); a chip's TDP includes its HBM, so the stacks' energy is counted.
HBM_PJ_PER_BIT = 3.9
# NOTE: NVIDIA's ground-referenced 25 Gbit/s link, 1.17 pJ/bit (Wilson et al., JSSC 2019); every
# link sends its bandwidth in both directions. Long-reach board SerDes cost several times more.
LINK_PJ_PER_BIT = 1.17
# NOTE: static (leakage, clock tree) power per mm² of die. Assumption, NOT sourced: an order of
# magnitude for N7 at ~0.75 V; no published per-mm² figure was found.
STATIC_W_PER_MM2 = 0.1


@dataclass(frozen=True)
class Area:
    """A chip's area by component, in mm²."""

    arrays: float
    vector: float
    sram: float
    hbm_phy: float
    links: float
    other: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def chip_area(chip: Chip) -> Area:
    """The die area of ``chip``'s parts at N7; ``other`` makes ``OTHER_SHARE`` of the total."""
    arrays = chip.pes * PE_MM2
    vector = chip.vector_cores * chip.vector_lanes * VECTOR_LANE_MM2
    sram = chip.sram_bytes / _MIB * SRAM_MM2_PER_MIB
    hbm_phy = chip.hbm_bandwidth / HBM_STACK_BANDWIDTH * HBM_PHY_MM2_PER_STACK
    links = chip.links * chip.link_bandwidth / LINK_REF_BANDWIDTH * LINK_PHY_MM2
    parts = arrays + vector + sram + hbm_phy + links
    return Area(arrays=arrays, vector=vector, sram=sram, hbm_phy=hbm_phy, links=links,
                other=parts * OTHER_SHARE / (1.0 - OTHER_SHARE))


def chip_power(chip: Chip) -> float:
    """Peak power in W: every unit busy every cycle, HBM and links at full bandwidth, plus
    static power in proportion to the area."""
    vector_hz = chip.vector_clock_hz or chip.clock_hz
    sram_bits = chip.tensor_cores * (16 * chip.array_rows + 32 * chip.array_cols) * chip.clock_hz
    picojoules_per_s = (MAC_PJ * chip.pes * chip.clock_hz
                        + FMA32_PJ * chip.vector_cores * chip.vector_lanes * vector_hz
                        + SRAM_PJ_PER_BIT * sram_bits
                        + HBM_PJ_PER_BIT * 8 * chip.hbm_bandwidth
                        + LINK_PJ_PER_BIT * 8 * 2 * chip.injection_bandwidth)
    return picojoules_per_s * 1e-12 + STATIC_W_PER_MM2 * chip_area(chip).total


# The budget reference: a "TPUv4-like" chip, eight 128×128 arrays and 128 MiB of SRAM.
TPUV4_LIKE: Chip = CHIPS["tpuv4"].replace(name="tpuv4-like", tensor_cores=8, array_rows=128,
                                          array_cols=128, sram_bytes=128 * _MIB)


def area_budget(spec: str | float) -> float:
    """An area budget in mm²: ``"tpuv4"`` (the area of ``TPUV4_LIKE``) or a positive number of
    mm², given as a number or a string such as ``"600"``."""
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key in ("tpuv4", "tpuv4-like"):
            return chip_area(TPUV4_LIKE).total
        try:
            value = float(key)
        except ValueError:
            value = math.nan
    elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
        value = float(spec)
    else:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"area budget {spec!r}: give 'tpuv4' or a positive number of mm² "
                         "(e.g. 600 or '600')")
    return value
