"""Forward regions re-made in the backward (``transform.recompute_copies``) and run there in
parts in every block (``solvers.fission.split_backward``): the same results as eager, a lower
least peak than remat alone, and ``auto`` reaching budgets remat alone cannot."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_split_like_eager
from torch import nn
from torch.nn import functional as F

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.execute import execute
from fitgraph.graph.ir import Phase
from fitgraph.solvers import Problem, solve
from fitgraph.solvers.fission.split_backward import split_backward
from fitgraph.solvers.remat.hotspot import solve_hotspot
from fitgraph.transform.compact_masks import compact_masks
from fitgraph.transform.recompute_copies import (
    COPY_SUFFIX,
    CopyError,
    copy_set,
    recompute_copies,
)


class Block(nn.Module):
    """Eager attention as Hugging Face writes it: scores, softmax, dropout, then values."""

    def __init__(self, width, heads, dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = self.drop(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1))
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(x)


def _encoder(dropout=0.1, layers=2, width=32, heads=2):
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))


def _loss(m, x):
    return m(x).square().mean()


BATCH = torch.randn(2, 64, 32)


def _run(graph, plan, model, seed=0):
    m = copy.deepcopy(model)
    torch.manual_seed(seed)
    loss = execute(graph, plan, m, BATCH)
    return loss, {n: p.grad for n, p in m.named_parameters()}


def _softmax_nodes(g):
    """The forward softmax nodes and the forward nodes that read them (the saved ``detach``,
    the dropout's product)."""
    soft = {n.id for n in g.nodes if n.phase is Phase.FORWARD and "softmax" in n.target}
    assert soft
    made = {o for i in soft for o in g.nodes[i].outputs if o is not None}
    return soft | {n.id for n in g.nodes if n.phase is Phase.FORWARD
                   and any(v in made for v in n.inputs)}


def test_copies_are_bitwise_and_read_by_the_backward():
    model = _encoder()
    g = compact_masks(fitgraph.capture(model, BATCH, _loss))
    nodes = copy_set(g, _softmax_nodes(g))
    g2 = recompute_copies(g, nodes)
    copies = [n for n in g2.nodes if n.name.endswith(COPY_SUFFIX)]
    assert len(copies) == len(nodes) and all(n.phase is Phase.BACKWARD for n in copies)
    # NOTE: nothing in the backward reads the originals' outputs any more
    originals = {o for n in g2.nodes if n.phase is Phase.FORWARD and n.name + COPY_SUFFIX in
                 {c.name for c in copies} for o in n.outputs if o is not None}
    assert not any(v in originals for n in g2.nodes if n.phase is Phase.BACKWARD
                   for v in n.inputs)
    la, ga = _run(g, fitgraph.eager_plan(g), model)
    lb, gb = _run(g2, fitgraph.eager_plan(g2), model)
    assert torch.equal(la, lb)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_a_random_draw_is_not_copied():
    model = _encoder()
    g = fitgraph.capture(model, BATCH, _loss)   # NOTE: masks as drawn, not as bits
    draws = [n.id for n in g.nodes if n.random]
    assert draws
    with pytest.raises(CopyError, match="draws random numbers"):
        recompute_copies(g, draws[:1])
    assert draws[0] not in copy_set(g, draws[:1])


def test_split_backward_lowers_the_least_peak_with_eager_results():
    model = _encoder(layers=3)
    g = fitgraph.capture(model, BATCH, _loss)
    cm = RooflineCostModel(get_device("cpu-generic"))
    least = solve_hotspot(Problem(g, cm, latency_limit=1e9, time_budget_s=10))
    s = split_backward(Problem(g, cm, latency_limit=1e9, time_budget_s=15))
    assert s.graph is not None and s.notes["splits"]
    assert s.sim.peak_bytes < least.sim.peak_bytes
    assert any("re-made in the backward" in w for w in s.notes["splits"])
    assert_split_like_eager(g, s.graph, model, BATCH, s.plan)


@pytest.mark.slow
def test_auto_reaches_a_budget_below_remat_alone():
    model = _encoder(layers=3)
    g = fitgraph.capture(model, BATCH, _loss)
    cm = RooflineCostModel(get_device("cpu-generic"))
    least = min(solve_hotspot(Problem(graph, cm, latency_limit=1e9, time_budget_s=10)
                              ).sim.peak_bytes for graph in (g, compact_masks(g)))
    deep = split_backward(Problem(g, cm, latency_limit=1e9, time_budget_s=20))
    assert deep.sim.peak_bytes < least
    budget = (least + deep.sim.peak_bytes) // 2
    s = solve(Problem(g, cm, budget_bytes=budget, time_budget_s=20), "auto")
    assert s.sim.peak_bytes <= budget and s.graph is not None
    assert s.notes["winner"] == "split_backward"


def test_the_forward_runs_in_parts_once_the_backward_reads_copies():
    from fitgraph.solvers.fission.backward_regions import _copied_in_parts, _forward_in_parts

    model = _encoder()
    g = compact_masks(fitgraph.capture(model, BATCH, _loss))
    soft = next(n for n in g.nodes if n.phase is Phase.FORWARD and "softmax" in n.target)
    # NOTE: before the copies the backward reads the softmax: its forward stays whole
    assert _forward_in_parts(g, g.values[soft.outputs[0]].name, 2) is g
    s = _copied_in_parts(g, soft.outputs[0], 2, 0.0)
    fwd = [n for n in s.nodes if n.phase is Phase.FORWARD and "softmax" in n.target
           and n.module == soft.module]   # NOTE: this block's (the alike maker does each)
    assert len(fwd) > 1 and all(".part" in n.name for n in fwd)
    later = {v for n in s.nodes if n.phase is not Phase.FORWARD for v in n.inputs}
    assert not any(o in later for n in fwd for o in n.outputs)
    # NOTE: the mask's bits are packed in rows: each backward part unpacks its own rows
    unpacks = [n.name for n in s.nodes if n.phase is Phase.BACKWARD and ".mask.full" in n.name]
    assert unpacks and all(".part" in name for name in unpacks)
    assert_split_like_eager(g, s, model, BATCH)


class _MaskedLM(nn.Module):
    """A masked-LM head whose loss is computed in the model's forward (as Hugging Face's)."""

    def __init__(self, vocab=256):
        super().__init__()
        self.vocab = vocab
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32))
        self.head = nn.Linear(32, vocab)

    def forward(self, x, labels):
        logits = self.head(self.body(x))
        return F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1))


