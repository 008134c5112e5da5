"""The coordinated search (solver ``search``) and hotspot over the exact scheduler's order."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import assert_split_like_eager, classifier_mlp
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_plan_sim import random_graphs
from test_rewrite_rules import Packed, Scaled, Twice

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.plan.verify import verify_plan
from fitgraph.sim.simulate import simulate
from fitgraph.solvers import BudgetInfeasible, Problem, solve
from fitgraph.solvers.coordinated import AUTO_SHARE
from fitgraph.solvers.remat.hotspot import solve_hotspot

CPU = RooflineCostModel(get_device("cpu-generic"))


def _eager(g, cm):
    return simulate(g, fitgraph.eager_plan(g), cm)


@settings(max_examples=25, deadline=None)
@given(random_graphs(), st.floats(0.3, 1.0))
def test_search_is_never_worse_than_auto_on_random_graphs(case, frac):
    """Its first candidate is auto's plan (the same time budget): the search's plan is within
    the budget, valid, and no slower; where auto finds none, neither is it asked to."""
    g, cost = case
    budget = int(frac * _eager(g, cost).peak_bytes)
    try:
        auto = solve(Problem(g, cost, budget_bytes=budget, time_budget_s=AUTO_SHARE * 30), "auto")
    except BudgetInfeasible:
        auto = None
    try:
        found = solve(Problem(g, cost, budget_bytes=budget, time_budget_s=30), "search")
    except BudgetInfeasible:
        assert auto is None
        return
    graph = found.graph_for(g)
    verify_plan(graph, found.plan)
    sim = simulate(graph, found.plan, cost)
    assert (sim.peak_bytes, sim.latency_s) == (found.sim.peak_bytes, found.sim.latency_s)
    assert sim.peak_bytes <= budget
    if auto is not None:
        assert found.sim.latency_s <= auto.sim.latency_s * (1 + 1e-12)
    assert found.notes["candidates"][0]["rules"] == []


@settings(max_examples=25, deadline=None)
@given(random_graphs(), st.floats(0.3, 1.0))
def test_hotspot_over_the_exact_order_is_never_worse(case, frac):
    g, cost = case
    budget = int(frac * _eager(g, cost).peak_bytes)
    try:
        plain = solve_hotspot(Problem(g, cost, budget_bytes=budget))
    except BudgetInfeasible:
        return
    exact = solve_hotspot(Problem(g, cost, budget_bytes=budget), exact=True)
    assert exact.sim.peak_bytes <= budget
    assert (exact.sim.latency_s, exact.sim.peak_bytes) <= (plain.sim.latency_s,
                                                           plain.sim.peak_bytes)


def test_search_plans_a_rewritten_graph_that_runs_like_eager():
    """Attention scores scaled after the product: the search keeps the rule's graph (a
    score-sized pass fewer: at the same least peak, a faster step), and its plan runs with
    eager's results (allclose: the scaling rounds first)."""
    torch.manual_seed(0)
    model = Scaled(8, 4, 2, 0.125, divide=False)
    batch = torch.randn(2, 64, 8)
    g = fitgraph.capture(copy.deepcopy(model), batch)
    auto = solve(Problem(g, CPU, latency_limit=1.0, time_budget_s=10), "auto")
    s = solve(Problem(g, CPU, latency_limit=1.0, time_budget_s=30), "search")
    assert s.notes["rules"] == ["scale_across_matmul"]
    assert s.sim.peak_bytes <= auto.sim.peak_bytes and s.sim.latency_s < auto.sim.latency_s
    assert s.sim.latency_s <= 1.0 * _eager(g, CPU).latency_s
    tried = {tuple(c["rules"]): c for c in s.notes["candidates"]}
    assert tried[("scale_across_matmul",)]["changes"]["scale_across_matmul"]["matches"] == 1
    assert_split_like_eager(g, s.graph, model, batch, plan=s.plan, atol=1e-5)


