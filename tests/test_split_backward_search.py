"""split_backward's rounds: which planned candidate a round keeps (the search, not the splits:
candidates and their plans are stubbed, each candidate's graph planned to a given peak)."""

import dataclasses

import pytest

from fitgraph.cost.base import BaseCostModel
from fitgraph.solvers.base import Problem, Solution
from fitgraph.solvers.fission import split_backward as fb


@dataclasses.dataclass
class _Sim:
    peak_bytes: int


def _maker(name: str):
    """Makes the candidate's graph (its name, with "@<parts>" past ``fb.PARTS``); "bad" in
    the name: the split fails; a name starting "W-": a re-made region with a looser trim,
    whose graph is the name with "~0.25"."""
    def make(graph, parts, deadline):
        if "bad" in name:
            raise fb.FissionError(f"{name}: cannot split")
        return name if parts == fb.PARTS else f"{name}@{parts}"
    if name.startswith("W-"):
        make.share, make.widens = 1.0, lambda graph: True
        make.wider = lambda: _copies(name, 0.25)
    return make


def _sol(peak: int) -> Solution:
    return Solution(plan=[], sim=_Sim(peak), solver="hotspot", solve_s=0.0)


@pytest.fixture(autouse=True)
def _nothing_to_fold(monkeypatch):
    """The path's graph as made: no part's products to sum in place (see
    ``test_the_path_with_its_products_summed_in_place_is_kept_where_lower``)."""
    monkeypatch.setattr(fb, "products_folded", lambda graph: graph)


@pytest.fixture
def rounds(monkeypatch):
    """Runs split_backward on rounds of candidates: ``rounds[i]`` the (name, kind, peak) or
    (name, kind, peak, screened peak) of round i's candidates in their ranked order (kind:
    "copies" or "plain"; a region's start is the name up to a ":"; screened: the peak planned
    unless given); returns the splits kept, the peak reached and the candidates planned."""
    def run(per_round: list[list[tuple]], start_peak: int = 1000, again: dict | None = None,
            moved: frozenset = frozenset(), budget: int | None = None):
        peaks = {c[0]: c[2] for cands in per_round for c in cands} | (again or {})
        screens = {c[0]: c[-1] for cands in per_round for c in cands}
        calls = iter(per_round)

        def candidates(graph, best):
            cands = next(calls, [])
            return [(c[0], c[1], (c[0].split(":")[0], 0), _maker(c[0])) for c in cands]

        def least(graph, cm, deadline, t0, total):
            return _sol(start_peak if graph == "start" else peaks.get(graph, start_peak))

        monkeypatch.setattr(fb, "candidates", candidates)
        monkeypatch.setattr(fb, "_least", least)
        def screen(graph, cm, dropped):
            if screens[graph] is None:
                raise RuntimeError(f"profiling {graph} failed")
            return screens[graph]

        monkeypatch.setattr(fb, "_screen", screen)
        # NOTE: where each plan peaks: elsewhere on the graphs named in ``moved``
        monkeypatch.setattr(fb, "_peak_at",
                            lambda graph, sol: "elsewhere" if graph in moved else "here")
        monkeypatch.setattr(fb, "prepared", lambda g: "start")
        s = fb.split_backward(Problem("start", BaseCostModel(), latency_limit=1e9, time_budget_s=60),
                              target_bytes=budget)
        planned = [t.split(": screened")[0] for t in s.notes["tried"] if ": screened" in t]
        return s.notes["splits"], s.sim.peak_bytes, planned
    return run


def test_candidates_are_planned_in_the_order_of_their_screened_peaks(rounds):
    # NOTE: Bloom: the attention split whole ranked first on the bytes it holds and planned
    # 40 MB against 17 unsplit; its screen says so before a plan is made
    splits, peak, planned = rounds([[("whole", "plain", 4000), ("worse", "plain", 1500),
                                     ("copies", "copies", 990)]])
    assert planned == ["copies", "worse"] and splits == ["copies"] and peak == 990


