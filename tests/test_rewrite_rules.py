"""The rewrite rules (transform.rules): each proved on real tensors on random shapes, each refused
where its rewrite would not keep the values or the layouts."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_split_like_eager
from hypothesis import given, settings
from hypothesis import strategies as st

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.execute import execute
from fitgraph.graph.analysis import verify_graph
from fitgraph.sim.simulate import simulate
from fitgraph.transform.registry import TRANSFORMS
from fitgraph.transform.rules import RULES

CPU = RooflineCostModel(get_device("cpu-generic"))


def _rewritten(rule: str, model, batch, loss_fn=None):
    """The captured step, the rule's rewrite of it (checked), and its matches."""
    g = fitgraph.capture(model, batch, loss_fn)
    matches = RULES[rule].find(g)
    g2 = RULES[rule].rewrite(g)
    if matches:
        assert g2 is not g
        verify_graph(g2)
    else:
        assert g2 is g
    return g, g2, matches


def _eager_seconds(g) -> float:
    return simulate(g, fitgraph.eager_plan(g), CPU).latency_s


class Scaled(torch.nn.Module):
    """Attention-like scores ``(q @ k^T) * c`` (or ``/ c``), 2-D or batched 4-D."""

    def __init__(self, d_in, d, heads, scale, divide):
        super().__init__()
        self.q = torch.nn.Linear(d_in, d * heads)
        self.k = torch.nn.Linear(d_in, d * heads)
        self.heads, self.scale, self.divide = heads, scale, divide

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, -1).transpose(1, 2)
        s = q @ k.transpose(-2, -1)
        s = s / self.scale if self.divide else s * self.scale
        return s.softmax(-1).sum()


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 3), st.integers(4, 24), st.integers(2, 8), st.integers(1, 3),
       st.sampled_from([0.125, 0.3, 3.0]), st.booleans())
def test_scale_across_matmul_keeps_the_values_on_random_shapes(b, t, d, heads, scale, divide):
    torch.manual_seed(0)
    model = Scaled(6, d, heads, scale, divide)
    batch = torch.randn(b, t, 6)
    g, g2, matches = _rewritten("scale_across_matmul", model, batch)
    # NOTE: an operand smaller than the product carries the scaling: always here when d < t
    assert bool(matches) == (d < t)
    # NOTE: the scaling rounds before the product: gradients of unit size agree to ~1e-6
    assert_split_like_eager(g, g2, model, batch, atol=1e-5)
    if matches:
        assert all(m.bytes_saved > 0 for m in matches)
        assert _eager_seconds(g2) < _eager_seconds(g)   # one score-sized pass fewer


def test_scale_across_matmul_leaves_a_product_read_elsewhere():
    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 2))

        def forward(self, x):
            q = x @ self.w
            p = q @ q.T
            return (p * 0.5).softmax(-1).sum() + p.sum()   # the product read twice

    _, g2, matches = _rewritten("scale_across_matmul", Both(), torch.randn(16, 4))
    assert not matches


class Packed(torch.nn.Module):
    """A packed projection split into parts of random widths, each used by a matmul after
    views (as GPT-2's attention does)."""

    def __init__(self, d_in, widths, bias, heads):
        super().__init__()
        self.proj = torch.nn.Linear(d_in, sum(widths), bias=bias)
        self.widths, self.heads = list(widths), heads

    def forward(self, x):
        b, t, _ = x.shape
        parts = self.proj(x).split(self.widths, dim=-1)
        out = 0
        for p in parts:
            h = p.view(b, t, self.heads, -1).transpose(1, 2)
            out = out + (h @ h.transpose(-2, -1)).softmax(-1).mean()
        return out


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 3), st.integers(2, 12), st.lists(st.sampled_from([2, 4, 6]), min_size=2,
                                                       max_size=4), st.booleans())
