"""Progress on long waits: said when asked (optimize, the backend, the CLI), quiet otherwise."""

from __future__ import annotations

import pytest
import torch
from test_compile_backend import _batch, mlp, mlp_loss

import fitgraph
from fitgraph import progress


def _mlp_case():
    # NOTE: activations dominate (AdamW's state would put 0.6 of the peak out of reach)
    model, batch = mlp(depth=6, dropout=False), _batch(n=4096)
    return model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_optimize_says_each_wait_and_what_each_option_reached(capsys):
    model, batch, opt = _mlp_case()
    lines = []
    fitgraph.optimize(model, batch, mlp_loss, opt, budget=0.6, time_budget=5,
                      progress=lines.append)
    text = "\n".join(lines)
    for said in ("planning the step for batch shapes (4096, 256), (4096, 256) ...",
                 "capturing forward, backward and optimizer step: done in",
                 "costing", "solving (auto, up to 5 s) ...", "hotspot: ", "plan: peak"):
        assert said in text, (said, text)
    assert "done in" in lines[-1] and lines[-1].startswith("planning the step")
    assert capsys.readouterr().err == "", "a callable gets the lines, not stderr"


def test_library_use_is_quiet_unless_asked(capsys):
    model, batch, opt = _mlp_case()
    fitgraph.optimize(model, batch, mlp_loss, opt, budget=0.6, time_budget=5)
    assert "fitgraph:" not in capsys.readouterr().err
    model, batch, opt = _mlp_case()
    fitgraph.optimize(model, batch, mlp_loss, opt, budget=0.6, time_budget=5, progress=True)
    assert "fitgraph: planning the step" in capsys.readouterr().err


def test_a_caller_listening_hears_the_calls_inside_unless_they_say_otherwise():
    lines = []
    with progress.listening(lines.append):
        model, batch, opt = _mlp_case()
        fitgraph.optimize(model, batch, mlp_loss, opt, budget=0.6, time_budget=5)
        heard = len(lines)
        model, batch, opt = _mlp_case()
        fitgraph.optimize(model, batch, mlp_loss, opt, budget=0.6, time_budget=5,
                          progress=False)
    assert heard > 3 and len(lines) == heard


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_backend_says_each_graph_it_plans():
    lines = []
    be = fitgraph.backend(budget=0.8, time_budget=5, solver="auto", progress=lines.append)
    model, batch = mlp(depth=4), _batch()
    mlp_loss(torch.compile(model, backend=be, dynamic=False), batch).backward()
    assert lines[0].startswith("planning compiled graph 1 (") and "done in" in lines[-1]
    assert any("hotspot: " in line for line in lines), lines


def test_the_search_says_each_candidate_and_the_best_so_far():
    from test_rewrite_rules import CPU, Scaled

    from fitgraph.solvers import Problem, solve

    torch.manual_seed(0)
    g = fitgraph.capture(Scaled(8, 4, 2, 0.125, divide=False), torch.randn(2, 64, 8))
    lines = []
    with progress.listening(lines.append):
        solve(Problem(g, CPU, latency_limit=1.05, time_budget_s=6), "search")
    assert lines[0] == "search: auto on the captured graph ..."
    cands = [line for line in lines if line.startswith("search: ") and "best so far" in line]
    assert cands and "scale_across_matmul" in cands[0], lines


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_step_by_regions_says_each_region_it_plans():
    from test_regions import ItemScaled

    model = ItemScaled()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    lines = []
    with pytest.warns(UserWarning, match="cannot be captured as one graph"):
        step = fitgraph.optimize(model, x, lambda m, b: m(b).square().mean(), opt, budget=0.9,
                                 time_budget=2, exact=True, progress=lines.append)
    step(x)
    assert any(line.startswith("planning compiled graph 1 (") for line in lines), lines
