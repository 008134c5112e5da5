"""Run one ``fitgraph.optimizer.*`` node: torch's own update for one parameter.

The implementation is the one eager ``optimizer.step()`` picks: the group's ``fused`` or
``foreach`` flag, or where both are None torch's default (the multi-tensor kernels for CUDA
tensors, the single-tensor ones on the CPU), run on a one-parameter list: all are elementwise,
so the bits are eager's.

Hyperparameters come from the live param group (so LR schedulers apply); missing state is created
exactly as torch's lazy initialisation creates it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain

import torch
from torch.optim import optimizer as torch_optimizer
from torch.optim.adam import adam
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.optim.sgd import sgd

from ..capture.combined_optimizer import members
from ..capture.optimizer_kinds import KINDS
from ..graph.ir import Graph, Node
from ..transform.optimizer_in_backward import update_nodes
from .input_specs import input_specs

__all__ = ["OptimizerStateMismatch", "apply_in_chunks", "has_step_pre_hooks",
           "init_missing_state", "run_optimizer_node",
           "run_step_post_hooks", "run_step_pre_hooks"]


class OptimizerStateMismatch(RuntimeError):
    """The optimizer's state is not what the graph was captured with (e.g. after the first step)."""


def _group_hyper(node: Node, optimizer: torch.optim.Optimizer | None) -> dict:
    if optimizer is None:
        return dict(node.kwargs["hyper"])  # NOTE: profiling runs nodes without the optimizer
    return optimizer.param_groups[node.kwargs["group"]]


def init_missing_state(graph: Graph, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer,
                       params: dict[str, torch.Tensor] | None = None,
                       specs: list | None = None) -> frozenset[str]:
    """Create the optimizer state a steady-state graph reads (``capture(..., steady_state=True)``)
    where the optimizer has none yet, as torch's lazy initialisation creates it at the first
    ``step()`` (``capture.optimizer_kinds``: Adam's step 0 and zero moments, NAdam's product
    1, Rprop's step sizes the learning rate...: what the first update then reads, bitwise
    eager's first step); SGD's momentum buffer as zeros, to be filled with the gradient by the
    first update (``run_optimizer_node(..., fresh=True)``, torch's first-step rule). Returns
    the names of the parameters whose state was created here. ``params`` (the model's by
    name) and ``specs`` (``input_specs(graph)``): where the caller has them."""
    if params is None:
        params = dict(model.named_parameters())
    created = set()
    updates: dict[str, Node] | None = None
    for spec in input_specs(graph) if specs is None else specs:
        if spec.kind != "state":
            continue
        pname, skey = spec.key, spec.state_key
        state = optimizer.state[params[pname]]
        if skey in state:
            continue
        if updates is None:  # NOTE: the first step only: every later one finds its state
            updates = {n.kwargs["param"]: n for n in update_nodes(graph)}
        node = updates[pname]
        with torch.no_grad():
            state[skey] = KINDS[node.target.rsplit(".", 1)[1]].make(
                skey, params[pname], optimizer.param_groups[node.kwargs["group"]])
        created.add(pname)
    return frozenset(created)


_FOREACH: dict[tuple, bool] = {}


def _default_foreach(kind: type, device: str, dtype: torch.dtype, param: torch.Tensor) -> bool:
    """torch's default ``foreach`` for a parameter like ``param``: it depends on the tensor's
    type, device and dtype only, and costs microseconds an update to ask (cached)."""
    key = (kind, device, dtype)
    if key not in _FOREACH:
        _FOREACH[key] = _default_to_fused_or_foreach([param], differentiable=False)[1]
    return _FOREACH[key]


