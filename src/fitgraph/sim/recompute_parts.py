"""Where ``remat_plan`` places recomputes, per independent part of the drop set.

``remat_plan`` re-creates a dropped value at its first use after the forward, depth first over
the recompute's own missing inputs. The walk started by input ``j`` of the node at position
``q`` only visits values that lie in dropped storages and are connected to it, so the drop set
splits into *parts* whose walks never meet: dropped nodes connected when one's recompute may
read the other's values (``RematEvaluator.neighbours``, from the graph alone). Each part's
recomputes are a function of its own dropped nodes. ``RematEvaluator`` caches parts and, when a
move changes a few nodes, re-walks only the parts those nodes touch.

Every recompute gets the key ``(q, j, seq)`` (``seq`` counts within the walk); sorting all
parts' recomputes by key gives the plan's order, because ``(q, j)`` names one walk.

Example:
    >>> from fitgraph.sim.recompute_parts import event_key
    >>> event_key(3, 1, 0) < event_key(3, 2, 0) < event_key(4, 0, 0)
    True
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..plan.remat import not_recomputable

__all__ = ["Packed", "Part", "event_key", "walk_parts"]

_Q_SHIFT, _J_SHIFT = 42, 24   # NOTE: positions < 2**21, inputs per node < 2**18, walks < 2**24


def event_key(q: int, j: int, seq: int) -> int:
    return (q << _Q_SHIFT) | (j << _J_SHIFT) | seq


_PIDS = itertools.count()


@dataclass(frozen=True, eq=False)
class Part:
    """Dropped nodes whose recomputes depend on each other only; ``pid`` names its rows in a
    Packed."""

    pid: int
    dropped: frozenset[int]


@dataclass(frozen=True)
class Packed:
    """Every part's rows in flat arrays (``pid`` columns say whose), so that a drop set next to
    an evaluated one costs a mask and a concatenation, not a loop over its parts.

    Rows: per recompute (node, position it precedes, event_key); per storage a recompute reads
    or writes (the recompute's key, storage); per dropped storage allocated before the
    backward (storage, key of the recompute that re-creates it for good, or -1); per short
    lifetime of a per-use storage (``remat_plan``: re-created only to feed other recomputes,
    freed after their backward node) (storage, key that makes it, key of its last use)."""

    pid: np.ndarray
    nodes: np.ndarray
    q: np.ndarray
    key: np.ndarray
    t_pid: np.ndarray
    t_key: np.ndarray
    t_st: np.ndarray
    d_pid: np.ndarray
    d_st: np.ndarray
    d_key: np.ndarray
    c_pid: np.ndarray
    c_st: np.ndarray
    c_start: np.ndarray
    c_end: np.ndarray

    @staticmethod
    def empty() -> Packed:
        return Packed(*([_EMPTY] * 14))

    def replace(self, old: list[int], new: Packed) -> Packed:
        """Without the rows of parts ``old`` (pids), with the rows ``new``."""
        keep_e = keep_t = keep_d = keep_c = slice(None)
        if old:
            gone = np.array(old, dtype=np.int64)
            keep_e = ~np.isin(self.pid, gone)
            keep_t = ~np.isin(self.t_pid, gone)
            keep_d = ~np.isin(self.d_pid, gone)
            keep_c = ~np.isin(self.c_pid, gone)
        keep = {"pid": keep_e, "nodes": keep_e, "q": keep_e, "key": keep_e, "t_pid": keep_t,
                "t_key": keep_t, "t_st": keep_t, "d_pid": keep_d, "d_st": keep_d,
                "d_key": keep_d, "c_pid": keep_c, "c_st": keep_c, "c_start": keep_c,
                "c_end": keep_c}
        return Packed(**{f: np.concatenate([getattr(self, f)[k], getattr(new, f)])
                         for f, k in keep.items()})


def walk_parts(ev, region: set[int], drop: frozenset[int], once: frozenset[int] = frozenset()
               ) -> tuple[list[Part], Packed]:
    """Walk the recomputes of the dropped nodes ``region`` (a union of parts of ``drop``) under
    evaluator ``ev``'s order (``once``: the nodes dropped per use); split them into parts, with
    their rows. RematError as ``remat_plan``."""
    G, t = ev.G, ev.G.t
    unavail: set[int] = set()
    for d in region:
        unavail.update(ev.unavail_of[d])
    once = region & once
    positions = sorted({p for v in unavail for p in ev.back_readers.get(v, ())})
    nodes: list[int] = []
    qs: list[int] = []
    keys: list[int] = []
    cycles: dict[tuple[int, int], int] = {}  # (storage, key that made it) -> key of last use

    def producer(vid: int) -> int:
        p = G.producer[vid]
        if p is None or p not in drop and not t.view_ok[p]:
            raise not_recomputable(ev.graph, vid)
        return p

    bound, storage_of = ev.bound, G.storage_of
    for q in positions:
        made: dict[int, int] = {}   # NOTE: per-use nodes re-run at q -> key; storages' last use
        last: dict[int, int] = {}
        for j, u in enumerate(G.inputs[ev.order[q]]):
            # NOTE: a dropped storage is gone only from its release on (``drop_points``)
            if u not in unavail or q < bound[storage_of[u]]:
                continue
            stack = [[producer(u), 0]]  # NOTE: remat_plan's depth-first walk, in input order
            while stack:
                frame = stack[-1]
                ins = G.inputs[frame[0]]
                if frame[1] < len(ins):
                    v = ins[frame[1]]
                    frame[1] += 1
                    if v in unavail and q >= bound[storage_of[v]]:
                        stack.append([producer(v), 0])
                    continue
                stack.pop()
                key = event_key(q, j, len(nodes))
                keys.append(key)
                nodes.append(frame[0])
                qs.append(q)
                unavail.difference_update(G.outputs[frame[0]])
                if once:
                    for v in (*G.inputs[frame[0]], *G.outputs[frame[0]]):
                        last[G.storage_of[v]] = key
                    if frame[0] in once:
                        made[frame[0]] = key
        if made:  # NOTE: what q's node reads none of is freed after its last use: remade later
            read = {G.storage_of[v] for v in G.inputs[ev.order[q]]}
            for m, key in made.items():
                if read.isdisjoint(t.fresh[m]):
                    for st in t.fresh[m]:
                        cycles[st, key] = last[st]
                        unavail.update(v for v in t.members[st] if ev.owner[v] is not None)
    return _split(ev, region, nodes, qs, keys, cycles)


def _split(ev, region: set[int], nodes: list[int], qs: list[int], keys: list[int],
           cycles: dict[tuple[int, int], int]) -> tuple[list[Part], Packed]:
    """Group the walk's recomputes by connected dropped nodes (``ev.neighbours``, union-find)."""
    G, t = ev.G, ev.G.t
    parent = {d: d for d in region}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for d in region:
        for o in ev.neighbours.get(d, ()):
            if o in parent:
                a, b = find(d), find(o)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for d in sorted(region):
        groups.setdefault(find(d), []).append(d)
    pid_of = {root: next(_PIDS) for root in groups}
    e_pid = [pid_of[find(next(ev.owner[v] for v in G.outputs[r] if ev.owner[v] in parent))]
             for r in nodes]
    made: dict[int, int] = {}
    t_pid, t_key, t_st = [], [], []
    c_pid, c_st, c_start, c_end = [], [], [], []
    for r, pid, key in zip(nodes, e_pid, keys):
        for st in t.fresh[r]:
            end = cycles.get((st, key))
            if end is None:
                made[st] = key
            else:
                c_pid.append(pid)
                c_st.append(st)
                c_start.append(key)
                c_end.append(end)
        for v in (*G.inputs[r], *G.outputs[r]):
            t_pid.append(pid)
            t_key.append(key)
            t_st.append(G.storage_of[v])
    d_pid, d_st = [], []
    for root, members in groups.items():
        for d in members:
            for st in ev.dropped_storages[d]:
                d_pid.append(pid_of[root])
                d_st.append(st)
    rows = Packed(_arr(e_pid), _arr(nodes), _arr(qs), _arr(keys), _arr(t_pid), _arr(t_key),
                  _arr(t_st), _arr(d_pid), _arr(d_st), _arr([made.get(st, -1) for st in d_st]),
                  _arr(c_pid), _arr(c_st), _arr(c_start), _arr(c_end))
    return [Part(pid_of[root], frozenset(members)) for root, members in groups.items()], rows


_EMPTY = np.zeros(0, dtype=np.int64)


def _arr(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.int64) if xs else _EMPTY
