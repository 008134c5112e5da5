"""BERT encoder with a masked-LM head, in plain PyTorch.

Token + position + segment embeddings, post-LN layers, attention through
``F.scaled_dot_product_attention`` with an additive mask built from the batch's
``attention_mask`` (random right padding), GELU, dropout 0.1, and an MLM head
whose decoder is tied to the word embedding. The loss is cross-entropy with
``ignore_index=-100`` on ~15% randomly chosen positions with random targets.

Paper configs: bert-base (12 layers, d=768, b32 s512, ~110M params) and
bert-large (24 layers, d=1024, b64 s512, ~335M), vocab 30522.
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
    rand_padding_mask,
    register,
)


@dataclass(frozen=True)
class BertConfig:
    n_layer: int
    hidden: int
    n_head: int
    intermediate: int
    vocab_size: int
    max_positions: int
    batch_size: int
    seq_len: int
    type_vocab_size: int = 2
    dropout: float = 0.1
    eps: float = 1e-12


# NOTE: small configs keep d_head=64, MLP = 4*d and the paper's 512-token
# sequences (so H*T / 16d = 0.5, as at paper size) at batch 2. Measured (fp32,
# 1 CPU thread, forward+backward; peak = weights + live step tensors):
#   bert-base  small: 5.5M params, 0.8 s, peak 291 MB, weights+grads 42 MB (86% activations)
#   bert-large small: 7.0M params, 1.0 s, peak 381 MB, weights+grads 54 MB (86% activations)
_CONFIGS = {
    "bert-base": {
        "small": BertConfig(4, 256, 4, 1024, 8192, 512, batch_size=2, seq_len=512),
        "paper": BertConfig(12, 768, 12, 3072, 30522, 512, batch_size=32, seq_len=512),
    },
    "bert-large": {
        "small": BertConfig(6, 256, 4, 1024, 8192, 512, batch_size=2, seq_len=512),
        "paper": BertConfig(24, 1024, 16, 4096, 30522, 512, batch_size=64, seq_len=512),
    },
}


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos)[None]
        x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertLayer(nn.Module):
    """One post-LN encoder layer: the unit for per-block checkpointing."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.p_drop = cfg.dropout
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_out = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.intermediate = nn.Linear(cfg.hidden, cfg.intermediate)
        self.act = nn.GELU()
        self.output = nn.Linear(cfg.intermediate, cfg.hidden)
        self.out_dropout = nn.Dropout(cfg.dropout)
        self.out_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, C = t.shape
        return t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        # NOTE: dropout_p depends on self.training only (a Python bool), never
        # on tensor values, so the traced graph is static.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.p_drop if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(B, T, C)
        x = self.attn_norm(x + self.attn_dropout(self.attn_out(y)))
        h = self.output(self.act(self.intermediate(x)))
        return self.out_norm(x + self.out_dropout(h))


class BertForMaskedLM(nn.Module):
    """``forward(input_ids, token_type_ids, attention_mask) -> MLM logits``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.n_layer))
        self.head_dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.head_act = nn.GELU()
        self.head_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.decoder_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        # NOTE: additive [B, 1, 1, T] mask: 0 where attended, finfo.min on padding
        # (HF's "extended attention mask"); pure arithmetic, no branching.
        keep = attention_mask[:, None, None, :].to(x.dtype)
        mask = (1.0 - keep) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask)
        h = self.head_norm(self.head_act(self.head_dense(x)))
        # NOTE: decoder tied to the word embedding: one Parameter, used twice.
        return F.linear(h, self.embeddings.word_embeddings.weight, self.decoder_bias)


def mlm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


@register(list(_CONFIGS), overrides=("batch_size", "seq_len"))
def build(args: BuildArgs) -> ZooCase:
    cfg = _CONFIGS[args.name][args.config]
    B, T = pick(args.batch_size, cfg.batch_size), pick(args.seq_len, cfg.seq_len)
    cfg = replace(cfg, batch_size=B, seq_len=T, max_positions=max(cfg.max_positions, T))
    model = construct(lambda: BertForMaskedLM(cfg), args)
    gen = generator(args)
    input_ids = rand_ints((B, T), cfg.vocab_size, gen, args)
    attention_mask = rand_padding_mask(B, T, gen, args)
    if args.is_meta:
        token_type_ids = torch.empty((B, T), dtype=torch.long, device="meta")
        labels = torch.empty((B, T), dtype=torch.long, device="meta")
    else:
        # Sentence A / sentence B split at a random point; ~15% of the real
        # (unpadded) tokens get a random target, the rest -100. NOTE: drawn once
        # at build time (static masking), so the step itself has no masking RNG.
        split = torch.randint(1, T + 1, (B, 1), generator=gen)
        token_type_ids = (torch.arange(T)[None, :] >= split).long().to(args.device)
        chosen = (torch.rand((B, T), generator=gen) < 0.15).to(args.device)
        chosen &= attention_mask.bool()
        chosen[:, 0] = True  # at least one target per row, so the loss is never NaN
        targets = rand_ints((B, T), cfg.vocab_size, gen, args)
        labels = torch.where(chosen, targets, torch.full_like(targets, -100))
    batch = {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": attention_mask,
        "labels": labels,
    }
    title = "BERT-base" if args.name == "bert-base" else "BERT-large"
    desc = (
        f"{title} {args.label} masked LM: {cfg.n_layer} layers, d={cfg.hidden}, "
        f"{cfg.n_head} heads, vocab {cfg.vocab_size}, seq {T}, batch {B}, "
        f"{fmt_params(count_params(model))} params"
    )
    return ZooCase(args.name, args.config, model, batch, mlm_loss, (BertLayer,), desc)
