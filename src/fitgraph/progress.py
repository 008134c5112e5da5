"""Progress on long waits: what fitgraph is doing, how long each part took, the best plan so far.

Quiet unless asked. ``fitgraph.optimize(..., progress=True)`` and ``fitgraph.backend(...,
progress=True)`` report on standard error (or pass a callable that takes one line); the CLI
reports unless ``--json``. The code that waits says what it does through ``stage`` and
``note``, which cost nothing when no one listens; ``listening`` turns them on for a block,
and a call inside it that passes no ``progress`` of its own reports there too.

Example:
    >>> lines = []
    >>> with listening(lines.append):
    ...     with stage("planning"):
    ...         note("hotspot: peak 1.0 MiB")
    >>> lines[0], lines[1], lines[2].startswith("planning: done in")
    ('planning ...', '  hotspot: peak 1.0 MiB', True)
    >>> with stage("nobody listens"):   # no output, no cost
    ...     pass
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Callable, Iterator

__all__ = ["enabled", "listening", "note", "on_terminal", "stage"]

Sink = Callable[[str], None]
_SINK: contextvars.ContextVar[Sink | None] = contextvars.ContextVar("fitgraph_progress",
                                                                   default=None)
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("fitgraph_progress_depth",
                                                             default=0)


def _stderr(line: str) -> None:
    print(f"fitgraph: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def listening(progress: bool | Sink | None) -> Iterator[None]:
    """Report inside the block: True on standard error, a callable gets each line, False
    silences, None leaves it as the caller set it."""
    if progress is None:
        yield
        return
    sink = _stderr if progress is True else (None if progress is False else progress)
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def enabled() -> bool:
    """Whether someone listens (to skip building a costly line)."""
    return _SINK.get() is not None


def on_terminal() -> bool:
    """Whether someone listens on standard error (where a progress bar may be drawn too)."""
    return _SINK.get() is _stderr


def note(line: str) -> None:
    """One line, indented under the stage it belongs to."""
    sink = _SINK.get()
    if sink is not None:
        sink("  " * _DEPTH.get() + line)


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """``what ...`` when it starts and ``what: done in N s`` when it ends (or ``failed``)."""
    if _SINK.get() is None:
        yield
        return
    note(f"{what} ...")
    token, t0 = _DEPTH.set(_DEPTH.get() + 1), time.perf_counter()
    ok = False
    try:
        yield
        ok = True
    finally:
        _DEPTH.reset(token)
        note(f"{what}: {'done' if ok else 'failed'} in {time.perf_counter() - t0:.1f} s")
