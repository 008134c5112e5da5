"""Resampling runs in parts: ``F.grid_sample`` (spatial transformers, flow warping) along the
batch (each sample reads its own grid) forward and backward, and along the channels forward;
bicubic, trilinear and 3-D nearest upsampling along batch and channels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_dims import _one_node, check_node
from torch import nn

import fitgraph


def _r(*shape):
    return torch.randn(shape, dtype=torch.float64)


@pytest.mark.parametrize("mode, padding, corners", [(0, 0, False), (1, 1, True), (2, 2, False)])
def test_rules_hold_on_real_tensors(mode, padding, corners):
    x, grid = _r(3, 4, 6, 5), _r(3, 7, 8, 2) * 0.9
    g, node, env = _one_node("aten.grid_sampler_2d.default", (x, grid, mode, padding, corners))
    assert check_node(g, node, env) == 2
    g, node, env = _one_node("aten.grid_sampler_2d_backward.default",
                             (_r(3, 4, 7, 8), x, grid, mode, padding, corners, [True, True]))
    assert check_node(g, node, env) == 1


@pytest.mark.parametrize("op, x, size, extra", [
    ("upsample_bicubic2d", (3, 4, 5, 6), [10, 12], (False,)),
    ("upsample_trilinear3d", (3, 4, 3, 5, 6), [6, 10, 12], (False,)),
    ("upsample_nearest3d", (3, 4, 3, 5, 6), [6, 10, 12], ()),
    ("upsample_nearest3d", (1, 4, 3, 5, 6), [6, 10, 12], ()),   # NOTE: the depth not offered
])
def test_upsampling_rules_hold_on_real_tensors(op, x, size, extra):
    x = _r(*x)
    g, node, env = _one_node(f"aten.{op}.default", (x, size, *extra))
    splits = (x.shape[0] >= 2) + (x.shape[1] >= 2)     # NOTE: batch and channels
    assert check_node(g, node, env) == splits
    grad = _r(*x.shape[:2], *size)
    g, node, env = _one_node(f"aten.{op}_backward.default",
                             (grad, size, list(x.shape), *extra))
    assert check_node(g, node, env) == splits


def test_a_warping_model_runs_its_batch_in_parts_as_eager():
    class Warp(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 16, 3, padding=1)
            self.flow = nn.Conv2d(16, 2, 3, padding=1)
            self.b = nn.Conv2d(16, 3, 3, padding=1)

        def forward(self, x):
            h = torch.relu(self.a(x))
            base = torch.stack(torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32),
                                              indexing="xy"), -1)
            grid = base + 0.1 * torch.tanh(self.flow(h)).permute(0, 2, 3, 1)
            return self.b(F.grid_sample(h, grid, align_corners=False))

    torch.manual_seed(0)
    a = Warp()
    b = copy.deepcopy(a)
    batch = (torch.randn(16, 3, 32, 32), torch.randn(16, 3, 32, 32))

    def loss_fn(m, bt):
        return F.mse_loss(m(bt[0]), bt[1])

    step = fitgraph.optimize(b, batch, loss_fn, budget=0.6, time_budget=10)
    r = step.report()
    assert r.notes["winner"] == "fission"
    loss = loss_fn(a, batch)
    loss.backward()
    torch.testing.assert_close(step(batch), loss.detach())
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad)
    r = step.report()
    assert r.measured_peak_bytes <= r.budget_bytes
    assert r.measured_peak_bytes == r.planned_peak_bytes   # NOTE: law 2, beyond the zoo
