"""torch's Muon, and several optimizers stepped as one (Muon for the matrices, AdamW for the
rest: ``capture/combined_optimizer.py``), train through fitgraph bit for bit as eager: each
parameter updated by its own optimizer's rule, each member's LR scheduler and step hooks
seen; a parameter in two optimizers is refused."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from helpers import eager_step
from torch import nn

import fitgraph
from fitgraph.capture.combined_optimizer import CombinedOptimizer
from fitgraph.capture.errors import CaptureError
from fitgraph.capture.optimizer_kinds import KINDS

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon")


class Net(nn.Module):
    """An embedding, linears with biases, a norm: matrices for Muon, the rest for AdamW."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32),
                                                    nn.GELU()) for _ in range(3)])
        self.head = nn.Linear(32, 48)   # NOTE: wide (Muon transposes a tall matrix)

    def forward(self, x):
        return self.head(self.blocks(self.emb(x)).mean(1))


def _loss(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])


BATCH = (torch.randint(0, 50, (16, 32)), torch.randint(0, 48, (16,)))


def _muon_adamw(model, **muon):
    mats = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("emb")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and not n.startswith("emb"))]
    return [torch.optim.Muon(mats, lr=0.02, **muon), torch.optim.AdamW(rest, lr=1e-3)]


def _twins(**muon):
    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    return a, b, _muon_adamw(a, **muon), _muon_adamw(b, **muon)


def _assert_same(a, b, oa: list, ob: list):
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    for ma, mb in zip(oa, ob):
        for pa, pb in zip((p for g in ma.param_groups for p in g["params"]),
                          (p for g in mb.param_groups for p in g["params"])):
            assert sorted(ma.state[pa]) == sorted(mb.state[pb])
            assert all(torch.equal(ma.state[pa][k], mb.state[pb][k]) for k in ma.state[pa])


def _steps_alike(step, a, b, oa: list, ob: list, steps: int = 2) -> None:
    """``steps`` steps of ``step`` (``b``, its optimizers ``ob``) equal to eager's (``a``)."""
    for i in range(steps):
        la = eager_step(a, BATCH, _loss, CombinedOptimizer(oa), seed=i)
        torch.manual_seed(i)
        assert torch.equal(la, step(BATCH))
        _assert_same(a, b, oa, ob)
        for o in oa + ob:
            o.zero_grad(set_to_none=True)


@pytest.mark.parametrize("muon", [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw",
                                       "weight_decay": 0.0, "ns_steps": 3}])
def test_muon_and_adamw_train_bitwise_as_eager_with_their_schedulers(muon):
    """One steady-state plan under a budget: every step's loss, weights and both optimizers'
    state are eager's, each member's scheduler sees each step (its own lr decay), and the
    measured peak is the simulated one."""
    a, b, oa, ob = _twins(**muon)
    sched = lambda opts, gammas: [torch.optim.lr_scheduler.StepLR(o, 1, g)  # noqa: E731
                                  for o, g in zip(opts, gammas)]
    sa, sb = sched(oa, (0.5, 0.8)), sched(ob, (0.5, 0.8))
    step = fitgraph.optimize(b, BATCH, _loss, ob, budget=0.8, time_budget=5, exact=True)
    assert isinstance(step.optimizer, CombinedOptimizer)
    assert not ob[0].state and not ob[1].state, "planning must not create optimizer state"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # NOTE: no "lr_scheduler.step() before optimizer.step()"
        for i in range(3):
            la = eager_step(a, BATCH, _loss, CombinedOptimizer(oa), seed=i)
            torch.manual_seed(i)
            assert torch.equal(la, step(BATCH))
            _assert_same(a, b, oa, ob)
            for o, s in zip(oa + ob, sa + sb):
                o.zero_grad(set_to_none=True)
                s.step()
    assert ob[0].param_groups[0]["lr"] == pytest.approx(0.02 * 0.5 ** 3)
    assert len(step._plans) == 1
    r = step.report()
    assert r.measured_peak_bytes == r.planned_peak_bytes <= r.budget_bytes
    assert step._plans[next(iter(step._plans))].graph.meta["optimizer"] == "muon+adam"


def test_each_members_step_hooks_run_once_a_step_with_that_member():
    a, b, oa, ob = _twins()
    seen = []
    for o, name in zip(ob, ("muon", "adamw")):
        o.register_step_pre_hook(lambda opt, args, kw, name=name: seen.append(("pre", name, opt)))
        o.register_step_post_hook(lambda opt, args, kw, name=name: seen.append(("post", name, opt)))
    step = fitgraph.optimize(b, BATCH, _loss, ob, budget=1.0, time_budget=3, exact=True)
    _steps_alike(step, a, b, oa, ob)
    assert [(k, n) for k, n, _ in seen] == [("pre", "muon"), ("pre", "adamw"),
                                            ("post", "muon"), ("post", "adamw")] * 2
    assert all(opt is ob[n == "adamw"] for _, n, opt in seen)


def test_muon_and_adamw_update_in_the_backward_bitwise_as_eager():
    a, b, oa, ob = _twins()
    step = fitgraph.optimize(b, BATCH, _loss, ob, latency_limit=1.5, time_budget=3,
                             optimizer_in_backward=True, exact=True, measure_latency=False)
    for i in range(3):
        la = eager_step(a, BATCH, _loss, CombinedOptimizer(oa), seed=i)
        for o in oa:
            o.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        assert torch.equal(la, step(BATCH))
        _assert_same(a, b, oa, ob)
        assert all(p.grad is None for p in b.parameters())


