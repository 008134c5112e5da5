"""The coordinated search's choice confirmed by measurement: which of its candidates' plans to
keep where the cost model measures on this machine (``ProfiledCostModel.measured_ratio``).

The simulator adds up ops measured one by one; a split graph, a rewrite or another order
changes what it does not see (caches, the allocator, the interpreter between ops), so plans a
few percent apart by the simulator are timed, whole steps in paired rounds (more of them where
the median is within ``CLOSE`` of the ratio the choice turns on): in budget mode
against auto's plan (the fastest measured kept where it is ``MEASURED_MARGIN`` faster), in
latency mode against the eager plan (the lowest peak within the limit less ``STEP_MARGIN``
kept, one plan made again for the limit its measured step leaves where none is: ``RETRY``;
and where the plan kept — auto's own, where no candidate simulates a lower peak — measures
under that limit, its graph planned again for the looser limit its measured step leaves:
``SLACK``; where none measures within and auto's own plan measures over the limit too, the
lowest peak timed that measures no slower than auto's plan, paired against it, twice:
``NO_SLOWER``); the one chosen is timed again and kept only where that timing too says so (the
fastest of three timings is partly the luckiest). In budget mode, where auto's plan is kept, a
candidate within the budget ``HEADROOM_MIN`` lower in peak that simulates as fast is timed too,
and kept where it measures a point faster than auto's step, twice (``HEADROOM``: the same step
time in less memory).
A candidate is the search's (``coordinated._Candidate``: ``rank``, ``graph``, ``rules``,
``solution``, ``changes``); nothing here plans but through the search's ``plan_again``.

Example:
    >>> from fitgraph.solvers.search_timing import MEASURED, MEASURED_MARGIN
    >>> MEASURED, MEASURED_MARGIN
    (3, 0.03)
"""

from __future__ import annotations

from .. import progress
from ..plan.eager import eager_plan
from ..sim.simulate import simulate
from .base import STEP_MARGIN, Problem

__all__ = ["CALIBRATED", "CLOSE", "HEADROOM", "HEADROOM_MEASURED", "HEADROOM_MIN", "MEASURED",
           "MEASURED_MARGIN", "NO_SLOWER", "RETRY", "SLACK", "SLACK_MIN", "confirmed_choice",
           "measured_over_simulated", "measures"]

# NOTE: where the cost model measures: at most this many candidates' steps timed (those that
# simulate better than auto's plan, best first): the simulated order of steps a few % apart is
# not the measured one (GPT-2 small at 0.8 of its peak, its fastest candidate by the simulator
# measured 0.983x auto's step)
MEASURED = 3
# NOTE: budget mode: a timed candidate is kept where its step measures this much faster than
# auto's — more than the simulator's TIME_MARGIN: paired medians of two steps move by a few %
# from one run to the next here (ViT-B/16 small at 0.4 of its peak: a candidate timed 0.978x
# auto's step in the search, 1.033x in the bench's rounds after it)
MEASURED_MARGIN = 0.03
# NOTE: latency mode, where every candidate timed measured over the limit less the margin: the
# lowest peak's graph planned again for the limit its measured step leaves (its name on the
# path): the simulator under-reads a plan that spends the slack (GPT-2 small within 1.10x,
# three candidates at 0.36 of eager's peak measured 1.114-1.121x eager's step)
RETRY = "planned again for its measured step"
# NOTE: latency mode, where the plan kept (a candidate measured within the limit less the
# margin, or auto's plan where no candidate simulates a lower peak) measured at least SLACK_MIN
# under it: its graph planned again for the limit its measured step leaves, a looser one (its
# name on the path): the simulator over-reads some plans as it under-reads others (ResNet-50
# small within 1.10x: auto's plan simulated at the limit, measured 1.063x eager's step in the
# bench; Llama within 1.10x, 1.053x)
SLACK = "planned again for the slack it measured"
SLACK_MIN = 0.01
# NOTE: latency mode, where no plan measured within the limit less the margin (RETRY's
# included) and auto's own plan measures over it too: the lowest peak timed whose step
# measures no slower than auto's plan's (paired against it, twice) is kept — a lower peak in
# no more time, where no plan holds the limit (the simulator under-reads some graphs' plans by
# more than the margin: U-Net small within 1.10x, auto's plan and the search's three lowest
# peaks measured 1.21-1.23x eager's step, one of them 3% lower in peak than auto's). Only the
# lower peaks that simulate no more than HEADROOM_SLOWER slower than auto's plan, as HEADROOM's:
# two timings both a point lucky are not rare (Llama small within 1.05x: fission's loss in 32
# parts, simulated 5.5% slower, timed 0.9945x auto's step twice, 1.027x in the bench's 32 rounds)
NO_SLOWER = "a lower peak no slower than auto's plan, where none holds the limit"
# NOTE: budget mode, where no candidate measured faster than auto's plan: the lowest peaks
# HEADROOM_MIN or more under auto's plan's that simulate no more than HEADROOM_SLOWER slower
# (HEADROOM_TIMED at most) are timed against auto's step, and the first measured at most
# HEADROOM_MEASURED of it, twice, kept: a plan as fast that leaves room in the budget (ViT-B/16
# small at 0.4 of its peak: auto for its own step as a latency limit, 3.3% lower, timed 0.985x
# and 0.968x; Llama small at 0.6, fission in four parts 25% lower and simulated 1.3% faster
# measured 1-4% slower: not kept)
HEADROOM = "as fast in less memory"
HEADROOM_MIN = 0.03
HEADROOM_SLOWER = 0.01
HEADROOM_TIMED = 2
# NOTE: under 1: a lower peak costs a little time where it costs any, and the search's two
# timings may both miss it (BERT-base small at 0.8: fission's split of the loss, 4.2% lower,
# timed 0.998x and 0.978x auto's step in the search, 1.019x paired in the bench's 16 rounds)
HEADROOM_MEASURED = 0.99


