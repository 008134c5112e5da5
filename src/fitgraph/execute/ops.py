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

from ..graph.ir import Node, ValueRef

__all__ = ["ArgBinder", "resolve_target"]


@functools.cache
def resolve_target(target: str) -> Callable:
    """'aten.addmm.default' -> torch.ops.aten.addmm.default."""
    ns, name, overload = target.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except AttributeError as e:
        raise RuntimeError(f"op {target} does not exist in this torch ({torch.__version__}); "
                           "re-capture the graph with this torch") from e


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
