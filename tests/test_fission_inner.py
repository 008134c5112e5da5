"""Fission along the tokens of a linear layer whose rows are batch and tokens merged: the part
of ``[B*T, F]`` is strided (``Along.outer``), and results are eager's."""

from __future__ import annotations

import copy

import torch
from helpers import assert_split_like_eager
from torch import nn

import fitgraph
from fitgraph.cost import ProfiledCostModel
from fitgraph.graph.dim_region import grow_region
from fitgraph.graph.ir import Phase
from fitgraph.measure import measure_plan
from fitgraph.sim import simulate
from fitgraph.transform.fission import split_region

BATCH = torch.randn(2, 16, 8)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


def _loss(m, x):
    return m(x).square().mean()


def _gelu(g, phase=Phase.FORWARD):
    return next(n for n in g.nodes if n.phase is phase and n.target == "aten.gelu.default")


def test_a_region_along_tokens_reaches_the_linear_layers_merged_rows():
    model = _mlp()
    g = fitgraph.capture(model, BATCH, _loss)
    r = grow_region(g, _gelu(g).outputs[0], 1)
    assert r.length == 16                      # the tokens, not the two batch rows
    merged = [g.values[v].shape[r.dims[v]] for v in r.outers]   # B*T, transposed or not
    assert merged and set(merged) == {32} and set(r.outers.values()) == {2}
    targets = {g.nodes[n].target for n in r.nodes}
    assert {"aten.addmm.default", "aten.mm.default"} <= targets   # forward and backward


def test_split_along_tokens_through_merged_rows_gives_eager_results():
    model = _mlp()
    g = fitgraph.capture(model, BATCH, _loss)
    r = grow_region(g, _gelu(g).outputs[0], 1)
    s = split_region(g, r, 4)
    parts = [n for n in s.nodes if n.target == "aten.addmm.default"]
    assert len(parts) == 2 * 4
    assert all(s.values[n.outputs[0]].shape[0] == 2 * 4 for n in parts)   # 2 rows of 4 tokens
    assert_split_like_eager(g, s, model, BATCH)


def test_an_op_that_reads_where_rows_sit_stops_the_region():
    """Shifted rows of the merged tensor (``h.flatten(0, 1)[1:]``) are positions in ``B*T``:
    a region along the tokens does not take the slice."""

    class Shift(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).relu().flatten(0, 1)[1:]

    model = Shift()
    g = fitgraph.capture(model, BATCH, lambda m, x: m(x).square().mean())
    relu = next(n for n in g.nodes if n.phase is Phase.FORWARD and "relu" in n.target)
    r = grow_region(g, relu.outputs[0], 1)
    assert r.length == 16 and r.outers
    sliced = [n for n in g.nodes if n.phase is Phase.FORWARD and n.target == "aten.slice.Tensor"]
    assert sliced and not any(n.id in r.nodes for n in sliced)
    assert any(n.id in r.boundary for n in sliced)


def test_the_split_through_merged_rows_measures_as_simulated():
    """Law 2 on the strided parts: the reshape copies of sliced inputs and the writes back
    through ``[B, T]`` views are priced as they allocate."""
    model = _mlp()
    g = fitgraph.capture(model, BATCH, _loss)
    s = split_region(g, grow_region(g, _gelu(g).outputs[0], 1), 4)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(s)
    plan = fitgraph.eager_plan(s)
    measured = measure_plan(s, plan, copy.deepcopy(model), BATCH, repeats=0)
    assert simulate(s, plan, cm).peak_bytes == measured.peak_bytes