# NOTE: a timing whose median is within this of the ratio a choice turns on (the margin's, or
# auto's step for HEADROOM) runs more paired rounds (``plan_timing.MAX_ROUNDS`` at most): the
# median of 7 rounds moves by a point or two here, and the same plan in two systems measured
# 0.897-1.055x itself in the bench's rounds (session 70)
CLOSE = 0.02


# NOTE: a split graph (fission's first splits, ``search_moves.SPLIT``) has its eager step
# timed against the captured graph's before it is planned, and the search scales its plans'
# simulated steps by what the simulator missed there (this key in the move's changes): on a
# graph split along the batch its ops run on other shapes, in other caches, and the simulator
# misses by more than the margins the search's choices turn on, either way and differently
# from one cost cache to the next (Llama small, 701 nodes grown from the loss in 4 parts: its
# eager step simulated 1.05x the captured graph's and measured 0.88x in one process; another
# process's plan on it simulated 6.6% faster than auto's and measured 3.3% slower). Without
# it a split that runs faster than simulated is never timed (budget mode: not a contender;
# latency mode: planned for a limit its measured step would leave far looser)
CALIBRATED = "measured_over_simulated"


def measured_over_simulated(problem: Problem, graph, eager_s: float) -> float:
    """``graph``'s eager step measured over what it simulates, on the footing of the captured
    graph's (``problem.graph``, whose eager step simulates ``eager_s``): its eager plan timed
    against the captured graph's in paired rounds (``CALIBRATED``); 1.0 where the cost model
    does not measure."""
    cm = problem.cost_model
    if not measures(cm):
        return 1.0
    cm.prepare(graph)
    plan = eager_plan(graph)
    own_s = simulate(graph, plan, cm).latency_s
    ratio = cm.measured_ratio(graph, plan, problem.graph, eager_plan(problem.graph))
    progress.note(f"search: a split graph's eager step measured {ratio:.3f}x the captured "
                  f"graph's, simulated {own_s / eager_s:.3f}x")
    return ratio * eager_s / own_s


def measures(cost_model) -> bool:
    """Whether ``cost_model`` times plans on this machine (``measured_ratio``): only then is a
    choice confirmed."""
    return hasattr(cost_model, "measured_ratio")


