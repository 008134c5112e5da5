"""``simulate(graph, remat_plan(graph, drop, order), cost)`` for many drop sets, fast and exact.

A remat solver asks one question hundreds of times: with these nodes dropped, how high is the
peak and how long is the step? Building the Plan and walking it is O(n) Python per question.
Here what does not depend on the drop set (each storage's lifetime in ``order``, node costs,
who reads what in the backward) is computed once; per question only the recomputes are placed
(the same depth-first walk as ``remat_plan``, cached per independent part of the drop set, so
that evaluating a drop set next to an evaluated one re-walks only the parts that changed, and
a part walked before is not walked again: see ``sim.recompute_parts``) and the memory curve is
a numpy cumulative sum over storage lifetimes. The answer is the simulator's: the same peak
bytes, the same latency (the same float additions in the same order) and the same storages live
at the peak — ``tests/test_remat_eval.py`` holds it to that.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.plan.remat import remat_plan
    >>> from fitgraph.sim.simulate import simulate
    >>> from fitgraph.sim.remat_eval import RematEvaluator
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Ms(BaseCostModel):
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    ...     def copy_seconds(self, nbytes): return 0.0
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.PARAMETER)
    >>> a = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    >>> y = b.add_node("aten.neg.default", [a], [((4,), "float32")])[0]
    >>> gy = b.add_node("aten.mul.Tensor", [y, a], [((4,), "float32")], phase=Phase.BACKWARD)[0]
    >>> g = b.finish({"loss": gy})
    >>> r = RematEvaluator(g, Ms()).evaluate({0})
    >>> s = simulate(g, remat_plan(g, {0}), Ms())
    >>> (r.peak_bytes, r.latency_s) == (s.peak_bytes, s.latency_s), r.recomputes
    (True, 1)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..cost.base import CostModel
from ..graph.ir import Graph
from ..graph.recompute_rules import is_view_node
from ..plan.remat import (
    RematError,
    RematTables,
    complete_drop,
    drop_points,
    per_use,
    remat_tables,
    split_drop,
)
from .recompute_parts import Packed, Part, walk_parts, walk_tables

__all__ = ["RematEval", "RematEvaluator"]

# NOTE: float64 adds integers exactly below 2**53; byte counts are summed as floats (bincount)
_EXACT_FLOAT_BYTES = 2**52
# NOTE: answers kept per evaluator, latest used first: hotspot asks for the same drop set again
# (a prune re-evaluates what its grow just took, exchange and add_prune passes meet the same
# sets): on ResNet-50 small at 0.7 (auto) 7,438 evaluations were of 4,790 distinct sets
MEMO_SETS = 1024


@dataclass(frozen=True, eq=False)
class RematEval:
    drop: frozenset[int]      # the drop set, in-place chains completed (per-use entries too)
    peak_bytes: int           # as SimResult.peak_bytes
    latency_s: float          # as SimResult.latency_s
    peak_made: np.ndarray     # sorted storages live at the peak that the step allocates
    recomputes: int           # Recompute instructions in the plan
    inputs_st: tuple[int, ...]
    parts: dict[int, Part]    # dropped node -> the part that re-creates its storages
    part_list: tuple[Part, ...]  # every part, once
    evaluator: RematEvaluator
    nodes: frozenset[int]     # the nodes dropped
    once: frozenset[int]      # the nodes dropped per use (``remat_plan``)

    @property
    def peak_live(self) -> frozenset[int]:
        """Storages live at the peak, as SimResult.peak_live."""
        return frozenset(self.peak_made.tolist()) | frozenset(self.inputs_st)


class _GraphTables:
    """Per-graph (order-independent) arrays shared by the evaluators of one graph."""

    def __init__(self, graph: Graph, cost_model: CostModel, tables: RematTables | None) -> None:
        self.graph = graph
        self.t = remat_tables(graph) if tables is None else tables
        costs = [cost_model.node_cost(graph, n) for n in graph.nodes]
        self.seconds = np.array([c.seconds for c in costs], dtype=np.float64)
        rng = cost_model.rng_state_bytes
        # NOTE: a view holds no workspace (the simulator)
        ws = [0 if is_view_node(graph, n.id, self.t.fresh) else c.workspace_bytes
              for c, n in zip(costs, graph.nodes)]
        self.workspace = np.array(ws, dtype=np.int64)
        # NOTE: a recomputed random node also holds a copy of the generator state (simulator)
        self.re_workspace = np.array([max(w, rng) if n.random else w
                                      for w, n in zip(ws, graph.nodes)], dtype=np.int64)
        self.nbytes = np.array([s.nbytes for s in graph.storages], dtype=np.int64)
        self.storage_of = [v.storage for v in graph.values]
        self.producer = [v.producer for v in graph.values]
        self.inputs = [n.inputs for n in graph.nodes]
        self.outputs = [tuple(o for o in n.outputs if o is not None) for n in graph.nodes]
        self.inputs_st = tuple(sorted(set(graph.input_storages())))
        self.resident = int(self.nbytes[list(self.inputs_st)].sum())
        self.maker = [-1] * len(graph.storages)
        for nid, ss in self.t.fresh.items():
            for st in ss:
                self.maker[st] = nid
        self.float_sums = int(self.nbytes.sum()) < _EXACT_FLOAT_BYTES
        self.nbytes_f = self.nbytes.astype(np.float64)


class RematEvaluator:
    """Evaluates drop sets for one graph, cost model and node order (default: captured)."""

    def __init__(self, graph: Graph, cost_model: CostModel, order: list[int] | None = None, *,
                 tables: RematTables | None = None, _shared: _GraphTables | None = None) -> None:
        G = _shared or _GraphTables(graph, cost_model, tables)
        self.G, self.graph, self.cost_model = G, graph, cost_model
        order = [n.id for n in graph.nodes] if order is None else list(order)
        self.order = order
        self.order_arr = np.array(order, dtype=np.int64)
        n, S = len(order), len(graph.storages)
        pos = [0] * n
        for p, nid in enumerate(order):
            pos[nid] = p
        # NOTE: where each storage is released if dropped (``drop_points``: one boundary in a
        # captured step, one per part in a step split along its batch)
        self.bound = bound = drop_points(graph, order, G.t.fresh)
        # storage lifetimes in positions: allocated at prod, last used at last (before its
        # boundary: last_fwd); -1 where never
        prod, last, last_fwd = [-1] * S, [-1] * S, [-1] * S
        self.back_readers: dict[int, list[int]] = {}
        fwd_readers: dict[int, list[int]] = {}
        fresh = G.t.fresh
        for p, nid in enumerate(order):
            for s in fresh[nid]:
                prod[s] = p
            for v in (*G.inputs[nid], *G.outputs[nid]):
                s = G.storage_of[v]
                last[s] = p
                if p < bound[s]:
                    last_fwd[s] = p
            for v in G.inputs[nid]:
                if p >= bound[G.storage_of[v]]:
                    self.back_readers.setdefault(v, []).append(p)
                else:
                    fwd_readers.setdefault(v, []).append(nid)
        self.prod, self.last = prod, last
        # a value made unavailable by dropping a node: in its storage, made before its boundary
        self.owner = [G.maker[G.storage_of[v]] if G.producer[v] is not None
                      and pos[G.producer[v]] < bound[G.storage_of[v]] else None
                      for v in range(len(graph.values))]
        for v, o in enumerate(self.owner):
            if o is not None and o < 0:
                self.owner[v] = None
        self.dropped_storages = {d: [s for s in fresh[d] if prod[s] < bound[s]]
                                 for d in range(n)}
        self.unavail_of = {d: [v for s in self.dropped_storages[d] for v in G.t.members[s]
                               if self.owner[v] is not None] for d in range(n)}
        # NOTE: dropped nodes whose recomputes may read each other's values (see _region)
        self.neighbours: dict[int, set[int]] = {}
        for d in range(n):
            near: set[int] = set()
            for v in self.unavail_of[d]:
                near.update(self.owner[u] for u in G.inputs[G.producer[v]])
                for r in fwd_readers.get(v, ()):
                    near.update(self.owner[w] for w in G.outputs[r])
            near.discard(None)
            near.discard(d)
            if near:
                self.neighbours[d] = near
        produced = [s for s in range(S) if prod[s] >= 0]
        self.produced = np.array(produced, dtype=np.int64)
        self.row_of = np.full(S, -1, dtype=np.int64)
        self.row_of[self.produced] = np.arange(len(produced))
        self.base_prod = np.array([prod[s] for s in produced], dtype=np.int64)
        self.base_end = np.array([n - 1 if s in G.t.keep else last[s] for s in produced],
                                 dtype=np.int64)
        self.positions = np.arange(n, dtype=np.int64)
        self._memo: OrderedDict[frozenset[int], RematEval | RematError] = OrderedDict()
        self.last_arr = np.array(last, dtype=np.int64)
        self.last_fwd_arr = np.array(last_fwd, dtype=np.int64)
        self.bound_arr = np.array(bound, dtype=np.int64)
        self.max_bound = int(self.bound_arr.max(initial=0))
        self.walk = walk_tables(self)
        self.part_cache: OrderedDict = OrderedDict()   # NOTE: see recompute_parts.PART_CACHE
        self.group_cache: OrderedDict = OrderedDict()  # region -> its parts' dropped nodes

    def reordered(self, order: list[int]) -> RematEvaluator:
        """An evaluator for the same graph and costs under another node order."""
        return RematEvaluator(self.graph, self.cost_model, order, _shared=self.G)

    def evaluate(self, drop: Iterable[int], base: RematEval | None = None) -> RematEval:
        """Peak, latency and storages live at the peak of ``remat_plan(graph, drop, order)``;
        RematError where ``remat_plan`` would raise it. ``base``, an earlier result of this
        evaluator, makes it incremental: only the parts of the drop set that differ are walked.
        The answer is a function of the drop set alone: a set asked again (``MEMO_SETS`` kept)
        is answered from memory, with or without ``base``."""
        key = drop if isinstance(drop, frozenset) else frozenset(drop)
        hit = self._memo.get(key)
        if hit is not None:
            self._memo.move_to_end(key)
            if isinstance(hit, RematError):
                raise RematError(*hit.args)
            return hit
        try:
            out = self._evaluate(key, base)
        except RematError as e:
            self._remember(key, e)
            raise
        self._remember(key, out)
        return out

    def _remember(self, key: frozenset[int], answer) -> None:
        self._memo[key] = answer
        if len(self._memo) > MEMO_SETS:
            self._memo.popitem(last=False)

    def _evaluate(self, drop: frozenset[int], base: RematEval | None) -> RematEval:
        nodes, once = split_drop(self.graph, drop)
        once = frozenset(complete_drop(self.graph, once, self.G.t))
        if base is None:
            drop = frozenset(complete_drop(self.graph, nodes, self.G.t))
            parts: dict[int, Part] = {}
            changed, kept = set(drop), ()
        else:
            if base.evaluator is not self:
                raise ValueError("base comes from another evaluator")
            drop, changed = self._complete_from(frozenset(nodes), base)
            changed |= once ^ base.once
            parts, kept = dict(base.parts), base.part_list
        stale = self._stale(changed, parts)
        gone = {parts[d] for d in stale if d in parts}
        for d in stale:
            parts.pop(d, None)
        new = walk_parts(self, stale & drop, drop, once)
        for part in new:
            for d in part.dropped:
                parts[d] = part
        part_list = (*(p for p in kept if p not in gone), *new)
        return self._assemble(drop, once, parts, part_list)

    def _complete_from(self, drop: frozenset[int], base: RematEval) -> tuple[frozenset, set]:
        """``complete_drop`` of ``drop`` knowing that of ``base.drop``, and the nodes that
        changed."""
        t = self.G.t
        added, removed = drop - base.nodes, base.nodes - drop
        new = set(added)
        for x in removed:  # NOTE: a chain member left in the drop set pulls its chain back
            chain = t.chain_of.get(x, ())
            if any(m in drop for m in chain):
                new.update(chain)
        todo = list(new)
        while todo:
            for m in t.chain_of.get(todo.pop(), ()):
                if m not in drop and m not in new:
                    new.add(m)
                    todo.append(m)
        drop = drop | new
        bad = sorted(nid for nid in drop - base.nodes if t.allowed[nid])
        if bad:
            complete_drop(self.graph, bad, t)  # NOTE: raises the RematError
        return drop, set(drop - base.nodes) | set(base.nodes - drop)

    def _stale(self, changed: set[int], parts: dict[int, Part]) -> set[int]:
        """The nodes to re-walk (those still dropped): the changed ones, and every part that a
        changed node belongs to or whose recomputes may read (or be read by) a changed node."""
        stale = set(changed)
        for d in changed:
            hit = [parts[d]] if d in parts else []
            hit += [parts[o] for o in self.neighbours.get(d, ()) if o in parts]
            for part in hit:
                stale.update(part.dropped)
        return stale

    def _assemble(self, drop: frozenset[int], once: frozenset[int], parts: dict[int, Part],
                  part_list: tuple[Part, ...]) -> RematEval:
        pk = Packed.of(part_list)
        G, n, R = self.G, len(self.order), len(pk.nodes)
        E = n + R
        perm = pk.key.argsort(kind="stable")
        keys, q_sorted, rec_sorted = pk.key[perm], pk.q[perm], pk.nodes[perm]
        ridx = q_sorted + np.arange(R)  # NOTE: event index = position + recomputes before it
        touch_g = ridx[keys.searchsorted(pk.t_key)]
        drop_st = pk.d_st
        again = pk.d_key >= 0
        drop_g = np.full(len(drop_st), -1, dtype=np.int64)
        if R:
            drop_g[again] = ridx[keys.searchsorted(pk.d_key[again])]
        cidx = self.positions + np.bincount(q_sorted, minlength=n).cumsum()
        prod_e = cidx[self.base_prod]
        # NOTE: a kept storage lives to the last event, the last position's (no recompute
        # follows it): base_end holds n - 1 for those
        end_e = cidx[self.base_end]
        # NOTE: a dropped storage's first lifetime ends at its last use in the forward
        end_e[self.row_of[drop_st]] = cidx[self.last_fwd_arr[drop_st]]
        is_dropped = np.zeros(len(G.nbytes), dtype=bool)
        is_dropped[drop_st] = True
        t_rows = self.row_of[pk.t_st]
        made_here = t_rows >= 0
        t_dropped = is_dropped[pk.t_st]
        plain = ~t_dropped & made_here
        np.maximum.at(end_e, t_rows[plain], touch_g[plain])
        # NOTE: a recompute before a dropped storage's release (``drop_points``: parts released
        # apart) reads it in its first lifetime; the release is an event index: its position
        # plus the recomputes placed before it. None can where every recompute comes after
        # every release (a captured step): its event index is at least its position
        if R and q_sorted[0] < self.max_bound:
            bound_t = self.bound_arr[pk.t_st]
            early = t_dropped & made_here & (
                touch_g < bound_t + q_sorted.searchsorted(bound_t, side="left"))
            np.maximum.at(end_e, t_rows[early], touch_g[early])
        st2, prod2 = drop_st[again], drop_g[again]
        last2 = self.last_arr[st2]
        end2 = np.maximum(prod2, np.where(last2 >= self.bound_arr[st2], cidx[last2], -1))
        if len(st2):
            reach = np.full(len(G.nbytes), -1, dtype=np.int64)
            np.maximum.at(reach, pk.t_st[~plain], touch_g[~plain])
            end2 = np.maximum(end2, reach[st2])
        # NOTE: per-use storages' short lifetimes: re-created to feed recomputes, then freed
        c_prod = ridx[np.searchsorted(keys, pk.c_start)]
        c_end = ridx[np.searchsorted(keys, pk.c_end)]
        st = np.concatenate([self.produced, st2, pk.c_st])
        prod_all = np.concatenate([prod_e, prod2, c_prod])
        end_all = np.concatenate([end_e, end2, c_end])
        level = _live_bytes(prod_all, end_all, st, G, E)
        events = np.empty(E, dtype=np.int64)
        events[cidx] = self.order_arr
        events[ridx] = rec_sorted
        ws = G.workspace[events]
        ws[ridx] = G.re_workspace[rec_sorted]
        high = level + ws
        e_peak = int(np.argmax(high))
        peak = G.resident + int(high[e_peak])
        latency = float(np.cumsum(G.seconds[events])[-1])
        live = np.zeros(len(G.nbytes), dtype=bool)
        if peak > G.resident:
            live[st[(prod_all <= e_peak) & (end_all >= e_peak)]] = True
        else:
            peak = G.resident
        made = np.flatnonzero(live)
        coded = drop | {per_use(self.graph, nid) for nid in once}
        return RematEval(coded, peak, latency, made, R, G.inputs_st, parts, part_list, self, drop,
                         once)


def _live_bytes(prod: np.ndarray, end: np.ndarray, st: np.ndarray, G: _GraphTables,
                n_events: int) -> np.ndarray:
    """Bytes of the lifetimes [prod, end] of storages ``st`` that cover each event: float64
    holding integers exactly, or int64 where the graph's bytes could exceed that."""
    if G.float_sums:  # NOTE: bincount is the fast path; exact while the sums stay below 2**52
        w = G.nbytes_f[st]
        diff = (np.bincount(prod, weights=w, minlength=n_events + 1)
                - np.bincount(end + 1, weights=w, minlength=n_events + 1))
        # NOTE: partial sums of integers below 2**52 are exact: no rounding back to int64
        return diff[:n_events].cumsum()
    nbytes = G.nbytes[st]
    diff = np.zeros(n_events + 1, dtype=np.int64)
    np.add.at(diff, prod, nbytes)
    np.add.at(diff, end + 1, -nbytes)
    return np.cumsum(diff[:n_events])
