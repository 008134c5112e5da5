"""A weight gradient run in parts accumulates into the gradient so far, not beside it.

A layer applied at several depths (ALBERT's one shared layer) sums one weight-gradient
contribution per use: ``s = add(p, acc)``. A region that runs a use's backward in parts
accumulated the parts' products in a whole accumulator ``acc`` that lived beside ``p`` through
the region (three of ALBERT's, 0.75 MiB, at its smallest peak); ``transform.sums_in_place``
accumulates into ``p`` itself.

And a product whose partial sums leave the region through views (attention's ``dV``, viewed
back to ``[B, H, T, d]``) accumulates in place from part to part (``fission._direct_sums``), in
place of a whole-size product per part added to the first's."""

from __future__ import annotations

import copy

import torch
from helpers import assert_split_like_eager
from torch import nn

import fitgraph
from fitgraph.graph.dim_region import grow_region
from fitgraph.graph.ir import GraphBuilder, Phase, Role, ValueRef
from fitgraph.transform.fission import split_region
from fitgraph.transform.sums_in_place import sums_in_place


class Shared(nn.Module):
    """One MLP applied ``depth`` times, as ALBERT shares its layer."""

    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        self.up, self.down, self.depth = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), depth

    def forward(self, x):
        for _ in range(self.depth):
            x = x + self.down(torch.relu(self.up(x)))
        return x


def _split_middle_use():
    """The shared model captured, and the backward of its middle use split along the tokens:
    that use's weight-gradient products run in parts, and are added to the last use's
    (the backward's first), made whole before."""
    torch.manual_seed(0)
    model, x = Shared(), torch.randn(2, 32, 16)
    g = fitgraph.capture(model, x, lambda m, b: m(b).square().mean())
    relu_bw = [n.id for n in g.nodes if n.target == "aten.threshold_backward.default"]
    outside = {n.id: "another use's" for n in g.nodes
               if n.phase is not Phase.BACKWARD or not relu_bw[0] + 8 < n.id < relu_bw[2]}
    r = grow_region(g, g.nodes[relu_bw[1]].outputs[0], 1, exclude=outside)
    return model, x, g, split_region(g, r, 4)


def _weight_sized(g, shape):
    return [v for v in g.values if v.shape == shape and v.producer is not None
            and g.nodes[v.producer].phase is Phase.BACKWARD]


def test_the_parts_accumulate_into_the_running_sum_and_match_eager():
    model, x, g, split = _split_middle_use()
    # NOTE: a chain folded: its first part's product accumulates into the running sum, made
    # by the last use's whole product
    into = [n for n in split.nodes if n.target == "aten.addmm_.default"
            and n.name.endswith(".part0")]
    assert into and all(split.nodes[split.values[n.args[0].id].producer].name in ("mm_1", "mm_3")
                        for n in into), [(n.name, n.args[0]) for n in into]
    # NOTE: fewer weight-sized backward storages than without the fold
    unfolded = _unfolded_split()
    shape = tuple(model.up.weight.shape)
    assert len({v.storage for v in _weight_sized(split, shape)}) < \
        len({v.storage for v in _weight_sized(unfolded, shape)})
    assert_split_like_eager(g, split, model, x)


def _unfolded_split():
    import fitgraph.transform.fission as fission

    saved = fission.sums_in_place
    fission.sums_in_place = lambda graph, verify=True: graph
    try:
        return _split_middle_use()[3]
    finally:
        fission.sums_in_place = saved


def test_the_folded_split_peaks_where_the_simulator_says_and_lower():
    """Law 2 for a chain written into the running sum; and the accumulator is gone from the
    peak."""
    model, x, _, split = _split_middle_use()
    _assert_measured_as_simulated_and_lower(model, x, split, _unfolded_split())


def _split_first_use_after(split):
    """``split`` with the first use's backward (the backward's last) split along the tokens
    too: ``split_backward`` splits one block at a time, each folded as it is made."""
    relu_bw = [n.id for n in split.nodes if n.target == "aten.threshold_backward.default"]
    first = relu_bw[-1]
    outside = {n.id: "another use's" for n in split.nodes
               if n.phase is not Phase.BACKWARD or n.id < first - 1}
    r = grow_region(split, split.nodes[first].outputs[0], 1, exclude=outside)
    return split_region(split, r, 4)


def test_a_later_split_accumulates_into_a_running_sum_an_earlier_fold_wrote():
    model, x, g, split = _split_middle_use()
    again = _split_first_use_after(split)
    into = {n.name: again.values[n.args[0].id].name for n in again.nodes
            if n.target == "aten.addmm_.default" and n.name.endswith(".part0")}
    # NOTE: the first use's up-projection gradient (mm_10) adds into the middle use's folded
    # chain (its last in-place part), not into an accumulator of its own
    assert into.get("mm_10.part0", "").startswith("mm_7."), into
    # NOTE: and the add of the two running sums is gone
    adds = {n.name for n in split.nodes if n.target == "aten.add.Tensor"}
    assert "add_12" in adds and "add_12" not in {n.name for n in again.nodes}
    assert_split_like_eager(g, again, model, x)
    _assert_measured_as_simulated_and_lower(model, x, again, again)


