"""The optimizer update as graph nodes: one node per parameter, in ``optimizer.step()`` order.

torch's single-tensor optimizers (the CPU default) update each parameter independently, in
param-group order; a node per parameter is therefore exactly ``optimizer.step()``, and it is the
granularity later planners need (update a parameter as soon as its gradient is complete). The
executor runs each node through torch's own functional optimizer (``torch.optim.adam.adam`` with
one parameter), so the arithmetic is torch's, bitwise. Step-dependent scalars (bias corrections)
and the learning rate are read from the live optimizer when the node runs, so LR schedulers work.

State that does not exist yet (the first step) is created by the node, as torch's lazy
initialisation does, and becomes a graph output; a graph captured before the first step therefore
differs from one captured after it, and the executor refuses to run a graph on an optimizer whose
state no longer matches.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype

from ..graph.ir import GraphBuilder, Phase, Role, ValueRef
from .combined_optimizer import members
from .convert import dtype_name
from .errors import CaptureError
from .optimizer_kinds import KINDS, UNSUPPORTED, OptimizerKind, kind_of, supported_names

__all__ = ["add_optimizer_nodes", "describe_optimizer"]


def describe_optimizer(optimizer) -> str:
    """The kind ("sgd", "adam", "rmsprop", ...: ``optimizer_kinds.KINDS``) of a supported
    optimizer, else a CaptureError; a ``CombinedOptimizer``'s members' kinds joined by "+"
    ("muon+adam")."""
    kinds = []
    for member in members(optimizer):
        kind = _member_kind(member)
        if kind not in kinds:
            kinds.append(kind)
    return "+".join(kinds)


def _member_kind(optimizer: torch.optim.Optimizer) -> str:
    kind = kind_of(optimizer)
    if kind is None:
        name = type(optimizer).__name__
        why = UNSUPPORTED.get(name) if type(optimizer).__module__.startswith("torch.") else None
        raise CaptureError(
            f"optimizer {name} is not supported" + (f" ({why})" if why else "") +
            f"; supported: {supported_names()} (their exact classes: a subclass's step may do "
            "anything), or a list of them; capture without optimizer= and call "
            "optimizer.step() yourself",
            op=f"{name}.step")
    for gi, group in enumerate(optimizer.param_groups):
        # NOTE: fused=True is run as torch runs it, one parameter a call (its kernels are
        # elementwise: the bits are eager's); these two change what a step is
        for flag in ("capturable", "differentiable"):
            if group.get(flag):
                raise CaptureError(
                    f"param group {gi} has {flag}=True; fitgraph runs torch's single-tensor, "
                    f"foreach or fused update per parameter: construct the optimizer with "
                    f"{flag}=False (or None)",
                    op=f"{type(optimizer).__name__}.step")
    return kind.name


def add_optimizer_nodes(b: GraphBuilder, optimizer: torch.optim.Optimizer, *,
                        param_values: dict[str, int], grad_values: dict[str, int],
                        param_names: dict[int, str], device: str,
                        steady_state: bool = False) -> dict[str, int]:
    """Append state inputs and one update node per parameter; return new state outputs.

    ``steady_state``: every updated parameter's state is an input, whether the optimizer holds
    it yet or not (the graph of every step after the first); ``init_missing_state`` creates what
    is missing before such a graph runs, as torch's lazy initialisation would."""
    created: dict[str, int] = {}
    owned = [(m, g) for m in members(optimizer) for g in m.param_groups]
    for gi, (member, group) in enumerate(owned):
        kind = _member_kind(member)
        spec = KINDS[kind]
        name = type(member).__name__
        hyper = {k: group[k] for k in spec.hyper if k in group}
        for p in group["params"]:
            pname = param_names.get(id(p))
            if pname is None:
                if not p.requires_grad and p.grad is None:
                    continue  # NOTE: frozen (or foreign) and gradient-free: eager skips it too
                raise CaptureError("the optimizer holds a tensor that requires grad but is not a "
                                   f"parameter of the model (shape {tuple(p.shape)}): the step "
                                   "captures the model's parameters only; pass the model's own "
                                   "parameters to the optimizer, or register the tensor as an "
                                   "nn.Parameter of the model", op=f"{name}.step")
            if pname not in grad_values:
                if p.grad is not None:
                    # NOTE: eager would apply this stale .grad at every step; the step cannot
                    raise CaptureError(f"parameter {pname} gets no gradient from the step but has "
                                       "a .grad, which eager's optimizer.step() would apply: call "
                                       "optimizer.zero_grad(set_to_none=True) first",
                                       op=f"{name}.step")
                continue  # NOTE: torch skips parameters whose .grad is None (frozen ones too)
            if p.is_complex() and not spec.complex_ok:
                raise CaptureError(f"parameter {pname} is complex, which "
                                   f"{name} does not update (torch's own "
                                   "step refuses it): keep complex parameters in another "
                                   "optimizer", op=f"{name}.step")
            keys = spec.param_keys(group, tuple(p.shape))
            state = member.state.get(p, {})
            have = tuple(k for k in keys if k in state)
            if have and have != keys:
                raise CaptureError(f"optimizer state of {pname} has keys {sorted(state)}, "
                                   f"expected {list(keys)}", op="optimizer.state")
            if steady_state:
                have = keys  # NOTE: the state the first step creates, assumed present (see doc)
            pv, gv = param_values[pname], grad_values[pname]
            state_refs = []
            for k in have:
                shape, dtype, stride, dev = _state_layout(spec, k, state.get(k), p, group)
                state_refs.append(b.add_input(f"state:{pname}:{k}", shape, dtype,
                                              Role.OPTIMIZER_STATE, stride=stride, device=dev))
            pval = b.values[pv]
            numel = pval.numel
            nid = len(b.nodes)
            outs = b.add_node(
                f"fitgraph.optimizer.{kind}", [pv, gv, *state_refs],
                [_created_shape(spec, k, pval) for k in keys if k not in have],
                phase=Phase.OPTIMIZER, module=pname.rpartition(".")[0],
                mutates=(pv, *state_refs), flops=spec.update_flops(pval.shape, group),
                name=f"{kind}_{pname}",
                args=(ValueRef(pv), ValueRef(gv), [ValueRef(s) for s in state_refs]),
                kwargs={"group": gi, "param": pname, "state_keys": keys, "have": have,
                        "hyper": hyper})
            node = b.nodes[nid]
            node.out_is_tuple = True
            # NOTE: the parameter read and written, each state tensor too
            state_numel = spec.state_numel(group, tuple(pval.shape))
            node.bytes_moved = (2 * numel + 2 * state_numel) * pval.itemsize
            for k, vid in zip([k for k in keys if k not in have], outs):
                b.values[vid].role = Role.OPTIMIZER_STATE
                b.storages[b.values[vid].storage].role = Role.OPTIMIZER_STATE
                b.storages[b.values[vid].storage].device = (
                    _state_layout(spec, k, None, p, group)[3] if k in spec.scalars else device)
                created[f"state:{pname}:{k}"] = vid
    return created


def _state_layout(spec: OptimizerKind, key: str, t: torch.Tensor | None, p: torch.Tensor,
                  group: dict) -> tuple:
    """(shape, dtype, stride, device) of state ``key``: the tensor's own, or for state not made
    yet what torch's lazy initialisation makes (0-d counters, on the host for most; buffers
    like ``p``)."""
    if t is not None:
        return tuple(t.shape), dtype_name(t.dtype), t.stride(), str(t.device)
    if key in spec.scalars:
        made = spec.make(key, p.detach(), group)
        return (), dtype_name(made.dtype), (), str(made.device)
    shape = spec.state_shape(key, tuple(p.shape))
    if shape == tuple(p.shape):
        like = torch.empty_like(p, memory_format=torch.preserve_format, device="meta")
    else:
        like = torch.empty(shape, dtype=p.dtype, device="meta")
    return shape, dtype_name(p.dtype), like.stride(), str(p.device)


def _created_shape(spec: OptimizerKind, key: str, pval) -> tuple:
    if key in spec.scalars:
        return ((), dtype_name(_get_scalar_dtype()))
    return (spec.state_shape(key, pval.shape), pval.dtype)
