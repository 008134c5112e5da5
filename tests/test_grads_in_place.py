"""An activation's backward writes over the gradient it reads where that one dies there
(``solvers.grads_in_place``): bitwise eager's results, a lower simulated peak, and the measured
peak equal to it."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_bitwise_equal_models, eager_step
from torch import nn

import fitgraph
from fitgraph.cost import ProfiledCostModel
from fitgraph.execute import execute
from fitgraph.measure import measure_plan
from fitgraph.solvers import Problem, solve
from fitgraph.solvers.grads_in_place import OUT_VARIANTS, grads_in_place

ACTIVATIONS = [nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU(), nn.SiLU(), nn.Tanh(),
               nn.Sigmoid(), nn.Hardtanh(), nn.ELU(), nn.LeakyReLU(0.1), nn.Softplus(),
               nn.Hardsigmoid(), nn.Hardswish(), nn.ReLU6()]


class MLP(nn.Module):
    def __init__(self, act: nn.Module, width: int = 64, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), act,
                                                  nn.Linear(4 * width, width))
                                    for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _planned(model, x, solver="eager", frac=None):
    g = fitgraph.capture(model, x, lambda m, b: m(b).square().mean())
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager")
    if frac is None:
        sol = eager
    else:
        sol = solve(Problem(g, cm, budget_bytes=int(frac * eager.sim.peak_bytes),
                            time_budget_s=10.0), solver)
    return g, cm, sol


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: repr(a))
def test_each_activation_backward_writes_over_its_gradient_bitwise(act):
    torch.manual_seed(0)
    model, x = MLP(act), torch.randn(128, 64)
    g, cm, sol = _planned(model, x)
    got = grads_in_place(sol, g, cm)
    rewritten = [n for n in got.graph_for(g).nodes if n.target in
                 {t for t, _ in OUT_VARIANTS.values()}]
    assert len(rewritten) == 3, [n.target for n in got.graph_for(g).nodes if "backward" in n.target]
    assert got.sim.peak_bytes <= sol.sim.peak_bytes
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    loss_fn = lambda m, b_: m(b_).square().mean()  # noqa: E731
    la = eager_step(a, x, loss_fn)
    torch.manual_seed(0)
    lb = execute(got.graph_for(g), got.plan, b, x)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b)
    for p in b.parameters():
        p.grad = None
    measured = measure_plan(got.graph_for(g), got.plan, b, x, repeats=0)
    assert measured.peak_bytes == got.sim.peak_bytes


def test_the_activation_backward_holds_one_tensor_less():
    torch.manual_seed(0)
    model, x = MLP(nn.GELU()), torch.randn(128, 64)
    g, cm, sol = _planned(model, x)
    got = grads_in_place(sol, g, cm)

    def live_at(s, target):
        return [s.sim.live_after[i] for i, ins in enumerate(s.plan.instructions)
                if getattr(ins, "node", None) is not None
                and s.graph_for(g).nodes[ins.node].target == target]

    before = live_at(sol, "aten.gelu_backward.default")
    after = live_at(got, "aten.gelu_backward.grad_input")
    # NOTE: dy and the GELU's input gradient, each [128, 256] float32, are one tensor now
    assert len(before) == len(after) == 3
    assert [b - a for b, a in zip(before, after)] == [128 * 256 * 4] * 3


def test_a_remat_plan_keeps_its_recomputes_and_runs_lower_as_simulated():
    torch.manual_seed(0)
    model, x = MLP(nn.GELU(), depth=4), torch.randn(128, 64)
    g, cm, sol = _planned(model, x, "hotspot", 0.8)
    got = grads_in_place(sol, g, cm)
    assert got.notes.get("grads_in_place", 0) >= 1
    assert got.sim.peak_bytes <= sol.sim.peak_bytes
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    la = eager_step(a, x, lambda m, b_: m(b_).square().mean())
    torch.manual_seed(0)
    assert torch.equal(la, execute(got.graph_for(g), got.plan, b, x))
    assert_bitwise_equal_models(a, b)
    for p in b.parameters():
        p.grad = None
    assert measure_plan(got.graph_for(g), got.plan, b, x, repeats=0).peak_bytes == \
        got.sim.peak_bytes


def test_a_gradient_read_again_later_is_not_written_over():
    class Twice(nn.Module):
        """``dy`` of the GELU is also read by a later backward op (the residual's sum)."""

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            h = self.a(x)
            return self.b(torch.nn.functional.gelu(h) + h)

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(16, 32)
    g, cm, sol = _planned(model, x)
    got = grads_in_place(sol, g, cm)
    nodes = got.graph_for(g).nodes
    for n in nodes:
        if n.target == "aten.gelu_backward.grad_input":
            # NOTE: written over only where nothing reads its gradient after it
            dy = n.args[0].id
            later = [m for m in nodes if m.id > n.id and dy in m.inputs]
            assert not later, (n.name, [m.name for m in later])
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    la = eager_step(a, x, lambda m, b_: m(b_).square().mean())
    torch.manual_seed(0)
    assert torch.equal(la, execute(got.graph_for(g), got.plan, b, x))
    assert_bitwise_equal_models(a, b)
