"""One training iteration's pipeline schedule, simulated event by event across devices.

The proof of a multi-device plan, as ``fitgraph.sim`` proves a single-device one. The model is
cut into ``p * v`` chunks; chunk ``k`` runs on device ``chunk_device(schedule, p, v, k)``:
``k % p`` (``v`` chunks per device for the interleaved schedule, one for ``gpipe``, ``1f1b``,
``zb-h1``), and for ``zb-v`` (two per device) a V: chunk ``k`` on device ``k`` for ``k < p``,
on ``2p - 1 - k`` after, so device 0 holds the first and the last chunk. Each device runs its
program (``programs``) in order; an action starts when the device is free and what it reads has
arrived:

- ``F(k, i)`` (forward of micro-batch ``i`` on chunk ``k``) needs ``F(k-1, i)``'s output;
- ``B(k, i)`` (its backward; the input-gradient part alone under ``zb-h1`` and ``zb-v``) needs
  ``B(k+1, i)``'s gradient, the last chunk its own ``F``;
- ``W(k, i)`` (the weight-gradient part split off by ``zb-h1`` and ``zb-v``) needs
  ``B(k, i)``, on the same device.

An output crosses to the next chunk's device over the directed link between the two: transfers
on one link take turns in the order they became ready, and take no compute time on either
device (communication streams). Chunks sharing a device (``p == 1``; the turn of ``zb-v``'s V
at device ``p - 1``, chunk ``p - 1`` to ``p``) pass outputs for free.

Example:
    >>> tl = simulate("1f1b", fwd_s=[1.0] * 4, bwd_s=[2.0] * 4, m=8, act_bytes=[10.0] * 4)
    >>> tl.makespan_s, tl.bubble_s(0), tl.peak_bytes     # (m + p - 1)(F + B), (p - 1)(F + B)
    (33.0, 9.0, (40.0, 30.0, 20.0, 10.0))
    >>> zb = simulate("zb-h1", [1.0] * 4, [1.0] * 4, m=8, w_s=[1.0] * 4)
    >>> zb.makespan_s, zb.bubble_s(0)                    # a third of 1F1B's bubble
    (27.0, 3.0)
    >>> zv = simulate("zb-v", [0.5] * 8, [0.5] * 8, m=8, v=2, w_s=[0.5] * 8)  # as much work
    >>> zv.makespan_s, zv.bubble_s(0)                    # in a V: half ZB-H1's bubble
    (25.5, 1.5)
    >>> programs("1f1b", p=2, m=2)[0]
    [Action(kind='F', chunk=0, micro=0), Action(kind='F', chunk=0, micro=1), \
Action(kind='B', chunk=0, micro=0), Action(kind='B', chunk=0, micro=1)]
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

__all__ = ["SIM_SCHEDULES", "ZB_W_HOLD", "Action", "Event", "Timeline", "chunk_device", "programs",
           "simulate"]

SIM_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
# NOTE: the schedules that split each backward into B (input gradient) and W (weight gradient)
_SPLIT = ("zb-h1", "zb-v")

# NOTE: what a micro-batch's W still reads once its B is done: the inputs of the layer's linear
# layers and their output gradients, 32 sbh bytes of a transformer layer's 34 sbh (+ 5 as²b
# attention scores, none with flash attention); zero-bubble's own scheduler charges
# mem_w = -32 h against mem_f = 34 h + 5 a s (sail-sg/zero-bubble-pipeline-parallelism).
ZB_W_HOLD = 32 / 34

_KINDS = "FBW"
_F, _B, _W = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work in a device's program: ``kind`` ``"F"`` (forward), ``"B"`` (backward;
    its input-gradient part alone when a ``"W"`` is split off) or ``"W"`` (weight gradient,
    ``zb-h1`` and ``zb-v``), of micro-batch ``micro`` on chunk ``chunk``."""

    kind: str
    chunk: int
    micro: int


