"""What the multi-device planner needs of a model: its blocks at a tensor-parallel width and
micro-batch, and what cannot be split.

``ModelSpec`` is the interface; ``GptModel`` gives a GPT by its shape (``dist.gpt_blocks``),
what published comparisons (Megatron-LM's Table 1) are made on.

Example:
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> gpt = GptModel(GptShape(96, 12288, 96))
    >>> round(gpt.model_flops(1) / 1e12)          # forward + backward of one sample, TFLOPs
    2205
    >>> gpt.why_not(tp=7, micro_batch=1, sp=False)
    'a GPT of 96 heads of width 12288 cannot be split over 7 devices (heads must divide by the tensor-parallel width)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .gpt_blocks import gpt_blocks
from .megatron_table import GptShape
from .ops import Block

__all__ = ["GptModel", "ModelSpec"]


class ModelSpec(Protocol):
    """A model the planner can split: a chain of blocks (embedding first, head last)."""

    name: str
    seq: int                       # tokens per sample

    def blocks(self, tp: int, micro_batch: int, sp: bool) -> list[Block]:
        """Its blocks on one device of a ``tp``-wide group, for one micro-batch."""

    def why_not(self, tp: int, micro_batch: int, sp: bool) -> str | None:
        """Why it cannot run so (None when it can)."""

    def model_flops(self, samples: int) -> float:
        """Forward and backward FLOPs of ``samples`` samples (no recompute): what MFU counts."""


@dataclass(frozen=True)
class GptModel:
    """A GPT given by its shape."""

    shape: GptShape
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            s = self.shape
            object.__setattr__(self, "name", f"gpt-l{s.layers}-h{s.hidden}-a{s.heads}")

    @property
    def seq(self) -> int:
        return self.shape.seq

    def blocks(self, tp: int, micro_batch: int, sp: bool) -> list[Block]:
        return gpt_blocks(self.shape, tp, micro_batch, sp)

    def why_not(self, tp: int, micro_batch: int, sp: bool) -> str | None:
        try:
            gpt_blocks(GptShape(1, self.shape.hidden, self.shape.heads, self.shape.vocab,
                                self.shape.seq), tp, micro_batch, sp)
        except ValueError as e:
            return str(e)
        return None

    def model_flops(self, samples: int) -> float:
        blocks = gpt_blocks(GptShape(1, self.shape.hidden, self.shape.heads, self.shape.vocab,
                                     self.shape.seq), 1, 1, False)
        per_layer = blocks[1].model_flops
        return samples * (blocks[0].model_flops + blocks[2].model_flops
                          + self.shape.layers * per_layer)
