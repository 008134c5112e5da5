"""One parallel configuration, predicted: its stages and memory plans, every device's time and
memory.

The step of a ``Parallelism`` on a cluster: the model's blocks at its tensor-parallel width and
micro-batch, priced on the device (``dist.block_cost``), cut into pipeline stages (the least
bottleneck, each stage with the memory plan that fits its device: ``dist.partition``,
``dist.stage``), the schedule simulated across the stages (``dist.simulate``: compute, the
point-to-point sends between stages, each stage's activations held), then each stage's
data-parallel gradient reduction (overlapped with its last backward where asked), the tied
embedding's reduction between the first and last stage, and the optimizer step. ZeRO-3 gathers
a stage's weights in every micro-batch's forward and backward, block by block, prefetched
beside compute (all but the first block's gather and the last one's reduce-scatter hidden).

The interleaved and ZB-V schedules cut the model into ``pp × chunks`` chunks (the embedding on
the first, the head on the last), the body's blocks shared out so that the devices' work is
even (``dist.chunks``).

Example:
    >>> from fitgraph.dist.cluster import dgx_a100
    >>> from fitgraph.dist.config import Parallelism
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> from fitgraph.dist.model import GptModel
    >>> par = Parallelism(tp=2, pp=2, dp=2, micro_batch=1, n_micro=8)
    >>> pred = evaluate(GptModel(GptShape(24, 2304, 24)), dgx_a100(1), par)
    >>> pred.fits, len(pred.stages), pred.step_s > 0
    (True, 2, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .block_cost import price_blocks
from .chunks import chunk_ranges as chunk_ranges_of
from .chunks import device_plan, held_vectors
from .cluster import Cluster
from .collectives import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s
from .config import Parallelism
from .memory import MIXED_ADAM, Precision, optimizer_step_bytes
from .model import ModelSpec
from .ops import stage_params
from .schedules import in_flight
from .simulate import ZB_W_HOLD, Timeline, chunk_device, simulate
from .stage import StagePlan
from .stage_cuts import cut_stages, stage_planner, stage_widths

__all__ = ["GIB", "Prediction", "StageReport", "default_budget", "evaluate"]

GIB = 2**30
# NOTE: what a GPU process holds besides tensors (CUDA context, NCCL's buffers, the caching
# allocator's fragmentation) is commonly 1-3 GiB; plans leave 2 GiB of each device free.
RESERVE_BYTES = 2 * GIB


def default_budget(cluster: Cluster) -> float:
    return max(cluster.device.memory_bytes - RESERVE_BYTES, cluster.device.memory_bytes * 0.5)


@dataclass(frozen=True)
class StageReport:
    """One pipeline stage (``pp`` of them; each runs on ``tp × dp`` devices alike)."""

    index: int
    tp: int                        # this stage's tensor-parallel width
    dp: int                        # and data-parallel degree
    plan: StagePlan                # blocks, memory plan, per-micro-batch seconds, bytes
    ranks: tuple[int, ...]
    busy_s: float                  # compute over the step
    bubble_s: float                # idle inside the pipeline part of the step
    tp_comm_s: float               # tensor-parallel collectives inside busy_s
    p2p_s: float                   # sending one micro-batch's activations to the next stage
    dp_sync_s: float               # gradient reduction (+ ZeRO's gather), exposed
    tied_sync_s: float             # tied embedding/head gradient reduction, exposed
    optimizer_s: float
    end_s: float                   # when this stage's devices finish the step
    activations: float             # bytes held at the schedule's worst moment (simulated)

    @property
    def peak_bytes(self) -> float:
        p = self.plan
        return p.weights + p.gradients + p.optimizer + self.activations + p.working_bytes

    def memory(self) -> dict[str, float]:
        p = self.plan
        return {"weights": p.weights, "gradients": p.gradients, "optimizer": p.optimizer,
                "activations": self.activations, "working": p.working_bytes}


@dataclass(frozen=True)
class Prediction:
    """A configuration's predicted step: ``fits`` when every device's peak is within budget
    (else ``binding`` names the stage and the memory term that does not fit)."""

    model: str
    parallelism: Parallelism
    stages: tuple[StageReport, ...]
    step_s: float
    pipeline_s: float
    budget_bytes: float
    tokens_per_s: float
    tflops_per_device: float       # FLOPs executed (recompute included) per second per device
    mfu: float                     # the model's FLOPs (no recompute) over the datasheet peak
    model_flops: float
    executed_flops: float
    fits: bool
    binding: str = ""
    timeline: Timeline | None = field(default=None, compare=False, repr=False)
    # the pipeline's chunks (virtual stages) in order: (device, block names); one per device
    # unless the schedule runs several chunks per device (interleaved, ZB-V)
    chunks: tuple[tuple[int, tuple[str, ...]], ...] = ()

    @property
    def peak_bytes_per_device(self) -> float:
        return max(s.peak_bytes for s in self.stages)


def evaluate(model: ModelSpec, cluster: Cluster, par: Parallelism, *,
             precision: Precision = MIXED_ADAM, budget: float | None = None,
             simulated: bool = True, cache: dict | None = None) -> Prediction | None:
    """The predicted step of ``par``; None when the configuration cannot be cut at all (fewer
    blocks than stages, a model that cannot be split so). With ``simulated=False`` the
    pipeline's time is the closed form of its schedule (what the search ranks with). ``cache``
    (any dict, kept by the caller) shares priced blocks and stage plans across calls."""
    cache = {} if cache is None else cache
    if par.devices != cluster.devices:
        raise ValueError(f"{par.tp}x{par.pp}x{par.dp} = {par.devices} devices on a cluster of "
                         f"{cluster.devices}")
    why = model.why_not(par.tp, par.micro_batch, par.sp)
    if why and not (par.per_stage or par.widths):
        raise ValueError(why)
    budget = default_budget(cluster) if budget is None else budget
    # the widths a stage may take: (tp, dp, per-replica micro-batch, sequence parallel)
    widths = stage_widths(model, cluster, par)
    if not widths:
        raise ValueError(why or f"no stage width of {par.tp * par.dp} devices runs {model.name}")
    built = {w: model.blocks(w[0], w[2], w[3]) for w in widths}
    priced = {w: price_blocks(built[w], cluster.device, cluster.link(range(w[0])),
                              precision.activation_dtype, cache) for w in widths}
    base = (par.tp, par.dp, par.micro_batch, par.sp)
    if base not in priced:
        base = widths[0]
    costs = priced[base]
    names = [b.name for b in built[base]]
    p, m, v = par.pp, par.n_micro, par.chunks
    shape_schedule = "1f1b" if par.schedule in ("zb-h1", "zb-v") else par.schedule

    devices_of = [chunk_device(par.schedule, p, v, c) for c in range(p * v)]
    cpu = cluster.device.name.startswith("cpu")
    dev = devices_of.__getitem__

    if par.schedule == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) a multiple of "
                         f"the stages ({p})")
    flights = [in_flight(shape_schedule, p, m, k, 1 if par.schedule == "zb-v" else v)
               for k in range(p)]
    if par.schedule == "zb-h1":
        # NOTE: ZB-H1 holds 1F1B's micro-batches whole until their B and, on stage k, k more
        # partly (what their deferred W reads) until their W (``dist.simulate``).
        flights = [min(p - k, m) + min(k, max(0, m - (p - k))) * ZB_W_HOLD for k in range(p)]
    if v == 1:
        prefixes = {}
        for w in widths:
            acc = [0.0]
            for c in priced[w]:
                acc.append(acc[-1] + c.fwd_s + c.bwd_s)
            prefixes[w] = acc
        # NOTE: the fastest width first, so that the others are mostly skipped
        order = sorted(widths, key=lambda w: prefixes[w][-1])

        def options(room):
            out = []
            for w in order:
                plan = stage_planner(priced[w], flights, room, precision, par.zero, w[1],
                                      par.recompute, cache, cluster.device)
                if par.widths:
                    def allowed(k, w=w):
                        return tuple(par.widths[k]) == w[:2]
                else:
                    def allowed(k):
                        return True
                out.append((w, plan, allowed, prefixes[w]))
            return out

        cut = cut_stages(options(budget), len(names), p, names)
        if cut is None and par.recompute == "auto":
            # nothing fits: cut as if memory were free, to say what does not fit
            cut = cut_stages(options(math.inf), len(names), p, names)
        if cut is None:
            return None
        chunk_ranges = [(a, b) for a, b, _, _ in cut]
        chunk_width = [w for _, _, w, _ in cut]
        plans = [st for _, _, _, st in cut]
        chunk_opts = [st.plan for st in plans]
    else:
        chunk_ranges = chunk_ranges_of(costs, p, v, dev)
        if not chunk_ranges:
            return None
        chunk_width = [base] * len(chunk_ranges)
        plans, chunk_opts = [], [None] * (p * v)
        for d in range(p):
            mine = [c for c in range(p * v) if devices_of[c] == d]
            idx = [i for c in mine for i in range(*chunk_ranges[c])]
            vectors = held_vectors(par.schedule, p, m, d, v, cache)
            # NOTE: configurations of one width and micro-batch share their devices' plans
            key = ("device", tuple(id(costs[i]) for i in idx),
                   tuple(b - a for a, b in (chunk_ranges[c] for c in mine)), vectors, budget,
                   precision, par.zero, par.dp, par.recompute, cpu)
            st = cache.get(key)
            if st is None:
                st = cache[key] = device_plan(costs, idx, [names[i] for i in idx],
                                                     [chunk_ranges[c] for c in mine], vectors,
                                                     budget, precision, par, cpu)
            plans.append(replace(st, blocks=tuple(names[i] for i in idx)))
            pos = 0
            for c in mine:
                size = chunk_ranges[c][1] - chunk_ranges[c][0]
                chunk_opts[c] = st.plan[pos:pos + size]
                pos += size
    fwd, bwd, wgt, act, tp_comm = [], [], [], [], []
    for (a, b), opts, w in zip(chunk_ranges, chunk_opts, chunk_width):
        cs = priced[w][a:b]
        chosen = [c.option(o) for c, o in zip(cs, opts)]
        fwd.append(sum(c.fwd_s for c in cs))
        bwd.append(sum(c.bwd_s for c in cs) + sum(o.recompute_s for o in chosen))
        wgt.append(sum(c.bwd_w_s for c in cs))
        act.append(sum(o.kept_bytes for o in chosen))
        tp_comm.append(sum(c.fwd_comm_s + c.bwd_comm_s for c in cs)
                       + sum(o.recompute_s * (c.fwd_comm_s / c.fwd_s if c.fwd_s else 0)
                             for c, o in zip(cs, chosen)))
    par = par if not par.per_stage else par.replace(
        per_stage=False, widths=tuple(chunk_width[k][:2] for k in range(p)))
    for c, (a, b) in enumerate(chunk_ranges):
        dp_c = chunk_width[c][1]
        if dp_c == 1 or par.zero < 2 or (par.zero == 2 and m == 1):
            continue
        cs = priced[chunk_width[c]][a:b]
        params = stage_params([x.block for x in cs])
        link = cluster.link(par.dp_group(dev(c)))
        if par.zero == 2:
            # NOTE: ZeRO-2 keeps only its shard of the gradients, so every micro-batch's
            # gradients are reduce-scattered as its backward makes them (hidden behind it up
            # to its length), not accumulated whole and reduced once
            bwd[c] = max(bwd[c], reduce_scatter_s(params * precision.grad, dp_c, link))
            continue
        # NOTE: FSDP gathers a chunk's weights for its forward and again for its backward and
        # reduce-scatters its gradients, every micro-batch, prefetched beside compute; the
        # first block's gather (forward) and the last one's reduce-scatter (backward) have
        # nothing to hide behind
        gather = all_gather_s(params * precision.weight, dp_c, link)
        scatter = reduce_scatter_s(params * precision.grad, dp_c, link)
        block = max(stage_params([x.block]) for x in cs)
        first = all_gather_s(block * precision.weight, dp_c, link)
        last = reduce_scatter_s(block * precision.grad, dp_c, link)
        fwd[c] = max(fwd[c], gather) + first
        bwd[c] = max(bwd[c], gather + scatter) + first + last
    devices_per_stage = par.tp * par.dp
    p2p = []
    for c in range(len(chunk_ranges) - 1):
        (t0, d0, _, sp0), (t1, d1, _, sp1) = chunk_width[c], chunk_width[c + 1]
        out = built[chunk_width[c]][chunk_ranges[c][1] - 1].output_bytes
        src, dst = par.rank(dev(c), 0, 0), par.rank(dev(c + 1), 0, 0)
        if src == dst:
            p2p.append(0.0)
            continue
        link = cluster.link([src, dst])
        # NOTE: the micro-batch's activation (``out`` is one device's: a replica's, sharded
        # by sequence parallelism) crosses spread over every device of the stage, and where
        # the next stage's tensor-parallel ranks need it whole they all-gather it over their
        # link — Megatron's scatter-gather (SC'21 §4.1); stages of other widths reshard so
        whole = out * (t0 if sp0 else 1) * d0
        cost = p2p_s(whole / devices_per_stage, link)
        if t1 > 1 and not sp1:
            cost += all_gather_s(whole / d1, t1, cluster.link(par.stage_tp_group(dev(c + 1))))
        p2p.append(cost)
    zb = par.schedule in ("zb-h1", "zb-v")
    timeline = None
    if simulated:
        timeline = simulate(par.schedule, fwd, [b - w for b, w in zip(bwd, wgt)] if zb else bwd,
                            m, v=v, p2p_s=p2p, act_bytes=act, w_s=wgt if zb else None)
        ends = list(timeline.end_s)
        busy = list(timeline.busy_s)
        # NOTE: the simulator holds every in-flight micro-batch on the device; what the memory
        # plan parks in host memory at the worst moment is not there
        held = [timeline.peak_bytes[d] - plans[d].offload_bytes for d in range(p)]
        pipeline = timeline.makespan_s
    else:
        per_dev = [0.0] * p
        for c in range(len(fwd)):
            per_dev[dev(c)] += fwd[c] + bwd[c]
        worst = max(per_dev)
        # NOTE: in a 1F1B steady state a balanced stage waits for each micro-batch's
        # activation and gradient to arrive: the sends add to every cycle (GPipe streams its
        # forwards, then its backwards, and pays them once)
        hop = 2 * max(p2p, default=0.0)
        if par.schedule == "zb-v":
            # NOTE: ZB-V's fill is one chunk forward per stage (``dist.simulate``)
            pipeline = m * (worst + hop) + (p - 1) * max(fwd) + 2 * sum(p2p)
        elif zb:
            idle = max(max(0.0, f + b - 2 * w) for f, b, w in zip(fwd, bwd, wgt))
            pipeline = m * (worst + hop) + (p - 1) * idle + 2 * sum(p2p)
        elif v > 1:
            pipeline = (m + (p - 1) / v) * (worst + v * hop) + 2 * sum(p2p)
        elif par.schedule == "gpipe":
            pipeline = sum(per_dev) + (m - 1) * worst + 2 * sum(p2p)
        else:
            pipeline = sum(per_dev) + (m - 1) * (worst + hop) + 2 * sum(p2p)
        ends = [pipeline] * p
        busy = [m * x for x in per_dev]
        held = [plans[d].held_bytes for d in range(p)]
    # NOTE: a parameter shared by blocks of different stages (a tied embedding and head) is a
    # copy on each; their gradients are all-reduced between those stages after the backward
    holding: dict[str, tuple[float, set[int]]] = {}
    for c, (a, b) in enumerate(chunk_ranges):
        for block in built[chunk_width[c]][a:b]:
            for name, count in block.shared:
                holding.setdefault(name, (count, set()))[1].add(dev(c))
    shared = {k: (v[0], sorted(v[1])) for k, v in holding.items() if len(v[1]) > 1}
    stages = []
    for d in range(p):
        st = plans[d]
        t_d, dp_d = par.stage_width(d)
        link = cluster.link(par.dp_group(d))
        grads = st.params * precision.grad
        if dp_d == 1 or par.zero >= 3:
            sync = 0.0
        elif par.zero == 0:
            sync = all_reduce_s(grads, dp_d, link)
        else:
            # ZeRO-1: the reduce-scatter of the gradients; ZeRO-2: the last micro-batch's
            # (the others ran inside their backwards); both: the gather of updated weights
            sync = (reduce_scatter_s(grads, dp_d, link)
                    + all_gather_s(st.params * precision.weight, dp_d, link))
        last_bwd = sum(bwd[c] for c in range(len(fwd)) if devices_of[c] == d)
        exposed = max(0.0, sync - last_bwd) if par.overlap_grad_reduce else sync
        tied = sum(all_reduce_s(count * precision.grad, len(holders),
                                cluster.link([par.rank(k, 0, 0) for k in holders]))
                   for name, (count, holders) in shared.items() if d in holders)
        opt = optimizer_step_bytes(st.params, precision, par.zero, dp_d) / cluster.device.bandwidth
        end = ends[d] + exposed + tied + opt
        stages.append(StageReport(
            index=d, tp=t_d, dp=dp_d, plan=st, ranks=tuple(par.stage_ranks(d)), busy_s=busy[d],
            bubble_s=max(0.0, pipeline - busy[d]),
            tp_comm_s=m * sum(tp_comm[c] for c in range(len(fwd)) if devices_of[c] == d),
            p2p_s=p2p[d] if d < len(p2p) else 0.0, dp_sync_s=exposed, tied_sync_s=tied,
            optimizer_s=opt, end_s=end, activations=held[d]))
    step = max(s.end_s for s in stages)
    samples = par.global_batch
    model_flops = model.model_flops(samples)
    recompute_flops = sum(st.recompute_flops for st in plans) * devices_per_stage * m
    executed = model_flops + recompute_flops
    peak_dtype = precision.activation_dtype
    peak = cluster.device.peak_flops.get(peak_dtype, cluster.device.peak_flops["float32"])
    over = [(s.peak_bytes - budget, s) for s in stages if s.peak_bytes > budget * (1 + 1e-9)]
    binding = ""
    if over:
        _, worst_stage = max(over, key=lambda x: x[0])
        terms = worst_stage.memory()
        term = max(terms, key=terms.get)
        binding = (f"stage {worst_stage.index} needs {worst_stage.peak_bytes / GIB:.1f} GiB of "
                   f"{budget / GIB:.1f} GiB; its largest term is {term} "
                   f"({terms[term] / GIB:.1f} GiB)")
    return Prediction(
        model=model.name, parallelism=par, stages=tuple(stages), step_s=step,
        pipeline_s=pipeline, budget_bytes=budget,
        tokens_per_s=samples * model.seq / step,
        tflops_per_device=executed / step / par.devices / 1e12,
        mfu=model_flops / step / par.devices / peak, model_flops=model_flops,
        executed_flops=executed, fits=not over, binding=binding, timeline=timeline,
        chunks=tuple((dev(c), tuple(names[a:b])) for c, (a, b) in enumerate(chunk_ranges)))
