"""Regions along a 1-D convolution stack's time (wav2vec2/HuBERT's feature encoder).

- a region grown along the time through convolutions (windows) stops before the linear layer
  whose rows are [batch x time] (the inner dim of a merged dim: fission runs neither with the
  other), says why, and splits like eager — it failed to split at all before;
- ``split_backward``'s starts include what the peak node reads that the step made: a
  convolution's backward, whose input gradient along the time is a partial sum, is in no
  region grown from what it makes, but is in the one grown from its output gradient.
"""

from __future__ import annotations

import dataclasses

import torch
from test_fission import assert_same_as_eager

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.graph.dim_region import grow_region
from fitgraph.plan.eager import eager_plan
from fitgraph.sim.simulate import simulate
from fitgraph.solvers.fission.peak_regions import peak_starts
from fitgraph.transform.fission import split_region
from fitgraph.transform.fission_halo_grads import separate_input_grads


class FrontEnd(torch.nn.Module):
    """Strided 1-D convolutions over the time, then a projection of every frame."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList([
            torch.nn.Conv1d(1, 8, 10, stride=5, bias=False),
            torch.nn.Conv1d(8, 8, 3, stride=2, bias=False),
            torch.nn.Conv1d(8, 8, 3, stride=2, bias=False)])
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, wave):
        x = wave[:, None]
        for conv in self.convs:
            x = torch.nn.functional.gelu(conv(x))
        return self.proj(x.transpose(1, 2))


def _loss(m, b):
    return m(*b).square().mean()


def _case():
    torch.manual_seed(0)
    return FrontEnd(), (torch.randn(2, 4000),)


def test_a_time_region_stops_before_rows_merged_with_the_batch():
    model, batch = _case()
    g = separate_input_grads(fitgraph.capture(model, batch, _loss))
    conv = next(n for n in g.nodes if n.target == "aten.convolution.default")
    region = grow_region(g, conv.outputs[0], 2)
    assert region.halo and not region.outers
    why = " ".join(region.boundary.values())
    assert "merged dim" in why and "windows" in why, region.boundary
    matmuls = {n.id for n in g.nodes if n.module == "proj" and "mm" in n.target}
    assert matmuls and not matmuls & set(region.nodes)
    assert_same_as_eager(model, batch, _loss, split_region(g, region, 4))


def test_backward_starts_include_the_peak_nodes_made_inputs():
    model, batch = _case()
    g = fitgraph.capture(model, batch, _loss)
    plan = eager_plan(g)
    sim = simulate(g, plan, RooflineCostModel(get_device("cpu-generic")))
    # NOTE: the peak pinned to the last convolution backward (the wave's first layer)
    nid = max(n.id for n in g.nodes if n.target == "aten.convolution_backward.default")
    pc = next(i for i, ins in enumerate(plan) if getattr(ins, "node", None) == nid)
    sim = dataclasses.replace(sim, peak_instruction=pc)
    made = [v for v in g.nodes[nid].inputs if not g.storages[g.values[v].storage].role.resident]
    assert made
    without = {v for v, _ in peak_starts(g, plan, sim, 0)}
    with_inputs = {v for v, _ in peak_starts(g, plan, sim, 0, peak_inputs=True)}
    assert not set(made) <= without
    assert set(made) <= with_inputs


def test_a_forward_start_is_offered_at_every_trim_tightest_first():
    """The copies recipe trims the forward region it grows from the start, not the region the
    start came from: each trim is a candidate, the tightest ranked first. From HuBERT's second
    convolution backward along the time (a region of two backward nodes, untrimmed) only the
    untrimmed copy was offered, which re-made the first layer's output whole (1.45x -> 1.34x
    the lower bound once the tightest was)."""
    from fitgraph.solvers import Problem
    from fitgraph.solvers.fission.backward_regions import COPIES, SHARES, candidates
    from fitgraph.solvers.fission.split_backward import prepared
    from fitgraph.solvers.remat.hotspot import solve_hotspot

    model, batch = _case()
    g = prepared(fitgraph.capture(model, batch, _loss))
    best = solve_hotspot(Problem(g, RooflineCostModel(get_device("cpu-generic")),
                                 latency_limit=1e9, time_budget_s=10))
    shares: dict[str, list[float]] = {}
    for what, kind, _, recipe in candidates(g, best):
        if kind == COPIES:
            shares.setdefault(what.split(" re-made")[0], []).append(recipe.share)
    assert shares
    for start, got in shares.items():
        assert got == sorted(SHARES, reverse=True), (start, got)


class NormedFrontEnd(FrontEnd):
    """wav2vec2/HuBERT's feature projection: the frames through a layer norm first."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, wave):
        x = wave[:, None]
        for conv in self.convs:
            x = torch.nn.functional.gelu(conv(x))
        return self.proj(self.norm(x.transpose(1, 2)))


def test_a_time_region_runs_on_from_a_layer_norms_separated_backward():
    """A layer norm's backward makes its weight gradient as a sum over the rows: a part of it
    ran exactly its own rows, and the next convolution backward gathers more (HuBERT:
    "part 0 must make rows (0, 13) ... but makes (0, 12)"). Separated like a convolution's,
    its input gradient runs any rows, and the region runs on through the convolution chain."""
    torch.manual_seed(0)
    model, batch = NormedFrontEnd(), (torch.randn(2, 4000),)
    g = separate_input_grads(fitgraph.capture(model, batch, _loss))
    names = {n.name for n in g.nodes if n.target == "aten.native_layer_norm_backward.default"}
    assert len(names) == 2 and all(n.endswith((".input", ".weight")) for n in names), names
    first = min((n for n in g.nodes if n.target == "aten.convolution_backward.default"),
                key=lambda n: n.id)
    region = grow_region(g, first.outputs[0], 2)
    norm = {n.id for n in g.nodes if n.name.endswith(".input") and "layer_norm" in n.target}
    assert region.halo and norm <= set(region.nodes)
    assert_same_as_eager(model, batch, _loss, split_region(g, region, 4))
