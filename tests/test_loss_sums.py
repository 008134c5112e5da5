"""Pointwise losses computed by one ATen op (``F.mse_loss``, ``huber_loss``, ``smooth_l1_loss``,
``soft_margin_loss``, ``binary_cross_entropy``) run in parts: their dimension rules hold on
real tensors, mean-reduced ones are rewritten as sums divided once (``transform.loss_sums``),
and a region of fission runs through them (a U-Net trained with ``F.mse_loss`` fits where
remat alone cannot)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_dims import _one_node, check_node
from torch import nn

import fitgraph
from fitgraph.execute import execute
from fitgraph.solvers.base import BudgetInfeasible
from fitgraph.transform.loss_sums import losses_as_sums, mean_losses


def _r(*shape):
    return torch.randn(shape, dtype=torch.float64)


def _p(*shape):
    return torch.rand(shape, dtype=torch.float64) * 0.9 + 0.05


# NOTE: (target, operands before the reduction, operands after it): a backward's own
# arguments are the incoming gradient and the forward's
LOSSES = {
    "mse_loss": ((_r(3, 4, 5), _r(3, 4, 5)), ()),
    "huber_loss": ((_r(3, 4, 5), _r(3, 4, 5)), (0.5,)),
    "smooth_l1_loss": ((_r(3, 4, 5), _r(3, 4, 5)), (0.5,)),
    "soft_margin_loss": ((_r(3, 4, 5), _r(3, 4, 5).sign()), ()),
    "binary_cross_entropy": ((_p(3, 4, 5), _p(3, 4, 5), None), ()),
    "binary_cross_entropy weighted": ((_p(3, 4, 5), _p(3, 4, 5), _p(3, 4, 5)), ()),
}


@pytest.mark.parametrize("reduction", [0, 2])
@pytest.mark.parametrize("name", list(LOSSES))
def test_rules_hold_on_real_tensors(name, reduction):
    op = name.split()[0]
    before, after = LOSSES[name]
    torch.manual_seed(0)
    g, node, env = _one_node(f"aten.{op}.default", (*before, reduction, *after))
    assert check_node(g, node, env) == 3   # NOTE: every dim of the (3, 4, 5) input
    grad = _r(3, 4, 5) if reduction == 0 else _r()
    g, node, env = _one_node(f"aten.{op}_backward.default", (grad, *before, reduction, *after))
    assert check_node(g, node, env) == 3


@pytest.mark.parametrize("name", ["mse_loss", "binary_cross_entropy weighted"])
def test_a_mean_reduced_loss_is_not_split_as_it_is(name):
    op = name.split()[0]
    before, after = LOSSES[name]
    g, node, env = _one_node(f"aten.{op}.default", (*before, 1, *after))
    assert check_node(g, node, env) == 0


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 6))


SPELLINGS = {
    "mse": lambda m, b: F.mse_loss(m(b[0]), b[1]),
    "huber": lambda m, b: F.huber_loss(m(b[0]), b[1], delta=0.3),
    "smooth_l1": lambda m, b: F.smooth_l1_loss(m(b[0]), b[1], beta=0.3),
    "soft_margin": lambda m, b: F.soft_margin_loss(m(b[0]), b[1].sign()),
    "bce": lambda m, b: F.binary_cross_entropy(m(b[0]).sigmoid(), b[1].sigmoid(),
                                               weight=b[1].abs()),
    "mse and a summed huber": lambda m, b: F.mse_loss(m(b[0]), b[1])
    + 0.1 * F.huber_loss(m(b[0]), b[1], reduction="sum"),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_mean_losses_become_sums_divided_once_with_eagers_results(name):
    loss_fn = SPELLINGS[name]
    model = _mlp()
    batch = (torch.randn(16, 12), torch.randn(16, 6))
    g = fitgraph.capture(model, batch, loss_fn)
    found = mean_losses(g)
    assert len(found) == 2    # NOTE: the forward and the backward of the mean-reduced loss
    r = losses_as_sums(g)
    assert not mean_losses(r) and len(r.nodes) == len(g.nodes) + 2
    want = loss_fn(model, batch)
    want.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    got = execute(r, fitgraph.eager_plan(r), model, batch)
    torch.testing.assert_close(got, want.detach())
    for p, w in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, w)


def test_a_graph_without_mean_losses_is_left_as_it_is():
    model = _mlp()
    batch = (torch.randn(16, 12), torch.randn(16, 6))
    g = fitgraph.capture(model, batch, lambda m, b: F.mse_loss(m(b[0]), b[1], reduction="sum"))
    assert losses_as_sums(g) is g


def test_a_conv_net_trained_with_mse_fits_by_running_the_batch_in_parts():
    """Every layer's activations alike (no single region holds the peak): remat alone cannot
    reach 0.45 of the eager peak; fission's region runs through the loss, the batch in parts,
    and the plan trains as eager does."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GELU(),
                        nn.Conv2d(16, 16, 3, padding=1), nn.GELU(),
                        nn.Conv2d(16, 3, 3, padding=1))
    batch = (torch.randn(16, 3, 32, 32), torch.randn(16, 3, 32, 32))

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1])

    a, b = copy.deepcopy(net), copy.deepcopy(net)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    with pytest.raises(BudgetInfeasible):
        fitgraph.optimize(copy.deepcopy(net), batch, loss_fn, None, budget=0.45,
                          solver="hotspot", time_budget=5)
    step = fitgraph.optimize(b, batch, loss_fn, ob, budget=0.45, time_budget=10)
    r = step.report()
    assert r.notes["winner"] == "fission"
    assert any("parts" in s for s in r.notes["fission"]["splits"])
    for _ in range(2):
        oa.zero_grad(set_to_none=True)
        la = loss_fn(a, batch)
        la.backward()
        oa.step()
        ob.zero_grad(set_to_none=True)
        torch.testing.assert_close(step(batch), la.detach())
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb)
    r = step.report()
    assert r.measured_peak_bytes <= r.budget_bytes
    assert r.measured_peak_bytes == r.planned_peak_bytes   # NOTE: law 2, beyond the zoo
