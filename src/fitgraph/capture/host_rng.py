"""Python's and NumPy's global random generators, which a traced step must not draw from, and
torch's, which it must not seed.

A step that draws from ``random`` or ``numpy.random`` (an augmentation ``if random.random() <
0.5: x = x.flip(-1)`` in the forward or the loss) is traced with one draw: the plan would take
that branch, or use that number, at every step, where eager draws again each time (silently
other results). Torch's own generator is another matter: its draws are ops of the graph, which
the plan makes as eager does, on fake tensors while tracing, so its state does not move then;
where it moved, the step seeded it (``torch.manual_seed`` in a forward, to draw the same masks
each step), which a plan, running no Python, would not do again. ``no_host_draws`` wraps a
trace: it puts the generators back as they were (capture leaves the caller's random streams
untouched) and, where the trace drew from one or seeded torch's, raises a CaptureError saying
what to do.

Example:
    >>> import random
    >>> from fitgraph.capture.host_rng import no_host_draws
    >>> with no_host_draws():
    ...     pass
    >>> try:
    ...     with no_host_draws():
    ...         _ = random.random()
    ... except Exception as e:
    ...     print(type(e).__name__, str(e).split("] ")[1].split(":")[0])
    CaptureError the step draws from Python's random module
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch

from .errors import CaptureError

__all__ = ["no_host_draws"]


def _numpy_random():
    try:
        import numpy
    except ImportError:  # NOTE: torch runs without numpy
        return None
    return numpy.random


@contextlib.contextmanager
def no_host_draws() -> Iterator[None]:
    """Within the block, draws from Python's or NumPy's global generator are an error (raised
    when the block ends without one of its own); both generators end as they began."""
    np_random = _numpy_random()
    py_state = random.getstate()
    np_state = np_random.get_state() if np_random is not None else None
    torch_state = torch.get_rng_state()
    try:
        yield
        drew = [name for name, moved in (
            ("Python's random module", random.getstate() != py_state),
            ("numpy.random", np_random is not None and _moved(np_random.get_state(), np_state)),
        ) if moved]
        seeded = not torch.equal(torch.get_rng_state(), torch_state)
    finally:
        random.setstate(py_state)
        if np_random is not None:
            np_random.set_state(np_state)
        torch.set_rng_state(torch_state)
    if seeded:
        raise CaptureError("the step seeds torch's random generator (torch.manual_seed or "
                           "set_rng_state in the forward or the loss): a plan runs no Python, so "
                           "it would not seed it again at every step as eager does; seed outside "
                           "the step, or pass a torch.Generator's draws in the batch",
                           module="", op="torch.manual_seed")
    if drew:
        raise CaptureError(f"the step draws from {' and '.join(drew)}: a plan would repeat the "
                           "one draw made when it was captured at every step, where eager draws "
                           "anew; draw it outside the step (in the data pipeline, passed in the "
                           "batch as a tensor) or with torch's generator (torch.rand), whose "
                           "draws the plan makes as eager does", module="", op="random")


def _moved(now, before) -> bool:
    """Whether two ``numpy.random.get_state()`` answers differ."""
    return any(bool((a != b).any()) if hasattr(a, "shape") else a != b
               for a, b in zip(now, before))
