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
    keep = output_storages(graph)
    live = {graph.values[v].storage for v in graph.inputs}
    # NOTE: offloading is a small state machine per storage (see plan.instructions): on device
    # -> Offload (copying out, readable) -> Wait (released, on host) -> Prefetch (copying back,
    # not readable) -> Wait (on device again)
    on_host: set[int] = set()
    copying: dict[int, str] = {}
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
                if copying.get(st) == "prefetch":
                    raise PlanError(f"instruction {pc}: {name(ins.node)} reads "
                                    f"{graph.values[vid].name} while its prefetch is in flight; "
                                    f"put Wait({st}) before it")
                if vid not in avail:
                    raise PlanError(f"instruction {pc}: {name(ins.node)} reads "
                                    f"{graph.values[vid].name}, freed and not recomputed since")
            for vid in n.mutates:
                st = graph.values[vid].storage
                if copying.get(st) == "offload":
                    raise PlanError(f"instruction {pc}: {name(ins.node)} writes "
                                    f"{graph.values[vid].name} while its offload is in flight "
                                    "(the host copy would be stale); offload after the write")
            if isinstance(ins, Recompute):
                for st in fresh[ins.node]:
                    if st in live:
                        raise PlanError(f"instruction {pc}: Recompute of {name(ins.node)} "
                                        f"but its output storage {st} is still live")
                    if st in on_host:
                        raise PlanError(f"instruction {pc}: Recompute of {name(ins.node)} "
                                        f"but its output storage {st} is offloaded; prefetch "
                                        "it or do not offload it")
            computed.add(ins.node)
            avail.update(o for o in n.outputs if o is not None)
            live.update(fresh[ins.node])
            produced.update(fresh[ins.node])
        elif isinstance(ins, Free):
            for st in ins.storages:
                if st not in live:
                    raise PlanError(f"instruction {pc}: Free of storage {st} "
                                    f"({graph.storages[st].name}) that is not live")
                if st in copying:
                    raise PlanError(f"instruction {pc}: Free of storage {st} "
                                    f"({graph.storages[st].name}) with its {copying[st]} in "
                                    f"flight; put Wait({st}) before it")
                live.discard(st)
                avail.difference_update(members[st])
        elif isinstance(ins, (Offload, Prefetch, Wait)):
            _copy_step(graph, pc, ins, live, keep, on_host, copying)
        else:
            raise PlanError(f"instruction {pc}: unknown instruction {ins!r}")
    if copying:
        st = min(copying)
        raise PlanError(f"storage {st} ({graph.storages[st].name}): its {copying[st]} is never "
                        f"waited for; end it with Wait({st})")
    missing = [n.id for n in graph.nodes if n.id not in computed]
    if missing:
        raise PlanError(f"plan never computes {name(missing[0])} (and {len(missing) - 1} more)")
    for st in output_storages(graph):
        if st in produced and st not in live:
            raise PlanError(f"storage {st} ({graph.storages[st].name}) is a step output or "
                            "resident but the plan frees it")


def _copy_step(graph: Graph, pc: int, ins: Offload | Prefetch | Wait, live: set[int],
               keep: set[int], on_host: set[int], copying: dict[int, str]) -> None:
    """One step of a storage's offload state machine; raises PlanError on a wrong step."""
    st = ins.storage
    if not 0 <= st < len(graph.storages):
        raise PlanError(f"instruction {pc}: no storage {st}")
    what = f"storage {st} ({graph.storages[st].name})"
    if isinstance(ins, Offload):
        if st in keep:
            raise PlanError(f"instruction {pc}: Offload of {what}, which is resident or a step "
                            "output (the model or the caller holds it); offload activations")
        if st not in live or st in copying:
            state = {"offload": "being offloaded", "prefetch": "being prefetched"}.get(
                copying.get(st, ""), "offloaded" if st in on_host else "not live")
            raise PlanError(f"instruction {pc}: Offload of {what} that is {state}; offload a "
                            "storage on device, once")
        copying[st] = "offload"
    elif isinstance(ins, Prefetch):
        if st not in on_host:
            raise PlanError(f"instruction {pc}: Prefetch of {what} that is not offloaded and "
                            "released; Offload it and Wait for it first")
        on_host.discard(st)
        live.add(st)
        copying[st] = "prefetch"
    else:
        kind = copying.pop(st, None)
        if kind is None:
            raise PlanError(f"instruction {pc}: Wait on {what} with no copy in flight")
        if kind == "offload":
            live.discard(st)
            on_host.add(st)
