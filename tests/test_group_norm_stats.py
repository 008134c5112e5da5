"""A group norm run from its statistics (``transform.group_norm_stats``): eager's results,
the simulator's peak measured, and a region along the time that runs through it.

wav2vec2 and HuBERT normalise their first convolution layer (the largest tensors of their
step) with a GroupNorm per channel; its statistics over the time ended every region along the
time, and their least peak sat at its backward (1.34x and 1.38x their lower bound)."""

from __future__ import annotations

import pytest
import torch
from test_fission import assert_same_as_eager, assert_simulator_tells_truth
from torch import nn

import fitgraph
from fitgraph.graph.dim_region import grow_region
from fitgraph.transform.group_norm_stats import group_norms_from_stats

GN, GN_BACKWARD = "aten.native_group_norm.default", "aten.native_group_norm_backward.default"
CONV_BACKWARD = "aten.convolution_backward.default"


class AudioFront(nn.Module):
    """wav2vec2's feature encoder in small: a strided convolution of the waveform (which needs
    no gradient), a GroupNorm (``groups`` of the channels), GELU, two more convolutions."""

    def __init__(self, groups: int = 8, affine: bool = True) -> None:
        super().__init__()
        self.conv0 = nn.Conv1d(1, 8, 10, 5, bias=False)
        self.norm = nn.GroupNorm(groups, 8, affine=affine)
        self.conv1 = nn.Conv1d(8, 8, 3, 2, bias=False)
        self.conv2 = nn.Conv1d(8, 4, 3, 2)

    def forward(self, x):
        h = nn.functional.gelu(self.norm(self.conv0(x[:, None])))
        return self.conv2(nn.functional.gelu(self.conv1(h)))


class NormInTheMiddle(nn.Module):
    """A GroupNorm between two 2-D convolutions, so its input gradient is needed whole (the
    convolution before it makes its own input's gradient too)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Conv2d(3, 3, 1)
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.GroupNorm(2, 6)
        self.head = nn.Conv2d(6, 2, 3, padding=1)

    def forward(self, x):
        return self.head(self.norm(self.stem(self.pre(x).relu())).relu())


def _loss(m, x):
    return m(x).square().mean()


def _rewritten(model, batch):
    g = fitgraph.capture(model, batch, _loss)
    assert any(n.target == GN for n in g.nodes)
    g2 = group_norms_from_stats(g)
    assert not any(n.target in (GN, GN_BACKWARD) for n in g2.nodes)
    return g2


@pytest.mark.parametrize("groups, affine", [(8, True), (2, True), (4, False)])
def test_a_first_layers_group_norm_runs_from_its_statistics(groups, affine):
    torch.manual_seed(0)
    model, batch = AudioFront(groups, affine), torch.randn(2, 400)
    g = _rewritten(model, batch)
    # NOTE: the waveform needs no gradient: the first convolution's weight gradient is made
    # as two terms, and the norm's input gradient never
    terms = [n.name for n in g.nodes if n.target == CONV_BACKWARD and n.module == "conv0"]
    assert len(terms) == 2, terms
    assert_same_as_eager(model, batch, _loss, g)
    assert_simulator_tells_truth(g, model, batch)


def test_a_group_norm_whose_input_gradient_is_read_whole():
    torch.manual_seed(0)
    model, batch = NormInTheMiddle(), torch.randn(2, 3, 8, 8)
    g = _rewritten(model, batch)
    stem = [n for n in g.nodes if n.target == CONV_BACKWARD and n.module == "stem"]
    assert len(stem) == 1 and list(stem[0].args[10]) == [True, True, True]
    assert_same_as_eager(model, batch, _loss, g)
    assert_simulator_tells_truth(g, model, batch)


def test_a_region_along_the_time_runs_through_the_normalised_output():
    torch.manual_seed(0)
    model, batch = AudioFront(), torch.randn(2, 400)
    captured = fitgraph.capture(model, batch, _loss)
    g = group_norms_from_stats(captured)

    def time_region(graph):
        gelu = next(n for n in graph.nodes if n.target == "aten.gelu.default")
        return {graph.nodes[i].target for i in grow_region(graph, gelu.outputs[0], 2).nodes}

    # NOTE: the statistics are over the time: the captured norm ends the region
    assert GN not in time_region(captured)
    assert "aten.addcmul.default" in time_region(g)


def test_group_norms_that_do_not_qualify_stay_as_captured():
    torch.manual_seed(0)
    model = AudioFront().to(torch.bfloat16)
    g = fitgraph.capture(model, torch.randn(2, 400, dtype=torch.bfloat16),
                         lambda m, x: m(x).float().square().mean())
    assert group_norms_from_stats(g) is g
    model = NormInTheMiddle().to(memory_format=torch.channels_last)
    g = fitgraph.capture(model, torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
                         _loss)
    assert group_norms_from_stats(g) is g
