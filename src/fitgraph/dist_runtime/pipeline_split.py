"""A multi-device plan's pipeline stages cut from the user's module.

A plan of a captured model names each stage's blocks by module path (``layers.2``, the
chain's ``<prelude>``/``<rest>`` ends aside): stage ``k > 0`` begins at its first block, which
``torch.distributed.pipelining.pipeline`` takes as a split point; each rank then builds its
stage (``build_stage``) and runs it with the plan's schedule.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_stage", "split_points"]


def split_points(plan) -> dict[str, Any]:
    """``{module path: SplitPoint.BEGINNING}`` of every stage after the first, from a
    ``DistPlan``'s stages."""
    from torch.distributed.pipelining import SplitPoint

    out = {}
    for stage in plan.stages[1:]:
        first = stage["blocks"][0]
        if first.startswith("<"):
            raise ValueError(f"stage {stage['index']} begins with {first}, not a module: a plan "
                             f"whose stages begin at the model's repeated blocks can be cut")
        out[first] = SplitPoint.BEGINNING
    return out


def build_stage(model, micro_batch_args: tuple, plan, rank: int, device=None):
    """This rank's ``PipelineStage`` of ``model`` cut as ``plan`` says (one stage per rank)."""
    import torch
    from torch.distributed.pipelining import pipeline

    if plan.parallelism.pp < 2:
        raise ValueError("the plan has one stage: nothing to pipeline")
    pipe = pipeline(model, micro_batch_args, split_spec=split_points(plan))
    return pipe.build_stage(rank, torch.device("cpu") if device is None else device)
