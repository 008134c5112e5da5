"""Turn IR node targets back into torch callables, and IR args back into torch arguments.

Example:
    >>> from fitgraph.execute.ops import resolve_target
    >>> resolve_target("aten.relu.default")
    <OpOverload(op='aten.relu', overload='default')>
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from ..graph.ir import Node, ValueRef
from . import bit_packing  # noqa: F401  (registers the fitgraph:: ops that graphs name)

__all__ = ["GRAD_MODE_OPS", "OVERSIZED_OUTPUT_OPS", "ArgBinder", "resolve_target"]

# NOTE: kernels that return their reduced loss inside the storage of the elementwise loss they
# reduced: on the CPU (torch 2.13) ``mse_loss(x, y)`` of a (64, 256) input is a 0-dim tensor
# holding a 64-KiB storage until the loss dies, where the IR (fake tensors) says 4 bytes. Run
# through ``resolve_target`` their outputs are copied out of such a storage (a scalar's copy),
# so the executor and the profiler see what the simulator counts (law 2). A new op showing
# this is caught by ``ProfiledCostModel.alias_mismatches`` (end bytes != the IR's).
OVERSIZED_OUTPUT_OPS = frozenset({
    "aten.mse_loss.default", "aten.smooth_l1_loss.default", "aten.soft_margin_loss.default",
    "aten.binary_cross_entropy.default"})
# NOTE: kernels that make the workspace their backward reads only with grad mode on: oneDNN's
# LSTM/GRU/RNN layer (torch 2.13) returns an undefined workspace under ``torch.no_grad()``,
# where the executor and profiler run, and its backward then fails. Run through
# ``resolve_target`` they see grad mode on, as in the eager step (their inputs detached, so no
# autograd graph is recorded).
GRAD_MODE_OPS = frozenset({"aten.mkldnn_rnn_layer.default"})


@functools.cache
def resolve_target(target: str) -> Callable:
    """'aten.addmm.default' -> torch.ops.aten.addmm.default (for ``OVERSIZED_OUTPUT_OPS``, a
    wrapper that returns the output in a storage of its own size)."""
    ns, name, overload = target.split(".")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except AttributeError as e:
        raise RuntimeError(f"op {target} does not exist in this torch ({torch.__version__}); "
                           "re-capture the graph with this torch") from e
    if target in GRAD_MODE_OPS:
        return _with_grad_mode(op)
    return _compacting(op) if target in OVERSIZED_OUTPUT_OPS else op


def _with_grad_mode(op) -> Callable:
    """``op`` run with grad mode on (inputs detached: nothing is recorded), as autograd ran it
    when the step was captured: see ``GRAD_MODE_OPS``."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        args, kwargs = tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
        with torch.enable_grad():
            return op(*args, **kwargs)

    return run


def _compacting(op) -> Callable:
    """``op`` whose (single tensor) output is copied out of a storage larger than itself.

    Example:
        >>> x, y = torch.zeros(8, 8), torch.ones(8, 8)
        >>> torch.ops.aten.mse_loss.default(x, y).untyped_storage().nbytes()
        256
        >>> resolve_target("aten.mse_loss.default")(x, y).untyped_storage().nbytes()
        4
    """

    @functools.wraps(op)
    def run(*args, **kwargs):
        out = op(*args, **kwargs)
        if out.untyped_storage().nbytes() > out.numel() * out.element_size():
            return out.clone(memory_format=torch.contiguous_format)
        return out

    return run


class ArgBinder:
    """Precompiled substitution of ValueRefs in a node's args/kwargs by tensors from ``env``."""

    __slots__ = ("args", "kwargs", "_flat")

    def __init__(self, node: Node) -> None:
        self.args = node.args
        self.kwargs = node.kwargs
        # NOTE: most args are flat; remember which top-level slots are refs for a fast path
        self._flat = all(not isinstance(a, (list, tuple, dict)) for a in node.args) and all(
            not isinstance(a, (list, tuple, dict)) for a in node.kwargs.values())

    def __call__(self, env: list) -> tuple[tuple, dict]:
        if self._flat:
            args = tuple(env[a.id] if isinstance(a, ValueRef) else a for a in self.args)
            kwargs = {k: env[v.id] if isinstance(v, ValueRef) else v
                      for k, v in self.kwargs.items()} if self.kwargs else {}
            return args, kwargs
        return _sub(self.args, env), _sub(self.kwargs, env)


def _sub(obj: Any, env: list) -> Any:
    if isinstance(obj, ValueRef):
        return env[obj.id]
    if isinstance(obj, tuple):
        return tuple(_sub(o, env) for o in obj)
    if isinstance(obj, list):
        return [_sub(o, env) for o in obj]
    if isinstance(obj, dict):
        return {k: _sub(v, env) for k, v in obj.items()}
    return obj