def test_split_packed_matmuls_keeps_the_values_on_random_shapes(b, t, widths, bias):
    torch.manual_seed(0)
    model = Packed(5, widths, bias, heads=2)
    batch = torch.randn(b, t, 5)
    g, g2, matches = _rewritten("split_packed_matmuls", model, batch)
    assert [m.parts for m in matches] == [len(widths)]
    target = "aten.addmm.default" if bias else "aten.mm.default"
    forward = [n for n in g2.nodes if n.target == target and n.phase.value == "forward"]
    assert len(forward) == len(widths)
    assert_split_like_eager(g, g2, model, batch)


def test_split_packed_matmuls_lets_each_part_die_alone():
    """``v`` read only at the end: the packed tensor lived until then, the split's ``q`` and
    ``k`` die at once (the eager peak is lower)."""
    class Late(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 3 * 256)

        def forward(self, x):
            q, k, v = self.qkv(x).split(256, dim=-1)
            s = (q @ k.T).softmax(-1)
            big = torch.tanh(s.repeat(1, 8))      # a large tensor while v waits
            return (big.sum() * v).sum()

    g, g2, matches = _rewritten("split_packed_matmuls", Late(), torch.randn(64, 16))
    assert matches
    peak = lambda graph: simulate(graph, fitgraph.eager_plan(graph), CPU).peak_bytes  # noqa: E731
    assert peak(g2) < peak(g)


def test_split_packed_matmuls_refuses_a_reader_whose_layout_follows_its_input():
    """A part read by an elementwise op after a transpose: its output's strides follow the
    input's, which the split changes — no match."""
    class Elementwise(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 8)

        def forward(self, x):
            a, b = self.proj(x).split(4, dim=-1)
            return (a.t() * 2).sum() + b.sum()

    _, _, matches = _rewritten("split_packed_matmuls", Elementwise(), torch.randn(6, 4))
    assert not matches


class Shared(torch.nn.Module):
    """``k`` projections of one input, as BERT's q/k/v or Llama's gate/up."""

    def __init__(self, d_in, d_out, k, bias):
        super().__init__()
        self.projs = torch.nn.ModuleList(torch.nn.Linear(d_in, d_out, bias=bias)
                                         for _ in range(k))

    def forward(self, x):
        ys = [p(x) for p in self.projs]
        out = ys[0]
        for y in ys[1:]:
            out = out * torch.sigmoid(y)
        return out.sum()


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.integers(2, 8), st.integers(2, 8),
       st.integers(2, 4), st.booleans())
def test_merge_shared_matmuls_keeps_the_values_on_random_shapes(b, t, d_in, d_out, k, bias):
    torch.manual_seed(0)
    model = Shared(d_in, d_out, k, bias)
    batch = torch.randn(b, t, d_in)
    g, g2, matches = _rewritten("merge_shared_matmuls", model, batch)
    assert [len(m.matmuls) for m in matches] == [k]
    merged = "aten.baddbmm.default" if bias else "aten.bmm.default"
    assert sum(n.target == merged for n in g2.nodes) == 1
    # NOTE: the stacked weights are a temporary the rewrite adds every step
    assert matches[0].bytes_saved == -k * d_in * d_out * 4
    assert_split_like_eager(g, g2, model, batch)


def test_merge_shared_matmuls_leaves_projections_of_other_widths_apart():
    class Widths(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 6)

        def forward(self, x):
            return self.a(x).sum() + self.b(x).sum()

    _, _, matches = _rewritten("merge_shared_matmuls", Widths(), torch.randn(3, 4))
    assert not matches


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_is_a_registered_transform(name):
    rule = RULES[name]
    assert TRANSFORMS[name].exact == rule.exact and rule.changes
    model = Packed(4, [4, 4], True, heads=1)
    g = fitgraph.capture(copy.deepcopy(model), torch.randn(1, 3, 4))
    out = TRANSFORMS[name](g)
    assert out.applied == (name,)


