"""Offloading with prefetch: the instructions' semantics in the simulator and the verifier, the
placement (offload_plan), the per-storage gains, and plans that run on the CPU bitwise equal to
eager with measured peak == simulated peak (CUDA tests run where a GPU is)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from helpers import assert_bitwise_equal_models, eager_step
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_plan_sim import TableCost, random_graphs

import fitgraph
from fitgraph import zoo
from fitgraph.cost import ProfiledCostModel
from fitgraph.cost.base import BaseCostModel, NodeCost
from fitgraph.execute import Executor, execute
from fitgraph.execute.meter import MemoryMeter
from fitgraph.execute.offload import HostStore
from fitgraph.graph.ir import GraphBuilder, Phase, Role
from fitgraph.measure import measure_plan
from fitgraph.plan.eager import eager_plan, plan_in_order
from fitgraph.plan.instructions import Compute, Free, Offload, Plan, Prefetch, Wait
from fitgraph.plan.verify import PlanError, verify_plan
from fitgraph.sim.simulate import simulate
from fitgraph.solvers.offload.plan import (
    OffloadError,
    offload_candidates,
    offload_gains,
    offload_plan,
    offload_windows,
)

gpu = pytest.mark.gpu
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EPS = 1e-12


class SlowCopy(BaseCostModel):
    """A random graph's node costs, with copies as slow as nodes (tens of microseconds a byte)."""

    name = "slow-copy"

    def __init__(self, table: TableCost, seconds_per_byte: float) -> None:
        self.table, self.per_byte = table, seconds_per_byte

    def node_cost(self, graph, node):
        return self.table.node_cost(graph, node)

    def copy_seconds(self, nbytes):
        return nbytes * self.per_byte


class Uniform(BaseCostModel):
    name = "uniform"

    def __init__(self, node_s: float, copy_s: float) -> None:
        self.node_s, self.copy_s = node_s, copy_s

    def node_cost(self, graph, node):
        return NodeCost(self.node_s, 0)

    def copy_seconds(self, nbytes):
        return self.copy_s


def chain(layers: int = 5, width: int = 256):
    """A forward chain whose every activation is saved for the backward, read back in reverse."""
    b = GraphBuilder()
    x = b.add_input("x", (width,), "float32", Role.INPUT)
    acts = [x]
    for i in range(layers):
        acts += b.add_node("aten.relu.default", [acts[-1]], [((width,), "float32")],
                           name=f"f{i}")
    grad = b.add_node("aten.sum.default", [acts[-1]], [((width,), "float32")], name="loss")[0]
    for i in range(layers, 0, -1):
        grad = b.add_node("aten.mul.Tensor", [grad, acts[i]], [((width,), "float32")],
                          phase=Phase.BACKWARD, name=f"b{i}")[0]
    return b.finish({"loss": grad}), acts


def _positions(plan, st_id):
    """Indices of the offload, release, prefetch and prefetch-wait of one storage."""
    ops = [(pc, i) for pc, i in enumerate(plan) if getattr(i, "storage", None) == st_id]
    kinds = [type(i).__name__ for _, i in ops]
    assert kinds == ["Offload", "Wait", "Prefetch", "Wait"], kinds
    return [pc for pc, _ in ops]


# -- the instructions' semantics --------------------------------------------------------------
def test_simulator_follows_the_offload_semantics():
    g, acts = chain(layers=2, width=4)  # 16-byte storages; 1 s a node, 0.5 s a copy
    sa, sb, s_sum, s_b2 = 1, 2, 3, 4
    assert sa == g.values[acts[1]].storage and sb == g.values[acts[2]].storage
    plan = Plan((Compute(0), Offload(sa), Compute(1), Wait(sa), Compute(2), Prefetch(sa),
                 Compute(3), Free((sb, s_sum)), Wait(sa), Compute(4), Free((sa, s_b2))))
    verify_plan(g, plan)
    r = simulate(g, plan, Uniform(1.0, 0.5))
    res = r.resident_bytes
    # offload: bytes stay on device until the Wait that ends it; prefetch: back at its start
    assert [b - res for b in r.live_after] == [16, 16, 32, 16, 32, 48, 64, 32, 32, 48, 16]
    assert [(c.kind, c.start, c.end) for c in r.copies] == [("offload", 1.0, 1.5),
                                                            ("prefetch", 3.0, 3.5)]
    assert r.stall_s == 0.0 and r.latency_s == 5.0  # the prefetch hid under node 3
    assert r.host_peak_bytes == 16
    # no compute to hide the prefetch: the Wait stalls the compute stream for the copy
    late = Plan((*plan[:5], *plan[6:8], Prefetch(sa), Wait(sa), *plan[9:]))
    verify_plan(g, late)
    r2 = simulate(g, late, Uniform(1.0, 0.5))
    assert r2.stall_s == 0.5 and r2.latency_s == 5.5
    # an offload waited for at once stalls for the whole copy
    eager_release = Plan((Compute(0), Offload(sa), Wait(sa), Prefetch(sa), Wait(sa),
                          *plan[2:3], *plan[4:5], *plan[6:8], *plan[9:]))
    verify_plan(g, eager_release)
    assert simulate(g, eager_release, Uniform(1.0, 0.5)).stall_s == 1.0


