"""Turn a staged schedule (Checkmate's R matrix) into a Plan.

Stage ``t`` recomputes some earlier units, in order, then computes unit ``t``. A unit may be
recomputed in many stages (``remat_plan`` recomputes each dropped node once; an exact solver may
do more). Views are re-created on demand, right before a reader needs them, after every
re-production of the storage they alias. Frees come from ``remat``: each storage is released
right after its last use in the final instruction order, which is never later than what the
schedule's own memory accounting assumed.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.plan.staged import staged_plan
    >>> from fitgraph.solvers.remat.stages import stage_graph
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Ms(BaseCostModel):
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.PARAMETER)
    >>> a = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    >>> y = b.add_node("aten.neg.default", [a], [((4,), "float32")])[0]
    >>> gy = b.add_node("aten.mul.Tensor", [y, a], [((4,), "float32")], phase=Phase.BACKWARD)[0]
    >>> g = b.finish({"loss": gy}); sg = stage_graph(g, Ms())
    >>> [f"{i.op} {getattr(i, 'node', '')}".strip() for i in staged_plan(g, sg, [[], [], [0]])]
    ['compute 0', 'compute 1', 'free', 'recompute 0', 'compute 2', 'free']
"""

from __future__ import annotations

from collections.abc import Sequence

from ..graph.analysis import new_storages, output_storages
from ..graph.ir import Graph
from ..graph.recompute_rules import is_view_node
from .instructions import Compute, Instruction, Plan, Recompute
from .remat import RematError, _with_frees

__all__ = ["staged_plan"]


def staged_plan(graph: Graph, stages, recompute: Sequence[Sequence[int]]) -> Plan:
    """``stages``: a ``solvers.remat.stages.StageGraph``; ``recompute[t]``: the units recomputed in
    stage ``t`` before unit ``t`` is computed (each earlier than ``t``)."""
    units = stages.units
    if len(recompute) != len(units):
        raise ValueError(f"{len(recompute)} stages given for {len(units)} units")
    fresh = new_storages(graph)
    folded = set(stages.folded)
    members: dict[int, list[int]] = {}
    for v in graph.values:
        members.setdefault(v.storage, []).append(v.id)
    readers: dict[int, bool] = {v.id: False for v in graph.values}
    for n in graph.nodes:
        for v in n.inputs:
            readers[v] = True
    avail: set[int] = set(graph.inputs)
    computed: set[int] = set()
    events: list[Instruction] = []

    def emit(nid: int) -> None:
        for v in graph.nodes[nid].inputs:
            ensure(v)
        events.append(Recompute(nid) if nid in computed else Compute(nid))
        computed.add(nid)
        outs = {o for o in graph.nodes[nid].outputs if o is not None}
        for s in fresh[nid]:  # NOTE: a new lifetime: views of the old one are stale
            avail.difference_update(set(members[s]) - outs)
        avail.update(outs)

    def ensure(vid: int) -> None:
        if vid in avail:
            return
        p = graph.values[vid].producer
        if p is None or not (p in folded or is_view_node(graph, p, fresh)):
            n = graph.nodes[p] if p is not None else None
            raise RematError(f"value {graph.values[vid].name} is read but its producer "
                             f"{n.name if n else '<input>'} was neither kept nor recomputed "
                             "by the schedule")
        emit(p)

    def makeable(vid: int) -> bool:
        """Available, or a view (of a view ...) of something available."""
        if vid in avail:
            return True
        p = graph.values[vid].producer
        return p in folded and all(makeable(i) for i in graph.nodes[p].inputs)

    for t, unit in enumerate(units):
        for u in recompute[t]:
            if not 0 <= u < t:
                raise ValueError(f"stage {t} recomputes unit {u}: only earlier units can be")
            if not units[u].recomputable:
                head = graph.nodes[units[u].members[0]]
                raise RematError(f"node {head.name} ({head.target}) cannot be recomputed")
            for nid in units[u].members:
                emit(nid)
        for nid in unit.members:
            emit(nid)
            for o in graph.nodes[nid].outputs:  # NOTE: views nobody reads still run, at once
                for v in _unread_views(graph, o, folded, readers, members):
                    # NOTE: an unread view of a view runs now too (its view re-made on demand):
                    # left to the end it would hold the storage the schedule freed
                    if v not in computed and all(makeable(i) for i in graph.nodes[v].inputs):
                        emit(v)
    for vid in graph.outputs.values():
        ensure(vid)
    for nid in sorted(folded - computed):  # views of resident storage that nobody reads
        emit(nid)
    return Plan(tuple(_with_frees(graph, events, fresh, set(output_storages(graph)))),
                meta={"recomputes": sum(len(r) for r in recompute)})


def _unread_views(graph: Graph, vid: int | None, folded: set[int], readers: dict[int, bool],
                  members: dict[int, list[int]]) -> list[int]:
    """Folded nodes reading a value of the same storage as ``vid`` whose outputs nobody reads."""
    if vid is None:
        return []
    out = []
    for v in members[graph.values[vid].storage]:
        p = graph.values[v].producer
        if p in folded and not any(readers[o] for o in graph.nodes[p].outputs if o is not None) \
                and v not in graph.outputs.values():
            out.append(p)
    return out
