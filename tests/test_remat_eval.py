"""The fast remat evaluator gives the simulator's answer on the plan remat_plan builds."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_plan_sim import random_graphs

from fitgraph.graph.deps import dependencies
from fitgraph.graph.recompute_rules import recomputable
from fitgraph.plan.remat import RematError, per_use, remat_plan
from fitgraph.plan.reorder import memory_aware_order
from fitgraph.sim.remat_eval import RematEvaluator
from fitgraph.sim.simulate import simulate


def random_order(g, rnd: random.Random) -> list[int]:
    """A random topological order of graph.deps."""
    deps = dependencies(g)
    waiting = {n: len(d) for n, d in deps.items()}
    users: dict[int, list[int]] = {n: [] for n in deps}
    for n, d in deps.items():
        for p in d:
            users[p].append(n)
    ready = sorted(n for n, k in waiting.items() if k == 0)
    order = []
    while ready:
        n = ready.pop(rnd.randrange(len(ready)))
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    return order


def assert_same(g, cost, ev, drop, order, base=None):
    """The evaluator (from scratch, and from ``base``) agrees with simulating the plan; asked
    again, it answers from its memo the same."""
    try:
        plan = remat_plan(g, drop, order)
    except RematError:
        for b in (None, base):
            ev._memo.clear()   # NOTE: each path computes, none answers from the memo
            try:
                ev.evaluate(drop, b)
            except RematError:
                continue
            raise AssertionError("remat_plan raised, the evaluator did not") from None
        try:
            ev.evaluate(drop)
        except RematError:
            return None
        raise AssertionError("asked again, the evaluator did not raise") from None
    sim = simulate(g, plan, cost)
    for b in (None, base, "memo"):
        if b == "memo":
            r = ev.evaluate(drop, base)
            assert r is ev.evaluate(frozenset(drop))   # NOTE: the memo's answer, not a new one
        else:
            ev._memo.clear()
            r = ev.evaluate(drop, b)
        assert r.peak_bytes == sim.peak_bytes
        assert r.latency_s == sim.latency_s
        assert r.peak_live == sim.peak_live
        assert r.recomputes == plan.counts().get("recompute", 0)
        assert sorted(r.drop) == plan.meta["dropped"]
    return r


def with_per_use(g, drop: set[int], rnd: random.Random) -> set[int]:
    """``drop`` with about half its nodes dropped per use instead (``per_use`` entries)."""
    return {per_use(g, n) if rnd.random() < 0.5 else n for n in drop}


@settings(max_examples=300, deadline=None)
@given(random_graphs(), st.randoms(use_true_random=False), st.integers(0, 2), st.booleans())
def test_evaluator_equals_simulating_the_plan(case, rnd, which_order, per_use_too):
    g, cost = case
    order = [None, memory_aware_order(g, "strict"), random_order(g, rnd)][which_order]
    ev = RematEvaluator(g, cost, order)
    ok = recomputable(g)
    candidates = [n.id for n in g.nodes if not ok[n.id]]
    base = None
    for _ in range(4):  # NOTE: each step adds and removes nodes from the last one
        drop = {n for n in candidates if rnd.random() < 0.5}
        if per_use_too:
            drop = with_per_use(g, drop, rnd)
        base = assert_same(g, cost, ev, drop, order, base) or base
    assert_same(g, cost, ev, set(), order, base)


@settings(max_examples=25, deadline=None)
@given(st.randoms(use_true_random=False), st.booleans())
def test_evaluator_on_transformer_like_graphs(rnd, reorder):
    """Dropout's in-place chains (dropped as a unit), views of dropped storages, multi-output
    nodes; captured and drop-aware orders; from scratch and incrementally."""
    from synthetic_graphs import transformer_like

    from fitgraph.cost.devices import get_device
    from fitgraph.cost.roofline import RooflineCostModel

    g = transformer_like(3, seq=16, d=32)
    cost = RooflineCostModel(get_device("rtx3090"))
    ok = recomputable(g)
    candidates = [n.id for n in g.nodes if not ok[n.id]]
    first = {n for n in candidates if rnd.random() < 0.5}
    order = memory_aware_order(g, "strict", first) if reorder else None
    ev = RematEvaluator(g, cost, order)
    base = assert_same(g, cost, ev, first, order)
    for i in range(6):
        drop = set(base.drop) ^ set(rnd.sample(candidates, 3))
        if i % 2:  # NOTE: and some dropped per use, or back
            drop ^= {per_use(g, n) for n in rnd.sample(candidates, 3)}
        base = assert_same(g, cost, ev, drop, order, base) or base


@settings(max_examples=10, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([1, 2048]))
def test_kept_parts_answer_as_a_cold_evaluator(rnd, cache_size):
    """Parts taken from the evaluator's part cache (``recompute_parts.PART_CACHE``, here also
    one part, evicted all the time) give the answers a fresh evaluator computes."""
    from synthetic_graphs import transformer_like

    import fitgraph.sim.recompute_parts as parts
    from fitgraph.cost.devices import get_device
    from fitgraph.cost.roofline import RooflineCostModel

    g = transformer_like(3, seq=16, d=32)
    cost = RooflineCostModel(get_device("rtx3090"))
    ok = recomputable(g)
    candidates = [n.id for n in g.nodes if not ok[n.id]]
    ev = RematEvaluator(g, cost)
    old, parts.PART_CACHE = parts.PART_CACHE, cache_size
    try:
        cur = ev.evaluate({n for n in candidates if rnd.random() < 0.5})
        for i in range(12):  # NOTE: moves from cur, some taken: parts come back from the cache
            drop = set(cur.drop) ^ set(rnd.sample(candidates, 2))
            if i % 3 == 2:
                drop ^= {per_use(g, n) for n in rnd.sample(candidates, 2)}
            try:
                r = ev.evaluate(drop, cur)
            except RematError:
                continue
            cold = RematEvaluator(g, cost).evaluate(drop)
            assert (r.peak_bytes, r.latency_s, r.peak_live, r.recomputes, r.drop) == (
                cold.peak_bytes, cold.latency_s, cold.peak_live, cold.recomputes, cold.drop)
            if rnd.random() < 0.5:
                cur = r
    finally:
        parts.PART_CACHE = old
        assert len(ev.part_cache) <= cache_size


def test_split_drop_of_a_set_as_of_a_list():
    """split_drop's set path (set operations) answers as its loop over entries, and raises the
    same on an entry that names no node."""
    import pytest
    from synthetic_graphs import transformer_like

    from fitgraph.plan.remat import split_drop

    g = transformer_like(1, seq=8, d=16)
    n = len(g.nodes)
    for drop in ([], [0, 3, n + 3, n + 5], [n - 1, 2 * n - 1], [1, n + 1]):
        assert split_drop(g, frozenset(drop)) == split_drop(g, list(drop))
        assert split_drop(g, set(drop)) == split_drop(g, iter(drop))
    for bad in ([0, 2 * n], [-1, 3], [n + 1, -5]):
        for form in (frozenset, set, list):
            with pytest.raises(RematError, match="names no node"):
                split_drop(g, form(bad))
