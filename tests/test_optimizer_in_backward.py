"""Optimizer-in-backward: each update right after its gradient is complete, the gradient freed at
once; bitwise ``loss.backward(); optimizer.step()``, simulated peak == measured, lower by about
the gradients; impossible with global gradient-norm clipping, which is named and kept exact."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph import zoo
from fitgraph.capture.calling import compute_loss
from fitgraph.cost import ProfiledCostModel, RooflineCostModel, get_device
from fitgraph.execute import execute
from fitgraph.graph.deps import dependencies, respects_dependencies
from fitgraph.graph.ir import Phase
from fitgraph.graph.recompute_rules import recomputable
from fitgraph.measure import measure_plan
from fitgraph.plan.remat import remat_plan
from fitgraph.plan.reorder import memory_aware_order
from fitgraph.plan.verify import verify_plan
from fitgraph.sim import simulate
from fitgraph.solvers import Problem, solve
from fitgraph.transform.optimizer_in_backward import (
    OptimizerInBackwardError,
    optimizer_in_backward,
    update_nodes,
    why_not,
)

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
}


def _mlp():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)]
    return torch.nn.Sequential(*layers), torch.randn(32, 256), lambda m, b: m(b).square().mean()


def _sum_loss(m, b):
    return m(b).square().sum()


def _gpt2():
    case = zoo.build("gpt2", "small", batch_size=1, seq_len=64)  # NOTE: small: weights dominate
    return case.model, case.batch, case.loss_fn


def _grad_bytes(graph) -> int:
    return sum(graph.storage_of(v).nbytes for k, v in graph.outputs.items()
               if k.startswith("grad:"))


def _steps_in_backward(model, batch, loss_fn, make_opt, steps=2, plan_fn=fitgraph.eager_plan):
    """Run ``steps`` steps eagerly and through optimizer-in-backward; assert loss, weights and
    optimizer state bitwise equal and ``.grad`` None. Return the last (plain, in-backward)
    graphs and the fitgraph-side model and optimizer."""
    a, b = model, copy.deepcopy(model)
    oa, ob = make_opt(a.parameters()), make_opt(b.parameters())
    for step in range(steps):
        la = eager_step(a, batch, loss_fn, oa, seed=step)
        plain = fitgraph.capture(b, batch, loss_fn, ob)
        graph = optimizer_in_backward(plain)
        plan = plan_fn(graph)
        verify_plan(graph, plan)
        torch.manual_seed(step)
        lb = execute(graph, plan, b, batch, ob)
        assert torch.equal(la, lb), f"step {step}: loss {la.item()} != {lb.item()}"
        assert all(p.grad is None for p in b.parameters()), "the step must leave .grad None"
        oa.zero_grad(set_to_none=True)
        assert_bitwise_equal_models(a, b, oa, ob)
    return plain, graph, b, ob


def _peaks(plain, graph, model, batch, optimizer):
    """(simulated, measured) peak of the eager plan of each graph, with measured op costs."""
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    out = []
    for g in (plain, graph):
        cm.profile(g)
        plan = fitgraph.eager_plan(g)
        sim = simulate(g, plan, cm).peak_bytes
        measured = measure_plan(g, plan, model, batch, optimizer, repeats=0).peak_bytes
        out.append((sim, measured))
    return out


def test_each_update_follows_its_last_dependency_and_gradients_are_not_outputs():
    model, batch, loss_fn = _mlp()
    plain = fitgraph.capture(model, batch, loss_fn, OPTIMIZERS["adamw"](model.parameters()))
    assert why_not(plain) is None
    graph = optimizer_in_backward(plain)
    respects_dependencies(graph, list(range(len(graph.nodes))))
    deps = dependencies(graph)
    for u in update_nodes(graph):
        before = graph.nodes[u.id - 1]
        assert before.id in deps[u.id] or before.phase is Phase.OPTIMIZER, u.name
    assert not [k for k in graph.outputs if k.startswith("grad:")]
    assert graph.meta["optimizer_in_backward"] == [n for n, _ in model.named_parameters()]
    last_backward = max(n.id for n in graph.nodes if n.phase is Phase.BACKWARD)
    assert sum(u.id < last_backward for u in update_nodes(graph)) == 11  # all but the last one
    # the captured graph is left as it was
    assert len([k for k in plain.outputs if k.startswith("grad:")]) == 12


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_mlp_bitwise_eager_and_peak_lower_by_the_gradients(opt):
    model, batch, loss_fn = _mlp()
    plain, graph, b, ob = _steps_in_backward(model, batch, loss_fn, OPTIMIZERS[opt])
    (sim_plain, meas_plain), (sim_oib, meas_oib) = _peaks(plain, graph, b, batch, ob)
    assert sim_plain == meas_plain and sim_oib == meas_oib
    grads = _grad_bytes(plain)
    # NOTE: the first layer's weight gradient (1/6 of them) is live when its update runs
    assert sim_plain - sim_oib >= 0.6 * grads, (sim_plain, sim_oib, grads)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_gpt2_bitwise_eager_and_peak_lower_by_the_gradients(opt):
    model, batch, loss_fn = _gpt2()
    plain, graph, b, ob = _steps_in_backward(model, batch, loss_fn, OPTIMIZERS[opt])
    (sim_plain, meas_plain), (sim_oib, meas_oib) = _peaks(plain, graph, b, batch, ob)
    assert sim_plain == meas_plain and sim_oib == meas_oib
    grads = _grad_bytes(plain)
    # NOTE: the tied embedding's gradient (8 of 22 MB) is complete only at the end of the step
    tied = plain.storage_of(plain.outputs["grad:wte.weight"]).nbytes
    assert sim_plain - sim_oib >= grads - tied, (sim_plain, sim_oib, grads, tied)


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
def test_clipping_is_named_and_stays_bitwise_eager(foreach, monkeypatch):
    # NOTE: torch's default (foreach=None) picks the kernels by the device (foreach on CUDA, on
    # the CPU too in recent torch); both ways forced here, for eager and the capture alike
    import torch.nn.utils.clip_grad as clip_grad
    monkeypatch.setattr(clip_grad, "_has_foreach_support", lambda tensors, device: foreach)
    monkeypatch.setattr(clip_grad, "_device_has_foreach_support", lambda device: foreach)
    model, batch, _ = _mlp()
    loss_fn = _sum_loss  # NOTE: large gradients: the clipping is active
    a, b = model, copy.deepcopy(model)
    oa, ob = OPTIMIZERS["adam"](a.parameters()), OPTIMIZERS["adam"](b.parameters())
    for _ in range(2):
        la = compute_loss(a, batch, loss_fn)
        la.backward()
        norm = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.05)
        assert norm > 0.05
        oa.step()
        graph = fitgraph.capture(b, batch, loss_fn, ob, clip_grad_norm=0.05)
        assert foreach == any(n.target == "aten._foreach_norm.Scalar" for n in graph.nodes)
        reason = why_not(graph)
        culprit = "_foreach_norm (aten._foreach_norm" if foreach else "stack (aten.stack"
        assert reason is not None and reason.startswith(f"node {culprit}")
        assert "12 parameters" in reason
        with pytest.raises(OptimizerInBackwardError, match=f"impossible: node {culprit[:6]}"):
            optimizer_in_backward(graph)
        lb = execute(graph, fitgraph.eager_plan(graph), b, batch, ob)
        assert torch.equal(la.detach(), lb)
        assert_bitwise_equal_models(a, b, oa, ob)  # NOTE: .grad kept, clipped, as eager
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)


def test_why_not_without_an_optimizer():
    model, batch, loss_fn = _mlp()
    graph = fitgraph.capture(model, batch, loss_fn)
    assert "no optimizer update" in why_not(graph)
    with pytest.raises(OptimizerInBackwardError, match="no optimizer update"):
        optimizer_in_backward(graph)


def test_updates_wait_for_every_recompute_that_may_read_their_weight():
    """graph.deps: an update waits for every later reader of a forward value computed at or
    after its weight's first forward reader (a recompute may be inserted before it)."""
    model, batch, loss_fn = _gpt2()
    g = fitgraph.capture(model, batch, loss_fn, OPTIMIZERS["adamw"](model.parameters()))
    deps = dependencies(g)
    forward = {n.id for n in g.nodes if n.phase in (Phase.FORWARD, Phase.LOSS)}
    for u in update_nodes(g):
        w = g.values[u.args[0].id].storage
        first = min(n.id for n in g.nodes if n.id in forward and any(
            g.values[v].storage == w for v in n.inputs))
        for n in g.nodes:
            if n.id not in forward and n.phase is not Phase.OPTIMIZER and any(
                    g.values[v].producer in forward and g.values[v].producer >= first
                    for v in n.inputs):
                assert n.id in deps[u.id], (u.name, n.name)
    # so updates inside the backward leave the forward ops that read weights recomputable
    graph = optimizer_in_backward(g)
    ok = recomputable(graph)
    linears = [n.id for n in graph.nodes
               if n.target == "aten.addmm.default" and n.phase is Phase.FORWARD]
    assert linears and all(ok[nid] == "" for nid in linears)


