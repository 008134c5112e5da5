"""Offloading with prefetch: send chosen storages to host memory across the gap in their use.

An activation saved for backward is written in the forward, read by a few forward ops, then left
untouched until the backward reads it. For each chosen storage, around the longest gap (in
simulated compute time) between two consecutive uses, ``offload_plan`` places:

* ``Offload(s)`` right after the last write before the gap: the copy overlaps the reads after it;
* ``Wait(s)`` right after the last use before the gap: the device bytes are released there;
* ``Prefetch(s)`` as late as its copy can still be hidden under compute before the next reader
  (node times from ``cost_model.node_cost``, copy times from ``cost_model.copy_seconds``, the
  copy stream's queue included), or right after the release when no point hides it;
* ``Wait(s)`` right before the next reader.

Only device memory inside the gap changes, so the offloaded plan never peaks above the plan it
came from. ``offload_gains`` scores each storage offloaded alone (bytes × seconds off device, the
peak it saves, the latency it exposes) so that a planner can weigh offloading a tensor against
recomputing it. See ``fitgraph.plan.instructions`` for what the instructions mean.

Example:
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.graph.ir import GraphBuilder, Phase, Role
    >>> from fitgraph.plan.eager import eager_plan
    >>> from fitgraph.plan.offload import offload_candidates, offload_plan
    >>> class Cost:  # 1 ms per node, 0.5 ms per copy
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

from ..cost.base import CostModel
from ..graph.analysis import new_storages, output_storages
from ..graph.ir import Graph
from ..sim.simulate import SimResult, simulate
from .instructions import Compute, Free, Instruction, Offload, Plan, Prefetch, Recompute, Wait

__all__ = ["OffloadError", "OffloadGain", "OffloadWindow", "offload_candidates", "offload_gains",
           "offload_plan", "offload_windows"]

# NOTE: simulated clocks are sums of float seconds; a copy "ends in time" within this slack
TIME_EPS_S = 1e-12


class OffloadError(ValueError):
    """A storage was asked to be offloaded that cannot be (resident, recomputed, no gap...)."""


@dataclass(frozen=True, slots=True)
class OffloadWindow:
    """Where one storage's offload goes, as indices into the plan it is placed in."""

    storage: int
    write: int    # last write before the gap: Offload right after it
    release: int  # last use before the gap: Wait (device bytes released) right after it
    reader: int   # first use after the gap: Wait (prefetch done) right before it


@dataclass(frozen=True, slots=True)
class OffloadGain:
    """What offloading one storage alone buys and costs, simulated."""

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
    freed: dict[int, int] = {}
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
            for st in ins.storages:
                freed[st] = pc
        elif isinstance(ins, (Offload, Prefetch, Wait)):
            why_not.setdefault(ins.storage, "the plan already offloads it")
    for st, nbytes in enumerate(s.nbytes for s in graph.storages):
        if st not in access:
            why_not.setdefault(st, "the plan never uses it")
        elif nbytes == 0:
            why_not.setdefault(st, "it holds no bytes")
        elif st not in writes:
            why_not.setdefault(st, "the plan never writes it")
    return _Uses(access, writes, why_not, compute_pcs)


def _window(uses: _Uses, st: int, before_s: list[float], after_s: list[float]
            ) -> OffloadWindow | None:
    """The gap with the most compute time between two consecutive uses of ``st`` (the first
    such on ties), or None when no compute runs between any two."""
    acc = uses.access[st]
    best, best_score = None, (0.0, 0)
    for a, b in zip(acc, acc[1:]):
        computes = (bisect.bisect_left(uses.compute_pcs, b)
                    - bisect.bisect_right(uses.compute_pcs, a))
        score = (before_s[b] - after_s[a], computes)
        if computes > 0 and (best is None or score > best_score):
            best, best_score = (a, b), score
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
    out = []
    for st in sorted(uses.access):
        if st in uses.why_not:
            continue
        acc = uses.access[st]
        if any(bisect.bisect_left(uses.compute_pcs, b) - bisect.bisect_right(uses.compute_pcs, a)
               for a, b in zip(acc, acc[1:])):
            out.append(st)
    return out


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
    base = simulate(graph, plan, cost_model)
    before_s, after_s = _clocks(base)
    windows = _windows(graph, uses, storages, before_s, after_s)
    return _place(graph, plan, uses, windows, cost_model)


# -- placement -------------------------------------------------------------------------------
# NOTE: instructions are inserted around the plan's own: ``before[pc]`` runs just before
# instruction pc (prefetches, then the Waits of prefetches), ``after[pc]`` just after it
# (offloads, then the Waits that release). The rank orders kinds inside one slot.
_BEFORE, _OWN, _AFTER = 0, 1, 2


def _assemble(plan: Plan, before: dict[int, list[tuple[int, int, Instruction]]],
              after: dict[int, list[tuple[int, int, Instruction]]]) -> tuple[Plan, list[int]]:
    """The plan with the insertions, and where each original instruction ended up."""
    out: list[Instruction] = []
    pos = []
    for pc, ins in enumerate(plan):
        out.extend(i for _, _, i in sorted(before.get(pc, ()), key=_slot_key))
        pos.append(len(out))
        out.append(ins)
        out.extend(i for _, _, i in sorted(after.get(pc, ()), key=_slot_key))
    return Plan(tuple(out), meta=dict(plan.meta)), pos


