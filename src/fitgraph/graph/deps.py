"""Which orders of a graph's nodes give the same results: the dependency side table.

Data edges are not enough. A node that writes a storage in place must stay after every earlier
access to that storage and before every later one (BatchNorm's running stats, dropout's mask,
the optimizer's update of a weight the backward still reads). Random ops keep their relative
order, so each draws the same numbers from the RNG stream as in eager. Any topological order of
these edges computes bitwise the same values, also when ``plan.remat`` recomputes forward values
during the backward: an optimizer update of a weight waits for every later node that reads a
forward value computed at or after the weight's first forward reader, because a recompute
inserted before such a node may read the weight and must see it before the update.

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
from .ir import Graph, Phase

__all__ = ["dependencies", "respects_dependencies"]

_FORWARD = (Phase.FORWARD, Phase.LOSS)


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
    _guard_recomputes(graph, deps)
    if graph.meta.get("updates_after_backward"):
        _updates_after_gradients(graph, deps)
    if graph.meta.get("backward_after_forward"):
        _backward_after_forward(graph, deps)
    return deps


def _backward_after_forward(graph: Graph, deps: dict[int, set[int]]) -> None:
    """Every node of the backward waits for the whole forward: a compiled region's joint graph
    (``capture.joint``) has the tangents as inputs, but autograd hands them over only once the
    forward module has run, so no backward node can run earlier. Only the backward's first
    nodes get the edges; the rest wait through them."""
    forward = {n.id for n in graph.nodes if n.phase in _FORWARD}
    for n in graph.nodes:
        if n.phase not in _FORWARD and not deps[n.id] - forward:
            deps[n.id].update(forward)


def _updates_after_gradients(graph: Graph, deps: dict[int, set[int]]) -> None:
    """Every optimizer update waits for every gradient: the step has code that reads all of
    them before the first update (``optimizer.step()``'s pre-hooks), as eager runs it."""
    makers = {graph.values[vid].producer for key, vid in graph.outputs.items()
              if key.startswith("grad:")} - {None}
    for n in graph.nodes:
        if n.phase is Phase.OPTIMIZER:
            deps[n.id].update(makers - {n.id})


def _guard_recomputes(graph: Graph, deps: dict[int, set[int]]) -> None:
    """Make each optimizer update wait for the nodes whose recomputes may read its weight.

    A recompute of forward node f runs right before a later node that reads an output of f or
    of a forward node computed from f (directly, or through a view made after the forward).
    Every such reader reads a forward value produced at or after f; f reads weight w only if f
    comes at or after w's first forward reader. So the readers of forward values produced at or
    after that point are all the nodes a recompute reading w may precede.
    """
    first_read: dict[int, int] = {}   # storage -> first forward node reading it
    origin: dict[int, int] = {}       # value -> forward node it was produced by (or viewed from)
    latest: dict[int, int] = {}       # later node -> latest origin among the values it reads
    for n in graph.nodes:
        forward = n.phase in _FORWARD
        if forward:
            for v in n.inputs:
                first_read.setdefault(graph.values[v].storage, n.id)
            origin.update((o, n.id) for o in n.outputs if o is not None)
            continue
        seen = [origin[v] for v in n.inputs if v in origin]
        if not seen:
            continue
        latest[n.id] = max(seen)
        outs = [o for o in n.outputs if o is not None]
        bases = {graph.values[v].storage for v in n.inputs}
        if not n.mutates and all(graph.values[o].storage in bases for o in outs):
            origin.update((o, latest[n.id]) for o in outs)  # NOTE: a view, re-made on recompute
    for n in graph.nodes:
        if n.phase is not Phase.OPTIMIZER:
            continue
        starts = [first_read[s] for s in {graph.values[v].storage for v in n.mutates}
                  if s in first_read]
        if starts:
            deps[n.id].update(c for c, o in latest.items() if o >= min(starts) and c != n.id)


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