def test_verifier_checks_every_offload_step():
    g, acts = chain(layers=2, width=4)
    x, sa, sb, s_sum, s_b2 = 0, 1, 2, 3, 4
    tail = (Compute(3), Free((sb, s_sum)), Compute(4), Free((sa, s_b2)))

    def bad(*ins, match):
        with pytest.raises(PlanError, match=match):
            verify_plan(g, Plan(ins))

    bad(Compute(0), Offload(sa), Wait(sa), Compute(1), Compute(2), *tail,
        match="reads f0 whose storage is offloaded and not prefetched")
    bad(Compute(0), Offload(sa), Compute(1), Wait(sa), Compute(2), Prefetch(sa), *tail,
        match=r"prefetch is in flight; put Wait\(1\) before it")
    bad(Compute(0), Offload(sa), Compute(1), Compute(2), *tail, match="with its offload in flight")
    bad(Compute(0), Offload(sa), Compute(1), Compute(2), Compute(3), Free((sb, s_sum)),
        Compute(4), Free((s_b2,)), match="never waited")
    bad(Compute(0), Offload(x), Wait(x), Compute(1), match="resident or a step output")
    bad(Compute(0), Prefetch(sa), match="not offloaded and released")
    bad(Compute(0), Wait(sa), match="no copy in flight")
    bad(Compute(0), Offload(sa), Offload(sa), match="that is being offloaded")
    bad(Compute(0), Compute(1), Offload(sb), Wait(sb), Free((sb,)),
        match=r"Free of storage 2 \(f1\) that is not live")
    # a write while the offload is in flight would leave a stale host copy
    b = GraphBuilder()
    x = b.add_input("x", (4,), "float32", Role.INPUT)
    y = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    y2 = b.add_node("aten.relu_.default", [y], [((4,), "float32")], mutates=(y,),
                    alias_of={0: y})[0]
    z = b.add_node("aten.neg.default", [y2], [((4,), "float32")])[0]
    g2 = b.finish({"loss": z})
    sy = g2.values[y].storage
    with pytest.raises(PlanError, match="writes relu_0 while its offload is in flight"):
        verify_plan(g2, Plan((Compute(0), Offload(sy), Compute(1), Wait(sy), Prefetch(sy),
                              Wait(sy), Compute(2), Free((sy,)))))


# -- offload_plan on random graphs -------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(random_graphs(), st.data())
def test_any_subset_of_candidates_verifies_and_never_raises_the_peak(case, data):
    g, cost = case
    rnd = data.draw(st.randoms(use_true_random=False))
    if rnd.random() < 0.5:
        base = eager_plan(g)
    else:  # NOTE: a random topological order: offloading works on reordered plans too
        deps = {n.id: {g.values[v].producer for v in n.inputs
                       if g.values[v].producer is not None} for n in g.nodes}
        order, done = [], set()
        while len(order) < len(g.nodes):
            pick = rnd.choice(sorted(n for n in deps if n not in done and deps[n] <= done))
            order.append(pick)
            done.add(pick)
        base = plan_in_order(g, order)
    cands = offload_candidates(g, base)
    chosen = data.draw(st.lists(st.sampled_from(cands), unique=True) if cands else st.just([]))
    cost = SlowCopy(cost, data.draw(st.sampled_from([1e-9, 2e-5, 1e-3])))
    plan = offload_plan(g, base, chosen, cost)
    verify_plan(g, plan)
    assert plan == offload_plan(g, base, list(reversed(chosen)), cost)  # deterministic
    assert plan.meta["offloaded"] == tuple(sorted(chosen))
    counts = plan.counts()
    assert counts.get("offload", 0) == counts.get("prefetch", 0) == len(chosen)
    assert counts.get("wait", 0) == 2 * len(chosen)
    r0, r = simulate(g, base, cost), simulate(g, plan, cost)
    assert r.peak_bytes <= r0.peak_bytes
    assert r.compute_s == pytest.approx(r0.compute_s)
    assert r.latency_s >= r0.latency_s - 1e-9
    for s in chosen:  # released for part of the step: off device between release and prefetch
        off, rel, pre, _ = _positions(plan, s)
        assert r.live_after[rel] == r.live_after[rel - 1] - g.storages[s].nbytes
        assert rel > off and pre > rel


