"""The search over parallel configurations: the fastest one that fits every device.

Candidates: tensor-parallel widths that divide the devices and fit one node (a tensor-parallel
group's collectives run every layer), pipeline depths that divide the rest, the data-parallel
degree they leave (it must divide the global batch), micro-batch sizes, schedules (GPipe,
1F1B, interleaved 1F1B with 2 or more chunks, ZB-H1, ZB-V), ZeRO stages, sequence parallelism; each
stage's memory plan is chosen inside (``dist.evaluate``). ``fixed`` pins any field (``--fix``).

Branch and bound: each candidate's lower bound is its busiest device's compute with perfect
balance, no bubble and no recompute (blocks priced once per width and micro-batch); candidates
go in the order of their bounds and the search stops at the first bound above the best step
found. Candidates whose weights, gradients and optimizer state alone overflow a device are
dropped before pricing. The closed-form pipeline time ranks; the ``top`` best are then
simulated event by event and the fastest simulated one is the plan. Deterministic: ties go to
the candidate listed first (smaller widths, fewer stages first).

Example:
    >>> from fitgraph.dist.cluster import dgx_a100
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> from fitgraph.dist.model import GptModel
    >>> found = search(GptModel(GptShape(24, 2304, 24)), dgx_a100(1), global_batch=64)
    >>> found.best.fits, found.best.parallelism.devices, found.evaluated <= found.candidates
    (True, 8, True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .block_cost import price_blocks
from .cluster import Cluster
from .config import ALL_SCHEDULES, Parallelism
from .evaluate import Prediction, default_budget, evaluate
from .memory import MIXED_ADAM, Precision, optimizer_step_bytes, parameter_bytes
from .model import ModelSpec
from .ops import stage_params
from .stage_cuts import stage_widths

__all__ = ["SearchResult", "bound_terms", "candidates", "lower_bound", "search"]

MICRO_BATCHES = (1, 2, 4, 8, 16)
CHUNKS = (2, 4)


@dataclass
class SearchResult:
    best: Prediction | None
    candidates: int
    evaluated: int
    simulated: int
    seconds: float
    ranked: list[Prediction] = field(default_factory=list)  # the simulated ones, best first
    rejected: dict[str, int] = field(default_factory=dict)   # why candidates were dropped
    closest: Prediction | None = None   # of those over budget, the least peak (its binding)
    least_static: float = 0.0           # the least weights + gradients + optimizer per device
    budget: float = 0.0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, cluster: Cluster, global_batch: int,
               fixed: dict | None = None, *, n_blocks: int,
               max_tp: int | None = None) -> list[Parallelism]:
    """Every configuration the search weighs, in a fixed order."""
    fixed = dict(fixed or {})
    n = cluster.devices
    max_tp = max_tp or cluster.devices_per_node
    out = []
    per_stage: set[tuple] = set()
    tps = [fixed["tp"]] if "tp" in fixed else [t for t in _divisors(n) if t <= max_tp]
    for tp in tps:
        if n % tp:
            continue
        pps = [fixed["pp"]] if "pp" in fixed else _divisors(n // tp)
        for pp in pps:
            if (n // tp) % pp or pp > n_blocks:
                continue
            dp = n // (tp * pp)
            if "dp" in fixed and fixed["dp"] != dp:
                continue
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            mbs = ([fixed["micro_batch"]] if "micro_batch" in fixed
                   else [b for b in MICRO_BATCHES if per_replica % b == 0])
            for b in mbs:
                if per_replica % b:
                    continue
                m = per_replica // b
                if "n_micro" in fixed and fixed["n_micro"] != m:
                    continue
                for sp in ([fixed["sp"]] if "sp" in fixed else ([False, True] if tp > 1
                                                                else [False])):
                    if sp and tp == 1:
                        continue
                    if model.why_not(tp, b, sp):
                        continue
                    for schedule, chunks in _schedules(pp, m, n_blocks, fixed):
                        # NOTE: ZeRO-1 moves the bytes ZeRO-0's all-reduce moves and updates
                        # 1/dp of the parameters: never slower, never larger (Megatron's
                        # distributed optimizer); ZeRO-0 is searched only without replicas
                        zeros = ([fixed["zero"]] if "zero" in fixed
                                 else ([1, 2] + ([3] if pp == 1 else [])) if dp > 1 else [0])
                        # NOTE: "max_zero": an optimizer that needs each matrix whole (Muon)
                        for zero in (z for z in zeros if z <= fixed.get("max_zero", 3)):
                            par = Parallelism(
                                tp=tp, pp=pp, dp=dp, micro_batch=b, n_micro=m,
                                schedule=schedule, chunks=chunks, zero=zero, sp=sp,
                                recompute=fixed.get("recompute", "auto"),
                                overlap_grad_reduce=fixed.get("overlap_grad_reduce", True))
                            out.append(par)
                            # NOTE: stages of their own widths (Piper's heterogeneous
                            # stages): one candidate per devices-per-stage, micro-batch,
                            # schedule, ZeRO and SP; each stage picks its tp x dp
                            key = (tp * dp, pp, b * dp, schedule, zero, sp)
                            if (pp > 1 and chunks == 1 and key not in per_stage
                                    and fixed.get("per_stage", True)
                                    and not {"tp", "dp"} & set(fixed)):
                                per_stage.add(key)
                                out.append(par.replace(per_stage=True))
    return out


def _schedules(pp: int, m: int, n_blocks: int, fixed: dict):
    names = [fixed["schedule"]] if "schedule" in fixed else list(ALL_SCHEDULES)
    for name in names:
        if name not in ALL_SCHEDULES:
            raise ValueError(f"unknown schedule {name!r}: one of {ALL_SCHEDULES}")
        if pp == 1 and name != "1f1b" and "schedule" not in fixed:
            continue                          # one stage: every schedule is the same
        if name == "interleaved":
            vs = [fixed["chunks"]] if "chunks" in fixed else list(CHUNKS)
            for v in vs:
                if v > 1 and m % pp == 0 and n_blocks - 2 >= pp * v:
                    yield name, v
        elif name == "zb-v":
            if pp > 1 and n_blocks - 2 >= 2 * pp and fixed.get("chunks", 2) == 2:
                yield name, 2
        else:
            if fixed.get("chunks", 1) == 1:
                yield name, 1


def _bound(par: Parallelism, seconds: float, params: float, precision: Precision,
           cluster: Cluster) -> float:
    """No step of ``par`` is shorter: a perfectly balanced stage's ``n_micro`` micro-batches
    (``seconds`` is one micro-batch through every block), the schedule's least bubble, the
    optimizer step of a stage's share of the parameters."""
    stage = seconds / par.pp
    if par.schedule in ("1f1b", "gpipe"):
        fill = (par.pp - 1) * stage
    elif par.schedule == "interleaved":
        fill = (par.pp - 1) * stage / par.chunks
    else:
        fill = 0.0
    opt = optimizer_step_bytes(params / par.pp, precision, par.zero, par.dp)
    return par.n_micro * stage + fill + opt / cluster.device.bandwidth


