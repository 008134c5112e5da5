"""Plans timed against each other (``cost.plan_timing``, ``ProfiledCostModel.measured_ratio``)."""

from __future__ import annotations

import time

import torch

import fitgraph
from fitgraph.cost.clock import planning_now
from fitgraph.cost.profiler import ProfiledCostModel
from fitgraph.solvers import Problem, solve


def test_a_plan_that_recomputes_measures_slower_and_is_not_planning_time():
    """A plan that recomputes the forward's activations measures slower than the eager plan
    (it runs forward ops again; one thread); the timing is measuring, not planning."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    g = fitgraph.capture(model, torch.randn(512, 256), lambda m, b: m(b).square().mean())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cm = ProfiledCostModel("cpu", progress=False)
        cm.prepare(g)
        eager = solve(Problem(g, cm, latency_limit=1.0), "eager")
        remat = solve(Problem(g, cm, budget_bytes=int(0.7 * eager.sim.peak_bytes)), "hotspot")
        assert remat.sim.latency_s > 1.05 * eager.sim.latency_s
        t0, p0 = time.perf_counter(), planning_now()
        ratio = cm.measured_ratio(g, remat.plan, g, eager.plan)
        wall, planning = time.perf_counter() - t0, planning_now() - p0
    finally:
        torch.set_num_threads(threads)
    assert ratio > 1.0
    assert planning < 0.1 * wall
