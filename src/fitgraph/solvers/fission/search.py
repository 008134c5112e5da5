"""``fission``: operator fission chosen by the simulator, then rematerialization on top.

Simulate the eager plan, look at what is live at the peak, grow fission regions from those
tensors along each of their dims (``solvers.fission.peak_regions``: whole and trimmed to their large
tensors), split each in k parts for k in ``FissionConfig.ks`` (``transform.split_region``) and
simulate the split graph's eager plan; take the candidate the simulator says is best and repeat
on the split graph, which may split a part again along another dim (nested fission), until the
budget holds or nothing lowers the peak. Best is, on one greedy path, the most bytes saved per
second added (among splits that close their share of the gap to the budget, a split that fits
included: a whole model run in parts fits alone but slowly, the chunked loss needs remat on top
but costs nothing); on another, within the budget the least latency, over it the lowest peak;
with a ``latency_limit``, the lowest peak within it. In budget mode no split is made slower
than remat alone's plan (no plan on a graph beats its eager plan), nor more parts of it, nor
more parts of a split that fits. The cheapest path takes a chosen split in more parts without
a new round while each increment buys bytes at a better rate than any other split its round
saw (``fission_walk``: a round on the split graph would grow and split all its regions first).
Losses count their targets apart first (``transform.fission_loss``), so the
logits, the loss and its gradient can run chunk by chunk in one region; a shifted causal-LM
loss (``logits[:, :-1]``, however spelled) reads every position first, its dropped ones
ignored (``transform.fission_shift``), so no slice copy or ``slice_backward`` buffer pins it. Spatial regions (rows
of a convolution chain, with a halo) are grown also where the input gradients of the
backward convolutions are separated from their weight gradients (``solvers.fission.spatial``):
such a region runs a whole chain, forward and backward, part by part; only the graph of a
split that needs it is separated (``notes["separated_grads"]``: the halves the plan's graph
runs). What is still
over budget goes to ``hotspot`` (remat and reordering on the split graph; ``joint``, remat and
offloading, with ``FissionConfig(offload=True)`` where device memory is apart); remat alone on the
original graph is one more option, and the best option is returned. The Solution carries the
split graph (``Solution.graph``). Deterministic: candidates are tried in a fixed order and ties
keep the first; only the deadline (``time_budget_s``, on the planning clock: the split graphs it
profiles do not count, ``cost.clock``) cuts the search short (``notes["timed_out"]``).

Measured costs (a cost model that must ``profile`` a graph before costing it): the search costs
split graphs from the original graph's measurements (``cost.scaled.ScaledCostModel``), so it
profiles nothing new; the split graph it picks is profiled once and planned again on its
measured costs (remat on top where still needed), and kept only if it then fits and beats
remat alone (else its last split is measured in more parts, ``MORE_PARTS_TRIES`` times, then
the next-best split option is measured). In latency mode its last split is also measured in
fewer parts (``FEWER_PARTS_TRIES`` counts, ``_fewer_parts``) and the least peak within the
limit wins: small parts run below the whole's efficiency, which the scaled estimate misses.

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
    >>> s = solve(Problem(g, cm, budget_bytes=eager.sim.peak_bytes // 2), "fission")
    >>> s.sim.peak_bytes <= eager.sim.peak_bytes // 2, s.notes["splits"]
    (True, ['11 nodes from _log_softmax dim 0 in 4 parts'])
    >>> s.graph is not None   # the plan runs on the split graph
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...cost.clock import planning_now
from ...cost.scaled import ScaledCostModel
from ...graph.analysis import verify_graph
from ...graph.dim_region import Region
from ...graph.ir import Graph
from ...plan.eager import eager_plan
from ...sim.simulate import SimResult, simulate
from ...transform.fission import FissionError, split_region
from ...transform.fission_loss import counting_nodes
from ...transform.registry import FISSION_SEARCH_READS, fission_reads
from ..base import BudgetInfeasible, Problem, Solution, dominated_by, register
from ..offload.remat_offload import solve_joint
from ..remat.hotspot import solve_hotspot
from .peak_regions import candidate_regions, peak_starts
from .spatial import spatial_candidates
from .walk import rate
from .walk import walk_parts as _walk_parts

__all__ = ["FissionConfig", "solve_fission"]


@dataclass(frozen=True)
class FissionConfig:
    """How far the search looks. ``ks``: part counts tried per region; ``max_storages``: the
    largest tensors live at the peak that regions are grown from; ``shares``: region trims
    tried (0: the whole region; 0.25: only nodes touching a tensor >= 1/4 of its largest);
    ``max_splits``: splits applied in sequence (nested included); ``remat``: hand what is
    still over budget (or the latency left) to ``hotspot``; ``scaled_costs``: with a measured
    cost model, cost the search's split graphs from the original's (``ScaledCostModel``) and
    profile only the chosen one (False: profile every candidate, slow); ``spatial``: also try
    spatial regions through separated input gradients (``fission_spatial``); ``offload``: hand
    the split graph to ``joint`` (remat and offloading weighed together) rather than
    ``hotspot``, where device memory is apart from the host's (a GPU cost model)."""

    ks: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128)
    max_storages: int = 6
    shares: tuple[float, ...] = (0.0, 1 / 16, 1 / 4)
    max_splits: int = 6
    remat: bool = True
    scaled_costs: bool = True
    spatial: bool = True
    offload: bool = False