def test_search_keeps_to_bitwise_rewrites_when_asked():
    torch.manual_seed(0)
    model = Packed(4, [4, 4], True, heads=2)
    g = fitgraph.capture(model, torch.randn(2, 6, 4))
    s = solve(Problem(g, CPU, latency_limit=1.05, time_budget_s=10, exact=True), "search")
    # NOTE: no rule that is not bitwise matches: only auto's plans for other constraints
    from fitgraph.solvers.search_moves import PROBE

    assert all(c["rules"][0].startswith(PROBE) for c in s.notes["candidates"][1:])
    assert all(r.startswith(PROBE) for r in s.notes["rules"])


def test_an_infeasible_budget_is_reported_as_auto_reports_it():
    """Below what any candidate reaches: auto's error on the captured graph, with the plan at
    its least peak (what a budget of "smallest" takes), unless a rewrite reached lower."""
    torch.manual_seed(0)
    model = Scaled(8, 4, 2, 0.125, divide=False)
    g = fitgraph.capture(model, torch.randn(2, 64, 8))
    budget = g.resident_bytes + 1
    try:   # NOTE: exact: auto's split_backward (minutes) is not tried
        solve(Problem(g, CPU, budget_bytes=budget, time_budget_s=10, exact=True), "search")
    except BudgetInfeasible as e:
        assert e.smallest_peak_bytes > budget and e.solver == "search"
        assert e.solution is None or e.solution.sim.peak_bytes == e.smallest_peak_bytes
    else:
        raise AssertionError("a budget of the resident bytes was met")


def test_auto_without_fallbacks_gives_up_at_once():
    """The search's rewritten graphs are planned without auto's least-peak search and
    split_backward (minutes): a missed budget is an error at once."""
    import time

    from fitgraph.solvers.portfolio import solve_auto

    torch.manual_seed(0)
    g = fitgraph.capture(Scaled(8, 4, 2, 0.125, divide=False), torch.randn(2, 64, 8))
    t0 = time.perf_counter()
    try:
        solve_auto(Problem(g, CPU, budget_bytes=g.resident_bytes + 1, time_budget_s=10),
                   fallback=False)
    except BudgetInfeasible as e:
        assert e.solver == "auto" and e.smallest_peak_bytes > g.resident_bytes
    else:
        raise AssertionError("a budget of the resident bytes was met")
    assert time.perf_counter() - t0 < 30   # NOTE: split_backward alone takes at least 240 s


def test_the_search_plan_measures_the_peak_it_simulates():
    """Law 2 on the search's plan (a rewritten graph, remat on it): measured on this machine's
    op costs and workspaces, its peak is the simulated one, within the budget."""
    from fitgraph.cost import ProfiledCostModel
    from fitgraph.measure import measure_plan

    torch.manual_seed(0)
    model, batch = Scaled(8, 4, 2, 0.125, divide=False), torch.randn(2, 64, 8)
    g = fitgraph.capture(copy.deepcopy(model), batch)
    cost = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cost.profile(g)
    budget = int(0.8 * _eager(g, cost).peak_bytes)
    s = solve(Problem(g, cost, budget_bytes=budget, time_budget_s=20), "search")
    graph = s.graph_for(g)
    measured = measure_plan(graph, s.plan, model, batch, repeats=0)
    assert measured.peak_bytes == s.sim.peak_bytes <= budget


class _ScoresHead(torch.nn.Module):
    """Scaled attention scores (scale_across_matmul matches) under a wide classifier head
    (fission splits its loss)."""

    def __init__(self, d=16, vocab=2048):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        s = (self.q(x) @ self.k(x).transpose(-2, -1)) * 0.25
        return self.head(s.softmax(-1) @ self.v(x))