def test_the_best_screened_of_each_kind_is_planned(rounds):
    # NOTE: Swin: a screen carries the plan's drops over, which suit a plain split and not a
    # region re-made in the backward: the MLP's tokens re-made screened above two plain splits
    # and were never planned, though they planned lowest
    splits, peak, planned = rounds([[("p1", "plain", 1100, 950), ("p2", "plain", 1050, 960),
                                     ("mlp", "copies", 900, 2000)]])
    assert planned == ["p1", "mlp"] and splits == ["mlp"] and peak == 900


def test_a_small_gain_does_not_end_the_round(rounds):
    # NOTE: Swin: the first candidate that lowered the peak (by 1.4%) was kept and the
    # attention copies, 8.5% lower, never planned
    splits, peak, _ = rounds([[("mlp", "plain", 990, 950), ("attention", "copies", 915, 960)]])
    assert splits == ["attention"] and peak == 915


def test_a_large_gain_does_not_end_the_round(rounds):
    # NOTE: Swin: the MLP backward along its rows (-4.3%) ended round 1 before its MLP re-made
    # along the tokens (-9.5%, and two more splits after it) was planned
    splits, peak, planned = rounds([[("rows", "plain", 950), ("tokens", "copies", 900, 960)],
                                    [("loss", "plain", 850)]])
    assert planned[:2] == ["rows", "tokens"] and splits == ["tokens", "loss"] and peak == 850


def test_where_the_rounds_end_the_search_goes_on_from_a_runner_up(rounds):
    splits, peak, planned = rounds([[("a", "plain", 900), ("b", "copies", 950)],
                                    [("a2", "plain", 901)],        # NOTE: from a: no gain
                                    [("b2", "plain", 800)]])       # NOTE: from b
    assert planned == ["a", "b", "a2", "b2"] and splits == ["b", "b2"] and peak == 800


def test_a_runner_up_that_ends_higher_is_not_kept(rounds):
    splits, peak, _ = rounds([[("a", "plain", 900), ("b", "copies", 950)],
                              [("a2", "plain", 850)], [],          # NOTE: from a, then a2
                              [("b2", "plain", 920)]])             # NOTE: from b
    assert splits == ["a", "a2"] and peak == 850


def test_the_rounds_best_small_gain_is_kept(rounds):
    splits, peak, _ = rounds([[("a", "plain", 995), ("b", "plain", 985, 999)]])
    assert splits == ["b"] and peak == 985


def test_the_path_made_again_in_more_parts_is_kept_where_lower(rounds):
    # NOTE: Falcon: its attention re-made in 8 parts holds an eighth of the scores at once;
    # the path made again in 16 halves that (1.262x -> 1.257x the lower bound)
    again = f"the 2 splits again in up to {fb.REPLAY_PARTS} parts"
    splits, peak, _ = rounds([[("a", "plain", 900)], [("b", "copies", 850)]],
                             again={f"b@{fb.REPLAY_PARTS}": 800})
    assert splits == ["a", "b", again] and peak == 800


def test_the_rounds_go_on_from_the_path_made_again(rounds):
    # NOTE: Falcon: in 16 parts the peak moved from block 0's attention to its MLP backward
    again = f"the split again in up to {fb.REPLAY_PARTS} parts"
    splits, peak, _ = rounds([[("a", "plain", 900)], [], [("mlp", "copies", 800)]],
                             again={f"a@{fb.REPLAY_PARTS}": 850})
    assert splits == ["a", again, "mlp"] and peak == 800


def test_the_path_made_again_in_more_parts_is_dropped_where_higher(rounds):
    splits, peak, _ = rounds([[("a", "plain", 900)]], again={f"a@{fb.REPLAY_PARTS}": 950})
    assert splits == ["a"] and peak == 900