@dataclass(frozen=True)
class _Step:
    """A split graph and its simulation; ``base``, ``region``, ``k``: the split that made it
    (so that a later round may make the same split with more parts instead)."""

    graph: Graph
    sim: SimResult
    what: str
    base: Graph | None = None
    region: Region | None = None
    k: int = 0


def _simulate(graph: Graph, cost_model) -> SimResult:
    cost_model.prepare(graph)  # NOTE: measured costs: the parts' new shapes, once each
    return simulate(graph, eager_plan(graph), cost_model)


# an option: (its plan or why there is none, the splits made, the graph it runs on)
_Option = tuple[Solution | None, BudgetInfeasible | None, list[_Step], _Step]


@register("fission")
def solve_fission(problem: Problem, *, config: FissionConfig = FissionConfig(),
                  remat_alone: tuple[Solution | None, BudgetInfeasible | None] | None = None
                  ) -> Solution:
    """Plan ``problem`` with fission and then remat (see the module doc). ``remat_alone``:
    hotspot's answer on ``problem`` itself (a plan, or why not), when the caller has it
    already (the ``auto`` portfolio); it is the option without splits."""
    t0 = planning_now()
    deadline = t0 + problem.time_budget_s
    cm, budget = problem.cost_model, problem.budget_bytes
    eager = _simulate(problem.graph, cm)
    scaled = config.scaled_costs and cm.measures
    search = ScaledCostModel(cm, problem.graph) if scaled else cm
    limit = (problem.latency_limit * eager.latency_s if problem.latency_limit is not None
             else float("inf"))
    # NOTE: reshape round trips (3-D logits between a 2-D head and a 2-D loss) tie the token
    # axis to the batch; read through them so a region can run along every token. A shifted
    # loss (logits[:, :-1]) reads every position first, its dropped ones ignored
    graph = fission_reads(problem.graph, FISSION_SEARCH_READS)
    start = _Step(graph, eager if graph is problem.graph else _simulate(graph, search), "")
    unsplit = _Step(problem.graph, eager, "")
    options: list[_Option] = []
    timed_out = False
    memo: dict = {}
    # NOTE: latency mode on estimated costs: the search may go past the limit by the
    # estimate's error; the measured check (_measure_best) keeps the limit itself, falling back
    # to the last split estimated within it
    search_limit = limit * (1 + ESTIMATE_SLACK) if scaled and budget is None else limit
    alone = None
    if budget is not None and config.remat:
        alone = remat_alone or _remat(problem, cm, unsplit, limit, config, t0)
        if alone[0] is not None:
            # NOTE: a plan runs every node of its graph at least once, so no plan on a split
            # graph is faster than that graph's eager plan: a split whose eager plan is
            # already slower than remat alone cannot win (nor can more parts of it)
            search_limit = alone[0].sim.latency_s * (1 + ESTIMATE_SLACK if scaled else 1)
    strategies = LATENCY_STRATEGIES if budget is None else STRATEGIES
    for i, strategy in enumerate(strategies):
        # NOTE: each path gets its share of the time left: the first must not starve the next
        now = planning_now()
        share = now + max(deadline - now, 0.0) / (len(strategies) - i)
        steps, cur, out_of_time = _greedy(start, search, budget, search_limit, config,
                                          share, strategy, memo)
        timed_out |= out_of_time
        ends = [(steps, cur)]
        within = [i for i, st in enumerate(steps) if st.sim.latency_s <= limit]
        if cur.sim.latency_s > limit and within:
            ends.append((steps[:within[-1] + 1], steps[within[-1]]))
        for path, end in ends:
            if path and not any(o[3] is end for o in options):  # NOTE: paths may end alike
                options.append((*_remat(problem, search, end, limit, config, t0), path, end))
    if config.remat or not options:
        # NOTE: fission is one option among others: remat alone may be faster at this budget
        alone = alone or remat_alone or _remat(problem, cm, unsplit, limit, config, t0)
        options.append((*alone, [], unsplit))
    profiled = 0
    if scaled:
        options, profiled = _measure_best(problem, options, limit, config, t0)
        if not any(o[0] is not None or o[3] is unsplit for o in options):
            # NOTE: every split measured over the budget or the limit: remat alone still is
            options.append((*(remat_alone or _remat(problem, cm, unsplit, limit, config, t0)),
                            [], unsplit))
    done = [o for o in options if o[0] is not None]
    if not done:
        # NOTE: the least peak a plan reached, where one did: an estimate lower than every
        # plan (ConvNeXt: 5.6 MB estimated, 11.2 MB planned) is no peak fitgraph can run at
        errors = [o[1] for o in options]
        planned = [e for e in errors if not e.estimated]
        raise min(planned or errors, key=lambda e: e.smallest_peak_bytes)
    sol, _, steps, cur = min(done, key=lambda o: _final_key(o[0], budget))
    notes = dict(sol.notes, splits=[s.what for s in steps], timed_out=timed_out or bool(
        sol.notes.get("timed_out")), eager_latency_s=eager.latency_s,
        fission_peak_bytes=cur.sim.peak_bytes, fission_latency_s=cur.sim.latency_s,
        separated_grads=list(cur.graph.meta.get("separated_grads", [])),
        # NOTE: shifted losses read over every position, and why any other was left as it is
        unshifted=list(graph.meta.get("unshifted", [])),
        unshift_skipped=list(graph.meta.get("unshift_skipped", [])))
    if scaled:
        notes["search_costs"] = search.name
        notes["graphs_profiled"] = profiled
    if cur.graph is not problem.graph:
        verify_graph(cur.graph)
    sol.plan.meta["solver"] = "fission"
    return Solution(sol.plan, sol.sim, "fission", planning_now() - t0, notes=notes,
                    graph=None if cur.graph is problem.graph else cur.graph)


