"""``eager_plan``: what eager PyTorch does — captured order, each storage freed after its last use.

Eager frees a tensor when its last reference dies: forward temporaries right after their last
forward reader, autograd's saved tensors right after the backward op that last reads them. In the
joint graph both are "after the storage's last reader", so one liveness sweep reproduces eager.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.plan.eager import eager_plan
    >>> b = GraphBuilder(); x = b.add_input("x", (2,), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((2,), "float32")])[0]
    >>> z = b.add_node("aten.neg.default", [y], [((2,), "float32")])[0]
    >>> [i.op for i in eager_plan(b.finish({"loss": z}))]
    ['compute', 'compute', 'free']
"""

from __future__ import annotations

from ..graph.analysis import output_storages
from ..graph.ir import Graph
from .instructions import Compute, Free, Instruction, Plan

__all__ = ["eager_plan", "plan_in_order"]


def plan_in_order(graph: Graph, order: list[int]) -> Plan:
    """Compute nodes in ``order`` (a topological order), freeing each storage after its last use
    in that order. The eager plan is this with the captured order."""
    keep = output_storages(graph)
    position = {nid: i for i, nid in enumerate(order)}
    last: dict[int, int] = {}
    for nid in order:
        n = graph.nodes[nid]
        for vid in list(n.inputs) + [o for o in n.outputs if o is not None]:
            st = graph.values[vid].storage
            if st not in keep:
                last[st] = max(last.get(st, -1), position[nid])
    dying: dict[int, list[int]] = {}
    for st, pos in last.items():
        dying.setdefault(pos, []).append(st)
    out: list[Instruction] = []
    for pos, nid in enumerate(order):
        out.append(Compute(nid))
        if pos in dying:
            out.append(Free(tuple(sorted(dying[pos]))))
    return Plan(tuple(out), meta={"solver": "eager"})


def eager_plan(graph: Graph) -> Plan:
    """The plan eager PyTorch follows for this graph."""
    return plan_in_order(graph, [n.id for n in graph.nodes])
