"""``auto``: the default solver — hotspot; joint (remat + offload) where offloading frees device
memory; fission where the peak holds a region to split.

Remat (``hotspot``) cannot cut what one region needs at once: a language model's logits, loss
and their gradient over a large vocabulary stay the floor of its peak. Operator fission
(``fission``) cuts that, but its search costs seconds and gains nothing where the peak is
remat's to cut. ``auto`` runs hotspot first (``HOTSPOT_SHARE`` of the time budget); then, when
the eager plan is over the budget and hotspot's plan is slower than it (or a latency limit is
asked), and the graph has dropout masks, hotspot plans ``transform.compact_masks``'s rewrite too
(each mask kept as bits, re-made where read: a cheap deterministic recompute instead of a
replayed draw); the better of the two graphs is the one every later option plans on. Then, when
the eager peak holds a region that fission can split
(``fission_regions.candidate_regions``) and time is left, it runs fission, handing it hotspot's
answer as the no-split option. Between the two, where the cost model says device memory is
apart from the host's (``host_memory_apart``: GPUs; not the CPU, whose "host" is the same RAM)
and remat alone is slower than eager (or a latency limit is asked), ``joint`` weighs offloading
against recompute; if it beats hotspot, it is the no-split option fission must beat; and
fission's split graphs are planned by ``joint`` too (``FissionConfig(offload=True)``), so
splits, remat and offloading combine in one plan.
Where every option misses the budget, DTR's plan (``solvers.peers.dtr``: values recomputed
from values recomputed in turn, which hotspot's plans never do; seconds) and the least-peak plan
(hotspot, a latency limit that never binds) are tried, and where the latter misses too and
results need not be bitwise, ``split_backward`` (``solvers.fission.split_backward``: the remat
plan's peak region re-made in the backward in parts, in every block alike; up to the time
budget again, stopping at its first plan within the budget): the fastest that fits is
returned, else BudgetInfeasible names the least peak found (with ``fallback=False``, the
coordinated search's rewritten graphs, DTR's alone).
Budget mode returns the faster plan within the budget, latency mode the lower peak within the
limit; ties keep the plan without splits (no rewritten graph). Before all of it, where large
parameters' optimizer updates can run on row slices (``transform.optimizer_chunks``, bitwise),
the graph every option plans on is that rewrite: in latency mode always (each update holds the
weights, the state, the gradients and its temporaries whatever a plan drops: a floor under
every plan's peak that only chunking lowers), in budget mode where that floor is over the
budget (``notes["optimizer_chunks"]`` says which). ``notes["winner"]`` names the
solver whose plan is returned, ``notes["why"]`` says why, ``notes["hotspot"]`` /
``notes["compact_masks"]`` / ``notes["joint"]`` / ``notes["fission"]`` what each reached.
Deterministic as its solvers are: only the deadline (``time_budget_s``) cuts them short, on the
planning clock (``cost.clock``: the ops it measures for its new graphs do not count), so a plan
does not depend on which ops the cost cache already held.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers import Problem, solve
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4096))
    >>> batch = (torch.randn(512, 16), torch.randint(0, 4096, (512,)))
    >>> loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    >>> g = fitgraph.capture(model, batch, loss_fn)
    >>> cm = RooflineCostModel(get_device("rtx3090"))
    >>> eager = solve(Problem(g, cm, latency_limit=1.0), "eager")
    >>> s = solve(Problem(g, cm, budget_bytes=eager.sim.peak_bytes // 2), "auto")
    >>> s.notes["winner"], s.graph is not None   # remat alone cannot halve a loss's peak
    ('fission', True)
"""

from __future__ import annotations

import dataclasses

from .. import progress
from ..cost.clock import planning_now
from ..plan.eager import eager_plan
from ..plan.instructions import Compute
from ..sim.simulate import SimResult, simulate
from ..transform.compact_masks import dropout_masks
from ..transform.optimizer_chunks import chunk_updates, find_chunkable_updates
from ..transform.registry import TRANSFORMS
from .base import BudgetInfeasible, Problem, Solution, dominated_by, register
from .fission.peak_regions import peak_starts, shared_regions
from .fission.search import FissionConfig, solve_fission
from .fission.split_backward import split_backward
from .offload.remat_offload import solve_joint
from .peers.dtr import solve_dtr
from .remat.hotspot import solve_hotspot

