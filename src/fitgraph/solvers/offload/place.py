"""Where offloading's instructions go, once each storage's window is chosen (``solvers.offload.plan``).

For each window, ``Offload`` after the last write before the gap, the release ``Wait`` after the
last use before it, ``Prefetch`` at the latest node before which its copy is still hidden, and its
``Wait`` right before the next reader. No simulation per step: the plan's clock (one simulation)
is shifted after each release Wait by the time that Wait stalls for its copy, as the simulator's
Wait does (``Clock``); offloads run first in, first out on the copy stream; prefetches go, latest
deadline first, into the stream's idle time (``plan.copy_stream``).

Example:
    >>> from fitgraph.plan.instructions import Compute, Plan
    >>> from fitgraph.solvers.offload.place import OffloadWindow, Placed, assemble
    >>> p = Plan(tuple(Compute(i) for i in range(4)))
    >>> w = OffloadWindow(storage=7, write=0, release=1, reader=3)
    >>> " ".join(i.op for i in assemble(p, [Placed(w, 2, 0.0, 0.0, 0.0)]))
    'compute offload compute wait prefetch compute wait compute'
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ...cost.base import CostModel
from ...graph.ir import Graph
from ...plan.copy_stream import CopyStream
from ...plan.instructions import Instruction, Offload, Plan, Prefetch, Wait

__all__ = ["Clock", "OffloadWindow", "Placed", "assemble", "place"]


@dataclass(frozen=True, slots=True)
class OffloadWindow:
    """Where one storage's offload goes, as indices into the plan it is placed in."""

    storage: int
    write: int    # last write before the gap: Offload right after it
    release: int  # last use before the gap: Wait (device bytes released) right after it
    reader: int   # first use after the gap: Wait (prefetch done) right before it


class Clock:
    """The plan's compute clock once the offloads are in: the clock of the plan shifted, after
    each release Wait, by the time it stalls for its copy (as the simulator's Wait does)."""

    def __init__(self, before_s: list[float], after_s: list[float]) -> None:
        self.before_s, self.after_s = before_s, after_s
        self.from_pc: list[int] = []    # the shift grows from these plan indices on
        self.shift: list[float] = []    # the shift from there

    def shift_at(self, pc: int) -> float:
        k = bisect.bisect_right(self.from_pc, pc) - 1
        return self.shift[k] if k >= 0 else 0.0

    def before(self, pc: int) -> float:
        return self.before_s[pc] + self.shift_at(pc)

    def stall(self, pc: int, seconds: float) -> None:
        """Add a stall after instruction ``pc`` (the clock of every later one moves)."""
        total = self.shift_at(pc + 1) + seconds
        if self.from_pc and self.from_pc[-1] == pc + 1:
            self.shift[-1] = total
        else:
            self.from_pc.append(pc + 1)
            self.shift.append(total)


@dataclass(frozen=True, slots=True)
class Placed:
    """One storage's offload, placed, with the planner's clock readings for its gains."""

    window: OffloadWindow
    prefetch: int       # plan index the Prefetch goes before
    release_s: float    # compute clock after the release Wait
    prefetch_s: float   # compute clock at the Prefetch's issue
    stall_s: float      # compute waiting at the two Waits


def stage(graph: Graph, windows: list[OffloadWindow], clock: Clock, cost_model: CostModel
          ) -> tuple[CopyStream, dict[int, float]]:
    """Offloads and releases on the clock: the copy stream's busy intervals, and each release
    Wait's stall (the clock is shifted by them)."""
    events = sorted([(w.write, 0, w.storage) for w in windows]
                    + [(w.release, 1, w.storage) for w in windows])
    t_copy, done, stalls, spans = 0.0, {}, {}, []
    for pc, kind, st in events:
        now = clock.after_s[pc] + clock.shift_at(pc + 1)
        if kind == 0:  # NOTE: FIFO, like the simulator: a copy starts when the stream is free
            start = max(t_copy, now)
            t_copy = done[st] = start + cost_model.copy_seconds(graph.storages[st].nbytes)
            spans.append((start, t_copy))
        else:
            stalls[st] = max(0.0, done[st] - now)
            if stalls[st] > 0:
                clock.stall(pc, stalls[st])
    return CopyStream(spans), stalls


