"""``dtr``: DTR's greedy eviction as a planner (issue 5's classic peers)."""

from __future__ import annotations

import pytest
from helpers import assert_solver_plan_runs_and_measures_as_simulated
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_plan_sim import random_graphs

import fitgraph
from fitgraph import zoo
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.plan.verify import verify_plan
from fitgraph.solvers import BudgetInfeasible, Problem, solve
from fitgraph.solvers.peers.dtr import DtrRun
from fitgraph.solvers.remat.stages import stage_graph


@settings(max_examples=40, deadline=None)
@given(random_graphs(), st.floats(0.3, 1.0))
def test_dtr_plan_fits_its_budget_and_its_own_accounting_is_never_below_the_simulator(
        case, frac):
    g, cost = case
    eager = solve(Problem(g, cost, latency_limit=1.0), "eager").sim
    budget = int(frac * eager.peak_bytes)
    try:
        s = solve(Problem(g, cost, budget_bytes=budget), "dtr")
    except BudgetInfeasible as e:
        assert e.smallest_peak_bytes > budget
        return
    verify_plan(g, s.plan)
    assert s.sim.peak_bytes <= budget
    assert s.sim.latency_s >= eager.latency_s * (1 - 1e-9)


def test_dtr_recomputes_a_value_more_than_once_when_memory_is_tight():
    case = zoo.build("gpt2", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    cm = RooflineCostModel(get_device("rtx3090"))
    sg = stage_graph(g, cm)
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
    run = DtrRun(sg, int(0.5 * eager.peak_bytes)).play()
    made = [u for stage in run.recompute for u in stage]
    assert run.evictions > 0 and len(made) > len(set(made)), "some unit is recomputed twice"


def test_dtr_latency_mode_keeps_the_limit_and_lowers_the_peak():
    case = zoo.build("vit-b16", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    cm = RooflineCostModel(get_device("rtx3090"))
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
    s = solve(Problem(g, cm, latency_limit=1.2, time_budget_s=20), "dtr")
    assert s.sim.latency_s <= 1.2 * eager.latency_s * (1 + 1e-9)
    assert s.sim.peak_bytes < 0.9 * eager.peak_bytes


@pytest.mark.parametrize("name", ["gpt2", "resnet50"])
def test_dtr_plan_runs_bitwise_equal_and_measures_as_simulated(name):
    s = assert_solver_plan_runs_and_measures_as_simulated(name, "dtr", 0.7)
    assert s.notes["recomputes"] > 0