__all__ = ["solve_auto", "splittable_regions"]

# NOTE: hotspot stops on its own evaluation budget well within half the time on every zoo
# model; the rest (all that is left, in fact) goes to the fission search
HOTSPOT_SHARE = 0.5
# NOTE: joint (remat + offload) may take this share of what hotspot left; fission the rest
JOINT_SHARE = 0.5
# NOTE: a fission search given less than this only makes and simulates a few splits; its
# measured final plan alone takes about this long on the zoo's small configs
MIN_FISSION_S = 1.0

_MIB = 2**20
_SEARCH = FissionConfig()  # NOTE: what solve_fission searches by default
_SEARCH_OFFLOAD = FissionConfig(offload=True)


def splittable_regions(problem: Problem, eager: SimResult,
                       config: FissionConfig = _SEARCH) -> bool:
    """Whether a fission region grows from what is live at the eager plan's peak (the first
    round of the fission search; False: fission has nothing to split). Stops at the first."""
    g = problem.graph
    starts = peak_starts(g, eager_plan(g), eager, config.max_storages)
    return next(shared_regions(g, starts, config.shares), None) is not None


def _key(sol: Solution, budget: int | None) -> tuple:
    return ((sol.sim.latency_s, sol.sim.peak_bytes) if budget is not None
            else (sol.sim.peak_bytes, sol.sim.latency_s))


def _summary(sol: Solution | None, err: BudgetInfeasible | None, name: str) -> dict:
    """What one option reached (``notes[name]``), said to whoever listens (``progress``)."""
    if progress.enabled():
        progress.note(f"{name}: " + (_describe(sol) if sol is not None else
                                     f"no plan within the budget (least "
                                     f"{err.smallest_peak_bytes / _MIB:,.1f} MiB)"))
    if sol is None:
        return {"infeasible": str(err), "smallest_peak_bytes": err.smallest_peak_bytes}
    return {"peak_bytes": sol.sim.peak_bytes, "latency_s": sol.sim.latency_s,
            "solve_s": sol.solve_s, "splits": sol.notes.get("splits", [])}


def _describe(sol: Solution) -> str:
    return f"{sol.sim.peak_bytes / _MIB:,.1f} MiB in {sol.sim.latency_s * 1e3:,.1f} ms"


def _joint(problem: Problem, hot: Solution | None, eager: SimResult, t0: float):
    """``joint`` (remat + offload) where offloading frees device memory and remat alone is
    slower than eager (or a latency limit is asked): (solution, error, why not run)."""
    if not problem.cost_model.host_memory_apart:
        return None, None, "host and device are one memory here: offloading frees nothing"
    if problem.budget_bytes is not None and (
            eager.peak_bytes <= problem.budget_bytes
            or (hot is not None and hot.sim.latency_s <= eager.latency_s)):
        return None, None, "remat alone is as fast as the eager plan"
    left = problem.time_budget_s - (planning_now() - t0)
    if left < MIN_FISSION_S:
        return None, None, f"no time left ({max(left, 0.0):.1f} s)"
    try:
        return solve_joint(dataclasses.replace(problem, time_budget_s=JOINT_SHARE * left)), \
            None, None
    except BudgetInfeasible as e:
        return None, e, None


def _compacted(problem: Problem, hot: Solution | None, eager: SimResult, remat_fast: bool,
               t0: float):
    """``hotspot`` on ``transform.compact_masks``'s rewrite (dropout masks kept as bits) where
    the graph has dropout masks and remat may be needed: (solution with ``graph`` set and
    ``notes["latency_factor"]``: the limit as a factor of the rewrite's eager step; error; why
    not run)."""
    if not dropout_masks(problem.graph):
        return None, None, "no dropout mask to keep as bits"
    if problem.budget_bytes is not None and eager.peak_bytes <= problem.budget_bytes:
        return None, None, "the eager plan fits the budget"
    if remat_fast:
        # NOTE: the rewrite's eager plan makes the bits too, so it is slower than the captured
        # graph's: it cannot beat an eager-fast plan
        return None, None, "hotspot's plan is as fast as the eager plan"
    left = problem.time_budget_s - (planning_now() - t0)
    if left < MIN_FISSION_S:
        return None, None, f"no time left ({max(left, 0.0):.1f} s)"
    cm = problem.cost_model
    graph = TRANSFORMS["compact_masks"](problem.graph).graph
    cm.prepare(graph)  # NOTE: measured costs: only the bits' new ops are profiled
    factor = None
    if problem.latency_limit is not None:
        own = simulate(graph, eager_plan(graph), cm).latency_s
        factor = problem.latency_limit * eager.latency_s / own
        if factor < 1.0:
            return None, None, "making the bits alone passes the latency limit"
    sub = dataclasses.replace(problem, graph=graph, latency_limit=factor,
                              time_budget_s=HOTSPOT_SHARE * left)
    try:
        sol = solve_hotspot(sub)
    except BudgetInfeasible as e:
        if e.solution is not None:  # NOTE: its plan runs on the rewrite
            e.solution = dataclasses.replace(e.solution, graph=graph)
        return None, e, None
    return dataclasses.replace(sol, graph=graph, notes=dict(
        sol.notes, graph="compact_masks", latency_factor=factor)), None, None


