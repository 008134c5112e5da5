"""Optimizers built with ``fused=True`` (torch's fused kernels, as training recipes ask for)
train through fitgraph bit for bit as eager: each update node runs the fused kernel on its one
parameter, which is elementwise. They were refused ("construct the optimizer with fused=False").
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise_equal_models, check_same_as_eager, twins
from torch import nn

import fitgraph

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, fused=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                              fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _loss(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])


BATCH = (torch.randn(8, 16), torch.randint(0, 4, (8,)))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_optimizers_run_bitwise_as_eager(name):
    check_same_as_eager(_model(), BATCH, _loss, OPTIMIZERS[name], steps=3)


def test_a_planned_step_with_fused_adamw_trains_bitwise_as_eager():
    a, b, oa, ob = twins(_model(), OPTIMIZERS["adamw"])
    step = fitgraph.optimize(b, BATCH, _loss, ob, latency_limit=1.3, time_budget=2,
                             measure_latency=False)
    for _ in range(3):
        oa.zero_grad(set_to_none=True)
        _loss(a, BATCH).backward()
        oa.step()
        ob.zero_grad(set_to_none=True)
        step(BATCH)
    assert_bitwise_equal_models(a, b, oa, ob)
