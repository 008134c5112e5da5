"""A region adds partial sums as partial sums: one accumulator for their sum, not one each.

A tensor read by several ops gets the sum of their gradients. Split along a dim those ops
reduce over (attention's heads, read by its query, key and value projections), each gradient
is a partial sum; their sum is one too, so the parts add theirs and one whole tensor
accumulates it.
"""

from __future__ import annotations

import torch
from helpers import assert_split_like_eager
from torch import nn

import fitgraph
from fitgraph.graph.dim_region import grow_region
from fitgraph.graph.dim_types import Reduced
from fitgraph.graph.ir import Phase
from fitgraph.transform.fission import split_region


class ThreeReaders(nn.Module):
    """One input read by three projections whose outputs are combined per column block (as
    attention's heads combine its queries, keys and values)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.pre = nn.Linear(width, width)
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.pre(x)
        return (self.q(h) * self.k(h)).tanh() * self.v(h)


def _split_along_columns(g):
    """The region grown from the query projection's output along its columns (the heads)."""
    q = [n for n in g.nodes if n.phase is Phase.FORWARD and n.target == "aten.mm.default"][0]
    return grow_region(g, q.outputs[0], 1)


def test_the_input_gradient_is_summed_in_parts_into_one_whole_tensor():
    torch.manual_seed(0)
    model, x = ThreeReaders(), torch.randn(64, 32)
    g = fitgraph.capture(model, x, lambda m, b: m(b).square().mean())
    r = _split_along_columns(g)
    summed = [n for n in r.nodes if g.nodes[n].target == "aten.add.Tensor"
              and isinstance(r.dims[g.nodes[n].outputs[0]], Reduced)]
    assert len(summed) == 2            # NOTE: (dq + dk) + dv, both in the region
    split = split_region(g, r, 4)
    # NOTE: the three products are never whole: one accumulator, made from the first part
    accumulators = [n for n in split.nodes if n.target == "aten.add_.Tensor"
                    and n.name.startswith(g.nodes[summed[-1]].name)]
    assert len(accumulators) == 3      # NOTE: parts 1..3 add into part 0's sum
    grads = {g.values[o].name for n in summed for o in g.nodes[n].inputs}
    assert not any(n.name.split(".")[0] in grads and ".acc" in n.name for n in split.nodes)
    assert_split_like_eager(g, split, model, x)


class ResidualReaders(ThreeReaders):
    """ThreeReaders combined back to the width by an output projection, plus the residual:
    the input's gradient also gets the residual's, which the region reads whole."""

    def __init__(self, width: int = 32):
        super().__init__(width)
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, x):
        h = self.pre(x)
        return self.o((self.q(h) * self.k(h)).tanh() * self.v(h)) + h


def test_the_first_part_adds_a_whole_gradient_to_its_partial_sum():
    torch.manual_seed(0)
    model, x = ResidualReaders(), torch.randn(64, 32)
    g = fitgraph.capture(model, x, lambda m, b: m(b).square().mean())
    # NOTE: from the output projection's input gradient, along its columns
    d_out = next(n for n in g.nodes if n.phase is Phase.BACKWARD
                 and n.target == "aten.mm.default" and g.values[n.outputs[0]].shape == x.shape)
    r = grow_region(g, d_out.outputs[0], 1)
    summed = [n for n in r.nodes if g.nodes[n].target == "aten.add.Tensor"
              and isinstance(r.dims[g.nodes[n].outputs[0]], Reduced)]
    whole = [n for n in summed if any(v not in r.dims or r.dims[v] is None
                                      for v in g.nodes[n].inputs)]
    assert len(summed) == 3 and len(whole) == 1   # NOTE: residual + dq + dk + dv
    split = split_region(g, r, 4)
    adds = [n.name for n in split.nodes if n.name.startswith(g.nodes[whole[0]].name + ".part")]
    assert adds == [g.nodes[whole[0]].name + ".part0"]   # NOTE: the first part alone adds it
    assert_split_like_eager(g, split, model, x)


class PartialPlusWhole(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.pre = nn.Linear(width, width)
        self.a = nn.Linear(width, width, bias=False)

    def forward(self, x):
        h = self.pre(x)
        return (self.a(h).tanh() + h).square()


def test_a_partial_sum_added_to_a_tensor_made_in_parts_leaves_the_region_first():
    # NOTE: the residual's gradient runs in column parts: each part's sum would hold its own
    # columns of it, and the partial sums their every column
    torch.manual_seed(0)
    model, x = PartialPlusWhole(), torch.randn(64, 32)
    g = fitgraph.capture(model, x, lambda m, b: m(b).mean())
    r = _split_along_columns(g)
    for n in r.nodes:
        node = g.nodes[n]
        if node.target == "aten.add.Tensor" and node.phase is Phase.BACKWARD:
            assert not all(isinstance(r.dims.get(v), Reduced) for v in node.inputs)
    assert_split_like_eager(g, split_region(g, r, 4), model, x)