def test_a_rule_on_autos_split_graph_plans_a_step_like_eager():
    from fitgraph.solvers.coordinated import _Candidate
    from fitgraph.solvers.search_moves import ON_PLANNED, _moves
    from fitgraph.transform.rules import RULES

    torch.manual_seed(0)
    model = _ScoresHead()
    batch = (torch.randn(8, 64, 16), torch.randint(0, 2048, (8, 64)))

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())

    g = fitgraph.capture(model, batch, loss_fn)
    sol = solve(Problem(g, CPU, latency_limit=1.5), "auto")
    assert sol.notes["winner"] == "fission" and sol.graph is not None
    rule = RULES["scale_across_matmul"]
    move = next(m for m in _moves(_Candidate((0,), g, (), sol, None), [rule])
                if m.name == rule.name)
    assert move.change["on"] == ON_PLANNED
    rewritten = move.make()
    assert rule.find(rewritten) == [] and len(rewritten.nodes) > len(g.nodes)
    again = solve(Problem(rewritten, CPU, latency_limit=1.5), "auto")
    assert_split_like_eager(g, again.graph_for(rewritten), model, batch, plan=again.plan,
                            atol=1e-5)


def test_a_plans_own_graph_is_planned_again_as_a_candidate():
    """Where auto's plan runs a graph it rewrote (fission's split loss), that graph is a
    candidate of its own (``AGAIN``: auto plans it again, and may split it further); the
    search's plan on whichever graph wins runs like eager's, within the budget."""
    from fitgraph.solvers.search_moves import AGAIN

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4096))
    batch = (torch.randn(512, 16), torch.randint(0, 4096, (512,)))

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    g = fitgraph.capture(copy.deepcopy(model), batch, loss_fn)
    cost = RooflineCostModel(get_device("rtx3090"))
    budget = _eager(g, cost).peak_bytes // 2
    s = solve(Problem(g, cost, budget_bytes=budget, time_budget_s=30), "search")
    again = [c for c in s.notes["candidates"] if c["rules"] == [AGAIN]]
    assert len(again) == 1 and again[0]["changes"][AGAIN]["planned_by"] == "fission"
    assert again[0]["changes"][AGAIN]["splits"]
    assert again[0]["peak_bytes"] <= budget
    assert s.sim.peak_bytes <= budget and s.graph is not None
    verify_plan(s.graph, s.plan)
    assert_split_like_eager(g, s.graph, model, batch, plan=s.plan, atol=1e-5)


def test_a_larger_budget_tries_more_candidates_not_longer_ones(monkeypatch):
    """auto's plan (the first candidate) gets ``AUTO_SHARE`` of the budget, every later one at
    most ``CANDIDATE_S``: fission runs to its deadline, so candidates given a share of a large
    budget would each take all of it and the search would try as few as with a small one."""
    from fitgraph.solvers import coordinated

    now = [0.0]
    given_s = []
    real_plan = coordinated._plan

    def timed_plan(problem, graph, rules, changes, time_s, *args, **kwargs):
        given_s.append(time_s)
        found = real_plan(problem, graph, rules, changes, min(time_s, 5.0), *args, **kwargs)
        now[0] += time_s   # NOTE: as fission does: every second it was given
        return found

    monkeypatch.setattr(coordinated, "planning_now", lambda: now[0])
    monkeypatch.setattr(coordinated, "_plan", timed_plan)
    torch.manual_seed(0)
    g = fitgraph.capture(Packed(8, [16, 16, 16], True, 2), torch.randn(2, 32, 8))
    s = solve(Problem(g, CPU, latency_limit=1.5, time_budget_s=90), "search")
    assert given_s[0] == AUTO_SHARE * 90
    assert len(given_s) > 2 and all(t <= coordinated.CANDIDATE_S for t in given_s[1:])
    assert len(s.notes["candidates"]) == len(given_s)


