"""Attention re-made in the backward along its heads, as ALBERT needs it.

ALBERT's shared layer has 4 heads: along the heads a region has 4 parts, half ``PARTS``. Its
forward start was the query seen in heads (a transpose of its projection, the first made of
the region's equal-sized tensors), and its candidates were ranked after every region cut in
``PARTS``, so no round screened them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import assert_split_like_eager
from torch import nn

import fitgraph
from fitgraph.graph.dim_region import grow_region
from fitgraph.graph.ir import Phase
from fitgraph.solvers.fission import backward_regions as br
from fitgraph.solvers.fission.backward_regions import PARTS, _forward_start, copies_recipe

BATCH, TOKENS, HEADS, DIM = 2, 32, 4, 8


class Attention(nn.Module):
    """Multi-head attention as ALBERT writes it: separate projections, the query, key and
    value seen in heads by ``view`` + ``transpose``, ``scaled_dot_product_attention``."""

    def __init__(self, width: int = HEADS * DIM):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape

        def heads(p):
            return p(x).view(b, t, HEADS, DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads(self.q), heads(self.k), heads(self.v))
        return self.o(out.transpose(1, 2).reshape(b, t, c)) + x


def _graph():
    torch.manual_seed(0)
    model = nn.Sequential(Attention(), Attention())
    x = torch.randn(BATCH, TOKENS, HEADS * DIM)
    return model, x, fitgraph.capture(model, x, lambda m, b: m(b).square().mean())


def _attention(g, phase):
    return [n for n in g.nodes if n.phase is phase and "scaled_dot_product" in n.target]


def test_a_region_along_the_heads_re_makes_from_the_attention_not_a_view_of_the_query():
    model, x, g = _graph()
    forward, backward = _attention(g, Phase.FORWARD)[-1], _attention(g, Phase.BACKWARD)[0]
    region = grow_region(g, backward.outputs[0], 1)
    out = forward.outputs[0]
    assert region.dims.get(out) == 1 and region.length == HEADS
    # NOTE: the query in heads is as large and made first, a view of its projection
    query = forward.inputs[0]
    assert region.dims.get(query) == 1 and query < out
    assert g.values[query].storage != g.values[out].storage
    assert _forward_start(g, region) == (out, 1)
    split = copies_recipe(g.values[out].name, 1, 0.0)(g, PARTS, float("inf"))
    re_made = [n for n in _attention(split, Phase.BACKWARD) if ".re" in n.name]
    assert len(re_made) == 2 * HEADS   # NOTE: both blocks, a head at a time
    assert_split_like_eager(g, split, model, x)


class _Sim:
    peak_live: frozenset = frozenset()
    peak_instruction = -1
    breakdown: dict = {}


class _Best:
    plan: list = []
    sim = _Sim()


def test_a_region_in_half_the_parts_is_ranked_by_what_it_takes_off(monkeypatch):
    # NOTE: two stubbed regions: the heads' (4 parts, 1,000 bytes held) before a smaller
    # one in PARTS (400 held); only a region in fewer than half PARTS (halves along the
    # batch) is ranked after every other
    model, x, g = _graph()
    backward = _attention(g, Phase.BACKWARD)[0]
    heads = grow_region(g, backward.outputs[0], 1)
    rows = grow_region(g, backward.outputs[0], 2)
    batch = grow_region(g, backward.outputs[0], 0)
    assert (heads.length, rows.length, batch.length) == (HEADS, TOKENS, BATCH)
    held = {id(heads): 1000, id(rows): 400, id(batch): 4000}
    monkeypatch.setattr(br, "peak_starts", lambda *a, **k: [])
    monkeypatch.setattr(br, "shared_regions",
                        lambda *a, **k: [(heads, 0.0), (rows, 0.0), (batch, 0.0)])
    monkeypatch.setattr(br, "_held", lambda graph, r, sim, node=None: held[id(r)])
    monkeypatch.setattr(br, "trimmed", lambda graph, r, share: r)
    dims = [start[1] for _, kind, start, _ in br.candidates(g, _Best()) if kind == br.PLAIN]
    assert list(dict.fromkeys(dims)) == [1, 2, 0]
