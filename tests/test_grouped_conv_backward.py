"""A grouped (depthwise) convolution's backward runs in parts along its channels, by whole
groups: each group is an independent convolution, so the parts' input, weight and bias
gradients are exactly eager's, and the kernel's workspace (SegFormer's depthwise 3x3 backward:
4.5 MiB on the CPU, its least peak's largest item) is taken a part at a time."""

from __future__ import annotations

import pytest
import torch
from test_fission import assert_same_as_eager, assert_simulator_tells_truth

import fitgraph
from fitgraph.graph.dim_region import node_region
from fitgraph.transform.fission import split_region


def _loss(m, x):
    return m(x).square().mean()


@pytest.mark.parametrize("groups, multiplier, bias", [(8, 1, True), (2, 2, False), (4, 2, True)])
def test_grouped_convolution_backward_splits_by_whole_groups(groups, multiplier, bias):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 1), torch.nn.GELU(),
        torch.nn.Conv2d(8, 8 * multiplier, 3, padding=1, groups=groups, bias=bias),
        torch.nn.GELU())
    batch = torch.randn(2, 3, 6, 6)
    g = fitgraph.capture(model, batch, _loss)
    node = next(n for n in g.nodes if n.target == "aten.convolution_backward.default"
                and n.module == "2")
    region = node_region(g, node.id, node.inputs[0], 1)
    assert region.nodes == (node.id,), region.boundary
    assert region.length == groups
    for k in (2, groups):
        split = split_region(g, region, k)
        parts = [n for n in split.nodes if n.target == "aten.convolution_backward.default"
                 and n.module == "2"]
        assert len(parts) == k
        assert_same_as_eager(model, batch, _loss, split)
    assert_simulator_tells_truth(split_region(g, region, 2), model, batch)
