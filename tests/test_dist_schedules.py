"""Pipeline schedules' bubbles and in-flight micro-batches (``fitgraph.dist.schedules``); ZB-V's
held vectors against the simulator."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitgraph.dist.schedules import bubble_fraction, in_flight, zbv_held
from fitgraph.dist.simulate import chunk_device, simulate


@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 4))
def test_interleaving_shrinks_the_bubble_and_holds_more(p, k, v):
    m = p * k
    assert bubble_fraction("interleaved", p, m, v) == pytest.approx(
        bubble_fraction("1f1b", p, m) / v)
    assert bubble_fraction("gpipe", p, m) == bubble_fraction("1f1b", p, m)
    for stage in range(p):
        one = in_flight("1f1b", p, m, stage)
        assert 1 <= one <= in_flight("gpipe", p, m, stage) == m
        if v > 1 and m >= 2 * p:
            assert in_flight("interleaved", p, m, stage, v) >= one - 1
    # NOTE: the first stage holds the most, the last one micro-batch (1F1B)
    assert in_flight("1f1b", p, m, 0) == min(p, m) and in_flight("1f1b", p, m, p - 1) == 1


def test_what_a_schedule_cannot_run_is_named():
    with pytest.raises(ValueError, match="multiple of the stages"):
        bubble_fraction("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        bubble_fraction("zb", 4, 8)
    with pytest.raises(ValueError, match="one chunk per device"):
        in_flight("1f1b", 4, 8, 0, v=2)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40), st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.data())
def test_zbv_held_gives_the_simulated_peak_of_each_device_exactly(p, m, w_hold, data):
    """For any act_bytes per chunk and any w_hold: the device's simulated peak is the max over
    zbv_held's vectors of h0 * act[first chunk] + h1 * act[second chunk]. Whole bytes and
    dyadic w_hold keep the simulator's running sums exact, so equality is exact."""
    n = 2 * p
    act = [float(x) for x in data.draw(st.lists(st.integers(0, 10**6), min_size=n,
                                                max_size=n))]
    tl = simulate("zb-v", [1.0] * n, [1.0] * n, m, v=2, w_s=[1.0] * n, act_bytes=act,
                  w_hold=w_hold)
    for d in range(p):
        first, second = d, 2 * p - 1 - d
        assert [chunk_device("zb-v", p, 2, k) for k in (first, second)] == [d, d]
        vecs = zbv_held(p, m, d)
        assert len(vecs) == len(set(vecs)) and all(h0 >= 0 and h1 >= 0 for h0, h1 in vecs)
        assert max(h0 * act[first] + h1 * act[second] for h0, h1 in vecs) == tl.peak_bytes[d]


@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 8), (4, 16), (8, 13), (8, 32), (16, 40)])
def test_zbv_held_with_the_default_w_hold_and_real_sizes(p, m):
    rng = random.Random(p * 1000 + m)
    n = 2 * p
    act = [rng.uniform(1e6, 5e9) for _ in range(n)]
    tl = simulate("zb-v", [rng.random() for _ in range(n)], [rng.random() for _ in range(n)],
                  m, v=2, w_s=[rng.random() for _ in range(n)], act_bytes=act,
                  p2p_s=[rng.random() for _ in range(n - 1)])
    for d in range(p):
        want = max(h0 * act[d] + h1 * act[2 * p - 1 - d] for h0, h1 in zbv_held(p, m, d))
        assert want == pytest.approx(tl.peak_bytes[d], rel=1e-12)
    # NOTE: with m >= 2p - 1 every device reaches 2p chunk micro-batches, 1F1B's first stage
    if m >= 2 * p - 1:
        assert all(max(map(sum, zbv_held(p, m, d))) == 2 * p for d in range(p))


def test_zbv_held_by_hand():
    # NOTE: device 0 of p = 2, m = 4: F0 F0 F0 (3, 0); F3 (3, 1) B3 W3; F3 (3, 1) B3 W3;
    # F0 (4, 0) B0 W0; F3 (3, 1) B3 W3; B0 W0 F3 (2, 1) ...
    assert zbv_held(2, 4, 0) == [(1, 0), (2, 0), (3, 0), (3, 1), (4, 0), (2, 1)]
    assert zbv_held(1, 3, 0) == [(1, 0), (1, 1), (2, 0)]


@pytest.mark.parametrize(("args", "message"), [
    ((0, 4, 0), "p = 0"), ((4, 0, 0), "m = 0"), ((4, 8, 4), "stage 4 of 4"),
    ((4, 8, -1), "stage -1 of 4")])
def test_zbv_held_names_what_it_cannot_do(args, message):
    with pytest.raises(ValueError, match=message):
        zbv_held(*args)
