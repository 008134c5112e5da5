"""The coordinated search's moves (``solvers.search_moves``): which graphs a candidate leads to
— rules, their better half, auto's rewrite kept, fission's other first splits, auto for the
other kind of constraint."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_split_like_eager
from test_coordinated_search import _eager, _loss_model

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.solvers import Problem, solve


def test_rules_that_save_the_most_bytes_are_tried_first():
    """Each expansion tries the matching rules not yet on its path, the most bytes saved
    first (a deadline that leaves time for few candidates spends it on those)."""
    from fitgraph.solvers.coordinated import _Candidate
    from fitgraph.solvers.search_moves import _promising_first
    from fitgraph.transform.rules import Rule

    def rule(name, saved):
        return Rule(name, lambda g: [type("M", (), {"bytes_saved": b, "flops_saved": 0.0})()
                                     for b in saved], lambda g: g, exact=True, changes="")

    rules = [rule("none", []), rule("small", [1, 2]), rule("big", [10]),
             rule("negative", [-5]), rule("done", [100])]
    parent = _Candidate((0,), object(), ("done",), None, None)
    assert [r.name for r, _, _ in _promising_first(parent, rules)] == [
        "big", "small", "negative"]


def test_a_rule_rewrites_the_graph_its_parents_plan_ran():
    """Where auto's plan ran a graph it rewrote (fission's splits, masks as bits), a rule that
    matches there rewrites that graph (auto's splits kept: a candidate's few seconds seldom
    reach fission again); a rule that matches only the parent's own graph rewrites that."""
    from types import SimpleNamespace

    from fitgraph.solvers.coordinated import _Candidate
    from fitgraph.solvers.search_moves import ON_PLANNED, _moves
    from fitgraph.transform.rules import Rule

    own, split = object(), object()
    made = []

    def rule(name, on):
        match = type("M", (), {"bytes_saved": 1, "flops_saved": 0.0})()
        return Rule(name, lambda g: [match] if g in on else [],
                    lambda g, matches=None: made.append((name, g)) or g, exact=True,
                    changes="")

    rules = [rule("both", (own, split)), rule("own only", (own,)), rule("split only", (split,))]
    sol = SimpleNamespace(graph=split, notes={"winner": "fission"}, solver="auto")
    parent = _Candidate((0,), own, (), sol, None)
    moves = {m.name: m for m in _moves(parent, rules)}
    for name in ("both", "own only", "split only"):
        moves[name].make()
    assert made == [("both", split), ("own only", own), ("split only", split)]
    assert moves["both"].change["on"] == ON_PLANNED and "on" not in moves["own only"].change
    # NOTE: a plan on the parent's own graph: every rule rewrites that
    made.clear()
    plain = _Candidate((0,), own, (), SimpleNamespace(graph=None, notes={}, solver="hotspot"),
                       None)
    for m in _moves(plain, rules):
        m.make()
    assert made == [("both", own), ("own only", own)]


def test_a_rule_that_does_not_pay_is_tried_on_its_better_half():
    """A rule with two or more matches carries a move on the half of them that save the most
    bytes (``HALF``), tried where the whole rule does not pay: all at once may cost more time
    than a latency limit leaves. The rule is then off that path, whole or half."""
    from fitgraph.solvers.coordinated import _Candidate
    from fitgraph.solvers.search_moves import HALF, _moves
    from fitgraph.transform.rules import Rule

    def match(b):
        return type("M", (), {"bytes_saved": b, "flops_saved": 0.0})()

    given = {}

    def rule(name, saved):
        ms = [match(b) for b in saved]
        return Rule(name, lambda g: ms,
                    lambda g, matches=None: given.setdefault(name, []).append(matches) or g,
                    exact=True, changes="")

    rules = [rule("three", [1, 5, 3]), rule("one", [100]), rule("two", [2, 8])]
    parent = _Candidate((0,), object(), (), None, None)
    moves = _moves(parent, rules)
    assert [m.name for m in moves] == ["one", "two", "three"]
    assert [m.half and m.half.name for m in moves] == [None, "two" + HALF, "three" + HALF]
    assert [m.half.change["matches"] for m in moves[1:]] == [1, 2]
    for m in moves[1:]:
        m.make(), m.half.make()
    assert [[m.bytes_saved for m in ms] for ms in given["three"]] == [[1, 5, 3], [5, 3]]
    assert [[m.bytes_saved for m in ms] for ms in given["two"]] == [[2, 8], [8]]
    halfway = _Candidate((0,), object(), ("two" + HALF,), None, None)
    assert [m.name for m in _moves(halfway, rules)] == ["one", "three"]


