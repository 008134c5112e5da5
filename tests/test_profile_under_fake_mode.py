"""The profiler measures real kernels even when called under a FakeTensorMode (issue 25).

``fitgraph.backend`` plans inside AOTAutograd's partitioner, where a FakeTensorMode is active:
the ops ran on fake tensors, so every workspace read 0 B and every time a fraction of the
kernel's (wav2vec2's convolution backward: 0 B for 6.2 MiB), and the cache kept them."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fitgraph
from fitgraph.cost import ProfiledCostModel
from fitgraph.execute.meter import MemoryMeter


def _conv_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 32, 10, stride=5), nn.GELU(),
                          nn.Conv1d(32, 32, 3, stride=2), nn.GELU())
    x = torch.randn(2, 1, 16000)
    return fitgraph.capture(model, x, lambda m, b: m(b).square().mean())


def test_a_profile_under_fake_mode_measures_real_workspaces(tmp_path):
    g = _conv_graph()
    real = ProfiledCostModel("cpu", cache=tmp_path / "a", progress=False, in_situ=False)
    real.profile(g)
    faked = ProfiledCostModel("cpu", cache=tmp_path / "b", progress=False, in_situ=False)
    with FakeTensorMode():
        faked.profile(g)
    convs = [n for n in g.nodes if n.target == "aten.convolution_backward.default"]
    assert convs
    for n in convs:
        a, b = real.measurement(g, n), faked.measurement(g, n)
        assert b.end_bytes == b.fresh_bytes > 0     # NOTE: fake tensors allocate nothing
        assert b.workspace_bytes == a.workspace_bytes
    assert max(real.measurement(g, n).workspace_bytes for n in convs) > 0


def test_the_backend_simulates_what_its_graph_allocates():
    """Law 2 through torch.compile: the region's simulated peak is the measured one, its
    convolution workspaces included (they were 0 B when measured on fake tensors)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 32, 10, stride=5), nn.GELU(),
                          nn.Conv1d(32, 32, 3, stride=2), nn.GELU())
    x = torch.randn(2, 1, 16000)
    be = fitgraph.backend(budget="smallest")
    torch._dynamo.reset()  # NOTE: earlier compiles of Sequential's code would make shapes dynamic
    f = torch.compile(model, backend=be, dynamic=False)
    out = f(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    del out
    r = be.last_report
    # NOTE: the joint graph counts its inputs from the start (weights, the batch, the output's
    # gradient: the tangent) and keeps the forward's output to the end, as this step does
    resident = sum(p.numel() * 4 for p in model.parameters()) + (x.numel() + grad_out.numel()) * 4
    with MemoryMeter() as m:
        out = f(x)
        out.backward(grad_out)
    torch._dynamo.reset()
    measured = resident + m.peak_bytes
    assert abs(r.planned_peak_bytes - measured) <= 0.01 * measured, (r.planned_peak_bytes,
                                                                      measured)
