"""Gradients no one can read (``compile_backend.unread_grads``): a leaf a step makes for itself
and lets go (Hugging Face speech encoders' ``hidden_states.requires_grad = True``) has its
gradient left out of a region planned again; a leaf the user holds keeps it, as eager."""

from __future__ import annotations

import torch
import torch.nn as nn

import fitgraph
from fitgraph.compile_backend.unread_grads import LeafRuns, drop_grads, leaf_inputs


class AudioFront(nn.Module):
    """wav2vec2's front in small: a leaf made inside the step that requires grad (a graph
    break under torch.compile), a strided convolution, a group norm, a ``.item()``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.Sequential(nn.Conv1d(1, 32, 10, 5), nn.GroupNorm(32, 32), nn.GELU(),
                                   nn.Conv1d(32, 32, 3, 2), nn.GELU())
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        h = x[:, None]
        if not h.requires_grad:
            h.requires_grad = True
        h = self.convs(h).transpose(1, 2)
        return self.head(h / (h.abs().mean() + 1).item())


def _loss(m, b):
    return m(b).square().mean()


def test_leaf_runs_find_the_leaves_no_one_holds():
    runs = LeafRuns()
    held = torch.ones(3, requires_grad=True)
    runs.note("g", [held, torch.ones(2, requires_grad=True), nn.Parameter(torch.ones(1)),
                    torch.ones(2)])
    assert runs.unread() == {"g": {1}}
    runs.note("g", [torch.ones(3, requires_grad=True), held])  # NOTE: index 1 held this time
    assert runs.unread() == {}
    assert leaf_inputs([held, held * 2, nn.Parameter(torch.ones(1))]) == [0]
    hooked = LeafRuns()
    t = torch.ones(2, requires_grad=True)
    t.register_hook(lambda g: g)  # NOTE: a hook reads its gradient: never left out
    hooked.note("h", [t])
    del t
    assert hooked.unread() == {}


def test_a_dropped_gradient_takes_its_backwards_work_with_it():
    """The joint graph returns None for the audio's gradient, and the convolution backward
    that made it no longer does (its output mask), the weights' gradients as eager's."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import default_partition

    conv = nn.Conv1d(1, 4, 5, 2)
    seen = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kw):
        seen["dropped"] = drop_grads(joint, num_fwd_outputs, {0})
        seen["masks"] = [n.args[-1] for n in joint.graph.nodes
                         if n.target == torch.ops.aten.convolution_backward.default]
        seen["outputs"] = list(joint.graph.output_node().args[0])
        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    f = aot_function(lambda x, w, b: torch.nn.functional.conv1d(x, w, b, 2).square().sum(),
                     fw_compiler=lambda gm, _: gm, partition_fn=partition)
    x = torch.randn(2, 1, 40, requires_grad=True)
    w, b = (t.detach().clone().requires_grad_() for t in (conv.weight, conv.bias))
    f(x, w, b).backward()
    assert seen["dropped"] == ["primals_1"] and seen["outputs"][1] is None
    assert seen["masks"] == [[False, True, True]]
    assert x.grad is None
    want = torch.nn.functional.conv1d(x.detach(), conv.weight, conv.bias, 2).square().sum()
    gw, gb = torch.autograd.grad(want, (conv.weight, conv.bias))
    torch.testing.assert_close(w.grad, gw)
    torch.testing.assert_close(b.grad, gb)


def _steps(batch_requires_grad: bool):
    model, twin = AudioFront(), AudioFront()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    x = torch.randn(2, 4000, generator=torch.Generator().manual_seed(0))
    x_twin = x.clone()
    if batch_requires_grad:
        x.requires_grad_()
        x_twin.requires_grad_()
    step = fitgraph.optimize(model, x, _loss, opt, budget="smallest", graph_breaks="regions",
                             time_budget=5, exact=True)
    for _ in range(8):
        for o in (opt, opt_twin):
            o.zero_grad(set_to_none=True)
        x.grad = x_twin.grad = None
        got = step(x)
        want = _loss(twin, x_twin)
        want.backward()
        opt_twin.step()
        torch.testing.assert_close(got, want.detach())
        if batch_requires_grad:
            torch.testing.assert_close(x.grad, x_twin.grad)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    return step


def test_a_leaf_the_step_made_and_let_go_has_its_gradient_left_out():
    step = _steps(batch_requires_grad=False)
    assert step.settled
    assert any(v for v in step._unread_grads.values()), step._unread_grads


def test_a_leaf_the_user_holds_keeps_its_gradient():
    """The batch itself requires grad (an adversarial step reads ``x.grad``): its gradient is
    made as eager makes it, at every step."""
    step = _steps(batch_requires_grad=True)
    assert step.settled and not step._unread_grads