def _chain_graph(base_readers: int = 1, base_first: bool = True, view_first: bool = False):
    b = GraphBuilder()
    x, y, p0 = (b.add_input(n, (4, 4), "float32", Role.INPUT) for n in ("x", "y", "p0"))
    bw = dict(phase=Phase.BACKWARD)

    def base():
        return b.add_node("aten.mul.Tensor", [p0, p0], [((4, 4), "float32")], name="p", **bw)[0]

    p = base() if base_first else None
    acc = b.add_node("aten.mm.default", [x, y], [((4, 4), "float32")], name="acc", **bw)[0]
    # NOTE: fission views a product's first part as it leaves, before the later parts add
    seen = b.add_node("aten.view.default", [acc], [((4, 4), "float32")], alias_of={0: acc},
                      name="seen", args=(ValueRef(acc), [4, 4]), **bw)[0] if view_first else None
    acc1 = b.add_node("aten.addmm_.default", [acc, y, x], [((4, 4), "float32")],
                      mutates=(acc,), alias_of={0: acc}, name="acc1", **bw)[0]
    acc1 = seen if view_first else acc1
    p = base() if p is None else p
    outs = {}
    for i in range(base_readers - 1):
        outs[f"other{i}"] = b.add_node("aten.neg.default", [p], [((4, 4), "float32")],
                                       name=f"other{i}", **bw)[0]
    s = b.add_node("aten.add.Tensor", [p, acc1], [((4, 4), "float32")], name="s", **bw)[0]
    return b.finish({"loss": s, **outs})


def test_only_a_running_sum_made_before_the_chain_and_read_by_the_add_alone_is_folded():
    assert [n.target for n in sums_in_place(_chain_graph()).nodes] == [
        "aten.mul.Tensor", "aten.addmm_.default", "aten.addmm_.default"]
    assert [n.target for n in sums_in_place(_chain_graph(view_first=True)).nodes] == [
        "aten.mul.Tensor", "aten.addmm_.default", "aten.view.default", "aten.addmm_.default"]
    for g in (_chain_graph(base_readers=2), _chain_graph(base_first=False)):
        assert sums_in_place(g) is g


# -- products whose partial sums leave through views ---------------------------------------


def _attention_split(direct: bool = True):
    """One attention block with a relative position bias (as BEiT's) split along the query
    rows of its backward: ``dV = P^T dO`` and ``dK`` sum over the parts, then are viewed back
    to ``[B, H, T, d]`` before they leave."""
    from test_scatter_rows_in_parts import _along_query_rows, _captured

    import fitgraph.transform.fission as fission

    model, x, g = _captured(layers=1)
    saved = fission._Splitter._direct_sums
    if not direct:
        def none(self, readers):
            self.direct_roots, self.direct_views, self.direct_leaving = set(), set(), set()
        fission._Splitter._direct_sums = none
    try:
        return model, x, g, split_region(g, _along_query_rows(g), 4)
    finally:
        fission._Splitter._direct_sums = saved


def test_products_viewed_before_they_leave_accumulate_in_place_and_match_eager():
    model, x, g, split = _attention_split()
    batched = [n for n in split.nodes if n.target == "aten.baddbmm_.default"]
    assert len(batched) == 2 * 3   # NOTE: dV and dK, parts 1-3 add into part 0's product
    # NOTE: no part's whole-size product is made and then added to the accumulator
    unsplit = _attention_split(direct=False)[3]

    def adds(graph):
        return [n for n in graph.nodes if n.target == "aten.add_.Tensor"]
    assert len(adds(split)) == len(adds(unsplit)) - 2 * 3
    assert_split_like_eager(g, split, model, x)


def test_the_in_place_products_peak_where_the_simulator_says_and_lower():
    model, x, _, split = _attention_split()
    _assert_measured_as_simulated_and_lower(model, x, split, _attention_split(direct=False)[3])


def _assert_measured_as_simulated_and_lower(model, x, graph, before):
    """Law 2 for ``graph`` and ``before`` (each one eager-order step measured against the
    simulator); ``graph`` peaks no higher."""
    from fitgraph.cost import ProfiledCostModel
    from fitgraph.measure import measure_plan
    from fitgraph.sim.simulate import simulate

    cm = ProfiledCostModel("cpu", progress=False)
    peaks = []
    for g in (graph, before):
        cm.profile(g)
        plan = fitgraph.eager_plan(g)
        measured = measure_plan(g, plan, copy.deepcopy(model), x, repeats=0)
        assert measured.peak_bytes == simulate(g, plan, cm).peak_bytes
        peaks.append(measured.peak_bytes)
    assert peaks[0] <= peaks[1]
