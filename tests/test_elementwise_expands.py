"""Elementwise ops moved before the expands they read: a mask made alike for every batch row is
made once, bitwise the same step."""

from __future__ import annotations

import copy

import torch
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph.execute import execute
from fitgraph.sim.simulate import simulate
from fitgraph.transform.elementwise_expands import elementwise_before_expands

B, T, D = 4, 16, 8


class _Masked(torch.nn.Module):
    """Blocks of masked attention scores, all reading one float mask made as Hugging Face makes
    a causal mask: a bool ``[1, 1, T, T]`` expanded over the batch, then ``where``."""

    def __init__(self, blocks: int = 3, reader=None):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(blocks))
        self.reader = reader

    def forward(self, x):
        rows = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(x.shape[0], 1, T, T)
        mask = torch.where(rows, 0.0, torch.finfo(x.dtype).min)
        if self.reader is not None:
            mask = self.reader(mask)
        for p in self.proj:
            h = p(x)
            scores = h @ h.transpose(-1, -2) / D ** 0.5
            x = (scores[:, None] + mask).softmax(-1)[:, 0] @ h + x
        return x


def _loss(m, x):
    return m(x).square().mean()


def _mask_bytes(g):
    where = next(n for n in g.nodes if n.target == "aten.where.self")
    return g.storage_of(where.outputs[0]).nbytes


def test_the_mask_is_made_once_for_the_batch_and_the_step_is_bitwise_eager():
    torch.manual_seed(0)
    model, x = _Masked(), torch.randn(B, T, D)
    a, b = model, copy.deepcopy(model)
    g = fitgraph.capture(b, x, _loss)
    g2 = elementwise_before_expands(g)
    assert _mask_bytes(g2) * B == _mask_bytes(g)
    assert [n.name for n in g2.nodes if n.name.endswith(".expanded")] == ["where.expanded"]
    la = eager_step(a, x, _loss)
    lb = execute(g2, fitgraph.eager_plan(g2), b, x)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b)


def _forward_peak(g, cm):
    sim = simulate(g, fitgraph.eager_plan(g), cm)
    return max(sim.peak_during[:sim.phase_starts["backward"]])


def test_the_forward_holds_less_at_its_peak():
    torch.manual_seed(0)
    g = fitgraph.capture(_Masked(), torch.randn(B, T, D), _loss)
    g2 = elementwise_before_expands(g)
    cm = fitgraph.cost.RooflineCostModel(fitgraph.cost.get_device("cpu-generic"))
    assert _forward_peak(g, cm) - _forward_peak(g2, cm) == _mask_bytes(g) - _mask_bytes(g2)


def test_a_mask_read_through_a_view_or_written_in_place_is_left_alone():
    torch.manual_seed(0)
    x = torch.randn(B, T, D)
    for reader in (lambda m: m.view(B, T, T)[:, None],     # NOTE: a view of a stride-0 tensor
                   lambda m: m.mul_(1.0)):                  # NOTE: an in-place write
        g = fitgraph.capture(_Masked(reader=reader), x, _loss)
        assert elementwise_before_expands(g) is g


def test_a_reader_that_would_lay_out_its_output_otherwise_keeps_the_mask_whole():
    # NOTE: the sum of the mask and a tensor laid out batch-innermost follows the mask's
    # layout (the first operand's); with the mask strided 0 over the batch it would follow
    # the other's, and a view after it (recorded on the captured strides) would not hold
    torch.manual_seed(0)
    x = torch.randn(B, T, D)

    def reader(m):
        return m + torch.zeros(1, T, T, B).permute(3, 0, 1, 2)

    g = fitgraph.capture(_Masked(reader=reader), x, _loss)
    g2 = elementwise_before_expands(g)
    assert _mask_bytes(g2) == _mask_bytes(g)


def test_an_op_with_a_whole_operand_stays_whole():
    class Whole(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(B, T))

        def forward(self, x):
            # NOTE: the comparison runs on one row; the where beside the whole weight cannot
            return (torch.where(x[:1].expand(B, T) > 0, self.w, 0.0) * x).sum()

    torch.manual_seed(0)
    model, x = Whole(), torch.randn(B, T)
    a, b = model, copy.deepcopy(model)
    g = fitgraph.capture(b, x, lambda m, x: m(x))
    g2 = elementwise_before_expands(g)
    assert [n.name for n in g2.nodes if n.name.endswith(".expanded")] == ["gt.expanded"]
    assert _mask_bytes(g2) == _mask_bytes(g)
    la = eager_step(a, x, lambda m, x: m(x))
    assert torch.equal(la, execute(g2, fitgraph.eager_plan(g2), b, x))
    assert_bitwise_equal_models(a, b)


def test_a_zero_dim_tensor_expanded_is_left_alone():
    class Scalar(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(B, T))

        def forward(self, x):
            # NOTE: a 0-dim tensor's dtype yields to a dimensioned one's in type promotion;
            # its expand does not: run on the 0-dim tensor, the op could promote otherwise
            s = x.sum().expand(B, T).to(torch.float64)
            return (torch.exp(s) * self.w.double()).sum()

    g = fitgraph.capture(Scalar(), torch.randn(B, T), lambda m, x: m(x))
    assert elementwise_before_expands(g) is g
