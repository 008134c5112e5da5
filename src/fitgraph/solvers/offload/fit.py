"""Offload on top of a plan until it fits: peak-targeted greedy over ``solvers.offload.plan``'s storages.

Given a plan that does not offload yet (eager, reordered or rematerialized), ``offload_to_fit``
repeatedly simulates the offloaded plan, looks at its peak, and offloads more of the storages
that are off device across that peak (their window, release to prefetch, covers it) — hidden
copies first, largest first; then exposed ones by bytes per exposed second (``offload_gains``,
each storage scored alone). A batch just large enough to cover the excess is tried; when the
simulator says it raises the peak or breaks the latency cap, the batch is halved, and a single
storage that fails is set aside. The peak moves as storages leave, so each round re-targets it.
Once the target holds, ``prune`` takes back every offload the plan still fits without, the most
exposed first: fewer copies, less pressure on the copy stream. Everything is judged by
``simulate``; deterministic (sorted ties, no sets iterated); ``deadline`` only cuts it short.

Example:
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.graph.ir import GraphBuilder, Phase, Role
    >>> from fitgraph.plan.eager import eager_plan
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Cost(BaseCostModel):  # 1 ms per node, 0.1 ms per copy: every copy hides
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    ...     def copy_seconds(self, nbytes): return 1e-4
    >>> b = GraphBuilder(); v = [b.add_input("x", (64,), "float32", Role.INPUT)]
    >>> for i in range(4): v += b.add_node("aten.relu.default", [v[-1]], [((64,), "float32")])
    >>> gr = b.add_node("aten.sum.default", [v[-1]], [((64,), "float32")])[0]
    >>> for i in range(4, 0, -1):
    ...     gr = b.add_node("aten.mul.Tensor", [gr, v[i]], [((64,), "float32")],
    ...                     phase=Phase.BACKWARD)[0]
    >>> g = b.finish({"loss": gr})
    >>> fit = offload_to_fit(g, eager_plan(g), Cost(), target_bytes=1280)
    >>> fit.sim.peak_bytes <= 1280 < fit.base_peak_bytes, fit.sim.stall_s, len(fit.offloaded)
    (True, 0.0, 2)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...cost.base import CostModel
from ...graph.ir import Graph
from ...plan.instructions import Offload, Plan, Prefetch, Wait
from ...sim.simulate import SimResult, simulate
from .plan import OffloadGain, offload_gains, offload_plan, offload_windows

__all__ = ["OffloadFit", "offload_to_fit"]

# NOTE: a copy exposing less than this is "hidden": float rounding of the placement's clock
HIDDEN_S = 1e-12
# NOTE: failed trials in a row, the last one past ``give_up_above_s``, before giving up: a
# batch halves to one storage in log2(batch) of them, so a few single storages get a chance
MAX_FAILS = 8


@dataclass(frozen=True)
class OffloadFit:
    """The best offloaded plan found: the least peak that meets the latency cap (the least
    latency once the target holds)."""

    plan: Plan
    sim: SimResult
    offloaded: tuple[int, ...]
    base_peak_bytes: int
    simulations: int
    timed_out: bool
    gave_up: bool = False  # a trial went past ``give_up_above_s``: the search stopped there


@dataclass
class _Ctx:
    graph: Graph
    base: Plan
    cost: CostModel
    target: int
    cap_s: float
    give_up_s: float
    deadline: float
    gains: dict[int, OffloadGain]
    off_until: dict[int, tuple[int, float]]  # storage -> (release index, prefetch clock)
    before_s: list[float]
    simulations: int = 0
    timed_out: bool = False
    gave_up: bool = False

    def out_of_time(self) -> bool:
        self.timed_out = self.timed_out or time.perf_counter() > self.deadline
        return self.timed_out

    def run(self, chosen: list[int]) -> tuple[Plan, SimResult]:
        self.simulations += 1
        plan = offload_plan(self.graph, self.base, chosen, self.cost) if chosen else self.base
        return plan, simulate(self.graph, plan, self.cost)

    def ok(self, sim: SimResult) -> bool:
        return sim.latency_s <= min(self.cap_s, self.give_up_s)


def offload_to_fit(graph: Graph, base: Plan, cost_model: CostModel, *,
                   target_bytes: int = 0, latency_cap_s: float = float("inf"),
                   give_up_above_s: float = float("inf"),
                   deadline: float = float("inf")) -> OffloadFit:
    """Offload storages of ``base`` (see the module doc) until the simulated peak is at most
    ``target_bytes`` (0: as low as it goes), keeping the latency within ``latency_cap_s``.
    A trial slower than ``give_up_above_s`` (what a caller already has in hand) is refused like
    one past the cap; ``MAX_FAILS`` refusals in a row stop the search (unpruned, ``gave_up``)."""
    base_sim = simulate(graph, base, cost_model)
    gains = offload_gains(graph, base, cost_model)
    before_s = [0.0, *base_sim.time_after[:-1]]
    off_until = {w.storage: (w.release, base_sim.time_after[w.release]
                             + gains[w.storage].off_device_s)
                 for w in offload_windows(graph, base, sorted(gains), cost_model)}
    ctx = _Ctx(graph, base, cost_model, target_bytes, latency_cap_s, give_up_above_s, deadline,
               gains, off_until, before_s, simulations=1)
    chosen, plan, sim = _grow(ctx, base, base_sim)
    if not ctx.gave_up:
        chosen, plan, sim = _prune(ctx, chosen, plan, sim)
    return OffloadFit(plan, sim, tuple(sorted(chosen)), base_sim.peak_bytes, ctx.simulations,
                      ctx.timed_out, ctx.gave_up)


def _rank(ctx: _Ctx, storages: list[int]) -> list[int]:
    """Hidden copies first, largest first; then bytes per exposed second."""
    def key(st: int):
        x = ctx.gains[st]
        if x.exposed_s <= HIDDEN_S:
            return (0, -x.nbytes, -x.byte_seconds, st)
        return (1, -x.nbytes / x.exposed_s, -x.byte_seconds, st)
    return sorted(storages, key=key)


def _covering(ctx: _Ctx, plan: Plan, sim: SimResult, skip: set[int]) -> list[int]:
    """Candidates off device at ``plan``'s peak, once offloaded (their window covers it)."""
    idx = _base_index(plan, sim.peak_instruction)
    t = ctx.before_s[idx] if idx < len(ctx.before_s) else float("inf")
    return [st for st, (release, prefetch_s) in ctx.off_until.items()
            if st not in skip and release < idx and t < prefetch_s]


