"""solve() runs every solver with fewer cyclic collections and restores the thresholds after."""

import gc

import pytest

from fitgraph.solvers import SOLVERS, Problem, solve
from fitgraph.solvers.collector import SOLVE_THRESHOLD, fewer_collections


@pytest.fixture
def probe():
    seen = []

    def solver(problem):
        seen.append(gc.get_threshold())
        if problem == "raise":
            raise RuntimeError("solver failed")
        return "solution"
    SOLVERS["_gc_probe"] = solver
    yield seen
    del SOLVERS["_gc_probe"]


def test_solve_raises_the_threshold_and_restores_it(probe):
    before = gc.get_threshold()
    assert solve("problem", "_gc_probe") == "solution"
    assert probe[0][0] == max(before[0], SOLVE_THRESHOLD[0])
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError, match="solver failed"):
        solve("raise", "_gc_probe")
    assert gc.get_threshold() == before


def test_never_more_often_and_off_stays_off():
    before = gc.get_threshold()
    try:
        gc.set_threshold(500_000, 20, 30)
        with fewer_collections():
            assert gc.get_threshold() == (500_000, 20, 30)
        gc.set_threshold(0)
        with fewer_collections():
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def test_same_plan_either_way():
    from synthetic_graphs import transformer_like

    from fitgraph.bench.solve_collector import time_both
    from fitgraph.cost import RooflineCostModel, get_device

    g = transformer_like(4)
    cm = RooflineCostModel(get_device("rtx3090"))
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
    row = time_both(Problem(g, cm, budget_bytes=int(0.6 * eager.peak_bytes)), "hotspot", 2)
    assert row["same"] and row["default_s"] > 0 and row["fewer_s"] > 0
