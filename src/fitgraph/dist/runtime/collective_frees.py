"""Collectives whose buffers are freed on the calling thread, so that the CPU allocator meter
sees them go.

Gloo runs each collective on a worker thread of its own, and that thread holds the
collective's tensors until it is done with them. When the caller has dropped its last
reference first (FSDP2 drops an all-gather's output right after copying it out, a finished
reduce-scatter's input at the next block), the tensor is freed *on the worker thread* — where
the profiler that ``execute.meter.MemoryMeter`` reads records nothing. The free is never seen
and every later moment of the rank looks that many bytes fuller (measured: 50 all-gathers of a
0.4 MB shard left 14 MB "held" that was long freed).

While metering, ``frees_on_this_thread`` wraps the collectives fitgraph's runtime reaches
(FSDP2's ``all_gather_single``/``reduce_scatter_single``, ``all_reduce``, ``broadcast``): each
is issued asynchronously and its ``Work`` — which owns the collective's tensors and gloo's
temporaries (a reduce-scatter's copy of its input) — is kept by this thread until a moment
(``SETTLE_S``) after it finished, when the worker has let go of it; then dropped here, at the
next collective or ``release``, so that what only the collective held is freed where the meter
sees it. A buffer may so live a little past its true free: the measured peak stays an upper
bound of the true one, no longer an unbounded one.

Example (inside a gloo launch; see ``run_processes``):
    >>> with frees_on_this_thread() as held:       # doctest: +SKIP
    ...     dist.all_reduce(t)
    ...     held.release()
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from typing import Any

__all__ = ["SETTLE_S", "WRAPPED", "HeldWorks", "frees_on_this_thread"]

# NOTE: the collectives FSDP2, DDP's Python side and fitgraph's own step call through the
# ``torch.distributed`` module's attributes (looked up at each call, so a patch reaches them).
# Point-to-point ops are left alone: pipelining checks ``P2POp.op`` against c10d's own
# ``isend``/``irecv`` and its receive buffers are the stage's, kept.
WRAPPED = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_reduce", "broadcast")

# NOTE: a finished collective's worker lets go of it within microseconds unless descheduled
# (2 cores, 4 ranks): a work is dropped this long after it finished, under metering only
SETTLE_S = 0.005


class HeldWorks:
    """The ``Work`` of every collective issued while metering, with the moment it was seen
    finished, kept until gloo's worker has let go of it."""

    def __init__(self) -> None:
        self.pending: list[list[Any]] = []       # [work, finished at (or None)]

    def release(self, wait_s: float = 0.0) -> None:
        """Drop the works finished ``SETTLE_S`` ago (waiting up to ``wait_s`` for that)."""
        now = time.perf_counter()
        for entry in self.pending:
            # NOTE: gloo's reduce-scatter work never reports itself completed: it is only
            # issued synchronously here (FSDP2 does), finished when wait() returned
            if entry[1] is None and entry[0].is_completed():
                entry[1] = now
        done = [e[1] for e in self.pending if e[1] is not None]
        if done and wait_s > 0:
            time.sleep(max(0.0, min(wait_s, max(done) + SETTLE_S - now)))
            now = time.perf_counter()
        self.pending = [e for e in self.pending if e[1] is None or now - e[1] < SETTLE_S]

    def wrap(self, name: str, fn):
        sig = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            self.release()
            bound = sig.bind(*args, **kwargs)
            wanted_async = bool(bound.arguments.get("async_op", False))
            bound.arguments["async_op"] = True
            work = fn(*bound.args, **bound.kwargs)
            if work is None:            # NOTE: this rank is not in the group
                return None
            if wanted_async:
                self.pending.append([work, None])
                return work
            work.wait()
            self.pending.append([work, time.perf_counter()])
            return None

        wrapped.__name__ = wrapped.__qualname__ = name
        wrapped.__wrapped__ = fn
        return wrapped


@contextmanager
def frees_on_this_thread():
    """Within: the collectives in ``WRAPPED`` leave their works to this thread to drop (yields
    the ``HeldWorks``; all dropped on leaving)."""
    import torch.distributed as dist

    held = HeldWorks()
    originals = {n: getattr(dist, n) for n in WRAPPED if hasattr(dist, n)}
    for name, fn in originals.items():
        setattr(dist, name, held.wrap(name, fn))
    try:
        yield held
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        held.release(wait_s=1.0)
        held.pending.clear()