def test_hotspot_remat_in_backward_bitwise_and_simulated_exactly():
    """Joint reordering + remat of an in-backward step (what hotspot plans) stays exact, and
    reaches a lower peak than the step that keeps its gradients."""
    case = zoo.build("gpt2", "small", batch_size=1, seq_len=256)
    make = OPTIMIZERS["adamw"]
    a, b = case.model, copy.deepcopy(case.model)
    oa, ob = make(a.parameters()), make(b.parameters())
    for m, o in ((a, oa), (b, ob)):  # NOTE: a first step creates AdamW's state
        eager_step(m, case.batch, case.loss_fn, o, seed=0)
        o.zero_grad(set_to_none=True)
    plain = fitgraph.capture(b, case.batch, case.loss_fn, ob)
    graph = optimizer_in_backward(plain)
    cm = RooflineCostModel(get_device("rtx3090"))
    eager = solve(Problem(plain, cm, latency_limit=1.0), "eager").sim.peak_bytes
    low = {}
    for name, g in (("plain", plain), ("oib", graph)):
        low[name] = solve(Problem(g, cm, latency_limit=1.5), "hotspot").sim.peak_bytes
    assert low["oib"] < low["plain"] < eager
    sol = solve(Problem(graph, cm, budget_bytes=int(0.9 * eager)), "hotspot")
    drop = sol.plan.meta["dropped"]
    order = memory_aware_order(graph, "strict", drop)
    respects_dependencies(graph, order)
    plan = remat_plan(graph, drop, order)
    verify_plan(graph, plan)
    assert plan.counts()["recompute"] > 0
    la = eager_step(a, case.batch, case.loss_fn, oa, seed=3)
    torch.manual_seed(3)
    lb = execute(graph, plan, b, case.batch, ob)
    assert torch.equal(la, lb)
    oa.zero_grad(set_to_none=True)
    assert_bitwise_equal_models(a, b, oa, ob)
    prof = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    prof.profile(graph)
    graph = optimizer_in_backward(fitgraph.capture(b, case.batch, case.loss_fn, ob))
    plan = remat_plan(graph, drop, memory_aware_order(graph, "strict", drop))
    assert simulate(graph, plan, prof).peak_bytes == measure_plan(
        graph, plan, b, case.batch, ob, repeats=0).peak_bytes