def test_the_forward_loss_runs_in_parts_once_the_backward_reads_the_logits_copies():
    """The backward's ``ones_like(loss)`` reads only the loss's shape: it does not keep the
    loss whole, nor the log-probabilities assembled for it (ALBERT: 2 MiB at its least
    peak); and the flattened tokens run in every part they have, not in the batch's two."""
    from fitgraph.solvers.fission.backward_regions import copies_recipe
    from fitgraph.solvers.fission.split_backward import prepared

    torch.manual_seed(0)
    model = _MaskedLM()
    x, y = torch.randn(2, 64, 32), torch.randint(0, 256, (2, 64))
    y[:, ::3] = -100
    g = prepared(fitgraph.capture(model, (x, y), lambda m, b: m(*b)))
    head = [n for n in g.nodes if n.phase is Phase.FORWARD and n.target == "aten.addmm.default"]
    s = copies_recipe(g.values[head[-1].outputs[0]].name, 0, 0.0)(g, 4, float("inf"))
    fwd = [n for n in s.nodes if n.phase is Phase.FORWARD]
    assert sum(n.target == "aten.nll_loss_forward.default" for n in fwd) == 4
    assert sum(n.target == "aten._log_softmax.default" for n in fwd) == 4
    assert not [n.name for n in fwd if n.target == "aten.new_empty_strided.default"]
    assert_split_like_eager(g, s, model, (x, y))


