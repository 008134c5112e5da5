"""The exact scheduler (issue 30): on random graphs its order is a topological order of the
dependencies, its peak never above the greedy order's or eager's (with and without a remat
drop set), and
on small graphs, with one window over the whole graph, the least of every topological order's."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_plan_sim import random_graphs

from fitgraph.graph.deps import dependencies
from fitgraph.plan.exact_order import exact_order, order_peak
from fitgraph.plan.reorder import memory_aware_order


def _topological(g, order) -> bool:
    deps = dependencies(g)
    at = {n: i for i, n in enumerate(order)}
    return sorted(order) == [n.id for n in g.nodes] and all(
        at[d] < at[n] for n, ds in deps.items() for d in ds)


@settings(max_examples=200, deadline=None)
@given(random_graphs(), st.integers(2, 12), st.randoms(use_true_random=False))
def test_never_above_the_greedy_and_always_topological(case, window, rnd):
    g, _ = case
    fwd = [n.id for n in g.nodes if n.phase.name == "FORWARD"]
    for drop in ([], [n for n in fwd if rnd.random() < 0.4]):
        order = exact_order(g, drop, window=window)
        assert _topological(g, order)
        greedy = memory_aware_order(g, "strict", drop)
        assert order_peak(g, order, drop) <= order_peak(g, greedy, drop)
        assert order_peak(g, order, drop) <= order_peak(g, [n.id for n in g.nodes], drop)


@settings(max_examples=120, deadline=None)
@given(random_graphs())
def test_one_window_over_a_small_graph_is_the_least_of_all_orders(case):
    g, _ = case
    if len(g.nodes) > 8:
        return
    deps = dependencies(g)
    best = min(order_peak(g, list(p)) for p in itertools.permutations(range(len(g.nodes)))
               if all(p.index(d) < p.index(n) for n, ds in deps.items() for d in ds))
    assert order_peak(g, exact_order(g, window=len(g.nodes))) == best


def test_a_window_too_wide_to_search_keeps_the_greedy_order():
    from fitgraph.graph.ir import GraphBuilder, Role

    b = GraphBuilder()
    x = b.add_input("x", (16,), "float32", Role.INPUT)
    # twelve independent branches: 2^12 sets of them run so far
    outs = [b.add_node("aten.op.default", [x], [((16 * (i + 1),), "float32")])[0]
            for i in range(12)]
    total = b.add_node("aten.op.default", outs[:3], [((1,), "float32")])[0]
    for o in outs[3:]:
        total = b.add_node("aten.op.default", [total, o], [((1,), "float32")])[0]
    g = b.finish({"loss": total})
    greedy = memory_aware_order(g, "strict")
    kept = exact_order(g, window=len(g.nodes), max_states=100)
    assert kept in (greedy, [n.id for n in g.nodes])       # one base order, unsearched
    assert order_peak(g, exact_order(g, window=len(g.nodes))) <= order_peak(g, greedy)


def test_the_benchmark_table():
    from fitgraph.bench.exact_order import markdown

    row = {"model": "m", "nodes": 3, "eager": 2 * 2**20, "strict": 2**20,
           "conservative": 2 * 2**20, "exact": 2**20, "exact_s": 0.25}
    table = markdown([row])
    assert "| m | 3 | 2.00 MiB | 1.00 MiB | 2.00 MiB | 1.00 MiB | 1.0000 | 0.2 s |" in table


def test_the_remat_benchmark_table():
    from fitgraph.bench.exact_order import markdown_remat

    row = {"model": "m", "budget": 0.8, "hotspot_peak": 2 * 2**20, "hotspot_latency_s": 1.0,
           "exact_peak": 2**20, "exact_latency_s": 1.0, "exact_s": 0.5}
    assert "| m | 0.8 | 2.00 MiB | 1.00 MiB | 0.5000 | 1.0000 | 0.5 s |" in markdown_remat([row])
