"""Cut a chain of blocks into contiguous pipeline stages: the least bottleneck stage time.

``stage(first, last, k)`` prices blocks ``first..last-1`` as stage ``k`` (its memory plan
included; None when they do not fit its device). Two exact solvers of the same problem:

- ``partition_dp``: the dynamic program over (stages, blocks) of Piper and Alpa, ``best[k][i] =
  min_j max(best[k-1][j], stage(j, i, k))``, then a second pass for the least sum of stage
  times among the cuts of that bottleneck; O(p n²) stage prices — for short chains and as the
  reference.
- ``partition_bisect``: bisection on the bottleneck; for a bound ``T`` the first stage takes the
  longest prefix whose time is at most ``T``, then the next stage, and so on (or from the last
  stage backwards) — feasible within ``p`` stages iff ``T`` is at least the optimum when a
  stage's time never falls as it gains a block (more work, less memory) and is monotone in the
  stage's index (1F1B: the first stages hold the most). O(p log n) stage prices per probe,
  which is what makes GPT-3 on 1024 devices plan in seconds.

Both return the cuts ``[(first, last), ...]`` (one per stage) or None when no cut fits.

Example:
    >>> times = [3, 1, 1, 1, 2, 2]
    >>> def stage(first, last, k):
    ...     return float(sum(times[first:last]))
    >>> partition_dp(len(times), 3, stage), partition_bisect(len(times), 3, stage)  # both 4
    ([(0, 1), (1, 4), (4, 6)], [(0, 1), (1, 4), (4, 6)])
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
    # pass 1: best[k][i], the least bottleneck of the first i blocks in k + 1 stages
    best = [[math.inf] * (n + 1) for _ in range(p)]
    times: dict[tuple[int, int, int], float] = {}

    def t(j: int, i: int, k: int) -> float:
        if (j, i, k) not in times:
            times[j, i, k] = _t(stage, j, i, k)
        return times[j, i, k]

    for i in range(1, n - p + 2):
        best[0][i] = t(0, i, 0)
    for k in range(1, p):
        for i in range(k + 1, n - (p - k - 1) + 1):
            best[k][i] = min((max(best[k - 1][j], t(j, i, k)) for j in range(k, i)
                              if best[k - 1][j] < math.inf), default=math.inf)
    bound = best[p - 1][n]
    if bound == math.inf:
        return None
    # pass 2: among cuts within that bottleneck, the least sum of stage times (a per-state
    # (bottleneck, sum) pair would not: a prefix of lower bottleneck may cost more in all)
    total = [[math.inf] * (n + 1) for _ in range(p)]
    back = [[-1] * (n + 1) for _ in range(p)]
    for i in range(1, n - p + 2):
        if t(0, i, 0) <= bound:
            total[0][i] = t(0, i, 0)
    for k in range(1, p):
        for i in range(k + 1, n - (p - k - 1) + 1):
            for j in range(k, i):
                if total[k - 1][j] < math.inf and t(j, i, k) <= bound:
                    cand = total[k - 1][j] + t(j, i, k)
                    if cand < total[k][i]:
                        total[k][i], back[k][i] = cand, j
    cuts, i = [], n
    for k in range(p - 1, -1, -1):
        j = back[k][i] if k else 0
        cuts.append((j, i))
        i = j
    return cuts[::-1]


def _within(t: float, bound: float) -> bool:
    return t < math.inf and t <= bound


def _fits_forward(n: int, p: int, stage: StageFn, bound: float) -> list[tuple[int, int]] | None:
    """The greedy cut under ``bound``: each stage, first to last, the longest prefix within it."""
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


def _fits(n: int, p: int, stage: StageFn, bound: float) -> list[tuple[int, int]] | None:
    """A cut under ``bound``, greedy from the first stage or from the last: the first is exact
    when a stage's time does not fall with its index, the second when it does not rise (a 1F1B
    pipeline's first stages hold the most micro-batches)."""
    def mirrored(first: int, last: int, k: int):
        return stage(n - last, n - first, p - 1 - k)

    # NOTE: from the last stage first: the 1F1B case, where it is the one that is exact
    back = _fits_forward(n, p, mirrored, bound)
    if back is not None:
        return [(n - b, n - a) for a, b in reversed(back)]
    return _fits_forward(n, p, stage, bound)


def partition_bisect(n: int, p: int, stage: StageFn, *,
                     rel_tol: float = 1e-7) -> list[tuple[int, int]] | None:
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
