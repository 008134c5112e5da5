"""Stage cuts (``fitgraph.dist.partition``): ``partition_dp`` and ``partition_bisect`` against
brute force over every cut of a short chain.

The stage function of the random chains prices blocks ``first..last-1`` as stage ``k``: the sum
of their times times a factor of the stage index, and None (does not fit) when the number of
blocks times ``p - k`` exceeds a cap (a 1F1B pipeline's stage ``k`` holds ``p - k`` micro-batches:
the first stages hold the most). A stage's time never falls when it gains a block, and a stage
that does not fit never fits again with more blocks: both solvers' premise.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitgraph.dist.partition import bottleneck, partition_bisect, partition_dp


def _chain_stage(times, p, rate, cap):
    """Stage ``k`` of ``p``: sum of the block times × ``1 + rate·(p-1-k)`` when ``rate`` ≥ 0
    (the first stages dearer, as under 1F1B) or ``1 + |rate|·k`` when ``rate`` < 0 (the last
    ones dearer); None when ``blocks·(p-k) > cap``."""
    factor = [1.0 + rate * (p - 1 - k) if rate >= 0 else 1.0 - rate * k for k in range(p)]

    def stage(first, last, k):
        if cap is not None and (last - first) * (p - k) > cap:
            return None
        return sum(times[first:last]) * factor[k]

    return stage


def _brute(n, p, stage):
    """(least bottleneck, least sum of stage times among the cuts of that bottleneck), or None
    when no cut fits: every way to cut ``n`` blocks into ``p`` contiguous non-empty stages."""
    best = None
    for inner in itertools.combinations(range(1, n), p - 1):
        ends = (0, *inner, n)
        times = [stage(a, b, k) for k, (a, b) in enumerate(zip(ends[:-1], ends[1:]))]
        if any(t is None for t in times):
            continue
        key = (max(times), sum(times))
        if best is None or key < best:
            best = key
    return best


def _check_cover(cuts, n, p):
    assert len(cuts) == p
    assert cuts[0][0] == 0 and cuts[-1][1] == n
    for (_, b), (c, _) in zip(cuts, cuts[1:]):
        assert b == c
    assert all(b > a for a, b in cuts)


def _stage_times(cuts, stage):
    return [stage(a, b, k) for k, (a, b) in enumerate(cuts)]


# -- random chains against brute force -------------------------------------------------------

_times = st.lists(st.floats(0.01, 100.0, allow_nan=False, allow_infinity=False),
                  min_size=1, max_size=9)


@st.composite
def _chains(draw, rates):
    times = draw(_times)
    n = len(times)
    p = draw(st.integers(1, n))
    rate = draw(rates)
    cap = draw(st.one_of(st.none(), st.integers(1, 3 * n)))
    return times, p, rate, cap


@settings(max_examples=250, deadline=None)
@given(_chains(st.sampled_from([0.0, 0.1, 0.5, -0.05, -0.1])))
def test_dp_bottleneck_is_the_brute_force_optimum(chain):
    times, p, rate, cap = chain
    n = len(times)
    stage = _chain_stage(times, p, rate, cap)
    best = _brute(n, p, stage)
    cuts = partition_dp(n, p, stage)
    assert (cuts is None) == (best is None)
    if cuts is None:
        return
    _check_cover(cuts, n, p)
    ts = _stage_times(cuts, stage)
    assert None not in ts
    # NOTE: the same stage values as brute force's, so the same max exactly
    assert max(ts) == best[0] == bottleneck(cuts, stage)


@settings(max_examples=250, deadline=None)
@given(_chains(st.sampled_from([0.0, -0.05, -0.1, -0.3])))
def test_bisect_is_optimal_when_later_stages_are_no_cheaper(chain):
    """Factor non-decreasing in ``k`` (and the memory cap tightest on the first stages): the
    greedy longest-prefix probe is exact, so bisection finds the optimum within its tolerance."""
    times, p, rate, cap = chain
    n = len(times)
    stage = _chain_stage(times, p, rate, cap)
    best = _brute(n, p, stage)
    cuts = partition_bisect(n, p, stage)
    assert (cuts is None) == (best is None)
    if cuts is None:
        return
    _check_cover(cuts, n, p)
    assert None not in _stage_times(cuts, stage)
    assert bottleneck(cuts, stage) <= best[0] * (1 + 1e-9)
    assert bottleneck(cuts, stage) >= best[0]


@settings(max_examples=250, deadline=None)
@given(_chains(st.sampled_from([0.1, 0.5])))
def test_bisect_finds_a_fitting_cut_exactly_when_one_exists(chain):
    """Whatever the stage factor: None exactly when no cut fits, else a cover of the chain
    whose every stage fits, no better than the optimum."""
    times, p, rate, cap = chain
    n = len(times)
    stage = _chain_stage(times, p, rate, cap)
    best = _brute(n, p, stage)
    cuts = partition_bisect(n, p, stage)
    assert (cuts is None) == (best is None)
    if cuts is not None:
        _check_cover(cuts, n, p)
        assert None not in _stage_times(cuts, stage)
        assert bottleneck(cuts, stage) >= best[0]


def _seeded_chains(seed, count, rate):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        times = [rng.uniform(0.1, 10.0) for _ in range(n)]
        cap = rng.choice([None, rng.randint(1, 3 * n)])
        yield times, p, _chain_stage(times, p, rate, cap)


def test_bisect_is_optimal_when_the_first_stages_are_dearer():
    misses = []
    for times, p, stage in _seeded_chains(7, 400, 0.1):
        best = _brute(len(times), p, stage)
        cuts = partition_bisect(len(times), p, stage)
        if best is not None and bottleneck(cuts, stage) > best[0] * (1 + 1e-9):
            misses.append((times, p, cuts, bottleneck(cuts, stage), best[0]))
    assert not misses, f"{len(misses)} of 400 chains: first {misses[0]}"


def test_bisect_minimal_first_stages_dearer():
    times, p = [1.0, 1.0, 10.0, 0.5], 3
    stage = _chain_stage(times, p, 0.1, None)
    assert partition_dp(4, p, stage) == [(0, 1), (1, 2), (2, 4)]
    assert bottleneck(partition_dp(4, p, stage), stage) == pytest.approx(10.5)
    assert bottleneck(partition_bisect(4, p, stage), stage) == pytest.approx(10.5)


def test_dp_tie_break_is_the_least_sum_among_optimal_cuts():
    misses = []
    for rate in (0.1, -0.1):
        for times, p, stage in _seeded_chains(11, 300, rate):
            best = _brute(len(times), p, stage)
            cuts = partition_dp(len(times), p, stage)
            if best is None:
                continue
            total = sum(_stage_times(cuts, stage))
            if total > best[1] * (1 + 1e-12):
                misses.append((times, p, rate, cuts, total, best[1]))
    assert not misses, f"{len(misses)} chains: first {misses[0]}"


def test_dp_tie_break_minimal():
    times, p = [1.0, 1.0, 2.0, 4.0], 3
    stage = _chain_stage(times, p, 0.1, None)
    cuts = partition_dp(4, p, stage)
    assert bottleneck(cuts, stage) == 4.0
    assert sum(_stage_times(cuts, stage)) == pytest.approx(8.5)


# -- hand cases ------------------------------------------------------------------------------

def _plain(times):
    return lambda first, last, k: float(sum(times[first:last]))


def test_the_docstring_chain():
    times = [3, 1, 1, 1, 2, 2]
    stage = _plain(times)
    dp, bis = partition_dp(6, 3, stage), partition_bisect(6, 3, stage)
    assert dp == bis == [(0, 1), (1, 4), (4, 6)]
    assert bottleneck(dp, stage) == bottleneck(bis, stage) == 4.0 == _brute(6, 3, stage)[0]


@pytest.mark.parametrize("solver", [partition_dp, partition_bisect])
def test_one_stage_takes_every_block(solver):
    times = [2.0, 5.0, 1.0]
    assert solver(3, 1, _plain(times)) == [(0, 3)]
    assert solver(1, 1, _plain([4.0])) == [(0, 1)]
    assert solver(3, 1, lambda a, b, k: None) is None


@pytest.mark.parametrize("solver", [partition_dp, partition_bisect])
def test_as_many_stages_as_blocks(solver):
    times = [2.0, 5.0, 1.0, 3.0]
    cuts = solver(4, 4, _plain(times))
    assert cuts == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert bottleneck(cuts, _plain(times)) == 5.0


@pytest.mark.parametrize("solver", [partition_dp, partition_bisect])
def test_more_stages_than_blocks_or_nothing_fits(solver):
    assert solver(3, 4, _plain([1.0, 1.0, 1.0])) is None
    assert solver(3, 2, lambda a, b, k: None) is None
    # NOTE: every stage fits one block only: three blocks cannot go in two stages
    assert solver(3, 2, lambda a, b, k: 1.0 if b - a == 1 else None) is None
    with pytest.raises(ValueError):
        solver(0, 1, _plain([]))
    with pytest.raises(ValueError):
        solver(3, 0, _plain([1.0, 1.0, 1.0]))


@pytest.mark.parametrize("solver", [partition_dp, partition_bisect])
def test_same_inputs_same_cuts(solver):
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 12)
        p = rng.randint(1, n)
        # NOTE: small integers: many ties, where a solver's order of search shows
        times = [float(rng.randint(1, 3)) for _ in range(n)]
        stage = _chain_stage(times, p, rng.choice([0.0, 0.1]), rng.choice([None, 2 * n]))
        assert solver(n, p, stage) == solver(n, p, stage)


def test_brute_force_counts_every_cut():
    calls = []

    def stage(a, b, k):
        calls.append((a, b, k))
        return 1.0

    _brute(6, 3, stage)
    assert len(calls) == 3 * math.comb(5, 2)
