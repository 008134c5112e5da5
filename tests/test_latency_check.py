"""A latency limit checked by measurement (issue 25, finding 5): the plan is timed against the
eager plan and made again for a tighter limit where it runs over; the eager plan is the last
resort. The retry logic is tested on scripted measurements (timings are not unit-tested)."""

from __future__ import annotations

import pytest
import torch

import fitgraph
from fitgraph import latency_check


def _case():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(),
                                  torch.nn.Linear(512, 128)) for _ in range(4)]
    return torch.nn.Sequential(*layers), torch.randn(512, 128), lambda m, b: m(b).square().mean()


def _scripted(monkeypatch, ratios):
    seen = []

    def fake(base, graph, plan, cm, **kw):
        seen.append(plan)
        return ratios[len(seen) - 1], 0.01
    monkeypatch.setattr(latency_check, "paired_ratio", fake)
    return seen


def test_a_plan_measured_over_the_limit_is_made_again_for_a_tighter_one(monkeypatch):
    _scripted(monkeypatch, [1.30, 1.08])
    model, batch, lf = _case()
    step = fitgraph.optimize(model, batch, lf, latency_limit=1.10, time_budget=5)
    check = step.report().notes["latency_check"]
    first, second = check["tries"]
    assert check["plan"] == "try 2" and check["measured"] == 1.08
    assert second["planned_for"] == pytest.approx(max(1.0, 1.10 * first["simulated"] / 1.30),
                                                  rel=1e-3)
    assert step.report().planned_peak_bytes == second["peak_bytes"]


def test_the_eager_plan_is_the_last_resort(monkeypatch):
    seen = _scripted(monkeypatch, [1.5, 1.4, 1.3])
    model, batch, lf = _case()
    step = fitgraph.optimize(model, batch, lf, latency_limit=1.10, time_budget=5)
    r = step.report()
    assert r.notes["latency_check"]["plan"] == "eager"
    assert 1 <= len(seen) <= latency_check.MAX_TRIES
    assert r.planned_peak_bytes == r.eager_peak_bytes and r.recomputes == 0


def test_measure_latency_false_trusts_the_simulation(monkeypatch):
    seen = _scripted(monkeypatch, [9.9])
    model, batch, lf = _case()
    step = fitgraph.optimize(model, batch, lf, latency_limit=1.10, time_budget=5,
                             measure_latency=False)
    assert not seen and "latency_check" not in step.report().notes


def test_paired_ratio_times_a_plan_against_the_eager_plan():
    from fitgraph.cost import ProfiledCostModel

    model, batch, lf = _case()
    g = fitgraph.capture(model, batch, lf)
    cm = ProfiledCostModel()
    cm.profile(g)
    ratio, spread = latency_check.paired_ratio(g, g, fitgraph.eager_plan(g), cm, rounds=3)
    assert 0.5 < ratio < 2.0 and spread >= 0
