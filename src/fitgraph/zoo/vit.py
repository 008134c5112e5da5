"""Vision Transformer (ViT-B/16) in plain PyTorch.

Patch embedding as a stride-16 ``Conv2d``, a class token, learned position
embeddings, pre-LN blocks with HAND-WRITTEN attention (``q @ k^T * scale``,
softmax, dropout, ``@ v``) so the ``N x N`` score matrices appear as separate
activations in the captured graph, GELU MLP, dropout 0.1, linear head on the
class token. Loss: cross-entropy on random labels.

Paper config: ViT-B/16 (12 layers, d=768, 12 heads, MLP 3072, 1000 classes,
~86M params) at batch 64, 224x224.
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
    image_classification_loss,
    pick,
    rand_floats,
    rand_ints,
    register,
)


@dataclass(frozen=True)
class ViTConfig:
    n_layer: int
    dim: int
    n_head: int
    mlp_dim: int
    num_classes: int
    image_size: int
    batch_size: int
    patch_size: int = 16
    in_chans: int = 3
    dropout: float = 0.1


# NOTE: small keeps 224x224 inputs with 16x16 patches (197 tokens, the paper's
# sequence), d_head=64 and MLP = 4*d, with 4 thin layers and a batch of 8.
# Measured (fp32, 1 CPU thread, forward+backward): 2.2M params, ~0.5 s, peak
# 165 MB, weights+grads 17 MB: activations 87%.
_CONFIGS = {
    "small": ViTConfig(4, 192, 3, 768, 1000, image_size=224, batch_size=8),
    "paper": ViTConfig(12, 768, 12, 3072, 1000, image_size=224, batch_size=64),
}


class Attention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.scale = (cfg.dim // cfg.n_head) ** -0.5
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.proj_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = self.attn_drop(F.softmax(attn, dim=-1))
        y = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(y))


class Mlp(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class ViTBlock(nn.Module):
    """One pre-LN encoder block: the unit for per-block checkpointing."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.mlp = Mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """``forward(pixel_values [B, 3, H, W]) -> class logits [B, num_classes]``."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(cfg.in_chans, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, cfg.dim))
        self.pos_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # [B, N, C]
        # NOTE: expand (a view) rather than repeat: the class token is not
        # copied per sample, its gradient is a sum over the batch.
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = self.pos_drop(torch.cat((cls, x), dim=1) + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


@register("vit-b16", overrides=("batch_size", "image_size"))
def build(args: BuildArgs) -> ZooCase:
    cfg = _CONFIGS[args.config]
    B, S = pick(args.batch_size, cfg.batch_size), pick(args.image_size, cfg.image_size)
    if S % cfg.patch_size:
        raise ValueError(f"vit-b16 image_size must be a multiple of {cfg.patch_size}, got {S}")
    cfg = replace(cfg, batch_size=B, image_size=S)
    model = construct(lambda: VisionTransformer(cfg), args)
    gen = generator(args)
    batch = {
        "pixel_values": rand_floats((B, cfg.in_chans, S, S), gen, args),
        "labels": rand_ints((B,), cfg.num_classes, gen, args),
    }
    tokens = (S // cfg.patch_size) ** 2 + 1
    desc = (
        f"ViT-B/16 {args.label}: {cfg.n_layer} layers, d={cfg.dim}, {cfg.n_head} heads, "
        f"{S}x{S} images ({tokens} tokens), batch {B}, {fmt_params(count_params(model))} params"
    )
    return ZooCase(args.name, args.config, model, batch, image_classification_loss, (ViTBlock,), desc)
