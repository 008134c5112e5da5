"""Where ``remat_plan`` places recomputes, per independent part of the drop set.

``remat_plan`` re-creates a dropped value at its first use after the forward, depth first over
the recompute's own missing inputs. The walk started by input ``j`` of the node at position
``q`` only visits values that lie in dropped storages and are connected to it, so the drop set
splits into *parts* whose walks never meet: dropped nodes connected when one's recompute may
read the other's values (``RematEvaluator.neighbours``, from the graph alone). Each part's
recomputes are a function of its own dropped nodes (and those of them dropped per use).
``RematEvaluator`` keeps each result's parts and, when a move changes a few nodes, re-walks only
the parts those nodes touch; each part is walked on its own, and kept by its dropped nodes
(``PART_CACHE``), so a part met again — the same move tried from the next drop set — is not
walked again.

Every recompute gets the key ``(q, j, seq)`` (``seq`` counts within the walk); sorting all
parts' recomputes by key gives the plan's order, because ``(q, j)`` names one walk.

Example:
    >>> from fitgraph.sim.recompute_parts import event_key
    >>> event_key(3, 1, 0) < event_key(3, 2, 0) < event_key(4, 0, 0)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..plan.remat import not_recomputable

__all__ = ["Packed", "Part", "WalkTables", "event_key", "walk_parts", "walk_tables"]

_Q_SHIFT, _J_SHIFT = 42, 24   # NOTE: positions < 2**21, inputs per node < 2**18, walks < 2**24


def event_key(q: int, j: int, seq: int) -> int:
    return (q << _Q_SHIFT) | (j << _J_SHIFT) | seq


_EMPTY = np.zeros(0, dtype=np.int64)


class Packed(NamedTuple):
    """Rows of parts in flat arrays, so that a drop set costs one concatenation over its parts,
    not a loop over them.

    Rows: per recompute (node, position it precedes, event_key); per storage a recompute reads
    or writes (the recompute's key, storage); per dropped storage allocated before the
    backward (storage, key of the recompute that re-creates it for good, or -1); per short
    lifetime of a per-use storage (``remat_plan``: re-created only to feed other recomputes,
    freed after their backward node) (storage, key that makes it, key of its last use). The
    order of rows means nothing (``RematEvaluator`` sorts recomputes by key).

    NOTE: a NamedTuple, so that ``zip(*rows)`` gives the columns without a call per part."""

    nodes: np.ndarray
    q: np.ndarray
    key: np.ndarray
    t_key: np.ndarray
    t_st: np.ndarray
    d_st: np.ndarray
    d_key: np.ndarray
    c_st: np.ndarray
    c_start: np.ndarray
    c_end: np.ndarray

    @staticmethod
    def empty() -> Packed:
        return Packed(*([_EMPTY] * 10))

    @staticmethod
    def of(parts: tuple[Part, ...]) -> Packed:
        """Every part's rows, part after part."""
        if len(parts) < 2:
            return parts[0].rows if parts else Packed.empty()
        return Packed._make([np.concatenate(c) for c in zip(*[p.rows for p in parts])])


@dataclass(frozen=True, eq=False)
class Part:
    """Dropped nodes whose recomputes depend on each other only, with their rows; ``needs``:
    the recomputed nodes that are not views (its walk raises unless they are all dropped).
    Equal by identity: an evaluation keeps the parts of its base that it does not re-walk."""

    dropped: frozenset[int]
    needs: frozenset[int]
    rows: Packed


@dataclass(frozen=True, eq=False)
class WalkTables:
    """Per-evaluator tables for ``walk_parts``, from the graph and the order alone: per value
    the position its storage is released at, per node the inputs a walk may find missing, and
    per node its storages flattened (one array and offsets: node ``r``'s are
    ``flat[off[r]:off[r + 1]]``) so that a walk's rows are gathered with numpy, not built per
    recompute."""

    vbound: list[int]           # value -> release position of its storage (``drop_points``)
    # NOTE: only values with an owner are ever missing (``RematEvaluator.owner``): the walk
    # skips the others (weights, inputs, values made in the backward) without a lookup
    ins: list[tuple[int, ...]]              # node -> its inputs that have an owner, in order
    ins_at: list[tuple[tuple[int, int], ...]]  # node -> (input index, input) of those
    touch: tuple[np.ndarray, np.ndarray]    # storages of the node's inputs, then outputs
    touch_set: list[frozenset[int]]         # the same, as a set
    fresh: tuple[np.ndarray, np.ndarray]    # storages the node allocates
    dropped: tuple[np.ndarray, np.ndarray]  # ``RematEvaluator.dropped_storages``


def walk_tables(ev) -> WalkTables:
    """``WalkTables`` of evaluator ``ev`` (its ``bound``, ``owner``, ``dropped_storages``)."""
    G, n, owner = ev.G, len(ev.order), ev.owner
    vbound = [ev.bound[s] for s in G.storage_of]
    ins_at = [tuple((j, u) for j, u in enumerate(G.inputs[r]) if owner[u] is not None)
              for r in range(n)]
    ins = [tuple(u for _, u in a) for a in ins_at]
    touched = [[G.storage_of[v] for v in (*G.inputs[r], *G.outputs[r])] for r in range(n)]
    touch = _flat(touched)
    fresh = _flat([G.t.fresh[r] for r in range(n)])
    dropped = _flat([ev.dropped_storages[r] for r in range(n)])
    return WalkTables(vbound, ins, ins_at, touch, [frozenset(x) for x in touched], fresh,
                      dropped)


def _flat(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    off = np.zeros(len(rows) + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(r) for r in rows])
    return np.array([x for r in rows for x in r], dtype=np.int64), off


def _gather(table: tuple[np.ndarray, np.ndarray], idx: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """The rows of nodes ``idx`` of a flattened table, concatenated, and how many per node.

    Example:
        >>> t = _flat([[5], [], [6, 7]])
        >>> [a.tolist() for a in _gather(t, np.array([2, 0, 2]))]
        [[6, 7, 5, 6, 7], [2, 1, 2]]
    """
    flat, off = table
    starts = off[idx]
    lens = off[idx + 1] - starts
    ends = np.cumsum(lens)
    # NOTE: row i of node k sits at flat[starts[k] + i]: shift each node's run of aranges
    at = np.arange(ends[-1] if len(ends) else 0) + np.repeat(starts - (ends - lens), lens)
    return flat[at], lens


# NOTE: walked parts kept per evaluator, latest used first. A part's walk is a function of its
# dropped nodes and those of them dropped per use (``drop`` only decides whether it raises):
# a hotspot round tries many moves from one drop set and, after taking one, tries them again;
# the parts a move re-walks are mostly the ones it re-walked last round (OPT's least-peak
# search asks for 9,988 parts and walks 1,674; a part's rows take some kB)
PART_CACHE = 2048


def walk_parts(ev, region: set[int], drop: frozenset[int], once: frozenset[int] = frozenset()
               ) -> list[Part]:
    """The parts of the dropped nodes ``region`` (a union of parts of ``drop``) under evaluator
    ``ev``'s order (``once``: the nodes dropped per use), with their recomputes' rows.
    RematError as ``remat_plan``. Each part is walked on its own, or taken from
    ``ev.part_cache``."""
    cache = ev.part_cache
    parts: list[Part] = []
    for group, dropped in _components(ev, region):
        key = (dropped, once & dropped)
        part = cache.get(key)
        if part is not None and part.needs <= drop:
            cache.move_to_end(key)
        else:
            part = _walk(ev, group, dropped, drop, key[1])
            cache[key] = part
            while len(cache) > PART_CACHE:
                cache.popitem(last=False)
        parts.append(part)
    return parts


def _components(ev, region: set[int]) -> list[tuple[list[int], frozenset[int]]]:
    """The connected groups of ``region`` under ``ev.neighbours`` (each sorted, and as a set),
    in the order of their smallest members; kept per region (``ev.group_cache``: a move tried
    again splits the same region)."""
    key = frozenset(region)
    groups = ev.group_cache.get(key)
    if groups is None:
        groups = [(g, frozenset(g)) for g in _search(ev.neighbours, region)]
        ev.group_cache[key] = groups
        while len(ev.group_cache) > PART_CACHE:
            ev.group_cache.popitem(last=False)
    else:
        ev.group_cache.move_to_end(key)
    return groups


def _search(neighbours: dict[int, set[int]], region: set[int]) -> list[list[int]]:
    """The connected groups of ``region`` under ``neighbours``, each sorted, in the order of
    their smallest members."""
    left = set(region)
    groups = []
    for d in sorted(region):
        if d not in left:
            continue
        left.discard(d)
        group, todo = [d], [d]
        while todo:
            near = neighbours.get(todo.pop())
            if near:
                hit = left.intersection(near)
                if hit:
                    left -= hit
                    group += hit
                    todo += hit
        group.sort()
        groups.append(group)
    return groups


def _walk(ev, group: list[int], dropped: frozenset[int], drop: frozenset[int],
          once: frozenset[int]) -> Part:
    """The recomputes that re-create part ``group``'s dropped values (``remat_plan``'s walk,
    restricted to the part), as rows."""
    G, t, W = ev.G, ev.G.t, ev.walk
    unavail: set[int] = set()
    for d in group:
        unavail.update(ev.unavail_of[d])
    back_readers = ev.back_readers
    positions = sorted({p for v in unavail for p in back_readers.get(v, ())})
    nodes: list[int] = []
    walks: list[tuple[int, int, int]] = []   # NOTE: per walk: (first recompute, q, j)
    cycles: dict[tuple[int, int], int] = {}  # (storage, key that made it) -> key of last use
    ins, outputs, producer_of, view_ok = W.ins, G.outputs, G.producer, t.view_ok
    trailing = t.trailing
    vbound, order, storage_of = W.vbound, ev.order, G.storage_of
    for q in positions:
        made: dict[int, int] = {}   # NOTE: per-use nodes re-run at q -> key
        first = len(nodes)
        for j, u in W.ins_at[order[q]]:
            # NOTE: a dropped storage is gone only from its release on (``drop_points``)
            if u not in unavail or q < vbound[u]:
                continue
            walks.append((len(nodes), q, j))
            base = event_key(q, j, 0)
            v = u
            walked: set[int] = set()
            # NOTE: remat_plan's depth-first walk, in input order; each frame holds an
            # iterator over its node's inputs (where the walk resumes after a child)
            stack = []
            while True:
                if v is not None:   # NOTE: v is missing: push its producer
                    p = producer_of[v]
                    if p is None or p not in drop and not view_ok[p]:
                        raise not_recomputable(ev.graph, v)
                    stack.append((p, iter(ins[p])))
                r, it = stack[-1]
                for v in it:
                    if v in unavail and q >= vbound[v]:
                        break
                else:
                    v = None
                    stack.pop()
                    if r in walked:
                        # NOTE: a trailing writer its chain's creator already re-ran
                        if not stack:
                            break
                        continue
                    if r in once:
                        made[r] = base | len(nodes)
                    nodes.append(r)
                    walked.add(r)
                    unavail.difference_update(outputs[r])
                    # NOTE: as ``remat_plan``: a chain's writers run right after its creator
                    stack.extend((w, iter(ins[w])) for w in reversed(trailing.get(r, ())))
                    if not stack:
                        break
        if made:  # NOTE: what q's node reads none of is freed after its last use: remade later
            read = {storage_of[v] for v in G.inputs[order[q]]}
            for m, key in made.items():
                if read.isdisjoint(t.fresh[m]):
                    for st in t.fresh[m]:
                        cycles[st, key] = _last_use(ev, nodes, walks, first, st)
                        unavail.update(v for v in t.members[st] if ev.owner[v] is not None)
    needs = frozenset(r for r in nodes if not view_ok[r])
    return Part(dropped, needs, _rows(ev, group, nodes, walks, cycles))


def _last_use(ev, nodes: list[int], walks: list[tuple[int, int, int]], first: int,
              st: int) -> int:
    """The key of the last recompute from ``nodes[first]`` on that reads or writes storage
    ``st`` (there is one: the one that made it).

    NOTE: looked up only for the storages a per-use node frees (rare), not recorded per
    recompute."""
    touch = ev.walk.touch_set
    i = next(i for i in range(len(nodes) - 1, first - 1, -1) if st in touch[nodes[i]])
    start, q, j = next(w for w in reversed(walks) if w[0] <= i)
    return event_key(q, j, i)


def _rows(ev, group: list[int], nodes: list[int], walks: list[tuple[int, int, int]],
          cycles: dict[tuple[int, int], int]) -> Packed:
    """One part's rows from its walk."""
    W = ev.walk
    rec = np.array(nodes, dtype=np.int64)
    lens = np.diff([w[0] for w in walks] + [len(nodes)])
    key = (np.repeat([event_key(q, j, 0) for _, q, j in walks], lens)
           | np.arange(len(nodes), dtype=np.int64)) if walks else _EMPTY
    qs = np.repeat([q for _, q, _ in walks], lens) if walks else _EMPTY
    t_st, k = _gather(W.touch, rec)
    t_key = np.repeat(key, k)
    f_st, k = _gather(W.fresh, rec)
    f_key = np.repeat(key, k)
    if cycles:
        cyc = np.array([(s, k) in cycles for s, k in zip(f_st.tolist(), f_key.tolist())],
                       dtype=bool)
        c_st, c_start = f_st[cyc], f_key[cyc]
        c_end = np.array([cycles[s, k] for s, k in zip(c_st.tolist(), c_start.tolist())],
                         dtype=np.int64)
        f_st, f_key = f_st[~cyc], f_key[~cyc]
    else:
        c_st = c_start = c_end = _EMPTY
    d_st, _ = _gather(W.dropped, np.array(group, dtype=np.int64))
    # NOTE: a storage is re-created for good by its last recompute in the walk (keys grow
    # along the walk: the largest)
    made = np.full(len(ev.G.nbytes), -1, dtype=np.int64)
    np.maximum.at(made, f_st, f_key)
    return Packed(rec, qs, key, t_key, t_st, d_st, made[d_st], c_st, c_start, c_end)