@dataclass(frozen=True, slots=True)
class Event:
    """An action as simulated: on ``device`` from ``start`` to ``end`` seconds."""

    device: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The simulated iteration: ``makespan_s`` (end of the last action), each device's compute
    time ``busy_s``, most activation bytes held at once ``peak_bytes`` and the end of its last
    action ``end_s``. ``events`` (device by device, each in program order) are built on first
    read: a planner reads the totals only."""

    makespan_s: float
    busy_s: tuple[float, ...]
    peak_bytes: tuple[float, ...]
    devices: int
    end_s: tuple[float, ...] = ()
    # NOTE: (m, seconds by kind then chunk, per device (coded program, starts)): a million frozen
    # Events cost more than simulating them, so they wait until someone reads them
    trace: tuple = field(repr=False, compare=False, default=(1, ((), (), ()), ()))

    def bubble_s(self, device: int) -> float:
        """Seconds ``device`` idles within the makespan."""
        return self.makespan_s - self.busy_s[device]

    @cached_property
    def events(self) -> tuple[Event, ...]:
        m, secs, per_device = self.trace
        with _bulk():
            return tuple(Event(d, _action(c, m), s, s + secs[c & 3][(c >> 2) // m])
                         for d, (prog, starts) in enumerate(per_device)
                         for c, s in zip(prog, starts))


@contextmanager
def _bulk() -> Iterator[None]:
    # NOTE: a million new objects at once: the cyclic collector would rescan them again and again
    # (they hold no cycles)
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# NOTE: a program is a list of ints, (chunk * m + micro) << 2 | kind: no per-action objects for
# the collector to scan while a large pipeline is built and simulated
def _code(kind: int, chunk: int, micro: int, m: int) -> int:
    return (chunk * m + micro) << 2 | kind


def _action(code: int, m: int) -> Action:
    chunk, micro = divmod(code >> 2, m)
    return Action(_KINDS[code & 3], chunk, micro)


def _check(schedule: str, p: int, m: int | None, v: int) -> None:
    # NOTE: m None: the placement alone (chunk_device)
    if schedule not in SIM_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SIM_SCHEDULES)}")
    for name, n in (("p", p), ("m", 1 if m is None else m), ("v", v)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} = {n!r}: a pipeline needs a positive integer")
    if schedule == "zb-v" and v != 2:
        raise ValueError(f"zb-v runs two chunks per device in a V (v=2), not {v}")
    if schedule not in ("interleaved", "zb-v") and v != 1:
        raise ValueError(f"{schedule} runs one chunk per device (v=1), not {v}")
    if m is not None and schedule == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) a multiple of "
                         f"the devices ({p})")


def chunk_device(schedule: str, p: int, v: int, chunk: int) -> int:
    """The device (0 to ``p - 1``) that runs chunk ``chunk`` of the ``p * v`` chunks under
    ``schedule``: ``chunk % p``, but for ``zb-v``'s V (``v = 2``): ``chunk`` for
    ``chunk < p``, ``2p - 1 - chunk`` after (device ``d`` holds chunks ``d`` and
    ``2p - 1 - d``).

    Example:
        >>> [chunk_device("zb-v", 4, 2, k) for k in range(8)]
        [0, 1, 2, 3, 3, 2, 1, 0]
        >>> [chunk_device("interleaved", 4, 2, k) for k in range(8)]
        [0, 1, 2, 3, 0, 1, 2, 3]
    """
    _check(schedule, p, None, v)
    if not isinstance(chunk, int) or not 0 <= chunk < p * v:
        raise ValueError(f"chunk {chunk!r} of {p * v} ({p} devices, {v} chunks each)")
    return _placement(schedule, p, v)[chunk]


def _placement(schedule: str, p: int, v: int) -> list[int]:
    # NOTE: chunk -> device for every chunk, unchecked: the simulator's one mapping
    if schedule == "zb-v":
        return [*range(p), *range(p - 1, -1, -1)]
    return [k % p for k in range(p * v)]


def _gpipe(p: int, m: int, v: int) -> list[list[int]]:
    # NOTE: backwards in micro-batch order, as torch.distributed.pipelining's ScheduleGPipe
    return [[(r * m + i) << 2 | _F for i in range(m)] + [(r * m + i) << 2 | _B for i in range(m)]
            for r in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[int]]:
    out = []
    for r in range(p):
        warm, base = min(p - r - 1, m), r * m
        out.append([(base + i) << 2 | _F for i in range(warm)]
                   + [c for j in range(m - warm)
                      for c in ((base + warm + j) << 2 | _F, (base + j) << 2 | _B)]
                   + [(base + j) << 2 | _B for j in range(m - warm, m)])
    return out


def _zb_h1(p: int, m: int, v: int) -> list[list[int]]:
    # NOTE: 1F1B's order, with device r running each W r backwards after its B (the rest at the
    # end): every device then holds p micro-batches from F to W, as many as 1F1B's first device,
    # and the deferred W's fill the cool-down (Qi et al., ICLR'24, ZB-H1; DeepSpeed's port)
    out = []
    for r, prog in enumerate(_one_f_one_b(p, m, v)):
        zb, base = [], r * m
        for c in prog:
            zb.append(c)
            if c & 3 == _B and (c >> 2) - base >= r:
                zb.append((c >> 2) - r << 2 | _W)
        out.append(zb + [(base + i) << 2 | _W for i in range(max(m - r, 0), m)])
    return out


def _interleaved(p: int, m: int, v: int) -> list[list[int]]:
    # NOTE: Megatron-LM's forward_backward_pipelining_with_interleaving (megatron/core): virtual
    # step k runs chunk (k // p) % v (reversed for backwards) on micro-batch
    # (k // (p v)) p + k % p; newer Megatron dropped the old all-forwards-first case for m == p,
    # which keeps the warm-up count schedules.in_flight reads
    total, pv = m * v, p * v
    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        f = [((k // p % v * p + r) * m + k // pv * p + k % p) << 2 | _F for k in range(total)]
        b = [(((v - 1 - k // p % v) * p + r) * m + k // pv * p + k % p) << 2 | _B
             for k in range(total)]
        out.append(f[:warm] + [c for j in range(total - warm) for c in (f[warm + j], b[j])]
                   + b[total - warm:])
    return out


def _zb_v(p: int, m: int, v: int) -> list[list[int]]:
    # NOTE: torch.distributed.pipelining's ScheduleZBVZeroBubble._calculate_single_rank_operations
    # (the handcrafted ZB-V of Qi et al., ICLR'24, section 6), action for action; its leading
    # None's only align ranks in time, which the simulator does by waiting. Device r runs chunks
    # c0 = r and c1 = 2p - 1 - r: 2(p - r) - 1 forwards of c0; r pairs F(c1) F(c0); p - r
    # triples F(c1) B(c1) W(c1); then F(c0) B(c0) W(c0) F(c1) B(c1) W(c1) (F(c0) once all are
    # run) until c1 has caught up; cool-down: r pairs B(c0) B(c1) with their W's deferred,
    # p - r pairs B(c0) W(c0) (the oldest deferred W of c0), then the deferred W's of c1, of c0.
    # Like torch, the order is built for max(m, 2p - 1) micro-batches and those past m are
    # dropped: what is left waits only on kept actions (dependencies stay within a micro-batch),
    # so any m >= 1 runs (torch checks no m either). With F = B = W per chunk each device then
    # idles only the (p - 1) F of the fill, from m >= 3p/2 on; below that, more. Every W before
    # a device's last forward runs right after its B: the memory peaks (after a forward) hold no
    # micro-batch waiting for its W (schedules.zbv_held)
    return [_zb_v_device(p, m, r) for r in range(p)]


def _zb_v_device(p: int, m: int, r: int) -> list[int]:
    # NOTE: device r's coded ZB-V program (schedules.zbv_held walks it too)
    n = max(m, 2 * p - 1)
    c0, c1 = r, 2 * p - 1 - r
    prog: list[tuple[int, int, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - r) - 1):
        prog.append((_F, c0, f0))
        f0 += 1
    for _ in range(r):
        prog += [(_F, c1, f1), (_F, c0, f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(p - r):
        prog += [(_F, c1, f1), (_B, c1, b1), (_W, c1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            prog.append((_F, c0, f0))
            f0 += 1
        prog += [(_B, c0, b0), (_W, c0, b0), (_F, c1, f1), (_B, c1, b1), (_W, c1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        prog += [(_B, c0, b0), (_B, c1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - r):
        prog += [(_B, c0, b0), (_W, c0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    prog += [(_W, c1, i) for i in range(w1, b1)] + [(_W, c0, i) for i in range(w0, b0)]
    return [(k * m + i) << 2 | kind for kind, k, i in prog if i < m]


_PROGRAMS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved,
             "zb-h1": _zb_h1, "zb-v": _zb_v}


def programs(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each device's ordered list of actions for ``schedule`` (``SIM_SCHEDULES``) on ``p``
    devices, ``m`` micro-batches, ``v`` chunks per device.

    Example:
        >>> [f"{a.kind}{a.micro}" for a in programs("zb-h1", p=2, m=2)[1]]
        ['F0', 'B0', 'F1', 'B1', 'W0', 'W1']
        >>> [f"{a.kind}{a.chunk}.{a.micro}" for a in programs("zb-v", p=2, m=4, v=2)[1]][:9]
        ['F1.0', 'F2.0', 'F1.1', 'F2.1', 'B2.0', 'W2.0', 'F1.2', 'B1.0', 'W1.0']
    """
    _check(schedule, p, m, v)
    with _bulk():
        return [[_action(c, m) for c in prog] for prog in _PROGRAMS[schedule](p, m, v)]