def _measure_best(problem: Problem, options: list[_Option], limit: float,
                  config: FissionConfig, t0: float) -> tuple[list[_Option], int]:
    """The options planned on estimated costs, replaced by the best of them measured: the
    split graph with the best estimate, if it beats the options already exact (remat alone),
    is profiled and planned again on its measured costs; if it no longer fits, the next one
    is. Returns (exact options, graphs profiled)."""
    cm, budget = problem.cost_model, problem.budget_bytes
    exact = [o for o in options if o[3].graph is problem.graph]
    guessed = [o for o in options if o[3].graph is not problem.graph]
    fit = sorted((o for o in guessed if o[0] is not None),
                 key=lambda o: _final_key(o[0], budget))
    bar = min((_final_key(o[0], budget) for o in exact if o[0] is not None), default=None)
    profiled = 0
    # NOTE: latency mode measures the best option of each greedy path: estimated with remat on
    # top, their order can flip once measured (BERT within 1.10x: 145 vs 150 MiB estimated,
    # 145 vs 120 MiB measured)
    kept = 0
    for sol, _, steps, cur in fit:
        if bar is not None and _final_key(sol, budget) >= bar:
            break  # NOTE: estimated no better than remat alone: nothing worth measuring
        measured = _Step(cur.graph, _simulate(cur.graph, cm), cur.what, cur.base, cur.region,
                         cur.k)
        profiled += 1
        found: list[_Option] = []
        # NOTE: latency mode: measured, the split alone may be over the limit
        if measured.sim.latency_s <= limit:
            sol, why = _remat(problem, cm, measured, limit, config, t0)
            if sol is None and budget is not None:
                sol, why, steps, measured, more = _more_parts(problem, measured, steps, why,
                                                              limit, config, t0)
                profiled += more
            found.append((sol, why, steps, measured))
        if budget is None:
            fewer, more = _fewer_parts(problem, measured, steps, limit, config, t0)
            found += fewer
            profiled += more
        exact += found
        if any(o[0] is not None for o in found):
            kept += 1
            if budget is not None or kept >= len(LATENCY_STRATEGIES):
                break
    if not fit:
        exact += [o for o in guessed if o[0] is None]  # NOTE: their reasons, for the error
    return exact, profiled