def test_the_half_is_planned_only_where_the_whole_rule_does_not_pay(monkeypatch):
    """On a graph whose two scaled products the scaling rule rewrites, the whole rule pays
    (a lower peak at the limit): its half is not planned; where a whole rule's graph plans
    worse than its parent, the half is."""
    from fitgraph.solvers import coordinated, search_moves

    torch.manual_seed(0)
    g = fitgraph.capture(Twice(lambda: Scaled(8, 4, 2, 0.125, divide=False)),
                         torch.randn(2, 64, 8))
    s = solve(Problem(g, CPU, latency_limit=1.0, time_budget_s=30), "search")
    names = [c["rules"] for c in s.notes["candidates"]]
    assert ["scale_across_matmul"] in names and ["scale_across_matmul" + search_moves.HALF] \
        not in names
    real = coordinated._better
    monkeypatch.setattr(coordinated, "_better", lambda a, b, budget_mode: a.rules != (
        "scale_across_matmul",) and real(a, b, budget_mode))
    s = solve(Problem(g, CPU, latency_limit=1.0, time_budget_s=30), "search")
    names = [c["rules"] for c in s.notes["candidates"]]
    half = [c for c in s.notes["candidates"]
            if c["rules"] == ["scale_across_matmul" + search_moves.HALF]]
    assert ["scale_across_matmul"] in names and len(half) == 1
    assert half[0]["changes"]["scale_across_matmul" + search_moves.HALF]["matches"] == 1


def _dropout_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 64)) for _ in range(3)))
    return model, torch.randn(1024, 64)


def test_auto_can_be_held_to_either_mask_choice():
    """``masks_as_bits``: True plans every later option on the masks-as-bits rewrite, False
    never makes it, None weighs both (``notes["masks_as_bits"]`` says which was planned on)."""
    from fitgraph.solvers.portfolio import solve_auto

    model, batch = _dropout_mlp()
    g = fitgraph.capture(model, batch, lambda m, x: m(x).square().mean())
    problem = Problem(g, CPU, latency_limit=1.2, time_budget_s=10)
    on = solve_auto(problem, masks_as_bits=True)
    off = solve_auto(problem, masks_as_bits=False)
    free = solve_auto(problem)

    def bits(sol):   # NOTE: split graphs' masks are parts: look for the bits' own ops
        return any("pack_bits" in n.target for n in sol.graph_for(g).nodes)

    assert on.notes["masks_as_bits"] and bits(on)
    assert not off.notes["masks_as_bits"] and off.notes["compact_masks"].endswith("=False")
    assert not bits(off)
    chosen = on if free.notes["masks_as_bits"] else off
    assert (free.sim.peak_bytes, free.sim.latency_s) == (chosen.sim.peak_bytes,
                                                         chosen.sim.latency_s)


# NOTE: ~39 s (three plans of 10-30 s): `make test-slow`; auto held to either choice is tested
# in the default tier (test_auto_can_be_held_to_either_mask_choice)
@pytest.mark.slow
def test_the_search_plans_auto_mask_choice_the_other_way(monkeypatch):
    """Where auto weighed the dropout masks as bits, the search plans the same graph with the
    other choice (``MASKS``), and every candidate descended from it keeps that choice; the
    candidate's plan is auto's held to the choice, within the limit."""
    from fitgraph.solvers import coordinated
    from fitgraph.solvers.portfolio import solve_auto
    from fitgraph.solvers.search_moves import MASKS

    model, batch = _dropout_mlp()
    g = fitgraph.capture(model, batch, lambda m, x: m(x).square().mean())
    problem = Problem(g, CPU, latency_limit=1.2, time_budget_s=30)
    auto_on = solve_auto(dataclasses.replace(problem, time_budget_s=AUTO_SHARE * 30))
    other = not auto_on.notes["masks_as_bits"]
    held = []
    real = coordinated.solve_auto

    def spy(sub, **kw):
        held.append(kw.get("masks_as_bits"))
        return real(sub, **kw)

    monkeypatch.setattr(coordinated, "solve_auto", spy)
    s = solve(problem, "search")
    cands = s.notes["candidates"]
    flipped = [i for i, c in enumerate(cands) if MASKS[other] in c["rules"]]
    assert flipped and cands[flipped[0]]["rules"] == [MASKS[other]]
    # NOTE: by count, not position: a candidate whose eager step is over the limit calls no auto
    assert held[0] is None and held.count(other) == len(flipped)
    assert held.count(None) == len(held) - len(flipped)
    assert MASKS[not other] not in str([c["rules"] for c in cands])
    first = cands[flipped[0]]
    assert first["latency_s"] <= 1.2 * _eager(g, CPU).latency_s * (1 + 1e-9)
    direct = solve_auto(dataclasses.replace(problem, time_budget_s=coordinated.CANDIDATE_S),
                        masks_as_bits=other)
    assert first["peak_bytes"] == direct.sim.peak_bytes