def test_a_try_whose_peak_moved_is_a_detour_the_search_goes_on_from(rounds):
    # NOTE: Gemma-2: its MLP re-made in parts moved the peak from the MLP backward (22.98 MB)
    # to the loss (23.97 MB); a chunked loss then went below both (22.66)
    splits, peak, planned = rounds([[("mlp", "copies", 1040)], [("loss", "plain", 900)]],
                                   moved=frozenset({"mlp"}))
    assert planned == ["mlp", "loss"]
    assert splits == ["mlp (a detour)", "loss"] and peak == 900


def test_a_higher_try_whose_peak_stayed_is_no_detour(rounds):
    splits, peak, planned = rounds([[("mlp", "copies", 1040)], [("loss", "plain", 900)]])
    assert planned == ["mlp"] and splits == [] and peak == 1000


def test_a_detour_far_above_the_rounds_start_is_not_taken(rounds):
    high = int(1000 * (1 + fb.DETOUR)) + 1
    splits, peak, planned = rounds([[("mlp", "copies", high)], [("loss", "plain", 900)]],
                                   moved=frozenset({"mlp"}))
    assert planned == ["mlp"] and splits == [] and peak == 1000


def test_a_detour_that_ends_higher_is_not_kept(rounds):
    splits, peak, _ = rounds([[("a", "plain", 950), ("mlp", "copies", 1040)], [],
                              [("loss", "plain", 990)]], moved=frozenset({"mlp"}))
    assert splits == ["a"] and peak == 950


def test_the_search_stops_at_the_first_plan_within_the_budget(rounds):
    # NOTE: a budget set to the peak a search reported: planned again at it, the search must
    # not spend its whole time (Gemma-2: 229 s a second time) past the plan that fits
    splits, peak, planned = rounds([[("a", "plain", 900), ("b", "copies", 950)],
                                    [("a2", "plain", 800)], [("a3", "plain", 700)]],
                                   budget=800)
    assert splits == ["a", "a2"] and peak == 800 and planned == ["a", "b", "a2"]


def test_a_budget_the_unsplit_plan_meets_makes_no_split(rounds):
    splits, peak, planned = rounds([[("a", "plain", 900)]], budget=1000)
    assert splits == [] and peak == 1000 and planned == []


@pytest.mark.parametrize("folded_peak, kept", [(850, True), (950, False)])
def test_the_path_with_its_products_summed_in_place_is_kept_where_lower(rounds, monkeypatch,
                                                                         folded_peak, kept):
    monkeypatch.setattr(fb, "products_folded", lambda graph: graph + "+folded")
    splits, peak, _ = rounds([[("a", "plain", 900)]], again={"a+folded": folded_peak})
    assert peak == (folded_peak if kept else 900)
    assert (splits[-1] == "each part's products summed in place") is kept


def test_a_path_within_the_budget_is_not_summed_in_place(rounds, monkeypatch):
    monkeypatch.setattr(fb, "products_folded", lambda graph: graph + "+folded")
    splits, peak, _ = rounds([[("a", "plain", 900)]], again={"a+folded": 850}, budget=950)
    assert splits == ["a"] and peak == 900


def test_a_budget_no_plan_meets_searches_every_path(rounds):
    splits, peak, _ = rounds([[("a", "plain", 900), ("b", "copies", 950)],
                              [("a2", "plain", 901)], [("b2", "plain", 800)]], budget=10)
    assert splits == ["b", "b2"] and peak == 800


def test_no_gain_ends_the_search(rounds):
    splits, peak, _ = rounds([[("a", "plain", 1000), ("b", "copies", 1200)],
                              [("later", "plain", 10)]])
    assert splits == [] and peak == 1000


def test_each_kind_gets_half_the_screens(rounds):
    # NOTE: the plain candidates past half the screens are not made; the copies one is
    plain = [(f"p{i}", "plain", 999 - i) for i in range(fb.SCREEN)]
    splits, peak, planned = rounds([plain + [("c", "copies", 990)]])
    assert splits == ["c"] and peak == 990
    assert planned[0] == "c" and f"p{fb.SCREEN // 2}" not in planned


