"""A candidate chip plugs into the planners unchanged (issue 29): its GEMMs timed by their
shapes on the arrays, the rest by the vector units and HBM, its links as the cluster's."""

from __future__ import annotations

import pytest

from fitgraph.dist import GptShape
from fitgraph.dist.block_cost import price_block
from fitgraph.dist.gpt_blocks import gpt_layer
from fitgraph.dist.planner import plan
from fitgraph.hw.chip import CHIPS
from fitgraph.hw.device import chip_cluster, chip_device, chip_link
from fitgraph.hw.gemm import gemm_seconds

SHAPE = GptShape(4, 1024, 16, seq=1024, vocab=32000)


def test_the_device_is_the_chips_datasheet():
    d = chip_device(CHIPS["a100"])
    assert d.memory_bytes == CHIPS["a100"].hbm_bytes
    assert d.peak("bfloat16") == CHIPS["a100"].peak_flops()
    assert d.peak("float32") == CHIPS["a100"].vector_flops()
    assert d.bandwidth == CHIPS["a100"].hbm_bandwidth


def test_a_layers_matmuls_are_timed_by_their_shapes():
    chip = CHIPS["tpuv4"]
    device = chip_device(chip)
    layer = gpt_layer(SHAPE, 1, 2)
    cost = price_block(layer, device, chip_link(chip))
    b, s, h = 2, SHAPE.seq, SHAPE.hidden
    qkv = gemm_seconds(chip, b * s, 3 * h, h)
    fc1 = gemm_seconds(chip, b * s, 4 * h, h)
    assert cost.fwd_s > qkv + fc1
    # the backward's two GEMMs per matmul: the weight gradient's is the [K, M] x [M, N] one
    assert cost.bwd_w_s == pytest.approx(sum(
        gemm_seconds(chip, k, n, m, bt) for op in layer.ops if op.bwd_w_flops
        for m, n, k, bt in op.gemms))


def test_more_arrays_make_a_layer_no_slower_and_small_arrays_lose_utilization():
    layer = gpt_layer(SHAPE, 1, 2)
    base = CHIPS["tpuv4"]
    times = [price_block(layer, chip_device(base.replace(tensor_cores=n)),
                         chip_link(base)).fwd_s for n in (2, 4, 8, 16)]
    assert all(b <= a for a, b in zip(times, times[1:]))
    # the same processing elements as 8 x 128x128, in 2 x 256x256 arrays: fewer, larger
    # tiles, each of the attention's 64-wide heads a quarter of an array
    big = base.replace(tensor_cores=2, array_rows=256, array_cols=256)
    assert big.peak_flops() == base.peak_flops()
    assert price_block(layer, chip_device(big), chip_link(big)).fwd_s > times[2]


def test_the_planner_plans_for_a_chip_cluster():
    cluster = chip_cluster(CHIPS["tpuv5e"], 8)
    assert cluster.devices == 8 and cluster.intra.bandwidth == 2 * CHIPS["tpuv5e"].link_bandwidth
    p = plan(SHAPE, cluster, 16, fix={"tp": 2, "pp": 2, "dp": 2, "micro_batch": 1,
                                      "schedule": "1f1b"})
    assert p.fits and p.predicted["tokens_per_s"] > 0
    # a switched chip talks over all its links
    assert chip_link(CHIPS["h100"]).bandwidth == 18 * CHIPS["h100"].link_bandwidth