def _loss_model():
    return classifier_mlp(16, 256, 4096, 512)


def test_the_search_plans_fission_other_first_splits(monkeypatch):
    """From the captured graph the search plans fission's other first-round splits (``SPLIT``)
    by auto, not the one auto's fission went on with; where one wins, its plan runs like
    eager on its split graph."""
    from fitgraph.solvers import coordinated
    from fitgraph.solvers.search_moves import SPLIT

    model, batch, loss_fn = _loss_model()
    g = fitgraph.capture(model, batch, loss_fn)
    cm = RooflineCostModel(get_device("rtx3090"))
    problem = Problem(g, cm, latency_limit=2.0, time_budget_s=30)
    s = solve(problem, "search")
    own = s.notes["auto"].get("winner") == "fission"
    cands = s.notes["candidates"]
    splits = [c for c in cands if c["rules"] and c["rules"][0].startswith(SPLIT)]
    assert splits and all(len(c["rules"]) == 1 or c["rules"][1] != c["rules"][0]
                          for c in splits)
    planned = {c["rules"][0] for c in splits}
    first = solve(dataclasses.replace(problem, time_budget_s=AUTO_SHARE * 30), "auto")
    if own:
        assert SPLIT + first.notes["splits"][0] not in planned
    # NOTE: a split move's candidate wins where the simulator says so: made so here
    def split(c):
        return bool(c.rules) and c.rules[0].startswith(SPLIT)

    monkeypatch.setattr(coordinated, "_better", lambda a, b, budget_mode: (
        a.solution is not None and split(a) and not split(b)))
    s = solve(problem, "search")
    assert s.notes["rules"][0].startswith(SPLIT)
    assert s.sim.latency_s <= 2.0 * _eager(g, cm).latency_s * (1 + 1e-9)
    assert_split_like_eager(g, s.graph, model, batch, plan=s.plan, atol=1e-5)


def test_a_graph_whose_eager_step_is_over_the_limit_is_not_expanded(monkeypatch):
    """A candidate whose eager step is over the latency limit plans nothing, and nothing made
    from it would start any lower: the search tries it and goes on from the others."""
    from fitgraph.solvers import coordinated

    torch.manual_seed(0)
    g = fitgraph.capture(Scaled(8, 4, 2, 0.125, divide=False), torch.randn(2, 64, 8))
    real = coordinated._plan

    def over(problem, graph, rules, changes, time_s, limit_s, budget_mode, fallback=False,
             probe=None, factor=1.0):
        if rules:   # NOTE: every rewritten graph over the limit
            return real(problem, graph, rules, changes, time_s, 0.0, budget_mode, probe=probe,
                        factor=factor)
        return real(problem, graph, rules, changes, time_s, limit_s, budget_mode, fallback)

    monkeypatch.setattr(coordinated, "_plan", over)
    s = solve(Problem(g, CPU, latency_limit=1.0, time_budget_s=30), "search")
    cands = s.notes["candidates"]
    assert len(cands) > 1 and s.notes["rules"] == []
    assert all(c["failed"] == "its eager step is over the latency limit" for c in cands[1:])
    assert all(len(c["rules"]) == 1 for c in cands[1:])
