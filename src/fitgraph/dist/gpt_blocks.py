"""A GPT given by its shape, as blocks (``dist.ops``): the embedding, ``layers`` transformer
layers and the head with its loss, sharded Megatron-style over a tensor-parallel group.

Each layer is the kernels Megatron-LM runs (Narayanan et al., SC'21; Korthikanti et al., 2022):
layer norm, the QKV projection (column-parallel: ``3h/t`` outputs per device), the attention
scores, the fused scale-mask-softmax, the attention dropout, the attention over values, the
output projection (row-parallel, then an all-reduce of its partial sums), the bias-dropout-add,
layer norm, the MLP's ``h -> 4h`` (column) and ``4h -> h`` (row, then an all-reduce) around a
GeLU, and the second bias-dropout-add. In the backward the column-parallel matmuls' input
gradients are all-reduced. With sequence parallelism (``sp``) the layer norms and dropouts run
on ``1/t`` of the sequence and each all-reduce becomes an all-gather before the column-parallel
matmul and a reduce-scatter after the row-parallel one (the same bytes on the wire).

What the backward keeps per layer adds up to Korthikanti et al.'s eq. (1)/(2),
``s b h (10 + 24/t + 5 a s/(h t))`` bytes without sequence parallelism (``10/t`` with it): the
test checks it. The vocabulary is split over the group (vocabulary-parallel embedding and
cross-entropy); the head's weight is the embedding's (tied), so the last stage holds a copy.

Example:
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> blocks = gpt_blocks(GptShape(24, 2304, 24), tp=1, micro_batch=1)
    >>> len(blocks), blocks[1].kind, round(blocks[1].saved_bytes / 2**20)
    (26, 'gpt-layer', 633)
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from .megatron_table import GptShape
from .ops import INPUT, Block, Collective, Op

__all__ = ["gpt_blocks", "gpt_embedding", "gpt_head", "gpt_layer"]

# NOTE: activations and weights in 16-bit (Megatron's mixed precision: fp16 or bf16); dropout
# masks one byte per element; the vocabulary-parallel cross-entropy works in float32.
HALF = 2
MASK = 1
FLOAT = 4
# NOTE: the chunked loss (logits and cross-entropy re-made in parts along the tokens) in 8
# parts: each part's matmul still spans the vocabulary share and 1/8 of the tokens
LOSS_PARTS = 8
# NOTE: arithmetic per element of the elementwise kernels (forward, backward), counted from
# their formulas: layer norm (mean, variance, normalize, scale and shift), the fused
# scale-mask-softmax (scale, mask, max, subtract, exp, sum, divide), dropout (compare, scale),
# bias-dropout-add, GeLU (tanh form), cross-entropy (max, subtract, exp, sum, log). Only a chip
# with few vector lanes is bound by them (fitgraph.hw); a GPU's are memory-bound.
VECTOR = {"norm": (8, 10), "softmax": (7, 3), "dropout": (2, 1), "dropout_add": (4, 2),
          "gelu": (10, 14), "cross_entropy": (6, 3)}


def _vector(kind: str, elems: float) -> dict:
    fwd, bwd = VECTOR[kind]
    return {"vector_flops": fwd * elems, "bwd_vector_flops": bwd * elems}


def _tp_input_comm(n_bytes: float, tp: int, sp: bool) -> tuple[tuple, tuple]:
    """Forward and backward collectives around a column-parallel matmul's input."""
    if tp == 1:
        return (), ()
    if sp:
        # NOTE: with sequence parallelism Megatron saves the sharded input and gathers it
        # again in the backward for the weight gradient, then reduce-scatters the input grad.
        return ((Collective("all_gather", n_bytes),),
                (Collective("all_gather", n_bytes), Collective("reduce_scatter", n_bytes)))
    return (), (Collective("all_reduce", n_bytes),)


def _tp_output_comm(n_bytes: float, tp: int, sp: bool) -> tuple[tuple, tuple]:
    """Forward and backward collectives after a row-parallel matmul."""
    if tp == 1:
        return (), ()
    if sp:
        return (Collective("reduce_scatter", n_bytes),), (Collective("all_gather", n_bytes),)
    return (Collective("all_reduce", n_bytes),), ()


def _norm(name: str, reads: tuple[str, ...], elems: float, tp: int, sp: bool) -> Op:
    """A layer norm on ``elems`` elements per device; its output is saved (the next matmul's
    weight gradient reads it), its input is saved by whoever made it."""
    fwd, _ = _tp_input_comm(elems * HALF * (tp if sp else 1), tp, sp)
    return Op(name, bytes=2 * HALF * elems, saved=HALF * elems, reads=reads,
              bwd_flops=0.0, bwd_bytes=3 * HALF * elems, matmul=False, fwd_comm=fwd,
              **_vector("norm", elems))


def _dropout_add(name: str, reads: tuple[str, ...], elems: float, keep_output: bool) -> Op:
    """Megatron's fused bias-dropout-add: saves its mask (and its output where a layer norm
    reads it next inside the block)."""
    return Op(name, bytes=(3 * HALF + MASK) * elems,
              saved=MASK * elems + (HALF * elems if keep_output else 0.0), reads=reads,
              bwd_flops=0.0, bwd_bytes=(3 * HALF + MASK) * elems, matmul=False,
              **_vector("dropout_add", elems))


