"""The cost model interface the simulator and planners use (no torch).

A cost model answers two questions: how long does a node take, and how many transient bytes
does it allocate beyond its fresh outputs (its *workspace*: conv columns, SDPA buffers, the
temporaries inside an optimizer update). The simulator counts both, so that a simulated peak can
equal a measured one.

Example:
    >>> from fitgraph.cost.base import NodeCost
    >>> NodeCost(seconds=1e-3, workspace_bytes=0).seconds
    0.001
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..graph.ir import Graph, Node

__all__ = ["CostModel", "CostModelWrapper", "NodeCost"]


@dataclass(frozen=True, slots=True)
class NodeCost:
    seconds: float          # wall time of the node on the compute stream
    workspace_bytes: int    # peak bytes the node allocates beyond its fresh outputs (>= 0)


class CostModel(Protocol):
    """What ``fitgraph.sim.simulate`` needs to know about a device."""

    name: str
    # NOTE: True where copies run on a copy engine beside compute (CUDA); False where the
    # executor copies in line on the compute stream (CPU). Absent means True.
    copies_overlap: bool
    # NOTE: True where offloading frees device memory (a GPU's host RAM is apart from it);
    # False on the CPU, where host and device are one RAM. Absent means False.
    host_memory_apart: bool

    def node_cost(self, graph: Graph, node: Node) -> NodeCost: ...

    def copy_seconds(self, nbytes: int) -> float:
        """Time to copy ``nbytes`` between device and host memory (either direction)."""
        ...


class CostModelWrapper:
    """A cost model that answers as ``base`` does, for a subclass to change ``node_cost``:
    copies, ``profile``, the device's traits (``copies_overlap``, ``host_memory_apart``) and
    the rest are ``base``'s, so ``hasattr(cm, "profile")`` still tells a measured model apart.

    Example:
        >>> class Doubled(CostModelWrapper):
        ...     def node_cost(self, graph, node):
        ...         c = self.base.node_cost(graph, node)
        ...         return NodeCost(2 * c.seconds, c.workspace_bytes)
        >>> class One:
        ...     name, copies_overlap = "one", False
        ...     def node_cost(self, graph, node): return NodeCost(1.0, 0)
        ...     def copy_seconds(self, nbytes): return 0.0
        >>> cm = Doubled(One())
        >>> cm.node_cost(None, None).seconds, cm.copies_overlap, cm.name
        (2.0, False, 'one')
    """

    def __init__(self, base) -> None:
        self.base = base

    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        return self.base.node_cost(graph, node)

    def copy_seconds(self, nbytes: int) -> float:
        return self.base.copy_seconds(nbytes)

    def __getattr__(self, name: str):
        if name == "base":  # NOTE: not set yet (unpickling, copying): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)
