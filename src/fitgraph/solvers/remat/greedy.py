"""The ``hotspot`` search steps over one node order: grow a drop set greedily, then prune it.

``grow``: evaluate the drop set, look at the storages live at the peak, try the move that frees
the most of them per second of recompute (``Moves.best``); keep it only if the peak went down
(and the step stays within the latency limit), else ban it; stop when the budget holds, no move
is left, or the deadline passes. ``prune`` walks it back: the greedy adds moves until the budget
holds, so a move taken early (or a whole block of the checkpoint-everything start) may no longer
be needed; each is removed, most recompute time first, when the budget still holds without it.

Both are deterministic functions of their inputs and an evaluation count; only the deadline can
cut them short (``Search.timed_out`` says so), which is the one way timing changes a result.

Example:
    >>> from fitgraph.solvers.remat.greedy import Search
    >>> Search(budget_bytes=100, limit_s=float("inf"), deadline=0.0).fits_peak(99)
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ...plan.remat import RematError
from ...sim.remat_eval import RematEval, RematEvaluator
from .moves import Moves

__all__ = ["MIN_BATCH", "Run", "Search", "local_evals", "lookahead"]

# NOTE: copies of one move (same ops, same sizes, e.g. in each layer) that tie are tried
# together from this many on: ~10x fewer evaluations on 64-250-layer models, where it gave the
# results of one move per evaluation; below it (the zoo's small models, BERT-base), one at a
# time, which can be better: the peak moves, and the next best move is no longer a copy
MIN_BATCH = 32
# NOTE: members of a tied group that cannot be undropped, in a row, before the rest is given up
SKIPS = 3
# NOTE: evaluations a local search step (exchange, add_prune) may spend: up to
# LOCAL_NODE_EVALS / (graph nodes), at most LOCAL_MAX_EVALS — an evaluation costs about O(nodes),
# so this bounds the added planning time (~1 s on BERT-base paper) whatever the graph size
LOCAL_MAX_EVALS = 4000
LOCAL_NODE_EVALS = 400_000


# NOTE: grow evaluates this many best-scoring moves per step on graphs of up to
# LOOKAHEAD_MAX_NODES nodes (on the ILP's block stacks: 0.091 -> 0.065 summed excess over the
# ILP's best; 16 or 32 did worse), one above (BERT-base paper: +40% planning time at 8)
LOOKAHEAD = 8
LOOKAHEAD_MAX_NODES = 5000
# NOTE: the least latency a move is charged when comparing peak bytes lowered per second added
MIN_ADDED_S = 1e-12


def lookahead(nodes: int) -> int:
    """How many best-scoring moves grow evaluates per step on a graph of ``nodes`` nodes."""
    return LOOKAHEAD if nodes <= LOOKAHEAD_MAX_NODES else 1


def local_evals(nodes: int) -> int:
    """The evaluation budget of one local search step on a graph of ``nodes`` nodes."""
    return max(1, min(LOCAL_MAX_EVALS, LOCAL_NODE_EVALS // max(nodes, 1)))


@dataclass
class Run:
    """One search result: the evaluation of a drop set under an evaluator's order."""

    result: RematEval
    ev: RematEvaluator
    label: str
    added: list[frozenset[int]] = field(default_factory=list)   # nodes each accepted move added
    own_only: bool = False    # how moves are scored: see Moves.best
    pairs: bool = False       # when stuck, try two moves at once: see Search._pair
    per_use: bool = False     # when stuck, try dropping per use (Moves.per_use)
    banned: np.ndarray | None = None   # moves grow starts with banned (a fork's)
    stuck: tuple | None = None         # (result, added, banned) where grow first got stuck


