"""The stage graph: a Graph seen as the units a Checkmate-style formulation schedules.

A *unit* is a node that allocates (or writes in place, or updates a weight) together with the
nodes that belong to it: the in-place writers of a chain it creates (dropout's
``empty_like → bernoulli_ → div_`` is one unit). Views (nodes that allocate nothing and only
alias) are not units: they cost nothing to re-create, so a reader of a view depends on the unit
that created the viewed storage, and ``plan.staged`` re-creates views on demand. Units are
ordered by the position of their last member, so stage ``t`` of a schedule is "compute unit
``t``" in an order that is a valid topological order of the graph.

Per unit: the bytes it allocates, its compute time, its workspace when computed and when
recomputed (a recomputed random node also holds a copy of the generator state), whether it may
be recomputed (a forward or loss unit that ``graph.recompute_rules.recomputable`` allows: like every remat
system, backward values are never recomputed) and the bytes of step outputs it makes (live to
the end, so reading them depends on nothing).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.solvers.remat.stages import stage_graph
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Ms(BaseCostModel):
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.INPUT)
    >>> a = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    >>> v = b.add_node("aten.view.default", [a], [((2, 2), "float32")], alias_of={0: a})[0]
    >>> s = b.add_node("aten.sum.default", [v], [((), "float32")])[0]
    >>> sg = stage_graph(b.finish({"loss": s}), Ms())
    >>> [u.members for u in sg.units], [u.deps for u in sg.units], sg.folded
    ([(0,), (2,)], [(), (0,)], (1,))
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cost.base import CostModel
from ...graph.analysis import new_storages, output_storages
from ...graph.ir import Graph, Phase
from ...graph.recompute_rules import inplace_chains, is_view_node, recomputable

__all__ = ["StageGraph", "StageGraphError", "Unit", "stage_graph"]


class StageGraphError(ValueError):
    """The graph cannot be cut into units without changing what it computes."""


@dataclass(frozen=True)
class Unit:
    members: tuple[int, ...]      # node ids, in graph order; the first creates the storages
    deps: tuple[int, ...]         # units whose storages a member reads (earlier units)
    reads: tuple[int, ...]        # stage-graph values (freeable storages) its members read
    values: tuple[int, ...]       # stage-graph values it creates
    nbytes: int                   # bytes its members allocate that can be freed
    seconds: float                # compute time of all members
    workspace: int                # transient bytes beyond its outputs, when computed
    recompute_workspace: int      # the same when recomputed (RNG state copy for random ops)
    recomputable: bool
    kept_bytes: int               # bytes of step outputs it allocates: live to the end


@dataclass(frozen=True)
class StageGraph:
    units: tuple[Unit, ...]
    folded: tuple[int, ...]       # view nodes: re-created on demand, not scheduled
    resident_bytes: int           # the graph's inputs: live the whole step
    users: tuple[tuple[int, ...], ...]  # unit -> units that depend on it (later units)
    value_unit: tuple[int, ...] = ()     # value (a freeable storage) -> the unit creating it
    value_bytes: tuple[int, ...] = ()
    value_users: tuple[tuple[int, ...], ...] = ()  # value -> units reading it


def stage_graph(graph: Graph, cost_model: CostModel) -> StageGraph:
    fresh = new_storages(graph)
    chains = inplace_chains(graph)
    in_chain = {w: ch[0] for ch in chains.values() for w in ch[1:]}
    ok = recomputable(graph)
    keep = output_storages(graph)
    rng_bytes = int(cost_model.rng_state_bytes)
    members: dict[int, list[int]] = {}
    folded: list[int] = []
    for n in graph.nodes:
        if n.id in in_chain:
            members[in_chain[n.id]].append(n.id)
        elif is_view_node(graph, n.id, fresh):  # NOTE: no workspace either (the simulator)
            folded.append(n.id)
        else:
            members[n.id] = [n.id]
    _check_random_order(graph, members)
    heads = sorted(members, key=lambda h: (members[h][-1], h))
    creator: dict[int, int] = {}
    value_of: dict[int, int] = {}   # storage -> stage-graph value (freeable storages only)
    value_unit: list[int] = []
    value_bytes: list[int] = []
    for i, h in enumerate(heads):
        for m in members[h]:
            for s in fresh[m]:
                creator[s] = i
                if s not in keep:
                    value_of[s] = len(value_unit)
                    value_unit.append(i)
                    value_bytes.append(graph.storages[s].nbytes)
    value_users: list[list[int]] = [[] for _ in value_unit]
    units: list[Unit] = []
    users: list[list[int]] = [[] for _ in heads]
    for i, h in enumerate(heads):
        mem = members[h]
        # NOTE: a step output stays live once made: reading it needs nothing kept
        deps = sorted({creator[graph.values[v].storage] for m in mem
                       for v in graph.nodes[m].inputs
                       if graph.values[v].storage in creator
                       and graph.values[v].storage not in keep} - {i})
        if any(d > i for d in deps):
            raise StageGraphError(f"unit of node {graph.nodes[h].name} reads a storage created "
                                  "later in the graph order")
        for d in deps:
            users[d].append(i)
        reads = sorted({value_of[graph.values[v].storage] for m in mem
                        for v in graph.nodes[m].inputs
                        if graph.values[v].storage in value_of} - {value_of[x] for m in mem
                                                                    for x in fresh[m]
                                                                    if x in value_of})
        for v in reads:
            value_users[v].append(i)
        costs = [cost_model.node_cost(graph, graph.nodes[m]) for m in mem]
        ws = max(c.workspace_bytes for c in costs)
        ws_re = max(max(c.workspace_bytes, rng_bytes) if graph.nodes[m].random
                    else c.workspace_bytes for m, c in zip(mem, costs))
        units.append(Unit(
            members=tuple(mem), deps=tuple(deps), reads=tuple(reads),
            values=tuple(value_of[x] for m in mem for x in fresh[m] if x in value_of),
            nbytes=sum(graph.storages[s].nbytes for m in mem for s in fresh[m] if s not in keep),
            seconds=sum(c.seconds for c in costs), workspace=ws, recompute_workspace=ws_re,
            recomputable=(all(not ok[m] for m in mem) and bool(fresh[h])
                          and graph.nodes[h].phase in (Phase.FORWARD, Phase.LOSS)),
            kept_bytes=sum(graph.storages[s].nbytes for m in mem for s in fresh[m] if s in keep)))
    return StageGraph(tuple(units), tuple(folded), graph.resident_bytes,
                      tuple(tuple(u) for u in users), tuple(value_unit), tuple(value_bytes),
                      tuple(tuple(u) for u in value_users))


def _check_random_order(graph: Graph, members: dict[int, list[int]]) -> None:
    """A unit runs where its last member was; its random members must not cross another
    random node on the way (the generator would hand out the numbers in another order)."""
    random_at = [n.id for n in graph.nodes if n.random]
    for mem in members.values():
        for m in mem:
            if graph.nodes[m].random and any(m < r < mem[-1] for r in random_at):
                raise StageGraphError(
                    f"node {graph.nodes[m].name} ({graph.nodes[m].target}) draws random numbers "
                    "before another random node but its in-place chain ends after it: this "
                    "graph cannot be cut into stages without changing the random stream")