def confirmed_choice(problem: Problem, first, best, tried: list, plan_again=None,
                     limit_s: float | None = None) -> tuple:
    """Where the cost model measures on this machine (``measured_ratio``), the plan kept is one
    whose step was timed in paired rounds: of the candidates that simulate better than auto's
    plan (``first``; ``_contenders``, ``MEASURED`` at most), in budget mode the fastest
    measured, timed against auto's step, kept only where it measures ``MEASURED_MARGIN``
    faster (timed again: ``measured_over_auto`` is that second timing); in latency mode the
    lowest peak measured within the limit less ``STEP_MARGIN`` of the eager plan's step, timed
    lowest peak first — where none is, the lowest peak's graph planned again for the limit its
    measured step leaves (``RETRY``, ``limit_s`` the limit in seconds; ``plan_again(candidate,
    graph, target_s, changes, name)`` plans it, None where the search's deadline leaves no
    time), kept where it measures within (timed again, as in budget mode); else ``first``.
    In latency mode with ``plan_again``, the plan kept within the limit (``first`` too, timed
    where no candidate simulates a lower peak) and measured ``SLACK_MIN`` under it is planned
    again for the looser limit its measured step leaves (``SLACK``), that plan kept where its
    peak is lower and it measures within, twice; where no plan measured within and ``first``
    measures over the limit too, the lowest peak timed that simulates at most
    ``HEADROOM_SLOWER`` over ``first``'s step and measures no slower than it, paired, twice, is
    kept (``NO_SLOWER``, ``_no_slower``: its ratio to ``first`` in the notes under that name).
    In budget mode, where ``first`` is kept, the lowest peaks ``HEADROOM_MIN`` under its own
    that simulate as fast (``_roomier``) are timed against its step, the first measured
    ``HEADROOM_MEASURED`` of it, twice, kept (``HEADROOM``). Returns the plan kept and what
    was measured (None where nothing was).

    NOTE: the simulator adds up ops measured one by one; a split graph, a rewrite or another
    order changes what it does not see (caches, the allocator, the interpreter between ops):
    BERT-base small at 0.6 of its peak, a rewritten graph planned by fission simulated 6.7%
    faster than auto's plan and measured 6.1% slower; the runner-up may measure faster. In
    latency mode a lower peak spends the slack auto's plan leaves, which the simulator
    under-reads: GPT-2 small within 1.05x, the search's plan measured 1.125x eager's step,
    auto's 1.093x, and ``optimize``'s latency check planned the search again three times."""
    if not measures(problem.cost_model) or first.solution is None:
        return best, None
    contenders = _contenders(first, best, tried)
    budget_mode = problem.budget_bytes is not None
    roomier = _roomier(first, [best, *tried]) if budget_mode else []
    if not contenders and not roomier and (budget_mode or plan_again is None):
        return best, None
    if budget_mode:
        against = "auto"
        base, plan = first.solution.graph_for(first.graph), first.solution.plan
        within = 1 - MEASURED_MARGIN
    else:
        against = "eager"
        base, plan = problem.graph, eager_plan(problem.graph)
        within = max(1.0, problem.latency_limit - STEP_MARGIN)

    ratio_of = _timer(problem, base, plan, within)
    timed = []
    for c in contenders:
        ratio = ratio_of(c)
        progress.note(f"search: {' + '.join(c.rules) or 'the exact order'} measured "
                      f"{ratio:.3f}x {against}'s step")
        timed.append((ratio, c))
        if not budget_mode and ratio <= within:
            break   # NOTE: timed lowest peak first: the first within the limit is kept
    retried = not budget_mode and bool(timed) and timed[-1][0] > within
    if retried and plan_again is not None:
        _timed_plan_again(problem, *timed[0], first, within, limit_s, plan_again, RETRY,
                          ratio_of, tried, timed)
    if timed:
        ratio, chosen = min(timed, key=lambda t: t[0]) if budget_mode else timed[-1]
        if ratio <= within:
            # NOTE: the choice timed again: the fastest of several timings (or the first
            # within the limit) is picked partly for its luck, and only a fresh timing is not
            ratio = _timed_again(ratio_of, chosen, against)
    elif budget_mode:
        ratio, chosen = within + 1.0, first   # NOTE: nothing simulated faster (HEADROOM's below)
    else:
        # NOTE: latency mode, no lower peak than auto's plan: its own step timed, for its slack
        ratio, chosen = ratio_of(first), first
        progress.note(f"search: auto's plan measured {ratio:.3f}x eager's step")
        timed.append((ratio, first))
    if not budget_mode and not retried and plan_again is not None and ratio <= within:
        ratio, chosen = _slack_spent(problem, ratio, chosen, within, limit_s, plan_again,
                                     ratio_of, tried, timed)
    kept = chosen if ratio <= within else first
    lower = (_no_slower(problem, first, timed, within, ratio_of)
             if not budget_mode and kept is first else None)
    if lower is not None:
        no_slower, kept = lower
        ratio, chosen = next((r, c) for r, c in timed if c is kept)
    roomy = _headroom(roomier, timed, ratio_of) if kept is first and roomier else None
    if roomy is not None:
        ratio, chosen = roomy
        kept = chosen
    elif budget_mode and chosen is first:
        ratio, chosen = min(timed, key=lambda t: t[0])   # NOTE: what HEADROOM timed
    said = " + ".join(chosen.rules) or ("auto" if chosen is first else "the exact order")
    progress.note(f"search: {'kept ' + said if kept is not first else 'auto kept'}")
    notes = {"rules": list(chosen.rules), f"measured_over_{against}": round(ratio, 4),
             "kept": "auto" if kept is first else "search", "for": (
                 "step" if budget_mode and roomy is None else "peak"),
             "timed": [{"rules": list(c.rules), f"measured_over_{against}": round(r, 4)}
                       for r, c in timed]}
    if lower is not None:
        notes[NO_SLOWER] = round(no_slower, 4)   # NOTE: its step over auto's plan's, paired
    return kept, notes


