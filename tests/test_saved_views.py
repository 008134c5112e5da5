"""Views saved for the backward copied out of the tensor they view (``copy_saved_views``): bitwise
eager's results, a lower peak (simulated = measured), and no copy where it cannot help or
would change a layout."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fitgraph
from fitgraph.cost import ProfiledCostModel
from fitgraph.execute import Executor
from fitgraph.measure import measure_plan
from fitgraph.sim.simulate import simulate
from fitgraph.transform.saved_views import SUFFIX, copy_saved_views
from fitgraph.transform.view_chains import collapse_view_chains

D = 32


def _encoder():
    torch.manual_seed(0)
    # NOTE: with dropout, attention runs as scores, softmax, dropout, then values (the sweep's)
    layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.1)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _loss(m, x):
    return m(x).square().mean()


def _step(graph, model, x):
    m = copy.deepcopy(model)
    torch.manual_seed(0)
    loss = Executor(graph, fitgraph.eager_plan(graph), m)(x)
    return loss, [p.grad for p in m.parameters()]


def test_multihead_attention_saves_its_values_not_the_packed_projection():
    model, x = _encoder(), torch.randn(128, 4, D)
    g = fitgraph.capture(copy.deepcopy(model), x, _loss)
    g2 = copy_saved_views(g)
    clones = [n for n in g2.nodes if n.name.endswith(SUFFIX)]
    assert len(clones) == 2   # NOTE: each layer's values, a third of its packed q, k, v
    for n in clones:
        out, src = g2.values[n.outputs[0]], g2.values[n.inputs[0]]
        assert out.stride == src.stride and 3 * out.nbytes == g2.storages[src.storage].nbytes
        # NOTE: the clone's views sit in it (they were cut 2/3 into the packed tensor)
        for v in g2.values:
            if v.storage == out.storage:
                end = sum((n - 1) * st for n, st in zip(v.shape, v.stride)) + 1
                assert 0 <= v.storage_offset and (v.storage_offset + end) * 4 <= out.nbytes
    want, want_grads = _step(g, model, x)
    got, got_grads = _step(g2, model, x)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    cm.profile(g2)
    cm.profile(collapse_view_chains(g2))   # NOTE: as_strided views: offsets in the clone
    before = simulate(g, fitgraph.eager_plan(g), cm)
    after = simulate(g2, fitgraph.eager_plan(g2), cm)
    assert after.peak_bytes < before.peak_bytes
    measured = measure_plan(g2, fitgraph.eager_plan(g2), copy.deepcopy(model), x, repeats=0)
    assert measured.peak_bytes == after.peak_bytes


def test_views_holding_more_than_half_their_tensor_are_left():
    m, x = nn.Linear(D, 3 * D), torch.randn(4, D)
    g = fitgraph.capture(m, x, lambda mm, b: (mm(b).unflatten(-1, (3, D)).movedim(-2, 0)
                                               .contiguous()[:2].exp()).sum())
    assert copy_saved_views(g) is g   # NOTE: q and k read by exp's backward: two thirds


def test_a_view_that_is_not_dense_is_left():
    m, x = nn.Linear(D, 3 * D), torch.randn(4, D)

    def loss_fn(mm, b):   # NOTE: a column block of the projection: a clone would be contiguous
        q, k, v = mm(b).chunk(3, dim=-1)
        return ((q + k).softmax(-1) * v).sum()
    g = fitgraph.capture(m, x, loss_fn)
    assert copy_saved_views(g) is g


def test_a_tensor_written_in_place_is_left():
    m, x = nn.Linear(D, 3 * D), torch.randn(4, D)

    def loss_fn(mm, b):
        qkv = mm(b).unflatten(-1, (3, D)).movedim(-2, 0).contiguous()
        qkv.mul_(2.0)
        q, k, v = qkv
        return ((q + k).softmax(-1) * v).sum()
    g = fitgraph.capture(m, x, loss_fn)
    assert copy_saved_views(g) is g