def _slot_key(entry: tuple[int, int, Instruction]) -> tuple[int, int]:
    return entry[0], entry[1]


@dataclass(frozen=True, slots=True)
class _Copy:
    key: tuple[int, int, int]  # (plan index, slot, storage): the copy stream's FIFO order
    issue_s: float             # compute clock when it is issued
    seconds: float
    deadline_s: float          # when the compute stream waits for it


def _lateness(copies: list[_Copy]) -> float:
    """Total time copies end after their deadlines, on a FIFO copy stream (like the simulator:
    a copy starts when issued and the stream is free)."""
    t = late = 0.0
    for c in sorted(copies, key=_copy_key):
        t = max(t, c.issue_s) + c.seconds
        late += max(0.0, t - c.deadline_s)
    return late


def _copy_key(c: _Copy) -> tuple[int, int, int]:
    return c.key


def _place(graph: Graph, plan: Plan, uses: _Uses, windows: list[OffloadWindow],
           cost_model: CostModel) -> Plan:
    before: dict[int, list[tuple[int, int, Instruction]]] = {}
    after: dict[int, list[tuple[int, int, Instruction]]] = {}
    for w in windows:
        after.setdefault(w.write, []).append((0, w.storage, Offload(w.storage)))
        after.setdefault(w.release, []).append((1, w.storage, Wait(w.storage)))
    # NOTE: simulate the offloads first: their release Waits may stall compute, which moves
    # every deadline after them; prefetches that are hidden stall nothing
    staged, pos = _assemble(plan, before, after)
    sim = simulate(graph, staged, cost_model)
    t_after = sim.time_after
    t_before = [t_after[p - 1] if p else 0.0 for p in pos]  # clock just before instruction pc
    t_done = [t_after[p] for p in pos]                      # ... and just after it
    inf = float("inf")
    copies = [_Copy((pc, _OWN, ins.storage), t_before[pc],
                    cost_model.copy_seconds(graph.storages[ins.storage].nbytes), inf)
              for pc, ins in enumerate(plan) if isinstance(ins, (Offload, Prefetch))]
    for w in windows:
        copies.append(_Copy((w.write, _AFTER, w.storage), t_done[w.write],
                            cost_model.copy_seconds(graph.storages[w.storage].nbytes),
                            t_done[w.release]))
    late = _lateness(copies)
    points = uses.compute_pcs
    starts = [t_before[pc] for pc in points]
    # NOTE: latest deadline first, so each prefetch is fitted in before the ones already placed
    # (a copy issued earlier delays, on a FIFO stream, every copy issued after it)
    for w in sorted(windows, key=lambda w: (-w.reader, w.storage)):
        secs = cost_model.copy_seconds(graph.storages[w.storage].nbytes)
        deadline = t_before[w.reader]
        lo = bisect.bisect_right(points, w.release)
        hi = bisect.bisect_right(points, w.reader)
        latest = bisect.bisect_right(starts, deadline - secs + TIME_EPS_S, lo, hi)
        chosen = points[lo]  # NOTE: no point hides the copy: start it as early as possible
        for i in range(latest - 1, lo - 1, -1):
            trial = _Copy((points[i], _BEFORE, w.storage), starts[i], secs, deadline)
            if _lateness([*copies, trial]) <= late + TIME_EPS_S:
                chosen = points[i]
                break
        copies.append(_Copy((chosen, _BEFORE, w.storage), t_before[chosen], secs, deadline))
        late = _lateness(copies)
        before.setdefault(chosen, []).append((0, w.storage, Prefetch(w.storage)))
        before.setdefault(w.reader, []).append((1, w.storage, Wait(w.storage)))
    out, _ = _assemble(plan, before, after)
    out.meta["offloaded"] = tuple(w.storage for w in windows)
    return out


def offload_gains(graph: Graph, plan: Plan, cost_model: CostModel,
                  storages: Iterable[int] | None = None) -> dict[int, OffloadGain]:
    """Per storage (default: every candidate), what offloading it alone in ``plan`` gains and
    costs in the simulator; sorted by storage id."""
    uses = _uses(graph, plan)
    base = simulate(graph, plan, cost_model)
    before_s, after_s = _clocks(base)
    chosen = offload_candidates(graph, plan) if storages is None else storages
    out: dict[int, OffloadGain] = {}
    for w in _windows(graph, uses, chosen, before_s, after_s):
        one = _place(graph, plan, uses, [w], cost_model)
        sim = simulate(graph, one, cost_model)
        released = next(pc for pc, i in enumerate(one) if isinstance(i, Wait)
                        and i.storage == w.storage)
        fetched = next(pc for pc, i in enumerate(one) if isinstance(i, Prefetch)
                       and i.storage == w.storage)
        off = sim.time_after[fetched - 1] - sim.time_after[released]
        nbytes = graph.storages[w.storage].nbytes
        out[w.storage] = OffloadGain(
            storage=w.storage, nbytes=nbytes, off_device_s=off, byte_seconds=nbytes * off,
            peak_saving=base.peak_bytes - sim.peak_bytes,
            exposed_s=max(0.0, sim.latency_s - base.latency_s),
            copy_s=sim.copy_s - base.copy_s)
    return out