def _no_slower(problem: Problem, first, timed: list, within: float, ratio_of
               ) -> tuple | None:
    """Latency mode, no plan kept within the limit: where auto's plan (``first``; its step
    timed against the eager plan's unless ``timed`` has it) measures over ``within`` too, the
    timed candidates of a lower simulated peak than its and at most ``HEADROOM_SLOWER`` over
    its simulated step, lowest peak first, each timed against auto's plan in paired rounds;
    the first measured no slower, twice (the second timing decides), is kept
    (``NO_SLOWER``): (its step over auto's, it); else None. What is timed against the eager
    plan joins ``timed``."""
    peak = first.solution.sim.peak_bytes
    lower = sorted({id(c): c for _, c in timed if c.solution is not None
                    and c.solution.sim.peak_bytes < peak and _as_fast(c, first)}.values(),
                   key=lambda c: c.solution.sim.peak_bytes)
    if not lower:
        return None
    own = next((r for r, c in timed if c is first), None)
    if own is None:
        own = ratio_of(first)
        progress.note(f"search: auto's plan measured {own:.3f}x eager's step")
        timed.append((own, first))
    if own <= within:
        return None   # NOTE: auto's plan holds the limit: no plan over it is kept
    over_auto = _timer(problem, first.solution.graph_for(first.graph), first.solution.plan,
                       1.0)
    for c in lower:
        ratio = over_auto(c)
        progress.note(f"search: {' + '.join(c.rules) or 'the exact order'} ({NO_SLOWER}) "
                      f"measured {ratio:.3f}x auto's step")
        if ratio <= 1.0:
            ratio = _timed_again(over_auto, c, "auto")
            if ratio <= 1.0:
                return ratio, c
    return None


def _timer(problem: Problem, base, plan, within: float):
    """``ratio_of(c, near=within)``: ``c``'s plan's step over ``plan``'s on ``base``, timed in
    paired rounds — more of them where the median is within ``CLOSE`` of ``near``, the ratio
    the choice turns on."""
    def ratio_of(c, near: float = within) -> float:
        return problem.cost_model.measured_ratio(
            c.solution.graph_for(c.graph), c.solution.plan, base, plan,
            undecided=lambda median: abs(median - near) < CLOSE)
    return ratio_of


def _roomier(first, tried: list) -> list:
    """Budget mode: the candidates whose plans simulate ``HEADROOM_MIN`` or more under
    ``first``'s peak and at most ``HEADROOM_SLOWER`` over its step, lowest peak first, one per
    simulated (peak, step), ``HEADROOM_TIMED`` at most."""
    peak = first.solution.sim.peak_bytes
    roomy = (c for c in tried if c.solution is not None
             and c.solution.sim.peak_bytes <= (1 - HEADROOM_MIN) * peak and _as_fast(c, first))
    return _distinct(sorted(roomy, key=_simulated), [], HEADROOM_TIMED)


def _as_fast(c, first) -> bool:
    """Whether ``c``'s plan simulates at most ``HEADROOM_SLOWER`` over ``first``'s step (each
    scaled by its graph's ``CALIBRATED`` factor: ``step_s``): what a lower peak may cost to be
    timed as no slower (``HEADROOM``, ``NO_SLOWER``)."""
    return c.step_s <= (1 + HEADROOM_SLOWER) * first.step_s


def _headroom(roomier: list, timed: list, ratio_of) -> tuple | None:
    """Budget mode, auto's plan kept: the first of ``roomier`` (``_roomier``) whose step
    measures at most ``HEADROOM_MEASURED`` of auto's, timed again (the second timing decides):
    (its ratio, it);
    None where none does. A candidate already timed (``timed``) is not timed anew first; what
    is timed joins ``timed``."""
    known = {id(c): r for r, c in timed}
    for c in roomier:
        ratio = known.get(id(c))
        if ratio is None:
            ratio = ratio_of(c, HEADROOM_MEASURED)
            progress.note(f"search: {' + '.join(c.rules) or 'the exact order'} ({HEADROOM}) "
                          f"measured {ratio:.3f}x auto's step")
            timed.append((ratio, c))
        if ratio <= HEADROOM_MEASURED:
            ratio = _timed_again(ratio_of, c, "auto", HEADROOM_MEASURED)
            if ratio <= HEADROOM_MEASURED:
                return ratio, c
    return None