def _resplits(problem: Problem, measured: _Step, ks: list[int], t0: float):
    """The last split of ``measured`` made again in each of ``ks`` parts (each profiled, with
    measured costs), while time is left and the region splits."""
    for k in ks:
        if planning_now() - t0 > problem.time_budget_s:
            return
        step = _split(measured.base, measured.region, k, problem.cost_model)
        if isinstance(step, FissionError):
            return
        yield step


# NOTE: measured splits of one region in more parts tried when the estimate undershot; each
# profiles one split graph (seconds on a CPU), and the first that fits ends the search
MORE_PARTS_TRIES = 2


def _more_parts(problem: Problem, measured: _Step, steps: list[_Step],
                why: BudgetInfeasible | None, limit: float, config: FissionConfig, t0: float):
    """The last split of ``measured`` made again in more parts, measured, while it does not
    fit the budget: the scaled estimate can undershoot a part's measured peak (CPU convolutions
    switch to a backend with a larger workspace below a size). Returns (plan or None, why not,
    steps, last measured step, graphs profiled)."""
    profiled = 0
    if measured.region is None:
        return None, why, steps, measured, profiled
    more = [k for k in config.ks if k > measured.k][:MORE_PARTS_TRIES]
    for step in _resplits(problem, measured, more, t0):
        profiled += 1
        if step.sim.peak_bytes >= measured.sim.peak_bytes or step.sim.latency_s > limit:
            break
        measured, steps = step, steps[:-1] + [step]
        sol, why = _remat(problem, problem.cost_model, measured, limit, config, t0)
        if sol is not None:
            return sol, why, steps, measured, profiled
    return None, why, steps, measured, profiled


# NOTE: latency mode: the chosen split made again in this many smaller part counts, measured
FEWER_PARTS_TRIES = 2


def _fewer_parts(problem: Problem, measured: _Step, steps: list[_Step], limit: float,
                 config: FissionConfig, t0: float) -> tuple[list[_Option], int]:
    """Latency mode: the last split of ``measured`` made again in fewer parts, each measured
    and planned with remat on top (the least peak of these and ``measured``'s wins). Returns
    (options, graphs profiled).

    NOTE: the scaled estimate undershoots small parts: on a CPU a matmul of few rows runs
    below the whole one's efficiency (GPT-2 small's loss in 32 parts of 32 tokens measured
    +8.7% of the step against -1.3% in 16 parts, for 3 MiB more peak), and the time fewer parts
    save is the limit's room left to remat."""
    out: list[_Option] = []
    profiled = 0
    if measured.region is None:
        return out, profiled
    fewer = sorted((k for k in config.ks if k < measured.k), reverse=True)[:FEWER_PARTS_TRIES]
    for step in _resplits(problem, measured, fewer, t0):
        profiled += 1
        if step.sim.latency_s > limit:
            continue
        sol, why = _remat(problem, problem.cost_model, step, limit, config, t0)
        out.append((sol, why, steps[:-1] + [step], step))
    return out, profiled


