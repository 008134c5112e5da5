"""The bytes later regions hold, charged at the boundary node of whichever graph a solver
plans: a rewriting solver (``split_backward``) plans graphs of its own, renumbered."""

from __future__ import annotations

import torch
from test_group_norm_stats import AudioFront

import fitgraph
from fitgraph.compile_backend.boundary_hold import HoldCostModel, StepShares, boundary_node
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.transform.group_norm_stats import group_norms_from_stats


def test_the_hold_is_charged_at_the_boundary_of_each_graph_asked():
    torch.manual_seed(0)
    g = fitgraph.capture(AudioFront(), torch.randn(2, 400), lambda m, x: m(x).square().mean())
    rewritten = group_norms_from_stats(g)
    base, hold = RooflineCostModel(get_device("cpu-generic")), 10_000
    cm = HoldCostModel(base, hold)
    for graph in (g, rewritten, g):
        at = boundary_node(graph)
        extra = [cm.node_cost(graph, n).workspace_bytes - base.node_cost(graph, n).workspace_bytes
                 for n in graph.nodes]
        assert extra[at] == hold and sum(extra) == hold
    # NOTE: the captured graph's boundary id names another node in the rewritten one
    assert rewritten.nodes[boundary_node(g)].name != g.nodes[boundary_node(g)].name


def test_a_share_reads_what_the_graphs_before_save_as_planned_again():
    """wav2vec2 at Hugging Face checkpointing's peak: its feature encoder, first planned at the
    whole budget, saved 15.5 MiB; planned again under its transformer's hold, far less. The
    transformer's share must read the bytes saved as planned again (it was left 5.5 MiB and
    the step ran over), a graph that ran twice gets its least, and a step that makes its
    gradients lets each graph count its own in its peak."""
    shares = StepShares(room=1000, runs=["enc", "blk", "blk", "head"],
                        first_saved={"enc": 600, "blk": 100, "head": 0})
    assert shares.share("blk", 50, 20, {}) == 1000 + 50 - 700          # second run: least
    assert shares.share("blk", 50, 20, {"enc": 200}) == 1000 + 50 - 300
    assert shares.share("head", 5, 1, {"enc": 200, "blk": 40}) == 1000 + 5 - 200 - 80
    assert shares.share("other", 5, 1, {}) is None
    made = StepShares(room=1000, runs=["enc"], first_saved={"enc": 600}, own_grads=True)
    assert made.share("enc", 50, 20, {}) == 1070
    assert StepShares(room=-10, runs=["enc"], first_saved={}).share("enc", 5, 0, {}) == 0
