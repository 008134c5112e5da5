"""Accelerate: a prepared model compiled with ``fitgraph.backend`` trains as the plain one
(gradient accumulation, an LR scheduler), bitwise, at a lower measured peak."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_compile_backend import mlp

import fitgraph
from fitgraph.execute.meter import MemoryMeter

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Regressor(torch.nn.Module):
    """A model of the user's own (its forward is user code, which Dynamo traces)."""

    def __init__(self):
        super().__init__()
        self.body = mlp(depth=6, dropout=False)

    def forward(self, x):
        return self.body(x)


def _train(with_fitgraph: bool):
    torch.manual_seed(0)
    model = Regressor()
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 256, generator=gen),
                                          torch.randn(4096, 256, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=512, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    be = None
    if with_fitgraph:
        be = fitgraph.backend(budget=0.8, time_budget=5)
        model = torch.compile(model, backend=be, dynamic=False)
    losses = []
    for x, y in loader:
        with acc.accumulate(model):
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    x, y = next(iter(loader))
    with MemoryMeter() as meter:
        F.mse_loss(model(x), y).backward()
    return losses, acc.unwrap_model(model, keep_torch_compile=False).state_dict(), meter.peak_bytes, be


def test_a_prepared_model_compiled_with_the_backend_trains_as_the_plain_one():
    plain_losses, plain_state, plain_peak, _ = _train(False)
    losses, state, peak, be = _train(True)
    assert len(losses) == 8
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    assert all(torch.equal(plain_state[k], state[k]) for k in plain_state)
    r = be.last_report
    assert len(be.reports) == 1 and r.recomputed_nodes > 0
    assert r.planned_peak_bytes <= r.budget_bytes
    assert peak < 0.9 * plain_peak, (peak, plain_peak)
