"""Regions grown on the zoo graphs (``graph.dim_region``): what a batch, tokens, query-rows or
spatial region holds, where it stops and why, and that every region is convex, agrees with
its nodes' splits and cuts each value in whole units."""

from __future__ import annotations

from fitgraph.graph.dim_convex import convexity_cut, order_edges
from fitgraph.graph.dim_region import RegionIndex, grow_region, regions
from fitgraph.graph.dims import (
    Along,
    Reduced,
    boundary_reason,
    node_splits,
    operands,
    split_dims,
    value_entries,
)
from fitgraph.graph.ir import Role


def _batch_input(graph, i: int = 0) -> int:
    return graph.inputs[graph.input_names.index(f"batch:{i}")]


def _first(graph, target: str):
    return next(n for n in graph.nodes if n.target == target)


def _assert_sound(graph, r, edges=None):
    """Convex, each node's split agrees with the region's dims, units match the length."""
    assert convexity_cut(set(r.nodes), r.anchor, *(edges or order_edges(graph))) == {}
    for nid, split in r.splits.items():
        for vid, e in value_entries(graph.nodes[nid], split).items():
            want = e.dim if isinstance(e, Along) else e
            assert r.dims[vid] == want, (graph.nodes[nid].name, vid, e, r.dims[vid])
    for vid, u in r.units.items():
        if r.length:
            outer = r.outers.get(vid, 1)
            assert graph.values[vid].shape[r.dims[vid]] == r.length * u * outer, (vid, u, r.length)


def test_batch_region_of_gpt2_is_its_forward_and_loss(zoo_graphs):
    _, g = zoo_graphs["gpt2"]
    r = grow_region(g, _batch_input(g), 0)
    _assert_sound(g, r)
    assert r.length == 2 and not r.halo
    batch_dep = set(_batch_input(g, i) for i in range(2))
    for n in g.nodes:
        if any(v in batch_dep for v in n.inputs) or n.id in r.splits:
            batch_dep.update(o for o in n.outputs if o is not None)
        if n.phase.value in ("forward", "loss") and n.id not in r.splits:
            # NOTE: left out only: random/shape-only/constant ops and batch-independent ones
            assert boundary_reason(g, n) or not any(v in batch_dep for v in n.inputs), n.name
    nll = _first(g, "aten.nll_loss_forward.default")
    assert r.dims[nll.outputs[0]] == Reduced("weighted_mean", weight=1)
    assert r.dims[nll.outputs[1]] == Reduced("sum")
    assert "partial result" in r.boundary[_first(g, "aten.nll_loss_backward.default").id]


def test_backward_region_of_gpt2_reduces_weight_gradients(zoo_graphs):
    _, g = zoo_graphs["gpt2"]
    start = _first(g, "aten.nll_loss_backward.default")
    r = grow_region(g, start.outputs[0], 0)
    _assert_sound(g, r)
    assert r.length == 2
    phases = {g.nodes[n].phase.value for n in r.nodes}
    assert "backward" in phases
    # NOTE: the token embedding's gradient (wte); wpe's reads a sum over the batch: a partial
    embs = [n.outputs[0] for n in g.nodes if n.target == "aten.embedding_dense_backward.default"
            and n.outputs[0] in r.dims]
    assert [r.dims[v] for v in embs] == [Reduced("sum")]
    grads = [v for k, v in g.outputs.items() if k.startswith("grad:") and v in r.dims]
    assert grads and all(isinstance(r.dims[v], Reduced) for v in grads)


def test_query_rows_of_attention_read_keys_whole(zoo_graphs):
    _, g = zoo_graphs["bert-base"]
    soft = _first(g, "aten._safe_softmax.default")
    r = grow_region(g, soft.outputs[0], 2)
    _assert_sound(g, r)
    scores = g.values[soft.inputs[0]].producer
    while g.nodes[scores].target != "aten.bmm.default":   # through the mask add and views
        scores = g.values[g.nodes[scores].inputs[0]].producer
    q, k = operands(g.nodes[scores])
    assert scores in r.splits and r.dims[q] == 1 and r.dims[k] is None
    strict = grow_region(g, soft.outputs[0], 2, whole="weights")
    # NOTE: the softmax itself stays (a cut once removed the start's side); the mask add
    # before the scores now stops it: it would read the batch-dependent scores whole
    assert soft.id in strict.splits and scores not in strict.splits
    assert any("no split" in why for why in strict.boundary.values())