def gpt_layer(shape: GptShape, tp: int, micro_batch: int, sp: bool = False,
              index: int = 0) -> Block:
    """One transformer layer of ``shape`` on one device of a ``tp``-wide group."""
    _check(shape, tp, micro_batch, sp)
    b, s, h, a = micro_batch, shape.seq, shape.hidden, shape.heads
    n = b * s * h                  # elements of one activation of the layer's width
    r = 1.0 / tp                   # the share of a tensor-parallel op
    q = r if sp else 1.0           # the share of a layer norm / dropout
    att = b * a * s * s * r        # elements of this device's attention scores
    mm_in = n * HALF               # a whole activation, what a collective moves
    qkv_fwd, qkv_bwd = _tp_input_comm(mm_in, tp, sp)
    out_fwd, out_bwd = _tp_output_comm(mm_in, tp, sp)
    ops = (
        _norm("ln1", (INPUT,), n * q, tp, sp),
        Op("qkv", flops=6 * n * h * r, bytes=HALF * (n + 3 * h * h * r + 3 * n * r),
           saved=3 * n * r * HALF, reads=("ln1",), bwd_w_flops=6 * n * h * r,
           gemms=((b * s, 3 * h // tp, h, 1),),
           bwd_bytes=HALF * (2 * n + 3 * h * h * r + 6 * n * r), bwd_comm=qkv_bwd),
        Op("scores", flops=2 * b * s * s * h * r, bytes=HALF * (2 * n * r + att),
           reads=("qkv",), gemms=((s, s, h // a, b * a // tp),), bwd_bytes=HALF * (att + 4 * n * r)),
        Op("softmax", bytes=2 * HALF * att, saved=HALF * att, reads=("scores",),
           bwd_flops=0.0, bwd_bytes=3 * HALF * att, matmul=False, **_vector("softmax", att)),
        Op("attn_dropout", bytes=(2 * HALF + MASK) * att, saved=(HALF + MASK) * att,
           reads=("softmax",), bwd_flops=0.0, bwd_bytes=(2 * HALF + MASK) * att, matmul=False,
           **_vector("dropout", att)),
        Op("context", flops=2 * b * s * s * h * r, bytes=HALF * (att + 2 * n * r),
           saved=HALF * n * r, reads=("attn_dropout", "qkv"),
           gemms=((s, h // a, s, b * a // tp),), bwd_bytes=HALF * (2 * att + 3 * n * r)),
        Op("proj", flops=2 * n * h * r, bytes=HALF * (n * r + h * h * r + n),
           reads=("context",), bwd_w_flops=2 * n * h * r, gemms=((b * s, h, h // tp, 1),),
           bwd_bytes=HALF * (n + 2 * n * r + h * h * r), fwd_comm=out_fwd, bwd_comm=out_bwd),
        _dropout_add("resid1", ("proj", INPUT), n * q, keep_output=True),
        _norm("ln2", ("resid1",), n * q, tp, sp),
        Op("fc1", flops=8 * n * h * r, bytes=HALF * (n + 4 * h * h * r + 4 * n * r),
           saved=4 * n * r * HALF, reads=("ln2",), bwd_w_flops=8 * n * h * r,
           gemms=((b * s, 4 * h // tp, h, 1),),
           bwd_bytes=HALF * (2 * n + 4 * h * h * r + 8 * n * r), bwd_comm=qkv_bwd),
        Op("gelu", bytes=2 * HALF * 4 * n * r, saved=HALF * 4 * n * r, reads=("fc1",),
           bwd_flops=0.0, bwd_bytes=3 * HALF * 4 * n * r, matmul=False,
           **_vector("gelu", 4 * n * r)),
        Op("fc2", flops=8 * n * h * r, bytes=HALF * (4 * n * r + 4 * h * h * r + n),
           reads=("gelu",), bwd_w_flops=8 * n * h * r, gemms=((b * s, h, 4 * h // tp, 1),),
           bwd_bytes=HALF * (n + 8 * n * r + 4 * h * h * r), fwd_comm=out_fwd, bwd_comm=out_bwd),
        _dropout_add("resid2", ("fc2", "resid1"), n * q, keep_output=False),
    )
    del qkv_fwd  # NOTE: the forward gather of sequence parallelism sits in the norm before
    sharded = 12 * h * h + 7 * h   # qkv, proj, fc1, fc2 weights; qkv and fc1 biases
    replicated = 6 * h             # proj and fc2 biases, two layer norms
    # NOTE: the backward's largest gradients alive at once: the attention scores' (input and
    # output of the softmax backward) or the MLP's 4h-wide ones.
    temp = 2 * HALF * max(att, 4 * n * r)
    return Block(f"layer{index}", "gpt-layer", ops, params=sharded * r + replicated,
                 input_bytes=HALF * n * q, output_bytes=HALF * n * q, tp=tp,
                 bwd_temp_bytes=temp, options=(("selective", ("softmax", "attn_dropout")),),
                 extra={"shape": shape, "micro_batch": micro_batch, "sp": sp})


def gpt_embedding(shape: GptShape, tp: int, micro_batch: int, sp: bool = False) -> Block:
    """Token (vocabulary-parallel) and position embeddings, their sum, dropout."""
    _check(shape, tp, micro_batch, sp)
    b, s, h, v = micro_batch, shape.seq, shape.hidden, shape.vocab
    n = b * s * h
    q = 1.0 / tp if sp else 1.0
    out_fwd, out_bwd = _tp_output_comm(n * HALF, tp, sp)
    ops = (
        # NOTE: the lookup's backward accumulates into a dense float32 gradient of this
        # device's vocabulary share (Megatron's main_grad), which it writes whole.
        Op("lookup", bytes=HALF * 2 * n, bwd_flops=0.0,
           bwd_bytes=HALF * n + FLOAT * v * h / tp, matmul=False, fwd_comm=out_fwd,
           bwd_comm=out_bwd),
        Op("emb_dropout", bytes=(3 * HALF + MASK) * n * q, saved=MASK * n * q,
           reads=("lookup",), bwd_flops=0.0, bwd_bytes=(2 * HALF + MASK) * n * q, matmul=False,
           **_vector("dropout", n * q)),
    )
    return Block("embedding", "gpt-embedding", ops, params=s * h,
                 input_bytes=0.0, output_bytes=HALF * n * q, tp=tp, role="embedding",
                 shared=(("word_embeddings", v * h / tp),),
                 extra={"shape": shape, "micro_batch": micro_batch, "sp": sp})


def gpt_head(shape: GptShape, tp: int, micro_batch: int, sp: bool = False) -> Block:
    """The final layer norm, the logits (the tied embedding, vocabulary-parallel) and the
    vocabulary-parallel cross-entropy (float32, its softmax saved for the backward)."""
    _check(shape, tp, micro_batch, sp)
    b, s, h, v = micro_batch, shape.seq, shape.hidden, shape.vocab
    n = b * s * h
    q = 1.0 / tp if sp else 1.0
    logits = b * s * v / tp
    in_fwd, in_bwd = _tp_input_comm(n * HALF, tp, sp)
    ce_comm = (Collective("all_reduce", 3 * FLOAT * b * s),) if tp > 1 else ()
    ops = (
        _norm("ln_f", (INPUT,), n * q, tp, sp),
        Op("logits", flops=2 * n * v / tp, bytes=HALF * (n + v * h / tp + logits),
           reads=("ln_f",), bwd_w_flops=2 * n * v / tp, gemms=((b * s, -(-v // tp), h, 1),),
           bwd_bytes=HALF * (2 * n + v * h / tp + logits), bwd_comm=in_bwd),
        Op("cross_entropy", bytes=(HALF + 2 * FLOAT) * logits, saved=FLOAT * logits,
           reads=("logits",), bwd_flops=0.0, bwd_bytes=(FLOAT + HALF) * logits,
           matmul=False, fwd_comm=ce_comm, **_vector("cross_entropy", logits)),
    )
    del in_fwd
    return Block("head", "gpt-head", ops, params=2 * h,
                 input_bytes=HALF * n * q, output_bytes=0.0, tp=tp, role="head",
                 bwd_temp_bytes=(FLOAT + HALF) * logits,
                 shared=(("word_embeddings", v * h / tp),),
                 fission=(("chunked-loss", ("cross_entropy",), LOSS_PARTS),),
                 extra={"shape": shape, "micro_batch": micro_batch, "sp": sp})


def gpt_blocks(shape: GptShape, tp: int, micro_batch: int, sp: bool = False) -> list[Block]:
    """The whole model: embedding, ``shape.layers`` layers, head (with the loss)."""
    return list(_blocks(shape, tp, micro_batch, sp))


@lru_cache(maxsize=256)
def _blocks(shape: GptShape, tp: int, micro_batch: int, sp: bool) -> tuple[Block, ...]:
    # NOTE: the layers are one block renamed (their ops are equal, so pricing sees one kind)
    layer = gpt_layer(shape, tp, micro_batch, sp, 0)
    return ((gpt_embedding(shape, tp, micro_batch, sp),)
            + tuple(replace(layer, name=f"layer{i}") for i in range(shape.layers))
            + (gpt_head(shape, tp, micro_batch, sp),))


def _check(shape: GptShape, tp: int, micro_batch: int, sp: bool) -> None:
    if tp < 1 or micro_batch < 1:
        raise ValueError(f"tensor-parallel width {tp} and micro-batch {micro_batch} must be >= 1")
    if shape.heads % tp or shape.hidden % shape.heads:
        raise ValueError(f"a GPT of {shape.heads} heads of width {shape.hidden} cannot be split "
                         f"over {tp} devices (heads must divide by the tensor-parallel width)")
    if sp and shape.seq % tp:
        raise ValueError(f"sequence parallelism needs the sequence ({shape.seq}) divisible by "
                         f"the tensor-parallel width ({tp})")
