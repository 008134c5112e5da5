"""The co-search (issue 29): its bound is a bound (no plan beats it, on random chips), the
batched bounds are the single ones, and the pruning is safe — on a small space the co-search
finds what planning every configuration finds."""

from __future__ import annotations

import json
import random

import pytest

from fitgraph.dist import GptShape
from fitgraph.hw.area import area_budget, chip_area
from fitgraph.hw.bound import step_bound, step_bounds
from fitgraph.hw.chip import CHIPS
from fitgraph.hw.search import Candidate, co_search, plan_chip
from fitgraph.hw.space import Space, configurations

SHAPE = GptShape(8, 1024, 16, seq=512, vocab=32000)
DEVICES, BATCH = 16, 64
SMALL = Space(array_sides=(32, 128), tensor_cores=(2, 8, 32), vector_cores=(1, 8),
              sram_mib=(8, 128), hbm_bandwidth=(1.2e12, 3.35e12), links=((6, 50e9),))


def _random_chips(n: int, seed: int = 0):
    rng = random.Random(seed)
    base = CHIPS["tpuv4"]
    for _ in range(n):
        yield base.replace(
            tensor_cores=rng.choice([1, 2, 4, 8, 16, 64]),
            array_rows=rng.choice([8, 32, 64, 128, 256]),
            array_cols=rng.choice([8, 32, 64, 128, 256]),
            vector_cores=rng.choice([1, 2, 8, 32]), vector_lanes=rng.choice([16, 128]),
            sram_bytes=rng.choice([2, 16, 128]) * 2**20,
            hbm_bandwidth=rng.choice([0.8e12, 1.2e12, 3.35e12]),
            links=rng.choice([4, 6]), link_bandwidth=rng.choice([25e9, 100e9]))


@pytest.mark.parametrize("chip", list(_random_chips(8)))
def test_no_plan_beats_the_bound_on_random_chips(chip):
    cand = plan_chip(Candidate(chip, 0.0, 1.0, 0.0), SHAPE, DEVICES, BATCH)
    bound = step_bound(chip, SHAPE, DEVICES, BATCH)
    assert cand.tokens_per_s > 0, cand.binding
    assert cand.step_s >= bound


def test_the_batched_bounds_are_the_single_ones():
    chips = list(_random_chips(12, seed=3))
    batched = step_bounds(chips, SHAPE, DEVICES, BATCH)
    for chip, b in zip(chips, batched):
        assert b == pytest.approx(step_bound(chip, SHAPE, DEVICES, BATCH), rel=1e-12)


def test_the_space_keeps_what_fits_the_budget():
    import dataclasses

    budget = area_budget("tpuv4")
    chips = list(configurations(SMALL, budget))
    assert {c.hbm_bytes for c in chips} == {CHIPS["tpuv4"].hbm_bytes}
    big = list(configurations(dataclasses.replace(SMALL, hbm_gib=80), budget))
    assert len(big) == len(chips) and {c.hbm_bytes for c in big} == {80 * 2**30}
    assert 0 < len(chips) < SMALL.size()
    assert all(chip_area(c).total <= budget for c in chips)
    assert len({c.name for c in chips}) == len(chips)


# NOTE: ~12 s each: the second objective runs in `make test-slow`
@pytest.mark.parametrize("objective", ["throughput",
                                       pytest.param("perf-per-area", marks=pytest.mark.slow)])
def test_the_co_search_finds_what_planning_every_configuration_finds(objective):
    r = co_search(SHAPE, DEVICES, BATCH, space=SMALL, objective=objective)
    assert r.configs_evaluated + r.pruned + r.unresolved == r.configs_in_budget
    assert r.unresolved == 0 and r.pruned > 0      # the bound saved planning, safely:
    every = [plan_chip(Candidate(c.chip, c.area_mm2, c.power_w, c.bound_tokens_per_s),
                       SHAPE, DEVICES, BATCH)
             for c in [*r.evaluated, *_unplanned(r)]]
    best = max(every, key=lambda c: c.score(objective))
    assert r.best.score(objective) == pytest.approx(best.score(objective))
    front = r.pareto()
    assert all(a.area_mm2 <= b.area_mm2 and a.tokens_per_s < b.tokens_per_s
               for a, b in zip(front, front[1:]))
    out = r.to_json()
    assert {"configs_evaluated", "search_s", "best", "baseline", "pareto"} <= set(out)
    json.dumps(out)