def _greedy(start: _Step, cm, budget: int | None, limit: float, config: FissionConfig,
            deadline: float, strategy: str, memo: dict) -> tuple[list[_Step], _Step, bool]:
    """Splits applied one after another while one lowers the peak: (steps, last, timed out)."""
    steps: list[_Step] = []
    cur = start
    while len(steps) < config.max_splits and (budget is None or cur.sim.peak_bytes > budget):
        rounds_left = config.max_splits - len(steps)
        best, timed_out, seen = _best_split(cur, cm, budget, limit, config, deadline, strategy,
                                            rounds_left, memo)
        if timed_out:
            return steps + ([best] if best else []), best or cur, True
        if best is None:
            break
        if best.base is cur.base and cur.base is not None:
            steps[-1] = best  # NOTE: the last split again, with more parts
        else:
            steps.append(best)
        if strategy == "cheapest":
            best = _walk_parts(cur, best, seen, budget, rounds_left)
            steps[-1] = best
        cur = best
    return steps, cur, False


def _final_key(sol: Solution, budget: int | None) -> tuple:
    """Budget mode: least latency (all fit); latency mode: least peak."""
    if budget is not None:
        return (sol.sim.latency_s, sol.sim.peak_bytes)
    return (sol.sim.peak_bytes, sol.sim.latency_s)


# NOTE: how far split graphs' scaled time estimates err on a CPU, both ways (a loss split in 8
# parts estimated at 1.09x of eager measured 0.82x; convolution row splits the other way)
ESTIMATE_SLACK = 0.10

# NOTE: budget mode grows two greedy paths: "cheapest" buys memory at the least time per byte,
# "deepest" at the least peak per split (fewer, larger splits); each gets remat on top
STRATEGIES = ("cheapest", "deepest")
# NOTE: latency mode grows "least peak" and "cheapest": the split that lowers the eager peak
# most is not always the one that ends lowest once remat is on top (BERT within 1.10x: the
# whole step in 2 parts along its batch lowered the eager peak most, but its parts' weight
# gradients and a nested loss split stopped remat at 0.44x; the loss along its tokens,
# cheaper, left remat the room to reach 0.36x)
LATENCY_STRATEGIES = ("least peak", "cheapest")


def _better(sim: SimResult, than: SimResult | None, cur: SimResult, budget: int | None,
            strategy: str, rounds_left: int) -> bool:
    """"least peak" (latency mode) and "deepest": within the budget the least latency, over
    it the least peak; "cheapest": among splits that close at least their share of the gap to
    the budget (``1 / rounds_left``; one that fits does; in latency mode, every split) the
    most bytes saved per second added, else the least peak."""
    def key(s: SimResult):
        fits = budget is not None and s.peak_bytes <= budget
        if fits and strategy != "cheapest":
            return (0, s.latency_s, s.peak_bytes)
        saved = cur.peak_bytes - s.peak_bytes
        if strategy == "cheapest" and (budget is None
                                       or saved * rounds_left >= cur.peak_bytes - budget):
            return (1, -rate(s, cur), s.peak_bytes)
        return (2, s.peak_bytes, s.latency_s)
    return than is None or key(sim) < key(than)


def _cached(memo: dict, key: tuple, keep, make):
    """``make()``, once per ``key`` in one search (``keep``: the graphs whose ids are in the
    key, held so that no id is reused): the greedy paths start alike and often stay alike."""
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = (keep, make())
    return hit[1]


def _split(base: Graph, region: Region, k: int, cm) -> _Step | FissionError:
    try:
        # NOTE: the search makes ~100 split graphs and keeps one: only that one is verified
        # (solve_fission, before it returns)
        g2 = split_region(base, region, k, verify=False)
    except FissionError as e:
        return e
    return _Step(g2, _simulate(g2, cm), described(base, region, k), base, region, k)


def described(graph: Graph, region: Region, k: int) -> str:
    """A split's name: "12 nodes from _log_softmax dim 0 in 2 parts" (its region's size, the
    value and dim it grew from, the parts; " (rows with a halo)" where parts overlap)."""
    start = graph.values[region.start[0]].name
    halo = " (rows with a halo)" if region.halo else ""
    return f"{len(region.nodes)} nodes from {start} dim {region.start[1]} in {k} parts{halo}"


