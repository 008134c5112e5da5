"""Turn a rematerialization decision into a Plan: which nodes' outputs are dropped after the
forward pass and recomputed when the backward needs them.

Every remat solver (ILP, the production solver, the baselines) decides a set of nodes; this one
function turns that set into instructions, so correctness lives in one place and the verifier
checks it. A dropped value is recomputed on first use after the drop, recursively (its inputs
are recomputed first if they were dropped too; views of a dropped storage are re-created), and
each storage is freed after its last use in the final instruction order.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
    >>> from fitgraph.plan.remat import remat_plan
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.PARAMETER)
    >>> a = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    >>> y = b.add_node("aten.neg.default", [a], [((4,), "float32")])[0]
    >>> gy = b.add_node("aten.mul.Tensor", [y, a], [((4,), "float32")], phase=Phase.BACKWARD)[0]
    >>> g = b.finish({"loss": gy})
    >>> [f"{i.op} {getattr(i, 'node', '')}" for i in remat_plan(g, {0})][:4]
    ['compute 0', 'compute 1', 'free ', 'recompute 0']
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..graph.analysis import new_storages, output_storages
from ..graph.ir import Graph, Phase
from ..graph.recompute_rules import inplace_chains, is_view_node, recomputable
from .instructions import Compute, Free, Instruction, Plan, Recompute

__all__ = ["RematError", "RematTables", "complete_drop", "drop_point", "drop_points", "per_use",
           "remat_plan", "remat_tables", "split_drop"]


class RematError(ValueError):
    """A node was asked to be recomputed that must not be (random, in-place, optimizer...)."""


@dataclass(frozen=True)
class RematTables:
    """What ``remat_plan`` needs to know about a graph, independent of the drop set and the
    order: computed once by ``remat_tables`` and shared by the many calls a solver makes."""

    fresh: dict[int, list[int]]        # node -> storages it allocates
    members: dict[int, list[int]]      # storage -> values that live in it
    chain_of: dict[int, tuple[int, ...]]  # node -> the in-place chains it belongs to
    allowed: dict[int, str]            # node -> "" if recomputable, else why not
    view_ok: list[bool]                # node -> re-run whenever its base storage is recomputed
    keep: set[int]                     # storages that survive the step
    # NOTE: creator -> its chain's writers: a recompute of the creator runs them right after
    # it, so the storage holds what the forward left in it whichever value a reader names.
    # Fission's parts copied into slices of one buffer are read through views of the creator's
    # output, and a part made by ``_to_copy`` then scaled by ``div_`` (a dropout mask in parts)
    # is copied into the whole mask by its creator's value id: re-running only what a reader
    # names re-made the mask unscaled (GPT-2's embedding gradients 10% off)
    trailing: dict[int, tuple[int, ...]] = field(default_factory=dict)


def _trailing_writers(chains: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    return {creator: tuple(writers) for creator, *writers in chains.values()}


def remat_tables(graph: Graph) -> RematTables:
    """The drop-independent tables of ``remat_plan`` for ``graph``."""
    fresh = new_storages(graph)
    members: dict[int, list[int]] = {}
    for v in graph.values:
        members.setdefault(v.storage, []).append(v.id)
    chain_of: dict[int, tuple[int, ...]] = {}
    chains = inplace_chains(graph)
    for chain in chains.values():
        for nid in chain:
            chain_of[nid] = tuple(dict.fromkeys((*chain_of.get(nid, ()), *chain)))
    view_ok = [is_view_node(graph, n.id, fresh) for n in graph.nodes]
    return RematTables(fresh, members, chain_of, recomputable(graph), view_ok,
                       output_storages(graph), _trailing_writers(chains))


def complete_drop(graph: Graph, drop: Iterable[int], tables: RematTables) -> set[int]:
    """``drop`` with every in-place chain it touches made whole; RematError if a node in it
    cannot be recomputed."""
    drop, todo = set(drop), list(drop)
    while todo:  # NOTE: an in-place chain goes as a unit
        for m in tables.chain_of.get(todo.pop(), ()):
            if m not in drop:
                drop.add(m)
                todo.append(m)
    for nid in sorted(drop):
        if tables.allowed[nid]:
            n = graph.nodes[nid]
            raise RematError(f"node {n.name} ({n.target}, module {n.module or '<top>'}) cannot "
                             f"be recomputed: {tables.allowed[nid]}")
    return drop


def per_use(graph: Graph, nid: int) -> int:
    """The drop-set entry for "drop node ``nid`` and free what a recompute re-created only to
    feed other recomputes": ``len(graph.nodes) + nid`` (see ``remat_plan``)."""
    return len(graph.nodes) + nid


