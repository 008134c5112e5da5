"""Zoo-derived graphs: the first blocks of a zoo model, alone, for solver-vs-optimum studies.

A whole zoo model is too large for an exact MILP, and cut to one block its floor is set by
what remat cannot touch (weights, the loss region). ``block_stack`` keeps only a run of the
model's blocks (``ZooCase.block_types``: transformer layers, ResNet bottlenecks): it runs the
full model once to record what the first block receives (its hidden-state input and any extra
arguments: causal mask, rotary tables, attention mask), then builds a module that applies the
first ``blocks`` blocks to that input, with a mean-squared-error loss against a fixed random
target. The blocks are the model's own modules (same weights, same ops), so the graph is
the model's body as planners see it, and activations dominate as they do in deep models.

Example:
    >>> from fitgraph.bench.derived import block_stack
    >>> case = block_stack("gpt2", 2)
    >>> len(case.model.blocks), case.name
    (2, 'gpt2[2 blocks]')
    >>> float(case.loss().detach()) > 0
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..zoo.registry import ZooCase

__all__ = ["BlockStack", "block_stack"]


class BlockStack(nn.Module):
    """``forward(x)``: ``x = block(x, *extras)`` for each block; extras are buffers."""

    def __init__(self, blocks: list[nn.Module], extras: tuple) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self._kinds: list[str | object] = []
        for i, e in enumerate(extras):
            if isinstance(e, torch.Tensor):
                # NOTE: a buffer, so capture sees it as a graph input (not a constant)
                self.register_buffer(f"extra{i}", e.detach().clone(), persistent=False)
                self._kinds.append(f"extra{i}")
            else:
                self._kinds.append((e,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extras = [getattr(self, k) if isinstance(k, str) else k[0] for k in self._kinds]
        for block in self.blocks:
            x = block(x, *extras)
        return x


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def block_stack(name: str, blocks: int, batch_size: int | None = None,
                seed: int = 0, dropout: bool = True) -> ZooCase:
    """The first ``blocks`` blocks of zoo model ``name`` (small configuration, ``batch_size``
    overriding the config's), on the hidden states its first block receives.
    ``dropout=False``: the blocks run without dropout (as in most LLM pre-training today), by
    putting every module but batch norms in eval mode."""
    from .. import zoo

    case = zoo.build(name, "small", batch_size=batch_size, seed=seed)
    found = [m for m in case.model.modules() if isinstance(m, case.block_types)]
    if len(found) < blocks:
        raise ValueError(f"zoo model {name!r} has {len(found)} blocks, not {blocks}")
    seen: dict = {}

    def record(_module, args, kwargs):
        if kwargs:
            raise ValueError(f"{name}: its blocks take keyword arguments "
                             f"({', '.join(kwargs)}); block_stack passes positional ones only")
        seen.setdefault("args", args)

    hook = found[0].register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            case.loss()
    finally:
        hook.remove()
    x, *extras = seen["args"]
    stack = BlockStack(found[:blocks], tuple(extras))
    if not dropout:
        for m in stack.modules():
            if not isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.training = False
    with torch.no_grad():
        target = torch.randn(stack(x).shape, generator=torch.Generator().manual_seed(seed + 1))
    tag = "" if dropout else ", no dropout"
    return ZooCase(name=f"{name}[{blocks} blocks{tag}]", config="small", model=stack,
                   batch=(x.detach().clone(), target), loss_fn=_mse,
                   block_types=case.block_types,
                   description=f"the first {blocks} blocks of {name} (small{tag}), MSE loss")
