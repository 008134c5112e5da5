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

__all__ = ["MEMBERS", "BaseCostModel", "CostModel", "CostModelWrapper", "NodeCost",
           "check_cost_model"]


@dataclass(frozen=True, slots=True)
class NodeCost:
    seconds: float          # wall time of the node on the compute stream
    workspace_bytes: int    # peak bytes the node allocates beyond its fresh outputs (>= 0)


class CostModel(Protocol):
    """What a planner may ask of op costs (``fitgraph.sim.simulate``, every solver, ``auto``).

    Implementations: ``RooflineCostModel`` (a device's datasheet), ``ProfiledCostModel`` (ops
    measured on this machine), ``ScaledCostModel`` (fission's parts from the whole ops' costs),
    ``FusedCostModel`` (pointwise ops free where inductor fuses them). A new one subclasses
    ``BaseCostModel``, which gives every member but ``node_cost`` and ``copy_seconds`` its
    default; ``check_cost_model`` names what one lacks."""

    name: str
    # NOTE: True where copies run on a copy engine beside compute (CUDA); False where the
    # executor copies in line on the compute stream (CPU)
    copies_overlap: bool
    # NOTE: True where offloading frees device memory (a GPU's host RAM is apart from it);
    # False on the CPU, where host and device are one RAM
    host_memory_apart: bool
    # NOTE: bytes a recompute of a random op allocates to replay its generator's state
    rng_state_bytes: int
    # NOTE: True where costs are measured on this machine's device: ``prepare`` then runs ops
    measures: bool

    def prepare(self, graph: Graph) -> None:
        """Make every node of ``graph`` costable (a measured model profiles the nodes it has
        not seen; others need nothing). Solvers call it on each graph they rewrite."""
        ...

    def node_cost(self, graph: Graph, node: Node) -> NodeCost: ...

    def copy_seconds(self, nbytes: int) -> float:
        """Time to copy ``nbytes`` between device and host memory (either direction)."""
        ...


MEMBERS = ("name", "copies_overlap", "host_memory_apart", "rng_state_bytes", "measures",
           "prepare", "node_cost", "copy_seconds")


class BaseCostModel:
    """The ``CostModel`` defaults: a device whose copies overlap compute and whose host memory
    is its own, no RNG replay bytes, costs not measured (nothing to prepare). A subclass
    writes ``node_cost`` and ``copy_seconds``.

    Example:
        >>> class Flat(BaseCostModel):
        ...     name = "flat"
        ...     def node_cost(self, graph, node): return NodeCost(1e-3, 0)
        ...     def copy_seconds(self, nbytes): return nbytes / 1e10
        >>> check_cost_model(Flat())
        >>> Flat().copies_overlap, Flat().measures
        (True, False)
    """

    name = "cost model"
    copies_overlap = True
    host_memory_apart = False
    rng_state_bytes = 0
    measures = False

    def prepare(self, graph: Graph) -> None:
        return None

    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        raise NotImplementedError(f"{type(self).__name__}.node_cost")

    def copy_seconds(self, nbytes: int) -> float:
        raise NotImplementedError(f"{type(self).__name__}.copy_seconds")


def check_cost_model(cost_model) -> None:
    """TypeError naming what ``cost_model`` lacks of the ``CostModel`` protocol.

    Example:
        >>> class Half:
        ...     def node_cost(self, graph, node): return NodeCost(0.0, 0)
        >>> check_cost_model(Half())
        Traceback (most recent call last):
        ...
        TypeError: Half is not a cost model: it lacks name, copies_overlap, host_memory_apart, rng_state_bytes, measures, prepare, copy_seconds (subclass fitgraph.cost.base.BaseCostModel for the defaults)
    """
    missing = [m for m in MEMBERS if not hasattr(cost_model, m)]
    if missing:
        raise TypeError(f"{type(cost_model).__name__} is not a cost model: it lacks "
                        f"{', '.join(missing)} (subclass fitgraph.cost.base.BaseCostModel for "
                        "the defaults)")


class CostModelWrapper:
    """A cost model that answers as ``base`` does, for a subclass to change ``node_cost``:
    copies, ``prepare``, the device's traits (``copies_overlap``, ``host_memory_apart``) and
    the rest are ``base``'s.

    Example:
        >>> class Doubled(CostModelWrapper):
        ...     def node_cost(self, graph, node):
        ...         c = self.base.node_cost(graph, node)
        ...         return NodeCost(2 * c.seconds, c.workspace_bytes)
        >>> class One(BaseCostModel):
        ...     name, copies_overlap = "one", False
        ...     def node_cost(self, graph, node): return NodeCost(1.0, 0)
        ...     def copy_seconds(self, nbytes): return 0.0
        >>> cm = Doubled(One())
        >>> cm.node_cost(None, None).seconds, cm.copies_overlap, cm.name
        (2.0, False, 'one')
    """

    def __init__(self, base) -> None:
        self.base = base

    def prepare(self, graph: Graph) -> None:
        self.base.prepare(graph)

    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        return self.base.node_cost(graph, node)

    def copy_seconds(self, nbytes: int) -> float:
        return self.base.copy_seconds(nbytes)

    def __getattr__(self, name: str):
        if name == "base":  # NOTE: not set yet (unpickling, copying): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)
