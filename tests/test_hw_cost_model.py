"""A candidate chip as a cost model of captured graphs (issue 29): matmuls and convolutions by
their GEMM shapes on the arrays, the rest on the vector units; the multi-device planner plans a
captured model for the chip unchanged."""

from __future__ import annotations

import pytest
import torch

import fitgraph
from fitgraph.dist import Cluster
from fitgraph.dist.graph_model import GraphModel
from fitgraph.dist.planner import plan
from fitgraph.hw.chip import CHIPS
from fitgraph.hw.cost_model import ChipCostModel, node_gemms
from fitgraph.hw.device import chip_link
from fitgraph.hw.gemm import gemm_seconds


def _convs():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 8, 3, groups=2))
    return fitgraph.capture(net, torch.randn(2, 3, 8, 8), lambda m, x: m(x).sum())


def test_convolutions_are_their_im2col_gemms_by_hand():
    g = _convs()
    gemms = [(n.target.split(".")[1], node_gemms(g, n)) for n in g.nodes
             if "convolution" in n.target]
    # 3 -> 8 channels, 3x3, padding 1, on 2 x 8 x 8: M = 2*8*8, N = 8, K = 3*3*3
    assert ("convolution", [(128, 8, 27, 1)]) in gemms
    # 8 -> 8 in 2 groups, 3x3, no padding: M = 2*6*6, N = 4 per group, K = 4*3*3, 2 GEMMs
    assert ("convolution", [(72, 4, 36, 2)]) in gemms
    # its backward: the input gradient's and the weight gradient's GEMMs
    assert ("convolution_backward", [(72, 36, 4, 2), (36, 4, 72, 2)]) in gemms
    # the first layer's input needs no gradient: its weight's GEMM only
    assert ("convolution_backward", [(27, 8, 128, 1)]) in gemms


def test_gemm_nodes_take_the_gemm_model_and_the_rest_the_roofline():
    g = fitgraph.capture(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU()),
                         torch.randn(32, 64), lambda m, x: m(x).sum())
    chip = CHIPS["tpuv5e"]
    cm = ChipCostModel(chip)
    for n in g.nodes:
        gemms = node_gemms(g, n)
        if gemms:
            expect = sum(gemm_seconds(chip, m, nn, k, b, itemsize=4) for m, nn, k, b in gemms)
            assert cm.node_cost(g, n).seconds == pytest.approx(
                max(expect, cm.device.kernel_overhead_s))
        elif n.target == "aten.gelu.default":
            assert cm.node_cost(g, n).seconds == pytest.approx(
                cm.device.kernel_overhead_s + n.bytes_moved / chip.hbm_bandwidth)
    assert any(node_gemms(g, n) for n in g.nodes)


def test_the_multi_device_planner_plans_a_captured_model_for_a_chip():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU())
              for _ in range(4)]
    net = torch.nn.Sequential(*layers)
    g = fitgraph.capture(net, torch.randn(16, 128), lambda m, x: m(x).square().mean())
    chip = CHIPS["tpuv4"]
    gm = GraphModel(g, ChipCostModel(chip), batch_size=16)
    cluster = Cluster(ChipCostModel(chip).device, 4, 1, chip_link(chip), chip_link(chip))
    p = plan(gm, cluster, 64, fix={"tp": 1, "pp": 2, "dp": 2, "micro_batch": 4,
                                   "schedule": "1f1b"})
    assert p.fits and p.predicted["step_s"] > 0
