"""A GPT by its shape as blocks (``fitgraph.dist.gpt_blocks``), against the published formulas:
Korthikanti et al. (2022)'s activation bytes per layer, Megatron's eq. 2 (parameters) and the
model FLOPs of eq. 3 without the recompute forward, Megatron's tensor-parallel parameter split
and collectives. Every expectation is written out by hand from the papers, not from the code.
"""

from __future__ import annotations

from collections import Counter

import pytest

from fitgraph.dist.cluster import LINKS
from fitgraph.dist.collectives import all_gather_s, all_reduce_s, reduce_scatter_s
from fitgraph.dist.gpt_blocks import gpt_blocks, gpt_embedding, gpt_head, gpt_layer
from fitgraph.dist.megatron_table import TABLE1, GptShape
from fitgraph.dist.model import GptModel
from fitgraph.dist.ops import stage_params


def _tied(block) -> float:
    """The tied vocabulary weight this block holds on one device (a ``shared`` parameter,
    counted once per device by ``stage_params``)."""
    return dict(block.shared)["word_embeddings"]


# (b, t, h, a, s): micro-batch, tensor-parallel width, hidden, heads, sequence
SHAPES = [
    (1, 1, 2304, 24, 2048),
    (1, 2, 3072, 32, 2048),
    (2, 4, 1024, 16, 512),
    (4, 8, 12288, 96, 2048),
    (3, 2, 640, 10, 1000),
]


def _layer(b, t, h, a, s, sp=False):
    return gpt_layer(GptShape(2, h, a, seq=s), tp=t, micro_batch=b, sp=sp)


@pytest.mark.parametrize("b,t,h,a,s", SHAPES)
def test_saved_bytes_per_layer_are_korthikantis_formula(b, t, h, a, s):
    # Korthikanti et al. 2022, eq. (2): tensor parallel, no sequence parallelism
    assert _layer(b, t, h, a, s).saved_bytes == pytest.approx(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)


@pytest.mark.parametrize("b,t,h,a,s", [x for x in SHAPES if x[1] > 1])
def test_saved_bytes_per_layer_with_sequence_parallelism(b, t, h, a, s):
    # eq. (4): the layer norms and dropouts on 1/t of the sequence
    assert _layer(b, t, h, a, s, sp=True).saved_bytes == pytest.approx(
        s * b * h * (10 / t + 24 / t + 5 * a * s / (h * t)), rel=1e-12)


def test_selective_recompute_leaves_34_sbh_over_t():
    """Korthikanti §4.2: re-making the softmax and its dropout (the 5as/h term) leaves
    s b h 34/t with sequence parallelism."""
    b, t, h, a, s = 1, 8, 12288, 96, 2048
    layer = _layer(b, t, h, a, s, sp=True)
    dropped = dict(layer.options)["selective"]
    kept = layer.saved_bytes - sum(op.saved for op in layer.ops if op.name in dropped)
    assert kept == pytest.approx(34 * s * b * h / t, rel=1e-12)


def _eq2(shape: GptShape) -> float:
    """Megatron's eq. 2, written out: 12 l h^2 + 13 l h + (V + s) h."""
    n, h = shape.layers, shape.hidden
    return 12 * n * h * h + 13 * n * h + (shape.vocab + shape.seq) * h


@pytest.mark.parametrize("shape", [GptShape(8, 1024, 16, seq=512)]
                         + [row.shape for row in TABLE1[:4]], ids=str)
