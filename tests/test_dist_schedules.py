"""Pipeline schedules' bubbles and in-flight micro-batches (``fitgraph.dist.schedules``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fitgraph.dist.schedules import bubble_fraction, in_flight


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
