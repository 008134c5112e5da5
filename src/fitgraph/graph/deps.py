"""Which orders of a graph's nodes give the same results: the dependency side table.

Data edges are not enough. A node that writes a storage in place must stay after every earlier
access to that storage and before every later one (BatchNorm's running stats, dropout's mask,
the optimizer's update of a weight the backward still reads). Random ops keep their relative
order, so each draws the same numbers from the RNG stream as in eager. Any topological order of
these edges computes bitwise the same values.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.deps import dependencies
    >>> b = GraphBuilder(); x = b.add_input("x", (2,), "float32", Role.PARAMETER)
    >>> y = b.add_node("aten.neg.default", [x], [((2,), "float32")])[0]
    >>> z = b.add_node("aten.add_.Tensor", [x, y], [((2,), "float32")], mutates=(x,),
    ...                alias_of={0: x})[0]
    >>> w = b.add_node("aten.relu.default", [x], [((2,), "float32")])[0]
    >>> sorted(dependencies(b.finish({"loss": w}))[2])   # relu waits for the in-place add_
    [1]
"""

from __future__ import annotations

from .analysis import GraphError
from .ir import Graph

__all__ = ["dependencies", "respects_dependencies"]


def dependencies(graph: Graph) -> dict[int, set[int]]:
    """node id -> ids of the nodes that must run before it."""
    deps: dict[int, set[int]] = {n.id: set() for n in graph.nodes}
    accesses: dict[int, list[int]] = {}   # storage -> nodes touching it so far, in order
    last_write: dict[int, int] = {}
    last_random: int | None = None
    for n in graph.nodes:
        for v in n.inputs:
            p = graph.values[v].producer
            if p is not None:
                deps[n.id].add(p)
        written = {graph.values[v].storage for v in n.mutates}
        touched = {graph.values[v].storage for v in n.inputs}
        touched |= {graph.values[o].storage for o in n.outputs if o is not None}
        for s in sorted(touched):
            if s in written:
                deps[n.id].update(accesses.get(s, ()))   # write after earlier reads/writes
            elif s in last_write:
                deps[n.id].add(last_write[s])            # read after the last write
            accesses.setdefault(s, []).append(n.id)
        for s in written:
            last_write[s] = n.id
        if n.random:
            if last_random is not None:
                deps[n.id].add(last_random)
            last_random = n.id
        deps[n.id].discard(n.id)
    return deps


def respects_dependencies(graph: Graph, order: list[int],
                          deps: dict[int, set[int]] | None = None) -> None:
    """Raise GraphError naming the first node that ``order`` runs before one it depends on."""
    deps = dependencies(graph) if deps is None else deps
    if sorted(order) != list(range(len(graph.nodes))):
        raise GraphError("order must list every node exactly once")
    pos = {nid: i for i, nid in enumerate(order)}
    for nid in order:
        for d in sorted(deps[nid]):
            if pos[d] > pos[nid]:
                raise GraphError(f"order runs node {graph.nodes[nid].name} before "
                                 f"{graph.nodes[d].name}, which it depends on")