def _per_block(model: ModelSpec, cluster: Cluster, width: tuple, precision: Precision,
               priced: dict) -> tuple[list[float], float]:
    """(seconds of one micro-batch through each block, parameters) at a stage width (tp, dp,
    per-replica micro-batch, sequence parallel); ``priced`` is the evaluation's cache, so the
    blocks priced here are not priced again."""
    key = ("bound", width)
    if key not in priced:
        t, _, b, sp = width
        blocks = model.blocks(t, b, sp)
        costs = price_blocks(blocks, cluster.device, cluster.link(range(t)),
                             precision.activation_dtype, priced)
        priced[key] = ([c.fwd_s + c.bwd_s for c in costs], stage_params(blocks))
    return priced[key]


def bound_terms(model: ModelSpec, cluster: Cluster, par: Parallelism, precision: Precision,
                priced: dict | None = None) -> tuple[float, float, int]:
    """(seconds, parameters, dp) that bound ``par`` below: its own width's, or for stages of
    their own widths each block at its fastest width and the parameters of the width that
    holds the fewest per device (``priced``: a dict to share across calls)."""
    priced = {} if priced is None else priced
    fastest, least = None, None
    for width in stage_widths(model, cluster, par):
        times, params = _per_block(model, cluster, width, precision, priced)
        fastest = times if fastest is None else [min(a, b) for a, b in zip(fastest, times)]
        if least is None or params / width[1] < least[0] / least[1]:
            least = (params, width[1])
    if fastest is None:
        times, params = _per_block(model, cluster, (par.tp, par.dp, par.micro_batch, par.sp),
                                   precision, priced)
        return sum(times), params, par.dp
    return sum(fastest), least[0], least[1]