@settings(max_examples=150, deadline=None)
@given(random_graphs(), st.sampled_from([2e-6, 2e-5, 2e-4]))
def test_a_prefetch_is_hidden_when_compute_allows_and_as_late_as_it_can_be(case, per_byte):
    g, table = case
    cost = SlowCopy(table, per_byte)
    base = eager_plan(g)
    for s in offload_candidates(g, base)[:4]:
        win = offload_windows(g, base, [s], cost)[0]
        plan = offload_plan(g, base, [s], cost)
        r = simulate(g, plan, cost)
        _, rel, pre, wait = _positions(plan, s)
        secs = cost.copy_seconds(g.storages[s].nbytes)
        fetch = next(c for c in r.copies if c.kind == "prefetch")
        reader_start = r.time_after[wait - 1]
        room = reader_start - r.time_after[rel]  # compute between the release and the reader
        computes = [pc for pc in range(pre + 1, wait) if isinstance(plan[pc], Compute)]
        if room + EPS >= secs:
            assert fetch.end <= reader_start + EPS, "the copy fits: it must end before its reader"
            assert r.time_after[wait] == pytest.approx(reader_start)  # the Wait does not stall
            # as late as possible: one node later and it would not be hidden any more
            if len(computes) > 1:
                assert r.time_after[computes[1] - 1] + secs > reader_start - EPS
        else:  # no point hides it: it starts as soon as the storage is released
            assert fetch.start == pytest.approx(r.time_after[rel], abs=EPS)
            assert r.time_after[pre - 1] == pytest.approx(r.time_after[rel], abs=EPS)
        assert base[win.reader] == plan[wait + 1]


@settings(max_examples=100, deadline=None)
@given(random_graphs(), st.sampled_from([1e-9, 2e-5, 1e-3]))
def test_gains_agree_with_simulating_each_offload_alone(case, per_byte):
    g, table = case
    cost = SlowCopy(table, per_byte)
    base = eager_plan(g)
    r0 = simulate(g, base, cost)
    gains = offload_gains(g, base, cost)
    assert sorted(gains) == offload_candidates(g, base)
    for s, x in gains.items():
        plan = offload_plan(g, base, [s], cost)
        r = simulate(g, plan, cost)
        _, rel, pre, _ = _positions(plan, s)
        assert x.peak_saving == r0.peak_bytes - r.peak_bytes >= 0
        assert x.exposed_s == pytest.approx(r.latency_s - r0.latency_s, abs=1e-9)
        assert x.exposed_s == pytest.approx(r.stall_s, abs=1e-9)
        assert x.off_device_s == pytest.approx(r.time_after[pre - 1] - r.time_after[rel],
                                               abs=1e-9)
        assert x.copy_s == pytest.approx(r.copy_s)
        assert x.byte_seconds == pytest.approx(x.nbytes * x.off_device_s)


class InLine(Uniform):
    """Copies on the compute stream, as the CPU executor does them."""

    copies_overlap = False


def test_in_line_copies_add_to_the_step_and_prefetches_go_last():
    g, acts = chain(layers=6)
    base = eager_plan(g)
    cands = offload_candidates(g, base)
    cost = InLine(1e-3, 2e-4)
    plan = offload_plan(g, base, cands, cost)
    verify_plan(g, plan)
    r0, r = simulate(g, base, cost), simulate(g, plan, cost)
    # every copy is on the compute clock: nothing overlaps, nothing stalls on a Wait
    assert r.latency_s == pytest.approx(r0.latency_s + r.copy_s)
    assert r.copy_s == pytest.approx(2 * len(cands) * 2e-4)
    for sid in cands:  # each prefetch right before its reader's Wait: the least device time
        _, _, pre, wait = _positions(plan, sid)
        assert wait == pre + 1
    gains = offload_gains(g, base, cost)
    assert all(x.exposed_s == pytest.approx(x.copy_s) for x in gains.values())
    assert ProfiledCostModel(progress=False).copies_overlap is False


