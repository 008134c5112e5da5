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
runs on *aliases* of its tensors (new tensor objects on the same memory) that this thread
keeps. Gloo's state holds the aliases, so an alias's reference count falls back to this
thread's own exactly when gloo has let go of it — whichever thread that happened on, nothing
was freed there, the alias still holding the memory. Then the alias is dropped here (at the
next collective, or ``release``), and with it, where the meter sees it, whatever only the
collective still held. An all-gather or reduce-scatter runs as an all-reduce (which holds
the very tensor it is given): an all-gather in place on its output (the other ranks' parts
zeroed, so the sum is the gather), a reduce-scatter on a copy of its input made and dropped
here (gloo's own makes that copy inside, where its free could not be kept on this thread) —
each finished before it returns. A buffer may so live a little past its true free (until the
next collective): the measured peak is an upper bound of the true one. Left: in a rare run
(about 1 in 10 runs of a test's 80 collectives) one buffer's free still goes unseen — a
measurement too high, never too low (``tests/test_dist_runtime_memory.py`` measures such a
rank again).

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

__all__ = ["WRAPPED", "HeldAliases", "frees_on_this_thread"]

# NOTE: the collectives FSDP2, DDP's Python side and fitgraph's own step call through the
# ``torch.distributed`` module's attributes (looked up at each call, so a patch reaches them).
# Point-to-point ops are left alone: pipelining checks ``P2POp.op`` against c10d's own
# ``isend``/``irecv`` and its receive buffers are the stage's, kept.
WRAPPED = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_reduce", "broadcast")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")
_GATHERS = ("all_gather_single", "all_gather_into_tensor")
# NOTE: how long a finished collective's aliases are waited for: gloo's worker lets go within
# microseconds unless descheduled; past it they go at the next collective (nothing is missed)
SETTLE_S = 0.05


class HeldAliases:
    """The aliases of every metered collective's tensors, kept until gloo let go of them."""

    def __init__(self) -> None:
        self.pending: list[list[Any]] = []

    def release(self, wait_s: float = 0.0, until: list | None = None) -> None:
        """Drop the aliases gloo is done with, waiting up to ``wait_s`` seconds for the rest
        (for the aliases ``until`` only, when given)."""
        deadline = time.perf_counter() + wait_s
        while True:
            pending, self.pending = self.pending, []
            # NOTE: popped one by one, so that an alias list dropped here is the last reference
            while pending:
                aliases = pending.pop(0)
                if any(a._use_count() > 1 for a in aliases):
                    self.pending.append(aliases)
                del aliases
            waiting = (self.pending if until is None
                       else [p for p in self.pending if p is until])
            if not waiting or time.perf_counter() >= deadline:
                return
            del waiting
            time.sleep(1e-4)

    def wrap(self, name: str, fn, all_reduce):
        import torch

        sig = inspect.signature(fn)

        def alias(value, aliases: list):
            if isinstance(value, torch.Tensor):
                aliases.append(value.view(value.shape))
                return aliases[-1]
            if isinstance(value, (list, tuple)) and value and all(
                    isinstance(v, torch.Tensor) for v in value):
                return type(value)(alias(v, aliases) for v in value)
            return value

        def wrapped(*args, **kwargs):
            self.release()
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            wanted_async = bool(bound.arguments.get("async_op"))
            if name in _SCATTERS:
                return self._scatter(bound.arguments, all_reduce)
            if name in _GATHERS and bound.arguments["output_tensor"].is_contiguous():
                return self._gather(bound.arguments, all_reduce)
            aliases: list = []
            for key, value in list(bound.arguments.items()):
                bound.arguments[key] = alias(value, aliases)
            work = fn(*bound.args, **bound.kwargs)
            self.pending.append(aliases)
            del bound
            if not wanted_async:
                # NOTE: finished: gloo lets go within microseconds; the aliases dropped then,
                # the caller's own references are the last, dropped on this thread
                self.release(wait_s=SETTLE_S, until=aliases)
            return work

        wrapped.__name__ = wrapped.__qualname__ = name
        wrapped.__wrapped__ = fn
        return wrapped

    def _gather(self, args: dict, all_reduce):
        """An all-gather as an all-reduce in place on the output, the other ranks' parts
        zeroed (synchronously; a finished work is returned where one was asked for)."""
        import torch.distributed as dist

        output, source, group = args["output_tensor"], args["input_tensor"], args.get("group")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = output.view(world, -1)
        for r in range(world):
            if r != rank:
                parts[r].zero_()
        # NOTE: FSDP2's input is a view of its output's own part: copied onto itself
        parts[rank].copy_(source.reshape(-1))
        del parts
        work, _ = self._all_reduced(output.view(output.shape), all_reduce, None, group)
        return work if args.get("async_op") else None

    def _scatter(self, args: dict, all_reduce):
        """A reduce-scatter as an all-reduce of a copy of the input, this rank's part copied
        out (synchronously; a finished work is returned where one was asked for)."""
        import torch.distributed as dist

        output = args.get("output", args.get("output_tensor"))
        source = args.get("input", args.get("input_tensor"))
        op, group = args.get("op", dist.ReduceOp.SUM), args.get("group")
        world = dist.get_world_size(group)
        average = op == dist.ReduceOp.AVG
        work, mine = self._all_reduced(
            source.detach().clone(), all_reduce, dist.ReduceOp.SUM if average else op, group,
            lambda whole: whole.reshape(world, -1)[dist.get_rank(group)])
        output.reshape(-1).copy_(mine / world if average else mine)
        return work if args.get("async_op") else None

    def _all_reduced(self, tensor, all_reduce, op, group, read=None):
        """``tensor`` all-reduced, held here until gloo lets go of it; the finished work and
        ``read(tensor)`` (read before this thread's last reference is left to ``pending``)."""
        kwargs = {} if op is None else {"op": op}
        work = all_reduce(tensor, group=group, async_op=True, **kwargs)
        mark = [tensor]
        self.pending.append(mark)
        work.wait()
        value = read(tensor) if read is not None else None
        del tensor
        self.release(wait_s=SETTLE_S, until=mark)
        return work, value


@contextmanager
def frees_on_this_thread():
    """Within: the collectives in ``WRAPPED`` run on aliases this thread drops once gloo is
    done with them (yields the ``HeldAliases``; all released on leaving)."""
    import torch.distributed as dist

    held = HeldAliases()
    originals = {n: getattr(dist, n) for n in WRAPPED if hasattr(dist, n)}
    all_reduce = originals["all_reduce"]
    for name, fn in originals.items():
        setattr(dist, name, held.wrap(name, fn, all_reduce))
    try:
        yield held
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        held.release(wait_s=1.0)
        held.pending.clear()
