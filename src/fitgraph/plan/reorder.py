"""Memory-aware reordering: list scheduling over the dependency table.

At each step one ready node runs (all its dependencies done, see ``graph.deps``); the choice
looks at the node's net effect on live bytes: what it allocates minus what it frees by being the
last reader of a storage. ``strict`` takes the ready node with the smallest net effect;
``conservative`` keeps eager's order unless a ready node frees memory on net. Ties keep eager's
order, so the result is deterministic. Any order it returns computes the same values
(bitwise): it is a topological order of the dependencies, which include in-place writes and the
RNG order.

With ``dropped`` (nodes whose outputs ``plan.remat`` drops after the forward and recomputes on
demand) the bytes follow the remat plan instead: a dropped storage dies at its last forward
use, and the first backward node to read it allocates it again (its recompute), so the backward
prefers finishing the readers of what has been recomputed before recomputing more.

Net effects change only when a storage's last reader becomes known or a recompute happens, so
they are kept in a heap with lazy invalidation: O((n + edges) log n), fit for 10,000+ nodes.

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

import heapq
from collections.abc import Iterable

from ..graph.analysis import new_storages, output_storages
from ..graph.deps import dependencies
from ..graph.ir import Graph, Phase
from .remat import split_drop

__all__ = ["STRATEGIES", "memory_aware_order", "touch_tables"]

STRATEGIES = ("strict", "conservative")
_LATE = (Phase.BACKWARD, Phase.OPTIMIZER)


def memory_aware_order(graph: Graph, strategy: str = "strict",
                       dropped: Iterable[int] = ()) -> list[int]:
    """A topological order of ``graph.deps`` that keeps live bytes low (see the module doc)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown reordering strategy {strategy!r}; known: {STRATEGIES}")
    deps = dependencies(graph)
    fresh = new_storages(graph)
    keep = output_storages(graph)
    nbytes = [s.nbytes for s in graph.storages]
    touches, touchers = touch_tables(graph)
    # NOTE: a per-use entry (plan.remat.per_use) orders like its node dropped
    again = _split_dropped(graph, split_drop(graph, dropped)[0], fresh, touches, touchers,
                           nbytes)
    remaining = {s: len(ns) for s, ns in touchers.items()}
    alloc = {nid: sum(nbytes[s] for s in fresh[nid]) + sum(nbytes[s] for s in st if s in again)
             for nid, st in touches.items()}
    delta = {nid: alloc[nid] - sum(nbytes[s] for s in st if remaining[s] == 1 and s not in keep)
             for nid, st in touches.items()}
    waiting = {nid: len(d) for nid, d in deps.items()}
    users_of: dict[int, list[int]] = {nid: [] for nid in deps}
    for nid, d in deps.items():
        for p in d:
            users_of[p].append(nid)
    # NOTE: an optimizer update that frees nothing (its gradient is a step output) has a net
    # effect of zero, below every allocating backward node, so ``strict`` ran each one as soon
    # as its gradient was done: interleaved with the backward, each update found its weights
    # and state out of cache (Swin: the updates 6 ms slower, +10% of the step, unseen by the
    # simulator) and its temporaries added to the backward's live bytes. Such an update waits
    # until nothing else is ready; one that frees (optimizer in backward) is taken at once.
    late = {n.id for n in graph.nodes if n.phase is Phase.OPTIMIZER}

    def key(nid: int) -> tuple[bool, int]:
        return nid in late and delta[nid] >= 0, delta[nid]

    ready = {nid for nid, k in waiting.items() if k == 0}
    by_delta = [(key(nid), nid) for nid in ready]
    by_id = list(ready)
    heapq.heapify(by_delta)
    heapq.heapify(by_id)
    done: set[int] = set()
    order: list[int] = []

    def change(nid: int, by: int) -> None:
        delta[nid] += by
        if nid in ready:
            heapq.heappush(by_delta, (key(nid), nid))

    def top_delta() -> int:
        while by_delta[0][0] != key(by_delta[0][1]) or by_delta[0][1] in done:
            heapq.heappop(by_delta)  # NOTE: lazy invalidation: stale or already scheduled
        return by_delta[0][1]

    while ready:
        best = top_delta()
        if strategy == "strict":
            pick = best
        else:
            while by_id[0] in done:
                heapq.heappop(by_id)
            first = by_id[0]
            pick = best if delta[best] < 0 <= delta[first] else first
        ready.discard(pick)
        done.add(pick)
        order.append(pick)
        for s in touches[pick]:
            remaining[s] -= 1
            if s in again:  # NOTE: recomputed now; the other backward readers find it live
                again.discard(s)
                for m in touchers[s]:
                    if m not in done:
                        change(m, -nbytes[s])
            if remaining[s] == 1 and s not in keep:
                last = next(m for m in touchers[s] if m not in done)
                change(last, -nbytes[s])
        for u in users_of[pick]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.add(u)
                heapq.heappush(by_delta, (key(u), u))
                heapq.heappush(by_id, u)
    if len(order) != len(graph.nodes):
        raise RuntimeError("dependency cycle: the graph's dependencies are not a DAG")
    return order


def touch_tables(graph: Graph) -> tuple[dict[int, set[int]], dict[int, list[int]]]:
    """(node -> storages it reads or writes, storage -> nodes touching it in node order)."""
    touches: dict[int, set[int]] = {}
    for n in graph.nodes:
        st = {graph.values[v].storage for v in n.inputs}
        st |= {graph.values[o].storage for o in n.outputs if o is not None}
        touches[n.id] = st
    touchers: dict[int, list[int]] = {}
    for nid, st in touches.items():
        for s in st:
            touchers.setdefault(s, []).append(nid)
    return touches, touchers


def _split_dropped(graph: Graph, dropped: set[int], fresh: dict[int, list[int]],
                   touches: dict[int, set[int]], touchers: dict[int, list[int]],
                   nbytes: list[int]) -> set[int]:
    """Give each dropped storage that the backward reads a second, virtual storage (its
    recomputed copy) touched by the backward readers instead; return the virtual ids."""
    again: set[int] = set()
    for d in sorted(dropped):
        if graph.nodes[d].phase in _LATE:
            continue
        for s in fresh[d]:
            late = [nid for nid in touchers[s] if graph.nodes[nid].phase in _LATE]
            if not late:
                continue
            copy = len(nbytes)
            nbytes.append(nbytes[s])
            again.add(copy)
            touchers[s] = [nid for nid in touchers[s] if graph.nodes[nid].phase not in _LATE]
            touchers[copy] = late
            for nid in late:
                touches[nid].discard(s)
                touches[nid].add(copy)
    return again
