"""The area and power model of a chip (fitgraph.hw.area): constants as documented, a chip
computed by hand, more of any part never less area, the TPUv4-like budget, and each preset's
area against its published die."""

from __future__ import annotations

import math

import pytest

from fitgraph.hw import area as A
from fitgraph.hw.area import TPUV4_LIKE, area_budget, chip_area, chip_power
from fitgraph.hw.chip import CHIPS, Chip

MiB = 2**20


def _toy(**kw) -> Chip:
    base = dict(name="toy", tensor_cores=2, array_rows=10, array_cols=20, vector_cores=1,
                vector_lanes=100, sram_bytes=4 * MiB, hbm_bytes=1 << 30,
                hbm_bandwidth=2 * A.HBM_STACK_BANDWIDTH, clock_hz=1e9, links=3,
                link_bandwidth=A.LINK_REF_BANDWIDTH)
    return Chip(**{**base, **kw})


def test_constants_are_the_documented_ones():
    assert round(A.PE_MM2 * 1e6, 1) == 263.2               # µm² per bf16 PE
    assert round(A.VECTOR_LANE_MM2 * 1e6) == 1392          # µm² per FP32 lane
    assert round(A.SRAM_MM2_PER_MIB, 3) == 0.675
    assert A.HBM_STACK_BANDWIDTH == 409.6e9
    assert round(A.OTHER_SHARE, 3) == 0.180
    assert round(A.MAC_PJ, 3) == 0.311 and round(A.FMA32_PJ, 3) == 0.716


def test_a_chip_computed_by_hand():
    a = chip_area(_toy())
    parts = (400 * A.PE_MM2 + 100 * A.VECTOR_LANE_MM2 + 4 * A.SRAM_MM2_PER_MIB
             + 2 * A.HBM_PHY_MM2_PER_STACK + 3 * A.LINK_PHY_MM2)
    assert a.arrays == pytest.approx(400 * A.PE_MM2, rel=1e-12)
    assert a.vector == pytest.approx(100 * A.VECTOR_LANE_MM2, rel=1e-12)
    assert a.sram == pytest.approx(4 * A.SRAM_MM2_PER_MIB, rel=1e-12)
    assert a.hbm_phy == pytest.approx(2 * A.HBM_PHY_MM2_PER_STACK, rel=1e-12)
    assert a.links == pytest.approx(3 * A.LINK_PHY_MM2, rel=1e-12)
    assert a.other == pytest.approx(parts * A.OTHER_SHARE / (1 - A.OTHER_SHARE), rel=1e-12)
    assert a.total == pytest.approx(parts / (1 - A.OTHER_SHARE), rel=1e-12)
    # the same in numbers: 0.105271 + 0.139221 + 2.699719 + 20.9 + 5.664 = 29.508210 mm² of parts
    assert a.total == pytest.approx(29.508210 / (1 - 0.180146), rel=1e-5)


def test_power_computed_by_hand():
    chip = _toy()
    dynamic_pj = (A.MAC_PJ * 400 * 1e9 + A.FMA32_PJ * 100 * 1e9
                  + A.SRAM_PJ_PER_BIT * 2 * (16 * 10 + 32 * 20) * 1e9
                  + A.HBM_PJ_PER_BIT * 8 * 2 * A.HBM_STACK_BANDWIDTH
                  + A.LINK_PJ_PER_BIT * 8 * 2 * 3 * A.LINK_REF_BANDWIDTH)
    expected = dynamic_pj * 1e-12 + A.STATIC_W_PER_MM2 * chip_area(chip).total
    assert chip_power(chip) == pytest.approx(expected, rel=1e-12)


