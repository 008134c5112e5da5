"""Wrappers around a model that ``fitgraph.optimize`` looks through, or refuses.

``torch.compile(model)`` and ``nn.DataParallel(model)`` hold the module they run (sharing its
parameters): fitgraph captures, plans and runs that module whole, where dynamo would break the
capture into regions; a warning says the wrapper's kernels or replicas are not what runs.
DistributedDataParallel and FSDP average gradients across processes in autograd hooks that a
planned step does not run: a CaptureError says what to do instead.

Example:
    >>> import warnings, torch
    >>> from fitgraph.capture.wrappers import unwrapped
    >>> lin = torch.nn.Linear(2, 2)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     unwrapped(torch.nn.DataParallel(lin)) is lin
    True
"""

from __future__ import annotations

import warnings

import torch

from .errors import CaptureError

__all__ = ["unwrapped"]

# NOTE: wrappers whose gradients are reduced across processes by hooks a plan does not run
_DISTRIBUTED = ("DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule")


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile(model)`` or ``nn.DataParallel(model)`` wraps (it shares its
    parameters), with a warning: fitgraph captures, plans and runs it whole, on its device, not
    the wrapper's compiled kernels or replicas (the same results). A model wrapped for several
    processes (DDP, FSDP) is a CaptureError: its gradients are averaged by hooks a plan does not
    run."""
    names = {c.__name__ for c in type(model).__mro__}
    if names & set(_DISTRIBUTED):
        kind = next(n for n in _DISTRIBUTED if n in names)
        raise CaptureError(f"the model is wrapped by {kind}, whose gradient reduction across "
                           "processes a planned step would not run: plan the module it wraps "
                           "with optimizer=None, reduce its gradients yourself "
                           "(torch.distributed.all_reduce on each .grad, divided by the world "
                           "size) and call optimizer.step()", module="", op=kind)
    kind, attr = {"OptimizedModule": ("torch.compile", "_orig_mod"),
                  "DataParallel": ("nn.DataParallel", "module")}.get(type(model).__name__,
                                                                     (None, ""))
    inner = getattr(model, attr, None)
    if kind is None or not isinstance(inner, torch.nn.Module):
        return model
    warnings.warn(f"fitgraph: the model is wrapped by {kind}; fitgraph plans and runs the "
                  "module it wraps (the same parameters) with its own plan, on its device, not "
                  "the wrapper's kernels or replicas (for torch.compile's kernels: "
                  "torch.compile(model, backend=fitgraph.backend(...)))", stacklevel=3)
    return inner
