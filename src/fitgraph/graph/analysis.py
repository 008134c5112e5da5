"""Analyses over a Graph, returned as side tables (never attributes on nodes).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.analysis import storage_last_use
    >>> b = GraphBuilder(); x = b.add_input("x", (2,), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((2,), "float32")])[0]
    >>> z = b.add_node("aten.neg.default", [y], [((2,), "float32")])[0]
    >>> g = b.finish({"loss": z}); storage_last_use(g)[g.values[y].storage]
    1
"""

from __future__ import annotations

import hashlib

from .ir import Graph, Node, ValueRef

__all__ = [
    "GraphError",
    "flatten_refs",
    "graph_fingerprint",
    "new_storages",
    "node_storages_read",
    "output_storages",
    "storage_accesses",
    "storage_last_use",
    "storage_producer",
    "topological_index",
    "users",
    "verify_graph",
]


class GraphError(ValueError):
    """A graph that breaks an IR invariant; the message names the node and what is wrong."""


# NOTE: argument types that hold no ref, skipped without a test each (graph rewrites flatten
# and substitute every node's arguments; most are ints and floats)
REF_FREE_TYPES = frozenset({int, float, bool, str, type(None)})


def flatten_refs(obj) -> list[int]:
    """Value ids referenced in a nested args structure, in order."""
    out: list[int] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if type(o) in REF_FREE_TYPES:
            continue
        if isinstance(o, ValueRef):
            out.append(o.id)
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
    return out


def users(graph: Graph) -> dict[int, list[int]]:
    """value id -> ids of the nodes that read it, in node order."""
    table: dict[int, list[int]] = {v.id: [] for v in graph.values}
    for n in graph.nodes:
        for v in n.inputs:
            table[v].append(n.id)
    return table


def topological_index(graph: Graph, order: list[int] | None = None) -> dict[int, int]:
    """node id -> position in ``order`` (default: captured order); checks the order is
    topological and raises GraphError naming the first node that reads a value too early."""
    order = [n.id for n in graph.nodes] if order is None else order
    pos = {nid: i for i, nid in enumerate(order)}
    for nid in order:
        for v in graph.nodes[nid].inputs:
            p = graph.values[v].producer
            if p is not None and pos.get(p, len(order)) >= pos[nid]:
                raise GraphError(f"order is not topological: node {graph.nodes[nid].name} reads "
                                 f"{graph.values[v].name} before its producer runs")
    return pos


def node_storages_read(graph: Graph, node: Node) -> list[int]:
    """Storages a node touches (reads or writes), deduplicated, in order."""
    return list(dict.fromkeys(graph.values[v].storage for v in node.inputs))


def storage_producer(graph: Graph) -> dict[int, int | None]:
    """storage id -> node that first materialises it (None for graph inputs)."""
    prod: dict[int, int | None] = {}
    for v in graph.values:
        prod.setdefault(v.storage, v.producer)
    return prod


def new_storages(graph: Graph) -> dict[int, list[int]]:
    """node id -> storages it allocates (its outputs that are not views of existing storage)."""
    seen: set[int] = set()
    for vid in graph.inputs:
        seen.add(graph.values[vid].storage)
    table: dict[int, list[int]] = {}
    for n in graph.nodes:
        fresh = []
        for vid in n.outputs:
            if vid is None:
                continue
            st = graph.values[vid].storage
            if st not in seen:
                seen.add(st)
                fresh.append(st)
        table[n.id] = fresh
    return table


def output_storages(graph: Graph) -> set[int]:
    """Storages that must survive the step: graph outputs and everything resident."""
    keep = {graph.values[v].storage for v in graph.outputs.values()}
    keep |= {graph.values[v].storage for v in graph.inputs}
    return keep


def storage_accesses(graph: Graph) -> dict[int, list[int]]:
    """storage id -> ids of the nodes that read or make a value in it, in node order."""
    accesses: dict[int, list[int]] = {}
    for n in graph.nodes:
        touched = {graph.values[v].storage for v in n.inputs}
        touched |= {graph.values[o].storage for o in n.outputs if o is not None}
        for st in touched:
            accesses.setdefault(st, []).append(n.id)
    return accesses


def storage_last_use(graph: Graph) -> dict[int, int]:
    """storage id -> index of the last node that reads or produces it (liveness by storage).

    Storages never used after being produced die right after their producer. Computed once, in
    reverse, like torch.fx's liveness.
    """
    last: dict[int, int] = {}
    for n in reversed(graph.nodes):
        for vid in list(n.inputs) + [o for o in n.outputs if o is not None]:
            last.setdefault(graph.values[vid].storage, n.id)
    return last


def verify_graph(graph: Graph) -> None:
    """Check IR invariants; raise GraphError naming the offending node and the fix."""
    defined = set(graph.inputs)
    for i, n in enumerate(graph.nodes):
        if n.id != i:
            raise GraphError(f"node {n.name}: id {n.id} != position {i}; renumber nodes")
        for v in n.inputs:
            if v not in defined:
                raise GraphError(f"node {n.name} ({n.target}) reads value "
                                 f"{graph.values[v].name} before it is produced")
        refs = set(flatten_refs(n.args)) | set(flatten_refs(n.kwargs))
        if not refs <= set(n.inputs):
            raise GraphError(f"node {n.name}: args reference values missing from inputs")
        for v in n.mutates:
            if v not in n.inputs:
                raise GraphError(f"node {n.name} mutates {graph.values[v].name} "
                                 "without reading it")
        for o in n.outputs:
            if o is None:
                continue
            if graph.values[o].producer != n.id:
                raise GraphError(f"node {n.name}: output {graph.values[o].name} has "
                                 f"producer {graph.values[o].producer}")
            defined.add(o)
    for key, v in graph.outputs.items():
        if v not in defined:
            raise GraphError(f"graph output {key!r} refers to a value never produced")


def graph_fingerprint(graph: Graph) -> str:
    """A hash of what a plan depends on: ops, their constant arguments, shapes, dtypes, inputs."""
    h = hashlib.sha256()
    h.update(repr(graph.input_names).encode())
    for v in graph.values:
        h.update(f"{v.shape}{v.stride}{v.dtype}{v.storage}".encode())
    for n in graph.nodes:
        h.update(f"{n.target}{n.args!r}{sorted(n.kwargs.items())!r}{n.inputs}{n.outputs}".encode())
    return h.hexdigest()
