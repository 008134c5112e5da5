"""Cutting a chain of blocks into pipeline stages, each stage under its memory plan and, where
the configuration lets stages split their devices their own way, at its own width.

``stage_widths`` lists the (tp, dp, per-replica micro-batch, sequence parallel) a stage may
take; ``stage_planner`` prices blocks ``first..last-1`` as stage ``k`` (memoized); ``cut_stages``
cuts for the least bottleneck (``dist.partition``), each stage the fastest width allowed it.

Example:
    >>> from fitgraph.dist.cluster import dgx_a100
    >>> from fitgraph.dist.config import Parallelism
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> from fitgraph.dist.model import GptModel
    >>> par = Parallelism(tp=2, pp=2, dp=2, micro_batch=2, n_micro=8, per_stage=True)
    >>> [w[:2] for w in stage_widths(GptModel(GptShape(8, 1024, 16)), dgx_a100(1), par)]
    [(1, 4), (2, 2), (4, 1)]
"""

from __future__ import annotations

from dataclasses import replace

from .cluster import Cluster
from .config import Parallelism
from .model import ModelSpec
from .partition import partition_bisect, partition_dp
from .stage import StagePlan, plan_stage

__all__ = ["DP_SIZE_LIMIT", "cut_stages", "host_bandwidth", "stage_planner", "stage_widths"]

DP_SIZE_LIMIT = 20_000  # blocks² × stages up to which the exact DP cuts the stages


def stage_widths(model: ModelSpec, cluster: Cluster, par: Parallelism) -> list[tuple]:
    """The (tp, dp, per-replica micro-batch, sequence parallel) a stage of ``par`` may take:
    its one width, its ``widths``, or (``per_stage``) every split of its devices whose tensor
    parallelism stays in a node and that the model can run."""
    devices = par.tp * par.dp
    samples = par.micro_batch * par.dp

    def width(t: int, d: int) -> tuple | None:
        if samples % d:
            return None
        w = (t, d, samples // d, par.sp and t > 1)
        return None if model.why_not(w[0], w[2], w[3]) else w

    if par.widths:
        got = [width(t, d) for t, d in dict.fromkeys(par.widths)]
        return [w for w in got if w is not None]
    if not par.per_stage:
        return [(par.tp, par.dp, par.micro_batch, par.sp)]
    out = []
    for t in range(1, min(devices, cluster.devices_per_node) + 1):
        if devices % t == 0:
            w = width(t, devices // t)
            if w is not None:
                out.append(w)
    return out


def host_bandwidth(device) -> float | None:
    """Where activations may be parked: host memory apart from the device's (a GPU's, over
    PCIe; on a CPU "host" is the same memory and parking frees nothing)."""
    return device.host_bandwidth if device.host_memory_apart else None


def stage_planner(costs, flights, budget, precision, zero: int, dp: int, recompute: str,
                   cache: dict, cluster_device):
    """``plan(first, last, k)``: blocks ``first..last-1`` as stage ``k`` under its memory plan
    (None when they cannot fit), memoized."""
    n = len(costs)
    ids = [id(c) for c in costs]
    uniform = len(set(ids[1:-1])) <= 1
    # NOTE: a stage's plan depends on its blocks' costs (shared across configurations of one
    # width and micro-batch through ``cache``), its in-flight count and its memory terms.
    host = host_bandwidth(cluster_device)
    cpu = cluster_device.name.startswith("cpu")
    setting = (budget, precision, zero, dp, recompute, host, cpu)
    memo = cache.setdefault(("stages", ids[0], ids[1] if n > 1 else 0, ids[-1], uniform, n,
                             setting), {})

    def plan(first: int, last: int, k: int) -> StagePlan | None:
        key = ((first == 0, last == n, last - first, flights[k]) if uniform
               else (tuple(ids[first:last]), flights[k]))
        hit = memo.get(key, memo)
        if hit is memo:
            hit = memo[key] = plan_stage(costs[first:last], flights[k], budget, precision,
                                         zero, dp, recompute, host_bandwidth=host, cpu=cpu)
        return hit

    return plan


def cut_stages(options, n: int, p: int, names):
    """Cut ``n`` blocks into ``p`` stages; ``options`` = [(width, plan function)] a stage
    may take (each stage the fastest of those allowed it: ``allowed(k)``). Returns per stage
    (first, last, width, plan) or None."""
    def best(first: int, last: int, k: int):
        got = None
        for width, plan, allowed, prefix in options:
            if not allowed(k):
                continue
            # NOTE: no plan is faster than its blocks without recompute: skip a width whose
            # bare work is no better than the best plan found
            if got is not None and prefix[last] - prefix[first] >= got[1].time_s:
                continue
            st = plan(first, last, k)
            if st is not None and (got is None or st.time_s < got[1].time_s):
                got = (width, st)
        return got

    def time(first: int, last: int, k: int) -> float | None:
        got = best(first, last, k)
        return None if got is None else got[1].time_s

    solver = partition_dp if n * n * p <= DP_SIZE_LIMIT else partition_bisect
    cuts = solver(n, p, time)
    if cuts is None:
        return None
    out = []
    for k, (a, b) in enumerate(cuts):
        width, st = best(a, b, k)
        out.append((a, b, width, replace(st, blocks=tuple(names[a:b]))))
    return out
