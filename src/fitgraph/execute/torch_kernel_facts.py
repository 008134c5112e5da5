"""torch's answers to what the planner asks of kernels (``graph.kernel_facts``), registered
when ``fitgraph.execute`` loads.

Example:
    >>> import fitgraph
    >>> from fitgraph.graph.kernel_facts import kernel_facts
    >>> kernel_facts().packs_alike("cpu")
    True
"""

from __future__ import annotations

import torch

from ..graph.ir import Graph, Node
from ..graph.kernel_facts import use_kernel_facts
from . import bit_packing
from .ops import ArgBinder, resolve_target

__all__ = ["TorchKernelFacts"]


class TorchKernelFacts:
    """Bit packing checked on the device; strides from running the op on meta tensors."""

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


use_kernel_facts(TorchKernelFacts())
