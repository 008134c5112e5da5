"""``dist.runtime.precision.precision_of``: the planner's bytes per parameter for a live model
and its optimizer — the state each kind keeps, hand-counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fitgraph.dist import FP32_ADAM
from fitgraph.dist.runtime.precision import precision_of


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16),
                         nn.Linear(16, 4)).to(dtype)


def _count(net):
    return sum(p.numel() for p in net.parameters())


def test_adamw_keeps_two_moments_and_no_master_copy():
    net = _net()
    p = precision_of(net, torch.optim.AdamW(net.parameters()))
    assert (p.weight, p.grad, p.master, p.state, p.step_temp) == (4, 4, 0, 8.0, "torch")
    assert p.per_parameter == FP32_ADAM.per_parameter


def test_bfloat16_weights_keep_bfloat16_state():
    net = _net(torch.bfloat16)
    p = precision_of(net, torch.optim.AdamW(net.parameters()))
    assert (p.weight, p.grad, p.master, p.state, p.activation_dtype) == (2, 2, 0, 4.0,
                                                                        "bfloat16")


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon")
def test_muon_and_adamw_each_keep_their_own():
    net = _net()
    mats = [net[1].weight, net[3].weight]
    rest = [q for q in net.parameters() if all(q is not m for m in mats)]
    p = precision_of(net, [torch.optim.Muon(mats), torch.optim.AdamW(rest)])
    matrix = sum(m.numel() for m in mats)
    assert p.state == pytest.approx((4 * matrix + 8 * (_count(net) - matrix)) / _count(net))
    assert p.name == "float32-muon+adam"


def test_adafactor_keeps_rows_and_columns_of_its_matrices():
    net = _net()
    p = precision_of(net, torch.optim.Adafactor(net.parameters()))
    # NOTE: a matrix's row and column statistics; a vector's variance; 0-d steps not counted
    kept = (10 + 8) + (16 + 8) + 16 + 16 + 16 + (4 + 16) + 4
    assert p.state == pytest.approx(4 * kept / _count(net))


def test_frozen_parameters_and_unknown_optimizers():
    net = _net()
    net[0].weight.requires_grad_(False)
    p = precision_of(net, torch.optim.SGD([q for q in net.parameters() if q.requires_grad],
                                          lr=0.1))
    assert p.state == 0.0 and p.step_temp == "none"
    assert precision_of(net, None) == FP32_ADAM
    assert precision_of(net, lambda params: torch.optim.AdamW(params)) == FP32_ADAM
    assert precision_of(net, torch.optim.LBFGS(net.parameters())) == FP32_ADAM
