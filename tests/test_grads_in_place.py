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


class Scores(nn.Module):
    """Attention-like scores through a softmax, then a classifier's cross-entropy: both
    softmax backwards read a gradient that dies there."""

    def __init__(self, width: int = 32, classes: int = 1000):
        super().__init__()
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, b):
        x, target = b
        p = (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1)
        return nn.functional.cross_entropy(self.head(p @ x).flatten(0, 1), target)


def test_softmax_backwards_write_over_their_gradient_bitwise():
    """``_softmax_backward_data`` and ``_log_softmax_backward_data`` run into their dying
    gradient: results bitwise eager's, the loss backward one [tokens, classes] tensor lower,
    the measured peak as simulated."""
    torch.manual_seed(0)
    model = Scores()
    batch = (torch.randn(4, 128, 32), torch.randint(0, 1000, (4 * 128,)))
    loss_fn = lambda m, b_: m(b_)  # noqa: E731
    g = fitgraph.capture(model, batch, loss_fn)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    sol = solve(Problem(g, cm, latency_limit=1.0), "eager")
    got = grads_in_place(sol, g, cm)
    done = {n.target for n in got.graph_for(g).nodes}
    assert {"aten._softmax_backward_data.out", "aten._log_softmax_backward_data.out"} <= done
    at = [i for i, ins in enumerate(got.plan.instructions) if getattr(ins, "node", None)
          is not None and got.graph_for(g).nodes[ins.node].target.startswith("aten._log_soft")]
    was = [i for i, ins in enumerate(sol.plan.instructions) if getattr(ins, "node", None)
           is not None and g.nodes[ins.node].target == "aten._log_softmax_backward_data.default"]
    # NOTE: at least one [tokens, classes] float32 tensor fewer at the loss backward
    assert sol.sim.peak_during[was[0]] - got.sim.peak_during[at[0]] >= 4 * 128 * 1000 * 4
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    la = eager_step(a, batch, loss_fn)
    assert torch.equal(la, execute(got.graph_for(g), got.plan, b, batch))
    assert_bitwise_equal_models(a, b)
    for p in b.parameters():
        p.grad = None
    assert measure_plan(got.graph_for(g), got.plan, b, batch, repeats=0).peak_bytes == \
        got.sim.peak_bytes