def test_a_region_keeps_its_own_block_not_the_other_readers_of_a_shared_mask():
    from fitgraph.graph.ir import GraphBuilder, Role
    from fitgraph.solvers.fission.forward_regions import linked_nodes as _linked

    b = GraphBuilder()
    mask = b.add_input("mask", (4, 8), "bool", Role.INPUT)
    xs = [b.add_input(f"x{i}", (4, 8), "float32", Role.INPUT) for i in range(2)]
    shared = b.add_node("aten.logical_not.default", [mask], [((4, 8), "bool")])[0]
    outs = []
    for x in xs:   # NOTE: each block turns the shared mask into its own float mask
        w = b.add_node("aten.bitwise_not.default", [shared], [((4, 8), "bool")])[0]
        s = b.add_node("aten.mul.Tensor", [x, w], [((4, 8), "float32")])[0]
        outs.append(b.add_node("aten.exp.default", [s], [((4, 8), "float32")])[0])
    g = b.finish({"a": outs[0], "b": outs[1]})
    names = {n.name: n.id for n in g.nodes}
    everything = set(names.values())
    own = {g.nodes[i].name for i in _linked(g, names["mul_2"], everything)}
    # NOTE: block 0's product, what it leads to and what leads to them; block 1's nodes only
    # hang off the shared node
    assert own == {"logical_not_0", "bitwise_not_1", "mul_2", "exp_3"}


def test_a_backward_view_of_a_copied_tensor_reads_the_copy():
    """A backward view (AOT's ``detach`` of a saved softmax) made from a copied forward view
    returns the copy's storage, not the original's: left in the original's, it kept the
    forward's tensor alive into the backward."""
    from fitgraph.graph.ir import GraphBuilder, Role

    b = GraphBuilder()
    x = b.add_input("x", (4, 8), "float32", Role.PARAMETER)
    e = b.add_node("aten.exp.default", [x], [((4, 8), "float32")])[0]
    d = b.add_node("aten.detach.default", [e], [((4, 8), "float32")], alias_of={0: e})[0]
    s = b.add_node("aten.sum.default", [e], [((), "float32")], phase=Phase.LOSS)[0]
    d2 = b.add_node("aten.detach.default", [d], [((4, 8), "float32")], alias_of={0: d},
                    phase=Phase.BACKWARD)[0]
    gx = b.add_node("aten.mul.Tensor", [s, d2], [((4, 8), "float32")], phase=Phase.BACKWARD)[0]
    g = b.finish({"loss": s, "grad:x": gx})
    g2 = recompute_copies(g, [g.values[e].producer, g.values[d].producer])
    by_name = {v.name: v for v in g2.values}
    original = by_name[g.values[e].name].storage
    assert by_name[g.values[d2].name].storage == by_name[g.values[e].name + COPY_SUFFIX].storage
    assert not any(g2.values[v].storage == original for n in g2.nodes
                   if n.phase is Phase.BACKWARD for v in n.inputs)


class MhaBlock(nn.Module):
    """Pre-norm ``nn.MultiheadAttention`` block: its backward is row-wise along the tokens
    from block to block (no reshape of the batch and tokens stops a region)."""

    def __init__(self, width=32, heads=2):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


@pytest.mark.parametrize("parts", [8, 16])
def test_every_block_of_torch_multihead_attention_runs_its_backward_in_parts(parts):
    """Grown from a copy, a region stays in its own block's backward: grown into the later
    blocks' (which run before it), its convexity cut took away its own backward, and only the
    last block's attention ran in parts. In the search's parts and in the replay's."""
    from fitgraph.solvers.fission.backward_regions import PARTS, copies_recipe
    from fitgraph.solvers.fission.split_backward import REPLAY_PARTS

    assert (PARTS, REPLAY_PARTS) == (8, 16)

    torch.manual_seed(0)
    model = nn.Sequential(MhaBlock(), MhaBlock(), MhaBlock())
    g = compact_masks(fitgraph.capture(model, BATCH, _loss))
    soft = next(n for n in g.nodes if n.phase is Phase.FORWARD and "softmax" in n.target)
    s = copies_recipe(g.values[soft.outputs[0]].name, 2, 0.0)(g, parts, float("inf"))
    grads = [n for n in s.nodes if n.target == "aten._softmax_backward_data.default"]
    assert len(grads) == 3 * parts and all(".part" in n.name for n in grads)
    assert_split_like_eager(g, s, model, BATCH)


