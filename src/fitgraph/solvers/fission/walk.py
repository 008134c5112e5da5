"""The fission search's part walk: a chosen split taken in more parts without a new round.

The "cheapest" greedy path (``solvers.fission.search``) buys memory at the least time per byte. When
it picks a region in k parts, the next round would try the same region in more parts first and
pick it while its rates stay ahead, but only after growing and splitting every region of the
new split graph. ``walk_parts`` takes those increments from the splits the round already
simulated (``_Step``s: a graph, its simulation, and the base/region/k that made it), comparing
each increment's rate with the best rate of any other split that round saw.

Example:
    >>> from types import SimpleNamespace as S
    >>> from fitgraph.solvers.fission.walk import rate, walk_parts
    >>> sim = lambda peak, lat: S(peak_bytes=peak, latency_s=lat)
    >>> region, base = object(), object()
    >>> cur = S(sim=sim(100, 1.0))
    >>> k2, k4 = (S(sim=sim(p, t), region=region, base=base, k=k)
    ...           for p, t, k in [(80, 1.1, 2), (70, 1.15, 4)])
    >>> other = S(sim=sim(95, 1.5), region=object(), base=base, k=2)
    >>> rate(k2.sim, cur.sim) > rate(other.sim, cur.sim)
    True
    >>> walk_parts(cur, k2, [k2, k4, other], budget=50, rounds_left=6).k  # 10 B per 0.05 s
    4
"""

from __future__ import annotations

from ...sim.simulate import SimResult

__all__ = ["MIN_ADDED_S", "rate", "walk_parts"]

# NOTE: the least latency a split is charged when comparing bytes saved per second added
MIN_ADDED_S = 1e-7


def walk_parts(before, chosen, seen: list, budget: int | None, rounds_left: int):
    """"cheapest": the chosen split made again in more parts, while each increment buys bytes
    at a better rate than any other split the round saw (bytes saved per second added) and
    closes its share of the gap to the budget. Only splits the round simulated are walked.

    NOTE: a round on the split graph would try the same region in more parts first (and
    pick it whenever the rates stay ahead), but it grows and splits every region of the new
    graph to learn that: GPT-2's loss chunked 2 -> 4 -> ... -> 32 took five rounds of ~15
    splits each. The other splits' rates are taken from this round, before the chosen one."""
    if chosen.region is None:
        return chosen
    others = [s for s in seen if s.region is not chosen.region or s.base is not chosen.base]
    bar = max((rate(s.sim, before.sim) for s in others), default=0.0)
    more = sorted((s for s in seen if s.region is chosen.region and s.base is chosen.base
                   and s.k > chosen.k), key=lambda s: s.k)
    cur = chosen
    for nxt in more:
        if budget is not None and cur.sim.peak_bytes <= budget:
            break
        saved = cur.sim.peak_bytes - nxt.sim.peak_bytes
        if saved <= 0 or rate(nxt.sim, cur.sim) <= bar or (
                budget is not None and saved * rounds_left < cur.sim.peak_bytes - budget):
            break
        cur = nxt
    return cur


def rate(sim: SimResult, than: SimResult) -> float:
    """Bytes of peak saved per second of latency added, from ``than`` to ``sim``."""
    return (than.peak_bytes - sim.peak_bytes) / max(sim.latency_s - than.latency_s,
                                                     MIN_ADDED_S)
