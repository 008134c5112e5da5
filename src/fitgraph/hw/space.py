"""The architecture space the co-search walks: Phaze's axes (tensor cores of W×D processing
elements, vector cores, one on-chip buffer) and what Phaze leaves out (HBM bandwidth, the
chip-to-chip links), every configuration kept that fits an area budget.

Phaze's ranges: array sides 2–256, up to 4,096 tensor and vector cores, a 2–128 MB buffer; 29,360
configurations within a TPUv4-like area. Here each axis takes powers of two (sides 2–256 apart
for rows and columns; 1–4,096 cores; 2–128 MiB) and HBM bandwidth and links a few published
points; the clock, HBM capacity and vector lanes are the baseline's (TPUv4: 1,050 MHz, 32 GiB,
128-lane vector cores). ``configurations(space, budget)`` yields them, cheapest area first
within each array shape.

Example:
    >>> from fitgraph.hw.area import area_budget
    >>> space = Space(sram_mib=(32, 128), hbm_bandwidth=(1.2e12,), links=((6, 50e9),))
    >>> chips = list(configurations(space, area_budget("tpuv4")))
    >>> len(chips) > 100, all(c.hbm_bandwidth == 1.2e12 for c in chips)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .chip import Chip, GiB, MiB, get_chip

__all__ = ["SPACES", "Space", "configurations"]

_POW2 = tuple(2 ** i for i in range(13))          # 1 .. 4096


@dataclass(frozen=True)
class Space:
    """The axes of the search; ``base`` supplies what they do not vary."""

    array_sides: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256)
    tensor_cores: tuple[int, ...] = _POW2
    vector_cores: tuple[int, ...] = _POW2
    vector_lanes: int = 128
    sram_mib: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128)
    # NOTE: HBM2 (TPUv4 1.2 TB/s), HBM2e (A100 2.0 TB/s), HBM3 (H100 3.35 TB/s)
    hbm_bandwidth: tuple[float, ...] = (1.2e12, 2.0e12, 3.35e12)
    # NOTE: (links, bytes/s each way per link): TPUv4's 6 x 50 GB/s ICI and a doubled one
    links: tuple[tuple[int, float], ...] = ((6, 50e9), (6, 100e9))
    base: str = "tpuv4"
    # NOTE: HBM capacity costs no die area here (it sits in the stacks): a search takes one,
    # as Phaze sweeps its 32/64/80 GB outside the search (None: the base chip's)
    hbm_gib: int | None = None
    # NOTE: Phaze keeps a configuration of at least 30% of the budget's area unless it has one
    # tensor or one vector core (its architecture.py): a chip far under budget is not a
    # candidate to build when more of the same fits
    min_area_fraction: float = 0.3

    def size(self) -> int:
        """Configurations before the area budget."""
        return (len(self.array_sides) ** 2 * len(self.tensor_cores) * len(self.vector_cores)
                * len(self.sram_mib) * len(self.hbm_bandwidth) * len(self.links))


SPACES = {
    "phaze": Space(),
    # NOTE: a quick look (about a hundred configurations): TPU-like arrays and buffers only
    "small": Space(array_sides=(64, 128, 256), tensor_cores=(2, 4, 8, 16, 32),
                   vector_cores=(1, 2, 8), sram_mib=(32, 128), hbm_bandwidth=(1.2e12, 3.35e12),
                   links=((6, 50e9),)),
}


def configurations(space: Space, budget_mm2: float,
                   area_of: Callable[[Chip], float] | None = None) -> Iterator[Chip]:
    """Every configuration of ``space`` whose area is within ``budget_mm2``."""
    if area_of is None:
        from .area import chip_area

        def area_of(chip: Chip) -> float:
            return chip_area(chip).total

    base = get_chip(space.base)
    for rows in space.array_sides:
        for cols in space.array_sides:
            for n in space.tensor_cores:
                for m in space.vector_cores:
                    for sram in space.sram_mib:
                        for bw in space.hbm_bandwidth:
                            for links, link_bw in space.links:
                                chip = base.replace(
                                    name=f"{n}x{rows}x{cols}-v{m}-{sram}MiB-"
                                         f"{bw / 1e12:g}TBs-{links}x{link_bw / 1e9:g}GBs",
                                    tensor_cores=n, array_rows=rows, array_cols=cols,
                                    vector_cores=m, vector_lanes=space.vector_lanes,
                                    sram_bytes=sram * MiB, hbm_bandwidth=bw, links=links,
                                    hbm_bytes=(space.hbm_gib * GiB if space.hbm_gib
                                               else base.hbm_bytes),
                                    link_bandwidth=link_bw, description="searched")
                                area = area_of(chip)
                                floor = (0.0 if n == 1 or m == 1
                                         else space.min_area_fraction * budget_mm2)
                                if floor <= area <= budget_mm2:
                                    yield chip