def run_optimizer_node(node: Node, param: torch.Tensor, grad: torch.Tensor,
                       state_tensors: list[torch.Tensor],
                       optimizer: torch.optim.Optimizer | None,
                       fresh: bool = False) -> tuple[torch.Tensor, ...]:
    """Update ``param`` in place; return the state tensors the node created (first step).
    ``fresh``: the state was created by ``init_missing_state`` for this step, which torch's
    first step treats apart (SGD copies the gradient into a new momentum buffer)."""
    u = _prepare(node, param, grad, state_tensors, fresh, optimizer)
    apply_in_chunks(u, node.kwargs.get("chunks", 1))
    return u.created()


def apply_in_chunks(u: _Update, chunks: int) -> None:
    """``u``'s update run on ``chunks`` slices of the parameter's rows, one after another
    (``transform.optimizer_chunks``): the same elementwise kernels on each slice of the
    parameter, gradient and state; each slice's update starts from the step counter as it was
    (a copy) and the counter ends as the last slice's left it (advanced once). One chunk:
    the update as torch runs it."""
    if chunks <= 1:
        _apply([u])
        return
    rows = u.param.shape[0]
    size = -(-rows // chunks)
    counters = {k: v for k, v in u.state.items()
                if isinstance(v, torch.Tensor) and v.dim() == 0}
    before = {k: v.clone() for k, v in counters.items()}
    if u.kind == "sgd" and u.node.kwargs["state_keys"] and u.made is None and \
            u.state.get("momentum_buffer") is None:
        # NOTE: SGD's first step makes its buffer (a copy of the gradient): made whole here,
        # each slice filled by torch's first-step rule as a fresh buffer's slice is
        u.made = u.state["momentum_buffer"] = torch.empty_like(u.param)
    part_state: dict = {}
    with torch.no_grad():
        for start in range(0, rows, size):
            rows_ = slice(start, start + size)
            part_state = {k: before[k].clone() if k in counters else
                          v[rows_] if isinstance(v, torch.Tensor) else v
                          for k, v in u.state.items()}
            _apply([dataclasses.replace(
                u, param=u.param[rows_], grad=u.grad[rows_], state=part_state,
                made=None if u.made is None else u.made[rows_])])
        for k, v in counters.items():
            v.copy_(part_state[k])


@dataclass
class _Update:
    node: Node
    kind: str
    param: torch.Tensor
    grad: torch.Tensor
    state: dict
    group: dict
    foreach: bool
    made: torch.Tensor | None   # NOTE: SGD's fresh momentum buffer, filled after the update
    fused: bool = False         # NOTE: the group's fused kernel, run on this one parameter

    def created(self) -> tuple[torch.Tensor, ...]:
        have = self.node.kwargs["have"]
        return tuple(self.state[k] for k in self.node.kwargs["state_keys"] if k not in have)


def _prepare(node: Node, param: torch.Tensor, grad: torch.Tensor, state_tensors: list,
             fresh: bool, optimizer: torch.optim.Optimizer | None) -> _Update:
    kind = node.target.rsplit(".", 1)[1]
    if kind not in KINDS:
        raise RuntimeError(f"node {node.name}: unknown optimizer kind {kind!r}")
    keys: tuple[str, ...] = node.kwargs["state_keys"]
    have: tuple[str, ...] = node.kwargs["have"]
    group = _group_hyper(node, optimizer)
    state: dict = {}
    if optimizer is not None:
        state = optimizer.state[param]
        if len(state) != len(have) or any(k not in state for k in have):
            present = tuple(k for k in keys if k in state)
            if present != have:
                raise OptimizerStateMismatch(
                    f"optimizer state of parameter {node.kwargs['param']} is {list(present)} "
                    f"but the graph was captured with {list(have)} (the first step creates "
                    "state): capture the step again")
    state.update(zip(have, state_tensors))
    fused = bool(group.get("fused"))
    foreach = False if fused else group.get("foreach")
    if foreach is None:
        # NOTE: eager's default: on CUDA the foreach kernels, whose rounding differs from the
        # single-tensor ones (law 1 is bitwise)
        foreach = _default_foreach(type(param), param.device.type, param.dtype, param)
    if kind != "sgd" and len(state) < len(keys):
        # NOTE: the first step: torch's lazy initialisation, every key at once
        with torch.no_grad():
            state.update({k: KINDS[kind].make(k, param, group) for k in keys})
    made = state.get("momentum_buffer") if kind == "sgd" and keys and fresh else None
    return _Update(node, kind, param, grad, state, group, bool(foreach), made, fused)


def _apply(run: list[_Update]) -> None:
    """One call of torch's functional update over ``run`` (one kind, group, implementation).
    NOTE: one parameter a call: torch's single-tensor loop keeps a temporary (Adam's
    ``denom``) from one parameter into the next, a transient the simulator prices per update
    would miss (tried: batching cut ~1 ms of a 50 ms ResNet step)."""
    first = run[0]
    group, foreach, fused = first.group, first.foreach, first.fused or None
    params, grads = [u.param for u in run], [u.grad for u in run]
    update = KINDS[first.kind].update
    if update is not None:
        (u,) = run
        update(u.param, u.grad, u.state, group, foreach)
        return
    if first.kind == "adam":
        beta1, beta2 = group["betas"]
        adam(params, grads, [u.state["exp_avg"] for u in run],
             [u.state["exp_avg_sq"] for u in run],
             [u.state["max_exp_avg_sq"] for u in run] if group["amsgrad"] else [],
             [u.state["step"] for u in run],
             foreach=foreach, capturable=False, differentiable=False, fused=fused,
             grad_scale=None, found_inf=None, has_complex=any(map(torch.is_complex, params)),
             decoupled_weight_decay=group.get("decoupled_weight_decay", False),
             amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        return
    (u,) = run
    bufs = [u.state.get("momentum_buffer")] if u.node.kwargs["state_keys"] else []
    if u.made is not None:
        bufs = [None]  # NOTE: torch's first step: the buffer is a copy of the gradient
    sgd(params, grads, bufs, has_sparse_grad=False, foreach=foreach, fused=fused,
        grad_scale=None, found_inf=None, weight_decay=group["weight_decay"],
        momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
        nesterov=group["nesterov"], maximize=group["maximize"])
    if u.made is not None:
        u.made.copy_(bufs[0])  # NOTE: into the buffer the graph holds: the same bits
        bufs = [u.made]
    if bufs:
        u.state["momentum_buffer"] = bufs[0]


def has_step_pre_hooks(optimizer) -> bool:
    """Whether ``optimizer.step()`` would run pre-hooks (its own or global ones; a combined
    optimizer's members' own)."""
    return bool(torch_optimizer._global_optimizer_pre_hooks
                or any(m._optimizer_step_pre_hooks for m in members(optimizer)))


def run_step_pre_hooks(optimizer) -> None:
    """What ``optimizer.step()`` runs before updating: the global and the optimizer's own
    step pre-hooks (``register_step_pre_hook``), in torch's order; for each member of a
    ``CombinedOptimizer``, as each member's ``step()`` would."""
    for member in members(optimizer):
        for hook in chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                          member._optimizer_step_pre_hooks.values()):
            result = hook(member, (member,), {})
            if result is not None and not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"optimizer step pre-hook {hook} must return None or a tuple "
                                   f"of (new_args, new_kwargs), but got {result}")


def run_step_post_hooks(optimizer) -> None:
    """What ``optimizer.step()`` runs after updating: the optimizer's own then the global step
    post-hooks; and the mark LR schedulers read (``_opt_called``: "optimizer.step() ran");
    for each member of a ``CombinedOptimizer``."""
    for member in members(optimizer):
        for hook in chain(member._optimizer_step_post_hooks.values(),
                          torch_optimizer._global_optimizer_post_hooks.values()):
            hook(member, (member,), {})
        # NOTE: set by the wrapper an LRScheduler puts around optimizer.step(); without it
        # the scheduler warns "lr_scheduler.step() before optimizer.step()"
        member._opt_called = True