def _timed_again(ratio_of, c, against: str, *near: float) -> float:
    """``c``'s plan's ratio, timed afresh (the one a choice is kept on; ``near``: the ratio it
    turns on, where not the margin's)."""
    ratio = ratio_of(c, *near)
    progress.note(f"search: {' + '.join(c.rules) or 'the exact order'} measured again "
                  f"{ratio:.3f}x {against}'s step")
    return ratio


def _slack_spent(problem: Problem, measured: float, c, within: float, limit_s: float,
                 plan_again, ratio_of, tried: list, timed: list) -> tuple:
    """Latency mode: where ``c``'s plan measured ``measured`` of the eager plan's step, at least
    ``SLACK_MIN`` under ``within``, its graph planned again for the limit that leaves
    (``SLACK``: looser than the one it simulated within), kept where its peak is lower and it
    measures within, timed twice (the second timing decides); else ``c``. Returns the ratio and
    the plan kept; what was planned joins ``tried``, what was timed ``timed``."""
    if measured > within - SLACK_MIN:
        return measured, c
    made = _timed_plan_again(problem, measured, c, c, within, limit_s, plan_again, SLACK,
                             ratio_of, tried, timed)
    if made is None:
        return measured, c
    ratio, again = made
    if ratio <= within:
        ratio = _timed_again(ratio_of, again, "eager")
    return (ratio, again) if ratio <= within else (measured, c)


def _timed_plan_again(problem: Problem, measured: float, c, than, within: float,
                      limit_s: float, plan_again, name: str, ratio_of, tried: list,
                      timed: list) -> tuple | None:
    """``c``'s graph planned again for the limit its measured step leaves (``_retried``,
    ``name``: ``RETRY`` or ``SLACK``), listed in ``tried`` (a plan or why not); where its plan
    ranks below ``than``'s (a lower peak), timed once against the eager plan's step and listed
    in ``timed``: (its ratio, it); else None."""
    again = _retried(problem, measured, c, within, limit_s, plan_again, name)
    if again is None:
        return None
    tried.append(again)
    if again.solution is None or not again < than:
        return None
    ratio = ratio_of(again)
    progress.note(f"search: {name}, measured {ratio:.3f}x eager's step")
    timed.append((ratio, again))
    return ratio, again


def _retried(problem: Problem, measured: float, c, within: float, limit_s: float, plan_again,
             name: str):
    """Latency mode: the graph ``c``'s plan ran (measured ``measured`` of the eager plan's
    step: over ``within`` for ``RETRY``, under it for ``SLACK``, ``name``) — else, where no
    plan of it is, ``c``'s own graph — planned by auto again (``plan_again``) for the limit
    scaled by what its simulation missed, as ``optimize``'s latency check plans again: the
    last candidate planned (with its plan, or why none), None where none was (no time left).

    NOTE: fission's split graph may be slower than the limit left even in its eager plan: a
    tighter limit may want fewer parts, which auto on the candidate's own graph can choose."""
    sol = c.solution
    target_s = sol.sim.latency_s * within / measured
    changes = dict(c.changes)
    changes[name] = {"limit": round(problem.latency_limit * target_s / limit_s, 4)}
    again = None
    for graph in [sol.graph, c.graph] if sol.graph is not None else [c.graph]:
        again = plan_again(c, graph, target_s, changes, name)
        if again is None or again.solution is not None:
            break
    return again


def _contenders(first, best, tried: list) -> list:
    """The candidates worth timing (``confirmed_choice``): ``best`` where it is not ``first``, then
    those whose plans rank better than ``first``'s (budget mode: faster; latency mode: lower
    peak), best first, one per simulated (peak, step) — a plan made again from another path
    simulates alike — ``MEASURED`` in all."""
    out = [best] if best is not first else []   # NOTE: a feasible first keeps best feasible
    better = sorted(c for c in tried if c.solution is not None and c.rank < first.rank)
    return _distinct(better, out, MEASURED, also_seen=[first])


def _distinct(cands, out: list, n: int, also_seen=()) -> list:
    """``out`` followed by ``cands`` in their order, one per simulated (peak, step) and none
    alike to ``also_seen``'s, ``n`` in all."""
    seen = {_simulated(c) for c in [*also_seen, *out]}
    for c in cands:
        if len(out) >= n:
            break
        if _simulated(c) not in seen:
            seen.add(_simulated(c))
            out.append(c)
    return out


def _simulated(c) -> tuple:
    return c.solution.sim.peak_bytes, c.solution.sim.latency_s