def split_drop(graph: Graph, drop: Iterable[int]) -> tuple[set[int], set[int]]:
    """(nodes dropped, nodes dropped per use) of a drop set whose entries are node ids or
    ``per_use`` entries (which drop their node too)."""
    n = len(graph.nodes)
    if isinstance(drop, (set, frozenset)):
        # NOTE: set operations in C, a Python loop over the per-use entries only (a remat
        # search splits thousands of drop sets of hundreds of nodes)
        ids = _node_ids(n)
        more = drop - ids
        if all(n <= x < 2 * n for x in more):
            once = {x - n for x in more}
            return set(drop & ids) | once, once
    nodes, once = set(), set()
    for x in drop:
        if not 0 <= x < 2 * n:
            raise RematError(f"drop-set entry {x} names no node (the graph has {n} nodes; "
                             f"{n}..{2 * n - 1} are per-use entries)")
        nodes.add(x % n)
        if x >= n:
            once.add(x - n)
    return nodes, once


@functools.lru_cache(maxsize=8)
def _node_ids(n: int) -> frozenset[int]:
    """The node ids of an ``n``-node graph (``split_drop``)."""
    return frozenset(range(n))


def not_recomputable(graph: Graph, vid: int) -> RematError:
    """The error for a value needed again whose producer may not be re-run."""
    p = graph.values[vid].producer
    n = graph.nodes[p] if p is not None else None
    return RematError(f"value {graph.values[vid].name} is needed again but its producer "
                      f"{n.name if n else '<input>'} is not recomputable")


def remat_plan(graph: Graph, drop: Iterable[int], order: list[int] | None = None, *,
               tables: RematTables | None = None) -> Plan:
    """The plan that computes ``order`` (default: captured order) and drops the outputs of the
    nodes in ``drop`` at the end of the forward+loss phases (``drop_points``: of the forward
    run that precedes their first backward reader, for a graph split in parts along its batch
    whose parts each run forward then backward), recomputing them on demand.

    A ``per_use(graph, nid)`` entry drops node ``nid`` too, and frees what a backward node's
    recomputes re-create of it only to feed other recomputes once that node has run (where the
    backward node reads none of its outputs itself); it is recomputed again when needed again — what
    Checkmate's schedules do when one value feeds two recomputes far apart (block 3's input,
    recomputed early in the backward, and block 2's MLP, much later).
    ``tables`` (from ``remat_tables``) saves recomputing the graph's tables on every call."""
    order = [n.id for n in graph.nodes] if order is None else list(order)
    t = remat_tables(graph) if tables is None else tables
    drop, once = split_drop(graph, drop)
    drop = complete_drop(graph, drop, t)
    once = complete_drop(graph, once, t)
    remade: set[int] = set()  # NOTE: per-use nodes the current backward node's walks re-ran
    walked: set[int] = set()  # NOTE: nodes the current walk re-ran
    avail: set[int] = set(graph.inputs)
    events: list[Instruction] = []

    def producer(vid: int) -> int:
        p = graph.values[vid].producer
        if p is None or p not in drop and not t.view_ok[p]:
            raise not_recomputable(graph, vid)
        return p

    def ensure(vid: int) -> None:
        """Recompute ``vid`` (its missing inputs first, depth first, in input order)."""
        if vid in avail:
            return
        walked.clear()
        # NOTE: an explicit stack, not recursion: a long dropped chain must not hit Python's
        # recursion limit on a 10,000-node graph
        stack = [[producer(vid), 0]]
        while stack:
            frame = stack[-1]
            ins = graph.nodes[frame[0]].inputs
            if frame[1] < len(ins):
                u = ins[frame[1]]
                frame[1] += 1
                if u not in avail:
                    stack.append([producer(u), 0])
                continue
            stack.pop()
            if frame[0] in walked:
                continue  # NOTE: a trailing writer its chain's creator already re-ran
            if updated and any(graph.values[u].storage in updated
                               for u in graph.nodes[frame[0]].inputs):
                raise _reads_updated_weight(graph, frame[0])
            events.append(Recompute(frame[0]))
            walked.add(frame[0])
            avail.update(o for o in graph.nodes[frame[0]].outputs if o is not None)
            if frame[0] in once:
                remade.add(frame[0])
            stack.extend([w, 0] for w in reversed(t.trailing.get(frame[0], ())))

    updated: set[int] = set()  # NOTE: weights an update has already changed
    points = drop_points(graph, order, t.fresh)
    released: dict[int, list[int]] = {}
    for s in sorted({s for nid in drop for s in t.fresh[nid]}):
        released.setdefault(points[s], []).append(s)
    for pos, nid in enumerate(order):
        for s in released.get(pos, ()):
            avail.difference_update(t.members[s])
        for u in graph.nodes[nid].inputs:
            ensure(u)
        events.append(Compute(nid))
        avail.update(o for o in graph.nodes[nid].outputs if o is not None)
        if remade:  # NOTE: per node: a recompute re-makes all its storages again
            read = {graph.values[u].storage for u in graph.nodes[nid].inputs}
            for m in remade:
                if read.isdisjoint(t.fresh[m]):
                    for s in t.fresh[m]:
                        avail.difference_update(t.members[s])
            remade.clear()
        if graph.nodes[nid].phase is Phase.OPTIMIZER:
            updated.update(graph.values[v].storage for v in graph.nodes[nid].mutates)
    return Plan(tuple(_with_frees(graph, events, t.fresh, t.keep)),
                meta={"dropped": sorted(drop | {per_use(graph, nid) for nid in once})})


