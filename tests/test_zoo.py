"""Model zoo: every model builds, trains a step, is deterministic, has paper-size counts."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

from fitgraph import zoo

BUILTIN = [
    "bert-base", "bert-large", "gpt-neo-1.3b", "gpt2", "gpt2-large", "gpt2-medium", "gpt2-xl",
    "llama", "resnet50", "unet", "vit-b16",
]
HF = ["hf-bert", "hf-gpt2", "hf-llama", "hf-t5", "hf-vit"]

# Known parameter counts of the paper configs (unet: the classic 31.0M U-Net;
# gpt-neo-1.3b: GPT-Neo 1.3B; llama: TinyLlama-1.1B).
PAPER_PARAMS = {
    "resnet50": 25.6e6,
    "unet": 31.0e6,
    "vit-b16": 86.6e6,
    "bert-base": 110e6,
    "bert-large": 335e6,
    "gpt2": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-large": 774e6,
    "gpt2-xl": 1.558e9,
    "gpt-neo-1.3b": 1.3e9,
    "llama": 1.1e9,
}


def _tensors(batch):
    return list(batch.values()) if isinstance(batch, dict) else list(batch)


def test_names():
    assert zoo.names() == BUILTIN
    assert zoo.hf_names() == HF
    assert set(PAPER_PARAMS) == set(BUILTIN)


@pytest.mark.parametrize("name", BUILTIN)
def test_small_trains_one_step(name):
    case = zoo.build(name, "small")
    assert (case.name, case.config) == (name, "small")
    assert case.description and callable(case.loss_fn)
    loss = case.loss_fn(case.model, case.batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in case.model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    # NOTE: the repeated blocks are what per-block checkpointing wraps.
    blocks = [m for m in case.model.modules() if isinstance(m, case.block_types)]
    assert len(blocks) >= 2


@pytest.mark.parametrize("name", ["gpt2", "bert-base", "resnet50"])
def test_deterministic(name):
    a, b = zoo.build(name, seed=3), zoo.build(name, seed=3)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(x, y) for x, y in zip(_tensors(a.batch), _tensors(b.batch)))
    c = zoo.build(name, seed=4)
    assert not all(torch.equal(x, y) for x, y in zip(_tensors(a.batch), _tensors(c.batch)))
    pa, pc = list(a.model.parameters()), list(c.model.parameters())
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc))


@pytest.mark.parametrize("name", BUILTIN)
def test_paper_on_meta(name):
    case = zoo.build(name, "paper", device="meta")
    n = sum(p.numel() for p in case.model.parameters())
    assert math.isclose(n, PAPER_PARAMS[name], rel_tol=0.10), n
    assert all(p.is_meta for p in case.model.parameters())
    assert all(b.is_meta for b in case.model.buffers())
    assert all(t.is_meta for t in _tensors(case.batch))


def test_paper_meta_forward_shapes():
    case = zoo.build("gpt2-xl", "paper", device="meta")
    assert case.batch["input_ids"].shape == (8, 1024)
    loss = case.loss_fn(case.model, case.batch)
    assert loss.is_meta and loss.shape == ()


def test_overrides_and_dtype():
    case = zoo.build("gpt2", batch_size=3, seq_len=40, dtype=torch.bfloat16)
    assert case.batch["input_ids"].shape == (3, 40)
    assert all(p.dtype == torch.bfloat16 for p in case.model.parameters())
    assert torch.isfinite(case.loss_fn(case.model, case.batch).float())
    case = zoo.build("vit-b16", batch_size=2, image_size=64)
    assert case.batch["pixel_values"].shape == (2, 3, 64, 64)
    assert case.loss_fn(case.model, case.batch).shape == ()
    # A sequence longer than the position table grows it.
    assert zoo.build("bert-base", batch_size=1, seq_len=600).batch["input_ids"].shape == (1, 600)


def test_errors():
    with pytest.raises(ValueError, match="gpt2-xl"):
        zoo.build("gpt5")
    with pytest.raises(ValueError, match="small, paper"):
        zoo.build("gpt2", "huge")
    with pytest.raises(ValueError, match="seq_len"):
        zoo.build("resnet50", seq_len=128)
    with pytest.raises(ValueError, match="multiple of 16"):
        zoo.build("vit-b16", image_size=100)
    with pytest.raises(ValueError, match="positive"):
        zoo.build("gpt2", batch_size=0)


def _trace(case):
    params = dict(case.model.named_parameters())
    buffers = dict(case.model.named_buffers())

    def step(params, buffers, batch):
        with _reparametrize_module(case.model, {**params, **buffers}, tie_weights=True):
            loss = case.loss(batch=batch)
        return loss, torch.autograd.grad(loss, list(params.values()))

    return make_fx(step, tracing_mode="fake")(params, buffers, case.batch)


_FAST_TRACE = {"gpt2", "resnet50"}


@pytest.mark.parametrize(
    "name", [n if n in _FAST_TRACE else pytest.param(n, marks=pytest.mark.slow) for n in BUILTIN]
)
def test_traces_with_fake_tensors(name):
    # NOTE: no data-dependent control flow, .item() or numpy in forward: the
    # whole step (forward + autograd.grad) traces on fake tensors.
    gm = _trace(zoo.build(name, "small"))
    assert len(gm.graph.nodes) > 100


@pytest.mark.hf
@pytest.mark.parametrize("name", HF)
def test_hf_small(name):
    pytest.importorskip("transformers")
    case = zoo.build(name, "small")
    assert case.loss_fn is None and "labels" in case.batch
    loss = case.model(**case.batch).loss
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in case.model.parameters() if p.requires_grad)
    assert any(isinstance(m, case.block_types) for m in case.model.modules())
    with pytest.raises(ValueError, match="small"):
        zoo.build(name, "paper")


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("name", HF)
def test_hf_traces_with_fake_tensors(name):
    pytest.importorskip("transformers")
    gm = _trace(zoo.build(name, "small"))
    assert len(gm.graph.nodes) > 100