GROW = {
    "more arrays": lambda c: c.replace(tensor_cores=c.tensor_cores + 1),
    "taller arrays": lambda c: c.replace(array_rows=2 * c.array_rows),
    "wider arrays": lambda c: c.replace(array_cols=2 * c.array_cols),
    "more sram": lambda c: c.replace(sram_bytes=2 * c.sram_bytes),
    "more hbm bandwidth": lambda c: c.replace(hbm_bandwidth=2 * c.hbm_bandwidth),
    "more links": lambda c: c.replace(links=c.links + 1),
    "faster links": lambda c: c.replace(link_bandwidth=2 * c.link_bandwidth),
    "more vector lanes": lambda c: c.replace(vector_lanes=2 * c.vector_lanes),
}
BASES = [*CHIPS.values(), TPUV4_LIKE, _toy()]


@pytest.mark.parametrize("grow", list(GROW), ids=list(GROW))
@pytest.mark.parametrize("base", BASES, ids=[c.name for c in BASES])
def test_more_of_any_part_never_less_area(base, grow):
    bigger = GROW[grow](base)
    assert chip_area(bigger).total >= chip_area(base).total
    for name in ("arrays", "vector", "sram", "hbm_phy", "links", "other"):
        assert getattr(chip_area(bigger), name) >= getattr(chip_area(base), name)


@pytest.mark.parametrize("base", BASES, ids=[c.name for c in BASES])
def test_more_arrays_never_less_power(base):
    for n in (1, 2, 8):
        assert chip_power(base.replace(tensor_cores=base.tensor_cores + n)) >= chip_power(base)


@pytest.mark.parametrize("base", BASES, ids=[c.name for c in BASES])
def test_hbm_capacity_costs_no_die_area(base):
    assert chip_area(base.replace(hbm_bytes=4 * base.hbm_bytes)) == chip_area(base)


def test_the_tpuv4_like_budget():
    assert (TPUV4_LIKE.tensor_cores, TPUV4_LIKE.array_rows, TPUV4_LIKE.array_cols,
            TPUV4_LIKE.sram_bytes) == (8, 128, 128, 128 * MiB)
    assert TPUV4_LIKE.replace(name="tpuv4") == CHIPS["tpuv4"]
    assert area_budget("tpuv4") == chip_area(TPUV4_LIKE).total
    assert area_budget("TPUv4") == area_budget("tpuv4")
    assert area_budget("600") == 600.0
    assert area_budget(600) == 600.0 and area_budget(612.5) == 612.5


@pytest.mark.parametrize("bad", ["tpuv9", "", "600mm", "-5", "0", "nan", "inf", -1.0, 0,
                                 math.inf, None, True, [600]])
def test_a_bad_budget_is_a_value_error(bad):
    with pytest.raises(ValueError, match="area budget"):
        area_budget(bad)


# Published die areas. TPUv4: no published die size was found (Google's TPUv4 papers and Cloud
# docs searched; TPUv4i, a different chip, is <400 mm²), so it is not compared. TPUv5e/v5p:
# none published.
DIE_MM2 = {
    "a100": 826.0,  # NVIDIA A100 Tensor Core GPU Architecture whitepaper (GA100, TSMC N7)
    "h100": 814.0,  # NVIDIA H100 Tensor Core GPU Architecture whitepaper (GH100, TSMC 4N)
}
# NOTE: both GPUs come out under half their die (A100 0.23×, H100 0.40×): the template has no
# field for an SM's register files, schedulers, FP64/INT32 units or the L2's tags and crossbars,
# and the PE constant is logic only. Reported, not tuned away: strict xfails, so a change of
# constants that brings a preset within a factor 2 shows up here.
OUTSIDE_FACTOR_2 = {"a100", "h100"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="modelled area < die / 2"))
    if n in OUTSIDE_FACTOR_2 else n for n in DIE_MM2])
def test_each_preset_within_a_factor_2_of_its_die(name):
    ratio = chip_area(CHIPS[name]).total / DIE_MM2[name]
    assert 0.5 <= ratio <= 2.0, f"{name}: modelled / published die = {ratio:.2f}"


def test_the_gpus_known_gap_is_what_the_docstring_says():
    assert round(chip_area(CHIPS["a100"]).total / DIE_MM2["a100"], 2) == 0.23
    assert round(chip_area(CHIPS["h100"]).total / DIE_MM2["h100"], 2) == 0.40
