"""Latency mode with measured costs: the fission search may go past the limit by its estimate's
error (``ESTIMATE_SLACK``), and only the measured split graph must keep the limit."""

from __future__ import annotations

import torch

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.cost.base import BaseCostModel, NodeCost
from fitgraph.plan.eager import eager_plan
from fitgraph.sim import simulate
from fitgraph.solvers import Problem
from fitgraph.solvers.fission import search as fission_solver
from fitgraph.solvers.fission.search import FissionConfig, solve_fission

ROOFLINE = RooflineCostModel(get_device("cpu-generic"))


class _CacheFriendlyParts(BaseCostModel):
    """A measured cost model (it must ``prepare`` a graph) where the parts of a split run at
    ``FACTOR`` of their share of the whole (a CPU's cache holds a part, not the whole): what
    the whole graph's measurements cannot tell the scaled estimate of a split."""

    name = "cache-friendly parts"
    measures = True
    FACTOR = 0.5

    def prepare(self, graph):
        pass

    def node_cost(self, graph, node):
        c = ROOFLINE.node_cost(graph, node)
        return NodeCost(c.seconds * (self.FACTOR if ".part" in node.name else 1.0),
                        c.workspace_bytes)

    def copy_seconds(self, nbytes):
        return ROOFLINE.copy_seconds(nbytes)


def _lm_head():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8192))
    batch = (torch.randn(1024, 32), torch.randint(0, 8192, (1024,)))
    return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _parts(sol) -> list[int]:
    return [int(what.split(" in ")[1].split()[0]) for what in sol.notes["splits"]]


def test_a_split_estimated_past_the_limit_is_measured_and_kept_within_it(monkeypatch):
    model, batch, loss_fn = _lm_head()
    g = fitgraph.capture(model, batch, loss_fn)
    cm = _CacheFriendlyParts()
    eager = simulate(g, eager_plan(g), cm)
    problem = Problem(g, cm, latency_limit=1.02, time_budget_s=30)
    config = FissionConfig(remat=False, spatial=False)
    wide = solve_fission(problem, config=config)
    assert wide.sim.latency_s <= 1.02 * eager.latency_s          # measured costs: the limit holds
    assert simulate(wide.graph, wide.plan, cm) == wide.sim
    monkeypatch.setattr(fission_solver, "ESTIMATE_SLACK", 0.0)
    strict = solve_fission(problem, config=config)
    assert strict.sim.latency_s <= 1.02 * eager.latency_s
    # NOTE: the estimate charges each part its share of the whole (and the summed weight
    # gradient), so alone it stops early; measured, more parts are cheaper and lower the peak
    assert wide.sim.peak_bytes < strict.sim.peak_bytes, (wide.notes["splits"],
                                                         strict.notes["splits"])
    assert max(_parts(wide)) > max(_parts(strict), default=1)


def test_a_split_that_measures_past_the_limit_falls_back_within_it():
    model, batch, loss_fn = _lm_head()
    g = fitgraph.capture(model, batch, loss_fn)

    class _DearParts(_CacheFriendlyParts):
        FACTOR = 1.3       # NOTE: parts cost more than their share: the estimate undershoots

    cm = _DearParts()
    eager = simulate(g, eager_plan(g), cm)
    s = solve_fission(Problem(g, cm, latency_limit=1.05, time_budget_s=30),
                      config=FissionConfig(remat=False, spatial=False))
    assert s.sim.latency_s <= 1.05 * eager.latency_s
    assert simulate(s.graph_for(g), s.plan, cm) == s.sim


def test_a_split_measured_past_the_limit_is_made_again_in_fewer_parts(monkeypatch):
    model, batch, loss_fn = _lm_head()
    g = fitgraph.capture(model, batch, loss_fn)

    class _MeasuredRoofline(_CacheFriendlyParts):
        FACTOR = 1.0   # NOTE: the roofline charges each small part more than its share

    cm = _MeasuredRoofline()
    eager = simulate(g, eager_plan(g), cm)
    problem = Problem(g, cm, latency_limit=1.05, time_budget_s=30)
    config = FissionConfig(remat=False, spatial=False)
    s = solve_fission(problem, config=config)
    assert s.sim.latency_s <= 1.05 * eager.latency_s
    assert simulate(s.graph_for(g), s.plan, cm) == s.sim
    assert s.sim.peak_bytes < eager.peak_bytes / 4, s.notes["splits"]
    # NOTE: the search's most parts (its estimate within the limit plus its slack) measure
    # past the limit; without trying fewer, the least-peak path splits nothing (the cheapest
    # path may stop short of the limit on its own: left out here)
    assert 1 < max(_parts(s)) < max(fission_solver.FissionConfig().ks)
    monkeypatch.setattr(fission_solver, "FEWER_PARTS_TRIES", 0)
    monkeypatch.setattr(fission_solver, "LATENCY_STRATEGIES", ("least peak",))
    assert solve_fission(problem, config=config).sim.peak_bytes > eager.peak_bytes / 4
