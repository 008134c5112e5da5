"""The planning clock (``cost.clock``): time spent measuring ops does not count against a
solver's time budget, so a plan does not depend on which ops the cost cache already held."""

from __future__ import annotations

import time

import torch

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.cost.clock import measured_s, measuring, planning_now
from fitgraph.graph.analysis import graph_fingerprint
from fitgraph.sim.simulate import simulate
from fitgraph.solvers import Problem, solve

# NOTE: longer than the whole time budget: on the wall clock, measuring the captured graph
# alone would leave auto no time for fission
MEASURE_S = 2.0
TIME_BUDGET_S = 1.5


class _SlowToMeasure(RooflineCostModel):
    """A roofline that "measures" each graph the first time it is prepared (a sleep inside
    ``measuring()``), as ``ProfiledCostModel`` profiles the ops its cache does not hold."""

    measures = True

    def __init__(self) -> None:
        super().__init__(get_device("rtx3090"))
        self.seen: set[str] = set()

    def prepare(self, graph) -> None:
        key = graph_fingerprint(graph)
        if key not in self.seen:
            self.seen.add(key)
            with measuring():
                time.sleep(MEASURE_S)


def test_measuring_is_not_planning_time_and_nests_once():
    t0, m0 = planning_now(), measured_s()
    with measuring():
        with measuring():
            time.sleep(0.05)
        time.sleep(0.05)
    assert 0.1 <= measured_s() - m0 < 0.2   # NOTE: the inner block counted once, in the outer
    assert planning_now() - t0 < 0.05


def test_auto_plans_the_same_on_a_cold_and_a_warm_cache():
    """The first plan measures the captured graph and the split graphs fission picks (each
    longer than the time budget); the second finds them measured. Both are fission's same
    plan: on the wall clock the first would have had no time left for fission."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4096))
    batch = (torch.randn(512, 16), torch.randint(0, 4096, (512,)))

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    g = fitgraph.capture(model, batch, loss_fn)
    cm = _SlowToMeasure()
    budget = simulate(g, fitgraph.eager_plan(g), cm).peak_bytes // 2
    problem = Problem(g, cm, budget_bytes=budget, time_budget_s=TIME_BUDGET_S)
    t0 = time.perf_counter()
    cold = solve(problem, "auto")
    cold_wall = time.perf_counter() - t0
    measured = len(cm.seen)
    warm = solve(problem, "auto")
    assert measured >= 2 and len(cm.seen) == measured   # the second plan measured nothing
    assert cold_wall >= measured * MEASURE_S > TIME_BUDGET_S
    assert cold.notes["winner"] == warm.notes["winner"] == "fission"
    assert cold.plan.instructions == warm.plan.instructions
    assert (cold.sim.peak_bytes, cold.sim.latency_s) == (warm.sim.peak_bytes, warm.sim.latency_s)
    assert cold.sim.peak_bytes <= budget