def _reads_updated_weight(graph: Graph, nid: int) -> RematError:
    n = graph.nodes[nid]
    return RematError(f"node {n.name} ({n.target}, module {n.module or '<top>'}) would be "
                      "recomputed after the optimizer updated a weight it reads, giving a "
                      "different result: the order breaks graph.deps (an update waits for "
                      "every node whose recompute may read its weight); plan with an order "
                      "that respects it (plan.reorder)")


def drop_point(graph: Graph, order: list[int]) -> int:
    """Where in ``order`` the dropped storages are released: after the last forward or loss
    node. (A reordered step may run backward nodes that need no forward value, such as weight
    transposes, earlier; they do not end the forward.)"""
    return 1 + max((i for i, nid in enumerate(order)
                    if graph.nodes[nid].phase in (Phase.FORWARD, Phase.LOSS)), default=-1)


def drop_points(graph: Graph, order: list[int],
                fresh: dict[int, list[int]] | None = None) -> list[int]:
    """storage -> where in ``order`` it is released if its maker is dropped: after the last
    forward or loss node before the first backward node that reads it (``drop_point`` where
    nothing in the backward reads it); a node's storages go at the earliest of theirs.
    ``fresh``: ``new_storages(graph)`` if the caller has it. In a captured step the forward
    ends before any backward node reads an activation, so every storage is released at
    ``drop_point``; in a step split in parts along its batch (``transform.fission``) each part
    runs forward then backward, and a part's activations are released where its forward ends.

    Example:
        >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
        >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.INPUT)
        >>> a = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]      # part 0
        >>> b.add_node("aten.neg.default", [a], [((4,), "float32")], phase=Phase.BACKWARD)
        [2]
        >>> c = b.add_node("aten.exp.default", [x], [((4,), "float32")])[0]       # part 1
        >>> y = b.add_node("aten.neg.default", [c], [((4,), "float32")], phase=Phase.BACKWARD)[0]
        >>> g = b.finish({"loss": y})
        >>> points = drop_points(g, [0, 1, 2, 3])
        >>> points[g.values[a].storage], points[g.values[c].storage], drop_point(g, [0, 1, 2, 3])
        (1, 3, 3)
    """
    end = drop_point(graph, order)
    last_fwd = -1
    points = [end] * len(graph.storages)
    seen: set[int] = set()
    for pos, nid in enumerate(order):
        n = graph.nodes[nid]
        if n.phase in (Phase.FORWARD, Phase.LOSS):
            last_fwd = pos
            continue
        for v in n.inputs:
            st = graph.values[v].storage
            if st not in seen:
                seen.add(st)
                points[st] = min(end, last_fwd + 1)
    # NOTE: a recompute re-makes every storage of its node: they are released together (one
    # released later would be released again after the recompute that brought it back)
    for ss in (new_storages(graph) if fresh is None else fresh).values():
        if len(ss) > 1:
            first = min(points[st] for st in ss)
            for st in ss:
                points[st] = first
    return points


def _with_frees(graph: Graph, events: list[Instruction], fresh: dict[int, list[int]],
                keep: set[int]) -> list[Instruction]:
    """Insert a Free after the last use of each storage lifetime (a lifetime ends when the
    storage is produced again by a Recompute, or at its last use)."""
    last_use: dict[int, int] = {}
    produced_at: dict[int, int] = {}
    ends: dict[int, list[int]] = {}
    for i, ins in enumerate(events):
        n = graph.nodes[ins.node]
        for s in fresh[ins.node]:
            if s in produced_at and s not in keep:  # NOTE: a new lifetime: close the old one
                ends.setdefault(last_use[s], []).append(s)
            produced_at[s] = i
            last_use[s] = i
        for v in [*n.inputs, *[o for o in n.outputs if o is not None]]:
            last_use[graph.values[v].storage] = i
    for s, i in last_use.items():
        if s not in keep and s in produced_at:
            ends.setdefault(i, []).append(s)
    out: list[Instruction] = []
    for i, ins in enumerate(events):
        out.append(ins)
        if i in ends:
            out.append(Free(tuple(sorted(set(ends[i])))))
    return out