def test_one_share_of_a_start_per_round(rounds):
    # NOTE: HuBERT: two shares of the convolution backward along the channels took the plain
    # tries from the split along the time, which runs the peak's workspace in parts
    shares = [(f"channels:{k} nodes", "plain", 1010) for k in range(fb.SCREEN)]
    splits, peak, _ = rounds([shares + [("time:2 nodes", "plain", 900)]])
    assert splits == ["time:2 nodes"] and peak == 900


def test_a_start_whose_split_fails_keeps_its_other_shares(rounds):
    splits, peak, _ = rounds([[("mlp:bad", "plain", 0), ("mlp:tight", "plain", 950)]])
    assert splits == ["mlp:tight"] and peak == 950


def test_every_block_alike_stops_at_the_deadline():
    import torch

    import fitgraph
    from fitgraph.graph.ir import Phase
    from fitgraph.solvers.fission.backward_regions import alike_split_recipe

    mlp = lambda: torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(),  # noqa: E731
                                      torch.nn.Linear(64, 8))
    model = torch.nn.Sequential(*(mlp() for _ in range(3)))
    g = fitgraph.capture(model, torch.randn(32, 8), lambda m, x: m(x).square().mean())
    grad = next(n.outputs[0] for n in g.nodes
                if n.phase is Phase.BACKWARD and n.target == "aten.gelu_backward.default")
    make = alike_split_recipe(g.values[grad].name, 0, 0.0)
    assert make(g, fb.PARTS, float("inf")) is not g
    with pytest.raises(fb.FissionError, match="out of time after 0 of 3"):
        make(g, fb.PARTS, 0.0)


def test_a_candidate_whose_ops_cannot_run_is_passed_over(rounds):
    # NOTE: RegNet: a split graph's convolution in 0 groups failed its profiling, which ended
    # the whole plan with a RuntimeError
    splits, peak, planned = rounds([[("broken", "copies", 100, None), ("ok", "plain", 950)]])
    assert splits == ["ok"] and peak == 950 and "broken" not in planned



@dataclasses.dataclass
class _At:
    peak_instruction: int


def test_where_a_plan_peaks_is_named_by_the_node_its_parts_and_copies_come_from():
    from fitgraph.graph.ir import GraphBuilder, Phase, Role
    from fitgraph.plan.instructions import Compute

    b = GraphBuilder()
    x = b.add_input("x", (4,), "float32", Role.PARAMETER)
    y = b.add_node("aten.exp.default", [x], [((4,), "float32")], name="exp_3.re.part1",
                   phase=Phase.BACKWARD)[0]
    g = b.finish({"loss": y})

    def at(pc):
        return fb._peak_at(g, Solution(plan=[Compute(0)], sim=_At(pc), solver="hotspot",
                                       solve_s=0.0))

    assert at(0) == "exp_3"
    assert at(-1) is None   # NOTE: the peak is what exists before the step


def _copies(name: str, share: float, looser: tuple = ()):
    """A re-made region's recipe with ``share`` and its looser trims (``copies_recipe``)."""
    make = _maker(f"{name}~{share}")
    make.share = share
    make.wider = (lambda: _copies(name, looser[0], looser[1:])) if looser else None
    make.widens = lambda graph: bool(looser) and "same" not in name
    return make


