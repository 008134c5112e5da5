"""The training loops people run: one plan up front, frozen parameters, hooks and schedulers,
budgets checked before any work, saved plans verified, the exact mode (issue 25)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph import api
from fitgraph.units import format_bytes, parse_budget


def mlp(act=nn.GELU, depth=4, width=128):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), act()) for _ in range(depth)])


def loss_fn(m, b):
    return (m(b[0]) - b[1]).square().mean()


BATCH = (torch.randn(256, 128), torch.randn(256, 128))


def _run_both(a, b, oa, step, steps=3):
    for i in range(steps):
        for m in (a, b):
            m.zero_grad(set_to_none=True)
        la = eager_step(a, BATCH, loss_fn, oa, seed=i)
        torch.manual_seed(i)
        lb = step(BATCH)
        assert torch.equal(la, lb)


# -- one plan, made up front -------------------------------------------------------------------
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
], ids=["adamw", "sgd-momentum-dampening"])
def test_one_plan_for_the_loop_bitwise_from_a_fresh_optimizer(monkeypatch, make_opt):
    captures = []
    real = api.capture
    monkeypatch.setattr(api, "capture", lambda *a, **k: captures.append(1) or real(*a, **k))
    a = mlp()
    b = copy.deepcopy(a)
    oa, ob = make_opt(a.parameters()), make_opt(b.parameters())
    step = fitgraph.optimize(b, BATCH, loss_fn, ob, budget=0.8, time_budget=5)
    assert not ob.state, "planning must not create optimizer state"
    assert any(n.startswith("state:") for n in step.graph.input_names)
    for i in range(3):
        la = eager_step(a, BATCH, loss_fn, oa, seed=i)
        torch.manual_seed(i)
        assert torch.equal(la, step(BATCH))
        assert_bitwise_equal_models(a, b, oa, ob)
        ob.zero_grad(set_to_none=True)
        oa.zero_grad(set_to_none=True)
    assert len(captures) == 1 and len(step._plans) == 1, "the loop was planned more than once"
    r = step.report()
    assert r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.budget_bytes


def test_fraction_budget_refers_to_the_steady_state_step():
    b = mlp()
    ob = torch.optim.AdamW(b.parameters())
    step = fitgraph.optimize(b, BATCH, loss_fn, ob, budget=0.9, time_budget=5)
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in b.parameters())
    weights = sum(p.numel() * p.element_size() for p in b.parameters())
    # NOTE: the steady-state eager peak holds the Adam moments all step long
    assert step.report().eager_peak_bytes >= weights + state_bytes


# -- frozen parameters -------------------------------------------------------------------------
def test_frozen_parameters_in_the_optimizer_are_skipped_as_eager_does():
    a = mlp()
    a[0][0].weight.requires_grad_(False)
    b = copy.deepcopy(a)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3)
    step = fitgraph.optimize(b, BATCH, loss_fn, ob, budget=0.9, time_budget=5)
    _run_both(a, b, oa, step, steps=2)
    assert_bitwise_equal_models(a, b, oa, ob)
    assert b[0][0].weight not in ob.state


def test_a_stale_grad_on_a_frozen_parameter_is_refused():
    b = mlp()
    b[0][0].weight.requires_grad_(False)
    b[0][0].weight.grad = torch.ones_like(b[0][0].weight)
    with pytest.raises(fitgraph.CaptureError, match="zero_grad"):
        fitgraph.optimize(b, BATCH, loss_fn, torch.optim.AdamW(b.parameters()), budget=0.9)


# -- optimizer.step() as users' code sees it ----------------------------------------------------
def test_lr_scheduler_and_step_hooks_see_an_optimizer_step():
    b = mlp()
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3)
    seen = []
    ob.register_step_pre_hook(lambda o, a, k: seen.append(("pre", b[0][0].weight.grad is not None)))
    ema = [p.detach().clone() for p in b.parameters()]

    def post(o, a, k):
        seen.append(("post", None))
        for e, p in zip(ema, b.parameters()):
            e.lerp_(p.detach(), 0.5)
    ob.register_step_post_hook(post)
    step = fitgraph.optimize(b, BATCH, loss_fn, ob, budget=0.9, time_budget=5)
    sched = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            step(BATCH)
            sched.step()
            ob.zero_grad(set_to_none=True)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], caught
    assert seen == [("pre", True), ("post", None)] * 2
    assert ob.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)
    assert not torch.equal(ema[0], mlp()[0][0].weight)


# -- budgets, checked before any work ------------------------------------------------------------
@pytest.mark.parametrize("budget, match", [
    (50, "did you mean 50%"), (1, "did you mean 1.0"), (500, "did you mean 500 MiB"),
    ("banana%", "'banana%'"), ("0%", "percentage"), ("0", "positive"), (1.5, "fraction"),
    ("12 parsecs", "'12 parsecs'"),
])
def test_bad_budgets_fail_before_capture(monkeypatch, budget, match):
    monkeypatch.setattr(api, "capture", lambda *a, **k: pytest.fail("captured first"))
    with pytest.raises(ValueError, match=match):
        fitgraph.optimize(mlp(), BATCH, loss_fn, budget=budget)


def test_bad_latency_limit_fails_before_capture(monkeypatch):
    monkeypatch.setattr(api, "capture", lambda *a, **k: pytest.fail("captured first"))
    with pytest.raises(ValueError, match="at least 1"):
        fitgraph.optimize(mlp(), BATCH, loss_fn, latency_limit=0.9)


def test_budget_strings_and_tiny_sizes_print_readably():
    assert parse_budget("0.5", eager_peak_bytes=1000) == 500
    assert parse_budget("2KiB", eager_peak_bytes=0) == 2048
    assert format_bytes(4096) == "4.0 KiB" and format_bytes(100) == "100 B"
    assert format_bytes(5 * 2**20) == "5.0 MiB"


def test_bench_exits_non_zero_on_an_invalid_budget(capsys):
    from fitgraph.cli import main

    assert main(["bench", "--models", "gpt2", "--budgets", "0.9,banana",
                 "--systems", "eager"]) == 2
    assert "banana" in capsys.readouterr().err


# -- saved plans ----------------------------------------------------------------------------------
def test_load_without_batch_refuses_a_model_whose_forward_changed(tmp_path):
    b = mlp(nn.GELU)
    step = fitgraph.optimize(b, BATCH, loss_fn, torch.optim.AdamW(b.parameters()),
                             budget=0.9, time_budget=5)
    path = str(tmp_path / "plan.fg")
    step.save(path)
    relu = mlp(nn.ReLU)   # NOTE: the same parameters, another forward
    loaded = fitgraph.load(path, relu, torch.optim.AdamW(relu.parameters()), loss_fn=loss_fn)
    before = [p.detach().clone() for p in relu.parameters()]
    with pytest.raises(ValueError, match="another graph"):
        loaded(BATCH)
    assert all(torch.equal(x, p) for x, p in zip(before, relu.parameters()))
    same = mlp(nn.GELU)
    a = copy.deepcopy(same)
    oa, os_ = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(same.parameters())
    again = fitgraph.load(path, same, os_, loss_fn=loss_fn)
    _run_both(a, same, oa, again, steps=1)
    assert_bitwise_equal_models(a, same, oa, os_)


# -- exact mode -------------------------------------------------------------------------------
def _vocab_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4096))
    batch = (torch.randn(512, 16), torch.randint(0, 4096, (512,)))
    return model, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])


def test_exact_mode_never_splits_and_is_bitwise():
    model, batch, lf = _vocab_case()
    free = fitgraph.optimize(copy.deepcopy(model), batch, lf, latency_limit=1.5,
                             cost_model="cpu-generic", time_budget=10)
    assert free.report().notes["winner"] == "fission"  # NOTE: else this test proves nothing
    b = copy.deepcopy(model)
    step = fitgraph.optimize(b, batch, lf, latency_limit=1.5, cost_model="cpu-generic",
                             time_budget=10, exact=True)
    notes = step.report().notes
    assert notes["winner"] != "fission" and "exact=True" in notes["fission"]
    a = copy.deepcopy(model)
    la = eager_step(a, batch, lf)
    assert torch.equal(la, step(batch))
    assert_bitwise_equal_models(a, b)


def test_exact_mode_refuses_a_splitting_solver():
    from fitgraph.cost import RooflineCostModel, get_device
    from fitgraph.solvers import Problem, solve

    model, batch, lf = _vocab_case()
    g = fitgraph.capture(model, batch, lf)
    with pytest.raises(ValueError, match="not bitwise"):
        solve(Problem(g, RooflineCostModel(get_device("rtx3090")), latency_limit=1.2,
                      exact=True), "fission")


# -- quiet profiling ------------------------------------------------------------------------------
def test_profiling_prints_no_kineto_lines():
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    code = ("import torch\nfrom fitgraph.execute.meter import MemoryMeter\n"
            "for _ in range(3):\n    with MemoryMeter():\n        torch.randn(1000) * 2\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "USDT" not in out.stderr and "profiler_start" not in out.stderr, out.stderr


# -- the steady-state graph's inputs ----------------------------------------------------------------
class Conv1dStack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv1d(8, 16, 5, padding="same")
        self.c2 = nn.Conv1d(16, 16, 4, padding="same", dilation=2)
        self.c3 = nn.Conv1d(16, 16, 3, groups=4, padding=1)

    def forward(self, x):
        return self.c3(nn.functional.gelu(self.c2(nn.functional.gelu(self.c1(x)))))


def test_steady_state_graph_numbers_its_inputs_first_and_fission_runs_on_it():
    m = Conv1dStack()
    x = torch.randn(4, 8, 64)
    lf = lambda m, b: m(b).square().mean()  # noqa: E731
    g = fitgraph.capture(m, x, lf, torch.optim.AdamW(m.parameters()), steady_state=True)
    computed = [v.id for v in g.values if v.id not in set(g.inputs)]
    assert max(g.inputs) < min(computed)
    # NOTE: the optimizer's state inputs came after the computed values: the spatial fission
    # search's halves renumbered them and asserted
    step = fitgraph.optimize(m, x, lf, torch.optim.AdamW(m.parameters()), latency_limit=1.1,
                             solver="fission", cost_model="cpu-generic", time_budget=10)
    assert torch.isfinite(step(x))


# -- the model's modes --------------------------------------------------------------------------
def test_a_step_after_eval_or_train_runs_the_modes_the_model_is_in():
    """A plan captured in training mode (dropout drawn, batch norm's batch statistics) ran on
    after ``model.eval()``, silently unlike eager (issue 25): the modes are part of the key a
    plan is cached by, so the step is planned again for them, and again back in training."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.5), nn.BatchNorm1d(64),
                             nn.Linear(64, 8))

    def ce(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    batch = (torch.randn(16, 32), torch.randint(0, 8, (16,)))
    a, b = model(), model()
    oa, ob = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b))
    step = fitgraph.optimize(b, batch, ce, ob, latency_limit=1.3, time_budget=2,
                             measure_latency=False)
    for i, train in enumerate((True, False, False, True)):
        for m, o in ((a, oa), (b, ob)):
            m.train(train)
            o.zero_grad(set_to_none=True)
        la = eager_step(a, batch, ce, oa, seed=i)
        torch.manual_seed(i)
        assert torch.equal(la, step(batch)), f"step {i} (train={train})"
        assert_bitwise_equal_models(a, b, oa, ob)
    assert len(step._plans) == 2
