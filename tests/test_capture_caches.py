"""Capture leaves the user's caches as eager would: no fake tensor cached for later eager calls,
and a real tensor the forward caches outside parameters and buffers is a constant (issue 25:
Hugging Face BEiT's relative position index)."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph


@functools.lru_cache(maxsize=4)
def _index(n: int) -> torch.Tensor:
    return torch.arange(n * n).reshape(n, n) % n


def cached_index(n: int) -> torch.Tensor:
    """As transformers' compile_compatible_method_lru_cache: no cache while tracing."""
    return _index.__wrapped__(n) if torch.compiler.is_compiling() else _index(n)


class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(8, 16))
        self.lin = nn.Linear(16, 16)
        self.memo = {}

    def forward(self, x):
        idx = cached_index(8)
        if "bias" not in self.memo:  # NOTE: a real tensor kept on the module, not a buffer
            self.memo["bias"] = torch.linspace(0, 1, 16)
        return self.lin(x + self.table[idx].sum(1)[None] + self.memo["bias"])


def loss_fn(m, b):
    return m(b).square().mean()


def test_capture_caches_no_fake_tensor_and_keeps_real_ones_as_constants():
    _index.cache_clear()
    x = torch.randn(4, 8, 16)
    b = Cached()
    a = copy.deepcopy(b)
    fitgraph.capture(b, x, loss_fn)   # NOTE: traced before any eager call: the cache is empty
    assert not isinstance(cached_index(8), torch._subclasses.FakeTensor)
    b.memo.clear()  # NOTE: what the traced forward put there is fake (a cache fitgraph can't see)
    a(x)                              # NOTE: an eager call fills the module's memo, for real
    oa = torch.optim.AdamW(a.parameters())
    ob = torch.optim.AdamW(b.parameters())
    b.memo = dict(a.memo)
    assert not isinstance(b.memo["bias"], torch._subclasses.FakeTensor)
    step = fitgraph.optimize(b, x, loss_fn, ob, latency_limit=1.5, cost_model="cpu-generic",
                             time_budget=5, exact=True)
    for i in range(2):
        assert torch.equal(eager_step(a, x, loss_fn, oa, seed=i), step(x))
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
    assert_bitwise_equal_models(a, b, oa, ob)