def test_a_kept_re_made_region_is_tried_wider_where_the_path_ends(monkeypatch):
    """BEiT: the tightest re-made scores recomputed their relative position bias whole; the
    next trim re-makes its gather in parts too (16.69 -> 16.28 MiB)."""
    planned = {"start": 1000, "attn~1.0": 900, "attn~0.25": 850, "attn~0.0": 870}
    monkeypatch.setattr(fb, "_least", lambda g, cm, d, t0, total: _sol(planned[g]))
    recipe = _copies("attn", 1.0, (0.25, 0.0))
    final = fb._Path("attn~1.0", _sol(900), ["attn"], [recipe])
    tried: list[str] = []
    wider = fb._widened(final, "start", None, float("inf"), 0.0, 60.0, tried)
    assert wider.graph == "attn~0.25" and wider.sol.sim.peak_bytes == 850
    assert wider.recipes[0].share == 0.25 and "re-made wider (share 0.25)" in wider.splits[-1]
    # NOTE: a wider region that plans higher is not kept; one that cannot be made is noted
    planned["attn~0.25"] = 950
    assert fb._widened(final, "start", None, float("inf"), 0.0, 60.0, tried) is final
    bad = _copies("bad", 1.0, (0.25,))
    path = fb._Path("x", _sol(900), ["bad"], [bad])
    assert fb._widened(path, "start", None, float("inf"), 0.0, 60.0, tried) is path
    assert "FissionError" in tried[-1]
    # NOTE: a looser trim that re-makes the same nodes is not planned (Swin's MLP)
    same = fb._Path("x", _sol(900), ["same"], [_copies("same", 1.0, (0.25,))])
    count = len(tried)
    assert fb._widened(same, "start", None, float("inf"), 0.0, 60.0, tried) is same
    assert len(tried) == count


def test_where_no_candidate_lowers_the_peak_the_kept_region_is_tried_wider(rounds):
    """The widened path is a round's gain: the rounds go on from it (and the replay after)."""
    splits, peak, _ = rounds([[("W-attn", "copies", 900)], [("worse", "plain", 950)],
                              [("loss", "plain", 700)]],
                             again={"W-attn~0.25": 800})
    assert splits[:2] == ["W-attn", "split 1 re-made wider (share 0.25)"]
    assert splits[-1] == "loss" and peak == 700


def test_a_later_split_whose_start_the_wider_region_took_in_is_left_out(monkeypatch):
    """BEiT: the scores re-made wider ran the forward's dropout in parts, the start of the
    path's next split: the wider path is planned without it (17.76 -> 17.21 MB), not
    dropped."""
    planned = {"start": 1000, "attn~1.0": 900, "attn~0.25": 850}
    monkeypatch.setattr(fb, "_least", lambda g, cm, d, t0, total: _sol(planned[g]))
    attn, gone = _copies("attn", 1.0, (0.25,)), _maker("gone-bad")
    final = fb._Path("attn~1.0", _sol(900), ["attn", "gone"], [attn, gone])
    tried: list[str] = []
    wider = fb._widened(final, "start", None, float("inf"), 0.0, 60.0, tried)
    assert wider.graph == "attn~0.25" and wider.sol.sim.peak_bytes == 850
    assert len(wider.recipes) == 1 and wider.recipes[0].share == 0.25
    assert any("split 2 left out" in t for t in tried)
    # NOTE: a split before the widened one (or the widened one itself) failing fails the try
    bad = fb._Path("x", _sol(900), ["bad", "attn"], [_copies("bad", 1.0, (0.25,)), attn])
    assert fb._widened(bad, "start", None, float("inf"), 0.0, 60.0, tried) is bad


def test_a_round_that_plans_nothing_lower_screens_its_next_candidates(rounds):
    # NOTE: BEiT: round 1 planned its two best-screened candidates, neither lower; with no
    # runner-up the 240 s search ended in 24 s
    page = [(f"p{i}", "plain", 1000 + i) for i in range(fb.SCREEN // 2)]
    splits, peak, planned = rounds([page + [("next", "plain", 900)]])
    assert planned == ["p0", "p1", "next"] and splits == ["next"] and peak == 900
    # NOTE: up to PAGES pages a round
    pages = [(f"q{i}", "plain", 1000 + i) for i in range(fb.PAGES * fb.SCREEN // 2)]
    splits, peak, planned = rounds([pages + [("late", "plain", 900)]])
    assert splits == [] and peak == 1000 and "late" not in planned
    assert len(planned) == fb.PAGES * fb.TRIES