def test_fission_first_splits_are_each_regions_best_within_the_limit():
    """Fission's first round as alternatives: one split per region, each lowering the eager
    peak within the latency limit, least peak first; a split named in ``skip`` left out; each
    split graph runs like eager."""
    from fitgraph.solvers.fission.first_splits import first_splits

    model, batch, loss_fn = _loss_model()
    g = fitgraph.capture(model, batch, loss_fn)
    cm = RooflineCostModel(get_device("rtx3090"))
    eager = _eager(g, cm)
    found = first_splits(Problem(g, cm, latency_limit=2.0), deadline=float("inf"))
    assert len(found) >= 2
    sims = [_eager(split, cm) for _, split in found]
    assert all(s.peak_bytes < eager.peak_bytes for s in sims)
    assert all(s.latency_s <= 2.0 * eager.latency_s for s in sims)
    assert [s.peak_bytes for s in sims] == sorted(s.peak_bytes for s in sims)
    regions = [what.rsplit(" in ", 1)[0] for what, _ in found]
    assert len(set(regions)) == len(regions)
    rest = first_splits(Problem(g, cm, latency_limit=2.0), deadline=float("inf"),
                        skip=(found[0][0],))
    assert found[0][0] not in [what for what, _ in rest] and rest[0] == found[1]
    for _, split in found:
        assert_split_like_eager(g, split, model, batch, atol=1e-5)
    tight = first_splits(Problem(g, cm, latency_limit=1.0), deadline=float("inf"))
    assert all(_eager(split, cm).latency_s <= eager.latency_s for _, split in tight)


def test_splits_at_a_plans_peak_hold_its_node_first_and_the_search_moves_take_them():
    """``splits_at``: single splits, in 2 parts, of the regions live at a given plan's peak
    (here a remat plan's, not the eager plan's), those holding the peak's node first, each run
    like eager; the search takes them as moves only where auto's plan misses the budget and
    its error carries a plan at its least peak, and never where the problem is exact."""
    from types import SimpleNamespace as NS

    from fitgraph.solvers.fission.first_splits import splits_at
    from fitgraph.solvers.search_moves import AT_LEAST_PEAK, SPLIT, _least_peak_split_moves

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 16 * 16, 4))
    batch = torch.randn(8, 3, 16, 16)
    loss_fn = lambda m, b: m(b).square().mean()  # noqa: E731
    g = fitgraph.capture(model, batch, loss_fn)
    cm = RooflineCostModel(get_device("cpu-generic"))
    least = solve(Problem(g, cm, latency_limit=1e9), "dtr")
    node = least.plan[least.sim.peak_instruction].node
    found = splits_at(g, least.plan, least.sim, n=2)
    assert 1 <= len(found) <= 2 and all(" in 2 parts" in what for what, _ in found)
    for _, split in found:
        assert_split_like_eager(g, split, model, batch, atol=1e-5)
    # NOTE: the region holding the peak's node first: its node runs in parts there (DTR's
    # least-peak plan peaks at a convolution backward the eager plan's peak does not hold)
    name = g.nodes[node].name
    assert f"{name}.part0" in {n.name for n in found[0][1].nodes}

    err = NS(solution=least)
    infeasible = NS(solution=None, infeasible=err, graph=g)
    moves = _least_peak_split_moves(Problem(g, cm, budget_bytes=1), infeasible)
    assert [m.name for m in moves] == [SPLIT + what + AT_LEAST_PEAK
                                       for what, _ in splits_at(g, least.plan, least.sim)]
    assert _least_peak_split_moves(Problem(g, cm, budget_bytes=1, exact=True), infeasible) == []
    assert _least_peak_split_moves(Problem(g, cm, budget_bytes=1),
                                   NS(solution=least, infeasible=None, graph=g)) == []
    assert _least_peak_split_moves(Problem(g, cm, budget_bytes=1),
                                   NS(solution=None, infeasible=NS(solution=None), graph=g)) == []