def test_batch_norm_in_training_stops_a_batch_region(zoo_graphs):
    _, g = zoo_graphs["resnet50"]
    r = grow_region(g, _batch_input(g), 0)
    _assert_sound(g, r)
    bn = _first(g, "aten.native_batch_norm.default")
    assert bn.id in r.boundary and bn.id not in r.splits
    splits = node_splits(g, bn)
    assert [s.operands[0].dim for s in splits] == [1]
    assert "batch statistics" in splits[0].note


def test_spatial_region_of_resnet_has_a_halo(zoo_graphs):
    _, g = zoo_graphs["resnet50"]
    relu = _first(g, "aten.relu.default")
    r = grow_region(g, relu.outputs[0], 2)
    _assert_sound(g, r)
    assert r.halo
    assert {g.nodes[n].target for n in r.nodes} >= {"aten.convolution.default",
                                                    "aten.max_pool2d_with_indices.default"}


def test_regions_are_sound_and_deterministic_on_the_zoo(zoo_graphs):
    for name, (_, g) in zoo_graphs.items():
        starts = [(v, d) for v in g.inputs if g.values[v].role == Role.INPUT
                  for d in range(len(g.values[v].shape))]
        for n in g.nodes[len(g.nodes) // 8:: len(g.nodes) // 4]:
            v = next((o for o in n.outputs if o is not None), None)
            if v is not None:
                starts += [(v, d) for d in range(len(g.values[v].shape))]
        index = RegionIndex(g)
        edges = (index.succ, index.pred)
        for i, (vid, dim) in enumerate(starts):
            r = grow_region(g, vid, dim, index=index)
            _assert_sound(g, r, edges)
            if i % 4 == 0:  # NOTE: a fresh index: the shared cache changes nothing
                again = grow_region(g, vid, dim)
                assert (again.nodes, again.dims, again.boundary) == (r.nodes, r.dims,
                                                                     r.boundary), name
        found = regions(g, starts, index=index)
        assert all(r.nodes for r in found)


def test_split_dims_of_a_linear_layer(zoo_graphs):
    _, g = zoo_graphs["gpt2"]
    mm = next(n for n in g.nodes if n.target == "aten.mm.default" and n.phase.value == "backward"
              and len(g.values[n.outputs[0]].shape) == 2
              and g.values[operands(n)[1]].producer is not None)
    a, b = operands(mm)
    # NOTE: a [M, K] @ b [K, N]: cutting K (the tokens of a weight gradient) sums partials
    table = split_dims(g, mm.id, a, 1)
    assert table == {a: Along(1), b: Along(0), mm.outputs[0]: Reduced()}
    assert split_dims(g, mm.id, a, 0)[b] is None
    dropout = _first(g, "aten.bernoulli_.float")
    assert node_splits(g, dropout) == [] and "random" in boundary_reason(g, dropout)


def test_a_region_through_a_grouped_convolution_cuts_whole_groups():
    """Grown along the channels from a ReLU (a unit: one channel) into a convolution in 2
    groups of 16 channels, the region's unit grows to a group: RegNet's was cut in 8 parts
    of 4 channels, and each part's convolution had 0 groups (a profiler error, not a plan)."""
    import torch
    from test_fission import assert_same_as_eager

    import fitgraph
    from fitgraph.graph.ir import Phase
    from fitgraph.transform.fission import split_region

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1, groups=2),
                                torch.nn.ReLU())
    batch = torch.randn(2, 4, 8, 8)
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    g = fitgraph.capture(model, batch, loss_fn)
    relu = next(n for n in g.nodes if n.phase is Phase.FORWARD and "relu" in n.target)
    r = grow_region(g, relu.outputs[0], 1)
    conv = next(n.id for n in g.nodes if n.phase is Phase.FORWARD and n.name == "convolution_1")
    assert conv in r.nodes and r.length == 2
    _assert_sound(g, r)
    assert_same_as_eager(model, batch, loss_fn, split_region(g, r, r.length, verify=True))
    # NOTE: a region that must keep every channel a unit stops at the convolution
    fine = grow_region(g, relu.outputs[0], 1, keep_length=True)
    assert conv not in fine.nodes and fine.length == 32
