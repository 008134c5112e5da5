"""A stage's memory plan, run: the blocks the plan re-makes in the backward run under
activation checkpointing, so that the rank keeps what the plan says it keeps.

The planner chooses per block among op-level options (``dist.block_cost``): ``none`` keeps
everything, ``full`` keeps only the block's input (re-made whole: a non-reentrant
``torch.utils.checkpoint`` of the block), ``drop:<ops>`` re-makes some of its ops: those ops,
by the plan's record of the block's ATen ops (``op_recompute``). A ``drop:`` block without that
record (a plan of a model by its shape), or whose units write in place, is re-made whole, and a
note says so (it keeps less than planned and spends more time); options of the chain's ends
(``<prelude>``, ``<rest>``: the loss re-made in parts) are not modules and are reported as not
run.

Example (``parallelize`` calls it on each of this rank's chunks):
    >>> apply_memory_plan(chunk, {"h.1": "full", "h.2": "none"}, {})   # doctest: +SKIP
    []
"""

from __future__ import annotations

import functools

import torch

from .op_recompute import recompute_ops

__all__ = ["apply_memory_plan", "block_ops", "block_options"]


def block_options(plan, stage: int) -> dict[str, str]:
    """Block name -> memory option of the plan's ``stage`` (empty for an older plan)."""
    for s in plan.stages:
        if s["index"] == stage:
            return dict(zip(s["blocks"], s.get("block_options", [])))
    return {}


def block_ops(plan, stage: int) -> dict[str, list]:
    """Block name -> its units' ATen ops and kept flags, for the ``drop:`` blocks of the
    plan's ``stage`` (``GraphModel.op_signature``)."""
    for s in plan.stages:
        if s["index"] == stage:
            return dict(s.get("block_ops", {}))
    return {}


def apply_memory_plan(chunk: torch.nn.Module, options: dict[str, str],
                      signatures: dict[str, list], notes: list[str] | None = None) -> list[str]:
    """Checkpoint the blocks of ``chunk`` whose option re-makes anything; notes on what runs
    otherwise than planned (``notes``, if given, also takes what the runtime finds later)."""
    from .stage_split import MODEL

    notes = [] if notes is None else notes
    modules = dict(chunk.body.named_modules())
    for block, option in options.items():
        if option == "none":
            continue
        module = modules.get(f"{MODEL}.{block}")
        if module is None:
            if not block.startswith("<"):
                continue     # NOTE: another chunk's block (a device's chunks share its plan)
            _say(notes, f"{block}: the plan's {option!r} is not run (the chain's end is not a "
                         f"module: it runs as planned without it, keeping more)")
            continue
        if option.startswith("drop:"):
            why = _why_not_ops(signatures.get(block), option)
            if why is None:
                dropped = {int(o.removeprefix("o")) for o in option[5:].split("+")}
                recompute_ops(module, signatures[block], dropped, block, notes)
                continue
            _say(notes, f"{block}: the plan re-makes some ops ({option}); the runtime "
                         f"re-makes the whole block ({why}: keeps less, spends more time)")
        elif option != "full":
            _say(notes, f"{block}: the plan's memory option {option!r} is not run by the "
                         f"runtime: it re-makes the whole block (keeps less, spends more time)")
        _checkpoint(module)
    return notes


def _say(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def _why_not_ops(signature: list | None, option: str) -> str | None:
    if not signature:
        return "the plan does not record the block's ops"
    if any(len(names) != 1 for names, _ in signature):
        return "some of its ops write in place"
    names = option[5:].split("+")
    if not all(n.startswith("o") and n[1:].isdigit() and int(n[1:]) < len(signature)
               for n in names):
        return f"the plan names ops {names} the block's record does not have"
    return None


def _checkpoint(module: torch.nn.Module) -> None:
    """Run ``module`` under non-reentrant activation checkpointing (parameter names kept)."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
