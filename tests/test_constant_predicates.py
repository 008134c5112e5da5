"""Mask predicates that index arithmetic decides are folded: a bidirectional mask ``(q_idx >= 0)
& padding`` becomes the padding mask expanded, each block's float mask is made from it once per
batch row (not per query row), and the step is bitwise the same."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph.execute import execute
from fitgraph.transform.constant_predicates import fold_constant_predicates
from fitgraph.transform.elementwise_expands import elementwise_before_expands

B, H, T, D = 2, 2, 16, 8


def _bidirectional(keep, offset=0):
    """Hugging Face's bidirectional mask: ``q_idx >= 0`` and'ed with the padding mask at the
    key positions, a bool ``[B, 1, T, T]``."""
    q_idx = (torch.arange(T) + offset)[None, None, :, None]
    kv_idx = torch.arange(T)[None, None, None, :]
    batch = torch.arange(keep.shape[0])[:, None, None, None]
    return q_idx.new_ones((), dtype=torch.bool) & (q_idx >= 0) & keep[batch, kv_idx]


class _Encoder(torch.nn.Module):
    """Blocks of scaled-dot-product attention, each turning one bool mask into its own float
    mask with ``where`` (as Hugging Face's attention does)."""

    def __init__(self, blocks: int = 3, mask_fn=_bidirectional):
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(D, 3 * D) for _ in range(blocks))
        self.mask_fn = mask_fn

    def forward(self, x, keep):
        mask = self.mask_fn(keep)
        for proj in self.qkv:
            q, k, v = proj(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
            floats = torch.where(mask, 0.0, float("-inf"))
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=floats
                                                   ).transpose(1, 2).reshape(B, T, D)
        return x


def _loss(m, batch):
    return m(*batch).square().mean()


def _batch():
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, -3:] = False     # NOTE: padding at the end of the second row
    return torch.randn(B, T, D), keep


def _where_bytes(g):
    return [g.storage_of(n.outputs[0]).nbytes for n in g.nodes
            if n.target == "aten.where.self"]


def _folded(g):
    return elementwise_before_expands(fold_constant_predicates(g))


def test_the_bidirectional_mask_is_folded_and_the_step_is_bitwise_eager():
    torch.manual_seed(0)
    model, batch = _Encoder(), _batch()
    a, b = model, copy.deepcopy(model)
    g = fitgraph.capture(b, batch, _loss)
    g2 = _folded(g)
    assert [n.target for n in g2.nodes if n.name.startswith("bitwise_and")][-1] == (
        "aten.expand.default")
    # NOTE: each block's float mask is one row per batch row, not T
    assert [w * T for w in _where_bytes(g2)] == _where_bytes(g) == [B * T * T * 4] * 3
    la = eager_step(a, batch, _loss)
    assert torch.equal(la, execute(g2, fitgraph.eager_plan(g2), b, batch))
    assert_bitwise_equal_models(a, b)


@pytest.mark.parametrize("mask_fn, folds", [
    # NOTE: arange(T) - 1 is -1 at row 0: the predicate is not true everywhere
    (lambda keep: _bidirectional(keep, offset=-1), False),
    (lambda keep: _bidirectional(keep, offset=3), True),
    # NOTE: kv_idx <= q_idx (causal) is decided by no range: it stays
    (lambda keep: (torch.arange(T)[None, None, None, :] <= torch.arange(T)[None, None, :, None])
     & keep[:, None, None, :], False),
    # NOTE: an | with a predicate false everywhere is the other operand
    (lambda keep: (torch.arange(T)[None, None, :, None] < 0) | keep[:, None, None, :], True),
    # NOTE: an index written in place is no range
    (lambda keep: (torch.arange(T).add_(-5)[None, None, :, None] >= 0)
     & keep[:, None, None, :], False),
])
def test_only_predicates_the_ranges_decide_fold(mask_fn, folds):
    torch.manual_seed(0)
    model, batch = _Encoder(mask_fn=mask_fn), _batch()
    a, b = model, copy.deepcopy(model)
    g = fitgraph.capture(b, batch, _loss)
    g2 = fold_constant_predicates(g)
    assert (g2 is not g) == folds
    g2 = elementwise_before_expands(g2)
    assert (_where_bytes(g2) != _where_bytes(g)) == folds
    la = eager_step(a, batch, _loss)
    assert torch.equal(la, execute(g2, fitgraph.eager_plan(g2), b, batch))
    assert_bitwise_equal_models(a, b)


def test_a_mask_read_through_another_view_is_left_alone():
    # NOTE: a view of a stride-0 tensor would be recorded with the strides it had: not folded
    def mask_fn(keep):
        m = _bidirectional(keep)
        return m.reshape(B, T * T).reshape(B, 1, T, T)

    g = fitgraph.capture(_Encoder(mask_fn=mask_fn), _batch(), _loss)
    assert fold_constant_predicates(g) is g


def test_hugging_face_encoder_masks_fold():
    pytest.importorskip("transformers")
    from fitgraph.bench.sweep_models import build

    case = build("albert")
    a, b = case.model, copy.deepcopy(case.model)
    loss_fn = case.loss_fn or (lambda m, batch: m(**batch).loss)
    g = fitgraph.capture(b, case.batch, loss_fn)
    g2 = _folded(g)
    assert len([n for n in g2.nodes if n.name.endswith(".expanded")]) == 4   # NOTE: per block
    assert sum(_where_bytes(g2)) * 256 == sum(_where_bytes(g))
    torch.manual_seed(0)
    la = eager_step(a, case.batch, loss_fn)
    torch.manual_seed(0)
    assert torch.equal(la, execute(g2, fitgraph.eager_plan(g2), b, case.batch))
    assert_bitwise_equal_models(a, b)