# NOTE: split_backward plans each candidate with hotspot: cut short, hotspot's least peak is
# worse than remat alone's (GPT-2 at sweep size: 25.4 MiB in 7.5 s against 23.9 in 15 s); and
# where a path made again in more parts moves the peak, its rounds go on (Falcon: 1.257x the
# lower bound in 60 s, out of time in the round after; 1.232x in 90); and where the greedy
# rounds end, a detour (a try whose peak moved elsewhere) goes on: each plan of a candidate
# takes 6-18 s on T5's 2,727 nodes (98 s of 136 were hotspot's), and Gemma-2 went 1.29x ->
# 1.21x in 170 s, T5 1.36x -> 1.30x in 136 s with its chunked loss left for the next round
SPLIT_BACKWARD_MIN_S = 240.0
# NOTE: a latency limit no plan reaches: hotspot's latency mode then minimises the peak alone
_UNBOUNDED = 1e9


def _least_peak(problem: Problem, t0: float) -> Solution | None:
    """hotspot's least-peak plan (latency mode, no limit that binds), within the time left
    (at least ``MIN_FISSION_S``): what an infeasible budget is checked against, so that the
    smallest peak reported does not depend on the budget asked."""
    left = max(problem.time_budget_s - (planning_now() - t0), MIN_FISSION_S)
    try:
        return solve_hotspot(dataclasses.replace(problem, budget_bytes=None,
                                                 latency_limit=_UNBOUNDED, time_budget_s=left))
    except BudgetInfeasible:
        return None


def _dtr(problem: Problem, t0: float) -> Solution | None:
    """DTR's plan for the budget (``solvers.peers.dtr``: greedy eviction, a value recomputed
    from values recomputed in turn), else its plan at the least peak it reached; None where it
    has none. Seconds: it replays the step, where the least-peak searches take minutes.

    NOTE: hotspot recomputes each dropped value once, from kept values; a chain of blocks
    whose outputs are all kept cannot go lower (ResNet-50 small, this CPU's measured costs:
    hotspot's least peak 0.466 of eager's, minutes of split_backward fitting nothing lower;
    DTR's 0.407, its plans at 0.43 and 0.41 of eager's peak measured +70% and +93% step)."""
    left = max(problem.time_budget_s - (planning_now() - t0), MIN_FISSION_S)
    try:
        return solve_dtr(dataclasses.replace(problem, time_budget_s=left))
    except BudgetInfeasible as e:
        return e.solution


def _fallbacks(problem: Problem, eager: SimResult, t0: float, fallback: bool,
               notes: dict) -> list[Solution]:
    """Where no option reaches the budget: DTR's plan (``_dtr``), and with ``fallback``
    hotspot's least-peak plan, and ``split_backward``'s where that misses the budget too —
    each within the budget or at its least peak (``notes["dtr"]``, ``notes["least_peak"]``
    say what each reached)."""
    budget = problem.budget_bytes
    progress.note("no option reaches the budget: DTR's eviction" + (
        ", the least peak" if fallback else ""))
    dtr = _dtr(problem, t0)
    notes["dtr"] = None if dtr is None else _summary(dtr, None, "dtr")
    found = [dtr] if dtr is not None else []
    if not fallback:
        return found
    least = _least_peak(problem, t0)
    # NOTE: below the bytes that exist before the step starts no plan fits: the least
    # peak is then hotspot's, not searched further
    if ((least is None or least.sim.peak_bytes > budget) and not problem.exact
            and budget >= eager.resident_bytes):
        # NOTE: where DTR's plan fits, split_backward only looks for a faster one, in the
        # time left: its minutes are for proving a budget infeasible
        fits = dtr is not None and dtr.sim.peak_bytes <= budget
        progress.note("and regions re-made in the backward in parts (split_backward" + (
            ")" if fits else ": minutes)"))
        deeper = _split_backward(problem, max(
            problem.time_budget_s - (planning_now() - t0), MIN_FISSION_S) if fits else None)
        if deeper is not None and (least is None
                                   or deeper.sim.peak_bytes < least.sim.peak_bytes):
            least = deeper
    if least is not None:
        notes["least_peak"] = _summary(least, None, least.solver)
        found.append(least)
    return found