def test_parameters_outside_the_optimizer_keep_their_grad():
    model, batch, loss_fn = _mlp()
    a, b = model, copy.deepcopy(model)
    make = OPTIMIZERS["sgd-momentum"]
    oa, ob = make(a[1:].parameters()), make(b[1:].parameters())  # NOTE: not the first layer
    la = eager_step(a, batch, loss_fn, oa)
    graph = optimizer_in_backward(fitgraph.capture(b, batch, loss_fn, ob))
    assert sorted(k for k in graph.outputs if k.startswith("grad:")) == [
        "grad:0.0.bias", "grad:0.0.weight"]
    lb = execute(graph, fitgraph.eager_plan(graph), b, batch, ob)
    assert torch.equal(la, lb)
    for p in a[1:].parameters():
        p.grad = None
    assert_bitwise_equal_models(a, b, oa, ob)  # NOTE: the first layer's .grad as eager's


def test_optimize_option(tmp_path):
    model, batch, loss_fn = _mlp()
    a, b = model, copy.deepcopy(model)
    oa, ob = OPTIMIZERS["adamw"](a.parameters()), OPTIMIZERS["adamw"](b.parameters())
    step = fitgraph.optimize(b, batch, loss_fn, ob, budget=1.0, optimizer_in_backward=True)
    for s in range(2):
        la = eager_step(a, batch, loss_fn, oa, seed=s)
        torch.manual_seed(s)
        assert torch.equal(la, step(batch))
        oa.zero_grad(set_to_none=True)
        assert_bitwise_equal_models(a, b, oa, ob)
    r = step.report()
    assert r.notes["optimizer_in_backward"] == "on"
    assert r.measured_peak_bytes == r.planned_peak_bytes
    b[0][0].weight.grad = torch.zeros_like(b[0][0].weight)
    with pytest.raises(ValueError, match="0.0.weight has a .grad"):
        step(batch)
    b[0][0].weight.grad = None
    step.save(str(tmp_path / "plan.fg"))
    loaded = fitgraph.load(str(tmp_path / "plan.fg"), b, ob, loss_fn, batch)
    assert loaded.report().notes["optimizer_in_backward"] == "on"
    la = eager_step(a, batch, loss_fn, oa, seed=2)
    torch.manual_seed(2)
    assert torch.equal(la, loaded(batch))
    oa.zero_grad(set_to_none=True)
    assert_bitwise_equal_models(a, b, oa, ob)
    # NOTE: the node that combines the gradients: torch's clipping default on this device
    # (foreach on the CPU in recent torch, stacked norms where it has no foreach kernels)
    combiner = "_foreach_norm" if any(
        n.target == "aten._foreach_norm.Scalar"
        for n in fitgraph.capture(b, batch, loss_fn, ob, clip_grad_norm=0.05).nodes) else "stack"
    with pytest.raises(OptimizerInBackwardError, match=f"node {combiner}"):
        fitgraph.optimize(b, batch, loss_fn, ob, budget=1.0, clip_grad_norm=0.05,
                          optimizer_in_backward=True, cost_model="rtx3090")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = fitgraph.optimize(b, batch, loss_fn, ob, budget=1.0, clip_grad_norm=0.05,
                                 optimizer_in_backward="auto", cost_model="rtx3090")
    assert any(f"optimizer-in-backward is off: node {combiner}" in str(w.message)
               for w in caught)
    assert step.report().notes["optimizer_in_backward"].startswith(f"off: node {combiner}")
    with pytest.raises(ValueError, match="optimizer_in_backward must be"):
        fitgraph.optimize(b, batch, loss_fn, ob, budget=1.0, optimizer_in_backward="yes")
