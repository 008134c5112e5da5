"""The copy stream as a planner sees it: busy stretches on the step's clock, and where a copy fits.

The simulator runs copies first in, first out: a copy starts when it is issued and the stream is
free. A copy issued into an idle stretch, and ending before the next busy one, therefore runs at
once and delays nobody; that is what ``latest_fit`` looks for, latest first, so that a prefetch
holds device memory as briefly as possible and is still hidden under compute.

Example:
    >>> from fitgraph.plan.copy_stream import CopyStream
    >>> s = CopyStream([(1.0, 2.0), (4.0, 5.0)])
    >>> issue = [0.0, 1.5, 2.5, 3.5, 4.5]   # the times one may issue the copy at
    >>> s.latest_fit(issue.__getitem__, 0, 5, seconds=1.0, deadline=6.0)  # 3.5, 4.5 overlap
    2
    >>> s.add(2.5, 1.0); s.busy
    [(1.0, 2.0), (2.5, 3.5), (4.0, 5.0)]
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

__all__ = ["TIME_EPS_S", "CopyStream"]

# NOTE: clocks are sums of float seconds; "ends by", "touches" and "overlaps" allow this slack
TIME_EPS_S = 1e-12


class CopyStream:
    """Disjoint busy intervals ``[start, end]`` of one copy stream, sorted; touching ones merge."""

    def __init__(self, spans: Iterable[tuple[float, float]] = ()) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        for start, end in sorted(spans):
            self.add(start, end - start)

    @property
    def busy(self) -> list[tuple[float, float]]:
        return list(zip(self.starts, self.ends))

    def overlap(self, start: float, end: float) -> int | None:
        """Index of the busy interval overlapping ``[start, end]`` that starts last, or None."""
        j = bisect.bisect_left(self.starts, end - TIME_EPS_S) - 1
        if j >= 0 and self.ends[j] > start + TIME_EPS_S:
            return j
        return None

    def latest_fit(self, issue_at: Callable[[int], float], lo: int, hi: int, seconds: float,
                   deadline: float) -> int | None:
        """The largest ``i`` in ``[lo, hi)`` such that a copy issued at ``issue_at(i)`` (a
        nondecreasing function) runs in idle time and ends by ``deadline``; None if none does."""
        points = range(hi)
        i = bisect.bisect_right(points, deadline - seconds + TIME_EPS_S, lo, hi, key=issue_at) - 1
        while i >= lo:
            start = issue_at(i)
            j = self.overlap(start, start + seconds)
            if j is None:
                return i
            # NOTE: jump past the whole busy interval: the copy must end before it starts
            limit = self.starts[j] - seconds + TIME_EPS_S
            i = bisect.bisect_right(points, limit, lo, i, key=issue_at) - 1
        return None

    def queued_start(self, issue: float) -> float:
        """When a copy issued at ``issue`` starts if it waits behind the busy interval it lands
        in (copies issued after it are taken as not pushed back: a planner's estimate)."""
        j = bisect.bisect_right(self.starts, issue + TIME_EPS_S) - 1
        if j >= 0 and self.ends[j] > issue:
            return self.ends[j]
        return issue

    def add(self, start: float, seconds: float) -> None:
        """Mark ``[start, start + seconds]`` busy, merged with the intervals it touches."""
        end = start + seconds
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.ends[i - 1] >= start - TIME_EPS_S:
            i -= 1
            start, end = self.starts[i], max(end, self.ends[i])
        j = i
        while j < len(self.starts) and self.starts[j] <= end + TIME_EPS_S:
            end = max(end, self.ends[j])
            j += 1
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]
