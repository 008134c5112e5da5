"""fitgraph's FakeTensorMode: torch's, with fake kernels of its own where torch's meta kernel is
stricter than the real kernels eager runs (``FAKE_KERNELS``; see each kernel's module).

A meta kernel that rejects what the CPU or CUDA kernel accepts makes a model that trains in
eager fail to capture; a fake kernel that mirrors the real one captures the op eager runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .grouped_mm import grouped_mm_fake

__all__ = ["CaptureFakeMode", "FAKE_KERNELS"]

FAKE_KERNELS: dict[torch._ops.OpOverload, Callable[..., object]] = {
    torch.ops.aten._grouped_mm.default: grouped_mm_fake,
}


class CaptureFakeMode(FakeTensorMode):
    """FakeTensorMode whose ops in ``FAKE_KERNELS`` run fitgraph's kernel instead of torch's
    meta kernel (unless the kernel returns NotImplemented); every other op dispatches as in
    FakeTensorMode."""

    def dispatch(self, func, types, args=(), kwargs=None):
        kernel = FAKE_KERNELS.get(func)
        if kernel is not None:
            # NOTE: ahead of FakeTensorMode's dispatch cache, which every fake mode shares
            with self:  # NOTE: the kernel's empty_strided must make a FakeTensor of this mode
                out = kernel(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        return super().dispatch(func, types, args, kwargs)
