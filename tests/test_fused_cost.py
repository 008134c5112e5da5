"""FusedCostModel: pointwise ops and views cost nothing (inductor fuses them), the rest is the
base model's; planned with it, remat recomputes pointwise chains before the convolutions."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.cost.base import BaseCostModel, NodeCost, check_cost_model
from fitgraph.cost.fused import FusedCostModel, is_fused
from fitgraph.graph.ir import GraphBuilder, Role
from fitgraph.plan.instructions import Recompute
from fitgraph.solvers import Problem, solve
from fitgraph.solvers.remat.hotspot import solve_hotspot

ROOF = RooflineCostModel(get_device("cpu-generic"))


def _toy():
    b = GraphBuilder()
    x = b.add_input("x", (256, 256), "float32", Role.INPUT)
    w = b.add_input("w", (256, 256), "float32", Role.PARAMETER)
    h = b.add_node("aten.mm.default", [x, w], [((256, 256), "float32")], name="mm",
                   flops=2 * 256**3)[0]
    r = b.add_node("aten.relu.default", [h], [((256, 256), "float32")], name="relu")[0]
    t = b.add_node("aten.t.default", [r], [((256, 256), "float32")], name="t",
                   alias_of={0: r})[0]
    d = b.add_node("aten.mul.Tensor", [t, t], [((256, 256), "float32")], name="mul_random",
                   random=True)[0]
    b.add_node("aten.add_.Tensor", [d, h], [((256, 256), "float32")], name="add_",
               mutates=(d,), alias_of={0: d})
    c = b.add_node("aten._to_copy.default", [d], [((256, 256), "float16")], name="cast")[0]
    s = b.add_node("aten.sum.default", [c], [((), "float16")], name="sum")[0]
    return b.finish({"loss": s})


def test_fused_nodes_cost_nothing_and_the_rest_is_the_base_models():
    g = _toy()
    fused = FusedCostModel(ROOF)
    by = {n.name: n for n in g.nodes}
    free = {name for name, n in by.items() if is_fused(g, n)}
    # NOTE: a view and the pointwise ops inductor fuses; not the matmul, not the reduction, not
    # a random or in-place op (which no plan recomputes), whatever their tags
    assert free == {"relu", "t", "cast"}
    for name, n in by.items():
        want = NodeCost(0.0, 0) if name in free else ROOF.node_cost(g, n)
        assert fused.node_cost(g, n) == want, name
    assert ROOF.node_cost(g, by["relu"]).seconds > 0   # NOTE: the base does charge it
    assert fused.copy_seconds(1 << 20) == ROOF.copy_seconds(1 << 20)
    assert fused.name == f"{ROOF.name}, pointwise fused"


def test_a_measured_base_stays_measured():
    """Callers tell a measured model by ``measures`` and make it cost a graph with ``prepare``:
    the wrapper answers as its base."""
    seen = []

    class Measured(BaseCostModel):
        name = "m"
        copies_overlap = False
        measures = True

        def prepare(self, graph):
            seen.append(graph)

        def node_cost(self, graph, node):
            return NodeCost(1.0, 0)

        def copy_seconds(self, nbytes):
            return 0.0

    fused = FusedCostModel(Measured())
    fused.prepare("g")
    assert seen == ["g"] and fused.measures and fused.copies_overlap is False
    check_cost_model(fused)
    assert not FusedCostModel(ROOF).measures


class _Block(nn.Module):
    """A 1x1 convolution (one cheap kernel) and a scale-shift-ReLU chain (three kernels in
    eager PyTorch, none of its own once inductor fuses it)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1, bias=False)
        self.scale = nn.Parameter(torch.ones(c, 1, 1))
        self.shift = nn.Parameter(torch.zeros(c, 1, 1))

    def forward(self, x):
        return torch.relu(self.conv(x) * self.scale + self.shift)


@pytest.mark.parametrize("frac", [0.9, 0.8])
def test_planned_with_fused_costs_remat_recomputes_the_pointwise_chain_not_the_conv(frac):
    """As inductor's own partitioner does: with the ATen kernels priced one by one the
    convolution is the cheapest recompute, with the chain fused it is the chain."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(8) for _ in range(4)])
    g = fitgraph.capture(model, (torch.randn(8, 8, 64, 64),),
                         lambda m, b: m(b[0]).square().mean())
    eager = solve(Problem(g, ROOF, latency_limit=1.0), "eager").sim.peak_bytes
    recomputed = {}
    for cm in (ROOF, FusedCostModel(ROOF)):
        # NOTE: as fitgraph.backend plans: the captured order, each node recomputed once
        s = solve_hotspot(Problem(g, cm, budget_bytes=int(frac * eager)), reorder=False,
                          per_use=False)
        assert s.sim.peak_bytes <= frac * eager
        recomputed[cm.name] = Counter(g.nodes[i.node].target for i in s.plan.instructions
                                      if isinstance(i, Recompute))
    aten, fused = recomputed[ROOF.name], recomputed[f"{ROOF.name}, pointwise fused"]
    assert aten["aten.convolution.default"] >= 2
    assert "aten.convolution.default" not in fused
    assert fused["aten.relu.default"] >= 2 and fused["aten.mul.Tensor"] >= 2

