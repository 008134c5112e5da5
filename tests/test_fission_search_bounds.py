"""The budget-mode fission search: what it may skip and what it must not miss.

- No plan on a split graph is faster than that graph's eager plan, so once a region's split is
  slower than remat alone's plan, the search makes no more parts of it (they would be slower
  still): on ViT-B/16 that was 20 s of split graphs built for nothing.
- A split that fits the budget by itself (a whole model run in parts: slow) must not hide a
  cheap split that needs remat on top (the chunked loss): the "cheapest" path ranks both by
  bytes saved per second added.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import fitgraph
from fitgraph import zoo
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.solvers import Problem, solve
from fitgraph.solvers.fission import search as fission_solver
from fitgraph.solvers.fission.search import solve_fission

ROOFLINE = RooflineCostModel(get_device("rtx3090"))


def _meta_case(name: str):
    case = zoo.build(name, "small", device=torch.device("meta"))
    return fitgraph.capture(case.model, case.batch, case.loss_fn)


def test_no_more_parts_of_a_split_slower_than_remat_alone(monkeypatch):
    g = _meta_case("vit-b16")
    eager = solve(Problem(g, ROOFLINE, latency_limit=1.0), "eager").sim
    budget = eager.peak_bytes // 2
    alone = solve(Problem(g, ROOFLINE, budget_bytes=budget), "hotspot").sim.latency_s
    built: list[tuple[tuple, int, float]] = []
    make = fission_solver._split

    def traced(base, region, k, cm):
        step = make(base, region, k, cm)
        if hasattr(step, "sim"):
            built.append(((id(base), region.start, tuple(region.nodes)), k, step.sim.latency_s))
        return step

    monkeypatch.setattr(fission_solver, "_split", traced)
    s = solve_fission(Problem(g, ROOFLINE, budget_bytes=budget))
    assert s.sim.peak_bytes <= budget and s.sim.latency_s <= alone
    slower = [(region, k) for region, k, latency in built if latency > alone]
    assert slower, "the case must hold a region whose split is slower than remat alone"
    for region, k in slower:
        more = [kk for r, kk, _ in built if r == region and kk > k]
        assert not more, f"made {more} parts of a region already slower than remat at {k}"


def _sim(peak: int, latency: float) -> SimpleNamespace:
    return SimpleNamespace(peak_bytes=peak, latency_s=latency)  # NOTE: all _better reads


def test_cheapest_path_ranks_a_fitting_split_by_bytes_per_second_too():
    cur = _sim(1000, 1.0)
    fits_slowly = _sim(400, 2.0)        # fits a budget of 500, +100% time for 600 bytes
    cheap = _sim(700, 1.01)             # over it, +1% time for 300 bytes: remat does the rest
    better = fission_solver._better
    assert better(cheap, fits_slowly, cur, 500, "cheapest", rounds_left=6)
    assert better(fits_slowly, cheap, cur, 500, "deepest", rounds_left=6)


def test_a_split_that_fits_alone_does_not_hide_the_chunked_loss():
    g = _meta_case("llama")
    eager = solve(Problem(g, ROOFLINE, latency_limit=1.0), "eager").sim
    s = solve_fission(Problem(g, ROOFLINE, budget_bytes=eager.peak_bytes // 2))
    # NOTE: the whole model in 4 parts fits alone at 2.1x; the loss in parts + remat: 1.08x
    assert s.sim.latency_s <= 1.2 * eager.latency_s, s.notes["splits"]
    assert any("_log_softmax" in what for what in s.notes["splits"])
