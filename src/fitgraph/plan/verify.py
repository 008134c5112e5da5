"""The plan verifier (torch.fx ``lint()``-style): run between stages; errors name the node.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.plan.eager import eager_plan
    >>> from fitgraph.plan.verify import verify_plan
    >>> b = GraphBuilder(); x = b.add_input("x", (2,), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((2,), "float32")])[0]
    >>> g = b.finish({"loss": y}); verify_plan(g, eager_plan(g))
"""

from __future__ import annotations

from ..graph.analysis import new_storages, output_storages
from ..graph.ir import Graph
from .instructions import Compute, Free, Offload, Plan, Prefetch, Recompute, Wait

__all__ = ["PlanError", "verify_plan"]


class PlanError(ValueError):
    """A plan that would read freed memory, compute a node twice, or lose an output."""


def verify_plan(graph: Graph, plan: Plan) -> None:
    """Check that ``plan`` is a valid program for ``graph``; raise PlanError otherwise."""
    fresh = new_storages(graph)
    live = {graph.values[v].storage for v in graph.inputs}
    on_host: set[int] = set()
    in_flight: set[int] = set()
    produced: set[int] = set(live)
    computed: set[int] = set()
    # NOTE: values, not only storages: after a storage is recomputed, a view of it made by
    # another node is stale until that view node runs again
    avail: set[int] = set(graph.inputs)
    members: dict[int, list[int]] = {}
    for v in graph.values:
        members.setdefault(v.storage, []).append(v.id)

    def name(nid: int) -> str:
        n = graph.nodes[nid]
        return f"node {n.name} ({n.target}, module {n.module or '<top>'})"

    for pc, ins in enumerate(plan):
        if isinstance(ins, (Compute, Recompute)):
            if not 0 <= ins.node < len(graph.nodes):
                raise PlanError(f"instruction {pc}: no node {ins.node}")
            n = graph.nodes[ins.node]
            if isinstance(ins, Compute) and ins.node in computed:
                raise PlanError(f"instruction {pc}: {name(ins.node)} computed twice; "
                                "use Recompute for re-materialisation")
            if isinstance(ins, Recompute) and ins.node not in computed:
                raise PlanError(f"instruction {pc}: Recompute of {name(ins.node)} before Compute")
            for vid in n.inputs:
                st = graph.values[vid].storage
                if st not in live:
                    why = "offloaded and not prefetched" if st in on_host else "not live"
                    raise PlanError(f"instruction {pc}: {name(ins.node)} reads "
                                    f"{graph.values[vid].name} whose storage is {why}")
                if vid not in avail:
                    raise PlanError(f"instruction {pc}: {name(ins.node)} reads "
                                    f"{graph.values[vid].name}, freed and not recomputed since")
            if isinstance(ins, Recompute):
                for st in fresh[ins.node]:
                    if st in live:
                        raise PlanError(f"instruction {pc}: Recompute of {name(ins.node)} "
                                        f"but its output storage {st} is still live")
            computed.add(ins.node)
            avail.update(o for o in n.outputs if o is not None)
            live.update(fresh[ins.node])
            produced.update(fresh[ins.node])
        elif isinstance(ins, Free):
            for st in ins.storages:
                if st not in live:
                    raise PlanError(f"instruction {pc}: Free of storage {st} "
                                    f"({graph.storages[st].name}) that is not live")
                live.discard(st)
                avail.difference_update(members[st])
        elif isinstance(ins, Offload):
            if ins.storage not in live:
                raise PlanError(f"instruction {pc}: Offload of storage {ins.storage} not live")
            on_host.add(ins.storage)
            in_flight.add(ins.storage)
        elif isinstance(ins, Prefetch):
            if ins.storage not in on_host:
                raise PlanError(f"instruction {pc}: Prefetch of storage {ins.storage} "
                                "that was never offloaded")
            live.add(ins.storage)
            in_flight.add(ins.storage)
        elif isinstance(ins, Wait):
            if ins.storage not in in_flight:
                raise PlanError(f"instruction {pc}: Wait on storage {ins.storage} with no copy "
                                "in flight")
            in_flight.discard(ins.storage)
            if ins.storage in on_host and ins.storage in live and not _prefetched(plan, pc, ins):
                live.discard(ins.storage)
        else:
            raise PlanError(f"instruction {pc}: unknown instruction {ins!r}")
    missing = [n.id for n in graph.nodes if n.id not in computed]
    if missing:
        raise PlanError(f"plan never computes {name(missing[0])} (and {len(missing) - 1} more)")
    for st in output_storages(graph):
        if st in produced and st not in live:
            raise PlanError(f"storage {st} ({graph.storages[st].name}) is a step output or "
                            "resident but the plan frees it")


def _prefetched(plan: Plan, pc: int, wait: Wait) -> bool:
    """True if the copy this Wait ends is a prefetch (the storage stays on device)."""
    for ins in reversed(plan.instructions[:pc]):
        if isinstance(ins, (Offload, Prefetch)) and ins.storage == wait.storage:
            return isinstance(ins, Prefetch)
    return False