def _best_split(cur: _Step, cm, budget: int | None, limit: float, config: FissionConfig,
                deadline: float, strategy: str, rounds_left: int,
                memo: dict) -> tuple[_Step | None, bool, list[_Step]]:
    """The best split of one region of ``cur.graph`` that lowers its peak (None: none does);
    the last split made again with more parts is a candidate too (rather than splitting its
    parts one by one). Also returns every split that lowered the peak within the limit."""
    g = cur.graph

    def regions() -> list[tuple[Graph, Region]]:
        starts = peak_starts(g, eager_plan(g), cur.sim, config.max_storages)
        found = [(g, r) for r in candidate_regions(g, starts, config.shares, counting_nodes(g))]
        if config.spatial:
            # NOTE: each in a copy of g with the backward nodes it runs through separated
            found += spatial_candidates(g, starts, config.shares)
        return found

    tries = [(cur.base, cur.region, [k for k in config.ks if k > cur.k])] if cur.region else []
    tries += [(base, r, list(config.ks))
              for base, r in _cached(memo, ("regions", id(g)), g, regions)]
    best: _Step | None = None
    seen: list[_Step] = []
    for base, region, ks in tries:
        last_peak = cur.sim.peak_bytes
        for k in ks:
            if planning_now() > deadline:
                return best, True, seen
            if k > region.length:
                break
            step = _cached(memo, ("split", id(base), region.start, region.nodes, k), base,
                           lambda base=base, region=region, k=k: _split(base, region, k, cm))
            if isinstance(step, FissionError):
                break  # NOTE: the reason does not depend on k
            sim = step.sim
            if sim.peak_bytes >= last_peak:
                break  # NOTE: more parts no longer help this region
            last_peak = sim.peak_bytes
            if sim.latency_s > limit:
                break
            seen.append(step)
            if _better(sim, best.sim if best else None, cur.sim, budget, strategy, rounds_left):
                best = step
            if budget is not None and sim.peak_bytes <= budget:
                break  # NOTE: it fits: more parts of this region only add time
    return best, False, seen


def _remat(problem: Problem, cm, cur: _Step, limit: float, config: FissionConfig,
           t0: float) -> tuple[Solution | None, BudgetInfeasible | None]:
    """The plan on ``cur.graph`` (costs: ``cm``): its eager plan, or hotspot's where remat is
    still needed (over budget) or allowed (latency left under the limit); (None, why) if over
    budget."""
    budget = problem.budget_bytes
    plain = Solution(eager_plan(cur.graph), cur.sim, "fission", 0.0)
    left = max(problem.time_budget_s - (planning_now() - t0), 1.0)
    # NOTE: joint is never slower than hotspot (it starts from hotspot's plan), only slower to
    # search; it offloads only where the host's memory is apart from the device's
    plan_on = (solve_joint if config.offload and cm.host_memory_apart
               else solve_hotspot)
    if budget is not None:
        if cur.sim.peak_bytes <= budget:
            return plain, None
        if not config.remat:
            err = BudgetInfeasible(budget, cur.sim.peak_bytes, dominated_by(cur.sim), "fission")
            err.estimated = cm is not problem.cost_model
            return None, err
        try:
            return plan_on(Problem(cur.graph, cm, budget_bytes=budget, time_budget_s=left)), None
        except BudgetInfeasible as e:
            err = BudgetInfeasible(budget, e.smallest_peak_bytes, e.dominated_by, "fission")
            err.estimated = cm is not problem.cost_model
            if e.solution is not None and not err.estimated:
                # NOTE: the plan at that peak, on the split graph (priced by the problem's own
                # costs: not a search's estimates)
                if cur.graph is not problem.graph:
                    verify_graph(cur.graph)
                err.solution = dataclasses.replace(
                    e.solution, solver="fission",
                    graph=None if cur.graph is problem.graph else cur.graph)
            return None, err
    factor = limit / cur.sim.latency_s
    if not config.remat or factor <= 1.0:
        return plain, None
    sol = plan_on(Problem(cur.graph, cm, latency_limit=factor, time_budget_s=left))
    return (sol if sol.sim.peak_bytes < cur.sim.peak_bytes else plain), None
