"""The user's optimizer rebuilt over this rank's parameters: same class, same options per
parameter group (groups matched by parameter name), and nothing of the parameters this rank
does not hold. Several optimizers (a list, or a ``CombinedOptimizer``: Muon for the matrices,
AdamW for the rest) are each rebuilt so, and step as one.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.AdamW([{"params": [net.weight], "lr": 0.1},
    ...                          {"params": [net.bias], "lr": 0.2}])
    >>> local = local_optimizer(opt, net, [("bias", net.bias)])
    >>> [g["lr"] for g in local.param_groups]
    [0.2]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ...capture.combined_optimizer import CombinedOptimizer, as_optimizer, members

__all__ = ["local_optimizer", "orthogonalises"]


def local_optimizer(optimizer, model: torch.nn.Module,
                    params: list[tuple[str, torch.nn.Parameter]], shard_group=None):
    """A new optimizer over ``params`` (``(name in model, parameter)``; a name may come twice:
    copies of a tied parameter in two chunks of this rank, each updated alike): ``optimizer``
    is an optimizer of ``model``'s parameters (not yet stepped) or a function of a parameter
    list. ``shard_group``: ZeRO-1 over that process group — each replica keeps the optimizer
    state of its share of the parameters (``ZeroRedundancyOptimizer``)."""
    if isinstance(optimizer, (list, tuple, CombinedOptimizer)):
        made = [local_optimizer(m, model, params, shard_group)
                for m in members(as_optimizer(optimizer))]
        made = [m for m in made if not isinstance(m, _NoParams)]
        return as_optimizer(made) if made else _NoParams()
    if isinstance(optimizer, Callable) and not isinstance(optimizer, torch.optim.Optimizer):
        made = as_optimizer(optimizer([p for _, p in params]))
        if shard_group is None:
            return made
        return as_optimizer([_zero1(m, m.param_groups, shard_group) for m in members(made)])
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: a torch.optim.Optimizer, a list of them or a function of "
                        f"the parameters, not {type(optimizer).__name__}")
    if optimizer.state:
        raise ValueError("the optimizer has state already (it has stepped): parallelize the "
                         "model before the first step, or pass a function that makes the "
                         "optimizer (lambda params: torch.optim.AdamW(params, ...))")
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        names = [name_of[id(p)] for p in group["params"] if id(p) in name_of]
        wanted = set(names)
        mine = [p for n, p in params if n in wanted]
        if mine:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": mine})
    missing = sorted({n for n, _ in params} - set(name_of.values()))
    if missing:
        raise ValueError(f"parameters {missing[:3]} are not the model's")
    if not groups:
        return _NoParams()
    # NOTE: every group carries all its options; the constructor gets those of its defaults
    # it accepts (AdamW's defaults hold "decoupled_weight_decay", not an argument of AdamW)
    if shard_group is not None:
        return _zero1(optimizer, groups, shard_group)
    return type(optimizer)(groups, **_accepted(optimizer))


def _accepted(optimizer) -> dict:
    accepted = inspect.signature(type(optimizer)).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _zero1(optimizer, groups: list[dict], group):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [{**g, "params": list(g["params"])} for g in groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                   process_group=group, **_accepted(optimizer))


class _NoParams:
    """A rank that holds no trainable parameter steps nothing."""

    param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {}


def orthogonalises(optimizer) -> bool:
    """Whether ``optimizer`` (one of its members; under ZeRO-1 the inner class) updates each
    matrix from the whole of it (Muon's Newton–Schulz orthogonalisation), which a tensor-
    parallel or FSDP shard is not."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        return False
    for m in members(as_optimizer(optimizer)):
        cls = getattr(m, "_optim_constructor", type(m))   # NOTE: ZeroRedundancyOptimizer's
        if isinstance(cls, type) and issubclass(cls, muon):
            return True
    return False
