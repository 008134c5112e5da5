"""Run one ``fitgraph.optimizer.*`` node: torch's own update for one parameter.

The implementation is the one eager ``optimizer.step()`` picks: the group's ``foreach`` flag, or
where it is None torch's default (the multi-tensor kernels for CUDA tensors, the single-tensor
ones on the CPU), run on a one-parameter list: both are elementwise, so the bits are eager's.

Hyperparameters come from the live param group (so LR schedulers apply); missing state is created
exactly as torch's lazy initialisation creates it.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _default_to_fused_or_foreach, _get_scalar_dtype
from torch.optim.sgd import sgd

from ..graph.ir import Node

__all__ = ["OptimizerStateMismatch", "run_optimizer_node"]


class OptimizerStateMismatch(RuntimeError):
    """The optimizer's state is not what the graph was captured with (e.g. after the first step)."""


def _group_hyper(node: Node, optimizer: torch.optim.Optimizer | None) -> dict:
    if optimizer is None:
        return dict(node.kwargs["hyper"])  # NOTE: profiling runs nodes without the optimizer
    return optimizer.param_groups[node.kwargs["group"]]


def run_optimizer_node(node: Node, param: torch.Tensor, grad: torch.Tensor,
                       state_tensors: list[torch.Tensor],
                       optimizer: torch.optim.Optimizer | None) -> tuple[torch.Tensor, ...]:
    """Update ``param`` in place; return the state tensors the node created (first step)."""
    kind = node.target.rsplit(".", 1)[1]
    keys: tuple[str, ...] = node.kwargs["state_keys"]
    have: tuple[str, ...] = node.kwargs["have"]
    group = _group_hyper(node, optimizer)
    state: dict = {}
    if optimizer is not None:
        state = optimizer.state[param]
        present = tuple(k for k in keys if k in state)
        if present != have:
            raise OptimizerStateMismatch(
                f"optimizer state of parameter {node.kwargs['param']} is {list(present)} but the "
                f"graph was captured with {list(have)} (the first step creates state): capture "
                "the step again")
    state.update(zip(have, state_tensors))
    foreach = group.get("foreach")
    if foreach is None:
        # NOTE: eager's default: on CUDA the foreach kernels, whose rounding differs from the
        # single-tensor ones (law 1 is bitwise)
        foreach = _default_to_fused_or_foreach([param], differentiable=False)[1]
    if kind == "adam":
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            for k in keys[1:]:
                state[k] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        adam([param], [grad], [state["exp_avg"]], [state["exp_avg_sq"]],
             [state["max_exp_avg_sq"]] if group["amsgrad"] else [], [state["step"]],
             foreach=foreach, capturable=False, differentiable=False, fused=None,
             grad_scale=None, found_inf=None, has_complex=torch.is_complex(param),
             decoupled_weight_decay=group.get("decoupled_weight_decay", False),
             amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
    elif kind == "sgd":
        bufs = [state.get("momentum_buffer")] if keys else []
        sgd([param], [grad], bufs, has_sparse_grad=False, foreach=foreach, fused=None,
            grad_scale=None, found_inf=None, weight_decay=group["weight_decay"],
            momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
            nesterov=group["nesterov"], maximize=group["maximize"])
        if keys:
            state["momentum_buffer"] = bufs[0]
    else:
        raise RuntimeError(f"node {node.name}: unknown optimizer kind {kind!r}")
    return tuple(state[k] for k in keys if k not in have)
