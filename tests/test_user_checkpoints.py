"""A model that checkpoints its own blocks (``torch.utils.checkpoint``, Hugging Face's
``gradient_checkpointing_enable``) trains through fitgraph with eager's results.

Traced as eager runs it, the backward re-ran each block with dropout drawing afresh (torch
restores the RNG state first, in Python, outside any op): Hugging Face GPT-2 with checkpointing
trained to other weights from the second step on, silently, and a user's checkpointed blocks
with dropout failed to plan ("dependency cycle"). See ``fitgraph.capture.user_checkpoints``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fitgraph
from fitgraph.capture.tracer import PhaseTracker
from fitgraph.graph.ir import Phase

STEPS = 3


class Blocks(nn.Module):
    """Residual MLP blocks with dropout, each checkpointed by the model itself."""

    def __init__(self, reentrant: bool = False, grad_input: bool = True) -> None:
        super().__init__()
        self.reentrant, self.grad_input = reentrant, grad_input
        self.inp = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.2),
                                                  nn.Linear(64, 32)) for _ in range(3))
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        h = self.inp(x) if self.grad_input else x
        for blk in self.blocks:
            h = h + checkpoint(blk, h, use_reentrant=self.reentrant)
        return self.head(h)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 32, generator=g), torch.randint(0, 8, (64,), generator=g)


def _loss(m, b):
    return F.cross_entropy(m(b[0]), b[1])


def _train_both(model, batch, loss_fn, **kw):
    """Losses and final weights of eager PyTorch and of fitgraph, from the same seed."""
    twin = copy.deepcopy(model)
    opt_e = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    opt_f = torch.optim.AdamW(model.parameters(), lr=1e-2)
    call = loss_fn or (lambda m, b: m(**b).loss)
    torch.manual_seed(123)
    eager = []
    for _ in range(STEPS):
        opt_e.zero_grad(set_to_none=True)
        loss = call(twin, batch)
        loss.backward()
        opt_e.step()
        eager.append(loss.detach())
    torch.manual_seed(123)
    # NOTE: hotspot (remat and order) keeps every op's arithmetic, so bitwise holds; auto may
    # also split the loss's rows by fission when its time allows, which sums them in another
    # order (allclose, not bitwise: CI's run once did).
    step = fitgraph.optimize(model, batch, loss_fn, opt_f, latency_limit=1.3, time_budget=2,
                             measure_latency=False, solver="hotspot", **kw)
    ours = []
    for _ in range(STEPS):
        opt_f.zero_grad(set_to_none=True)
        ours.append(step(batch).detach())
    return eager, ours, twin, step


def _assert_bitwise(eager, ours, twin, model):
    assert all(torch.equal(a, b) for a, b in zip(eager, ours)), (eager, ours)
    for (name, a), b in zip(twin.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_with_dropout_train_bitwise_as_eager(reentrant):
    torch.manual_seed(0)
    model = Blocks(reentrant)
    eager, ours, twin, step = _train_both(model, _batch(), _loss)
    _assert_bitwise(eager, ours, twin, model)
    assert "3 torch.utils.checkpoint call(s)" in step.report().notes["user_checkpoints"]


def test_a_reentrant_block_without_grad_inputs_gets_no_gradients_as_in_eager():
    """torch's reentrant checkpoint gives a block none of its gradients where no tensor it
    reads requires grad (a known pitfall; torch warns): its weights stay where they were."""
    torch.manual_seed(0)
    model = Blocks(reentrant=True, grad_input=False)
    before = copy.deepcopy(model.blocks.state_dict())
    with pytest.warns(UserWarning, match="requires_grad"):
        eager, ours, twin, _ = _train_both(model, _batch(), _loss)
    _assert_bitwise(eager, ours, twin, model)
    assert all(torch.equal(a, b) for a, b in zip(before.values(),
                                                 model.blocks.state_dict().values()))


def test_a_module_run_during_the_backward_stays_in_the_backward():
    tracker = PhaseTracker()
    tracker.mark(Phase.BACKWARD, "")
    tracker.enter_module("blocks.0")
    tracker.exit_module()
    assert tracker.phase is Phase.BACKWARD
    tracker = PhaseTracker()
    tracker.enter_module("head")
    tracker.exit_module()
    assert tracker.phase is Phase.LOSS   # NOTE: after the model's forward, the loss


@pytest.mark.hf
def test_hugging_face_gradient_checkpointing_trains_bitwise_as_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable()
    model.train()   # NOTE: dropout 0.1 in every block: the masks must be the forward's
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    eager, ours, twin, step = _train_both(model, {"input_ids": ids, "labels": ids}, None)
    _assert_bitwise(eager, ours, twin, model)
    assert "user_checkpoints" in step.report().notes
