"""``hotspot``: the production solver — greedy rematerialization of what is live at the simulated
peak, with memory-aware reordering, judged by the simulator at every step.

MAGIS's insight, without its GPU-in-the-loop ranking: simulate, look at the storages live at the
peak, drop (and recompute in the backward) what frees the most bytes per second of recompute,
simulate again; keep a drop only if the peak went down. Moves (``solvers.remat.moves``) are single
candidates with their forward-only chains (dropping ``mul(gelu(x), mask)`` alone would keep
``gelu(x)`` alive for the recompute) and whole blocks (``h.3``: what ``torch.utils.checkpoint``
drops), which stop the recompute cascade at block outputs that single drops cannot find one at
a time. Every candidate is judged by the simulator — through ``sim.remat_eval``, which gives the
simulator's exact answer for a drop set without building the plan — so a drop that would raise
the peak (a recompute keeps its inputs alive into the backward) is rejected rather than trusted.

The search, in budget mode (least latency within ``budget_bytes``):

1. two starts in the captured order — nothing dropped, and every block checkpointed (single
   moves cannot always undo a recompute cascade) — each grown greedily until the budget holds
   (where no single move lowers the peak, a pair of moves may: ``Search._pair``), once with
   nodes dropped once only and once allowing drops per use where nothing else lowers the peak
   (``plan.remat.per_use``: a value re-made only to feed other recomputes is freed and made
   again later, as Checkmate's schedules do), then pruned (moves no longer needed are
   undropped, most recompute time first); the best of each kind is improved by local search
   (``Search.exchange``: take a move back and regrow without it; ``Search.add_prune``: add one
   move and prune what it makes unnecessary), within an evaluation budget that shrinks with
   the graph's size;
2. joint reordering: the best drop set is re-planned over memory-aware orders that know what is
   dropped (``plan.reorder``, e.g. a backward node that frees a recomputed activation runs
   before one that allocates); each is grown and pruned again and kept if the simulator says it
   is better (fewer recomputes at the same budget, or a budget the captured order cannot reach).

With a ``latency_limit`` it keeps lowering the peak while the simulated step stays within the
limit (a descent, given half the time), then runs the budget-mode search at lower budgets —
galloping down below the descent's peak, then bisecting — and keeps the least peak within the
limit (``_bisect_budgets``: the budget-mode search's pairs, exchange and pruning often reach
lower than the descent: BERT small on a generic CPU's roofline within 1.10x, 6.5% lower).
Deterministic: the result is a function of the inputs; the deadline (``time_budget_s``) only
cuts the search short, and then ``notes["timed_out"]`` is True — the one case where timing
changes the plan. Anytime: it returns the best plan found when time runs out.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.solvers import Problem, solve
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Ms(BaseCostModel):
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    ...     def copy_seconds(self, nbytes): return 0.0
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.PARAMETER)
    >>> a = b.add_node("aten.exp.default", [x], [((1024,), "float32")])[0]
    >>> y = b.add_node("aten.sum.default", [a], [((), "float32")])[0]
    >>> z = b.add_node("aten.expand.default", [y], [((1024,), "float32")],
    ...                phase=Phase.BACKWARD)[0]
    >>> w = b.add_node("aten.sum.default", [z], [((), "float32")], phase=Phase.BACKWARD)[0]
    >>> gx = b.add_node("aten.mul.Tensor", [w, a], [((4,), "float32")],
    ...                 phase=Phase.BACKWARD)[0]
    >>> g = b.finish({"loss": gx})
    >>> s = solve(Problem(g, Ms(), budget_bytes=5000), "hotspot")  # eager peaks at 8,212 B
    >>> s.sim.peak_bytes <= 5000, s.notes["dropped"]
    (True, 1)
"""

from __future__ import annotations

import dataclasses
import time

from ...plan.exact_order import exact_order
from ...plan.remat import remat_plan, remat_tables
from ...plan.reorder import STRATEGIES, memory_aware_order
from ...sim.remat_eval import RematEvaluator
from ...sim.simulate import simulate
from ..base import BudgetInfeasible, EvaluatorMismatch, Problem, Solution, dominated_by, register
from .greedy import Run, Search, local_evals, lookahead
from .moves import build_moves

__all__ = ["solve_hotspot"]

# NOTE: share of the time budget kept for building and simulating the final plan (O(n) Python)
FINAL_SHARE = 0.1


