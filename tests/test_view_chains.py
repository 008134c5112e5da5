"""Reshape round trips collapsed, and regions that keep the token axis's full length."""

from __future__ import annotations

import copy
import re

import torch
import torch.nn.functional as F
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph.execute import execute
from fitgraph.graph.dim_region import grow_region
from fitgraph.transform.fission import split_region
from fitgraph.transform.fission_loss import count_targets_apart, counting_nodes
from fitgraph.transform.view_chains import collapse_view_chains


class _Head(torch.nn.Module):
    """A 3-D hidden state, a linear head and a token loss over the flattened (batch, seq)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 40, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


def _case(batch=2, seq=12):
    torch.manual_seed(0)
    x = torch.randn(batch, seq, 8)
    y = torch.randint(0, 40, (batch, seq))
    return _Head(), (x, y)


def _loss(m, b):
    return F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())


def _value(g, target):
    return next(n.outputs[0] for n in g.nodes if n.target == target)


def test_collapsed_graph_runs_bitwise_like_eager():
    model, batch = _case()
    a, b = model, copy.deepcopy(model)
    g = fitgraph.capture(b, batch, _loss)
    g2 = collapse_view_chains(g)
    assert len(g2.nodes) < len(g.nodes)
    # NOTE: no view reads a view any more where the first one reads a contiguous tensor
    for n in g2.nodes:
        if n.target in ("aten.view.default", "aten._unsafe_view.default"):
            src = g2.values[n.inputs[0]]
            p = src.producer
            assert p is None or g2.nodes[p].target not in (
                "aten.view.default", "aten._unsafe_view.default"), n.name
    la = eager_step(a, batch, _loss)
    lb = execute(g2, fitgraph.eager_plan(g2), b, batch)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b)


def test_views_of_a_strided_tensor_are_left_alone():
    class Sliced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            h = (x @ self.w)[:, :4]           # (6, 4) with stride (8, 1): not contiguous
            return h.view(2, 3, 4).view(6, 4).sum()

    g = fitgraph.capture(Sliced(), torch.randn(6, 4))
    assert collapse_view_chains(g) is g


def test_region_keeps_the_token_axis_through_the_collapsed_head():
    model, batch = _case(batch=2, seq=12)
    g = count_targets_apart(fitgraph.capture(model, batch, _loss))
    start = _value(g, "aten._log_softmax.default")
    coarse = grow_region(g, start, 0, exclude=counting_nodes(g))
    assert coarse.length == 2            # tied to the batch through the 3-D logits
    g2 = collapse_view_chains(g)
    start2 = _value(g2, "aten._log_softmax.default")
    fine = grow_region(g2, start2, 0, exclude=counting_nodes(g2), keep_length=True)
    assert fine.length == 24             # every token
    targets = {g2.nodes[n].target for n in fine.nodes}
    assert {"aten.mm.default", "aten._log_softmax.default",
            "aten.nll_loss_backward.default"} <= targets
    assert any("coarser" in why for why in fine.boundary.values())
    # the region in 8 parts runs like eager (allclose: the head's weight gradient is summed)
    a, b = model, copy.deepcopy(model)
    split = split_region(g2, fine, 8)
    la = eager_step(a, batch, _loss)
    lb = execute(split, fitgraph.eager_plan(split), b, batch)
    torch.testing.assert_close(lb, la)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, msg=name)


def test_fission_solver_splits_gpt2_loss_along_tokens_at_batch_two():
    from fitgraph import zoo
    from fitgraph.cost import RooflineCostModel, get_device
    from fitgraph.solvers import Problem, solve

    case = zoo.build("gpt2", "small", batch_size=2)
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    cm = RooflineCostModel(get_device("cpu-generic"))
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
    s = solve(Problem(g, cm, latency_limit=1.05, time_budget_s=30), "fission_splits")
    assert s.sim.peak_bytes <= 0.85 * eager.peak_bytes
    # NOTE: the loss along its tokens, maybe inside a part of the whole step split along the
    # batch first ("_log_softmax.part1 dim 0")
    loss_splits = [re.search(r"_log_softmax(\.part\d+)? dim 0 in (\d+) parts", what)
                   for what in s.notes["splits"]]
    assert any(m and int(m.group(2)) > 2 for m in loss_splits), s.notes["splits"]


class _SoftCapped(_Head):
    """Gemma-2's final logit soft-capping between the head and the loss, and a GELU between two
    linear layers on the 3-D hidden state: elementwise ops on 3-D views of 2-D matmuls."""

    def forward(self, x):
        logits = self.head(F.gelu(self.proj(x), approximate="tanh"))
        return torch.tanh(logits / 30.0) * 30.0


def test_elementwise_ops_between_reshapes_run_on_the_2d_tensor():
    from fitgraph.transform.elementwise_views import elementwise_before_reshapes

    torch.manual_seed(0)
    model = _SoftCapped()
    batch = (torch.randn(2, 12, 8), torch.randint(0, 40, (2, 12)))
    a, b = model, copy.deepcopy(model)
    g = count_targets_apart(fitgraph.capture(b, batch, _loss))
    moved = elementwise_before_reshapes(g)
    # the cap's div, tanh and mul, the GELU, and their gradients now run on [24, features]
    for n in moved.nodes:
        if n.target in ("aten.tanh.default", "aten.tanh_backward.default",
                        "aten.gelu.default", "aten.gelu_backward.default"):
            assert len(moved.values[n.outputs[0]].shape) == 2, n.name
    la = eager_step(a, batch, _loss)
    lb = execute(moved, fitgraph.eager_plan(moved), b, batch)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b)
    # the chunked loss's region takes in the soft-capping and the head, along every token
    g2 = collapse_view_chains(g)
    start = _value(g2, "aten._log_softmax.default")
    region = grow_region(g2, start, 0, exclude=counting_nodes(g2), keep_length=True)
    assert region.length == 24
    targets = {g2.nodes[n].target for n in region.nodes}
    assert {"aten.tanh.default", "aten.tanh_backward.default", "aten.mm.default"} <= targets