def lower_bound(model: ModelSpec, cluster: Cluster, par: Parallelism, precision: Precision,
                priced: dict | None = None) -> float:
    """No step of ``par`` is shorter (what branch and bound orders and stops by)."""
    seconds, params, _ = bound_terms(model, cluster, par, precision, priced)
    return _bound(par, seconds, params, precision, cluster)


def search(model: ModelSpec, cluster: Cluster, global_batch: int, *,
           fixed: dict | None = None, precision: Precision = MIXED_ADAM,
           budget: float | None = None, top: int = 6,
           max_tp: int | None = None) -> SearchResult:
    """The fastest configuration of ``model`` on ``cluster`` at ``global_batch`` samples per
    step that fits every device (``best`` is None when none fits; ``rejected`` counts why)."""
    start = time.perf_counter()
    budget = default_budget(cluster) if budget is None else budget
    n_blocks = len(model.blocks(1, 1, False))
    cands = candidates(model, cluster, global_batch, fixed, n_blocks=n_blocks, max_tp=max_tp)
    rejected: dict[str, int] = {}
    # NOTE: one cache for the bounds and the evaluations: a block priced for a bound is not
    # priced again when its candidate is evaluated
    cache: dict = {}

    bounded = []
    least_static = float("inf")
    for par in cands:
        seconds, params, dp = bound_terms(model, cluster, par, precision, cache)
        static = sum(parameter_bytes(params / par.pp, precision, par.zero, dp).values())
        least_static = min(least_static, static)
        if static > budget:
            rejected["weights, gradients and optimizer state alone"] = (
                rejected.get("weights, gradients and optimizer state alone", 0) + 1)
            continue
        bounded.append((_bound(par, seconds, params, precision, cluster), par))
    bounded.sort(key=lambda x: x[0])           # stable: ties keep the listed order
    ranked: list[tuple[float, int, Prediction]] = []
    evaluated = 0
    closest: Prediction | None = None
    for i, (bound, par) in enumerate(bounded):
        if len(ranked) >= top and bound >= ranked[top - 1][0]:
            break
        pred = evaluate(model, cluster, par, precision=precision, budget=budget,
                        simulated=False, cache=cache)
        evaluated += 1
        if pred is None:
            rejected["cannot be cut into its stages"] = rejected.get(
                "cannot be cut into its stages", 0) + 1
            continue
        if not pred.fits:
            rejected["a device's peak above the budget"] = rejected.get(
                "a device's peak above the budget", 0) + 1
            if closest is None or pred.peak_bytes_per_device < closest.peak_bytes_per_device:
                closest = pred
            continue
        ranked.append((pred.step_s, i, pred))
        ranked.sort(key=lambda x: (x[0], x[1]))
        del ranked[top:]
    simulated = []
    for _, i, pred in ranked:
        sim = evaluate(model, cluster, pred.parallelism, precision=precision, budget=budget,
                       cache=cache)
        if sim is not None and sim.fits:
            simulated.append((sim.step_s, i, sim))
    simulated.sort(key=lambda x: (x[0], x[1]))
    best = simulated[0][2] if simulated else None
    return SearchResult(best, len(cands), evaluated, len(simulated),
                        time.perf_counter() - start, [s for _, _, s in simulated], rejected,
                        closest, least_static if cands else 0.0, budget)
