"""Sums of gradients scattered into zeros made by stack/cat (transform.scatter_sums): the same
loss and gradients as the captured graph, a lower simulated peak that the run measures, and
no rewrite where the pieces do not cover their dim once."""

import copy

import pytest
import torch
from helpers import assert_split_like_eager
from torch import nn

import fitgraph
from fitgraph.cost import ProfiledCostModel
from fitgraph.measure import measure_plan
from fitgraph.sim.simulate import simulate
from fitgraph.transform.scatter_sums import stack_scatter_sums

D = 32


class Packed(nn.Module):
    """A fused projection read in pieces: selected (nn.MultiheadAttention's ``proj[i]``) or
    sliced along the features (fused-QKV models)."""

    def __init__(self, pieces, select=True):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D)
        self.pieces, self.select = pieces, select

    def forward(self, x):
        p = self.proj(x)
        if self.select:
            qkv = p.unflatten(-1, (3, D)).movedim(-2, 0)
            got = [qkv[i] for i in self.pieces]
        else:
            got = [p[..., a:b] for a, b in self.pieces]
        out = got[0].tanh()
        for t in got[1:]:
            out = out * t.sigmoid()
        return out


def _loss(m, x):
    return m(x).square().mean()


def _targets(g):
    return [n.target for n in g.nodes]


def test_torch_multihead_attention_sums_its_qkv_gradient_by_stacking():
    torch.manual_seed(0)
    model = nn.MultiheadAttention(D, 4, batch_first=True)
    x = torch.randn(2, 16, D)
    g = fitgraph.capture(model, x, lambda m, b: m(b, b, b, need_weights=False)[0].square().mean())
    g2 = stack_scatter_sums(g)
    assert "aten.select_backward.default" in _targets(g)
    assert "aten.select_backward.default" not in _targets(g2)
    assert _targets(g2).count("aten.stack.default") == 1
    assert_split_like_eager(g, g2, model, x)


@pytest.mark.parametrize("pieces", [(2, 0, 1), (0, 1, 2)])
def test_selected_pieces_in_any_order(pieces):
    torch.manual_seed(0)
    model, x = Packed(pieces), torch.randn(4, 64, D)
    g = fitgraph.capture(model, x, _loss)
    g2 = stack_scatter_sums(g)
    assert "aten.stack.default" in _targets(g2)
    assert_split_like_eager(g, g2, model, x)


def test_sliced_pieces_are_concatenated():
    torch.manual_seed(0)
    model, x = Packed([(D, 2 * D), (0, D), (2 * D, 3 * D)], select=False), torch.randn(4, 64, D)
    g = fitgraph.capture(model, x, _loss)
    g2 = stack_scatter_sums(g)
    assert "aten.slice_backward.default" not in _targets(g2)
    assert "aten.cat.default" in _targets(g2)
    assert_split_like_eager(g, g2, model, x)


@pytest.mark.parametrize("model", [
    Packed((0, 2)),                                                  # a piece unread
    Packed([(0, D), (D // 2, D // 2 + D), (2 * D, 3 * D)], select=False),  # overlapping
    Packed([(0, D), (D, 2 * D)], select=False),                      # the last third unread
], ids=["two-of-three", "overlap", "gap"])
def test_pieces_that_do_not_cover_their_dim_once_are_left(model):
    g = fitgraph.capture(model, torch.randn(4, 8, D), _loss)
    assert stack_scatter_sums(g) is g


def test_the_stacked_sum_lowers_the_peak_as_simulated_and_measured():
    torch.manual_seed(0)
    model, x = Packed((0, 1, 2)), torch.randn(8, 256, D)
    g = fitgraph.capture(copy.deepcopy(model), x, _loss)
    g2 = stack_scatter_sums(g)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    cm.profile(g2)
    before = simulate(g, fitgraph.eager_plan(g), cm)
    after = simulate(g2, fitgraph.eager_plan(g2), cm)
    assert after.peak_bytes < before.peak_bytes
    m = copy.deepcopy(model)
    measured = measure_plan(g2, fitgraph.eager_plan(g2), m, x, repeats=0)
    assert measured.peak_bytes == after.peak_bytes
