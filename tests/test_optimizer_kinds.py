"""Every torch optimizer whose update is per parameter trains through fitgraph bit for bit as
eager: RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop and Adafactor (whose
state is not shaped like its parameter) beside SGD and Adam (``capture/optimizer_kinds.py``);
the others are refused by name, saying why."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_bitwise_equal_models, check_same_as_eager, eager_step
from torch import nn

import fitgraph
from fitgraph.capture.errors import CaptureError
from fitgraph.capture.optimizer_kinds import KINDS

# NOTE: settings that take each update's branches (weight decay, momentum, centred, maximise,
# decoupled decay, ASGD's averaging from its first step on)
OPTIMIZERS = {
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "rmsprop-centered-momentum": lambda p: torch.optim.RMSprop(
        p, lr=1e-2, momentum=0.9, centered=True, weight_decay=0.1, maximize=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.01, weight_decay=0.1,
                                             initial_accumulator_value=0.1),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2, weight_decay=0.1),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "nadam-decoupled": lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.1,
                                                   decoupled_weight_decay=True),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2, weight_decay=0.1),
    "adadelta": lambda p: torch.optim.Adadelta(p, weight_decay=0.1, maximize=True),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=1, weight_decay=0.1),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    # NOTE: factored statistics for matrices (row_var, col_var), a variance for vectors
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "adafactor-decay-maximize": lambda p: torch.optim.Adafactor(
        p, lr=1e-2, weight_decay=0.1, maximize=True, eps=(1e-6, 1e-3), d=2.0),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _loss(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])


BATCH = (torch.randn(8, 16), torch.randint(0, 4, (8,)))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_runs_bitwise_as_eager_from_its_first_step(name):
    # NOTE: captured before each step: the first graph makes the state (torch's lazy init)
    check_same_as_eager(_model(), BATCH, _loss, OPTIMIZERS[name], steps=3)


@pytest.mark.parametrize("name", ["rmsprop-centered-momentum", "nadam", "asgd", "rprop",
                                  "adagrad", "adafactor"])
def test_one_plan_trains_bitwise_from_a_fresh_optimizer_with_a_scheduler(name):
    """``optimize``'s steady-state plan: the state it reads made before the first step as torch
    makes it, and the learning rate read where each update runs."""
    a = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
    b = copy.deepcopy(a)
    oa, ob = OPTIMIZERS[name](a.parameters()), OPTIMIZERS[name](b.parameters())
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
    batch = (torch.randn(128, 64), torch.randint(0, 64, (128,)))
    step = fitgraph.optimize(b, batch, _loss, ob, budget=0.8, time_budget=5, exact=True)
    assert not ob.state or name == "adagrad", "planning must not create optimizer state"
    for i in range(3):
        la = eager_step(a, batch, _loss, oa, seed=i)
        torch.manual_seed(i)
        assert torch.equal(la, step(batch))
        assert_bitwise_equal_models(a, b, oa, ob)
        for o, s in ((oa, sa), (ob, sb)):
            o.zero_grad(set_to_none=True)
            s.step()
    assert len(step._plans) == 1
    r = step.report()   # NOTE: law 2 with each kind's state and update: as simulated
    assert r.measured_peak_bytes == r.planned_peak_bytes <= r.budget_bytes


def test_every_kind_names_the_state_torch_keeps():
    """The state keys and settings each kind records are those torch's optimizer keeps."""
    for name, make in OPTIMIZERS.items():
        for shape in ((3, 2), (4, 3, 2), (5,), ()):
            p = nn.Parameter(torch.randn(shape))
            opt = make([p])
            p.grad = torch.randn(shape)
            opt.step()
            group = opt.param_groups[0]
            kind = next(k for k in KINDS.values() if type(opt) in k.classes)
            assert kind.param_keys(group, shape) == tuple(opt.state[p]), (name, shape)
            assert set(kind.param_keys(group, shape)) <= set(kind.keys(group))
            assert all(h in group for h in kind.hyper), name
            for key, value in opt.state[p].items():
                if shape:
                    assert (key in kind.scalars) == (value.dim() == 0), (name, key)
                assert kind.state_shape(key, shape) == value.shape, (name, shape, key)
                made = kind.make(key, p.detach(), group)
                assert (made.shape, made.dtype, made.device) == (
                    value.shape, value.dtype, value.device), (name, shape, key)