def test_a_graph_break_runs_the_regions_with_both_optimizers_stepped():
    """The regions route (``.item()`` in the forward) steps each member after the backward."""
    class Breaks(Net):
        def forward(self, x):
            h = self.blocks(self.emb(x)).mean(1)
            return self.head(h * (1.0 + 0.0 * float(h.detach().abs().max().item())))

    torch.manual_seed(0)
    a = Breaks()
    b = copy.deepcopy(a)
    oa, ob = _muon_adamw(a), _muon_adamw(b)
    with pytest.warns(UserWarning, match="cannot be captured as one graph"):
        step = fitgraph.optimize(b, BATCH, _loss, ob, budget=1.0, time_budget=3)
    for i in range(2):
        la = eager_step(a, BATCH, _loss, CombinedOptimizer(oa), seed=i)
        torch.manual_seed(i)
        lb = step(BATCH)
        assert torch.allclose(la, lb, rtol=1e-6, atol=1e-7)
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-6), n
        for o in oa + ob:
            o.zero_grad(set_to_none=True)
    assert ob[0].state and ob[1].state


def test_a_saved_plan_loads_for_the_same_two_optimizers(tmp_path):
    a, b, oa, ob = _twins()
    step = fitgraph.optimize(b, BATCH, _loss, ob, budget=1.0, time_budget=3, exact=True)
    step.save(tmp_path / "plan.pkl")
    loaded = fitgraph.load(tmp_path / "plan.pkl", b, ob, loss_fn=_loss, batch=BATCH)
    _steps_alike(loaded, a, b, oa, ob)


def test_a_parameter_in_two_optimizers_is_refused():
    net = Net()
    with pytest.raises(ValueError, match="in Muon and in AdamW: each parameter must have one"):
        fitgraph.optimize(net, BATCH, _loss, [torch.optim.Muon([net.head.weight]),
                                              torch.optim.AdamW(net.head.parameters())],
                          budget=1.0)


def test_an_unsupported_member_is_refused_by_name():
    net = Net()
    opts = [torch.optim.Muon([net.head.weight]),
            torch.optim.LBFGS([p for n, p in net.named_parameters() if n != "head.weight"])]
    with pytest.raises(CaptureError, match="LBFGS is not supported.*closure"):
        fitgraph.capture(net, BATCH, _loss, opts)


def test_combined_state_reads_and_writes_each_members_own():
    net = nn.Linear(4, 3)
    muon, adamw = torch.optim.Muon([net.weight]), torch.optim.SGD([net.bias], momentum=0.9)
    both = CombinedOptimizer([muon, adamw])
    assert both.kinds() == ["muon", "sgd"] and both.param_groups[1] is adamw.param_groups[0]
    both.state[net.bias]["momentum_buffer"] = torch.ones(3)
    assert torch.equal(adamw.state[net.bias]["momentum_buffer"], torch.ones(3))
    assert net.weight not in both.state and both.state.get(net.weight) is None
    assert len(both.state) == 1 and list(both.state) == [net.bias]
    with pytest.raises(KeyError, match="none of the optimizers"):
        both.state[torch.zeros(1)]
    with pytest.raises(ValueError, match="at least one"):
        CombinedOptimizer([])


def test_muon_state_and_flops_are_torchs():
    """Muon keeps a momentum buffer like its matrix; its update's FLOPs are the Newton–Schulz
    matmuls on the matrix's smaller side (hand-computed for 48 x 32 at 5 steps)."""
    kind = KINDS["muon"]
    p = nn.Parameter(torch.randn(48, 32))
    opt = torch.optim.Muon([p])
    p.grad = torch.randn(48, 32)
    opt.step()
    group = opt.param_groups[0]
    assert kind.param_keys(group, (48, 32)) == tuple(opt.state[p]) == ("momentum_buffer",)
    made = kind.make("momentum_buffer", p.detach(), group)
    assert made.shape == (48, 32) and not made.any()
    m, n = 32, 48
    assert kind.update_flops((48, 32), group) == 5 * (4 * m * m * n + 2 * m ** 3) + 12 * m * n
    assert kind.update_flops((32, 48), group) == kind.update_flops((48, 32), group)
    lin = nn.Linear(32, 48, bias=False)
    g = fitgraph.capture(lin, torch.randn(2, 32), lambda mm, b: mm(b).sum(),
                         torch.optim.Muon(lin.parameters()), steady_state=True)
    (update,) = [nd for nd in g.nodes if nd.target == "fitgraph.optimizer.muon"]
    assert update.flops == kind.update_flops((48, 32), group)


def test_the_update_overhead_times_both_optimizers():
    """``latency_check.update_times``: torch's step over the graph's tensors, one torch
    optimizer per kind, with the group indices of a graph whose first group is frozen."""
    from fitgraph.cost import choose_cost_model
    from fitgraph.latency_check import update_times

    net = Net()
    net.emb.weight.requires_grad_(False)
    opts = [torch.optim.SGD([net.emb.weight], lr=0.1)] + _muon_adamw(net)
    opts[2].param_groups[0]["params"].remove(net.emb.weight)
    g = fitgraph.capture(net, BATCH, _loss, opts, steady_state=True)
    assert g.meta["optimizer"] == "sgd+muon+adam"
    extra, torch_s = update_times(g, choose_cost_model(None, torch.device("cpu")), rounds=1)
    assert torch_s > 0 and math.isfinite(extra)