def test_parameters_at_t1_are_eq2_plus_the_final_layer_norm(shape):
    blocks = gpt_blocks(shape, tp=1, micro_batch=1)
    assert [b.role for b in blocks] == ["embedding"] + ["body"] * shape.layers + ["head"]
    # the head's vocabulary weight is the embedding's (tied): the model holds it once
    assert _tied(blocks[0]) == _tied(blocks[-1]) == shape.vocab * shape.hidden
    total = stage_params(blocks)
    # each end alone holds it (a pipeline's first and last stages keep a copy each)
    assert stage_params(blocks[:1]) + stage_params(blocks[1:]) == pytest.approx(
        total + shape.vocab * shape.hidden, rel=1e-12)
    assert shape.parameters == pytest.approx(_eq2(shape), rel=1e-12)
    assert total == pytest.approx(shape.parameters, rel=1e-3)
    # eq. 2 omits the final layer norm's scale and shift: exactly 2h
    assert total - shape.parameters == pytest.approx(2 * shape.hidden, rel=1e-6)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_per_device_parameters_follow_megatrons_split(t):
    h, v, s = 1024, 51200, 512
    shape = GptShape(4, h, 16, vocab=v, seq=s)
    # column-parallel: qkv weight and bias (3h^2 + 3h), fc1 weight and bias (4h^2 + 4h);
    # row-parallel: proj and fc2 weights (h^2, 4h^2), their biases replicated (h, h);
    # two layer norms replicated (4h)
    sharded = 3 * h * h + 3 * h + 4 * h * h + 4 * h + h * h + 4 * h * h
    replicated = h + h + 4 * h
    assert sharded == 12 * h * h + 7 * h and replicated == 6 * h
    assert gpt_layer(shape, t, 1).params == pytest.approx(sharded / t + replicated, rel=1e-12)
    # vocabulary-parallel embedding, replicated positions; the head: tied copy + final norm
    assert stage_params([gpt_embedding(shape, t, 1)]) == pytest.approx(v * h / t + s * h,
                                                                        rel=1e-12)
    assert stage_params([gpt_head(shape, t, 1)]) == pytest.approx(v * h / t + 2 * h, rel=1e-12)
    # t devices together hold the whole layer once (the replicated part t times)
    assert t * gpt_layer(shape, t, 1).params == pytest.approx(
        12 * h * h + 7 * h + t * 6 * h, rel=1e-12)


@pytest.mark.parametrize("shape", [GptShape(8, 1024, 16, seq=512), GptShape(96, 12288, 96),
                                   GptShape(3, 640, 10, vocab=1000, seq=100)], ids=str)
@pytest.mark.parametrize("batch", [1, 7, 512])
def test_model_flops_are_eq3_without_the_recompute_forward(shape, batch):
    B, s, n, h, V = batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    want = 72 * B * s * n * h * h * (1 + s / (6 * h)) + 6 * B * s * h * V
    assert GptModel(shape).model_flops(batch) == pytest.approx(want, rel=1e-9)
    # eq. 3 counts a second forward of the layers: 96 against 72
    assert shape.flops_per_iteration(batch) - want == pytest.approx(
        24 * B * s * n * h * h * (1 + s / (6 * h)), rel=1e-9)


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_matmul_flops_at_t_are_a_tth_of_t1s(t, sp):
    shape = GptShape(4, 1024, 16, seq=512)
    one, at = gpt_blocks(shape, 1, 2), gpt_blocks(shape, t, 2, sp)
    matmuls = 0
    for b1, bt in zip(one, at):
        assert [op.name for op in b1.ops] == [op.name for op in bt.ops]
        for o1, ot in zip(b1.ops, bt.ops):
            if o1.matmul:
                matmuls += 1
                assert ot.flops == pytest.approx(o1.flops / t, rel=1e-12)
                assert ot.bwd_flops == pytest.approx(o1.bwd_flops / t, rel=1e-12)
                assert ot.bwd_w_flops == pytest.approx(o1.bwd_w_flops / t, rel=1e-12)
        assert bt.model_flops == pytest.approx(b1.model_flops / t, rel=1e-12)
    # per layer: qkv, scores, context, proj, fc1, fc2; the head's logits
    assert matmuls == 6 * shape.layers + 1


def _comms(block, direction):
    attr = "fwd_comm" if direction == "fwd" else "bwd_comm"
    return [(op.name, c.kind, c.nbytes) for op in block.ops for c in getattr(op, attr)]


