"""The production solver: scale (10,000+ nodes), joint reordering + remat, anytime, determinism."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_graphs import transformer_like
from test_graph_plan_sim import random_graphs

from fitgraph.cost.base import BaseCostModel, NodeCost
from fitgraph.cost.devices import get_device
from fitgraph.cost.roofline import RooflineCostModel
from fitgraph.graph.deps import respects_dependencies
from fitgraph.graph.ir import GraphBuilder, Phase, Role
from fitgraph.plan.remat import remat_plan, remat_tables
from fitgraph.plan.verify import verify_plan
from fitgraph.sim.remat_eval import RematEvaluator
from fitgraph.sim.simulate import simulate
from fitgraph.solvers import BudgetInfeasible, Problem, solve
from fitgraph.solvers.remat.greedy import (
    LOCAL_MAX_EVALS,
    LOCAL_NODE_EVALS,
    Run,
    Search,
    local_evals,
)
from fitgraph.solvers.remat.hotspot import solve_hotspot
from fitgraph.solvers.remat.moves import build_moves

RTX3090 = RooflineCostModel(get_device("rtx3090"))


class Ms(BaseCostModel):
    """Every node 1 ms, no workspace."""

    name = "toy"

    def node_cost(self, g, n):
        return NodeCost(1e-3, 0)

    def copy_seconds(self, nbytes):
        return 0.0


def eager_peak(g, cm) -> int:
    return solve(Problem(g, cm, latency_limit=1.0), "eager").sim.peak_bytes


def check(g, cm, s, budget):
    """A solution is a valid plan whose simulated peak (re-simulated here) fits."""
    verify_plan(g, s.plan)
    assert s.sim.peak_bytes <= budget
    assert simulate(g, s.plan, cm).peak_bytes == s.sim.peak_bytes


def needs_reordering():
    """Three big forward temporaries live at once in the captured order (t_i = exp(x), each
    summed afterwards), and ``a`` saved for a backward that first allocates a big ``z``.
    Dropping ``a`` fixes the backward, reordering (t1, s1, t2, s2, ...) fixes the forward:
    only both together reach 1.5x one temporary."""
    n = 1024
    b = GraphBuilder()
    x = b.add_input("x", (4,), "float32", Role.PARAMETER)
    big, one = [((n,), "float32")], [((), "float32")]
    ts = [b.add_node("aten.exp.default", [x], big)[0] for _ in range(3)]
    ss = [b.add_node("aten.sum.default", [t], one)[0] for t in ts]
    a = b.add_node("aten.exp.default", [ss[0]], big)[0]
    y = b.add_node("aten.sum.default", [a], one)[0]
    loss = b.add_node("aten.mul.Tensor", [ss[1], ss[2], y], one, phase=Phase.LOSS)[0]
    z = b.add_node("aten.exp.default", [loss], big, phase=Phase.BACKWARD)[0]
    w = b.add_node("aten.sum.default", [z], one, phase=Phase.BACKWARD)[0]
    gx = b.add_node("aten.mul.Tensor", [w, a], [((4,), "float32")], phase=Phase.BACKWARD)[0]
    return b.finish({"loss": loss, "grad:x": gx}), int(1.5 * 4 * n)


def test_joint_reordering_and_remat_reach_what_remat_alone_cannot():
    g, budget = needs_reordering()
    assert eager_peak(g, Ms()) > 3 * budget / 1.5 - 64
    with pytest.raises(BudgetInfeasible):
        solve_hotspot(Problem(g, Ms(), budget_bytes=budget), reorder=False)
    s = solve(Problem(g, Ms(), budget_bytes=budget), "hotspot")
    check(g, Ms(), s, budget)
    assert "memory-aware order" in s.notes["order"]
    order = [ins.node for ins in s.plan if ins.op == "compute"]
    assert order != sorted(order)
    respects_dependencies(g, order)
    assert any(ins.op == "recompute" for ins in s.plan)


@pytest.fixture(scope="module")
def graph_10k():
    g = transformer_like(251)
    assert len(g.nodes) >= 10_000
    return g


def test_hotspot_plans_a_10k_node_graph(graph_10k):
    g = graph_10k
    budget = int(0.6 * eager_peak(g, RTX3090))
    s = solve(Problem(g, RTX3090, budget_bytes=budget), "hotspot")
    check(g, RTX3090, s, budget)
    assert s.plan.counts().get("recompute", 0) > 100


def test_hotspot_is_anytime(graph_10k):
    """Out of time at once, it still returns the best plan it holds (every block checkpointed,
    evaluated before the first deadline check), not over budget and without raising."""
    g = graph_10k
    every = solve(Problem(g, RTX3090, latency_limit=100.0), "checkpoint_blocks")
    budget = every.sim.peak_bytes
    s = solve(Problem(g, RTX3090, budget_bytes=budget, time_budget_s=1e-6), "hotspot")
    assert s.notes["timed_out"]
    check(g, RTX3090, s, budget)


@pytest.mark.parametrize("frac", [0.8, 0.6])
def test_hotspot_is_deterministic_with_batched_moves(frac):
    """40 layers: enough copies of each move to take them together (greedy.MIN_BATCH)."""
    g = transformer_like(40)
    budget = int(frac * eager_peak(g, RTX3090))
    a = solve(Problem(g, RTX3090, budget_bytes=budget), "hotspot")
    b = solve(Problem(g, RTX3090, budget_bytes=budget), "hotspot")
    check(g, RTX3090, a, budget)
    assert not a.notes["timed_out"] and a.plan == b.plan


@pytest.mark.slow
@pytest.mark.parametrize("frac", [0.8, 0.6, 0.4])
def test_bert_base_paper_plans_within_10_s(frac):
    """Issue 3: BERT-base, paper configuration (b32 s512, AdamW, fake tensors), RTX 3090
    roofline, planned within 10 s on this 2-core machine."""
    from fitgraph.bench.planning_speed import zoo_graph

    g = zoo_graph("bert-base", "paper")
    budget = int(frac * eager_peak(g, RTX3090))
    t0 = time.perf_counter()
    s = solve(Problem(g, RTX3090, budget_bytes=budget), "hotspot")
    assert time.perf_counter() - t0 < 10
    check(g, RTX3090, s, budget)
    assert not s.notes["timed_out"]


@pytest.mark.slow
def test_gpt2_paper_64_layers_plans_within_the_default_budget():
    """A captured 10,000-node graph (GPT-2 paper config, 64 layers) at 60% of eager."""
    from fitgraph.bench.planning_speed import deep_gpt2

    g = deep_gpt2(64)
    assert len(g.nodes) >= 10_000
    budget = int(0.6 * eager_peak(g, RTX3090))
    t0 = time.perf_counter()
    s = solve(Problem(g, RTX3090, budget_bytes=budget), "hotspot")
    assert time.perf_counter() - t0 < 30
    check(g, RTX3090, s, budget)
    assert not s.notes["timed_out"]


@settings(max_examples=40, deadline=None)
@given(random_graphs(), st.floats(0.3, 1.0), st.integers(1, 300))
def test_local_search_keeps_the_budget_and_never_slows_the_plan(case, frac, evals):
    """exchange and add_prune start from grow + prune and only ever accept a faster plan
    within the budget, whatever their evaluation budget."""
    g, cost = case
    budget = int(frac * eager_peak(g, cost))
    tables = remat_tables(g)
    ev = RematEvaluator(g, cost, tables=tables)
    moves = build_moves(g, cost, tables)
    search = Search(budget, float("inf"), time.perf_counter() + 60)
    run = Run(ev.evaluate(()), ev, "captured")
    run = search.prune(search.grow(run, moves), moves.blocks + run.added, moves)
    start = run.result
    for step in (search.exchange, search.add_prune):
        run = step(run, moves, evals)
        r = run.result
        assert (r.latency_s, r.peak_bytes) <= (start.latency_s, start.peak_bytes)
        if search.fits_peak(start.peak_bytes):
            assert search.fits_peak(r.peak_bytes)
        start = r
    sim = simulate(g, remat_plan(g, r.drop, tables=tables), cost)
    assert (sim.peak_bytes, sim.latency_s) == (r.peak_bytes, r.latency_s)


def test_local_search_budget_shrinks_with_the_graph():
    assert local_evals(10) == LOCAL_MAX_EVALS
    assert local_evals(10_000) == LOCAL_NODE_EVALS // 10_000 < local_evals(1_000)


def _plan_block_stack(name: str, blocks: int, batch: int, frac: float, dropout: bool = True):
    """hotspot on the zoo block stack at ``frac`` of its eager peak (RTX 3090 roofline costs):
    (the plan's step time / eager's, the Solution), after checking it fits in time."""
    import fitgraph
    from fitgraph.bench.derived import block_stack

    case = block_stack(name, blocks, batch, dropout=dropout)
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    eager = solve(Problem(g, RTX3090, latency_limit=1.0), "eager").sim
    budget = int(frac * eager.peak_bytes)
    s = solve(Problem(g, RTX3090, budget_bytes=budget, time_budget_s=60), "hotspot")
    assert s.sim.peak_bytes <= budget and not s.notes["timed_out"]
    return s.sim.latency_s / eager.latency_s, s


def test_hotspot_swaps_a_chain_of_small_drops_for_one_larger():
    # GPT-2's first two blocks at 60% of eager's peak: the greedy drops block 1's output
    # projection, dropouts and residual adds (~3.9% of the step); the ILP's schedule drops the
    # MLP up-projection instead (1.3%). Only "add one move, keep it, prune single nodes" finds
    # that swap: before it hotspot planned 1.192x of eager.
    slowdown, _ = _plan_block_stack("gpt2", 2, 8, 0.6)
    assert slowdown <= 1.17   # ILP's best known: 1.149x


def test_hotspot_lowers_twin_peaks_with_a_pair_of_moves():
    # BERT's first three blocks at 40% of eager's peak: grown from the captured order, the
    # greedy stalls 6% over the budget at two peaks of equal height (block 3's attention
    # backward, and block 2's once its softmax is dropped), where no single move lowers the
    # peak. A pair (block 2's softmax and its scores) does. The ILP's best known schedule
    # (900 s, gap 1.9%) is 1.243x; before pairs hotspot planned 1.301x.
    slowdown, _ = _plan_block_stack("bert-base", 3, 8, 0.4)
    assert slowdown <= 1.03 * 1.243


def test_hotspot_drops_per_use_where_the_ilp_recomputes_twice():
    # BERT's first three blocks without dropout at 40% of eager's peak: the ILP's proven
    # optimum (1.192x) recomputes block 2's attention layer norm twice — once to remake block
    # 3's input early in the backward, once for block 2's MLP much later — rather than hold it
    # in between. Dropping once only, hotspot could not fit the budget at all.
    slowdown, s = _plan_block_stack("bert-base", 3, 8, 0.4, dropout=False)
    assert s.notes["per_use"] > 0
    assert slowdown <= 1.03 * 1.192


def test_hotspot_looks_ahead_to_reach_the_optimum():
    # ResNet-50's first six bottlenecks at 60% of eager's peak: the ILP proves 1.074x optimal
    # (47 s). Taking the best-scoring move alone, hotspot stopped at 1.078x; evaluating the 8
    # best and taking the one that lowers the peak most per second added, it reaches 1.0737x.
    slowdown, _ = _plan_block_stack("resnet50", 6, 32, 0.6)
    assert slowdown <= 1.075


@settings(max_examples=30, deadline=None)
@given(random_graphs(), st.floats(1.0, 1.5))
def test_latency_mode_budget_searches_keep_the_limit_and_never_raise_the_peak(case, limit):
    """Latency mode: the budget-mode searches after the descent (``_bisect_budgets``) keep
    the limit, and their plan's peak is never above the descent's."""
    import fitgraph.solvers.remat.hotspot as hs

    g, cost = case
    eager = solve(Problem(g, cost, latency_limit=1.0), "eager").sim
    s = solve_hotspot(Problem(g, cost, latency_limit=limit, time_budget_s=60))
    verify_plan(g, s.plan)
    assert s.sim.latency_s <= limit * eager.latency_s * (1 + 1e-12)
    assert simulate(g, s.plan, cost) == s.sim
    descent = hs._solve(Problem(g, cost, latency_limit=limit, time_budget_s=30), True, True)
    assert s.sim.peak_bytes <= descent.sim.peak_bytes
    assert s.notes["bisected"] <= hs.BISECT_STEPS


def test_latency_mode_keeps_the_lowest_of_descent_and_budget_searches():
    """BERT small (generic CPU roofline) within 1.10x of eager: the budget searches (bisected)
    reached a peak 6.5% below the descent's, when chains stopped at views (descent 192.8 MB,
    bisected 180.2 MB); with chains through views the descent reaches 176.0 MB itself."""
    import fitgraph
    import fitgraph.solvers.remat.hotspot as hs
    from fitgraph import zoo

    case = zoo.build("bert-base", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    cm = RooflineCostModel(get_device("cpu-generic"))
    descent = hs._solve(Problem(g, cm, latency_limit=1.10, time_budget_s=30), True, True)
    s = solve_hotspot(Problem(g, cm, latency_limit=1.10, time_budget_s=60))
    assert s.sim.peak_bytes <= descent.sim.peak_bytes, s.notes
    assert s.sim.latency_s <= 1.10 * s.notes["eager_latency_s"]


def test_latency_mode_prune_undrops_a_drop_that_holds_more_than_it_frees():
    """Dropping ``c = sum(a)`` keeps its 4 KiB input ``a`` alive through the backward's peak to
    remake a scalar: in latency mode (no budget), prune takes it back: the peak falls."""
    b = GraphBuilder()
    x = b.add_input("x", (1024,), "float32", Role.PARAMETER)
    a = b.add_node("aten.exp.default", [x], [((1024,), "float32")])[0]
    c = b.add_node("aten.sum.default", [a], [((), "float32")])[0]
    f = b.add_node("aten.neg.default", [x], [((1024,), "float32")], phase=Phase.BACKWARD)[0]
    h = b.add_node("aten.mul.Tensor", [f, x], [((1024,), "float32")], phase=Phase.BACKWARD)[0]
    e = b.add_node("aten.mul.Tensor", [h, c], [((1024,), "float32")], phase=Phase.BACKWARD)[0]
    g = b.finish({"loss": e})
    c_node = g.values[c].producer
    tables = remat_tables(g)
    ev = RematEvaluator(g, Ms(), tables=tables)
    moves = build_moves(g, Ms(), tables)
    dropped = ev.evaluate({c_node})
    kept = ev.evaluate(())
    assert kept.peak_bytes < dropped.peak_bytes   # NOTE: the premise: the drop hurts
    search = Search(None, float("inf"), time.perf_counter() + 60)
    run = search.prune(Run(dropped, ev, "t"), [frozenset({c_node})], moves)
    assert not run.result.drop and run.result.peak_bytes == kept.peak_bytes
    # NOTE: within a latency limit the drop's undrop is taken too (it only saves time) ...
    limited = Search(None, 10.0, time.perf_counter() + 60)
    assert not limited.prune(Run(dropped, ev, "t"), [frozenset({c_node})], moves).result.drop
    # ... but not where the plan is over the limit already (nothing to keep)
    over = Search(None, 0.0, time.perf_counter() + 60)
    assert over.prune(Run(dropped, ev, "t"), [frozenset({c_node})], moves).result.drop


def test_a_forward_chain_goes_through_views_to_what_made_their_storage():
    """``clone(transpose(view(add(mm(x, w)))))`` read by the backward (nn.MultiheadAttention's
    packed q, k, v): dropping the clone alone keeps ``add`` (as big) to remake it, so the
    chain must take ``add`` and ``mm`` through the views."""
    from fitgraph.solvers.remat.candidates import forward_chains, remat_candidates

    b = GraphBuilder()
    x = b.add_input("x", (64, 32), "float32", Role.INPUT)
    w = b.add_input("w", (32, 96), "float32", Role.PARAMETER)
    mm = b.add_node("aten.mm.default", [x, w], [((64, 96), "float32")])[0]
    add = b.add_node("aten.add.Tensor", [mm, mm], [((64, 96), "float32")])[0]
    view = b.add_node("aten.view.default", [add], [((64, 3, 32), "float32")],
                      alias_of={0: add})[0]
    tr = b.add_node("aten.transpose.int", [view], [((3, 64, 32), "float32")],
                    alias_of={0: view})[0]
    packed = b.add_node("aten.clone.default", [tr], [((3, 64, 32), "float32")])[0]
    big = b.add_node("aten.exp.default", [x], [((64, 32), "float32")])[0]
    hold = b.add_node("aten.mul.Tensor", [big, big], [((64, 32), "float32")])[0]
    g1 = b.add_node("aten.mul.Tensor", [hold, x], [((64, 32), "float32")],
                    phase=Phase.BACKWARD)[0]
    g2 = b.add_node("aten.sum.default", [packed], [((), "float32")], phase=Phase.BACKWARD)[0]
    g = b.finish({"loss": g2, "grad:x": g1})
    assert g.values[view].storage == g.values[add].storage   # NOTE: the premise: views alias
    node = {g.values[v].producer: n for v, n in ((mm, "mm"), (add, "add"), (packed, "clone"))}
    chain = forward_chains(g, remat_candidates(g))[g.values[packed].producer]
    assert {node[n] for n in chain if n in node} == {"mm", "add", "clone"}
