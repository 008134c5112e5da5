"""The lowest-peak order, found exactly within windows of the greedy order (issue 30: MAGIS's
DP over narrow-waist intervals).

The greedy (``plan.reorder.memory_aware_order``) picks one ready node at a time. This takes its
order (and eager's: the better result of the two is kept), cuts it where few bytes are live (the narrow waists: every prefix of a topological order
is a set of nodes a schedule can have run, so a cut there fixes what is live across it), and
within each window searches every order of the window's nodes that respects their
dependencies, by dynamic programming over the sets of nodes run so far: a set's live bytes do
not depend on the order that reached it, so each set keeps only its least peak so far. The
memory model is the greedy's (a node allocates its new storages, and the recomputed copy of a
dropped one at its first backward reader; a storage is freed after its last reader unless it
must survive the step), so every window's peak is at most the base order's there, and the
whole order's peak at most the greedy order's and eager's. A window whose sets would exceed ``max_states``
keeps the greedy's order.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> b = GraphBuilder(); x = b.add_input("x", (1024,), "float32", Role.INPUT)
    >>> big = b.add_node("aten.exp.default", [x], [((1024,), "float32")])[0]
    >>> small = b.add_node("aten.sum.default", [x], [((), "float32")])[0]
    >>> out = b.add_node("aten.mul.Tensor", [big, small], [((1024,), "float32")])[0]
    >>> g = b.finish({"loss": out})
    >>> order = exact_order(g)
    >>> order, order_peak(g, order) <= order_peak(g, [0, 1, 2])
    ([1, 0, 2], True)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..graph.analysis import new_storages, output_storages
from ..graph.deps import dependencies
from ..graph.ir import Graph
from .remat import split_drop
from .reorder import _split_dropped, memory_aware_order, touch_tables

__all__ = ["exact_order", "order_peak"]

WINDOW = 24
MAX_STATES = 50_000


@dataclass
class _Model:
    deps: dict[int, set[int]]
    touches: dict[int, set[int]]      # node -> storages it reads or writes
    touchers: dict[int, list[int]]    # storage -> nodes touching it
    nbytes: list[int]
    made: dict[int, set[int]]         # node -> storages it makes (allocates)
    keep: set[int]
    again: set[int]                   # recomputed copies: allocated by their first toucher


def _model(graph: Graph, dropped: Iterable[int]) -> _Model:
    deps = {k: set(v) for k, v in dependencies(graph).items()}
    fresh = new_storages(graph)
    nbytes = [s.nbytes for s in graph.storages]
    touches, touchers = touch_tables(graph)
    again = _split_dropped(graph, split_drop(graph, dropped)[0], fresh, touches, touchers,
                           nbytes)
    made = {nid: set(fresh.get(nid, ())) for nid in touches}
    return _Model(deps, touches, touchers, nbytes, made, output_storages(graph), again)


def order_peak(graph: Graph, order: list[int], dropped: Iterable[int] = ()) -> int:
    """The most bytes live while ``order`` runs, in the reordering's memory model (relative
    to what is live before the first node)."""
    return max((peak for peak, _ in _trace(_model(graph, dropped), order)), default=0)


def _trace(m: _Model, order: list[int]) -> list[tuple[int, int]]:
    """Per node of ``order`` (the whole graph, from 0 live): (bytes live while it runs,
    bytes live after it)."""
    remaining = {s: len(ts) for s, ts in m.touchers.items()}
    allocated: set[int] = set()
    live = 0
    out = []
    for nid in order:
        new = m.made[nid] | {s for s in m.touches[nid] & m.again if s not in allocated}
        allocated |= new
        live += sum(m.nbytes[s] for s in new)
        during = live
        for s in m.touches[nid]:
            remaining[s] -= 1
            if remaining[s] == 0 and s not in m.keep:
                live -= m.nbytes[s]
        out.append((during, live))
    return out


def exact_order(graph: Graph, dropped: Iterable[int] = (), *, window: int = WINDOW,
                max_states: int = MAX_STATES) -> list[int]:
    """A topological order whose peak is the least within each window of the greedy order or
    of eager's (see the module doc); never above either's peak. ``dropped``: nodes a remat
    plan drops after the forward (their recomputed copies counted as the greedy counts them)."""
    dropped = list(dropped)
    m = _model(graph, dropped)
    # NOTE: from the greedy order and from eager's (the greedy can be worse: Llama's +5%),
    # the better of the two
    bases = [memory_aware_order(graph, "strict", dropped), [n.id for n in graph.nodes]]
    best: tuple[int, list[int]] | None = None
    for base in bases:
        out: list[int] = []
        done: set[int] = set()
        for part in _windows(m, base, window):
            out.extend(_best_order(m, part, done, max_states))
            done.update(part)
        peak = max((p for p, _ in _trace(m, out)), default=0)
        if best is None or peak < best[0]:
            best = (peak, out)
    return best[1]


def _windows(m: _Model, order: list[int], window: int) -> list[list[int]]:
    """The order cut into windows of at most ``window`` nodes, each cut where the fewest bytes
    are live among the window's second half (a narrow waist)."""
    live_after = [after for _, after in _trace(m, order)]
    cuts, start = [], 0
    while start < len(order):
        end = min(len(order), start + window)
        if end < len(order):
            lo = start + max(1, window // 2)
            end = min(range(lo, end + 1), key=lambda i: (live_after[i - 1], -i))
        cuts.append(order[start:end])
        start = end
    return cuts


def _best_order(m: _Model, part: list[int], done: set[int], max_states: int) -> list[int]:
    """The least-peak order of ``part`` (run after ``done``), or ``part`` as it is when the
    search would exceed ``max_states`` sets."""
    index = {nid: i for i, nid in enumerate(part)}
    need = [0] * len(part)
    for nid, i in index.items():
        for d in m.deps[nid]:
            if d in index:
                need[i] |= 1 << index[d]
    # storages this window frees: those whose every toucher is done or in the window
    inside = {}
    for nid in part:
        for s in m.touches[nid]:
            if s in inside or s in m.keep:
                continue
            ts = m.touchers[s]
            if all(t in done or t in index for t in ts):
                inside[s] = sum(1 << index[t] for t in ts if t in index)
    copies = {s: sum(1 << index[t] for t in m.touchers[s] if t in index)
              for s in m.again if any(t in index for t in m.touchers[s])
              and not any(t in done for t in m.touchers[s])}
    alloc_fixed = [sum(m.nbytes[s] for s in m.made[nid] if s not in m.again) for nid in part]
    frees = [[(s, mask) for s, mask in inside.items() if mask >> i & 1] for i in range(len(part))]
    mine = [[(s, mask) for s, mask in copies.items() if mask >> i & 1] for i in range(len(part))]
    full = (1 << len(part)) - 1
    # state: scheduled set -> (peak so far, live now, previous set, node)
    layer = {0: (0, 0, None, None)}
    seen: dict[int, tuple] = dict(layer)
    for _ in range(len(part)):
        nxt: dict[int, tuple] = {}
        for state, (peak, live, _, _) in layer.items():
            for i in range(len(part)):
                bit = 1 << i
                if state & bit or need[i] & ~state:
                    continue
                alloc = alloc_fixed[i] + sum(m.nbytes[s] for s, mask in mine[i]
                                             if not mask & state)
                now = live + alloc
                after = state | bit
                freed = sum(m.nbytes[s] for s, mask in frees[i] if mask & ~after == 0)
                cand = (max(peak, now), now - freed, state, i)
                old = nxt.get(after)
                if old is None or cand[:2] < old[:2]:
                    nxt[after] = cand
        if len(seen) + len(nxt) > max_states:
            return part
        seen.update(nxt)
        layer = nxt
    order: list[int] = []
    state = full
    while state:
        _, _, prev, i = seen[state]
        order.append(part[i])
        state = prev
    order.reverse()
    return order
