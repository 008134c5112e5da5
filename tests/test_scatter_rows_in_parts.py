"""A gather's gradient scattered in parts: a table indexed by position (a relative position
bias, as BEiT's and Swin's attention add it to the scores) gets its gradient by
``index_put(new_zeros, [index], rows, accumulate=True)``. Split along the scores' query rows,
each part scatters its own rows, adding into the result of the part before: the whole
``[T*T, heads]`` tensor of rows (BEiT: 1 MiB a layer, at its smallest peak) is never made."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_split_like_eager
from torch import nn

import fitgraph
from fitgraph.graph.dim_region import grow_region
from fitgraph.graph.dim_rules_index import index_scatter
from fitgraph.graph.dim_types import Along, Reduced
from fitgraph.graph.ir import Node, Phase, ValueRef
from fitgraph.transform.fission import FissionError, split_region


class RelativeBias(nn.Module):
    """Attention with a bias gathered from a table by relative position."""

    def __init__(self, tokens: int = 16, heads: int = 4, width: int = 32):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * tokens - 1, heads))
        pos = torch.arange(tokens)
        self.register_buffer("index", pos[:, None] - pos[None, :] + tokens - 1,
                             persistent=False)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        bias = self.table[self.index.view(-1)].view(t, t, self.heads).permute(2, 0, 1)
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / 8 + bias.contiguous().unsqueeze(0)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)


def _captured(layers: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(*(RelativeBias() for _ in range(layers)))
    x = torch.randn(2, 16, 32)
    return model, x, fitgraph.capture(model, x, lambda m, b: m(b).square().mean())


def _along_query_rows(g):
    sm = next(n for n in g.nodes if n.target == "aten._softmax_backward_data.default")
    return grow_region(g, sm.outputs[0], 2)


def test_the_table_gradient_is_scattered_in_parts_and_matches_eager():
    model, x, g = _captured()
    r = _along_query_rows(g)
    scatter = next(n for n in r.nodes if g.nodes[n].target == "aten.index_put.default")
    assert isinstance(r.dims[g.nodes[scatter].outputs[0]], Reduced)
    split = split_region(g, r, 4)
    parts = [n for n in split.nodes if n.name.startswith(g.nodes[scatter].name + ".")]
    # NOTE: the first part scatters into its zeros, the others add into its result in place
    assert [n.target for n in parts] == ["aten.index_put.default"] + \
        ["aten.index_put_.default"] * 3
    rows = g.nodes[scatter].inputs[-1]
    assert not any(v.shape == g.values[rows].shape for v in split.values
                   if v.producer is not None and split.nodes[v.producer].phase is Phase.BACKWARD
                   and split.nodes[v.producer].name.startswith("permute"))
    assert_split_like_eager(g, split, model, x)


def test_the_bias_is_gathered_in_parts_where_the_backward_re_makes_the_scores():
    """Re-made in the backward along the query rows (``split_backward``'s copies), the scores
    gather their own rows of the bias from the table: it is never whole in the backward."""
    from fitgraph.solvers.fission.backward_regions import copies_recipe

    model, x, g = _captured(layers=3)
    softmax = next(n for n in g.nodes if n.target == "aten._softmax.default")
    name = g.values[softmax.outputs[0]].name
    split = copies_recipe(name, 2, 0.25)(g, 4, float("inf"))
    gathered = [n for n in split.nodes if n.target == "aten.index.Tensor" and ".re.part" in n.name]
    scattered = [n for n in split.nodes if n.target == "aten.index_put_.default"]
    assert len(gathered) == 3 * 4 and len(scattered) == 3 * 3
    assert_split_like_eager(g, split, model, x)


def _scatter_node(accumulate, index_shapes):
    refs = [ValueRef(1 + i) for i in range(len(index_shapes))]
    return Node(0, "s", "aten.index_put.default",
                (ValueRef(0), refs, ValueRef(9), accumulate), {}, (0, *range(1, 1 + len(refs)), 9),
                (10,), (), Phase.BACKWARD, "")


def test_a_gather_splits_its_rows_with_its_1d_index():
    from fitgraph.graph.dim_rules_index import index_gather

    n = Node(0, "i", "aten.index.Tensor", (ValueRef(0), [ValueRef(1)]), {}, (0, 1), (2,), (),
             Phase.FORWARD, "")
    assert [(s.operands, s.outputs) for s in index_gather(n, [(5, 3), (12,)], [(12, 3)])] == [
        ((None, Along(0)), (Along(0),))]
    assert index_gather(n, [(5, 3), (4, 3)], [(4, 3, 3)]) == []


def test_the_rule_splits_rows_only_when_they_accumulate_from_1d_indices():
    rows = (Along(0), Along(0), Along(0))
    accumulating = index_scatter(_scatter_node(True, [(12,)]), [(5, 3), (12,), (12, 3)],
                                 [(5, 3)])
    assert [(s.operands, s.outputs) for s in accumulating] == [
        ((None, Along(0), Along(0)), (Reduced(),))]
    # NOTE: overwriting rows: a later part's row would not replace an earlier part's
    assert index_scatter(_scatter_node(False, [(12,)]), [(5, 3), (12,), (12, 3)], [(5, 3)]) == []
    # NOTE: 2-D index tensors scatter a grid of rows: not offered
    two_d = index_scatter(_scatter_node(True, [(4, 3)]), [(5, 3), (4, 3), (4, 3, 3)], [(5, 3)])
    assert all(s.operands[:2] != rows[:2] for s in two_d)


def test_a_scatter_whose_result_is_read_in_the_region_is_refused():
    """Its parts' results are running sums, not partial ones: a reader in the region would
    add the base once per part."""
    from fitgraph.graph.ir import GraphBuilder, Role

    b = GraphBuilder()
    table = b.add_input("table", (5, 3), "float32", Role.PARAMETER)
    idx = b.add_input("idx", (12,), "int64", Role.INPUT)
    rows = b.add_input("rows", (12, 3), "float32", Role.INPUT)
    h = b.add_node("aten.relu.default", [rows], [((12, 3), "float32")], name="h")[0]
    out = b.add_node("aten.index_put.default", [table, idx, h], [((5, 3), "float32")],
                     args=(ValueRef(table), [ValueRef(idx)], ValueRef(h), True), name="put")[0]
    both = b.add_node("aten.add.Tensor", [out, out], [((5, 3), "float32")], name="twice")[0]
    g = b.finish({"loss": both})
    r = grow_region(g, rows, 0)
    assert "twice" in {g.nodes[n].name for n in r.nodes}   # NOTE: a sum of partial sums
    with pytest.raises(FissionError, match="read inside the region"):
        split_region(g, r, 2)


def test_the_split_step_peaks_where_the_simulator_says():
    """Law 2 for the threaded scatter (``index_put_`` into the first part's result) and the
    zeros every part makes: simulated peak = measured peak."""
    import copy

    from fitgraph.cost import ProfiledCostModel
    from fitgraph.measure import measure_plan
    from fitgraph.sim.simulate import simulate

    model, x, g = _captured()
    split = split_region(g, _along_query_rows(g), 4)
    cm = ProfiledCostModel("cpu", progress=False)
    cm.profile(split)
    plan = fitgraph.eager_plan(split)
    measured = measure_plan(split, plan, copy.deepcopy(model), x, repeats=0)
    assert measured.peak_bytes == simulate(split, plan, cm).peak_bytes
