"""``hotspot``: greedy rematerialization of what is live at the simulated peak.

MAGIS's insight, without its GPU-in-the-loop ranking: simulate, look at the storages live at the
peak, drop (and recompute in the backward) the one that frees the most bytes per second of
recompute, simulate again; keep a drop only if the peak went down. A candidate comes with its forward-only chain: the recomputable producers of
its inputs whose outputs no backward node reads (dropping ``mul(gelu(x), mask)`` alone would keep
``gelu(x)`` alive for the recompute and save nothing; dropping both saves the bytes). Deterministic (ties broken by
node id), anytime (stops at ``time_budget_s`` with the best plan so far), and every candidate is
judged by the simulator, so a drop that would raise the peak (a recompute keeps its inputs alive
into the backward) is rejected rather than trusted.

With a ``latency_limit`` it keeps lowering the peak while the simulated step stays within the
limit.
"""

from __future__ import annotations

import time

from ..graph.analysis import new_storages, users
from ..graph.ir import Graph, Phase
from ..plan.remat import recomputable, remat_plan
from ..sim.simulate import simulate
from .base import BudgetInfeasible, Problem, Solution, dominated_by, register

__all__ = ["solve_hotspot"]

# NOTE: recompute cost floor, so that free-looking ops (views) do not divide by zero
MIN_RECOMPUTE_S = 1e-7


@register("hotspot")
def solve_hotspot(problem: Problem) -> Solution:
    t0 = time.perf_counter()
    g, cm = problem.graph, problem.cost_model
    ok = recomputable(g)
    fresh = new_storages(g)
    producer = {s: nid for nid, ss in fresh.items() for s in ss}
    candidates = {n.id for n in g.nodes
                  if not ok[n.id] and fresh[n.id] and n.phase in (Phase.FORWARD, Phase.LOSS)}
    seconds = {nid: max(cm.node_cost(g, g.nodes[nid]).seconds, MIN_RECOMPUTE_S)
               for nid in candidates}
    chain = _forward_chains(g, candidates)
    drop: set[int] = set()
    banned: set[int] = set()
    plan = remat_plan(g, drop)
    sim = simulate(g, plan, cm)
    eager_latency = sim.latency_s
    limit = (problem.latency_limit * eager_latency if problem.latency_limit is not None
             else float("inf"))
    iterations = 0
    while time.perf_counter() - t0 < problem.time_budget_s:
        if problem.budget_bytes is not None and sim.peak_bytes <= problem.budget_bytes:
            break
        ranked = sorted(
            ({producer[s] for s in sim.peak_live if s in producer} & candidates) - drop - banned,
            key=lambda nid: (-sum(g.storages[s].nbytes for s in fresh[nid]) / seconds[nid], nid))
        if not ranked:
            break
        nid = ranked[0]
        iterations += 1
        trial = remat_plan(g, drop | chain[nid])
        tsim = simulate(g, trial, cm)
        if tsim.peak_bytes < sim.peak_bytes and tsim.latency_s <= limit:
            drop |= chain[nid]
            plan, sim = trial, tsim
        else:
            banned.add(nid)
    solve_s = time.perf_counter() - t0
    if problem.budget_bytes is not None and sim.peak_bytes > problem.budget_bytes:
        raise BudgetInfeasible(problem.budget_bytes, sim.peak_bytes, dominated_by(sim), "hotspot")
    return Solution(plan, sim, "hotspot", solve_s,
                    notes={"dropped": len(drop), "iterations": iterations,
                           "eager_latency_s": eager_latency})


def _forward_chains(g: Graph, candidates: set[int]) -> dict[int, set[int]]:
    """node -> itself plus, transitively, the candidate producers of its inputs whose outputs
    are read by no backward node (kept alive only to recompute it)."""
    readers = users(g)
    members: dict[int, list[int]] = {}
    for v in g.values:
        members.setdefault(v.storage, []).append(v.id)
    backward = {n.id for n in g.nodes if n.phase in (Phase.BACKWARD, Phase.OPTIMIZER)}

    def forward_only(nid: int) -> bool:
        return not any(r in backward for o in g.nodes[nid].outputs if o is not None
                       for v in members[g.values[o].storage] for r in readers[v])

    out: dict[int, set[int]] = {}
    for nid in sorted(candidates):
        group, stack = {nid}, [nid]
        while stack:
            for v in g.nodes[stack.pop()].inputs:
                p = g.values[v].producer
                if p is not None and p in candidates and p not in group and forward_only(p):
                    group.add(p)
                    stack.append(p)
        out[nid] = group
    return out