def test_a_chain_offloads_everything_with_every_copy_hidden():
    g, acts = chain(layers=6)
    base = eager_plan(g)
    cands = offload_candidates(g, base)
    assert cands == sorted(g.values[a].storage for a in acts[1:6])  # the last is read at once
    cost = Uniform(1e-3, 2e-4)
    plan = offload_plan(g, base, cands, cost)
    verify_plan(g, plan)
    r0, r = simulate(g, base, cost), simulate(g, plan, cost)
    assert r.stall_s == 0.0 and r.latency_s == pytest.approx(r0.latency_s)
    assert r.peak_bytes < r0.peak_bytes
    assert r.host_peak_bytes == 5 * 1024  # all five on host between forward and backward
    gains = offload_gains(g, base, cost)
    assert sorted(gains) == cands
    first = gains[cands[0]]
    assert first.exposed_s == 0.0 and first.copy_s == pytest.approx(4e-4)
    assert first.byte_seconds == pytest.approx(first.nbytes * first.off_device_s)
    assert first.off_device_s == max(x.off_device_s for x in gains.values())
    assert all(x.peak_saving >= 0 for x in gains.values())


def test_offloading_what_cannot_be_says_why():
    g, acts = chain(layers=2)
    base = eager_plan(g)
    with pytest.raises(OffloadError, match="resident or a step output"):
        offload_plan(g, base, [g.values[acts[0]].storage], Uniform(1.0, 1.0))
    last = g.values[acts[2]].storage  # read right away by the loss, then by b2: no gap
    with pytest.raises(OffloadError, match="no node runs between two of its uses"):
        offload_plan(g, base, [last], Uniform(1.0, 1.0))
    once = offload_plan(g, base, [g.values[acts[1]].storage], Uniform(1.0, 1.0))
    with pytest.raises(OffloadError, match="already offloads .* every storage in one call"):
        offload_plan(g, once, [], Uniform(1.0, 1.0))


def test_remat_plans_offload_what_they_keep():
    from test_ilp import train_like_graphs

    from fitgraph.plan.remat import remat_plan
    from fitgraph.solvers.remat.candidates import remat_candidates

    @settings(max_examples=60, deadline=None)
    @given(train_like_graphs(), st.data())
    def check(case, data):
        g, cost = case
        cands = sorted(remat_candidates(g))
        drop = data.draw(st.lists(st.sampled_from(cands), unique=True) if cands else st.just([]))
        base = remat_plan(g, set(drop))
        off = offload_candidates(g, base)
        plan = offload_plan(g, base, off, cost)
        verify_plan(g, plan)
        assert simulate(g, plan, cost).peak_bytes <= simulate(g, base, cost).peak_bytes

    check()


def test_planning_offload_never_imports_torch():
    from test_boundary import _import_without_torch

    r = _import_without_torch("fitgraph.solvers.offload.plan")
    assert r.returncode == 0, r.stderr


# -- execution on the CPU ----------------------------------------------------------------------
def test_host_store_rebuilds_views_with_their_strides_and_offsets():
    b = GraphBuilder()
    x = b.add_input("x", (6, 4), "float32", Role.INPUT)
    base = b.add_node("aten.relu.default", [x], [((6, 4), "float32")])[0]
    view = b.add_node("aten.t.default", [base], [((4, 6), "float32")], alias_of={0: base})[0]
    g = b.finish({"loss": view})
    st_id = g.values[base].storage
    members = {st_id: [base, view]}
    store = HostStore(g, Plan((Offload(st_id),)), members)
    want = torch.arange(24.0).reshape(6, 4)
    with MemoryMeter() as m:
        src = want.clone()
        env = [None, src, src.t()[1:, 2:]]
        del src
        store.offload(st_id, env)
        store.wait(st_id, env)
        assert env[1] is None and env[2] is None
        store.prefetch(st_id, env)
        store.wait(st_id, env)
    # NOTE: 96 bytes, released at the Wait, before the prefetch allocates 96 again
    assert m.timeline == [96, 0, 96]
    assert torch.equal(env[1], want) and torch.equal(env[2], want.t()[1:, 2:])
    assert env[2].stride() == (1, 4) and env[2].storage_offset() == 9
    assert env[1].untyped_storage().data_ptr() == env[2].untyped_storage().data_ptr()
    # values that do not share one storage at run time are refused, not silently copied
    env = [None, torch.zeros(6, 4), torch.zeros(4, 6)]
    with pytest.raises(RuntimeError, match="do not share one storage"):
        store.offload(st_id, env)


def test_a_dropped_executor_gives_its_host_buffers_back_at_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    batch = torch.randn(4, 8)
    g = fitgraph.capture(model, batch, lambda m, b: m(b).square().mean())
    base = eager_plan(g)
    ex = Executor(g, offload_plan(g, base, offload_candidates(g, base), Uniform(1e-3, 1e-4)),
                  model)
    ex(batch)
    refs = [weakref.ref(t) for t in ex.host.buffers.values()]
    assert refs
    gc.disable()  # NOTE: not at the next collection, which could fall inside a measured step
    try:
        del ex
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