class Undone(torch.nn.Module):
    """A split concatenated back, pieces concatenated then split at their sizes, and a
    permutation undone — around a matmul so that each value has a gradient."""

    def __init__(self, widths, order):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, sum(widths)))
        self.widths, self.order = list(widths), list(order)

    def forward(self, x):
        y = x @ self.w
        back = torch.cat(y.split(self.widths, dim=-1), dim=-1)           # y again
        pieces = torch.cat([back.tanh(), back.sin()], dim=0).split(x.shape[0], dim=0)
        z = pieces[0] * pieces[1]
        inverse = [self.order.index(i) for i in range(3)]
        u = z.view(x.shape[0], 1, -1).permute(self.order).permute(inverse)  # z again
        return (u.exp() * 2).sum()


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(1, 4), min_size=2, max_size=4),
       st.permutations([0, 1, 2]))
def test_inverse_pairs_are_removed_bitwise_on_random_shapes(rows, widths, order):
    torch.manual_seed(0)
    model = Undone(widths, order)
    batch = torch.randn(rows, 3)
    g, g2, matches = _rewritten("inverse_pairs", model, batch)
    kinds = {m.kind for m in matches}
    assert {"cat of a split", "split of a cat"} <= kinds
    assert "permutations" in kinds or order == [0, 1, 2]
    assert len(g2.nodes) < len(g.nodes)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    la = execute(g, fitgraph.eager_plan(g), a, batch)
    lb = execute(g2, fitgraph.eager_plan(g2), b, batch)
    assert torch.equal(la, lb) and torch.equal(a.w.grad, b.w.grad)   # nothing computed otherwise


def test_a_cat_in_another_order_is_not_undone():
    class Swapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            a, b = (x @ self.w).split(2, dim=-1)
            return torch.cat([b, a], dim=-1).tanh().sum()   # rotate_half-like: not x

    _, _, matches = _rewritten("inverse_pairs", Swapped(), torch.randn(2, 3))
    assert not [m for m in matches if m.kind == "cat of a split"]


class Fused(torch.nn.Module):
    """Operands concatenated along the channels, then a convolution (a U-Net's skip
    connection, a feature pyramid's fusion)."""

    def __init__(self, widths, k, bias):
        super().__init__()
        self.parts = torch.nn.ModuleList(torch.nn.Conv2d(3, w, 3, padding=1) for w in widths)
        self.fuse = torch.nn.Conv2d(sum(widths), 4, k, padding=k // 2, bias=bias)

    def forward(self, x):
        return self.fuse(torch.cat([p(x).relu() for p in self.parts], 1)).square().mean()


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 3), st.integers(3, 9), st.lists(st.integers(1, 5), min_size=2, max_size=3),
       st.sampled_from([1, 3]), st.booleans())
def test_per_operand_convolution_keeps_the_values_on_random_shapes(b, size, widths, k, bias):
    torch.manual_seed(0)
    model = Fused(widths, k, bias)
    batch = torch.randn(b, 3, size, size)
    g, g2, matches = _rewritten("per_operand_convolution", model, batch)
    assert len(matches) == 1 and len(matches[0].convolutions) == 2   # forward and backward
    assert matches[0].bytes_saved == b * sum(widths) * size * size * 4
    # NOTE: the one concatenation left is the weight gradient's columns, put back together
    assert [g2.values[n.outputs[0]].shape for n in g2.nodes if n.target == "aten.cat.default"
            ] == [(4, sum(widths), k, k)]
    assert_split_like_eager(g, g2, model, batch, atol=1e-5)


