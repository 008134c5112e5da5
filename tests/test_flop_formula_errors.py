"""A FLOP formula that fails on a node's arguments loses that node's FLOP estimate, and says so:
the graph keeps which nodes and why, and ``auto`` on a roofline (which costs such a node by its
bytes alone) names them in its notes — no silent 0 FLOPs."""

from __future__ import annotations

import torch
from torch.utils import flop_counter

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.solvers import Problem, solve


def test_a_failing_flop_formula_is_named_in_the_graph_and_autos_notes(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("odd arguments")

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.addmm, broken)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    g = fitgraph.capture(model, torch.randn(8, 16), lambda m, x: m(x).square().mean())
    errors = g.meta["flop_formula_errors"]
    assert errors and all("addmm" in why and "odd arguments" in why for why in errors.values())
    assert all(g.nodes[i].flops == 0 for i, n in enumerate(g.nodes) if n.name in errors)
    cm = RooflineCostModel(get_device("cpu-generic"))
    s = solve(Problem(g, cm, latency_limit=1.1, time_budget_s=2), "auto")
    assert s.notes["flops_unknown"].startswith(f"{len(errors)} node(s) have no FLOP estimate")


def test_a_graph_whose_formulas_all_hold_has_no_such_note():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    g = fitgraph.capture(model, torch.randn(8, 16), lambda m, x: m(x).square().mean())
    assert g.meta["flop_formula_errors"] == {}
    s = solve(Problem(g, RooflineCostModel(get_device("cpu-generic")), latency_limit=1.1,
                      time_budget_s=2), "auto")
    assert "flops_unknown" not in s.notes
