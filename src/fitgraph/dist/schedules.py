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

Example:
    >>> from fitgraph.dist.schedules import bubble_fraction, in_flight
    >>> bubble_fraction("1f1b", p=8, m=64), bubble_fraction("interleaved", p=8, m=64, v=2)
    (0.109375, 0.0546875)
    >>> in_flight("1f1b", p=8, m=64, stage=0), in_flight("interleaved", p=8, m=64, stage=0, v=2)
    (8.0, 11.5)
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "bubble_fraction", "in_flight"]

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
