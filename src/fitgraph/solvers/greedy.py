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
    >>> from fitgraph.solvers.greedy import Search
    >>> Search(budget_bytes=100, limit_s=float("inf"), deadline=0.0).fits_peak(99)
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..plan.remat import RematError
from ..sim.remat_eval import RematEval, RematEvaluator
from .moves import Moves

__all__ = ["Run", "Search"]


@dataclass
class Run:
    """One search result: the evaluation of a drop set under an evaluator's order."""

    result: RematEval
    ev: RematEvaluator
    label: str
    added: list[frozenset[int]] = field(default_factory=list)   # nodes each accepted move added


@dataclass
class Search:
    budget_bytes: int | None
    limit_s: float
    deadline: float
    evaluations: int = 0
    timed_out: bool = False

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

    def grow(self, run: Run, moves: Moves) -> Run:
        """Add the best move until the budget holds, no move lowers the peak, or time's up."""
        cur, ev = run.result, run.ev
        banned = np.zeros(len(moves.keys), dtype=bool)
        dropped = np.zeros(len(moves.candidate), dtype=bool)
        dropped[sorted(cur.drop)] = True
        while not self.fits_peak(cur.peak_bytes) and not self.out_of_time():
            k = moves.best(moves.hot_nodes(cur.peak_made), dropped, banned)
            if k is None:
                break
            trial = self.evaluate(ev, cur.drop | moves.nodes[k], cur)
            if (trial is not None and trial.peak_bytes < cur.peak_bytes
                    and trial.latency_s <= self.limit_s):
                run.added.append(trial.drop - cur.drop)
                cur = trial
                dropped[sorted(cur.drop)] = True
            else:
                banned[k] = True
        run.result = cur
        return run

    def prune(self, run: Run, units: list[frozenset[int]], moves: Moves) -> Run:
        """Undrop each unit (most recompute seconds first) whose removal keeps the budget."""
        cur = run.result
        if self.budget_bytes is None or not self.fits_peak(cur.peak_bytes):
            return run
        cost = [(-float(moves.seconds[sorted(u)].sum()), i) for i, u in enumerate(units)]
        for _, i in sorted(cost):
            if self.out_of_time():
                break
            if not units[i] & cur.drop:
                continue
            trial = self.evaluate(run.ev, cur.drop - units[i], cur)
            if (trial is not None and self.fits_peak(trial.peak_bytes)
                    and trial.latency_s <= cur.latency_s):
                cur = trial
        run.result = cur
        return run
