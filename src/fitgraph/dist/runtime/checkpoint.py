"""Checkpoints of a running plan in ``torch.distributed.checkpoint`` (DCP) format, keyed by
the user's model's own state-dict names, so that they load back into the unsplit model in one
process (or into the same plan's ranks).

Each rank writes what it runs: its stages' parameters and persistent buffers; a data-parallel
(FSDP2) parameter as its shards, which DCP joins; a tensor-parallel one gathered whole from its
shards (the column-parallel parts of a fused QKV weight are not one ``Shard`` layout DCP
knows). A parameter two stages hold (a tied embedding) is written once.

Example:
    >>> step.save("ckpt/step-100")                                    # doctest: +SKIP
    >>> model = build_model()                                         # doctest: +SKIP
    >>> load_unsplit(model, "ckpt/step-100")   # one process, no process group  # doctest: +SKIP
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["load_unsplit", "rank_state_dict", "save"]


def rank_state_dict(step) -> dict[str, torch.Tensor]:
    """This rank's part of the model's state dict (every rank calls it: tensor-parallel
    parameters are gathered)."""
    from .stage_split import model_name

    out: dict[str, torch.Tensor] = {}
    keys = step.state_keys
    for ch in step.chunks:
        for n, t in sorted([*ch.named_parameters(), *ch.named_buffers()], key=lambda x: x[0]):
            name = model_name(n)
            if name in keys and name not in out:
                # NOTE: FSDP's shards stay shards (DCP joins them); tensor-parallel ones do not
                out[name] = step.unsharded(name, t, data_parallel=False)
    return out


def save(step, path: str) -> None:
    """Write the model's state from every rank into the DCP checkpoint ``path``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(rank_state_dict(step), checkpoint_id=path)


def load_unsplit(model: torch.nn.Module, path: str) -> None:
    """Load a plan's checkpoint into the whole ``model`` (one process, no process group)."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    with warnings.catch_warnings():
        # NOTE: one process without a process group is what this function is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state)