# NOTE: latency mode: at most this many budget-mode searches at lower budgets after the greedy
# descent (``_bisect_budgets``), and the share of the time budget the descent may use first
BISECT_STEPS = 6
DESCENT_SHARE = 0.5
GALLOP_FIRST = 0.02
BISECT_TOL = 0.01


@register("hotspot")
def solve_hotspot(problem: Problem, *, reorder: bool = True, per_use: bool = True,
                  exact: bool = False) -> Solution:
    """Plan ``problem`` (see the module doc); ``reorder=False`` keeps the captured order;
    ``per_use=False`` recomputes each node at most once (``fitgraph.backend`` needs that);
    ``exact=True`` re-plans the drop set over the exact scheduler's order too
    (``plan.exact_order``: seconds more on the zoo; the coordinated search asks for it)."""
    if problem.latency_limit is None:
        return _solve(problem, reorder, per_use, exact)
    t0 = time.perf_counter()
    sol = _solve(dataclasses.replace(problem, time_budget_s=DESCENT_SHARE
                                     * problem.time_budget_s), reorder, per_use, exact)
    return _bisect_budgets(problem, sol, t0, reorder, per_use, exact)


def _bisect_budgets(problem: Problem, sol: Solution, t0: float, reorder: bool,
                    per_use: bool, exact: bool) -> Solution:
    """Latency mode: lower budgets searched in budget mode below ``sol``'s peak — galloping
    down (``GALLOP_FIRST`` below it, then twice as far each time) until one is over the
    limit, then bisecting to ``BISECT_TOL`` — at most ``BISECT_STEPS`` searches; the least
    peak within the limit wins.

    NOTE: the latency-mode descent stops where no move lowers the peak within the limit, but
    the budget-mode search (two starts, pairs, exchange, pruning) at a lower budget often
    still fits it: GPT-2 small's graph with its loss split, within 1.10x, descent 0.408x of
    eager at 1.065x, budget mode 0.38x at 1.10x. Where the descent is already as low (one
    budget 2% lower is over the limit), this costs one search."""
    limit = problem.latency_limit * sol.notes["eager_latency_s"]
    best, tried, step = sol, 0, GALLOP_FIRST
    hi, lo = sol.sim.peak_bytes, None   # NOTE: lo: the highest budget found over the limit
    deadline = t0 + problem.time_budget_s
    while tried < BISECT_STEPS:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        if lo is None:
            mid = max(int(hi * (1 - step)), problem.graph.resident_bytes)
            step *= 2
        elif hi - lo > BISECT_TOL * hi:
            mid = (lo + hi) // 2
        else:
            break
        tried += 1
        try:
            cand = _solve(dataclasses.replace(problem, latency_limit=None, budget_bytes=mid,
                                              time_budget_s=left / (BISECT_STEPS - tried + 1)),
                          reorder, per_use, exact)
        except BudgetInfeasible:
            lo = mid
            continue
        if cand.sim.latency_s <= limit:
            best, hi = cand, cand.sim.peak_bytes
        else:
            lo = mid
    notes = dict(best.notes, bisected=tried, eager_latency_s=sol.notes["eager_latency_s"],
                 timed_out=bool(sol.notes.get("timed_out") or best.notes.get("timed_out")))
    return Solution(best.plan, best.sim, "hotspot", time.perf_counter() - t0, notes=notes)


