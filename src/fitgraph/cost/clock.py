"""The planning clock: the seconds that count against a solver's time budget — wall time less
the time spent measuring ops (``ProfiledCostModel.profile`` runs inside ``measuring()``).

A solver that plans on measured costs profiles the new graphs it makes (fission's split
graphs, masks as bits, chunked updates) the first time it costs them; the next plan in the
process finds them in the cost cache. On the wall clock, that measuring ate the first plan's
time budget and not the second's, so the same problem planned twice took two paths (a fission
search cut short at its deadline once, searched further the second time: GPT-2 small at 0.4 of
its peak, 0.61 s simulated against 0.52 s). On this clock both plans have the same time, so a
plan does not depend on which ops the cache already held. Solvers whose deadlines span
profiling read ``planning_now()`` in place of ``time.perf_counter()``.

Example:
    >>> import time
    >>> from fitgraph.cost.clock import measuring, planning_now
    >>> t0 = planning_now()
    >>> with measuring():
    ...     time.sleep(0.2)          # an op being measured: not planning time
    >>> planning_now() - t0 < 0.1
    True
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["measuring", "measured_s", "planning_now"]

_measured_s = 0.0
_depth = 0


@contextmanager
def measuring() -> Iterator[None]:
    """Time spent inside is measuring, not planning (nested: counted once)."""
    global _measured_s, _depth
    _depth += 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _measured_s += time.perf_counter() - t0


def measured_s() -> float:
    """Seconds this process has spent measuring ops so far."""
    return _measured_s


def planning_now() -> float:
    """``time.perf_counter()`` less every second spent measuring ops: differences of it are
    planning time."""
    return time.perf_counter() - _measured_s
