"""GPT-2 family (and a GPT-Neo-1.3B-sized GPT-2) in plain PyTorch.

Pre-LN decoder with hand-written causal attention, like Hugging Face's eager
``GPT2Attention``: ``q @ k^T / sqrt(d_head)``, a causal mask from a
non-persistent ``torch.tril`` buffer, softmax, dropout, ``@ v``. MLP uses
``GELU(approximate="tanh")``; the LM head is tied to the token embedding.
The loss is next-token cross-entropy (labels are shifted when the batch is made).

Paper configs: gpt2 124M, gpt2-medium 355M, gpt2-large 774M, gpt2-xl 1.56B
(b8 s1024) and gpt-neo-1.3b (24 layers, d=2048, 16 heads, b32 s512; the GPT-2
architecture at GPT-Neo-1.3B's size, not GPT-Neo's local attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .registry import (
    BuildArgs,
    ZooCase,
    construct,
    count_params,
    fmt_params,
    generator,
    pick,
    rand_ints,
    register,
    token_lm_loss,
)


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    n_positions: int
    batch_size: int
    seq_len: int
    dropout: float = 0.1


# NOTE: the small configs keep the paper's d_head (64; 128 for gpt-neo), a
# sequence of 256-512 so attention scores are a paper-like share of the
# activations (H*T / 16d = 0.5 vs 1.0 at paper size), ~1k tokens per batch and
# a shrunk vocab: few thin layers, so activations dominate the eager peak as
# they do at paper size. Measured fp32, 1 CPU thread, forward+backward; peak =
# weights + batch + live bytes of tensors created during the step:
#   name          params  step    peak    weights+grads  activations
#   gpt2           5.5M   0.7 s   289 MB  42 MB          85%
#   gpt2-medium    7.1M   1.0 s   379 MB  54 MB          85%
#   gpt2-large    10.4M   1.3 s   455 MB  79 MB          82%
#   gpt2-xl       12.8M   1.3 s   395 MB  98 MB          75%
#   gpt-neo-1.3b   5.8M   0.5 s   221 MB  44 MB          78%
_CONFIGS: dict[str, dict[str, GPT2Config]] = {
    "gpt2": {
        "small": GPT2Config(4, 256, 4, 8192, 1024, batch_size=2, seq_len=512),
        "paper": GPT2Config(12, 768, 12, 50257, 1024, batch_size=8, seq_len=1024),
    },
    "gpt2-medium": {
        "small": GPT2Config(6, 256, 4, 8192, 1024, batch_size=2, seq_len=512),
        "paper": GPT2Config(24, 1024, 16, 50257, 1024, batch_size=8, seq_len=1024),
    },
    "gpt2-large": {
        "small": GPT2Config(6, 320, 5, 8192, 1024, batch_size=2, seq_len=512),
        "paper": GPT2Config(36, 1280, 20, 50257, 1024, batch_size=8, seq_len=1024),
    },
    "gpt2-xl": {
        "small": GPT2Config(8, 320, 5, 8192, 1024, batch_size=2, seq_len=384),
        "paper": GPT2Config(48, 1600, 25, 50257, 1024, batch_size=8, seq_len=1024),
    },
    "gpt-neo-1.3b": {
        "small": GPT2Config(4, 256, 2, 8192, 2048, batch_size=4, seq_len=256),
        "paper": GPT2Config(24, 2048, 16, 50257, 2048, batch_size=32, seq_len=512),
    },
}

_TITLES = {
    "gpt2": "GPT-2",
    "gpt2-medium": "GPT-2 medium",
    "gpt2-large": "GPT-2 large",
    "gpt2-xl": "GPT-2 xl",
    "gpt-neo-1.3b": "GPT-Neo-1.3B-like GPT-2",
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        # NOTE: finfo.min rather than -inf, as Hugging Face does: a fully masked
        # row then gives a uniform softmax instead of NaN.
        att = torch.where(causal, att, torch.finfo(att.dtype).min)
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    """One pre-LN transformer layer: the unit for per-block checkpointing."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), causal)
        return x + self.mlp(self.ln_2(x))


class GPT2LM(nn.Module):
    """GPT-2 language model; ``forward(input_ids) -> logits``."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        P = cfg.n_positions
        # NOTE: one shared mask buffer for the model (HF's legacy GPT-2 keeps one
        # per layer: 48 MB of bools at xl size). Non-persistent, so it is not in
        # the state dict, but it is a buffer a capture must carry as an input.
        self.register_buffer(
            "causal_mask", torch.tril(torch.ones(P, P, dtype=torch.bool)).view(1, 1, P, P),
            persistent=False,
        )
        self.apply(self._init_weights)
        # NOTE: GPT-2's scaled init of residual projections keeps the loss sane.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        # NOTE: positions come from the shape, never from tensor values, so the
        # graph has no data-dependent control flow.
        pos = torch.arange(T, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos)[None])
        causal = self.causal_mask[:, :, :T, :T]
        for block in self.h:
            x = block(x, causal)
        x = self.ln_f(x)
        # NOTE: weight tying via F.linear on the embedding matrix: there is one
        # Parameter, so functional_call / named_parameters see it exactly once.
        return F.linear(x, self.wte.weight)


@register(list(_CONFIGS), overrides=("batch_size", "seq_len"))
def build(args: BuildArgs) -> ZooCase:
    cfg = _CONFIGS[args.name][args.config]
    B, T = pick(args.batch_size, cfg.batch_size), pick(args.seq_len, cfg.seq_len)
    # NOTE: a longer sequence than the position table grows the table.
    cfg = replace(cfg, batch_size=B, seq_len=T, n_positions=max(cfg.n_positions, T))
    model = construct(lambda: GPT2LM(cfg), args)
    gen = generator(args)
    tokens = rand_ints((B, T + 1), cfg.vocab_size, gen, args)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    desc = (
        f"{_TITLES[args.name]} {args.label}: {cfg.n_layer} layers, d={cfg.n_embd}, "
        f"{cfg.n_head} heads, vocab {cfg.vocab_size}, seq {T}, batch {B}, "
        f"{fmt_params(count_params(model))} params"
    )
    return ZooCase(args.name, args.config, model, batch, token_lm_loss, (GPT2Block,), desc)