def _solve(problem: Problem, reorder: bool, per_use: bool, exact: bool = False) -> Solution:
    """One search (see the module doc): budget mode, or latency mode's greedy descent."""
    t0 = time.perf_counter()
    g, cm = problem.graph, problem.cost_model
    tables = remat_tables(g)
    ev = RematEvaluator(g, cm, tables=tables)
    moves = build_moves(g, cm, tables)
    eager = ev.evaluate(())
    limit = (problem.latency_limit * eager.latency_s if problem.latency_limit is not None
             else float("inf"))
    search = Search(problem.budget_bytes, limit,
                    t0 + (1 - FINAL_SHARE) * problem.time_budget_s,
                    pair_evals=local_evals(len(g.nodes)), look=lookahead(len(g.nodes)))
    blocks = moves.blocks
    firsts = [(eager, "captured")]
    every = None
    if moves.every_block:
        every = search.evaluate(ev, moves.every_block)
        if every is not None:
            firsts.append((every, "captured, every block checkpointed"))
    if moves.every_inner_block and moves.every_inner_block != moves.every_block:
        inner = search.evaluate(ev, moves.every_inner_block)
        # NOTE: a start costs two grown runs: only where the inner level (Swin's layers in
        # its stages) checkpoints lower than the outer one
        if inner is not None and (every is None or inner.peak_bytes < every.peak_bytes):
            firsts.append((inner, "captured, every innermost block checkpointed"))
    starts = [Run(r, ev, label + (", own seconds" if own else ""), own_only=own, pairs=True)
              for r, label in firsts for own in (False, True)]
    best = None
    for run in starts:  # NOTE: the starts' own evaluations come first: anytime from here on
        if best is None or search.better(run.result, best.result):
            best = Run(run.result, run.ev, run.label, own_only=run.own_only)
    # NOTE: the best grown start of each kind (dropping once only, and per use too) gets the
    # local search: either can end ahead, and the ranking before it does not say which
    kinds: dict[bool, Run] = {}
    for run in starts:
        grown = [search.grow(run, moves)]
        if per_use and run.stuck is not None:  # NOTE: where dropping once got stuck, per use
            at, added, banned = run.stuck
            grown.append(search.grow(Run(at, ev, run.label + ", per use", added, run.own_only,
                                         pairs=True, per_use=True, banned=banned), moves))
        for done in grown:
            done = search.prune(done, blocks + done.added, moves)
            if done.per_use not in kinds or search.better(done.result,
                                                          kinds[done.per_use].result):
                kinds[done.per_use] = done
    local = local_evals(len(g.nodes))
    for pu in sorted(kinds):
        run = kinds[pu]
        if pu and False in kinds and run.result.drop == kinds[False].result.drop:
            continue
        if search.better(run.result, best.result):
            best = run
        run = search.add_prune(search.exchange(run, moves, local), moves, local)
        if search.better(run.result, best.result):
            best = run
    if reorder:
        best = _reorder(g, search, moves, blocks, best, exact)
    r = best.result
    plan = remat_plan(g, r.drop, best.ev.order, tables=tables)
    sim = simulate(g, plan, cm)
    if (sim.peak_bytes, sim.latency_s) != (r.peak_bytes, r.latency_s):
        raise EvaluatorMismatch(f"hotspot: the fast evaluator says peak {r.peak_bytes} latency "
                           f"{r.latency_s} but the simulator {sim.peak_bytes} {sim.latency_s}; "
                           "this is a bug in fitgraph.sim.remat_eval, please report it")
    plan.meta["solver"] = "hotspot"
    sol = Solution(plan, sim, "hotspot", time.perf_counter() - t0,
                   notes={"dropped": len(r.nodes), "per_use": len(r.once),
                          "recomputes": r.recomputes,
                          "evaluations": search.evaluations, "timed_out": search.timed_out,
                          "order": best.label, "eager_latency_s": eager.latency_s})
    if problem.budget_bytes is not None and sim.peak_bytes > problem.budget_bytes:
        err = BudgetInfeasible(problem.budget_bytes, sim.peak_bytes, dominated_by(sim), "hotspot")
        err.solution = sol  # NOTE: the plan at the peak reported (solvers.smallest)
        raise err
    return sol


def _reorder(g, search: Search, moves, blocks, best: Run, exact: bool) -> Run:
    """Re-plan the best drop set over memory-aware orders that know what it drops (with
    ``exact``, the exact scheduler's too); where that peaks no higher, grow and prune again;
    keep what the simulator says is better."""
    captured = best.ev.order
    for strategy in STRATEGIES + (("exact",) if exact else ()):
        if search.out_of_time():
            break
        order = (exact_order(g, best.result.drop) if strategy == "exact"
                 else memory_aware_order(g, strategy, best.result.drop))
        if order == captured:
            continue
        ev = best.ev.reordered(order)
        start = search.evaluate(ev, best.result.drop)
        if start is None or start.peak_bytes > best.result.peak_bytes:
            continue
        run = Run(start, ev, f"{best.label}; memory-aware order ({strategy}, drop-aware)",
                  list(best.added), best.own_only, pairs=True, per_use=best.per_use)
        run = search.prune(search.grow(run, moves), blocks + run.added, moves)
        if search.better(run.result, best.result):
            best = run
    return best
