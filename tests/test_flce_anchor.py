"""The Liger-style fused linear cross-entropy reference and its benchmark (issue 25, finding 4)."""

import pytest
import torch
import torch.nn.functional as F

from fitgraph.bench import flce_anchor
from fitgraph.bench.flce_anchor import flce_reference, liger_chunk_size


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [None, 4, 64])
def test_reference_equals_eager_cross_entropy(label_smoothing, bias, chunk):
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(53, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(53, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, 53, (37,))
    y[::5] = -100
    y[-3:] = -100
    wrt = [h, w] + ([b] if bias else [])
    eager = F.cross_entropy(F.linear(h, w, b), y, ignore_index=-100,
                            label_smoothing=label_smoothing)
    # NOTE: a grad_output other than 1 exercises the backward's scaling
    g_eager = torch.autograd.grad(eager * 2.5, wrt)
    ref = flce_reference(h, w, y, b, label_smoothing=label_smoothing, chunk=chunk)
    g_ref = torch.autograd.grad(ref * 2.5, wrt)
    torch.testing.assert_close(ref, eager)
    for a, e in zip(g_ref, g_eager):
        torch.testing.assert_close(a, e)


def test_reference_float32_with_hf_shift():
    """fp32, the labels shifted as Liger's Hugging Face integration does (padded with -100)."""
    torch.manual_seed(1)
    bsz, seq, hid, vocab = 2, 9, 8, 40
    h = torch.randn(bsz, seq, hid, requires_grad=True)
    w = torch.randn(vocab, hid, requires_grad=True)
    labels = torch.randint(0, vocab, (bsz, seq))
    labels[:, -2:] = -100
    logits = (h @ w.t()).float()
    eager = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
    g_eager = torch.autograd.grad(eager, [h, w])
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    ref = flce_reference(h.reshape(-1, hid), w, shifted.reshape(-1))
    g_ref = torch.autograd.grad(ref, [h, w])
    torch.testing.assert_close(ref, eager)
    for a, e in zip(g_ref, g_eager):
        torch.testing.assert_close(a, e)


def test_liger_chunk_rule():
    assert liger_chunk_size(4 * 4096, 32000, 4096) == 2048   # Liger's own comment's example
    assert liger_chunk_size(2048, 50257, 128) == 8
    assert liger_chunk_size(10, 10, 100) == 16                # at least the tokens, a power of 2


def test_benchmark_runs_on_a_tiny_config():
    rows, facts = flce_anchor.run(vocab=64, hidden=16, layers=1, seq=8, batch=2, rounds=1,
                                  time_budget=2.0, smallest=False, chunks=(4,),
                                  progress=lambda s: None)
    by = {r.system: r for r in rows}
    assert set(by) == {"eager", "reference", "reference, chunk 4", "fitgraph @ reference",
                       "fitgraph @ reference, chunk 4"}, rows
    for r in rows:
        assert not r.error, r
        assert r.peak_bytes and r.peak_bytes > 0
        assert r.vocab_bytes is not None and r.step_s and r.vs_eager and r.spread is not None
        assert r.result in ("bitwise", "allclose"), r
    assert by["reference"].vs_reference == 1.0
    assert facts["block_bytes"] > 0 and facts["body_peak"] > 0
    assert "| fitgraph @ reference |" in flce_anchor.table(rows, facts)