def test_the_gradient_of_a_copied_mlp_hidden_runs_in_parts_with_it():
    """The MLP hidden's gradient (``dY @ W2``) runs in the backward just before the first
    reader of the hidden's copy: it joins the region and runs in parts, never whole."""
    from fitgraph.solvers.fission.backward_regions import _copied_in_parts

    model = _encoder(dropout=0.0)
    g = fitgraph.capture(model, BATCH, _loss)
    gelu = next(n for n in g.nodes if n.phase is Phase.FORWARD and "gelu" in n.target)
    hidden = g.values[gelu.outputs[0]]
    s = _copied_in_parts(g, hidden.id, 2, 0.0)
    # NOTE: the block's mm in the backward that makes a tensor of the hidden's size
    rows = hidden.shape[0] * hidden.shape[1]
    block = gelu.module.split(".")[0] + "."
    whole = [n.name for n in s.nodes if n.phase is Phase.BACKWARD and n.module.startswith(block)
             and n.target == "aten.mm.default"
             and tuple(s.values[n.outputs[0]].shape) == (rows, hidden.shape[2])]
    assert not whole, whole
    parts = [n for n in s.nodes if n.phase is Phase.BACKWARD and n.target == "aten.mm.default"
             and ".part" in n.name and s.values[n.outputs[0]].shape[-1] < hidden.shape[2]
             and s.values[n.outputs[0]].shape[0] == rows]
    assert parts
    assert_split_like_eager(g, s, model, BATCH)


def test_a_copied_mlp_along_its_flattened_tokens_keeps_every_token():
    """Re-made along the flattened tokens of its 2-D matmuls (``[B*T, F]``), a block's MLP ran
    on through the 3-D norm and residual, which tie the tokens to the batch: cut in 2 parts at
    batch 2. The region keeps to where every token is a unit, and runs in up to PARTS parts."""
    from fitgraph.graph.dim_region import grow_region
    from fitgraph.solvers.fission.backward_regions import PARTS, _copied_in_parts
    from fitgraph.transform.view_chains import collapse_view_chains

    model = _encoder(dropout=0.0)
    g = collapse_view_chains(fitgraph.capture(model, BATCH, _loss))
    gelu = next(n for n in g.nodes if n.phase is Phase.FORWARD and "gelu" in n.target)
    hidden = g.values[gelu.outputs[0]]
    tokens = BATCH.shape[0] * BATCH.shape[1]
    assert hidden.shape[0] == tokens      # NOTE: the GELU runs on the 2-D hidden
    assert grow_region(g, hidden.id, 0).length == BATCH.shape[0]
    s = _copied_in_parts(g, hidden.id, 0, 0.0)
    copies = [n for n in s.nodes if n.phase is Phase.BACKWARD and n.target == gelu.target
              and n.module == gelu.module]
    assert len(copies) == PARTS
    assert all(s.values[n.outputs[0]].shape[0] == tokens // PARTS for n in copies)
    assert_split_like_eager(g, s, model, BATCH)


class ConvFrontEnd(nn.Module):
    """A speech model's convolutional front end (HuBERT's, conv_bias=False): a convolution of
    the raw samples, a GroupNorm per channel, GELU; then a convolution that sums over them."""

    def __init__(self, ch=16):
        super().__init__()
        self.conv0 = nn.Conv1d(1, ch, 10, stride=5, bias=False)
        self.norm = nn.GroupNorm(ch, ch)
        self.conv1 = nn.Conv1d(ch, ch, 3, stride=2, bias=False)
        self.head = nn.Linear(ch, 4)

    def forward(self, audio):
        h = F.gelu(self.norm(self.conv0(audio[:, None])))
        return self.head(F.gelu(self.conv1(h)).mean(-1))


def test_a_layer_re_made_along_its_channels_leaves_the_sum_over_them_to_the_forward():
    """Re-made with the layer, the next convolution's sum over its channels had to be whole
    before the next layer's activation backward, which runs first: the region stopped at the
    copies, whole. Left to the forward, the layer's copies and its backward (the next
    convolution's gradients by input channel, GELU, GroupNorm, the first convolution's
    weight gradient) run in parts, like eager."""
    from fitgraph.solvers.fission.backward_regions import PARTS, _copied_in_parts

    torch.manual_seed(0)
    model, audio = ConvFrontEnd(), torch.randn(2, 800)
    g = fitgraph.capture(model, audio, lambda m, b: m(b).square().mean())
    gelu = next(n for n in g.nodes if n.phase is Phase.FORWARD and "gelu" in n.target)
    s = _copied_in_parts(g, gelu.outputs[0], 1, 0.0)
    copies = [n for n in s.nodes if n.phase is Phase.BACKWARD and n.target == gelu.target
              and ".part" in n.name]
    assert len(copies) == PARTS
    norms = [n for n in s.nodes if n.target == "aten.native_group_norm_backward.default"]
    assert len(norms) == PARTS and all(".part" in n.name for n in norms)
    # NOTE: the second convolution runs once in the forward, never re-made in the backward
    assert [n.phase for n in s.nodes if n.target == "aten.convolution.default"
            and n.module == "conv1"] == [Phase.FORWARD]
    assert_split_like_eager(g, s, model, audio)


class _SharedBias(nn.Module):
    """Blocks of masked attention scores that all add one ``[1, T, T]`` bias (T5's position
    bias, computed once and shared): its gradient sums every block's, each masked and summed
    over the batch."""

    def __init__(self, blocks: int = 3, t: int = 32, d: int = 16):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, t, t) * 0.1)
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))

    def forward(self, x):
        bias = self.bias * 1.0
        keep = x[:, None, :, 0] > -1.0     # NOTE: a padding mask from the data, [B, 1, T]
        for p in self.proj:
            h = p(x)
            scores = torch.where(keep, h @ h.transpose(-1, -2) + bias, -1e4)
            x = scores.softmax(-1) @ h + x
        return x


