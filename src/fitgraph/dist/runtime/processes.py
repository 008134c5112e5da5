"""Run a function on ``world`` local processes joined in one gloo process group, with a time
limit: a hang fails with the ranks that did not finish instead of stalling (CI, tests).

Example:
    >>> def rank_and_world(rank, world):
    ...     import torch.distributed as dist
    ...     return rank, dist.get_world_size()
    >>> run_processes(rank_and_world, 2, timeout_s=120)   # doctest: +SKIP
    [(0, 2), (1, 2)]
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["DistributedRunError", "run_processes"]


class DistributedRunError(RuntimeError):
    """A rank raised, or did not finish in time."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    # NOTE: tensors put on a torch.multiprocessing queue travel as shared-memory file
    # descriptors that the parent fetches from the child *after* unpickling starts; a child
    # that has exited by then leaves "FileNotFoundError: .../pymp-*/listener-*" (seen in CI).
    # Bytes made by torch.save carry the tensors' data themselves.
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            out.put((rank, True, _to_bytes(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # NOTE: the parent reports it; a child must not die silently
        out.put((rank, False, traceback.format_exc()))


def run_processes(fn: Callable[..., Any], world: int, *args, timeout_s: float = 300.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned processes (gloo, localhost); their
    results by rank. ``fn`` and its arguments must pickle (a module-level function)."""
    import torch.multiprocessing as mp

    if world < 1:
        raise ValueError(f"world size {world}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world):
            rank, ok, value = out.get(timeout=timeout_s)
            (results if ok else errors)[rank] = value
    except queue.Empty:
        missing = sorted(set(range(world)) - set(results) - set(errors))
        raise DistributedRunError(f"ranks {missing} did not finish within {timeout_s:.0f} s "
                                  f"(a hang in a collective?)") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise DistributedRunError("\n".join(f"rank {r} failed:\n{errors[r]}" for r in sorted(errors)))
    return [_from_bytes(results[r]) for r in range(world)]
