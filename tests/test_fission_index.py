"""Fission through advanced indexing: CUDA's bilinear upsampling under deterministic algorithms.

With ``torch.use_deterministic_algorithms(True)`` on CUDA, ``interpolate(mode="bilinear")`` runs
torch's decomposition: four ``_unsafe_index`` gathers, and a backward that adds into
``new_zeros`` with ``_unsafe_index_put``. The CPU never takes that path, so these tests call the
decomposition itself (what CUDA runs) and check that the batch flows through those ops: a batch
region spans the forward and the backward, and the fission solver splits a small U-Net-like net
where nothing else fits, allclose to eager.
"""

from __future__ import annotations

import torch
from test_fission import assert_same_as_eager
from torch._decomp.decompositions import _upsample_linear_vec

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.graph.dim_region import grow_region
from fitgraph.graph.dim_rules_index import index_gather, index_scatter
from fitgraph.graph.ir import Node, Phase, ValueRef
from fitgraph.plan.eager import eager_plan
from fitgraph.sim import simulate
from fitgraph.solvers import BudgetInfeasible, Problem, solve
from fitgraph.solvers.fission.search import solve_fission

ROOFLINE = RooflineCostModel(get_device("cpu-generic"))
INDEX_OPS = {"aten._unsafe_index.Tensor", "aten._unsafe_index_put.default",
             "aten.new_zeros.default"}


class DeterministicCudaUpsample(torch.nn.Module):
    """Bilinear x2 as CUDA runs it with deterministic algorithms on (torch's decomposition)."""

    def forward(self, x):
        return _upsample_linear_vec(x, None, False, [2.0, 2.0])


def _net():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), DeterministicCudaUpsample(),
        torch.nn.Conv2d(16, 3, 3, padding=1))
    return model, (torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32))


def _mean_squared_error(m, b):
    return (m(b[0]) - b[1]).square().mean()


def test_a_batch_region_runs_through_the_gathers_and_their_index_put():
    model, batch = _net()
    g = fitgraph.capture(model, batch, _mean_squared_error)
    targets = {n.target for n in g.nodes}
    assert INDEX_OPS <= targets
    r = grow_region(g, g.inputs[g.input_names.index("batch:0")], 0)
    inside = {g.nodes[i].target for i in r.nodes}
    assert INDEX_OPS <= inside, sorted(targets - inside)
    assert "aten.convolution_backward.default" in inside


def test_fission_splits_the_batch_through_them_where_nothing_else_fits():
    model, batch = _net()
    g = fitgraph.capture(model, batch, _mean_squared_error)
    budget = int(0.5 * simulate(g, eager_plan(g), ROOFLINE).peak_bytes)
    try:
        solve(Problem(g, ROOFLINE, budget_bytes=budget), "hotspot")
        raise AssertionError("hotspot fits: the test needs a budget only a split reaches")
    except BudgetInfeasible:
        pass
    s = solve_fission(Problem(g, ROOFLINE, budget_bytes=budget))
    assert s.sim.peak_bytes <= budget and s.notes["splits"], s.notes
    parts = {n.target for n in s.graph.nodes if ".part" in n.name}
    assert INDEX_OPS <= parts, sorted(parts)
    assert_same_as_eager(model, batch, _mean_squared_error, s.graph)


def _node(target, indices, n_in):
    return Node(0, "n", target, (ValueRef(0), indices) + ((ValueRef(n_in - 1), True)
                                                          if "put" in target else ()),
                {}, tuple(range(n_in)), (n_in,), (), Phase.FORWARD, "")


def test_index_tensors_apart_are_offered_no_split():
    """``x[:, i, :, j]`` puts the gathered dims first: no dim keeps its place."""
    apart = [None, ValueRef(1), None, ValueRef(2)]
    n = _node("aten._unsafe_index.Tensor", apart, 3)
    assert index_gather(n, [(2, 3, 4, 5), (6,), (6,)], [(6, 2, 4)]) == []
    n = _node("aten._unsafe_index_put.default", apart, 4)
    assert index_scatter(n, [(2, 3, 4, 5), (6,), (6,), (6, 2, 4)], [(2, 3, 4, 5)]) == []
    adjacent = [None, None, ValueRef(1), ValueRef(2)]
    n = _node("aten._unsafe_index.Tensor", adjacent, 3)
    # NOTE: and the gathered rows themselves: a part gathers its rows i[a:b], j[a:b]
    assert [s.outputs[0].dim for s in index_gather(n, [(2, 3, 4, 5), (6,), (6,)],
                                                   [(2, 3, 6)])] == [0, 1, 2]