def _split_backward(problem: Problem, time_s: float | None = None) -> Solution | None:
    """``split_backward`` (forward regions re-made in the backward in parts, every block
    alike) where the least-peak plan is still over the budget: its own search, for ``time_s``
    where given, else up to the problem's whole time budget again, at least
    ``SPLIT_BACKWARD_MIN_S`` (an infeasible budget costs that much more to prove), or until a
    plan fits the budget."""
    try:
        return split_backward(dataclasses.replace(
            problem, budget_bytes=None, latency_limit=_UNBOUNDED,
            time_budget_s=time_s if time_s is not None else max(problem.time_budget_s,
                                                               SPLIT_BACKWARD_MIN_S)),
            target_bytes=problem.budget_bytes)
    except BudgetInfeasible:
        return None


@register("auto")
def solve_auto(problem: Problem, *, fallback: bool = True,
               masks_as_bits: bool | None = None) -> Solution:
    """Plan ``problem`` with hotspot, and fission where it may win (see the module doc).
    ``fallback=False``: where every option misses the budget, DTR's plan alone (seconds), no
    least-peak search, no ``split_backward`` (minutes): the coordinated search's rewritten
    graphs, which must keep to its deadline. ``masks_as_bits``: None chooses the graph every
    later option plans on by hotspot's plans on both (the module doc); True takes the
    masks-as-bits rewrite wherever hotspot plans it, False never makes it (the coordinated
    search tries the choice auto did not make: fission may split the other graph further).
    ``notes["masks_as_bits"]`` says which graph the later options planned on."""
    t0 = planning_now()
    on, why = _chunked_updates(problem)
    if on is problem:
        sol = _solve_auto(problem, fallback, masks_as_bits)
        return dataclasses.replace(sol, notes=dict(sol.notes, optimizer_chunks=why))
    try:
        sol = _solve_auto(on, fallback, masks_as_bits)
    except BudgetInfeasible as e:
        if e.solution is not None and e.solution.graph is None:
            e.solution = dataclasses.replace(e.solution, graph=on.graph)
        raise
    return dataclasses.replace(sol, graph=sol.graph_for(on.graph),
                               solve_s=planning_now() - t0,
                               notes=dict(sol.notes, optimizer_chunks=why))


def _chunked_updates(problem: Problem) -> tuple[Problem, str]:
    """``problem`` on ``transform.optimizer_chunks``'s rewrite (large parameters' updates run on
    row slices: their temporaries a slice's size), and why (or why not). Every plan holds, at
    each update, the weights, the optimizer state, the gradients not yet used and the update's
    temporaries, whatever it drops: a floor under its peak that only chunking lowers. So: in
    latency mode (least peak) wherever the rule matches and its slices keep the eager step
    within the limit; in budget mode where that floor is over the budget (elsewhere chunks
    would only add launches)."""
    matches = find_chunkable_updates(problem.graph)
    if not matches:
        return problem, "no optimizer update to run in chunks"
    cm, budget = problem.cost_model, problem.budget_bytes
    cm.prepare(problem.graph)
    plan = eager_plan(problem.graph)
    eager = simulate(problem.graph, plan, cm)
    if budget is not None:
        updates = {m.node for m in matches}
        floor = max(eager.peak_during[i] for i, ins in enumerate(plan.instructions)
                    if isinstance(ins, Compute) and ins.node in updates)
        if floor <= budget:
            return problem, "every update fits the budget whole"
    graph = chunk_updates(problem.graph)
    cm.prepare(graph)  # NOTE: measured costs: only the chunked updates are profiled
    factor = None
    if problem.latency_limit is not None:
        factor = problem.latency_limit * eager.latency_s / simulate(
            graph, eager_plan(graph), cm).latency_s
        if factor < 1.0:
            return problem, "updates in chunks pass the latency limit"
    said = (f"{len(matches)} update(s) in row chunks: their temporaries "
            f"{sum(m.bytes_saved for m in matches) / _MIB:,.1f} MiB smaller")
    return dataclasses.replace(problem, graph=graph, latency_limit=factor), said


