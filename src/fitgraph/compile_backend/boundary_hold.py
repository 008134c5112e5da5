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

from ..cost.base import CostModelWrapper, NodeCost
from ..graph.analysis import new_storages
from ..graph.ir import Graph, Node, Phase

__all__ = ["HoldCostModel", "boundary_node", "graph_key", "holds_by_graph",
           "holds_in_run_order", "shares_by_graph"]


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


def shares_by_graph(reports, runs: list[int], limit: int, outside: int) -> dict[str, int]:
    """Graph key -> the bytes of a step's bytes budget ``limit`` the graph may plan its own
    peak within: the limit less ``outside`` (what the step keeps resident: weights, their
    gradients, the optimizer state, the batch) plus the graph's own weights (its peak counts
    them), less what the regions that ran before it saved for their backwards (``runs`` and
    ``reports`` as in ``holds_by_graph``). A graph that ran more than once gets its least.

    Example:
        >>> from types import SimpleNamespace as R
        >>> reps = [R(weight_bytes=10, planned_saved_bytes=30, graph_key="a"),
        ...         R(weight_bytes=20, planned_saved_bytes=5, graph_key="b")]
        >>> shares_by_graph(reps, [0, 1], limit=200, outside=100)
        {'a': 110, 'b': 90}
    """
    out: dict[str, int] = {}
    before = 0
    for i in runs:
        r = reports[i]
        share = max(0, limit - outside + r.weight_bytes - before)
        out[r.graph_key] = min(out.get(r.graph_key, share), share)
        before += r.planned_saved_bytes
    return out


def graph_key(code: str, shapes) -> str:
    """A joint graph's identity across compiles of the same code: its generated Python and its
    inputs' shapes (Dynamo compiles a region again as the same graph)."""
    return hashlib.sha1(f"{code}\n{shapes!r}".encode()).hexdigest()[:16]
