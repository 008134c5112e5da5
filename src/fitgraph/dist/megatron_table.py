"""The ground truth of the parallel planner: Megatron-LM's published throughput (Narayanan et
al., SC'21, Table 1), and the GPT it measures given by its shape.

Every row is a GPT of ``layers`` blocks of width ``hidden`` (``heads`` heads), vocabulary
51,200, sequence 2048, trained with full activation recompute on ``gpus`` A100-80GB (8 to a
DGX node), tensor-parallel ``t``, pipeline-parallel ``p``, data-parallel ``gpus / (t p)``, at
global ``batch``; the paper reports TFLOP/s per GPU, counting FLOPs with its eq. 3, which
includes the extra forward of full recompute:
``96 B s l h² (1 + s/(6h) + V/(16 l h))``. A row so implies its iteration time (eq. 3 over the
TFLOP/s of all its GPUs): a plan that recomputes less is compared through the same formula.
Transcribed from ``../shared/ANCHORS.md``; the parameter counts (the paper's eq. 2) check the
shapes (``tests/test_dist_megatron_table.py``).

Example:
    >>> row = TABLE1[0]
    >>> round(row.shape.parameters / 1e9, 1), row.dp, round(row.iteration_s, 2)
    (1.7, 32, 3.53)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPT_PRESETS", "TABLE1", "GptShape", "MegatronRow"]


@dataclass(frozen=True)
class GptShape:
    """A GPT by its shape (Megatron's: learned positions, tied embedding and LM head)."""

    layers: int
    hidden: int
    heads: int
    vocab: int = 51200
    seq: int = 2048

    @property
    def parameters(self) -> float:
        """Megatron's eq. 2: ``12 l h² (1 + 13/(12h) + (V + s)/(12 l h))``."""
        n, h = self.layers, self.hidden
        return 12 * n * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * n * h))

    def flops_per_iteration(self, batch: int) -> float:
        """Megatron's eq. 3 (full recompute: a second forward counted)."""
        n, h, s = self.layers, self.hidden, self.seq
        return 96 * batch * s * n * h * h * (1 + s / (6 * h) + self.vocab / (16 * n * h))


@dataclass(frozen=True)
class MegatronRow:
    """One row of Table 1: the model, its published parallel configuration and throughput."""

    billions: float        # parameters as published
    shape: GptShape
    t: int
    p: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # as published (eq. 3 FLOPs over the measured time)

    @property
    def dp(self) -> int:
        return self.gpus // (self.t * self.p)

    @property
    def iteration_s(self) -> float:
        """The iteration time the published throughput implies."""
        return self.shape.flops_per_iteration(self.batch) / (self.tflops_per_gpu * 1e12
                                                             * self.gpus)


TABLE1: tuple[MegatronRow, ...] = tuple(
    MegatronRow(b, GptShape(layers, hidden, heads), t, p, gpus, batch, tflops)
    for b, hidden, layers, heads, t, p, gpus, batch, tflops in (
        (1.7, 2304, 24, 24, 1, 1, 32, 512, 137),
        (3.6, 3072, 30, 32, 2, 1, 64, 512, 138),
        (7.5, 4096, 36, 32, 4, 1, 128, 512, 142),
        (18.4, 6144, 40, 48, 8, 1, 256, 1024, 135),
        (39.1, 8192, 48, 64, 8, 2, 512, 1536, 138),
        (76.1, 10240, 60, 80, 8, 4, 1024, 1792, 140),
        (145.6, 12288, 80, 96, 8, 8, 1536, 2304, 148),
        (310.1, 16384, 96, 128, 8, 16, 1920, 2160, 155),
        (529.6, 20480, 105, 128, 8, 35, 2520, 2520, 163),
        (1008.0, 25600, 128, 160, 8, 64, 3072, 3072, 163),
    ))


def _billions(b: float) -> str:
    return f"{round(b / 1000)}t" if b >= 1000 else f"{b:g}b"


# NOTE: GPT shapes by name for `fitgraph plan-dist`: GPT-3 175B (Brown et al., 2020: 96 layers,
# 12288 wide, 96 heads) and every Table 1 model ("gpt-1.7b" ... "gpt-1t").
GPT_PRESETS: dict[str, GptShape] = {
    "gpt3-175b": GptShape(96, 12288, 96),
    **{f"gpt-{_billions(row.billions)}": row.shape for row in TABLE1},
    # NOTE: Phaze's other models at its sequence lengths (msr-fiddle/phaze scripts/*.sh), by
    # their shapes: GPT-2 XL (48 x 1600, 25 heads, vocabulary 50,257, 1,024 tokens); BERT-large
    # (24 x 1024, 16 heads, 30,522, 512 tokens: an encoder costs a decoder's FLOPs and bytes);
    # Llama-2 7B (32 x 4096, 32 heads, 32,000, 4,096 tokens) priced as a GPT layer: its SwiGLU
    # MLP's three 4096 x 11008 matmuls are 1.008x the two 4096 x 16384 of a GPT's, RMSNorm and
    # rotary embeddings about a layer norm's and no learned positions
    "gpt2-xl": GptShape(48, 1600, 25, vocab=50257, seq=1024),
    "bert-large": GptShape(24, 1024, 16, vocab=30522, seq=512),
    "llama2-7b": GptShape(32, 4096, 32, vocab=32000, seq=4096),
}
