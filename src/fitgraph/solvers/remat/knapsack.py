"""``knapsack``: what torch.compile's ``activation_memory_budget`` does, as a plan.

torch's min-cut partitioner with a memory budget solves a 0/1 knapsack: keep the saved
activations that are most expensive to recompute per byte, within a fraction of the saved bytes,
recompute the rest. The fraction bounds *saved activation bytes*, not the peak, so to meet a peak
budget this baseline searches the fraction (bisection on the simulated peak). Items are the
forward nodes whose outputs the backward reads, each with its forward-only recompute chain
(as in ``hotspot``). The DP quantises sizes into ``KNAPSACK_UNITS`` buckets, as torch's does.
"""

from __future__ import annotations

import time

import numpy as np

from ...graph.analysis import new_storages, users
from ...graph.ir import Phase
from ...plan.remat import remat_plan
from ...sim.simulate import simulate
from ..base import BudgetInfeasible, Problem, Solution, dominated_by, register
from .candidates import MIN_RECOMPUTE_S, forward_chains, remat_candidates

__all__ = ["knapsack_keep", "solve_knapsack"]

KNAPSACK_UNITS = 1000   # NOTE: size quantisation of the DP
BISECTION_STEPS = 12    # NOTE: 2^-12 resolution on the memory fraction


def knapsack_keep(sizes: list[int], values: list[float], capacity: int) -> list[bool]:
    """0/1 knapsack by DP: which items to keep (maximise value, total size <= capacity).

    Example:
        >>> knapsack_keep([5, 4, 3], [10.0, 7.0, 5.0], 7)
        [False, True, True]
    """
    n = len(sizes)
    best = np.zeros(capacity + 1)
    take = np.zeros((n, capacity + 1), dtype=bool)
    for i, (s, v) in enumerate(zip(sizes, values)):
        if s > capacity:
            continue
        cand = np.full(capacity + 1, -np.inf)
        cand[s:] = best[:capacity + 1 - s] + v
        take[i] = cand > best
        best = np.maximum(best, cand)
    keep, c = [False] * n, capacity
    for i in range(n - 1, -1, -1):
        if take[i, c]:
            keep[i] = True
            c -= sizes[i]
    return keep


@register("knapsack")
def solve_knapsack(problem: Problem) -> Solution:
    t0 = time.perf_counter()
    g, cm = problem.graph, problem.cost_model
    fresh = new_storages(g)
    readers = users(g)
    candidates = remat_candidates(g)
    chains = forward_chains(g, candidates)
    saved = sorted(nid for nid in candidates
                   if any(g.nodes[r].phase is Phase.BACKWARD for o in g.nodes[nid].outputs
                          if o is not None for r in readers[o]))
    nbytes = [sum(g.storages[s].nbytes for s in fresh[nid]) for nid in saved]
    secs = [sum(max(cm.node_cost(g, g.nodes[c]).seconds, MIN_RECOMPUTE_S) for c in chains[nid])
            for nid in saved]
    total = max(sum(nbytes), 1)
    unit = max(total // KNAPSACK_UNITS, 1)
    sizes = [max(b // unit, 1) for b in nbytes]

    def plan_for(fraction: float):
        keep = knapsack_keep(sizes, secs, int(fraction * sum(sizes)))
        drop = set().union(*[chains[nid] for nid, k in zip(saved, keep) if not k])
        plan = remat_plan(g, drop)
        return plan, simulate(g, plan, cm)

    best = plan_for(1.0)
    eager_latency = best[1].latency_s
    lo, hi = 0.0, 1.0
    if problem.budget_bytes is not None and best[1].peak_bytes > problem.budget_bytes:
        best = None
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            cand = plan_for(mid)
            if cand[1].peak_bytes <= problem.budget_bytes:
                best, lo = cand, mid
            else:
                hi = mid
        if best is None:
            floor = plan_for(0.0)
            if floor[1].peak_bytes <= problem.budget_bytes:
                best = floor
            else:
                raise BudgetInfeasible(problem.budget_bytes, floor[1].peak_bytes,
                                       dominated_by(floor[1]), "knapsack")
    elif problem.latency_limit is not None:
        limit = problem.latency_limit * eager_latency
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            cand = plan_for(mid)
            if cand[1].latency_s <= limit:
                if cand[1].peak_bytes < best[1].peak_bytes:
                    best = cand
                hi = mid
            else:
                lo = mid
    plan, sim = best
    return Solution(plan, sim, "knapsack", time.perf_counter() - t0,
                    notes={"saved_candidates": len(saved)})
