"""A captured model as the multi-device planner's chain of blocks, with Megatron-style tensor
parallelism found from the graph's structure (``dist.graph_model``, ``dist.graph_tp``)."""

from __future__ import annotations

import math

import pytest
import torch

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.dist import LINKS, Cluster, Parallelism
from fitgraph.dist.evaluate import evaluate
from fitgraph.dist.graph_model import GraphModel, GraphModelError
from fitgraph.dist.graph_tp import tensor_parallel_map

A100 = get_device("a100-80gb")


class Block(torch.nn.Module):
    """A pre-norm transformer layer written out (attention by bmm over merged batch x heads,
    as eager attention code does), so that the tensor-parallel search sees plain ATen ops."""

    def __init__(self, h: int = 64, heads: int = 4):
        super().__init__()
        self.h, self.heads = h, heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.up, self.down = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)

        def heads(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2).reshape(
                b * self.heads, s, h // self.heads)

        att = torch.softmax(heads(q) @ heads(k).transpose(1, 2) / 4.0, dim=-1)
        y = (att @ heads(v)).view(b, self.heads, s, h // self.heads).transpose(1, 2)
        x = x + self.proj(y.reshape(b, s, h))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class Tiny(torch.nn.Module):
    def __init__(self, layers: int = 3, h: int = 64, vocab: int = 96):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(Block(h) for _ in range(layers))
        self.head = torch.nn.Linear(h, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _loss(m, ids):
    logits = m(ids)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = Tiny()
    ids = torch.randint(0, 96, (4, 16))
    graph = fitgraph.capture(model, ids, _loss)
    return model, graph, GraphModel(graph, RooflineCostModel(A100), batch_size=4, seq=16)


def test_the_chain_is_the_repeated_layers_between_what_comes_before_and_after(tiny):
    model, _, gm = tiny
    blocks = gm.blocks(1, 4, False)
    assert [b.name for b in blocks] == ["<prelude>", "layers.0", "layers.1", "layers.2",
                                        "<rest>"]
    # blocks of one structure are one kind (priced once), the ends their own
    assert len({b.kind for b in blocks[1:4]}) == 1
    assert blocks[0].role == "embedding" and blocks[-1].role == "head"
    # every parameter counted once over the chain
    total = sum(p.numel() for p in model.parameters())
    assert sum(b.params for b in blocks) + sum(
        dict(x for b in blocks for x in b.shared).values()) == pytest.approx(total)


def test_micro_batches_scale_times_and_activations_not_parameters(tiny):
    _, _, gm = tiny
    one, two = gm.blocks(1, 4, False), gm.blocks(1, 8, False)
    for a, b in zip(one, two):
        assert b.params == a.params
        assert b.saved_bytes == pytest.approx(2 * a.saved_bytes)
        assert sum(o.seconds for o in b.ops) == pytest.approx(2 * sum(o.seconds for o in a.ops))
    assert gm.model_flops(8) == pytest.approx(2 * gm.model_flops(4))


def test_attention_and_mlp_split_column_then_row_the_head_refused_with_its_reason(tiny):
    _, graph, gm = tiny
    tpm = gm.tensor_parallel(2)
    # per layer: the fused QKV -> proj group and the up -> down group
    assert len(tpm.groups) == 6
    assert len(tpm.reduce_bytes) == 6
    # a layer's four weights and the column biases (qkv, up) are split; proj/down biases and
    # the norms are not
    assert len(tpm.sharded_params) == 6 * 3
    assert any("_log_softmax" in r for r in tpm.refused)
    # each all-reduce moves one activation of the residual width: batch x seq x hidden x 4 B
    assert set(tpm.reduce_bytes.values()) == {4 * 16 * 64 * 4}
    assert set(tpm.input_grad_bytes.values()) == {4 * 16 * 64 * 4}


def test_width_that_does_not_divide_the_heads_is_refused(tiny):
    _, graph, gm = tiny
    tpm = tensor_parallel_map(graph, 3)
    assert not tpm.groups and tpm.refused
    assert "divide" in gm.why_not(3, 4, False)
    assert "tp > 1" in gm.why_not(1, 4, True)


def test_split_blocks_run_half_their_sliced_work_with_their_collectives(tiny):
    _, _, gm = tiny
    whole, half = gm.blocks(1, 4, False), gm.blocks(2, 4, False)
    layer1, layer2 = whole[1], half[1]
    fwd_comm = [c for op in layer2.ops for c in op.fwd_comm]
    bwd_comm = [c for op in layer2.ops for c in op.bwd_comm]
    assert [c.kind for c in fwd_comm] == ["all_reduce"] * 2
    assert [c.kind for c in bwd_comm] == ["all_reduce"] * 2
    t1 = sum(o.seconds for o in layer1.ops)
    t2 = sum(o.seconds for o in layer2.ops)
    assert t1 / 2 < t2 < t1                      # the sliced part halves, norms stay whole
    assert layer2.params < layer1.params / 2 + 6 * 64 + 1
    assert half[-1].params == whole[-1].params   # the refused head stays whole


def test_sequence_parallel_blocks_run_the_rest_on_their_part_of_the_rows(tiny):
    """From a row-parallel matmul to the next matmul (its residual add, the next norm) the
    ops run on 1/tp of the rows and save 1/tp; the first block's first norm reads the whole
    input it is handed and runs whole, as at run time; each all-reduce becomes a reduce-
    scatter and an all-gather of the same bytes; the embedding block is unchanged."""
    _, _, gm = tiny
    tp, sp = gm.blocks(2, 4, False), gm.blocks(2, 4, True)
    body = list(zip(tp[1:-1], sp[1:-1]))
    assert body[0][1].input_bytes == body[0][0].input_bytes      # the embedding's output
    for a, b in body[1:]:
        assert b.input_bytes == a.input_bytes / 2                  # the last block's parts
    halved = 0
    for a, b in body:
        for x, y in zip(a.ops[:-1], b.ops[:-1]):
            assert y.seconds in (x.seconds, pytest.approx(x.seconds / 2))
            if y.seconds != x.seconds:
                halved += 1
                assert y.saved == pytest.approx(x.saved / 2)
        assert sum(o.saved for o in b.ops) < sum(o.saved for o in a.ops)
        kinds = sorted(c.kind for op in b.ops for c in (*op.fwd_comm, *op.bwd_comm))
        assert kinds == ["all_gather"] * 6 + ["reduce_scatter"] * 4
        assert {c.nbytes for op in b.ops for c in (*op.fwd_comm, *op.bwd_comm)} == {
            c.nbytes for op in a.ops for c in (*op.fwd_comm, *op.bwd_comm)}
    assert halved >= 3 * len(body) - 1
    assert sp[0].ops == tp[0].ops


def test_a_captured_model_plans_with_tensor_parallelism_and_honest_memory(tiny):
    _, _, gm = tiny
    cluster = Cluster(A100, 4, 1, LINKS["nvlink3"], LINKS["hdr-ib"])
    par = Parallelism(tp=2, pp=2, dp=1, micro_batch=4, n_micro=4)
    pred = evaluate(gm, cluster, par)
    assert pred.fits
    for s in pred.stages:
        assert s.peak_bytes == pytest.approx(sum(s.memory().values()))
        assert s.tp_comm_s > 0
    assert math.isclose(pred.tokens_per_s, 16 * 16 / pred.step_s)


def test_a_model_with_no_chain_says_so():
    lin = torch.nn.Linear(8, 8)
    g = fitgraph.capture(lin, torch.randn(2, 8), lambda m, b: m(b).sum())
    with pytest.raises(GraphModelError, match="no chain"):
        GraphModel(g, RooflineCostModel(A100), batch_size=2)


def test_zoo_transformers_split_every_attention_and_mlp():
    from fitgraph import zoo

    for name, per_layer in (("llama", 2), ("gpt2", 2)):
        case = zoo.build(name, "small")
        g = fitgraph.capture(case.model, case.batch, case.loss_fn)
        tpm = tensor_parallel_map(g, 2)
        layers = len(case.block_types and [m for m in case.model.modules()
                                           if isinstance(m, case.block_types)])
        assert len(tpm.groups) == per_layer * layers, (name, tpm.groups, tpm.refused)


def test_plan_takes_a_captured_graph(tiny):
    from fitgraph.dist import dgx_a100, plan

    _, graph, _ = tiny
    p = plan(graph, dgx_a100(1), global_batch=64)
    assert p.fits and p.parallelism.devices == 8
    assert p.parallelism.global_batch == 64
    with pytest.raises(TypeError, match="GptShape, a captured Graph"):
        plan(object(), dgx_a100(1), global_batch=64)


def test_plan_dist_plans_a_zoo_model_with_tensor_parallelism(capsys):
    import json

    from fitgraph.cli import main

    rc = main(["plan-dist", "gpt2", "--devices", "4", "--gpus-per-node", "4",
               "--global-batch", "16", "--fix", "tp=2,pp=2,dp=1,microbatch=2,schedule=1f1b",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"]
    assert out["parallelism"]["tp"] == 2 and len(out["stages"]) == 2
    assert all(s["time"]["tp_comm_s"] > 0 for s in out["stages"])
    assert out["model"].startswith("gpt2 (small, bfloat16)")


def test_the_head_runs_its_loss_in_parts_and_each_block_carries_its_backward_peak(tiny):
    from fitgraph.dist.block_cost import price_block

    _, _, gm = tiny
    blocks = gm.blocks(1, 4, False)
    # the backward's own peak (gradients, the input gradient handed down) is counted
    assert all(b.bwd_temp_bytes > 0 for b in blocks[1:])
    head = blocks[-1]
    name, _, k = head.fission[0]
    assert 2 <= k <= 8 and name == f"in {k} parts"       # along its tokens or its 4 samples
    cost = price_block(head, A100, LINKS["nvlink3"])
    parts = cost.option(name)
    whole = max(cost.options, key=lambda o: o.working_bytes)
    # re-made in parts: little kept, and a working set a fraction of re-making it whole
    assert parts.kept_bytes < cost.options[0].kept_bytes
    assert parts.kept_bytes == pytest.approx(head.input_bytes, abs=64)   # its input only
    assert parts.working_bytes < whole.working_bytes / 2
    # what the runtime runs (parallelize's plan="auto", --emit-script) has no loss in parts
    _, graph, _ = tiny
    runnable = GraphModel(graph, RooflineCostModel(A100), batch_size=4, seq=16,
                          loss_in_parts=False)
    assert runnable.blocks(1, 4, False)[-1].fission == ()


def test_the_split_names_each_weight_as_parallelize_module_would(tiny):
    _, _, gm = tiny
    styles = gm.tensor_parallel(2).styles
    for i in range(3):
        for name in ("qkv.weight", "qkv.bias", "up.weight", "up.bias"):
            assert styles[f"layers.{i}.{name}"] == "colwise"
        for name in ("proj.weight", "down.weight"):
            assert styles[f"layers.{i}.{name}"] == "rowwise"
        # a row-parallel bias is added once, after the all-reduce: not split
        assert f"layers.{i}.proj.bias" not in styles and f"layers.{i}.down.bias" not in styles
    assert not any(k.startswith(("emb", "head")) for k in styles)
