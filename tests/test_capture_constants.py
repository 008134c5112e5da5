"""A plain tensor attribute (no buffer, no parameter) read by the forward is a graph constant;
the views the traced ops take of it alias it, as BEiT's relative-position index does in every
layer. A view once became a fresh activation storage shared by all layers' views, and the remat
evaluator and the simulator then disagreed on its lifetime (hotspot raised)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import check_same_as_eager

from fitgraph import Phase, Role
from fitgraph.capture.api import capture
from fitgraph.cost.base import BaseCostModel, NodeCost
from fitgraph.plan.remat import per_use, remat_plan, remat_tables
from fitgraph.sim.remat_eval import RematEvaluator
from fitgraph.sim.simulate import simulate


class RelativeBias(nn.Module):
    def __init__(self, index: torch.Tensor, width: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(int(index.max()) + 1, 1))
        self.index = index          # NOTE: a plain attribute, shared by every layer
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        bias = self.table[self.index.view(-1)].view(x.shape[-1], x.shape[-1])
        return F.gelu(self.lin(x) + bias)


class Net(nn.Module):
    def __init__(self, width=16, layers=3):
        super().__init__()
        index = torch.arange(width * width).reshape(width, width) % 7
        self.layers = nn.ModuleList(RelativeBias(index, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Unit(BaseCostModel):
    name = "unit"
    rng_state_bytes = 0

    def node_cost(self, g, n):
        return NodeCost(1e-3, 0)

    def copy_seconds(self, nbytes):
        return 0.0


def test_views_of_a_constant_alias_it_and_remat_agrees_with_the_simulator():
    torch.manual_seed(0)
    m = Net()
    g = capture(m, torch.randn(4, 16, 16), lambda model, x: model(x).square().mean())
    const = {v.storage for v in g.values if v.role is Role.CONSTANT}
    assert const
    views = [n for n in g.nodes if n.target == "aten.view.default"
             and g.values[n.inputs[0]].role is Role.CONSTANT]
    assert len(views) == 3
    for n in views:  # NOTE: each view lives in the constant's storage, as in eager
        assert g.values[n.outputs[0]].storage in const
    cm = Unit()
    order = [n.id for n in g.nodes]
    t = remat_tables(g)
    ev = RematEvaluator(g, cm, tables=t)
    for n in g.nodes:  # NOTE: every droppable node of the layers, dropped alone and per use
        if t.allowed[n.id] or n.phase is not Phase.FORWARD:
            continue
        for nid in (n.id, per_use(g, n.id)):
            r = ev.evaluate({nid})
            s = simulate(g, remat_plan(g, {nid}, order, tables=t), cm)
            assert (r.peak_bytes, r.latency_s) == (s.peak_bytes, s.latency_s), n.name


def test_a_shared_constant_runs_as_eager():
    torch.manual_seed(0)
    check_same_as_eager(Net(), torch.randn(4, 16, 16),
                        lambda model, x: model(x).square().mean(),
                        torch.optim.AdamW, steps=2)
