"""The accelerator template's peaks are the datasheets' and its GEMM model behaves (issue 29):
hand-computed cycle counts, more arrays never slower, more SRAM never more HBM traffic, the
cache the same as a fresh evaluation."""

from __future__ import annotations

import pytest

from fitgraph.hw.chip import CHIPS, Chip, get_chip
from fitgraph.hw.gemm import _blocks, _timing, gemm_seconds, gemm_timing, vector_seconds


@pytest.mark.parametrize("name,tflops", [("tpuv4", 275), ("tpuv5e", 197), ("tpuv5p", 459),
                                         ("a100", 312), ("h100", 989.4)])
def test_each_presets_peak_is_its_datasheets(name, tflops):
    digits = 1 if tflops % 1 else 0
    assert round(get_chip(name).peak_flops() / 1e12, digits) == tflops


def test_vector_peaks_are_the_datasheets():
    assert round(CHIPS["a100"].vector_flops() / 1e12, 1) == 19.5
    assert round(CHIPS["h100"].vector_flops() / 1e12, 1) == 66.9


def _toy(**kw) -> Chip:
    base = dict(name="toy", tensor_cores=1, array_rows=4, array_cols=4, vector_cores=1,
                vector_lanes=8, sram_bytes=1 << 20, hbm_bytes=1 << 30, hbm_bandwidth=1e15,
                clock_hz=1e9, links=1, link_bandwidth=1e9)
    return Chip(**{**base, **kw})


def test_a_weight_stationary_gemm_by_hand():
    # K=8, N=8 on a 4x4 array: 2 x 2 weight tiles, each M + 4 + 4 cycles; 2 arrays: 2 rounds
    chip = _toy(tensor_cores=2)
    g = gemm_timing(chip, 16, 8, 8)
    assert g.compute_s == pytest.approx(2 * (16 + 8) / 1e9)
    assert g.seconds == g.compute_s                 # HBM far faster here
    assert g.utilization == pytest.approx(2 * 16 * 8 * 8 / (g.seconds * 2 * 2 * 16 * 1e9))


def test_an_output_stationary_gemm_by_hand():
    # M=8, N=12 on a 4x4 array: 2 x 3 output tiles, each K + 8 cycles, one array
    chip = _toy(dataflow="output-stationary")
    assert gemm_timing(chip, 8, 12, 5).compute_s == pytest.approx(6 * (5 + 8) / 1e9)


def test_hbm_traffic_by_hand_and_a_bandwidth_bound_gemm():
    # the whole of C fits: A and B read once, C written once
    chip = _toy(hbm_bandwidth=1e6)
    g = gemm_timing(chip, 16, 8, 8)
    moved = 2 * (16 * 8 + 8 * 8 + 16 * 8)
    assert g.hbm_bytes == moved and g.block == (16, 8)
    assert g.seconds == pytest.approx(moved / 1e6)
    # an SRAM that holds C's block of 4 x 8 only: A read once, B four times
    small = _toy(hbm_bandwidth=1e6, sram_bytes=4 * 8 * 4 + 2 * 2 * 4 * (4 + 8))
    g = gemm_timing(small, 16, 8, 8)
    assert g.block == (4, 8)
    assert g.hbm_bytes == 2 * (16 * 8 + 4 * 8 * 8 + 16 * 8)


@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (8192, 1024, 2048), (512, 3072, 768)])
def test_more_arrays_are_never_slower(shape):
    base = CHIPS["tpuv4"]
    times = [gemm_seconds(base.replace(tensor_cores=n), *shape) for n in (1, 2, 3, 4, 8, 16)]
    assert all(b <= a for a, b in zip(times, times[1:]))
    # compute-bound: twice the arrays, about half the time
    assert times[1] == pytest.approx(times[0] / 2, rel=0.02)


def test_more_sram_never_moves_more_and_square_gemms_near_peak():
    sizes = [2 << 20, 8 << 20, 32 << 20, 128 << 20]
    moved = [gemm_timing(CHIPS["tpuv4"].replace(sram_bytes=s), 8192, 8192, 8192).hbm_bytes
             for s in sizes]
    assert all(b <= a for a, b in zip(moved, moved[1:]))
    assert gemm_timing(CHIPS["tpuv4"], 8192, 8192, 8192).utilization > 0.95


def test_the_cache_returns_what_a_fresh_evaluation_returns():
    chip = CHIPS["h100"]
    first = gemm_timing(chip, 3000, 5000, 700, batch=3)
    _timing.cache_clear()
    _blocks.cache_clear()
    assert gemm_timing(chip, 3000, 5000, 700, batch=3) == first


def test_vector_ops_by_lanes_or_bandwidth():
    chip = _toy(vector_lanes=8, hbm_bandwidth=1e9)
    # 1e6 elements x 10 FLOPs on 8 lanes x 2 FLOPs x 1 GHz, or 4 MB over 1 GB/s
    assert vector_seconds(chip, 1e6, 10, 4e6) == pytest.approx(4e6 / 1e9)
    assert vector_seconds(chip, 1e6, 1000, 4e6) == pytest.approx(1e9 / 16e9)


def test_a_bad_gemm_or_chip_is_refused():
    with pytest.raises(ValueError, match="every size"):
        gemm_timing(CHIPS["a100"], 0, 4, 4)
    with pytest.raises(ValueError, match="tensor_cores"):
        _toy(tensor_cores=0)
    with pytest.raises(KeyError, match="unknown chip"):
        get_chip("tpu-v9")


def test_the_sram_feed_by_hand_and_narrow_arrays_re_read_their_input():
    # 2 banks of 32 KiB, 1 byte per cycle each: 2 GB/s between the SRAM and the array
    chip = _toy(sram_bytes=64 * 1024, sram_port_bytes=1)
    g = gemm_timing(chip, 16, 8, 8)
    # weights once (8x8, bf16), the input once per column of tiles (2), the float32 partial
    # sums out after each of the 2 rows of tiles and back in once
    fed = 2 * (8 * 8 + 16 * 8 * 2) + 4 * 16 * 8 * (2 * 2 - 1)
    assert g.sram_s == pytest.approx(fed / 2e9) and g.seconds == g.sram_s
    wide = CHIPS["tpuv4"]
    narrow = wide.replace(tensor_cores=128, array_rows=32, array_cols=32)
    assert narrow.pes == wide.pes
    a, b = (gemm_timing(c, 4096, 4096, 4096) for c in (wide, narrow))
    # the input re-read per column of tiles (128 times, not 32), the partial sums per row of
    # tiles (2 x 128 - 1 passes, not 2 x 32 - 1, of float32: twice the bf16 bytes); the
    # weights once; in units of one bf16 matrix
    assert b.sram_s / a.sram_s == pytest.approx((1 + 128 + 2 * 255) / (1 + 32 + 2 * 63))


def test_this_machines_cpu_in_the_template_and_the_sweep_runs():
    from fitgraph.bench import gemm_sweep
    from fitgraph.hw.host import host_chip

    chip = host_chip(cores=2)
    assert chip.tensor_cores == 2 and chip.peak_flops() > 0
    assert chip.array_rows * chip.array_cols * 2 * chip.clock_hz == chip.peak_flops() / 2
    res = gemm_sweep.run("cpu", rounds=1, shapes=[(64, 64, 64), (128, 32, 256)])
    assert [r["m"] for r in res["rows"]] == [64, 128]
    assert all(r["measured_tflops"] > 0 and r["predicted_tflops"] > 0 for r in res["rows"])
    assert "predicted / measured" in gemm_sweep.markdown(res)
