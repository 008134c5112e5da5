"""Pipeline schedules: the bubble each leaves, and how many micro-batches a stage holds at once.

``p`` stages, ``m`` micro-batches per iteration, ``v`` model chunks per device (interleaved):

- ``gpipe``: every forward, then every backward; bubble ``(p-1)/m`` of the ideal time; each
  stage holds the activations of all ``m`` micro-batches at the turn.
- ``1f1b`` (PipeDream-flush, Megatron's default): the same bubble; stage ``r`` (0-based) runs
  ``p - r - 1`` warm-up forwards, so it holds at most ``p - r`` micro-batches.
- ``interleaved`` (Megatron's interleaved 1F1B, ``v`` chunks of ``1/v`` of a stage's layers
  each): bubble ``(p-1)/(v m)``; stage ``r`` runs ``2 (p - r - 1) + (v - 1) p`` warm-up chunk
  forwards (Megatron-LM's ``schedules.py``), so it holds ``warm-up + 1`` chunks, each a ``1/v``
  of a stage's activations. Needs ``m`` a multiple of ``p``.
- ``zb-v`` (zero-bubble V, Qi et al.; simulated only, ``dist.simulate``): two chunks per device
  placed in a V (device ``d`` runs chunks ``d`` and ``2p - 1 - d``), backwards split into B and
  W; ``zbv_held`` gives what each of a device's two chunks holds at its memory peaks.

Example:
    >>> from fitgraph.dist.schedules import bubble_fraction, in_flight
    >>> bubble_fraction("1f1b", p=8, m=64), bubble_fraction("interleaved", p=8, m=64, v=2)
    (0.109375, 0.0546875)
    >>> in_flight("1f1b", p=8, m=64, stage=0), in_flight("interleaved", p=8, m=64, stage=0, v=2)
    (8.0, 11.5)
    >>> chunks_held(p=8, m=64, stage=0, v=2)       # after each forward, by chunk
    [(15, 8), (16, 7)]
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "bubble_fraction", "chunks_held", "in_flight", "zbv_held"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"a pipeline of {p} stages, {m} micro-batches, {v} chunks")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"{schedule} runs one chunk per device (v=1), not {v}")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) a multiple of "
                         f"the stages ({p})")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle time over the ideal (bubble-free) time of one iteration."""
    _check(schedule, p, m, v)
    return (p - 1) / (v * m)


def in_flight(schedule: str, p: int, m: int, stage: int, v: int = 1) -> float:
    """The most micro-batches whose activations stage ``stage`` holds at once, in units of one
    micro-batch of the whole stage."""
    _check(schedule, p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} of {p}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - stage, m))
    warmup = min(2 * (p - stage - 1) + (v - 1) * p, m * v)
    return min(warmup + 1, m * v) / v


def chunks_held(p: int, m: int, stage: int, v: int) -> list[tuple[int, ...]]:
    """Interleaved 1F1B: the micro-batches each of stage ``stage``'s ``v`` chunks holds right
    after each of its forwards (where its memory peaks), distinct vectors, the end of the
    warm-up first. The ``k``-th forward runs local chunk ``(k // p) % v``, the ``k``-th
    backward chunk ``v - 1 - (k // p) % v``; warm-up forwards first, then a forward and a
    backward in turn. The steady state repeats every ``p v`` pairs: two periods are walked."""
    _check("interleaved", p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} of {p}")
    total = m * v
    warm = min(2 * (p - stage - 1) + (v - 1) * p, total)
    held = [0] * v
    for k in range(warm):
        held[(k // p) % v] += 1
    seen: dict[tuple[int, ...], None] = {}
    if warm == total:
        seen[tuple(held)] = None
    for j in range(min(total - warm, 2 * p * v + 1)):
        held[((warm + j) // p) % v] += 1
        seen.setdefault(tuple(held), None)
        held[v - 1 - (j // p) % v] -= 1
    return list(seen)


def zbv_held(p: int, m: int, stage: int) -> list[tuple[int, int]]:
    """ZB-V (``dist.simulate``'s ``zb-v``, torch's ``ScheduleZBVZeroBubble`` order): the
    micro-batches device ``stage`` holds of its first chunk (``stage``) and of its second
    (``2p - 1 - stage``) right after each of its forwards, distinct vectors in order of first
    appearance.

    A micro-batch counts from the start of its F to the end of its B. The simulator keeps a
    fraction ``w_hold`` of a chunk's activations from the end of B to the end of W, but in
    this order every W that precedes one of the device's forwards runs right after its B: at
    each of these moments no micro-batch waits for its W. Activations only grow at a forward,
    so the device's peak bytes, for any ``w_hold``, are exactly
    ``max(h0 * act[stage] + h1 * act[2p - 1 - stage] for h0, h1 in zbv_held(p, m, stage))``
    (``act[k]``: one micro-batch's activation bytes of chunk ``k``).

    Example:
        >>> zbv_held(p=4, m=8, stage=3)         # 2p = 8 chunk micro-batches at most
        [(1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3), (4, 3), (4, 4), (5, 3)]
        >>> max(map(sum, zbv_held(p=4, m=8, stage=0)))
        8
    """
    # NOTE: the simulator's own order, walked: one source of truth (no import cycle: simulate
    # imports nothing from here)
    from .simulate import _B, _F, _zb_v_device

    for name, n in (("p", p), ("m", m)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} = {n!r}: a pipeline needs a positive integer")
    if not isinstance(stage, int) or not 0 <= stage < p:
        raise ValueError(f"stage {stage!r} of {p}")
    first = stage
    held = [0, 0]
    seen: dict[tuple[int, int], None] = {}
    for c in _zb_v_device(p, m, stage):
        kind, local = c & 3, 0 if (c >> 2) // m == first else 1
        if kind == _F:
            held[local] += 1
            seen.setdefault((held[0], held[1]), None)
        elif kind == _B:
            held[local] -= 1
    return list(seen)
