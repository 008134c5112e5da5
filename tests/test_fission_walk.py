"""The fission search's part walk: the "cheapest" greedy path takes a chosen split in more parts
without a new round while the rates its round saw say so; the plan is the one the round-by-round
search finds, from fewer split graphs."""

from __future__ import annotations

import pytest
import torch

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.plan.eager import eager_plan
from fitgraph.sim import simulate
from fitgraph.solvers import Problem
from fitgraph.solvers.fission import search as fission_solver
from fitgraph.solvers.fission.search import solve_fission

CM = RooflineCostModel(get_device("rtx3090"))


def _lm_head(vocab: int = 8192, rows: int = 2048, depth: int = 4):
    """A loss over a large vocabulary after ``depth`` hidden layers: its logits and their
    gradient are the peak, and the loss alone in parts does not reach the tighter budgets."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 256), torch.nn.Tanh()]
    for _ in range(depth):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, vocab))
    batch = (torch.randn(rows, 32), torch.randint(0, vocab, (rows,)))
    return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _solve_counting(monkeypatch, problem, walk: bool):
    made = []
    split = fission_solver._split

    def counted(*args):
        made.append(args[2])
        return split(*args)

    monkeypatch.setattr(fission_solver, "_split", counted)
    if not walk:
        monkeypatch.setattr(fission_solver, "_walk_parts", lambda before, chosen, *_: chosen)
    try:
        return solve_fission(problem), len(made)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("frac", [0.5, 0.35, 0.25])
def test_the_walk_finds_the_round_by_round_plan_from_fewer_split_graphs(monkeypatch, frac):
    model, batch, loss_fn = _lm_head()
    g = fitgraph.capture(model, batch, loss_fn)
    eager = simulate(g, eager_plan(g), CM)
    problem = Problem(g, CM, budget_bytes=int(frac * eager.peak_bytes), time_budget_s=60)
    rounds, made_rounds = _solve_counting(monkeypatch, problem, walk=False)
    walked, made_walked = _solve_counting(monkeypatch, problem, walk=True)
    assert walked.notes["splits"] == rounds.notes["splits"]
    assert (walked.sim.peak_bytes, walked.sim.latency_s) == (rounds.sim.peak_bytes,
                                                             rounds.sim.latency_s)
    assert walked.sim.peak_bytes <= problem.budget_bytes
    assert made_walked < made_rounds, (made_walked, made_rounds)