def _base_index(plan: Plan, pc: int) -> int:
    """Index in the base plan of instruction ``pc`` of the offloaded plan (a copy instruction
    maps to the base instruction after it)."""
    return sum(1 for ins in plan.instructions[:pc] if not isinstance(ins, (Offload, Prefetch,
                                                                           Wait)))


def _grow(ctx: _Ctx, plan: Plan, sim: SimResult) -> tuple[list[int], Plan, SimResult]:
    chosen: list[int] = []
    rejected: set[int] = set()
    fails = 0  # failed trials since the last one kept
    while sim.peak_bytes > ctx.target and not ctx.out_of_time() and not ctx.gave_up:
        ranked = _rank(ctx, _covering(ctx, plan, sim, set(chosen) | rejected))
        if not ranked:
            break
        excess, batch = sim.peak_bytes - ctx.target, []
        for st in ranked:  # NOTE: just enough bytes to cover the excess, if every one helps
            batch.append(st)
            excess -= ctx.gains[st].nbytes
            if excess <= 0:
                break
        while batch and not ctx.out_of_time():
            p2, s2 = ctx.run(chosen + batch)
            if s2.peak_bytes <= sim.peak_bytes and ctx.ok(s2):
                chosen, plan, sim, fails = chosen + batch, p2, s2, 0
                break
            fails += 1
            if fails >= MAX_FAILS and s2.latency_s > ctx.give_up_s:
                ctx.gave_up = True
                return chosen, plan, sim
            if len(batch) == 1:
                rejected.add(batch[0])
            batch = batch[:len(batch) // 2]
    return chosen, plan, sim


def _prune(ctx: _Ctx, chosen: list[int], plan: Plan, sim: SimResult
           ) -> tuple[list[int], Plan, SimResult]:
    """Undo offloads the plan does without (peak no higher than the target or than now, latency
    no higher): the most exposed first, then the largest copies."""
    bound = max(ctx.target, sim.peak_bytes)
    order = sorted(chosen, key=lambda st: (-ctx.gains[st].exposed_s, -ctx.gains[st].copy_s, st))
    for st in order:
        if ctx.out_of_time():
            break
        rest = [s for s in chosen if s != st]
        p2, s2 = ctx.run(rest)
        if s2.peak_bytes <= bound and s2.latency_s <= sim.latency_s:
            chosen, plan, sim = rest, p2, s2
    return chosen, plan, sim
