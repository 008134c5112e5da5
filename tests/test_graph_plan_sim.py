"""Property tests on random graphs for the torch-free core: eager plan, verifier, simulator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitgraph.cost.base import BaseCostModel, NodeCost
from fitgraph.graph.analysis import GraphError, storage_last_use, users, verify_graph
from fitgraph.graph.ir import GraphBuilder, Phase, Role
from fitgraph.plan.eager import eager_plan, plan_in_order
from fitgraph.plan.instructions import Compute, Free, Plan, Recompute
from fitgraph.plan.verify import PlanError, verify_plan
from fitgraph.sim.simulate import simulate


class TableCost(BaseCostModel):
    """Per-node seconds and workspace from a table (ids are node ids)."""

    name = "table"

    def __init__(self, seconds, workspace):
        self.seconds, self.workspace = seconds, workspace

    def node_cost(self, graph, node):
        return NodeCost(self.seconds[node.id], self.workspace[node.id])

    def copy_seconds(self, nbytes):
        return nbytes / 1e9


@st.composite
def random_graphs(draw):
    """A random DAG: inputs, then nodes reading 1-3 earlier values; some outputs are views."""
    b = GraphBuilder()
    vals = [b.add_input(f"in{i}", (draw(st.integers(1, 64)),), "float32", Role.PARAMETER)
            for i in range(draw(st.integers(1, 3)))]
    n_nodes = draw(st.integers(1, 25))
    for i in range(n_nodes):
        k = draw(st.integers(1, min(3, len(vals))))
        ins = draw(st.lists(st.sampled_from(vals), min_size=k, max_size=k, unique=True))
        phase = Phase.FORWARD if i < n_nodes // 2 else Phase.BACKWARD
        if draw(st.booleans()) and i > 0 and b.values[ins[0]].producer is not None:
            out = b.add_node("aten.view.default", ins[:1], [(b.values[ins[0]].shape, "float32")],
                             phase=phase, alias_of={0: ins[0]})  # a view: no new storage
        else:
            n_out = draw(st.integers(1, 2))
            shapes = [((draw(st.integers(1, 64)),), "float32") for _ in range(n_out)]
            out = b.add_node("aten.op.default", ins, shapes, phase=phase)
        vals.extend(out)
    produced = [v for v in vals if b.values[v].producer is not None]
    loss = draw(st.sampled_from(produced))
    g = b.finish({"loss": loss})
    seconds = draw(st.lists(st.floats(0, 1e-2), min_size=len(g.nodes), max_size=len(g.nodes)))
    ws = draw(st.lists(st.integers(0, 512), min_size=len(g.nodes), max_size=len(g.nodes)))
    # NOTE: a view allocates nothing: no cost model gives it workspace (the simulator counts 0
    # whatever a table says, tested in test_ilp)
    ws = [0 if n.target == "aten.view.default" else w for n, w in zip(g.nodes, ws)]
    return g, TableCost(seconds, ws)


def brute_force_peak(g, order, workspace):
    """Independent recount: a storage is live from its producer to its last reader in order."""
    keep = {g.values[v].storage for v in g.inputs} | {g.values[v].storage for v in g.outputs.values()}
    first, last = {}, {}
    for pos, nid in enumerate(order):
        n = g.nodes[nid]
        for vid in [*n.inputs, *[o for o in n.outputs if o is not None]]:
            s = g.values[vid].storage
            first.setdefault(s, pos)
            last[s] = pos
    resident = sum(g.storages[s].nbytes for s in {g.values[v].storage for v in g.inputs})
    peak = resident
    for pos, nid in enumerate(order):
        live = resident + sum(g.storages[s].nbytes for s in first
                              if s not in {g.values[v].storage for v in g.inputs}
                              and first[s] <= pos and (last[s] >= pos or s in keep))
        peak = max(peak, live + workspace[nid])
    return peak


@settings(max_examples=150, deadline=None)
@given(random_graphs())
def test_eager_plan_verifies_and_simulates_exactly(case):
    g, cost = case
    verify_graph(g)
    plan = eager_plan(g)
    verify_plan(g, plan)
    r = simulate(g, plan, cost)
    assert r.peak_bytes == brute_force_peak(g, [n.id for n in g.nodes], cost.workspace)
    assert r.peak_bytes >= r.resident_bytes
    assert r.latency_s == pytest.approx(sum(cost.seconds))
    assert len(r.live_after) == len(plan)
    assert max(r.peak_during) == r.peak_bytes
    # every non-kept storage is freed: the step ends with resident + outputs only
    kept = {g.values[v].storage for v in g.outputs.values()} - set(g.input_storages())
    assert r.live_after[-1] == r.resident_bytes + sum(g.storages[s].nbytes for s in kept)
    assert sum(r.breakdown.values()) == r.peak_bytes


@settings(max_examples=100, deadline=None)
@given(random_graphs(), st.randoms(use_true_random=False))
def test_any_topological_order_is_a_valid_plan(case, rnd):
    g, cost = case
    # a random topological order (Kahn's algorithm with random choices)
    deps = {n.id: {g.values[v].producer for v in n.inputs if g.values[v].producer is not None}
            for n in g.nodes}
    order, done = [], set()
    while len(order) < len(g.nodes):
        ready = sorted(n for n in deps if n not in done and deps[n] <= done)
        pick = rnd.choice(ready)
        order.append(pick)
        done.add(pick)
    plan = plan_in_order(g, order)
    verify_plan(g, plan)
    assert simulate(g, plan, cost).peak_bytes == brute_force_peak(g, order, cost.workspace)


@settings(max_examples=100, deadline=None)
@given(random_graphs())
def test_verifier_catches_use_after_free(case):
    g, _ = case
    plan = list(eager_plan(g))
    u = users(g)
    for ins in plan:
        if not isinstance(ins, Free):
            continue
        st_id = ins.storages[0]
        readers = [n for v in g.values if v.storage == st_id for n in u[v.id]]
        if not readers:
            continue
        # free the storage just before its last reader instead of after it
        without = [Free(tuple(s for s in x.storages if s != st_id)) if isinstance(x, Free) else x
                   for x in plan]
        without = [x for x in without if not (isinstance(x, Free) and not x.storages)]
        j = next(k for k, x in enumerate(without)
                 if isinstance(x, Compute) and x.node == max(readers))
        bad = without[:j] + [Free((st_id,))] + without[j:]
        with pytest.raises(PlanError, match="not live"):
            verify_plan(g, Plan(tuple(bad)))
        return


def _tiny():
    b = GraphBuilder()
    x = b.add_input("x", (4,), "float32", Role.INPUT)
    y = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    z = b.add_node("aten.neg.default", [y], [((4,), "float32")])[0]
    w = b.add_node("aten.sum.default", [z], [((), "float32")])[0]
    return b.finish({"loss": w}), (x, y, z, w)


def test_verifier_errors_name_the_node():
    g, _ = _tiny()
    with pytest.raises(PlanError, match="computed twice"):
        verify_plan(g, Plan((Compute(0), Compute(0), Compute(1), Compute(2))))
    with pytest.raises(PlanError, match="never computes node neg"):
        verify_plan(g, Plan((Compute(0),)))
    with pytest.raises(PlanError, match="reads relu_0 whose storage is not live"):
        verify_plan(g, Plan((Compute(0), Free((g.values[1].storage,)), Compute(1), Compute(2))))
    with pytest.raises(PlanError, match="Recompute of node relu.* before Compute"):
        verify_plan(g, Plan((Recompute(0), Compute(0), Compute(1), Compute(2))))
    with pytest.raises(PlanError, match="step output or resident but the plan frees it"):
        verify_plan(g, Plan((Compute(0), Compute(1), Compute(2), Free((g.values[3].storage,)))))


def test_recompute_after_free_is_valid_and_costs_twice():
    g, (x, y, z, w) = _tiny()
    sy = g.values[y].storage
    plan = Plan((Compute(0), Free((sy,)), Recompute(0), Compute(1), Free((sy,)), Compute(2),
                 Free((g.values[z].storage,))))
    verify_plan(g, plan)
    r = simulate(g, plan, TableCost([1.0, 1.0, 1.0], [0, 0, 0]))
    assert r.latency_s == pytest.approx(4.0)


def test_graph_verifier_rejects_reading_before_producing():
    g, _ = _tiny()
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    g.nodes[0].id, g.nodes[1].id = 0, 1
    with pytest.raises(GraphError, match="before it is produced"):
        verify_graph(g)


def test_liveness_side_table():
    g, (x, y, z, w) = _tiny()
    last = storage_last_use(g)
    assert last[g.values[y].storage] == 1 and last[g.values[z].storage] == 2
