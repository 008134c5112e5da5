"""What the rest of a step holds while a compiled region waits for its backward.

A step by regions (graph breaks) runs each compiled region's forward, then the next region's,
and the backwards in reverse: between a region's forward and its backward, every later region
runs its forward and backward whole, and the region's saved tensors stay the while. The
region's own graph does not show that: to its planner, nine MiB of convolution outputs saved
for the backward cost nothing where its backward peaks higher anyway (wav2vec2's feature
encoder, compiled apart from its transformer by a ``requires_grad`` setattr: the step peaked at
31.9 MiB, above Hugging Face checkpointing's 28.6 MiB, with every region at its own least).

``HoldCostModel`` charges the bytes the later regions need above what is already live (the
*hold*) as workspace of the region's first backward node that allocates: there, what the
forward saved and its outputs are live, so the simulated peak at that point is what the step
holds while the later regions run at theirs, and the solver drops saved values wherever that
lowers it. ``holds_in_run_order`` works the holds out from each region's planned activation
peak and saved bytes, in the order the regions' forwards ran.

Example:
    >>> holds_in_run_order([(5_000, 900), (8_000, 100), (300, 0)])
    [8000, 300, 0]
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..cost.base import CostModelWrapper, NodeCost
from ..graph.analysis import new_storages
from ..graph.ir import Graph, Node, Phase

__all__ = ["HoldCostModel", "boundary_node", "graph_key", "holds_by_graph",
           "holds_in_run_order", "StepShares", "step_shares"]


def boundary_node(graph: Graph) -> int | None:
    """The first backward node (IR order, which the backward module keeps) that allocates a
    storage: at its start the forward's saved values and outputs are live, and nothing of the
    backward but the tangents. None when the graph has no backward."""
    fresh = new_storages(graph)
    return next((n.id for n in graph.nodes if n.phase is Phase.BACKWARD and fresh[n.id]), None)


class HoldCostModel(CostModelWrapper):
    """``base``'s costs, with ``hold_bytes`` more workspace at each graph's ``boundary_node``;
    everything else is ``base``'s (``profile``, copies, the device's traits).

    NOTE: the boundary node of the graph a cost is asked for, not of the graph planned first:
    a rewriting solver (``split_backward``) plans graphs of its own, renumbered, where that
    node id named another node (wav2vec2's feature encoder saved 8.7 MiB of convolution
    outputs across its transformer's step with the hold charged elsewhere)."""

    def __init__(self, base, hold_bytes: int) -> None:
        super().__init__(base)
        self.hold_bytes = int(hold_bytes)
        self._at: dict[int, tuple[Graph, int | None]] = {}

    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        cost = self.base.node_cost(graph, node)
        if node.id != self._boundary(graph):
            return cost
        return NodeCost(cost.seconds, cost.workspace_bytes + self.hold_bytes)

    def _boundary(self, graph: Graph) -> int | None:
        hit = self._at.get(id(graph))
        if hit is None or hit[0] is not graph:
            if len(self._at) >= 8:   # NOTE: the search's last graphs, each held (ids reused)
                self._at.pop(next(iter(self._at)))
            hit = self._at[id(graph)] = (graph, boundary_node(graph))
        return hit[1]


def holds_in_run_order(regions: list[tuple[int, int]]) -> list[int]:
    """Each region's hold: ``regions`` are (activation peak, saved bytes) per region in the
    order their forwards ran (the activation peak: the planned peak less what was resident
    for the region, weights and inputs). The regions after ``p`` run nested inside ``p``'s
    forward-to-backward window (each one's backward before the one before it), so while ``q``
    peaks, every region between ``p`` and ``q`` holds its saved bytes: the hold of ``p`` is
    the most, over ``q > p``, of ``q``'s activation peak plus the saved bytes of those
    between. The last region holds nothing.

    Example:
        >>> holds_in_run_order([(10, 4), (3, 2), (6, 0)])
        [8, 6, 0]
    """
    holds = []
    for p in range(len(regions)):
        best, between = 0, 0
        for peak, saved in regions[p + 1:]:
            best = max(best, peak + between)
            between += saved
        holds.append(best)
    return holds


def holds_by_graph(reports, runs: list[int]) -> dict[str, int]:
    """Graph key -> hold, for the planned graphs that ran: ``reports`` are a backend's
    ``BackendReport``s, ``runs`` the report index of each forward in the order they ran in
    one step. A graph that ran more than once (a block compiled as one region, each layer a
    call) is planned once: for the most any of its runs holds. Graphs that save nothing, or
    hold nothing, are left out.

    Example:
        >>> from types import SimpleNamespace as R
        >>> reps = [R(planned_peak_bytes=50, resident_bytes=10, planned_saved_bytes=9,
        ...           graph_key="a"),
        ...         R(planned_peak_bytes=30, resident_bytes=20, planned_saved_bytes=4,
        ...           graph_key="b")]
        >>> holds_by_graph(reps, [0, 1, 1])
        {'a': 14, 'b': 10}
    """
    regions = [(max(0, reports[i].planned_peak_bytes - reports[i].resident_bytes),
                reports[i].planned_saved_bytes) for i in runs]
    out: dict[str, int] = {}
    for i, hold in zip(runs, holds_in_run_order(regions)):
        if hold > 0 and reports[i].planned_saved_bytes > 0:
            key = reports[i].graph_key
            out[key] = max(out.get(key, 0), hold)
    return out


@dataclass
class StepShares:
    """What of a step's bytes budget each graph may plan its own peak within, worked out as
    the step's graphs are planned again in the order they ran.

    ``room`` is the budget less what the step keeps outside its regions (weights, their
    gradients, the optimizer state, the batch); ``runs`` the graph key of each forward in the
    order they ran; ``first_saved`` each graph's saved bytes as first planned. A graph's share
    is the room plus its own weights (and gradients, where the step makes them: its peak
    counts those), less what the graphs that ran before it save for their backwards: as
    planned again where they were (``planned_saved``), else as first planned. A graph that
    ran more than once gets its least.

    NOTE: the saved bytes of the graphs before as planned again, not as first planned:
    planned first at the whole budget, wav2vec2's feature encoder saved 15.5 MiB; planned
    again with what its transformer holds, it saved a third of that, while its transformer,
    left 5.5 MiB by the first plan's bytes, ran at its least peak and the step over the budget.

    Example:
        >>> shares = StepShares(room=100, runs=["a", "b"], first_saved={"a": 30, "b": 5})
        >>> shares.share("b", weight_bytes=20, grad_bytes=0, planned_saved={})
        90
        >>> shares.share("b", weight_bytes=20, grad_bytes=0, planned_saved={"a": 10})
        110
    """

    room: int
    runs: list[str]
    first_saved: dict[str, int]
    own_grads: bool = False   # the step makes its gradients: a graph's peak counts its own

    def share(self, key: str, weight_bytes: int, grad_bytes: int,
              planned_saved: dict[str, int]) -> int | None:
        """The share of the graph ``key`` (None for a graph that did not run)."""
        out, before = None, 0
        for k in self.runs:
            if k == key:
                own = weight_bytes + (grad_bytes if self.own_grads else 0)
                got = max(0, self.room + own - before)
                out = got if out is None else min(out, got)
            before += planned_saved.get(k, self.first_saved.get(k, 0))
        return out


def step_shares(reports, runs: list[int], limit: int, outside: int,
                own_grads: bool = False) -> StepShares:
    """``StepShares`` for a step's bytes budget ``limit`` from its first plan: ``reports``
    are a backend's ``BackendReport``s, ``runs`` the report index of each forward in the
    order they ran, ``outside`` what the step keeps resident outside its regions."""
    return StepShares(limit - outside, [reports[i].graph_key for i in runs],
                      {reports[i].graph_key: reports[i].planned_saved_bytes for i in runs},
                      own_grads)


def graph_key(code: str, shapes) -> str:
    """A joint graph's identity across compiles of the same code: its generated Python and its
    inputs' shapes (Dynamo compiles a region again as the same graph)."""
    return hashlib.sha1(f"{code}\n{shapes!r}".encode()).hexdigest()[:16]
