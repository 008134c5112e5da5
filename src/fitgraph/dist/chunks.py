"""Multi-chunk schedules (interleaved 1F1B, ZB-V): where the chunks' blocks are cut, and one
device's memory plan over its chunks, planned for the micro-batches each chunk holds at the
device's worst moment.

Example:
    >>> from fitgraph.cost.devices import get_device
    >>> from fitgraph.dist.block_cost import price_block
    >>> from fitgraph.dist.cluster import LINKS
    >>> from fitgraph.dist.gpt_blocks import gpt_blocks
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> blocks = gpt_blocks(GptShape(8, 1024, 16), 1, 1)
    >>> costs = [price_block(b, get_device("a100-80gb"), LINKS["nvlink3"]) for b in blocks]
    >>> chunk_ranges(costs, 2, 2, lambda c: c % 2)
    [(0, 4), (4, 6), (6, 8), (8, 10)]
"""

from __future__ import annotations

import math
from dataclasses import replace

from .config import Parallelism
from .schedules import chunks_held, zbv_held
from .stage import StagePlan, plan_stage

__all__ = ["chunk_ranges", "device_plan", "held_vectors"]


def chunk_ranges(costs, p: int, v: int, dev) -> list[tuple[int, int]]:
    """Block ranges of ``p × v`` chunks (chunk ``c`` on device ``dev(c)``): the embedding with
    chunk 0, the head with the last, the body in order, each device given as many body blocks
    as evens out the devices' work (the ends' devices fewer: their embedding and head weigh),
    split evenly over its chunks. Megatron-LM spreads the body evenly instead; with a heavy
    head (a large vocabulary) that leaves the other devices waiting on the head's."""
    n, chunks = len(costs), p * v
    body = n - 2
    if body < chunks:
        return []
    work = [c.fwd_s + c.bwd_s for c in costs]
    unit = sum(work[1:-1]) / body
    load = [0.0] * p
    load[dev(0)] += work[0]
    load[dev(chunks - 1)] += work[-1]
    share = [v] * p                       # body blocks per device, one per chunk at least
    for d in range(p):
        load[d] += v * unit
    for _ in range(body - chunks):
        d = min(range(p), key=lambda k: (load[k] + unit, k))
        share[d] += 1
        load[d] += unit
    sizes = [0] * chunks
    for d in range(p):
        mine = [c for c in range(chunks) if dev(c) == d]
        for i, c in enumerate(mine):
            sizes[c] = share[d] // v + (1 if i < share[d] % v else 0)
    out, first = [], 1
    for c, size in enumerate(sizes):
        a, b = first, first + size
        out.append((0 if c == 0 else a, n if c == chunks - 1 else b))
        first = b
    return out


def held_vectors(schedule: str, p: int, m: int, d: int, v: int, cache: dict) -> tuple:
    """Each of device ``d``'s held-micro-batch vectors (``schedules``), memoized in ``cache``."""
    key = ("held", schedule, p, m, d, v)
    if key not in cache:
        got = zbv_held(p, m, d) if schedule == "zb-v" else chunks_held(p, m, d, v)
        cache[key] = tuple(tuple(x) for x in got)
    return cache[key]


def device_plan(costs, idx, names, ranges, vectors, budget, precision,
                       par: Parallelism, cpu: bool = False) -> StagePlan:
    """A device's chunks under one memory plan. Its activations peak right after one of its
    forwards, holding ``vector[c]`` micro-batches of chunk ``c``: plan for the vector holding
    the most, then, while the plan's own worst vector overflows, for the elementwise most of
    the vectors found worst so far (never less than any of them: it converges in a few
    rounds). The plan's held bytes are its worst vector's."""
    sizes = [b - a for a, b in ranges]
    blocks = [costs[i] for i in idx]

    def exact(st: StagePlan) -> tuple[float, tuple]:
        kept, pos = [], 0
        for size, (a, _) in zip(sizes, ranges):
            kept.append(sum(costs[a + k].option(st.plan[pos + k]).kept_bytes
                            for k in range(size)))
            pos += size
        return max((sum(h * x for h, x in zip(vec, kept)), vec) for vec in vectors)

    weights = list(max(vectors, key=sum))
    best = None
    for _ in range(8):
        per_block = [w for w, size in zip(weights, sizes) for _ in range(size)]
        st = plan_stage(blocks, per_block, budget, precision, par.zero, par.dp, par.recompute,
                        names=names, cpu=cpu, segments=sizes)
        if st is None:
            break
        held, worst = exact(st)
        best = replace(st, held_bytes=held)
        if best.peak_bytes <= budget * (1 + 1e-9):
            return best
        grown = [max(w, h) for w, h in zip(weights, worst)]
        if grown == weights:
            break
        weights = grown
    if best is not None:
        return best
    per_block = [w for w, size in zip(weights, sizes) for _ in range(size)]
    st = plan_stage(blocks, per_block, math.inf, precision, par.zero, par.dp, par.recompute,
                    names=names, cpu=cpu, segments=sizes)
    return replace(st, held_bytes=exact(st)[0])
