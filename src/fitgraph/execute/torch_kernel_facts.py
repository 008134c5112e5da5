"""torch's answers to what the planner asks of kernels (``graph.kernel_facts``), registered
when ``fitgraph.execute`` loads.

Example:
    >>> import fitgraph
    >>> from fitgraph.graph.kernel_facts import kernel_facts
    >>> kernel_facts().packs_alike("cpu")
    True
"""

from __future__ import annotations

import functools

import torch

from ..graph.ir import Graph, Node
from ..graph.kernel_facts import use_kernel_facts
from . import bit_packing
from .ops import ArgBinder, resolve_target

__all__ = ["TorchKernelFacts"]


class TorchKernelFacts:
    """Bit packing and BatchNorm's re-made output checked on the device; strides from running
    the op on meta tensors."""

    def packs_alike(self, device: str) -> bool:
        # NOTE: read from the module at each call (tests replace it)
        return bit_packing.packs_alike(device)

    def strides_kept(self, graph: Graph, node: Node, vid: int,
                     stride: tuple[int, ...]) -> bool:
        env = {v: torch.empty_strided(graph.values[v].shape,
                                      stride if v == vid else graph.values[v].stride,
                                      dtype=getattr(torch, graph.values[v].dtype),
                                      device="meta")
               for v in node.inputs}
        try:
            args, kwargs = ArgBinder(node)(env)
            made = resolve_target(node.target)(*args, **kwargs)
        except Exception:   # NOTE: any op that cannot run on meta tensors is left as it is
            return False
        made = made if isinstance(made, (tuple, list)) else (made,)
        return all(o is None or tuple(t.stride()) == graph.values[o].stride
                   for o, t in zip(node.outputs, made))

    def batch_norm_from_stats(self, device: str, dtype: str, eps: float) -> bool:
        return _batch_norm_from_stats(device, dtype, eps)


@functools.cache
def _batch_norm_from_stats(device: str, dtype: str, eps: float) -> bool:
    """Whether ``native_batch_norm(x, invstd * w, b, mean, 1 - eps, False, ...)`` makes the
    training kernel's output bit for bit (``transform.norm_from_stats``), tried on random
    tensors of a few ranks and layouts (odd sizes: vector bodies and scalar tails), with and
    without the affine parameters, on a private generator. False where it differs or cannot
    run."""
    try:
        dt = getattr(torch, dtype)
        if not dt.is_floating_point:
            return False
        gen = torch.Generator().manual_seed(0)
        for shape, channels_last in (((5, 19, 7, 9), False), ((5, 19, 7, 9), True),
                                     ((6, 37, 11), False), ((33, 21), False)):
            x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dt).to(device)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            c = shape[1]
            w = torch.randn(c, generator=gen, dtype=torch.float64).to(dt).to(device)
            b = torch.randn(c, generator=gen, dtype=torch.float64).to(dt).to(device)
            for weight, bias in ((w, b), (None, None)):
                rm, rv = torch.zeros_like(w), torch.ones_like(w)
                y, mean, invstd = torch.ops.aten.native_batch_norm(
                    x, weight, bias, rm, rv, True, 0.1, eps)
                scale = invstd if weight is None else invstd * weight
                again = torch.ops.aten.native_batch_norm(
                    x, scale, bias, mean, mean.new_full(mean.shape, 1.0 - eps), False, 0.1,
                    eps)[0]
                if not torch.equal(y, again) or y.stride() != again.stride():
                    return False
        return True
    except (RuntimeError, TypeError, AttributeError):
        return False


use_kernel_facts(TorchKernelFacts())