def _solve_auto(problem: Problem, fallback: bool, masks_as_bits: bool | None = None) -> Solution:
    """``solve_auto`` on the graph it plans (see the module doc)."""
    t0 = planning_now()
    cm, budget = problem.cost_model, problem.budget_bytes
    cm.prepare(problem.graph)  # NOTE: a no-op when the caller profiled (the cache holds it)
    hot, hot_err = None, None
    try:
        hot = solve_hotspot(dataclasses.replace(
            problem, time_budget_s=HOTSPOT_SHARE * problem.time_budget_s))
    except BudgetInfeasible as e:
        hot_err = e
    eager = simulate(problem.graph, eager_plan(problem.graph), cm)
    notes = {"hotspot": _summary(hot, hot_err, "hotspot")}
    flop_errors = problem.graph.meta.get("flop_formula_errors")
    if flop_errors and not cm.measures:
        # NOTE: named, not silent: such a node's roofline time is its bytes moved alone
        first = next(iter(flop_errors.items()))
        notes["flops_unknown"] = (f"{len(flop_errors)} node(s) have no FLOP estimate (torch's "
                                  f"formula failed; costed by bytes moved alone), e.g. "
                                  f"{first[0]} ({first[1]})")
    remat_fast = budget is not None and hot is not None and hot.sim.latency_s <= eager.latency_s
    bits, bits_err, bits_skip = (_compacted(problem, hot, eager, remat_fast, t0)
                                 if masks_as_bits is not False else
                                 (None, None, "masks_as_bits=False"))
    notes["compact_masks"] = (_summary(bits, bits_err, "masks as bits") if bits_skip is None
                              else f"not run: {bits_skip}")
    base, also = problem, []
    if bits is not None and (masks_as_bits or hot is None
                             or _key(bits, budget) < _key(hot, budget)):
        # NOTE: the dropout masks kept as bits: the graph every later option plans on
        hot, hot_err = bits, None
    elif hot is None and bits_err is not None:
        # NOTE: remat alone reaches the budget on neither graph: fission searches both (on
        # GPT-2 small at 40%, its plan on the captured graph replayed seven dropout draws,
        # 7% of the step; on the bits it re-makes masks from bits instead)
        also = [dataclasses.replace(problem,
                                    graph=TRANSFORMS["compact_masks"](problem.graph).graph)]
        hot_err = min(hot_err, bits_err, key=lambda e: e.smallest_peak_bytes)
    notes["masks_as_bits"] = bits is not None and hot is bits
    if hot is not None and hot.graph is not None:
        base = dataclasses.replace(problem, graph=hot.graph,
                                   latency_limit=hot.notes["latency_factor"])
    off, off_err, off_skip = _joint(base, hot, eager, t0)
    notes["joint"] = (_summary(off, off_err, "remat + offload") if off_skip is None
                      else f"not run: {off_skip}")
    if off is not None and base is not problem:
        off = dataclasses.replace(off, graph=base.graph)
    if off is not None and (hot is None or _key(off, budget) < _key(hot, budget)):
        # NOTE: remat + offload beats remat alone: it is the no-split option fission must beat
        hot, hot_err = off, None
    left = problem.time_budget_s - (planning_now() - t0)
    skip = None
    if problem.exact:
        skip = ("exact=True: fission sums in parts (results allclose to eager's, not bitwise)")
    elif budget is not None and eager.peak_bytes <= budget:
        skip = "the eager plan fits the budget: nothing to split"
    elif remat_fast:
        # NOTE: k parts of a node cost at least the node (launches, whole inputs read again):
        # no split plan can be faster than an eager-fast one
        skip = "hotspot's plan is as fast as the eager plan: no split can be faster"
    elif left < MIN_FISSION_S:
        skip = f"no time left for fission ({max(left, 0.0):.1f} s of {problem.time_budget_s:g})"
    elif not splittable_regions(base, eager if base is problem else simulate(
            base.graph, eager_plan(base.graph), cm)):
        skip = "no region live at the eager peak can be split"
    fis, fis_err = None, None
    if skip is None:
        config = _SEARCH_OFFLOAD if cm.host_memory_apart else _SEARCH
        for i, on in enumerate([base, *also]):
            share = (problem.time_budget_s - (planning_now() - t0)) / (1 + len(also) - i)
            try:
                found = solve_fission(dataclasses.replace(on, time_budget_s=share),
                                      config=config, remat_alone=(hot, hot_err))
            except BudgetInfeasible as e:
                if e.solution is not None and e.solution.graph is None and on is not problem:
                    e.solution = dataclasses.replace(e.solution, graph=on.graph)
                if fis_err is None or e.smallest_peak_bytes < fis_err.smallest_peak_bytes:
                    fis_err = e
                continue
            if found.graph is None and on is not problem:
                found = dataclasses.replace(found, graph=on.graph)
            if fis is None or _key(found, budget) < _key(fis, budget):
                fis = found
        if fis is not None:
            fis_err = None
        notes["fission"] = _summary(fis, fis_err, "fission")
    else:
        notes["fission"] = f"not run: {skip}"
    if fis is not None and fis.graph is not None and (hot is None or _key(fis, budget) < _key(
            hot, budget)):
        win, name = fis, "fission"
        target = "within the budget" if budget is not None else "within the latency limit"
        why = (f"fission {_describe(fis)} beats hotspot {_describe(hot)} {target}"
               if hot is not None else
               f"hotspot cannot reach the budget ({hot_err.smallest_peak_bytes / _MIB:,.1f} "
               f"MiB at least); fission {_describe(fis)}")
    elif hot is not None:
        win, name = hot, hot.solver + (" (masks as bits)" if hot.graph is not None else "")
        why = (f"{name} {_describe(hot)}; " + (skip if skip is not None else
               "fission found no split plan better " + ("within the budget" if budget is not None
                                                        else "within the latency limit")))
    else:
        errors = [e for e in (hot_err, fis_err) if e is not None]
        best = min(errors, key=lambda e: e.smallest_peak_bytes)
        found = _fallbacks(problem, eager, t0, fallback, notes)
        fits = [s for s in found if s.sim.peak_bytes <= budget]
        if fits:
            # NOTE: budget mode's greedy stops its path where it stalls; the least-peak
            # searches walk others (hotspot's without a budget, DTR's eviction, split_backward)
            win = min(fits, key=lambda s: (s.sim.latency_s, s.sim.peak_bytes))
            name = win.solver
            why = (f"budget mode reached {best.smallest_peak_bytes / _MIB:,.1f} MiB at least; "
                   f"the least-peak search ({win.solver}) {_describe(win)}")
        else:
            least = min(found, key=lambda s: s.sim.peak_bytes, default=None)
            if least is not None and least.sim.peak_bytes < best.smallest_peak_bytes:
                best = BudgetInfeasible(budget, least.sim.peak_bytes,
                                        dominated_by(least.sim), "auto")
            err = BudgetInfeasible(best.budget_bytes, best.smallest_peak_bytes,
                                   best.dominated_by, "auto")
            kept = least if least is not None and least.sim.peak_bytes == err.smallest_peak_bytes \
                else best.solution
            if kept is not None:
                # NOTE: the plan at the least peak rides on the error: a budget of "smallest"
                # takes it as is (solvers.smallest), where planning again at its peak may
                # not walk the same time-bound path (BEiT: 15.56 MiB found, 15.8 again)
                err.solution = _as_auto(kept, notes, kept.solver, (
                    f"the least peak found ({kept.solver} {_describe(kept)}); the budget "
                    f"{budget / _MIB:,.1f} MiB is below it"), t0)
            raise err
    return _as_auto(win, notes, name, why, t0)


def _as_auto(win: Solution, notes: dict, name: str, why: str, t0: float) -> Solution:
    """``win`` as auto's answer: its notes with what each option reached, who won and why."""
    win.plan.meta["solver"] = "auto"
    notes = dict(win.notes, **notes, winner=name, why=why)
    return Solution(win.plan, win.sim, "auto", planning_now() - t0, win.optimal, win.gap,
                    notes, win.graph)