@dataclass
class Search:
    budget_bytes: int | None
    limit_s: float
    deadline: float
    evaluations: int = 0
    timed_out: bool = False
    pair_evals: int = 0     # evaluations one stuck greedy step may spend on pairs of moves
    look: int = 1           # best-scoring moves grow evaluates per step

    def fits_peak(self, peak: int) -> bool:
        return self.budget_bytes is not None and peak <= self.budget_bytes

    def out_of_time(self) -> bool:
        if time.perf_counter() >= self.deadline:
            self.timed_out = True
        return self.timed_out

    def evaluate(self, ev: RematEvaluator, drop, base: RematEval | None = None
                 ) -> RematEval | None:
        self.evaluations += 1
        try:
            return ev.evaluate(drop, base)
        except RematError:  # NOTE: e.g. a view whose producer also allocates: not re-creatable
            return None

    def better(self, a: RematEval, b: RematEval) -> bool:
        """Within the target first; then least latency (budget mode) or least peak."""
        if self.budget_bytes is not None:
            fa, fb = self.fits_peak(a.peak_bytes), self.fits_peak(b.peak_bytes)
            if fa != fb:
                return fa
            if fa:
                return (a.latency_s, a.peak_bytes) < (b.latency_s, b.peak_bytes)
            return (a.peak_bytes, a.latency_s) < (b.peak_bytes, b.latency_s)
        fa, fb = a.latency_s <= self.limit_s, b.latency_s <= self.limit_s
        if fa != fb:
            return fa
        return (a.peak_bytes, a.latency_s) < (b.peak_bytes, b.latency_s)

    def grow(self, run: Run, moves: Moves, ban: frozenset[int] = frozenset()) -> Run:
        """Add the best move until the budget holds, no move lowers the peak, or time's up.
        Moves with a node in ``ban`` are never taken. With ``look`` > 1 the ``look``
        best-scoring moves are evaluated and the one lowering the peak most per second added
        is taken (the score counts bytes freed as if the peak stayed where it is; it often
        moves). Where it first gets stuck (no single move lowers the peak), a run that may not
        drop per use leaves its state in ``run.stuck``, for a run that may to go on from."""
        cur, ev = run.result, run.ev
        forbidden = np.array([bool(nodes & ban) for nodes in moves.nodes], dtype=bool)
        banned = forbidden | run.banned if run.banned is not None else forbidden.copy()
        dropped = np.zeros(len(moves.candidate), dtype=bool)
        dropped[sorted(cur.drop)] = True
        while not self.fits_peak(cur.peak_bytes) and not self.out_of_time():
            hot = moves.hot_nodes(cur.peak_made)
            # NOTE: dropping per use only where dropping once cannot lower the peak: it is a
            # finer cut (one value held between recomputes far apart), not a first choice
            mask = banned | moves.per_use
            ties = moves.best(hot, dropped, mask, run.own_only)
            if not ties and run.per_use:
                mask = banned
                ties = moves.best(hot, dropped, mask, run.own_only)
            if not ties:
                if run.stuck is None and not run.per_use:
                    run.stuck = (cur, list(run.added), banned.copy())
                pair = (self._pair(ev, cur, moves, forbidden | (moves.per_use & ~run.per_use),
                                   dropped) if run.pairs else None)
                if pair is None:
                    break
                run.added.append(pair.drop - cur.drop)
                cur = pair
                dropped[sorted(cur.drop)] = True
                banned = forbidden.copy()  # NOTE: the peak moved: what it banned may help now
                continue
            # NOTE: tied moves (one per layer) go in together, the smallest prefix that fits,
            # instead of one evaluation each: what makes 250-layer graphs fast
            alike = _disjoint([moves.nodes[k] for k in ties if moves.shape[k] == moves.shape[ties[0]]])
            took = self._together(ev, cur, alike) if len(alike) >= MIN_BATCH else None
            if took is not None:
                trial, m = took
                run.added.extend(u - cur.drop for u in alike[:m])
                cur = trial
                dropped[sorted(cur.drop)] = True
                continue
            got = []
            for k in moves.ranked(hot, dropped, mask, run.own_only, self.look):
                trial = self.evaluate(ev, cur.drop | moves.nodes[k], cur)
                if self._lowers(trial, cur):
                    got.append(trial)
                else:
                    banned[k] = True
            if got:
                trial = max(got, key=lambda r: (cur.peak_bytes - r.peak_bytes)
                            / max(r.latency_s - cur.latency_s, MIN_ADDED_S))
                run.added.append(trial.drop - cur.drop)
                cur = trial
                dropped[sorted(cur.drop)] = True
        run.result = cur
        return run

    def _pair(self, ev: RematEvaluator, cur: RematEval, moves: Moves, forbidden: np.ndarray,
              dropped: np.ndarray) -> RematEval | None:
        """When no single move lowers the peak: the two moves that lower it most together
        (least latency among equals). The peak often has a twin as high elsewhere (block 2's
        attention backward beside block 3's) that one move cannot lower without the other.
        Pairs: neither move raises the peak alone, one frees a storage live at it; tried in
        order of the recompute seconds they add, within ``pair_evals`` evaluations (with the
        single moves' own). None if no pair tried lowers the peak."""
        stop = self.evaluations + self.pair_evals
        hot = moves.hot_nodes(cur.peak_made) & ~dropped
        level, is_hot = [], []
        for k, nodes in enumerate(moves.nodes):
            if forbidden[k] or not nodes - cur.drop:
                continue
            if self.evaluations >= stop or self.out_of_time():
                return None
            r = self.evaluate(ev, cur.drop | nodes, cur)
            if r is not None and r.peak_bytes <= cur.peak_bytes and r.latency_s <= self.limit_s:
                level.append(k)
                is_hot.append(bool(hot[sorted(nodes)].any()))
        secs = {k: float(moves.seconds[sorted(moves.nodes[k] - cur.drop)].sum()) for k in level}
        pairs = sorted((secs[a] + secs[b], a, b) for i, a in enumerate(level)
                       for j, b in enumerate(level) if i < j and (is_hot[i] or is_hot[j]))
        found = []
        for _, a, b in pairs:
            if self.evaluations >= stop or self.out_of_time():
                break
            r = self.evaluate(ev, cur.drop | moves.nodes[a] | moves.nodes[b], cur)
            if self._lowers(r, cur):
                found.append(r)
        return min(found, key=lambda r: (r.peak_bytes, r.latency_s), default=None)

    def _lowers(self, trial: RematEval | None, cur: RematEval) -> bool:
        return (trial is not None and trial.peak_bytes < cur.peak_bytes
                and trial.latency_s <= self.limit_s)

    def _together(self, ev: RematEvaluator, cur: RematEval, groups: list[frozenset[int]]
                  ) -> tuple[RematEval, int] | None:
        """Drop ``groups`` together if that lowers the peak: the shortest prefix that fits the
        budget, or else that reaches the peak of all of them (bisection: once the peak moves
        elsewhere, more of the same stops helping). (result, prefix length) or None."""
        def upto(m: int) -> RematEval | None:
            return self.evaluate(ev, cur.drop.union(*groups[:m]), cur)

        full = upto(len(groups))
        if not self._lowers(full, cur):
            return None
        target = self.budget_bytes if self.fits_peak(full.peak_bytes) else full.peak_bytes
        lo, hi, best = 0, len(groups), full
        while hi - lo > 1 and not self.out_of_time():
            mid = (lo + hi) // 2
            r = upto(mid)
            if self._lowers(r, cur) and r.peak_bytes <= target:
                hi, best = mid, r
            else:
                lo = mid
        return best, hi

    def prune(self, run: Run, units: list[frozenset[int]], moves: Moves,
              keep: frozenset[int] = frozenset()) -> Run:
        """Undrop units (most recompute seconds first) while the budget holds (latency mode:
        while the peak does not rise); units that touch ``keep`` stay dropped. Many units that
        tie (the same block in each layer) are undropped together: the longest prefix that
        keeps the budget (bisection), none if the first alone does not."""
        cur = run.result
        if self.budget_bytes is None:
            # NOTE: latency mode: a move the descent took while the peak was elsewhere can hold
            # more than it frees later (OPT: a dropped fc2 output kept its 1 MiB input, written
            # in place in parts and so not droppable, alive to the backward; undropped, the
            # least peak fell 1.4%)
            if cur.latency_s > self.limit_s:
                return run
        elif not self.fits_peak(cur.peak_bytes):
            return run
        # NOTE: then each dropped node alone: a move dropped a chain (attention's output
        # projection with its dropout and residual) of which only part may still be needed
        seen = set(units)
        units = [u for u in [*units, *(u for u in (frozenset({n}) for n in sorted(cur.drop))
                                       if u not in seen)] if not u & keep]
        sig = [(float(moves.seconds[sorted(u)].sum()), int(moves.node_bytes[sorted(u)].sum()))
               for u in units]
        members: dict[tuple, list[frozenset[int]]] = {}
        for u, key in zip(units, sig):
            members.setdefault(key, []).append(u)
        done: set[tuple] = set()
        for i in sorted(range(len(units)), key=lambda i: (-sig[i][0], i)):
            if self.out_of_time():
                break
            group = members[sig[i]]
            if len(group) < MIN_BATCH:
                if units[i] & cur.drop:
                    cur = self._without(run.ev, cur, [units[i]]) or cur
            elif sig[i] not in done:
                done.add(sig[i])
                cur = self._prefix_without(run.ev, cur, [u for u in group if u & cur.drop])
        run.result = cur
        return run

    def exchange(self, run: Run, moves: Moves, max_evals: int) -> Run:
        """Local search after grow and prune: take one dropped unit back (most
        recompute seconds first), forbid the moves that would drop it again, grow and prune;
        keep the result when it is faster within the budget; repeat until a pass finds nothing
        (or ``max_evals`` evaluations are spent). The greedy is myopic — a move
        taken early can block a cheaper combination found later (on BERT's block, recomputing
        the whole attention where the MLP's up-projection and one dropout mask would do).
        NOTE: bounded by an evaluation count, not the clock, so the plan stays a function of
        the inputs."""
        if self.budget_bytes is None or not self.fits_peak(run.result.peak_bytes):
            return run
        stop = self.evaluations + max_evals
        tried: set[frozenset[int]] = set()
        while self.evaluations < stop and not self.out_of_time():
            before = run.result
            run = self._exchange_pass(run, moves, stop, tried)
            if run.result is before:
                break
        return run

    def _exchange_pass(self, run: Run, moves: Moves, stop: int, tried: set) -> Run:
        units = _disjoint([u for u in run.added if u & run.result.drop] +
                          [b for b in moves.blocks if b & run.result.drop])
        units.sort(key=lambda u: (-float(moves.seconds[sorted(u)].sum()), min(u)))
        for u in units:
            if self.evaluations >= stop or self.out_of_time():
                break
            cur = run.result
            back = u & cur.drop
            if not back or back in tried:
                continue
            tried.add(back)
            base = self.evaluate(run.ev, cur.drop - back, cur)
            if base is None:
                continue
            trial = Run(base, run.ev, run.label, [a - back for a in run.added if a - back],
                        run.own_only, per_use=run.per_use)
            trial = self.prune(self.grow(trial, moves, ban=back), moves.blocks + trial.added,
                               moves)
            if self._faster_within(trial.result, cur):
                run = trial
                tried.clear()
        return run

    def add_prune(self, run: Run, moves: Moves, max_evals: int) -> Run:
        """Local search by "add one move, then prune": drop one more single move (least
        recompute seconds first) and undrop whatever the budget no longer needs; take the
        first that is faster and start over, until none is or ``max_evals`` are spent. It
        reaches what one-at-a-time greed bans for good: a move that did not lower the peak
        when tried (the peak was elsewhere) but makes several earlier moves unnecessary."""
        if self.budget_bytes is None or not self.fits_peak(run.result.peak_bytes):
            return run
        stop = self.evaluations + max_evals
        singles = [k for k, key in enumerate(moves.keys)
                   if key[0] == 0 and (run.per_use or not moves.per_use[k])]
        cost = {k: float(moves.seconds[sorted(moves.nodes[k])].sum())
                   / max(float(moves.node_bytes[sorted(moves.nodes[k])].sum()), 1.0)
                for k in singles}
        tried: set[frozenset[int]] = set()
        improved = True
        while improved and self.evaluations < stop and not self.out_of_time():
            improved = False
            cur = run.result
            for k in sorted(singles, key=lambda k: (cost[k], k)):
                if self.evaluations >= stop or self.out_of_time():
                    return run
                drop = cur.drop | moves.nodes[k]
                if drop == cur.drop or drop in tried:
                    continue
                tried.add(drop)
                r = self.evaluate(run.ev, drop, cur)
                if r is None:
                    continue
                trial = Run(r, run.ev, run.label, [*run.added, r.drop - cur.drop], run.own_only,
                            per_use=run.per_use)
                # NOTE: the move just added stays: undropping it first would only undo it
                trial = self.prune(trial, moves.blocks + trial.added, moves,
                                   keep=r.drop - cur.drop)
                if self._faster_within(trial.result, cur):
                    run, improved = trial, True
                    break
        return run

    def _faster_within(self, r: RematEval, cur: RematEval) -> bool:
        """``r`` fits the budget and is faster than ``cur`` (or as fast, lower)."""
        return self.fits_peak(r.peak_bytes) and (r.latency_s, r.peak_bytes) < (
            cur.latency_s, cur.peak_bytes)

    def _prefix_without(self, ev: RematEvaluator, cur: RematEval,
                        group: list[frozenset[int]]) -> RematEval:
        """``cur`` with ``group`` undropped by longest prefixes that keep the budget
        (bisection), skipping a member that cannot go, until SKIPS members in a row cannot."""
        misses = 0
        while group and misses < SKIPS and not self.out_of_time():
            first = self._without(ev, cur, group[:1])
            if first is None:
                group, misses = group[1:], misses + 1
                continue
            misses = 0
            lo, hi, best = 1, len(group), first   # NOTE: lo can go; beyond hi cannot
            m = hi   # NOTE: the whole group first: often all of it can go
            while hi > lo and not self.out_of_time():
                r = self._without(ev, cur, group[:m])
                if r is not None:
                    lo, best = m, r
                else:
                    hi = m - 1
                m = (lo + hi + 1) // 2
            cur, group = best, group[lo:]
        return cur

    def _without(self, ev: RematEvaluator, cur: RematEval, units: list[frozenset[int]]
                 ) -> RematEval | None:
        """``cur`` with ``units`` undropped, if the budget still holds (latency mode: the peak
        does not rise) and it is no slower."""
        r = self.evaluate(ev, cur.drop.difference(*units), cur)
        cap = cur.peak_bytes if self.budget_bytes is None else self.budget_bytes
        if r is not None and r.peak_bytes <= cap and r.latency_s <= cur.latency_s:
            return r
        return None


def _disjoint(groups: list[frozenset[int]]) -> list[frozenset[int]]:
    """The groups, in order, that share no node with an earlier one (copies of one move in
    different layers are disjoint)."""
    used: set[int] = set()
    out = []
    for u in groups:
        if not u & used:
            out.append(u)
            used |= u
    return out