def test_per_operand_convolution_matches_in_a_step_with_its_optimizer():
    """The weight gradient, put back together dense as the kernel made it, is read by the
    captured optimizer's update as before (a reader that cannot run on meta tensors, asked
    about the layout it already reads)."""
    torch.manual_seed(0)
    model, batch = Fused([3, 5], 3, True), torch.randn(2, 3, 8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = fitgraph.capture(model, batch, None, opt)
    matches = RULES["per_operand_convolution"].find(g)
    assert len(matches) == 1
    g2 = RULES["per_operand_convolution"].rewrite(g)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    for m, graph in ((a, g), (b, g2)):
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        execute(graph, fitgraph.eager_plan(graph), m, batch, optimizer=o)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


_MATCHING = {   # NOTE: a module on which each rule matches, and its batch
    "scale_across_matmul": (lambda: Scaled(8, 4, 2, 0.125, divide=False), (2, 32, 8)),
    "split_packed_matmuls": (lambda: Packed(5, [4, 6, 2], True, heads=2), (2, 8, 5)),
    "merge_shared_matmuls": (lambda: Shared(6, 5, 3, True), (2, 7, 6)),
    "inverse_pairs": (lambda: Undone([2, 3], [2, 0, 1]), (4, 3)),
    "per_operand_convolution": (lambda: Fused([3, 5], 3, True), (2, 3, 8, 8)),
}


@pytest.mark.parametrize("name", sorted(_MATCHING))
def test_a_rewritten_step_measures_the_peak_it_simulates(name):
    """Law 2 on each rule's graph: the layouts a rule writes (views laid out again, parts at
    new offsets) are the tensors the step makes — the allocator meter measures the simulated
    peak to the byte (kernels' workspaces measured: a profiled cost model)."""
    from fitgraph.cost import ProfiledCostModel
    from fitgraph.measure import measure_plan

    make, shape = _MATCHING[name]
    torch.manual_seed(0)
    model, batch = make(), torch.randn(*shape)
    _, g2, matches = _rewritten(name, model, batch)
    assert matches
    cost = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cost.profile(g2)
    plan = fitgraph.eager_plan(g2)
    measured = measure_plan(g2, plan, model, batch, repeats=0)
    assert measured.peak_bytes == simulate(g2, plan, cost).peak_bytes


class Twice(torch.nn.Module):
    """Two copies of a module, on the batch and on half of it, their losses added: each rule
    matches in both (apart: the copies read different inputs)."""

    def __init__(self, make):
        super().__init__()
        self.a, self.b = make(), make()

    def forward(self, x):
        return self.a(x) + self.b(x * 0.5)


def _norm_block():
    from test_norm_from_stats import Block
    return Block(4, "relu", True, 2)


_TWICE = dict(_MATCHING, norm_from_stats=(_norm_block, (3, 3, 6, 6)),
              norm_from_stats_through_sums=(_norm_block, (3, 3, 6, 6)))


@pytest.mark.parametrize("name", sorted(_TWICE))
def test_a_rule_on_some_of_its_matches_keeps_the_values(name):
    """The search also applies a rule to half of its matches (``coordinated.HALF``): each
    match stands alone, so any one of them rewritten keeps the step's results (bitwise for an
    exact rule), and the others stay as captured."""
    make, shape = _TWICE[name]
    torch.manual_seed(0)
    model, batch = Twice(make), torch.randn(*shape)
    g = fitgraph.capture(copy.deepcopy(model), batch)
    rule = RULES[name]
    matches = rule.find(g)
    assert len(matches) >= 2
    for one in matches:
        g2 = rule.rewrite(g, matches=[one])
        verify_graph(g2)
        assert 0 < len(rule.find(g2)) < len(matches)   # the others still match
        if rule.exact:
            a, b = copy.deepcopy(model), copy.deepcopy(model)
            la = execute(g, fitgraph.eager_plan(g), a, batch)
            lb = execute(g2, fitgraph.eager_plan(g2), b, batch)
            assert torch.equal(la, lb)
            assert all(torch.equal(p.grad, q.grad)
                       for p, q in zip(a.parameters(), b.parameters()))
        else:
            assert_split_like_eager(g, g2, model, batch, atol=1e-5)
