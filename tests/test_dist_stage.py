"""A stage's memory plan (``fitgraph.dist.stage``): ``plan_stage`` and ``hull`` against brute
force on small synthetic curves, named policies, per-block in-flight counts, and a GPT layer's
real curve.

Synthetic blocks are ``BlockCost``s built directly around an op-less ``Block``; their bytes are
integers so that the brute force's and the planner's sums are exact and a budget met to the
byte is met by both.
"""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from fitgraph.dist.block_cost import BlockCost, MemoryOption
from fitgraph.dist.memory import MIXED_ADAM, MIXED_SGD, parameter_bytes
from fitgraph.dist.ops import Block
from fitgraph.dist.stage import backward_excess, hull, plan_stage

PRECISION = MIXED_ADAM


def _cost(options, role="body", params=100.0, name="b"):
    block = Block(name, "synthetic", (), params, 0.0, 0.0, role=role)
    return BlockCost(block, 1.0, 2.0, 1.0, 0.0, 0.0, tuple(options))


def _curve(rng, m, working, convex):
    """``m`` options, kept bytes strictly decreasing, recompute strictly increasing from 0.
    ``convex``: every option a vertex of the lower convex hull (the seconds per byte freed rise
    step by step). ``working``: "const" (one value for every option), "freed" (a base plus the
    bytes freed, as ``price_block`` makes them) or "any"."""
    if convex:
        kept, rec, slope = [rng.randint(600, 1000)], [0.0], 0.0
        for _ in range(m - 1):
            slope += rng.uniform(1e-3, 1e-2)
            step = rng.randint(1, max(1, (kept[-1] - 1) // 2))
            kept.append(kept[-1] - step)
            rec.append(rec[-1] + slope * step)
    else:
        kept = sorted(rng.sample(range(1, 1001), m), reverse=True)
        rec = [0.0, *sorted(rng.uniform(1e-4, 1.0) for _ in range(m - 1))]
    base = rng.choice([0, rng.randint(0, 500)])
    out = []
    for i, (k, r) in enumerate(zip(kept, rec)):
        w = {"const": base, "freed": base + kept[0] - k, "any": rng.randint(0, 800)}[working]
        out.append(MemoryOption(f"o{i}", (), float(k), r, float(w)))
    return out


def _fixed(costs, precision=PRECISION, zero=0, dp=1):
    return sum(parameter_bytes(sum(c.block.params for c in costs), precision, zero, dp).values())


def _peak(costs, flights, choice):
    return (_fixed(costs) + sum(f * o.kept_bytes for f, o in zip(flights, choice))
            + max(o.working_bytes for o in choice))


def _brute(costs, flights, budget):
    """The least total recompute over every assignment of one option per block that fits
    ``budget``, or None."""
    best = None
    for choice in itertools.product(*(c.options for c in costs)):
        if _peak(costs, flights, choice) <= budget:
            r = sum(o.recompute_s for o in choice)
            best = r if best is None else min(best, r)
    return best


def _hull_step(costs):
    """The largest recompute one block adds by moving one step along its curve's hull."""
    steps = [0.0]
    for c in costs:
        h = hull(c.options)
        steps += [c.options[b].recompute_s - c.options[a].recompute_s for a, b in zip(h, h[1:])]
    return max(steps)


def _cases(seed, count, working, convex=None, identical=None):
    """(costs, flights, budget): 1–5 blocks of 2–4 options, flights ≥ 1, budgets from below
    the most recompute's peak to above the least's (integers: ties to the byte happen)."""
    rng = random.Random(seed)
    for _ in range(count):
        n, m = rng.randint(1, 5), rng.randint(2, 4)
        conv = rng.random() < 0.5 if convex is None else convex
        same = rng.random() < 0.5 if identical is None else identical
        if same:
            costs = [_cost(_curve(rng, m, working, conv), params=float(rng.randint(0, 200)))] * n
        else:
            costs = [_cost(_curve(rng, m, working, conv), params=float(rng.randint(0, 200)))
                     for _ in range(n)]
        if rng.random() < 0.6:
            flights = [float(rng.choice([1, 2, 3, 4, 8, 16]))] * n
        else:
            flights = [float(rng.choice([1, 2, 3, 4, 8, 16])) for _ in range(n)]
        most = _peak(costs, flights, [c.options[-1] for c in costs])
        least = _peak(costs, flights, [c.options[0] for c in costs])
        lo, hi = min(most, least), max(most, least)
        budget = float(rng.randint(int(lo * 0.95), int(hi * 1.05) + 1))
        yield costs, flights, budget


def _check_plan(st, costs, flights, budget):
    """A plan's figures are its options' (and fits ``budget``)."""
    chosen = [c.option(name) for c, name in zip(costs, st.plan)]
    assert st.recompute_s == pytest.approx(sum(o.recompute_s for o in chosen), rel=1e-12)
    assert st.held_bytes == sum(f * o.kept_bytes for f, o in zip(flights, chosen))
    # NOTE: the greedy fits under the largest working set (``_peak``); the plan's predicted
    # peak walks the backward (what the blocks after each have freed), never above that
    assert st.working_bytes == backward_excess(chosen)
    assert st.working_bytes <= max(o.working_bytes for o in chosen)
    assert st.peak_bytes <= _peak(costs, flights, chosen) <= budget
    return chosen


# -- auto against brute force ----------------------------------------------------------------

@pytest.mark.parametrize("working", ["const", "freed"])
def test_auto_fits_exactly_when_some_plan_fits_and_never_beats_brute_force(working):
    """Working bytes constant, or a base plus the bytes freed (``price_block``'s curves), and
    every block held at least once: the most recompute is the least peak, so the greedy (which
    walks to it before giving up) returns None exactly when nothing fits."""
    for costs, flights, budget in _cases(1, 400, working):
        best = _brute(costs, flights, budget)
        st = plan_stage(costs, flights, budget, PRECISION)
        assert (st is None) == (best is None), (costs, flights, budget)
        if st is not None:
            _check_plan(st, costs, flights, budget)
            assert st.recompute_s >= best - 1e-12 * max(1.0, best)


@pytest.mark.parametrize("convex,identical", [(True, True), (True, False), (False, True),
                                              (False, False)])
def test_auto_is_within_one_hull_step_of_the_optimum(convex, identical):
    """Constant working bytes: the memory left is a knapsack of separable convex costs once each
    curve is replaced by its lower hull. Taking hull steps cheapest per byte freed (per block
    held ``f`` times) first is that relaxation's optimum, which is no worse than the best mix of
    options; the greedy moves whole blocks, so the last group it moves rounds up by at most one
    block's step. Hence recompute ≤ optimum + the largest hull step of any block (on convex
    curves of identical blocks: exact on the hull up to one block's step)."""
    for costs, flights, budget in _cases(2, 300, "const", convex, identical):
        best = _brute(costs, flights, budget)
        st = plan_stage(costs, flights, budget, PRECISION)
        assert (st is None) == (best is None)
        if st is None:
            continue
        _check_plan(st, costs, flights, budget)
        tol = 1e-9 * max(1.0, best)
        assert best - tol <= st.recompute_s <= best + _hull_step(costs) + tol


def test_auto_with_any_working_bytes_still_fits_when_the_most_recompute_fits():
    """Working bytes free of the curve: the greedy still never returns a plan over budget nor
    beats brute force, and it finds a plan whenever every block's last hull point fits (the
    docstring's "None when even the most recompute does not fit"). A mix of options may fit
    where the most recompute does not; the greedy need not find it."""
    for costs, flights, budget in _cases(3, 300, "any"):
        best = _brute(costs, flights, budget)
        st = plan_stage(costs, flights, budget, PRECISION)
        last = [c.options[hull(c.options)[-1]] for c in costs]
        if _peak(costs, flights, last) <= budget:
            assert st is not None
        if st is not None:
            _check_plan(st, costs, flights, budget)
            assert st.recompute_s >= best - 1e-12 * max(1.0, best)


def test_auto_takes_no_recompute_when_everything_fits_and_none_when_nothing_does():
    rng = random.Random(4)
    costs = [_cost(_curve(rng, 4, "const", True)) for _ in range(3)]
    flights = [2.0, 1.0, 3.0]
    roomy = _peak(costs, flights, [c.options[0] for c in costs])
    st = plan_stage(costs, flights, roomy, PRECISION)
    assert st.recompute_s == 0.0 and st.plan == ("o0",) * 3 and st.peak_bytes <= roomy
    tight = _peak(costs, flights, [c.options[-1] for c in costs])
    assert plan_stage(costs, flights, tight, PRECISION).plan == ("o3",) * 3
    assert plan_stage(costs, flights, tight - 1, PRECISION) is None
    # NOTE: the parameters alone over budget
    assert plan_stage(costs, flights, _fixed(costs) - 1, PRECISION) is None


# -- the hull --------------------------------------------------------------------------------

def _brute_hull(options):
    """Vertices of the lower convex hull of (kept, recompute), exact in rationals: per kept
    value its first (cheapest) option; a point is a vertex when strictly below every chord
    between a point on its left and one on its right; both ends are."""
    pts = {}
    for i, o in enumerate(options):
        pts.setdefault(Fraction(o.kept_bytes), (i, Fraction(o.recompute_s)))
    xs = sorted(pts, reverse=True)
    out = []
    for x in xs:
        i, y = pts[x]
        if x in (xs[0], xs[-1]) or all(
                y < pts[a][1] + (pts[c][1] - pts[a][1]) * (a - x) / (a - c)
                for a in xs if a > x for c in xs if c < x):
            out.append(i)
    return out


@pytest.mark.parametrize("grid", [True, False])
def test_hull_is_the_lower_convex_hull(grid):
    rng = random.Random(5 + grid)
    for _ in range(500):
        m = rng.randint(1, 8)
        if grid:
            # NOTE: small integers: repeated kept values and collinear points
            pts = [(float(rng.randint(0, 12)), float(rng.randint(0, 8))) for _ in range(m)]
        else:
            pts = [(rng.uniform(0, 1e9), rng.uniform(0, 1e-2)) for _ in range(m)]
        pts.sort(key=lambda kr: (-kr[0], kr[1]))
        options = [MemoryOption(f"o{i}", (), k, r, 0.0) for i, (k, r) in enumerate(pts)]
        assert hull(options) == _brute_hull(options), pts


def test_hull_of_a_convex_curve_is_all_of_it_and_drops_what_lies_above():
    opts = [MemoryOption(f"o{i}", (), k, r, 0.0)
            for i, (k, r) in enumerate([(10, 0), (6, 1), (3, 3), (1, 6), (0, 10)])]
    assert hull(opts) == [0, 1, 2, 3, 4]
    # NOTE: (5, 3) lies above the chord (6, 1)-(3, 3); (2, 4) on the chord (3, 3)-(1, 5)
    opts = [MemoryOption(f"o{i}", (), k, r, 0.0)
            for i, (k, r) in enumerate([(10, 0), (6, 1), (5, 3), (3, 3), (2, 4), (1, 5)])]
    assert hull(opts) == [0, 1, 3, 5]


# -- named policies, per-block in-flight -----------------------------------------------------

def _named(role, names=("none", "selective", "full"), params=10.0):
    opts = [MemoryOption(name, (), float(100 - 40 * i), float(i), float(7 * i))
            for i, name in enumerate(names)]
    return _cost(opts, role=role, params=params, name=role)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_a_named_policy_applies_to_body_blocks_only(policy):
    costs = [_named("embedding"), _named("body"), _named("body", ("none", "full")),
             _named("head")]
    st = plan_stage(costs, 2, 1e12, PRECISION, recompute=policy)
    body_without = policy if policy != "selective" else "none"
    assert st.plan == ("none", policy, body_without, "none")
    assert st.blocks == ("embedding", "body", "body", "head")
    _check_plan(st, costs, [2.0] * 4, 1e12)
    # NOTE: a named policy is applied whether it fits or not (the caller reads peak_bytes)
    tiny = plan_stage(costs, 2, 1.0, PRECISION, recompute=policy)
    assert tiny is not None and tiny.plan == st.plan and tiny.peak_bytes > 1.0


def test_per_block_in_flight_counts():
    rng = random.Random(6)
    costs = [_cost(_curve(rng, 4, "freed", False), params=float(p), name=f"b{i}")
             for i, p in enumerate((10, 20, 30, 40))]
    flights = [4, 3.0, 2, 1.5]
    for policy in ("none", "full", "auto"):
        st = plan_stage(costs, flights, 1e9, PRECISION, recompute=policy)
        chosen = [c.option(name) for c, name in zip(costs, st.plan)]
        assert st.held_bytes == st.activations == sum(
            f * o.kept_bytes for f, o in zip(flights, chosen))
        assert st.kept_bytes == sum(o.kept_bytes for o in chosen)
        assert st.in_flight == 4.0
        assert st.peak_bytes == (st.weights + st.gradients + st.optimizer + st.held_bytes
                                 + st.working_bytes)
        assert (st.weights, st.gradients, st.optimizer) == tuple(
            parameter_bytes(100.0, PRECISION, 0, 1).values())
        assert st.time_s == st.fwd_s + st.bwd_s
        assert st.bwd_s == pytest.approx(sum(c.bwd_s for c in costs) + st.recompute_s)
    with pytest.raises(ValueError, match="in-flight"):
        plan_stage(costs, [1.0, 2.0], 1e9, PRECISION)
    with pytest.raises(ValueError, match="at least one block"):
        plan_stage([], 1, 1e9, PRECISION)


@pytest.mark.parametrize("zero,dp", [(1, 4), (2, 4), (3, 4)])
def test_zero_shards_the_parameter_terms_and_zero3_gathers(zero, dp):
    costs = [_named("body", params=float(p)) for p in (10, 30)]
    st = plan_stage(costs, 1, 1e12, MIXED_SGD, zero=zero, dp=dp, recompute="full")
    assert (st.weights, st.gradients, st.optimizer) == tuple(
        parameter_bytes(40.0, MIXED_SGD, zero, dp).values())
    gather = 2 * MIXED_SGD.weight * 30.0 if zero >= 3 else 0.0
    assert st.working_bytes == 14.0 + gather
    assert st.peak_bytes == st.weights + st.gradients + st.optimizer + 2 * 20.0 + 14.0 + gather


# -- a GPT layer's real curve ----------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_layer_cost():
    from fitgraph.cost.devices import get_device
    from fitgraph.dist.block_cost import price_block
    from fitgraph.dist.cluster import LINKS
    from fitgraph.dist.gpt_blocks import gpt_layer
    from fitgraph.dist.megatron_table import GptShape

    return price_block(gpt_layer(GptShape(24, 2304, 24), 1, 1), get_device("a100-80gb"),
                       LINKS["nvlink3"])


def test_gpt_layer_curve_is_a_pareto_front(gpt_layer_cost):
    opts = gpt_layer_cost.options
    assert opts[0].name == "none" and opts[0].recompute_s == 0.0 and opts[0].dropped == ()
    full = gpt_layer_cost.option("full")
    assert full.kept_bytes == min(o.kept_bytes for o in opts)
    assert all(o.kept_bytes > full.kept_bytes for o in opts if o is not full)
    assert full.recompute_s == pytest.approx(gpt_layer_cost.fwd_s, rel=1e-9)
    # NOTE: named plans (Megatron's "selective") are kept even when dominated; the rest is
    # the front: fewer kept bytes always cost more seconds
    named = {name for name, _ in gpt_layer_cost.block.options}
    assert "selective" in named and any(o.name == "selective" for o in opts)
    front = [o for o in opts if o.name not in named]
    assert len(front) >= 3
    for a, b in zip(front, front[1:]):
        assert a.kept_bytes > b.kept_bytes and a.recompute_s < b.recompute_s, (a, b)
    assert all(o.kept_bytes >= p.kept_bytes for o, p in zip(opts, opts[1:]))


def test_gpt_layer_stage_recomputes_more_as_more_is_held(gpt_layer_cost):
    budget = 80 * 2**30
    costs = [gpt_layer_cost] * 24
    last = -1.0
    for f in (1, 2, 4, 8, 16):
        st = plan_stage(costs, f, budget, PRECISION)
        assert st is not None and st.peak_bytes <= budget
        assert st.recompute_s >= last
        last = st.recompute_s
        assert st.held_bytes == pytest.approx(
            f * sum(gpt_layer_cost.option(n).kept_bytes for n in st.plan), rel=1e-12)
    assert last > 0
    # NOTE: one micro-batch in flight fits without recompute (the weights and Adam: 16 B each)
    assert plan_stage(costs, 1, budget, PRECISION).plan == ("none",) * 24
    assert math.isclose(plan_stage(costs, 16, budget, PRECISION, recompute="full").recompute_s,
                        24 * gpt_layer_cost.fwd_s, rel_tol=1e-9)
