"""Cut a chain of blocks into contiguous pipeline stages: the least bottleneck stage time.

``stage(first, last, k)`` prices blocks ``first..last-1`` as stage ``k`` (its memory plan
included; None when they do not fit its device). Two exact solvers of the same problem:

- ``partition_dp``: the dynamic program over (stages, blocks) of Piper and Alpa, ``best[k][i] =
  min_j max(best[k-1][j], stage(j, i, k))``, ties broken by the least sum of stage times;
  O(p n²) stage prices — for short chains and as the reference.
- ``partition_bisect``: bisection on the bottleneck; for a bound ``T`` the first stage takes the
  longest prefix whose time is at most ``T``, then the next stage, and so on — feasible within
  ``p`` stages iff ``T`` is at least the optimum, because a stage's time never falls when it
  gains a block (more work, less memory). O(p log n) stage prices per probe, which is what
  makes GPT-3 on 1024 devices plan in seconds.

Both return the cuts ``[(first, last), ...]`` (one per stage) or None when no cut fits.

Example:
    >>> times = [3, 1, 1, 1, 2, 2]
    >>> def stage(first, last, k):
    ...     return float(sum(times[first:last]))
    >>> partition_dp(len(times), 3, stage), partition_bisect(len(times), 3, stage)  # both 4
    ([(0, 1), (1, 4), (4, 6)], [(0, 2), (2, 5), (5, 6)])
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["StageFn", "bottleneck", "partition_bisect", "partition_dp"]

StageFn = Callable[[int, int, int], "float | None"]


def _t(stage: StageFn, first: int, last: int, k: int) -> float:
    value = stage(first, last, k)
    return math.inf if value is None else float(value)


def _check(n: int, p: int) -> None:
    if p < 1 or n < 1:
        raise ValueError(f"{n} blocks in {p} stages")


def bottleneck(cuts: list[tuple[int, int]], stage: StageFn) -> float:
    return max(_t(stage, a, b, k) for k, (a, b) in enumerate(cuts))


def partition_dp(n: int, p: int, stage: StageFn) -> list[tuple[int, int]] | None:
    """The exact cut by dynamic programming (every stage at least one block)."""
    _check(n, p)
    if p > n:
        return None
    inf = (math.inf, math.inf)
    # best[k][i]: (bottleneck, sum) of the first i blocks in k + 1 stages; back[k][i]: the cut
    best = [[inf] * (n + 1) for _ in range(p)]
    back = [[-1] * (n + 1) for _ in range(p)]
    for i in range(1, n - p + 2):
        t = _t(stage, 0, i, 0)
        best[0][i] = (t, t)
    for k in range(1, p):
        for i in range(k + 1, n - (p - k - 1) + 1):
            for j in range(k, i):
                prev = best[k - 1][j]
                if prev[0] == math.inf:
                    continue
                t = _t(stage, j, i, k)
                cand = (max(prev[0], t), prev[1] + t)
                if cand < best[k][i]:
                    best[k][i], back[k][i] = cand, j
    if best[p - 1][n][0] == math.inf:
        return None
    cuts, i = [], n
    for k in range(p - 1, -1, -1):
        j = back[k][i] if k else 0
        cuts.append((j, i))
        i = j
    return cuts[::-1]


def _within(t: float, bound: float) -> bool:
    return t < math.inf and t <= bound


def _fits(n: int, p: int, stage: StageFn, bound: float) -> list[tuple[int, int]] | None:
    """The greedy cut under ``bound``: each stage the longest prefix within it."""
    cuts, first = [], 0
    for k in range(p):
        hi = n - (p - k - 1)                  # leave one block for each stage after this one
        if first >= hi or not _within(_t(stage, first, first + 1, k), bound):
            return None
        if k == p - 1:
            if not _within(_t(stage, first, n, k), bound):
                return None
            lo = n
        else:
            lo, top = first + 1, hi           # the largest last that fits, by bisection
            while lo < top:
                mid = (lo + top + 1) // 2
                if _within(_t(stage, first, mid, k), bound):
                    lo = mid
                else:
                    top = mid - 1
        cuts.append((first, lo))
        first = lo
    return cuts


def partition_bisect(n: int, p: int, stage: StageFn, *,
                     rel_tol: float = 1e-9) -> list[tuple[int, int]] | None:
    """The least-bottleneck cut by bisection on the bound (stage times must not fall when a
    stage gains a block)."""
    _check(n, p)
    if p > n:
        return None
    top = _fits(n, p, stage, math.inf)
    if top is None:
        return None
    # NOTE: the optimum is a stage time; bisect between 0 and the first feasible cut's
    # bottleneck, keeping the best cut found (its bottleneck is the new top).
    lo, hi = 0.0, bottleneck(top, stage)
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        cut = _fits(n, p, stage, mid)
        if cut is None:
            lo = mid
        else:
            top, hi = cut, bottleneck(cut, stage)
    return top
