"""A stage's memory plan, run: the blocks the plan re-makes in the backward run under
activation checkpointing, so that the rank keeps what the plan says it keeps.

The planner chooses per block among op-level options (``dist.block_cost``): ``none`` keeps
everything, ``full`` keeps only the block's input (re-made whole: a non-reentrant
``torch.utils.checkpoint`` of the block), ``drop:<ops>`` re-makes some of its ops. The runtime
re-makes a ``drop:`` block whole too, and says so (it keeps less than planned and spends more
time); options of the chain's ends (``<prelude>``, ``<rest>``: the loss re-made in parts) are
not modules and are reported as not run.

Example (``parallelize`` calls it on each of this rank's chunks):
    >>> apply_memory_plan(chunk, {"h.1": "full", "h.2": "none"})       # doctest: +SKIP
    []
"""

from __future__ import annotations

import functools

import torch

__all__ = ["apply_memory_plan", "block_options"]


def block_options(plan, stage: int) -> dict[str, str]:
    """Block name -> memory option of the plan's ``stage`` (empty for an older plan)."""
    for s in plan.stages:
        if s["index"] == stage:
            return dict(zip(s["blocks"], s.get("block_options", [])))
    return {}


def apply_memory_plan(chunk: torch.nn.Module, options: dict[str, str]) -> list[str]:
    """Checkpoint the blocks of ``chunk`` whose option re-makes anything; notes on what runs
    otherwise than planned."""
    from .stage_split import MODEL

    notes = []
    modules = dict(chunk.body.named_modules())
    for block, option in options.items():
        if option == "none":
            continue
        module = modules.get(f"{MODEL}.{block}")
        if module is None:
            if not block.startswith("<"):
                continue     # NOTE: another chunk's block (a device's chunks share its plan)
            notes.append(f"{block}: the plan's {option!r} is not run (the chain's end is not a "
                         f"module: it runs as planned without it, keeping more)")
            continue
        if option != "full":
            notes.append(f"{block}: the plan re-makes some ops ({option}); the runtime "
                         f"re-makes the whole block (keeps less, spends more time)")
        _checkpoint(module)
    return notes


def _checkpoint(module: torch.nn.Module) -> None:
    """Run ``module`` under non-reentrant activation checkpointing (parameter names kept)."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