def fit_prefetches(graph: Graph, points: list[int], windows: list[OffloadWindow], clock: Clock,
                   stream: CopyStream, stalls: dict[int, float], cost_model: CostModel
                   ) -> list[Placed]:
    """Each prefetch at the latest node (of ``points``, the plan's compute instructions) it is
    hidden before, latest deadline first (so each fits in before the ones already placed); with
    no such node, so that it starts earliest."""

    def issue_at(i: int) -> float:
        return clock.before(points[i])

    out = []
    for w in sorted(windows, key=lambda w: (-w.reader, w.storage)):
        secs = cost_model.copy_seconds(graph.storages[w.storage].nbytes)
        deadline = clock.before(w.reader)
        lo = bisect.bisect_right(points, w.release)
        hi = bisect.bisect_right(points, w.reader)
        inline = not cost_model.copies_overlap
        # NOTE: copies in line on the compute stream hide nowhere: the latest point holds the
        # device bytes least and costs the same time
        i = hi - 1 if inline and hi > lo else stream.latest_fit(issue_at, lo, hi, secs, deadline)
        if i is None:
            # NOTE: hidden nowhere: the copy starts as early as it can (the least stall), and is
            # issued at the latest node that still lets it start then (the least memory)
            first = stream.queued_start(issue_at(lo))
            i = bisect.bisect_right(range(hi), first, lo, hi, key=issue_at) - 1
        start = stream.queued_start(issue_at(i))
        stream.add(start, secs)
        p = points[i]
        release_s = clock.after_s[w.release] + clock.shift_at(w.release + 1)
        stall = stalls[w.storage] + max(0.0, start + secs - deadline)
        out.append(Placed(w, p, release_s, clock.before(p), stall))
    return out


def assemble(plan: Plan, placed: list[Placed]) -> Plan:
    """The plan with the copies: after instruction pc its offloads then its release Waits, before
    it its prefetches then their Waits; each sorted by storage."""
    before: dict[int, list[tuple[int, int, Instruction]]] = {}
    after: dict[int, list[tuple[int, int, Instruction]]] = {}
    for x in placed:
        w = x.window
        after.setdefault(w.write, []).append((0, w.storage, Offload(w.storage)))
        after.setdefault(w.release, []).append((1, w.storage, Wait(w.storage)))
        before.setdefault(x.prefetch, []).append((0, w.storage, Prefetch(w.storage)))
        before.setdefault(w.reader, []).append((1, w.storage, Wait(w.storage)))
    out: list[Instruction] = []
    for pc, ins in enumerate(plan):
        out.extend(i for _, _, i in sorted(before.get(pc, ()), key=_slot_key))
        out.append(ins)
        out.extend(i for _, _, i in sorted(after.get(pc, ()), key=_slot_key))
    meta = dict(plan.meta, offloaded=tuple(sorted(x.window.storage for x in placed)))
    return Plan(tuple(out), meta=meta)


def _slot_key(entry: tuple[int, int, Instruction]) -> tuple[int, int]:
    return entry[0], entry[1]


def place(graph: Graph, points: list[int], windows: list[OffloadWindow], before_s: list[float],
          after_s: list[float], cost_model: CostModel) -> list[Placed]:
    """Place every window's instructions on the plan's clock (``before_s``/``after_s``: compute
    clock before and after each instruction, from one simulation)."""
    clock = Clock(before_s, after_s)
    stream, stalls = stage(graph, windows, clock, cost_model)
    return fit_prefetches(graph, points, windows, clock, stream, stalls, cost_model)
