"""Memory-aware reordering: list scheduling over the dependency table.

At each step one ready node runs (all its dependencies done, see ``graph.deps``); the choice
looks at the node's net effect on live bytes: what it allocates minus what it frees by being the
last reader of a storage. ``strict`` takes the ready node with the smallest net effect;
``conservative`` keeps eager's order unless a ready node frees memory on net. Ties keep eager's
order, so the result is deterministic. Any order it returns computes the same values
(bitwise): it is a topological order of the dependencies, which include in-place writes and the
RNG order.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.plan.reorder import memory_aware_order
    >>> b = GraphBuilder(); x = b.add_input("x", (1024,), "float32", Role.INPUT)
    >>> big = b.add_node("aten.exp.default", [x], [((1024,), "float32")])[0]
    >>> small = b.add_node("aten.sum.default", [x], [((), "float32")])[0]
    >>> out = b.add_node("aten.mul.Tensor", [big, small], [((1024,), "float32")])[0]
    >>> memory_aware_order(b.finish({"loss": out}), "strict")   # the 4-byte sum first
    [1, 0, 2]
"""

from __future__ import annotations

from ..graph.analysis import new_storages, output_storages
from ..graph.deps import dependencies
from ..graph.ir import Graph

__all__ = ["STRATEGIES", "memory_aware_order"]

STRATEGIES = ("strict", "conservative")


def memory_aware_order(graph: Graph, strategy: str = "strict") -> list[int]:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown reordering strategy {strategy!r}; known: {STRATEGIES}")
    deps = dependencies(graph)
    fresh = new_storages(graph)
    keep = output_storages(graph)
    nbytes = [s.nbytes for s in graph.storages]
    touches: dict[int, set[int]] = {}
    for n in graph.nodes:
        st = {graph.values[v].storage for v in n.inputs}
        st |= {graph.values[o].storage for o in n.outputs if o is not None}
        touches[n.id] = st
    remaining: dict[int, int] = {}
    for st in touches.values():
        for s in st:
            remaining[s] = remaining.get(s, 0) + 1
    waiting = {nid: len(d) for nid, d in deps.items()}
    users_of: dict[int, list[int]] = {nid: [] for nid in deps}
    for nid, d in deps.items():
        for p in d:
            users_of[p].append(nid)
    ready = {nid for nid, k in waiting.items() if k == 0}
    order: list[int] = []

    def delta(nid: int) -> int:
        freed = sum(nbytes[s] for s in touches[nid] if remaining[s] == 1 and s not in keep)
        return sum(nbytes[s] for s in fresh[nid]) - freed

    while ready:
        first = min(ready)
        if strategy == "strict":
            pick = min(ready, key=lambda n: (delta(n), n))
        else:
            best = min(ready, key=lambda n: (delta(n), n))
            pick = best if delta(best) < 0 <= delta(first) else first
        ready.discard(pick)
        order.append(pick)
        for s in touches[pick]:
            remaining[s] -= 1
        for u in users_of[pick]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.add(u)
    if len(order) != len(graph.nodes):
        raise RuntimeError("dependency cycle: the graph's dependencies are not a DAG")
    return order
