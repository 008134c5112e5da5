"""Llama-style decoder in plain PyTorch.

RMSNorm, rotary position embeddings (cos/sin precomputed as non-persistent
buffers), grouped-query attention through causal
``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU MLP, no biases and
an untied LM head. Loss: next-token cross-entropy.

Paper config: TinyLlama-1.1B shape (22 layers, d=2048, 32 heads, 4 KV heads,
MLP 5632, vocab 32000), trained at batch 8 x sequence 2048.
"""

from __future__ import annotations

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
class LlamaConfig:
    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    hidden_dim: int
    vocab_size: int
    max_seq_len: int
    batch_size: int
    seq_len: int
    rope_theta: float = 10000.0
    eps: float = 1e-5


# NOTE: small keeps d_head=64, GQA (2 query heads per KV head) and MLP/d ratio
# 2.75 of the paper config; 2k tokens per batch so activations dominate.
# Measured (fp32, 1 CPU thread, forward+backward): 7.1M params, ~1.0 s,
# peak 395 MB of which weights+grads 55 MB: activations 86%. (SDPA's fused CPU
# kernel keeps no T x T matrix, so the logits are the largest activations.)
_CONFIGS = {
    "small": LlamaConfig(4, 256, 4, 2, 704, 8192, 2048, batch_size=4, seq_len=512),
    "paper": LlamaConfig(22, 2048, 32, 4, 5632, 32000, 2048, batch_size=8, seq_len=2048),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in fp32 (as Llama does) so bf16 training is stable.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.hd = cfg.dim // cfg.n_head
        self.q_proj = nn.Linear(cfg.dim, cfg.n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_head * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_head * self.hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # NOTE: GQA by repeating KV heads (like HF's repeat_kv) instead of
        # sdpa(enable_gqa=True), so every backend and tracer sees plain ops.
        rep = self.n_head // self.n_kv_head
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.hd))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer: the unit for per-block checkpointing."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(nn.Module):
    """Llama causal LM; ``forward(input_ids) -> logits``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        hd = cfg.dim // cfg.n_head
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # NOTE: non-persistent buffers: not in the state dict (they are derived),
        # but inputs of the captured graph; forward only slices them by T. They
        # follow the model's dtype (bf16 tables are coarser than HF's fp32 ones).
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


@register("llama", overrides=("batch_size", "seq_len"))
def build(args: BuildArgs) -> ZooCase:
    cfg = _CONFIGS[args.config]
    B, T = pick(args.batch_size, cfg.batch_size), pick(args.seq_len, cfg.seq_len)
    cfg = replace(cfg, batch_size=B, seq_len=T, max_seq_len=max(cfg.max_seq_len, T))
    model = construct(lambda: LlamaLM(cfg), args)
    gen = generator(args)
    tokens = rand_ints((B, T + 1), cfg.vocab_size, gen, args)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    like = "TinyLlama-1.1B-shaped " if args.config == "paper" else ""
    desc = (
        f"Llama {args.label} ({like}RMSNorm, RoPE, SwiGLU, GQA): {cfg.n_layer} layers, "
        f"d={cfg.dim}, {cfg.n_head} heads / {cfg.n_kv_head} KV heads, MLP {cfg.hidden_dim}, "
        f"vocab {cfg.vocab_size}, seq {T}, batch {B}, {fmt_params(count_params(model))} params"
    )
    return ZooCase(args.name, args.config, model, batch, token_lm_loss, (LlamaDecoderLayer,), desc)
