"""Swin-style attention re-made in the backward, in parts, along its windows.

Its batched matmuls run on ``[windows x heads, T, T]``, and the attention's output is read
back as ``[windows, T, heads x dim]`` (the output projection's input): the split axis is the
windows there, coarser than the windows x heads it started from.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_split_like_eager
from torch import nn

import fitgraph
from fitgraph.graph.dim_region import grow_region
from fitgraph.graph.ir import Phase
from fitgraph.solvers.fission.backward_regions import PARTS, _forward_start, copies_recipe

WINDOWS, TOKENS, HEADS, DIM = 16, 16, 2, 16


class WindowAttention(nn.Module):
    """Multi-head attention within windows, as Hugging Face's Swin writes it: ``[windows,
    heads, T, D]`` matmuls (run as ``bmm`` on windows x heads), the output transposed back to
    ``[windows, T, heads x D]``."""

    def __init__(self, width: int = HEADS * DIM):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)

    def forward(self, x):
        w, t, c = x.shape

        def heads(p):
            return p(x).view(w, t, HEADS, DIM).transpose(1, 2)
        q, k, v = heads(self.q), heads(self.k), heads(self.v)
        probs = (q * DIM ** -0.5 @ k.transpose(-1, -2)).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(w, t, c)
        return self.o(out) + x


def _graph():
    torch.manual_seed(0)
    model = nn.Sequential(WindowAttention(), WindowAttention())
    x = torch.randn(WINDOWS, TOKENS, HEADS * DIM)
    return model, x, fitgraph.capture(model, x, lambda m, b: m(b).square().mean())


def _probs_at_v(g):
    """The first block's ``probs @ v`` (the forward's second bmm)."""
    return [n for n in g.nodes if n.phase is Phase.FORWARD and n.target == "aten.bmm.default"][1]


def test_a_least_length_lets_the_axis_coarsen_to_the_windows_not_below():
    model, x, g = _graph()
    out = _probs_at_v(g).outputs[0]
    projections = {n.id for n in g.nodes if n.module.endswith(".o")}
    kept = grow_region(g, out, 0, keep_length=True)
    assert kept.length == WINDOWS * HEADS and not projections & set(kept.nodes)
    coarse = grow_region(g, out, 0, min_length=PARTS)
    assert coarse.length == WINDOWS and projections & set(coarse.nodes)
    # NOTE: a floor above the windows keeps the length whole, as keep_length does
    assert grow_region(g, out, 0, min_length=WINDOWS + 1).nodes == kept.nodes


def test_attention_re_made_from_its_probabilities_runs_in_parts_with_eager_results():
    # NOTE: kept to every windows x heads unit, the region from ``probs @ v`` is that bmm
    # alone, which the backward does not read (CopyError); it keeps the windows instead and
    # runs on to the output projection, whose weight gradient then sums its parts
    model, x, g = _graph()
    name = g.values[_probs_at_v(g).outputs[0]].name
    fine = grow_region(g, _probs_at_v(g).outputs[0], 0, keep_length=True)
    assert [g.nodes[n].target for n in fine.nodes if g.nodes[n].phase is Phase.FORWARD] == [
        "aten.bmm.default"]
    split = copies_recipe(name, 0, 0.0)(g, PARTS, float("inf"))
    re_made = [n for n in split.nodes if n.phase is Phase.BACKWARD
               and n.target == "aten.bmm.default" and ".re" in n.name]
    # NOTE: both bmm of both blocks in parts, once each: the blocks' scores are alike starts
    # of the recipe too, and their regions were re-made a second time
    assert len(re_made) == 2 * 2 * PARTS
    assert all(split.values[n.outputs[0]].shape[0] == WINDOWS * HEADS // PARTS
               for n in re_made)
    assert_split_like_eager(g, split, model, x)


@pytest.mark.parametrize("start", ["softmax", "bmm"])
def test_of_equal_forward_tensors_a_region_re_makes_from_its_own_start(start):
    # NOTE: the block's input, its scores, softmax and probabilities are all [W x H, T, T] or
    # [W, T, C] of one size: from Swin's softmax, the first of them (the input) was taken,
    # and the whole block was re-made
    model, x, g = _graph()
    node = next(n for n in g.nodes if n.phase is Phase.FORWARD and start in n.target)
    v = node.outputs[0]
    region = grow_region(g, v, 0, keep_length=True)
    sizes = {g.values[u].nbytes for u, d in region.dims.items() if isinstance(d, int)}
    assert g.values[v].nbytes == max(sizes)
    assert _forward_start(g, region) == (v, 0)
