"""Checkpoints of a running plan in ``torch.distributed.checkpoint`` (DCP) format, keyed by
the user's model's own state-dict names, so that they load back into the unsplit model in one
process (or into the same plan's ranks).

Each rank writes what it runs: its stages' parameters and persistent buffers; a data-parallel
(FSDP2) parameter as its shards, which DCP joins; a tensor-parallel one gathered whole from its
shards (the column-parallel parts of a fused QKV weight are not one ``Shard`` layout DCP
knows). A parameter two stages hold (a tied embedding) is written once. The optimizer's state
goes with it, per parameter by the same name (``optimizer.state.<parameter>.<key>``: AdamW's
``exp_avg``, ``exp_avg_sq``, ``step``), sharded and gathered as its parameter; under ZeRO-1
each replica writes the share it steps.

Example:
    >>> step.save("ckpt/step-100")                                    # doctest: +SKIP
    >>> model = build_model()                                         # doctest: +SKIP
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-4)          # doctest: +SKIP
    >>> load_unsplit(model, "ckpt/step-100", opt)   # one process, no process group  # doctest: +SKIP
"""

from __future__ import annotations

import warnings

import torch

from ...capture.combined_optimizer import as_optimizer, members

__all__ = ["OPTIMIZER", "load_unsplit", "rank_state_dict", "save"]

OPTIMIZER = "optimizer.state."


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
    out.update(_optimizer_state(step))
    return out


def _optimizer_state(step) -> dict[str, torch.Tensor]:
    # NOTE: ZeroRedundancyOptimizer steps this replica's share with an inner optimizer; each
    # member of several optimizers (Muon + AdamW) its own parameters
    states = [getattr(getattr(m, "optim", m), "state", {}) for m in members(step.optimizer)]
    out: dict[str, torch.Tensor] = {}
    for name, p in sorted(step.named_parameters(), key=lambda x: x[0]):
        held = next((s[p] for s in states if p in s), {})
        for key, value in sorted(held.items()):
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            elif value.dim() and value.shape == p.shape:
                # NOTE: shaped like its parameter: sharded like it (every rank of the stage
                # holds the state of the same parameters, so the gathers match)
                value = step.unsharded(name, value, data_parallel=False)
            out[f"{OPTIMIZER}{name}.{key}"] = value
    return out


def save(step, path: str) -> None:
    """Write the model's state from every rank into the DCP checkpoint ``path``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(rank_state_dict(step), checkpoint_id=path)


def load_unsplit(model: torch.nn.Module, path: str, optimizer=None) -> None:
    """Load a plan's checkpoint into the whole ``model`` (one process, no process group) and,
    if given, ``optimizer``'s state (an optimizer of ``model``'s parameters, of the class the
    plan ran; or a list of them, as the plan ran them)."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    _load(state, path)
    model.load_state_dict(state)
    if optimizer is None:
        return
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith(OPTIMIZER) and hasattr(m, "size")}
    if not saved:
        raise ValueError(f"{path}: the checkpoint holds no optimizer state (written before "
                         f"the first step, or by an optimizer that keeps none)")
    _load(saved, path)
    name_of = {id(p): n for n, p in model.named_parameters()}
    opts = members(as_optimizer(optimizer))
    index: dict[str, tuple[int, int]] = {}   # parameter name -> (member, its index there)
    for o, member in enumerate(opts):
        for i, p in enumerate(p for group in member.param_groups for p in group["params"]):
            if id(p) in name_of:
                index[name_of[id(p)]] = (o, i)
    per_param: list[dict[int, dict]] = [{} for _ in opts]
    for k, v in saved.items():
        name, key = k[len(OPTIMIZER):].rsplit(".", 1)
        if name not in index:
            raise ValueError(f"{path}: optimizer state of {name!r}, which the optimizer "
                             f"does not step")
        o, i = index[name]
        per_param[o].setdefault(i, {})[key] = v
    for member, state in zip(opts, per_param):
        member.load_state_dict({"state": state,
                                "param_groups": member.state_dict()["param_groups"]})


def _load(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # NOTE: one process without a process group is what this function is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