def test_blocks_sharing_a_tensor_sum_its_gradient_in_parts():
    # NOTE: T5: grown first block first, block 2's region took the sum of block 3's gradient
    # (over the batch) as a whole input, and block 3's region made that gradient, [B, H, T,
    # T], in parts into a whole buffer that lived through block 2's backward (the regions
    # are now grown last block first; this small model shows no such buffer either way: the
    # sweep's T5 row measures it). Each forward runs in parts, no softmax left whole
    from fitgraph.solvers.fission.backward_regions import copies_recipe

    torch.manual_seed(0)
    model, x = _SharedBias(), torch.randn(4, 32, 16)
    g = fitgraph.capture(model, x, lambda m, x: m(x).square().mean())
    soft = next(n for n in g.nodes if n.target == "aten._softmax.default")
    split = copies_recipe(g.values[soft.outputs[0]].name, 1, 1.0)(g, 4, float("inf"))
    buffers = [split.values[n.outputs[0]].shape for n in split.nodes
               if n.target == "aten.new_empty_strided.default"]
    assert (4, 32, 32) not in buffers
    assert sum(".part" in n.name and n.target == "aten.sum.dim_IntList"
               for n in split.nodes) >= 3 * 4   # NOTE: every block sums its parts
    assert_split_like_eager(g, split, model, x)


def test_a_tensor_filled_in_place_is_not_copied_without_its_writes():
    """A forward tensor made in parts is a buffer that in-place writes fill (fission's
    ``new_empty_strided`` + ``copy_``): copied without those writes, the backward would read
    it unwritten (HuBERT's first layer's weight gradient was wrong). Refused, naming the write;
    copied with them, the backward reads the copies of both."""
    from fitgraph.graph.ir import GraphBuilder, Role

    b = GraphBuilder()
    x = b.add_input("x", (4, 8), "float32", Role.PARAMETER)
    buf = b.add_node("aten.zeros_like.default", [x], [((4, 8), "float32")])[0]
    e = b.add_node("aten.exp.default", [x], [((4, 8), "float32")])[0]
    b.add_node("aten.add_.Tensor", [buf, e], [((4, 8), "float32")], mutates=(buf,),
               alias_of={0: buf})
    # NOTE: as fission's buffers are read: the buffer's own value, after the writes
    s = b.add_node("aten.sum.default", [buf], [((), "float32")])[0]
    gx = b.add_node("aten.mul.Tensor", [s, buf], [((4, 8), "float32")],
                    phase=Phase.BACKWARD)[0]
    g = b.finish({"loss": s, "grad:x": gx})
    with pytest.raises(CopyError, match="after add_.* writes it in place"):
        recompute_copies(g, [0])
    copied = recompute_copies(g, [0, 2])
    assert [n.name for n in copied.nodes if n.phase is Phase.BACKWARD][:2] == [
        g.nodes[0].name + ".re", g.nodes[2].name + ".re"]