def _unplanned(r):
    from fitgraph.hw.search import _candidates

    planned = {c.chip.name for c in r.evaluated}
    chips = [c for c in configurations(SMALL, r.budget_mm2) if c.name not in planned]
    return _candidates(chips, SHAPE, DEVICES, BATCH)


def test_a_time_limit_reports_what_it_left_unplanned():
    r = co_search(SHAPE, DEVICES, BATCH, space=SMALL, time_limit_s=0.0)
    assert r.configs_evaluated == 0 and r.best is None
    assert r.unresolved == r.configs_in_budget
    assert r.baseline.tokens_per_s > 0            # the baseline is planned regardless


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="objective"):
        co_search(SHAPE, DEVICES, BATCH, space=SMALL, objective="speed")
    with pytest.raises(ValueError, match="area budget"):
        area_budget("tpu-v9")


def test_the_cli_prints_the_search_as_json_and_plots_it(tmp_path, capsys):
    from fitgraph.cli import main

    plot = tmp_path / "pareto.png"
    rc = main(["hw-search", "gpt", "--layers", "8", "--hidden", "1024", "--heads", "16",
               "--seq", "512", "--vocab", "32000", "--devices", "16", "--global-batch", "64",
               "--space", "small", "--json", "--plot", str(plot)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["configs_evaluated"] > 0 and out["best"]["tokens_per_s"] > 0
    assert out["gain"] >= 1.0 and plot.stat().st_size > 0
    rc = main(["hw-search", "bert-large", "--devices", "16", "--global-batch", "64",
               "--space", "small", "--objective", "perf-per-watt", "--hbm-gib", "80"])
    text = capsys.readouterr().out
    assert rc == 0 and "baseline (TPUv4-like)" in text and "best / baseline" in text


@pytest.mark.slow
def test_the_cli_searches_for_a_zoo_model(capsys):
    from fitgraph.cli import main

    # a zoo model: its step captured, re-timed on each chip
    rc = main(["hw-search", "gpt2", "--devices", "8", "--global-batch", "32", "--space",
               "small", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["best"]["tokens_per_s"] >= out["baseline"]["tokens_per_s"] > 0


def test_the_benchmarks_table_reads_saved_searches(tmp_path):
    from fitgraph.bench import hw_search

    r = co_search(SHAPE, DEVICES, BATCH, space=SMALL)
    (tmp_path / "search_gpt2-xl.json").write_text(json.dumps(r.to_json()))
    table = hw_search.markdown(tmp_path)
    assert table.count("\n") == 2 and "| gpt2-xl |" in table and "x |" in table


@pytest.fixture(scope="module")
def captured():
    import torch

    import fitgraph
    from fitgraph.dist.graph_model import GraphModel
    from fitgraph.hw.area import TPUV4_LIKE
    from fitgraph.hw.cost_model import ChipCostModel

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                                    torch.nn.Linear(512, 256))
                                for _ in range(4)])
    g = fitgraph.capture(net, torch.randn(32, 256), lambda m, x: m(x).square().mean())
    return GraphModel(g, ChipCostModel(TPUV4_LIKE), batch_size=32)


@pytest.mark.parametrize("chip", list(_random_chips(4, seed=7)))
def test_no_plan_of_a_captured_model_beats_its_bound(chip, captured):
    from fitgraph.hw.bound import graph_step_bounds

    cand = plan_chip(Candidate(chip, 0.0, 1.0, 0.0), captured, DEVICES, 256)
    assert cand.tokens_per_s > 0, cand.binding
    assert cand.step_s >= graph_step_bounds([chip], captured, DEVICES, 256)[0]


def test_a_captured_model_is_re_timed_on_each_chip(captured):
    from fitgraph.hw.cost_model import ChipCostModel

    slow, fast = (captured.retimed(ChipCostModel(CHIPS["tpuv4"].replace(tensor_cores=n)))
                  for n in (1, 8))
    a, b = (sum(op.seconds for blk in m.blocks(1, 32, False) for op in blk.ops)
            for m in (slow, fast))
    assert b < a


@pytest.mark.slow
def test_the_co_search_takes_a_captured_model(captured):
    r = co_search(captured, DEVICES, 256, space=SMALL)
    assert r.best is not None and r.best.tokens_per_s >= r.baseline.tokens_per_s
    assert r.unresolved == 0
