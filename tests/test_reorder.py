"""Reordering: any order respecting graph.deps computes bitwise the same step."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_bitwise_equal_models, eager_step
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_plan_sim import random_graphs

import fitgraph
from fitgraph import zoo
from fitgraph.cost import ProfiledCostModel
from fitgraph.execute import execute
from fitgraph.graph.analysis import GraphError
from fitgraph.graph.deps import dependencies, respects_dependencies
from fitgraph.measure import measure_plan
from fitgraph.plan.eager import plan_in_order
from fitgraph.plan.reorder import STRATEGIES, memory_aware_order
from fitgraph.plan.verify import verify_plan
from fitgraph.sim import simulate


@settings(max_examples=80, deadline=None)
@given(random_graphs(), st.sampled_from(STRATEGIES))
def test_orders_respect_dependencies_and_verify(case, strategy):
    g, cost = case
    order = memory_aware_order(g, strategy)
    respects_dependencies(g, order)
    verify_plan(g, plan_in_order(g, order))


def test_dependencies_order_inplace_writes_and_random_ops():
    case = zoo.build("resnet50", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn,
                         torch.optim.SGD(case.model.parameters(), lr=0.1, momentum=0.9))
    deps = dependencies(g)
    # every optimizer update waits for every earlier reader of its weight
    for n in g.nodes:
        if n.phase.value == "optimizer":
            st = g.values[n.mutates[0]].storage
            readers = {m.id for m in g.nodes[:n.id] if any(g.values[v].storage == st
                                                           for v in m.inputs)}
            assert readers <= deps[n.id]
    case = zoo.build("gpt2", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    deps = dependencies(g)
    rnd = [n.id for n in g.nodes if n.random]
    assert all(a in deps[b] for a, b in zip(rnd, rnd[1:]))
    with pytest.raises(GraphError, match="depends on"):
        order = list(range(len(g.nodes)))
        i, j = rnd[0], rnd[1]
        order[i], order[j] = order[j], order[i]
        respects_dependencies(g, order, deps)


# NOTE: Llama (~20 s) in ``make test-slow``; ResNet's branches by default
@pytest.mark.parametrize("name,strategy", [pytest.param("llama", "strict", marks=pytest.mark.slow),
                                           ("resnet50", "strict")])
def test_reordered_step_is_bitwise_eager_and_simulated_exactly(name, strategy):
    case = zoo.build(name, "small")
    a, b = case.model, copy.deepcopy(case.model)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3)
    for step in range(2):
        la = eager_step(a, case.batch, case.loss_fn, oa, seed=step)
        g = fitgraph.capture(b, case.batch, case.loss_fn, ob)
        order = memory_aware_order(g, strategy)
        assert order != sorted(order), "the strategy changes the order"
        plan = plan_in_order(g, order)
        torch.manual_seed(step)
        lb = execute(g, plan, b, case.batch, ob)
        assert torch.equal(la, lb)
        assert_bitwise_equal_models(a, b, oa, ob)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    assert simulate(g, plan, cm).peak_bytes == measure_plan(g, plan, b, case.batch, ob,
                                                            repeats=0).peak_bytes


@pytest.mark.parametrize("name", ["gpt2", "resnet50"])
def test_reordered_remat_plan_is_bitwise_eager_and_simulated_exactly(name):
    """Joint reordering + remat (what hotspot plans): drops from hotspot, the drop-aware order;
    dropout's RNG replay and BatchNorm's in-place stats stay exact."""
    from fitgraph.cost import RooflineCostModel, get_device
    from fitgraph.plan.remat import remat_plan
    from fitgraph.solvers import Problem, solve

    case = zoo.build(name, "small")
    a, b = case.model, copy.deepcopy(case.model)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3)
    for m, o in ((a, oa), (b, ob)):  # NOTE: a first step creates AdamW's state
        eager_step(m, case.batch, case.loss_fn, o, seed=0)
        o.zero_grad(set_to_none=True)
    la = eager_step(a, case.batch, case.loss_fn, oa, seed=3)
    g = fitgraph.capture(b, case.batch, case.loss_fn, ob)
    cm = RooflineCostModel(get_device("rtx3090"))
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim.peak_bytes
    drop = solve(Problem(g, cm, budget_bytes=int(0.6 * eager)), "hotspot").plan.meta["dropped"]
    order = memory_aware_order(g, "strict", drop)
    assert order != sorted(order)
    respects_dependencies(g, order)
    plan = remat_plan(g, drop, order)
    verify_plan(g, plan)
    assert plan.counts()["recompute"] > 0
    torch.manual_seed(3)
    lb = execute(g, plan, b, case.batch, ob)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b, oa, ob)
    prof = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    prof.profile(g)
    ob.zero_grad(set_to_none=True)
    assert simulate(g, plan, prof).peak_bytes == measure_plan(g, plan, b, case.batch, ob,
                                                              repeats=0).peak_bytes


def test_updates_that_free_nothing_wait_for_the_backward():
    """An optimizer update whose gradient is a step output frees nothing: ``strict`` used to run
    each as soon as its gradient was done, interleaved with the backward, where it finds its
    weights and state out of cache (Swin: +10% of the step, unseen by the simulator). The updates
    run after every backward node; with optimizer-in-backward (updates free their gradient)
    they still run early."""
    from fitgraph.transform.optimizer_in_backward import optimizer_in_backward

    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(8, 32)
    loss_fn = lambda m, b: m(b).square().mean()  # noqa: E731
    eager_step(model, batch, loss_fn, opt, seed=0)
    opt.zero_grad(set_to_none=True)
    g = fitgraph.capture(model, batch, loss_fn, opt)
    for strategy in STRATEGIES:
        order = memory_aware_order(g, strategy)
        phases = [g.nodes[i].phase.value for i in order]
        first_update = phases.index("optimizer")
        assert "backward" not in phases[first_update:], strategy
    fused = optimizer_in_backward(g)
    order = memory_aware_order(fused, "strict")
    phases = [fused.nodes[i].phase.value for i in order]
    assert "backward" in phases[phases.index("optimizer"):]