def test_a_layer_without_sequence_parallelism_all_reduces_twice_each_way():
    b, s, h = 2, 512, 1024
    layer = gpt_layer(GptShape(2, h, 16, seq=s), tp=4, micro_batch=b)
    nbytes = b * s * h * 2
    # forward: after the row-parallel proj and fc2 (Megatron's g); backward: the input
    # gradients of the column-parallel qkv and fc1 (its f)
    assert _comms(layer, "fwd") == [("proj", "all_reduce", nbytes), ("fc2", "all_reduce", nbytes)]
    assert _comms(layer, "bwd") == [("qkv", "all_reduce", nbytes), ("fc1", "all_reduce", nbytes)]


def test_a_layer_with_sequence_parallelism_gathers_and_scatters_the_same_bytes():
    b, s, h, t = 2, 512, 1024, 4
    shape = GptShape(2, h, 16, seq=s)
    layer = gpt_layer(shape, tp=t, micro_batch=b, sp=True)
    nbytes = b * s * h * 2
    fwd, bwd = _comms(layer, "fwd"), _comms(layer, "bwd")
    assert {x[2] for x in fwd + bwd} == {nbytes}
    assert not [x for x in fwd + bwd if x[1] == "all_reduce"]
    # forward: all-gather before each column-parallel matmul (in the norm before it),
    # reduce-scatter after each row-parallel one
    assert Counter(x[1] for x in fwd) == {"all_gather": 2, "reduce_scatter": 2}
    assert [x[:2] for x in fwd] == [("ln1", "all_gather"), ("proj", "reduce_scatter"),
                                    ("ln2", "all_gather"), ("fc2", "reduce_scatter")]
    # backward: the conjugates (2 reduce-scatters, 2 all-gathers) and Megatron's re-gather of
    # the sharded input for each column-parallel weight gradient (2 more all-gathers)
    assert Counter(x[1] for x in bwd) == {"all_gather": 4, "reduce_scatter": 2}
    # a ring all-reduce is a reduce-scatter then an all-gather: the forward costs the same
    link = LINKS["nvlink3"]
    cost = {"all_reduce": lambda n, t, link: all_reduce_s(n, t, link, "ring"),
            "all_gather": all_gather_s,
            "reduce_scatter": reduce_scatter_s}
    plain = gpt_layer(shape, tp=t, micro_batch=b, sp=False)
    assert sum(cost[k](n, t, link) for _, k, n in fwd) == pytest.approx(
        sum(cost[k](n, t, link) for _, k, n in _comms(plain, "fwd")), rel=1e-12)


@pytest.mark.parametrize("sp", [False, True])
def test_no_collectives_at_t1_and_some_in_every_block_at_t2(sp):
    shape = GptShape(2, 1024, 16, seq=512)
    for block in gpt_blocks(shape, 1, 2):
        assert _comms(block, "fwd") == [] and _comms(block, "bwd") == []
    for block in gpt_blocks(shape, 2, 2, sp):
        assert _comms(block, "fwd") + _comms(block, "bwd")


def test_heads_must_divide_by_the_tensor_parallel_width():
    shape = GptShape(2, 1024, 16, seq=512)
    for t in (3, 32):
        with pytest.raises(ValueError, match="heads must divide"):
            gpt_blocks(shape, t, 1)
        assert "heads must divide" in GptModel(shape).why_not(t, 1, False)
    assert GptModel(shape).why_not(16, 1, False) is None


def test_sequence_parallelism_needs_the_sequence_divisible_by_the_width():
    shape = GptShape(2, 1024, 16, seq=510)
    gpt_blocks(shape, 4, 1, sp=False)          # fine without sequence parallelism
    with pytest.raises(ValueError, match=r"sequence parallelism needs the sequence \(510\)"):
        gpt_blocks(shape, 4, 1, sp=True)
    assert GptModel(shape).why_not(2, 1, True) is None
    assert "sequence" in GptModel(shape).why_not(4, 1, True)


def test_bad_widths_and_micro_batches():
    shape = GptShape(2, 1024, 16, seq=512)
    for tp, b in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            gpt_layer(shape, tp, b)
