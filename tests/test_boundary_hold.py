"""The bytes later regions hold, charged at the boundary node of whichever graph a solver
plans: a rewriting solver (``split_backward``) plans graphs of its own, renumbered."""

from __future__ import annotations

import torch
from test_group_norm_stats import AudioFront

import fitgraph
from fitgraph.compile_backend.boundary_hold import HoldCostModel, boundary_node
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