class SavesViews(torch.nn.Module):
    """An MLP whose saved activations are views (reshape, transpose) of larger storages."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(64, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))                       # (n, 64)
        v = h.view(-1, 4, 16).transpose(0, 1)           # a strided view of h
        w = torch.sigmoid(self.b(v)).transpose(0, 1).reshape(-1, 64)
        return self.c(w * h)


def test_mlp_offload_plan_is_bitwise_eager_and_simulated_exactly():
    torch.manual_seed(0)
    model, batch = SavesViews(), torch.randn(64, 32)

    def loss_fn(m, b):
        return m(b).square().mean()

    a, b = model, copy.deepcopy(model)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3)
    for m, o in ((a, oa), (b, ob)):  # NOTE: a first step creates AdamW's state
        eager_step(m, batch, loss_fn, o, seed=0)
        o.zero_grad(set_to_none=True)
    g = fitgraph.capture(b, batch, loss_fn, ob)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    base = eager_plan(g)
    plan = offload_plan(g, base, offload_candidates(g, base), cm)
    verify_plan(g, plan)
    assert plan.counts()["offload"] >= 4
    ex = Executor(g, plan, b, ob)
    for step in (1, 2):  # NOTE: the host buffers are reused by the second step
        la = eager_step(a, batch, loss_fn, oa, seed=step)
        torch.manual_seed(step)
        lb = ex(batch)
        assert torch.equal(la, lb)
        assert_bitwise_equal_models(a, b, oa, ob)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
    g = fitgraph.capture(b, batch, loss_fn, ob)
    plan = offload_plan(g, eager_plan(g), offload_candidates(g, eager_plan(g)), cm)
    sim, sim0 = simulate(g, plan, cm), simulate(g, eager_plan(g), cm)
    measured = measure_plan(g, plan, b, batch, ob, repeats=0)
    assert measured.peak_bytes == sim.peak_bytes < sim0.peak_bytes


def test_gpt2_offload_plan_is_bitwise_eager_and_simulated_exactly():
    case = zoo.build("gpt2", "small")
    a, b = case.model, copy.deepcopy(case.model)
    la = eager_step(a, case.batch, case.loss_fn, seed=1)
    g = fitgraph.capture(b, case.batch, case.loss_fn)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    base = eager_plan(g)
    plan = offload_plan(g, base, offload_candidates(g, base), cm)
    verify_plan(g, plan)
    torch.manual_seed(1)  # NOTE: dropout draws the same masks: offloading moves no RNG
    lb = execute(g, plan, b, case.batch)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b)
    for p in b.parameters():
        p.grad = None
    sim, sim0 = simulate(g, plan, cm), simulate(g, base, cm)
    measured = measure_plan(g, plan, b, case.batch, repeats=0)
    assert measured.peak_bytes == sim.peak_bytes
    assert sim.peak_bytes - sim.resident_bytes < 0.5 * (sim0.peak_bytes - sim0.resident_bytes)


# -- execution on CUDA -------------------------------------------------------------------------
@gpu
@cuda_only
def test_cuda_offload_plan_is_bitwise_eager_with_pinned_buffers_and_a_copy_stream():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model, batch = SavesViews().to(dev), torch.randn(256, 32, device=dev)

    def loss_fn(m, b):
        return m(b).square().mean()

    a, b = model, copy.deepcopy(model)
    g = fitgraph.capture(b, batch, loss_fn)
    cm = ProfiledCostModel(device=dev, repeats=1, warmup=0, progress=False)
    cm.profile(g)
    base = eager_plan(g)
    plan = offload_plan(g, base, offload_candidates(g, base), cm)
    verify_plan(g, plan)
    ex = Executor(g, plan, b)
    assert ex.host.buffers and all(t.is_pinned() for t in ex.host.buffers.values())
    assert len(ex.host.streams) == 1
    for step in (1, 2):
        la = eager_step(a, batch, loss_fn, seed=step)
        torch.manual_seed(step)
        lb = ex(batch)
        torch.cuda.synchronize()
        assert torch.equal(la, lb)
        assert_bitwise_equal_models(a, b)
        for p in [*a.parameters(), *b.parameters()]:
            p.grad = None
    sim = simulate(g, plan, cm)
    measured = measure_plan(g, plan, b, batch, repeats=0, device=dev)
    assert measured.peak_bytes == sim.peak_bytes
    assert sim.peak_bytes < simulate(g, base, cm).peak_bytes
