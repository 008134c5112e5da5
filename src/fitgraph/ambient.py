"""What a captured step depends on besides the batch's shapes: the model's modules' modes, which
of its parameters train, and the autocast the step is called in.

Eager PyTorch runs the model as it is at each call: after ``model.eval()`` dropout draws nothing
and batch norm reads its running statistics; a parameter set to ``requires_grad=False`` gets no
gradient and no update; inside ``torch.autocast`` the matmuls run in its dtype. A plan is
captured in one such state, so ``TrainStep`` keys its plans by ``step_key`` and plans again
where the state changed, capturing in the caller's autocast (``autocast_as``); the planned
graph then runs with autocast off (``no_autocast``), its casts being ops of the graph already.

Example:
    >>> import torch
    >>> from fitgraph.ambient import step_key
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    >>> mods, params = list(m.modules()), list(m.parameters())
    >>> before = step_key(mods, params)
    >>> _ = m.eval()
    >>> step_key(mods, params) != before
    True
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     step_key(mods, params)[2]
    (('cpu', torch.bfloat16),)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["autocast_as", "autocast_state", "no_autocast", "step_key"]

_DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """(device type, dtype) of each autocast in effect here."""
    return tuple((t, torch.get_autocast_dtype(t)) for t in _DEVICE_TYPES
                 if torch.is_autocast_enabled(t))


def step_key(modules: Sequence[torch.nn.Module], params: Sequence[torch.Tensor]) -> tuple:
    """(modules not in training mode, parameters not requiring grad — by index — and
    ``autocast_state()``): a plan is valid for one of each."""
    return (tuple(i for i, m in enumerate(modules) if not m.training),
            tuple(i for i, p in enumerate(params) if not p.requires_grad),
            autocast_state())


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Within the block, exactly the autocasts of ``state`` (``autocast_state()``'s answer)."""
    with contextlib.ExitStack() as stack:
        for t in _DEVICE_TYPES:
            dtype = dict(state).get(t)
            stack.enter_context(torch.autocast(t, dtype=dtype, enabled=dtype is not None))
        yield


def no_autocast() -> contextlib.AbstractContextManager:
    """Autocast off within the block (a captured graph's casts are its own ops)."""
    return autocast_as(())
