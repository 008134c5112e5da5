"""The planner's bytes per parameter (``dist.memory.Precision``) for a live model and
optimizer, as ``parallelize`` runs them: weights and gradients at the parameters' dtype, no
master copy (torch's optimizers update the weights in place), and the state the optimizer
keeps — per parameter, by its kind (``capture.optimizer_kinds``: AdamW's two moments, SGD's
momentum or none, Adafactor's row and column statistics, Muon's momentum for its matrices
beside AdamW's for the rest) — averaged over the trainable parameters.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(4, 4)
    >>> p = precision_of(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    >>> (p.weight, p.grad, p.master, p.state, p.activation_dtype)
    (4, 4, 0, 4.0, 'float32')
"""

from __future__ import annotations

import torch

from ...capture.combined_optimizer import as_optimizer, members
from ...capture.optimizer_kinds import kind_of
from ..memory import FP32_ADAM, MIXED_ADAM, Precision

__all__ = ["precision_of"]


def precision_of(model: torch.nn.Module, optimizer) -> Precision:
    """``model``'s trainable parameters as ``optimizer`` (one, a list, or None) keeps them;
    an optimizer fitgraph does not know, or a function making one, is priced as Adam."""
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params) or 1
    size = max((p.element_size() for p in params), default=4)
    base = FP32_ADAM if size >= 4 else MIXED_ADAM
    opts = members(as_optimizer(optimizer))
    kinds = [kind_of(o) for o in opts]
    if not opts or None in kinds:
        return base
    state = 0.0
    for opt, kind in zip(opts, kinds):
        for group in opt.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state += p.element_size() * kind.state_numel(group, tuple(p.shape))
    names = "+".join(dict.fromkeys(k.name for k in kinds))
    # NOTE: torch's SGD updates its momentum and the weight in place (no temporaries); the
    # others' temporaries are priced as Adam's, two of its largest tensor's moment
    temps = "none" if names == "sgd" else "torch"
    return Precision(f"{str(params[0].dtype).removeprefix('torch.') if params else 'float32'}"
                     f"-{names}", weight=size, grad=size, master=0, state=state / count,
                     activation_dtype="float32" if size >= 4 else "bfloat16",
                     step_temp=temps)
