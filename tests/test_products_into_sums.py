"""A part's products summed with adds accumulate into the first of them, and the parts' sums
into the region's accumulator (``transform.products_into_sums``, then ``sums_in_place``).

Attention's backward re-made in head parts makes, per part, the layer's input gradient as
``dq_h Wq_h + dk_h Wk_h + dv_h Wv_h``: three whole ``[tokens, hidden]`` products summed
out of place, then added to the parts' sum so far, four whole tensors at once (ALBERT's head
split held 1 MiB of them at its peak). Folded, each part writes its products into one tensor
with ``addmm_``: the same results (allclose), simulated = measured, a lower peak."""

from __future__ import annotations

import copy

import torch
from helpers import assert_split_like_eager
from torch import nn
from torch.nn import functional as F

import fitgraph
from fitgraph.graph.ir import Phase
from fitgraph.transform.products_into_sums import products_into_sums


class _Attention(nn.Module):
    """Pre-norm attention with separate q, k, v projections (as ALBERT's and BERT's)."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, t, w = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, w))


def _head_split(fold: bool = True):
    """Two attention layers captured, every layer's attention re-made in the backward in head
    parts (``split_backward``'s copies recipe along the heads), and (``fold``) each part's
    products summed in place, as ``split_backward`` does once its path is made."""
    from fitgraph.solvers.fission.backward_regions import copies_recipe, products_folded
    from fitgraph.solvers.fission.split_backward import prepared

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _Attention(), _Attention())
    x = torch.randn(2, 64, 32)
    g = prepared(fitgraph.capture(model, x, lambda m, b: m(b).square().mean()))
    sdpa = next(n for n in g.nodes if n.phase is Phase.FORWARD and "attention" in n.target)
    split = copies_recipe(g.values[sdpa.outputs[0]].name, 1, 0.0)(g, 4, float("inf"))
    return model, x, g, products_folded(split) if fold else split


def _whole_adds(graph, shape):
    return [n.name for n in graph.nodes if n.phase is Phase.BACKWARD
            and n.target in ("aten.add.Tensor", "aten.add_.Tensor")
            and graph.values[n.outputs[0]].shape == shape]


def test_each_parts_products_accumulate_into_one_tensor_and_match_eager():
    model, x, g, split = _head_split()
    unfolded = _head_split(fold=False)[3]
    # NOTE: in the last layer, each part's k and v products go into its q product's tensor,
    # and parts after the first into the first part's: one product made, 11 accumulated
    last = [n for n in split.nodes if n.phase is Phase.BACKWARD and n.module.startswith("2.")
            and split.values[n.outputs[0]].shape == (128, 32) and "mm" in n.target]
    assert [n.target for n in last].count("aten.addmm_.default") == 4 * 3 - 1, \
        [(n.name, n.target) for n in last]
    assert len(_whole_adds(split, (2, 64, 32))) < len(_whole_adds(unfolded, (2, 64, 32)))
    assert_split_like_eager(g, split, model, x)


def test_the_folded_products_peak_where_the_simulator_says_and_lower():
    """Law 2 for the least-peak plans of the folded and unfolded splits; the folded peaks
    lower."""
    from fitgraph.cost import ProfiledCostModel
    from fitgraph.measure import measure_plan
    from fitgraph.solvers import Problem
    from fitgraph.solvers.remat.hotspot import solve_hotspot

    model, x, _, split = _head_split()
    cm = ProfiledCostModel("cpu", progress=False)
    peaks = []
    for graph in (split, _head_split(fold=False)[3]):
        cm.profile(graph)
        sol = solve_hotspot(Problem(graph, cm, latency_limit=1e9, time_budget_s=20))
        measured = measure_plan(graph, sol.plan, copy.deepcopy(model), x, repeats=0)
        assert measured.peak_bytes == sol.sim.peak_bytes
        peaks.append(measured.peak_bytes)
    assert peaks[0] < peaks[1]


def test_a_product_read_elsewhere_or_added_to_a_live_tensor_is_not_folded():
    from fitgraph.graph.ir import GraphBuilder, Role

    def graph(product_read_twice: bool, x_read_later: bool):
        b = GraphBuilder()
        a, c = (b.add_input(n, (4, 4), "float32", Role.INPUT) for n in ("a", "c"))
        bw = dict(phase=Phase.BACKWARD)
        x = b.add_node("aten.mm.default", [a, a], [((4, 4), "float32")], name="x", **bw)[0]
        y = b.add_node("aten.mm.default", [c, c], [((4, 4), "float32")], name="y", **bw)[0]
        s = b.add_node("aten.add.Tensor", [x, y], [((4, 4), "float32")], name="s", **bw)[0]
        outs = {"loss": s}
        if product_read_twice:
            outs["y2"] = b.add_node("aten.neg.default", [y], [((4, 4), "float32")], **bw)[0]
        if x_read_later:
            outs["x2"] = b.add_node("aten.neg.default", [x], [((4, 4), "float32")], **bw)[0]
        return b.finish(outs)

    assert [n.target for n in products_into_sums(graph(False, False)).nodes] == [
        "aten.mm.default", "aten.addmm_.default"]
    # NOTE: a product read elsewhere cannot be written into another tensor, nor a tensor
    # read after the add take a product
    for flags in ((True, False), (False, True), (True, True)):
        g = graph(*flags)
        assert products_into_sums(g) is g