def _values(name: str, xs: Sequence[float] | None, n: int, what: str = "time") -> list[float]:
    if xs is None:
        return [0.0] * n
    out = [float(x) for x in xs]
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries; it needs {n}")
    for k, x in enumerate(out):
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{name}[{k}] = {x}: a {what} must be finite and non-negative")
    return out


def simulate(schedule: str, fwd_s: Sequence[float], bwd_s: Sequence[float], m: int, *,
             v: int = 1, p2p_s: Sequence[float] | None = None,
             act_bytes: Sequence[float] | None = None, w_s: Sequence[float] | None = None,
             w_hold: float = ZB_W_HOLD) -> Timeline:
    """Simulate ``m`` micro-batches through ``schedule`` (``SIM_SCHEDULES``).

    ``fwd_s[k]``, ``bwd_s[k]``: seconds of one micro-batch's forward / backward on chunk ``k``
    (``p * v`` chunks, so ``p = len(fwd_s) // v`` devices). ``p2p_s[k]`` (``p * v - 1``, default
    zeros): seconds to send chunk ``k``'s output to chunk ``k + 1``, and the gradient back.
    ``act_bytes[k]`` (default zeros): activation bytes chunk ``k`` holds for one micro-batch
    from the start of its F to the end of its B. ``zb-h1`` and ``zb-v`` only: ``w_s[k]`` is the
    weight-gradient part of the backward (``bwd_s[k]`` then the input-gradient part alone),
    and a fraction ``w_hold`` of ``act_bytes[k]`` stays from the end of B to the end of W.
    Chunk ``k`` runs on device ``chunk_device(schedule, p, v, k)``; ``zb-v`` needs ``v = 2``.

    Example:
        >>> tl = simulate("gpipe", [1.0, 1.0], [1.0, 1.0], m=1, p2p_s=[0.5])
        >>> [(e.action.kind, e.start, e.end) for e in tl.events if e.device == 0]
        [('F', 0.0, 1.0), ('B', 4.0, 5.0)]
    """
    fwd = _values("fwd_s", fwd_s, len(fwd_s))
    if not isinstance(v, int) or v < 1 or not fwd or len(fwd) % v:
        raise ValueError(f"{len(fwd)} chunks cannot be split into v = {v!r} per device")
    n = len(fwd)
    _check(schedule, n // v, m, v)
    if (schedule in _SPLIT) != (w_s is not None):
        raise ValueError(f"{schedule} splits each backward into B and W: give it w_s"
                         if w_s is None
                         else f"w_s is the weight-gradient part of a split backward, which "
                              f"{schedule} does not run (zb-h1 and zb-v do)")
    return _run(_PROGRAMS[schedule](n // v, m, v), _placement(schedule, n // v, v), fwd,
                _values("bwd_s", bwd_s, n),
                None if w_s is None else _values("w_s", w_s, n), _values("p2p_s", p2p_s, n - 1),
                _values("act_bytes", act_bytes, n, "size"), m, w_hold)


def _run_programs(progs: list[list[Action]], fwd_s: Sequence[float], bwd_s: Sequence[float],
                  m: int, *, p2p_s: Sequence[float] | None = None,
                  act_bytes: Sequence[float] | None = None, w_s: Sequence[float] | None = None,
                  w_hold: float = ZB_W_HOLD, schedule: str = "interleaved") -> Timeline:
    """Simulate hand-made programs, checked first: each device runs every F and B (and W, with
    ``w_s``) of its own chunks once, the chunks placed as ``schedule`` places them
    (``chunk_device``; ``k % p`` by default)."""
    n, p = len(fwd_s), len(progs)
    if p < 1 or not isinstance(m, int) or m < 1 or n % p:
        raise ValueError(f"{n} chunks over {p} devices, {m!r} micro-batches")
    if schedule not in SIM_SCHEDULES or (schedule == "zb-v" and n != 2 * p):
        raise ValueError(f"cannot place {n} chunks on {p} devices as {schedule!r} does")
    place = _placement(schedule, p, n // p)
    for d, prog in enumerate(progs):
        want = {(kind, k, i) for kind in ("FBW" if w_s is not None else "FB")
                for k in range(n) if place[k] == d for i in range(m)}
        have = [(a.kind, a.chunk, a.micro) for a in prog]
        if len(have) != len(want) or set(have) != want:
            odd = sorted(set(have) ^ want) or sorted(have)
            raise ValueError(f"device {d}'s program must run each of its actions once: "
                             f"{Action(*odd[0])} is missing, repeated or not its own")
    coded = [[_code(_KINDS.index(a.kind), a.chunk, a.micro, m) for a in prog] for prog in progs]
    return _run(coded, place, _values("fwd_s", fwd_s, n), _values("bwd_s", bwd_s, n),
                None if w_s is None else _values("w_s", w_s, n), _values("p2p_s", p2p_s, n - 1),
                _values("act_bytes", act_bytes, n, "size"), m, w_hold)


def _run(progs: list[list[int]], dev: list[int], fwd: list[float], bwd: list[float],
         wgt: list[float] | None, p2p: list[float], act: list[float], m: int,
         w_hold: float) -> Timeline:
    if not 0.0 <= w_hold <= 1.0:
        raise ValueError(f"w_hold = {w_hold}: a fraction of the activations, in [0, 1]")
    p, n = len(progs), len(fwd)
    last = n - 1
    # NOTE: per (chunk k, micro i) at k * m + i: when F's input and B's output gradient arrive,
    # when B ends (W reads it), which device waits for an input (-1: none)
    f_in: list[float | None] = [0.0] * m + [None] * (last * m)
    g_in: list[float | None] = [None] * (n * m)
    b_end: list[float | None] = [None] * (n * m)
    wait_f, wait_g = [-1] * (n * m), [-1] * (n * m)
    # NOTE: directed link src -> dst at src * p + dst (chunk k on device dev[k]); -1: the
    # chunks share a device
    fl = [-1 if dev[k] == dev[k + 1] else dev[k] * p + dev[k + 1] for k in range(last)]
    bl = [-1 if dev[k] == dev[k + 1] else dev[k + 1] * p + dev[k] for k in range(last)]
    link_free = [0.0] * (p * p)
    # NOTE: with W split off, B frees all but what W still reads
    b_frees = 1.0 - w_hold if wgt is not None else 1.0
    pos, free, held, peak = [0] * p, [0.0] * p, [0.0] * p, [0.0] * p
    starts: list[list[float]] = [[] for _ in range(p)]
    # NOTE: a device runs until an input is missing, then waits to be woken by its arrival.
    # Every transfer on a link leaves one device, in that device's program order, so the
    # link's FIFO order is fixed when the sender runs: no global event queue is needed
    stack = list(range(p - 1, -1, -1))
    while stack:
        d = stack.pop()
        prog, i, t, h, pk, st = progs[d], pos[d], free[d], held[d], peak[d], starts[d]
        end = len(prog)
        while i < end:
            c = prog[i]
            x = c >> 2
            k = x // m
            kind = c & 3
            if kind == _F:
                r = f_in[x]
                if r is None:
                    wait_f[x] = d
                    break
                s = t if t > r else r
                t = s + fwd[k]
                if k < last:
                    lk = fl[k]
                    if lk < 0:
                        f_in[x + m] = t
                    else:
                        lf = link_free[lk]
                        f_in[x + m] = link_free[lk] = (t if t > lf else lf) + p2p[k]
                    w = wait_f[x + m]
                    if w >= 0:
                        stack.append(w)
                else:
                    g_in[x] = t
                h += act[k]
                if h > pk:
                    pk = h
            elif kind == _B:
                r = g_in[x]
                if r is None:
                    wait_g[x] = d
                    break
                s = t if t > r else r
                t = b_end[x] = s + bwd[k]
                if k > 0:
                    lk = bl[k - 1]
                    if lk < 0:
                        g_in[x - m] = t
                    else:
                        lf = link_free[lk]
                        g_in[x - m] = link_free[lk] = (t if t > lf else lf) + p2p[k - 1]
                    w = wait_g[x - m]
                    if w >= 0:
                        stack.append(w)
                h -= act[k] * b_frees
            else:
                if b_end[x] is None:
                    break  # NOTE: its B comes later on this very device: a deadlock
                s = t
                t = s + wgt[k]
                h -= act[k] * w_hold
            st.append(s)
            i += 1
        pos[d], free[d], held[d], peak[d] = i, t, h, pk
    stuck = [d for d in range(p) if pos[d] < len(progs[d])]
    if stuck:
        raise ValueError("the programs deadlock: " + "; ".join(
            _waiting(d, _action(progs[d][pos[d]], m), n) for d in stuck))
    # NOTE: each device runs each action of its chunks once, so its compute time is a sum
    per_chunk = [m * (fwd[k] + bwd[k] + (wgt[k] if wgt is not None else 0.0)) for k in range(n)]
    busy = tuple(math.fsum(per_chunk[k] for k in range(n) if dev[k] == d) for d in range(p))
    secs = (fwd, bwd, wgt if wgt is not None else [0.0] * n)
    return Timeline(max(free), busy, tuple(peak), p, tuple(free),
                    (m, secs, tuple(zip(progs, starts))))


def _waiting(d: int, a: Action, n: int) -> str:
    if a.kind == "F":
        why = f"chunk {a.chunk - 1}'s forward of micro-batch {a.micro}"
    elif a.kind == "B" and a.chunk < n - 1:
        why = f"chunk {a.chunk + 1}'s backward of micro-batch {a.micro}"
    else:
        own = "F" if a.kind == "B" else "B"
        why = f"its own {own}(chunk {a.chunk}, micro {a.micro}), later in its program"
    return f"device {d} waits to run {a} for {why}"
