"""Offloading with prefetch: send chosen storages to host memory across the gap in their use.

An activation saved for backward is written in the forward, read by a few forward ops, then left
untouched until the backward reads it. For each chosen storage, around the longest gap (in
simulated compute time) between two consecutive uses, ``offload_plan`` places:

* ``Offload(s)`` right after the last write before the gap: the copy overlaps the reads after it;
* ``Wait(s)`` right after the last use before the gap: the device bytes are released there;
* ``Prefetch(s)`` as late as its copy can still be hidden under compute before the next reader
  (node times from ``cost_model.node_cost``, copy times from ``cost_model.copy_seconds``, in idle
  time of the copy stream); where nothing hides it, so that it starts as early as it can;
* ``Wait(s)`` right before the next reader.

Placing takes one simulation of the plan (``solvers.offload.place``: its clock, shifted after each
release Wait by the time that Wait stalls, and the copy stream's busy intervals, prefetches placed
latest deadline first). The plan given must not offload yet: offload every storage in one call.
Only device memory inside the gaps changes, so the offloaded plan never peaks above the plan it
came from.

``offload_gains`` scores each storage offloaded alone (bytes × seconds off device, the peak it
saves, the latency it exposes), all of them in about the time of one simulation, so that a
planner can weigh offloading a tensor against recomputing it. The instructions' meaning is in
``fitgraph.plan.instructions``.

Example:
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.graph.ir import GraphBuilder, Phase, Role
    >>> from fitgraph.plan.eager import eager_plan
    >>> from fitgraph.solvers.offload.plan import offload_candidates, offload_plan
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Cost(BaseCostModel):  # 1 ms per node, 0.5 ms per copy
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    ...     def copy_seconds(self, nbytes): return 5e-4
    >>> b = GraphBuilder(); x = b.add_input("x", (64,), "float32", Role.INPUT)
    >>> a = b.add_node("aten.relu.default", [x], [((64,), "float32")])[0]
    >>> y = b.add_node("aten.neg.default", [a], [((64,), "float32")])[0]
    >>> z = b.add_node("aten.exp.default", [y], [((64,), "float32")])[0]
    >>> w = b.add_node("aten.exp.default", [z], [((64,), "float32")], phase=Phase.BACKWARD)[0]
    >>> gy = b.add_node("aten.mul.Tensor", [w, a], [((64,), "float32")], phase=Phase.BACKWARD)[0]
    >>> g = b.finish({"loss": gy}); sa = g.values[a].storage
    >>> offload_candidates(g, eager_plan(g)) == [sa]
    True
    >>> " ".join(i.op for i in offload_plan(g, eager_plan(g), [sa], Cost()))
    'compute offload compute wait compute free prefetch compute free wait compute free'
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ...cost.base import CostModel
from ...graph.analysis import new_storages, output_storages
from ...graph.ir import Graph
from ...plan.instructions import Compute, Free, Offload, Plan, Prefetch, Recompute, Wait
from ...sim.simulate import SimResult, simulate
from .place import OffloadWindow, assemble, place

__all__ = ["OffloadError", "OffloadGain", "OffloadWindow", "offload_candidates", "offload_gains",
           "offload_plan", "offload_windows"]


class OffloadError(ValueError):
    """A storage was asked to be offloaded that cannot be (resident, recomputed, no gap...)."""


@dataclass(frozen=True, slots=True)
class OffloadGain:
    """What offloading one storage alone buys and costs (the planner's clock; the simulator
    agrees up to float rounding, and exactly on bytes)."""

    storage: int
    nbytes: int
    off_device_s: float   # compute-clock time from the release to the prefetch's start
    byte_seconds: float   # nbytes × off_device_s: device memory freed, over time
    peak_saving: int      # simulated peak of the plan minus that of the offloaded plan
    exposed_s: float      # step latency added: compute waiting for the copies
    copy_s: float         # copy-stream time, both directions


@dataclass(slots=True)
class _Uses:
    """Per storage, the plan indices that touch it, and why it may not be offloadable."""

    access: dict[int, list[int]]
    writes: dict[int, list[int]]
    why_not: dict[int, str]
    compute_pcs: list[int]


def _uses(graph: Graph, plan: Plan) -> _Uses:
    fresh = new_storages(graph)
    keep = output_storages(graph)
    access: dict[int, list[int]] = {}
    writes: dict[int, list[int]] = {}
    why_not: dict[int, str] = {st: "it is resident or a step output" for st in sorted(keep)}
    freed: set[int] = set()
    compute_pcs = []
    for pc, ins in enumerate(plan):
        if isinstance(ins, (Compute, Recompute)):
            compute_pcs.append(pc)
            n = graph.nodes[ins.node]
            touched = [graph.values[v].storage for v in n.inputs]
            touched += [graph.values[o].storage for o in n.outputs if o is not None]
            for st in dict.fromkeys(touched):
                if st in freed:
                    why_not.setdefault(st, "the plan frees it before its last use")
                access.setdefault(st, []).append(pc)
            written = list(fresh[ins.node]) if isinstance(ins, Compute) else []
            written += [graph.values[v].storage for v in n.mutates]
            for st in dict.fromkeys(written):
                writes.setdefault(st, []).append(pc)
            if isinstance(ins, Recompute):
                for st in fresh[ins.node]:
                    why_not.setdefault(st, "the plan recomputes it")
        elif isinstance(ins, Free):
            freed.update(ins.storages)
        elif isinstance(ins, (Offload, Prefetch, Wait)):
            raise OffloadError(f"instruction {pc}: the plan already offloads (storage "
                               f"{ins.storage}); offload from the plan before offloading, every "
                               "storage in one call")
    for st, nbytes in enumerate(s.nbytes for s in graph.storages):
        if st not in access:
            why_not.setdefault(st, "the plan never uses it")
        elif nbytes == 0:
            why_not.setdefault(st, "it holds no bytes")
        elif st not in writes:
            why_not.setdefault(st, "the plan never writes it")
    return _Uses(access, writes, why_not, compute_pcs)


def _gaps(uses: _Uses, st: int) -> list[tuple[int, int]]:
    """Consecutive uses of ``st`` with at least one node run between them."""
    acc, pcs = uses.access[st], uses.compute_pcs
    return [(a, b) for a, b in zip(acc, acc[1:])
            if bisect.bisect_left(pcs, b) - bisect.bisect_right(pcs, a) > 0]


def _window(uses: _Uses, st: int, before_s: list[float], after_s: list[float]
            ) -> OffloadWindow | None:
    """The gap with the most compute time between two consecutive uses of ``st`` (the first
    such on ties), or None when no node runs between any two."""
    best, best_s = None, -1.0
    for a, b in _gaps(uses, st):
        if before_s[b] - after_s[a] > best_s:
            best, best_s = (a, b), before_s[b] - after_s[a]
    if best is None:
        return None
    release, reader = best
    write = max(pc for pc in uses.writes[st] if pc <= release)
    return OffloadWindow(st, write, release, reader)


def _clocks(sim: SimResult) -> tuple[list[float], list[float]]:
    """Compute-stream clock before and after each instruction."""
    after = list(sim.time_after)
    return [0.0, *after[:-1]], after


def offload_candidates(graph: Graph, plan: Plan) -> list[int]:
    """Storages ``offload_plan`` can offload in ``plan``, sorted: made once by a Compute, neither
    resident nor a step output, not freed before their last use, and with at least one node run
    between two consecutive uses."""
    uses = _uses(graph, plan)
    return [st for st in sorted(uses.access) if st not in uses.why_not and _gaps(uses, st)]


def offload_windows(graph: Graph, plan: Plan, storages: Iterable[int],
                    cost_model: CostModel) -> list[OffloadWindow]:
    """Where each storage's offload goes in ``plan``, sorted by storage; raises OffloadError
    naming a storage that cannot be offloaded and why."""
    uses = _uses(graph, plan)
    before_s, after_s = _clocks(simulate(graph, plan, cost_model))
    return _windows(graph, uses, storages, before_s, after_s)


def _windows(graph: Graph, uses: _Uses, storages: Iterable[int], before_s: list[float],
             after_s: list[float]) -> list[OffloadWindow]:
    out = []
    for st in sorted(set(storages)):
        if not 0 <= st < len(graph.storages):
            raise OffloadError(f"no storage {st} in the graph")
        why = uses.why_not.get(st)
        win = None if why else _window(uses, st, before_s, after_s)
        if win is None:
            why = why or "no node runs between two of its uses"
            raise OffloadError(f"storage {st} ({graph.storages[st].name}) cannot be offloaded: "
                               f"{why}; choose among offload_candidates(graph, plan)")
        out.append(win)
    return out


def offload_plan(graph: Graph, plan: Plan, storages: Iterable[int],
                 cost_model: CostModel) -> Plan:
    """``plan`` with each of ``storages`` offloaded across its longest gap (see the module doc).
    Deterministic; the result peaks no higher than ``plan`` in the simulator."""
    uses = _uses(graph, plan)
    before_s, after_s = _clocks(simulate(graph, plan, cost_model))
    windows = _windows(graph, uses, storages, before_s, after_s)
    placed = place(graph, uses.compute_pcs, windows, before_s, after_s, cost_model)
    return assemble(plan, placed)


def offload_gains(graph: Graph, plan: Plan, cost_model: CostModel,
                  storages: Iterable[int] | None = None) -> dict[int, OffloadGain]:
    """Per storage (default: every candidate), what offloading it alone in ``plan`` gains and
    costs, placed as ``offload_plan(graph, plan, [storage], cost_model)`` places it; sorted by
    storage id. One simulation of ``plan``, then a few lookups per storage."""
    uses = _uses(graph, plan)
    base = simulate(graph, plan, cost_model)
    before_s, after_s = _clocks(base)
    chosen = offload_candidates(graph, plan) if storages is None else storages
    peaks = _RangeMax(base.peak_during)
    out: dict[int, OffloadGain] = {}
    for w in _windows(graph, uses, chosen, before_s, after_s):
        x = place(graph, uses.compute_pcs, [w], before_s, after_s, cost_model)[0]
        nbytes = graph.storages[w.storage].nbytes
        # NOTE: only the plan's instructions strictly between the release and the prefetch run
        # without the storage; what is inserted never tops its neighbours
        inside = peaks.max(w.release + 1, x.prefetch) - nbytes
        outside = max(peaks.max(0, w.release + 1), peaks.max(x.prefetch, len(plan)))
        peak = max(base.resident_bytes, inside, outside)
        off = x.prefetch_s - x.release_s
        out[w.storage] = OffloadGain(
            storage=w.storage, nbytes=nbytes, off_device_s=off, byte_seconds=nbytes * off,
            peak_saving=base.peak_bytes - peak,
            exposed_s=(x.stall_s if cost_model.copies_overlap
                       else 2 * cost_model.copy_seconds(nbytes)),  # NOTE: in line: all exposed
            copy_s=2 * cost_model.copy_seconds(nbytes))
    return out


class _RangeMax:
    """max(values[lo:hi]) in O(1) after an O(n log n) sparse table (numpy)."""

    def __init__(self, values) -> None:
        table = [np.asarray(values, dtype=np.int64)]
        k = 1
        while 2 * k <= len(values):
            prev = table[-1]
            table.append(np.maximum(prev[:-k], prev[k:]))
            k *= 2
        self.table = table

    def max(self, lo: int, hi: int) -> int:
        if hi <= lo:
            return -1
        level = (hi - lo).bit_length() - 1
        row = self.table[level]
        return int(max(row[lo], row[hi - (1 << level)]))
