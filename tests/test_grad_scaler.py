"""A mixed-precision loop with ``torch.amp.GradScaler``: the loss scaled in the step, the
update left to ``scaler.step`` — bitwise eager's, the scale made by the capture as torch's
first ``scale()`` makes it, a non-finite step skipped and the scale backed off alike; the
optimizer in the step refused (``capture/grad_scalers.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_bitwise_equal_models
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fitgraph
from fitgraph.capture.errors import CaptureError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def _batches():
    torch.manual_seed(1)
    xs = [torch.randn(64, 32) for _ in range(4)]
    xs[2][0, 0] = float("inf")   # NOTE: a step whose gradients are not finite: skipped
    return [(x, torch.randint(0, 8, (64,))) for x in xs]


def _scaled(scaler):
    def loss_fn(m, b):
        return scaler.scale(nn.functional.cross_entropy(m(b[0]), b[1]))
    return loss_fn


def test_a_scaled_loop_runs_bitwise_as_eager_with_the_scale_made_at_capture():
    a, b = _model(), None
    b = copy.deepcopy(a)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    sa = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    batches = _batches()
    step = fitgraph.optimize(b, batches[0], _scaled(sb), None, latency_limit=1.5,
                             time_budget=3, exact=True, measure_latency=False)
    assert sb.get_scale() == 2.0 ** 8 and sb._scale.device.type == "cpu"
    scales = []
    for batch in batches:
        oa.zero_grad(set_to_none=True)
        la = _scaled(sa)(a, batch)
        la.backward()
        sa.step(oa)
        sa.update()
        ob.zero_grad(set_to_none=True)
        lb = step(batch)
        sb.step(ob)
        sb.update()
        torch.testing.assert_close(lb, la, rtol=0, atol=0, equal_nan=True)
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=0, equal_nan=True,
                                       msg=n)
            pa.grad = pb.grad = None   # NOTE: NaNs where the step was skipped
        assert_bitwise_equal_models(a, b, oa, ob)
        assert sa.get_scale() == sb.get_scale()
        scales.append(sb.get_scale())
    assert scales == [2.0 ** 9, 2.0 ** 10, 2.0 ** 9, 2.0 ** 10]   # NOTE: grown, backed off


def test_the_optimizer_in_a_scaled_step_is_refused():
    model = _model()
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(CaptureError, match=r"optimizer=None.*scaler\.step"):
        fitgraph.capture(model, _batches()[0], _scaled(scaler),
                         torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_placeholder_an_earlier_trace_left_is_refused_by_name():
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            with FakeTensorMode():
                self.table = torch.ones(4)   # NOTE: as a first-use cache made while traced

        def forward(self, x):
            return self.lin(x) * self.table

    with pytest.raises(CaptureError, match="earlier capture made"):
        fitgraph.capture(Cached(), torch.randn(2, 4), lambda m, b: m(b).sum())