# NOTE: ~24 s (two searches of 30 s on a small MLP): `make test-slow`
@pytest.mark.slow
def test_the_search_plans_auto_for_the_other_constraint():
    """From the captured graph the search plans auto for a budget below its own plan's peak
    (latency mode) or a limit at and below its own plan's step (budget mode), and judges each plan
    by the problem's constraint (``PROBE``): ranked by it where it holds it, else failed and
    not expanded."""
    from fitgraph.solvers import coordinated
    from fitgraph.solvers.search_moves import PROBE, PROBE_PEAKS

    model, batch, loss_fn = _loss_model()
    g = fitgraph.capture(model, batch, loss_fn)
    cm = RooflineCostModel(get_device("rtx3090"))
    eager = _eager(g, cm)
    latency = Problem(g, cm, latency_limit=1.5, time_budget_s=30)
    s = solve(latency, "search")
    first = s.notes["candidates"][0]
    probes = [c for c in s.notes["candidates"] if len(c["rules"]) == 1 and
              c["rules"][0].startswith(PROBE)]
    assert [c["changes"][c["rules"][0]]["budget"] for c in probes] == [
        int(f * first["peak_bytes"]) for f in PROBE_PEAKS]
    for c in probes:
        budget = c["changes"][c["rules"][0]]["budget"]
        assert ("failed" in c or (c["peak_bytes"] <= budget
                                  and c["latency_s"] <= 1.5 * eager.latency_s * (1 + 1e-9)))
    # NOTE: a probe is expanded only from a graph auto rewrote (its own moves from the
    # captured graph would be the first candidate's)
    after = {c["rules"][0] for c in s.notes["candidates"] if len(c["rules"]) > 1}
    assert not any("failed" in c for c in probes if c["rules"][0] in after)
    budget = int(0.5 * eager.peak_bytes)
    tight = Problem(g, cm, budget_bytes=budget, time_budget_s=30)
    s = solve(tight, "search")
    for c in s.notes["candidates"]:
        if len(c["rules"]) == 1 and c["rules"][0].startswith(PROBE):
            limit_s = c["changes"][c["rules"][0]]["latency"]
            assert c.get("failed") == "over the budget" or (
                c["peak_bytes"] <= budget and c["latency_s"] <= limit_s * (1 + 1e-9))

    # NOTE: latency mode: a probe's plan for a loose budget holds the limit and ranks by its
    # peak; for a budget under every plan's peak, none
    loose = coordinated._plan(latency, g, (PROBE,), {}, 10.0, 1.5 * eager.latency_s, False,
                              probe=("budget", eager.peak_bytes))
    assert loose.solution.sim.latency_s <= 1.5 * eager.latency_s * (1 + 1e-9)
    assert loose.rank == (0, loose.solution.sim.peak_bytes, loose.solution.sim.latency_s)
    none = coordinated._plan(latency, g, (PROBE,), {}, 10.0, 1.5 * eager.latency_s, False,
                             probe=("budget", eager.peak_bytes // 100))
    assert none.solution is None and none.dead_end
    # NOTE: budget mode: a probe's plan for a loose limit (auto's least peak) holds the budget
    # and ranks by its step; for the eager step's limit it is over the budget
    loose = coordinated._plan(tight, g, (PROBE,), {}, 10.0, None, True,
                              probe=("latency", 10 * eager.latency_s))
    assert loose.solution.sim.peak_bytes <= budget
    assert loose.rank == (0, loose.solution.sim.latency_s, loose.solution.sim.peak_bytes)
    tight_limit = coordinated._plan(tight, g, (PROBE,), {}, 10.0, None, True,
                                    probe=("latency", eager.latency_s))
    assert tight_limit.solution is None and tight_limit.error == "over the budget"


def test_a_split_graph_is_planned_on_its_measured_eager_step():
    """Fission's first splits (``SPLIT``): the split graph's eager step is timed against the
    captured graph's before it is planned, and its plans are judged by their simulated steps
    scaled by what the simulator missed there (``CALIBRATED``): measured faster than it
    simulates, the split is planned for the looser limit that leaves (a lower peak, within
    the limit as scaled); measured over the limit, it is not planned; a candidate made from
    it keeps its factor, and in budget mode ranks by its scaled step."""
    from test_search_timing import _Timed

    from fitgraph.solvers import coordinated
    from fitgraph.solvers.fission.first_splits import first_splits
    from fitgraph.solvers.search_moves import SPLIT, _Move
    from fitgraph.solvers.search_timing import CALIBRATED

    model, batch, loss_fn = _loss_model()
    g = fitgraph.capture(model, batch, loss_fn)
    roofline = RooflineCostModel(get_device("rtx3090"))
    eager_s, limit = _eager(g, roofline).latency_s, 1.5
    timed = _Timed(roofline, 1.0)
    problem = Problem(g, timed, latency_limit=limit, time_budget_s=30)
    what, split = first_splits(problem, deadline=float("inf"))[0]
    own_s = _eager(split, roofline).latency_s
    first = coordinated._plan(problem, g, (), {}, 10.0, limit * eager_s, False)
    move = _Move(SPLIT + what, lambda: split, {"split": what}, calibrate=True)

    def child(ratio):
        timed.ratio, timed.asked = ratio, 0
        c = coordinated._child(problem, first, move, set(), 10.0, limit * eager_s, False,
                               eager_s)
        assert timed.asked == 1   # NOTE: its eager step, timed once
        return c

    same, fast, slow = child(own_s / eager_s), child(0.6 * own_s / eager_s), child(limit + 0.1)
    assert same.factor == pytest.approx(1.0) and fast.factor == pytest.approx(0.6)
    assert fast.changes[move.name] == {"split": what, CALIBRATED: 0.6}
    assert fast.solution.sim.latency_s * 0.6 <= limit * eager_s * (1 + 1e-9)
    assert fast.solution.sim.latency_s > same.solution.sim.latency_s
    assert fast.solution.sim.peak_bytes < same.solution.sim.peak_bytes
    assert slow.solution is None and slow.error == "its eager step is over the latency limit"
    timed.asked = 0
    again = _Move("again", lambda: fast.graph, {})
    kid = coordinated._child(problem, fast, again, set(), 10.0, limit * eager_s, False, eager_s)
    assert kid.factor == fast.factor and timed.asked == 0
    budget = Problem(g, timed, budget_bytes=_eager(g, roofline).peak_bytes)
    planned = coordinated._plan(budget, split, ("split",), {}, 10.0, None, True, factor=0.6)
    assert planned.rank[1] == pytest.approx(0.6 * planned.solution.sim.latency_s)
    assert planned.step_s == pytest.approx(planned.rank[1])