@pytest.mark.parametrize("make, says", [
    (lambda p: torch.optim.SparseAdam(p), "sparse gradients"),
    (lambda p: torch.optim.LBFGS(p), "closure"),
    (lambda p: type("MyAdam", (torch.optim.AdamW,), {})(p), "subclass"),
])
def test_other_optimizers_are_refused_by_name(make, says):
    model = _model()
    opt = make(model.parameters())
    with pytest.raises(CaptureError, match=says) as e:
        fitgraph.capture(model, BATCH, _loss, opt)
    assert type(opt).__name__ in str(e.value) and "RMSprop" in str(e.value)


@pytest.mark.parametrize("name", ["rmsprop-centered-momentum", "radam", "adafactor"])
def test_updates_run_in_the_backward_bitwise_as_eager(name):
    """``optimizer_in_backward``: each update as soon as its gradient is complete, whatever
    the kind (each reads its own parameter's gradient and state alone)."""
    a = _model()
    b = copy.deepcopy(a)
    oa, ob = OPTIMIZERS[name](a.parameters()), OPTIMIZERS[name](b.parameters())
    step = fitgraph.optimize(b, BATCH, _loss, ob, latency_limit=1.5, time_budget=3,
                             optimizer_in_backward=True, exact=True, measure_latency=False)
    for i in range(3):
        la = eager_step(a, BATCH, _loss, oa, seed=i)
        oa.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        assert torch.equal(la, step(BATCH))
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa, pb), n
            assert all(torch.equal(oa.state[pa][k], ob.state[pb][k]) for k in oa.state[pa])


def test_every_cli_optimizer_is_one_fitgraph_captures():
    from fitgraph.capture.optimizer import describe_optimizer
    from fitgraph.cli_case import OPTIMIZERS, make_optimizer

    for name in OPTIMIZERS:
        opt = make_optimizer(name, _model())
        assert (opt is None) == (name == "none")
        if opt is not None and name == "muon":   # NOTE: Muon's matrices, AdamW's the rest
            assert describe_optimizer(opt) == "muon+adam"
        elif opt is not None:
            assert type(opt).__name__.lower() == name
            describe_optimizer(opt)


def test_adafactor_refuses_a_complex_parameter_by_name():
    model = nn.Linear(4, 2).to(torch.complex64)
    batch = torch.randn(3, 4, dtype=torch.complex64)
    opt = torch.optim.Adafactor(model.parameters())
    with pytest.raises(CaptureError, match="complex, which Adafactor does not update"):
        fitgraph.capture(model, batch, lambda m, b: m(b).abs().sum(), opt)


def test_adafactor_state_is_planned_at_its_own_size():
    """A matrix's factored statistics are a row and a column, not a matrix: the graph's state
    inputs and the update's traffic are priced at their own sizes."""
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    opt = torch.optim.Adafactor(model.parameters())
    batch = torch.randn(4, 64)
    g = fitgraph.capture(model, batch, lambda m, b: m(b).square().mean(), opt, steady_state=True)
    shapes = {name: g.values[v].shape for name, v in zip(g.input_names, g.inputs)
              if name.startswith("state:")}
    assert shapes["state:0.weight:row_var"] == (32, 1)
    assert shapes["state:0.weight:col_var"] == (1, 64)
    assert shapes["state:0.bias:variance"] == (32,)
    assert shapes["state:0.weight:step"] == ()
    assert "state:0.weight:variance" not in shapes and "state:0.bias:row_var" not in shapes
    (update,) = [n for n in g.nodes if n.name == "adafactor_0.weight"]
    assert update.bytes_moved == (2 * 32 * 64 + 2 * (32 + 64)) * 4
