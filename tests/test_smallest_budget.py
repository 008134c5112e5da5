"""``budget="smallest"``: the plan at the least peak fitgraph reaches, the search's own plan."""

from __future__ import annotations

import copy

import pytest
import torch
from test_regions import ItemScaled, ctc_batch, ctc_loss

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.solvers import BudgetInfeasible, Problem, solve, solve_smallest
from fitgraph.solvers.smallest import resident_bytes
from fitgraph.units import check_budget, is_smallest, parse_budget


def _mlp(depth: int = 4, width: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, 64))
        for _ in range(depth)))


def _loss(m, x):
    return m(x).square().mean()


X = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))


def test_smallest_is_a_budget_without_bytes():
    assert is_smallest("smallest") and is_smallest(" Smallest ") and not is_smallest(0.5)
    check_budget("smallest")  # NOTE: accepted before capture
    with pytest.raises(ValueError, match="no bytes before"):
        parse_budget("smallest", eager_peak_bytes=100)
    with pytest.raises(ValueError, match="'smallest'"):
        parse_budget("smalest", eager_peak_bytes=100)


def test_an_infeasible_budget_keeps_the_plan_at_the_peak_it_reports():
    g = fitgraph.capture(_mlp(depth=2, width=128), X, _loss)
    cm = RooflineCostModel(get_device("cpu-generic"))
    # NOTE: auto exact: its least-peak search without split_backward (minutes on any graph)
    for solver in ("hotspot", "auto"):
        with pytest.raises(BudgetInfeasible) as e:
            solve(Problem(g, cm, budget_bytes=resident_bytes(g), time_budget_s=5,
                          exact=True), solver)
        sol = e.value.solution
        assert sol is not None and sol.sim.peak_bytes == e.value.smallest_peak_bytes
        assert sol.solver == solver
    s = solve_smallest(g, cm, lambda p: solve(p, "hotspot"), time_budget_s=5)
    least = solve(Problem(g, cm, latency_limit=1e9, time_budget_s=5), "hotspot")
    assert s.sim.peak_bytes <= least.sim.peak_bytes
    assert s.notes["smallest"].startswith("searched below the resident bytes")


def test_optimize_at_the_smallest_peak_runs_as_eager_and_peaks_as_simulated():
    a = _mlp()
    b = copy.deepcopy(a)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    step = fitgraph.optimize(b, X, _loss, ob, budget="smallest", solver="hotspot", time_budget=5)
    for _ in range(2):
        la = _loss(a, X)
        la.backward()
        oa.step()
        oa.zero_grad(set_to_none=True)
        lb = step(X)
        ob.zero_grad(set_to_none=True)
        assert torch.equal(la.detach(), lb)  # NOTE: remat and reordering: bitwise
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    r = step.report()
    assert r.budget_bytes is None and r.planned_peak_bytes < r.eager_peak_bytes
    assert r.measured_peak_bytes == r.planned_peak_bytes
    assert "smallest" in r.notes or "smallest" in step.plan_for(X).solution.notes


def test_a_step_by_regions_plans_each_region_at_its_least_peak():
    a = ItemScaled()
    b = copy.deepcopy(a)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3)
    batch = ctc_batch()
    with pytest.warns(UserWarning, match="cannot be captured as one graph"):
        # NOTE: exact: remat alone (auto's split_backward would search its least peak for
        # minutes: 6 of them in the default tier)
        step = fitgraph.optimize(b, batch, ctc_loss, ob, budget="smallest", time_budget=3,
                                 exact=True)
    for _ in range(5):
        la = ctc_loss(a, batch)
        la.backward()
        oa.step()
        oa.zero_grad(set_to_none=True)
        lb = step(batch)
        ob.zero_grad(set_to_none=True)
        assert torch.allclose(la.detach(), lb, rtol=1e-5, atol=1e-6)
    r = step.report()
    assert r.regions and r.budget_bytes is None
    assert any(x.planned_peak_bytes < x.eager_peak_bytes for x in r.regions)
    assert r.measured_peak_bytes is not None
