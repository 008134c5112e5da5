"""One pipeline stage: its blocks, the memory plan that fits it on its device, and its cost.

A stage runs a micro-batch's forward and backward through its blocks and holds, at its
schedule's worst moment, ``in_flight`` micro-batches' kept activations. Its device's memory is
the sum of: weights, gradients, optimizer state (``dist.memory``, ZeRO-sharded), activations
(``in_flight`` × the kept bytes of every block under its memory plan) and the working bytes of
one block's backward (the largest: what it re-makes plus its gradients; with ZeRO-3 also a
block's gathered weights, twice for prefetch).

The memory plan picks, per block, a point of its curve (``BlockCost.options``). ``"auto"``
takes the least recompute that fits: blocks of one cost move together along the lower convex
hull of their curve, the step that frees bytes for the fewest seconds first — exact on the hull,
within one block's step of the best mix. A name (``"none"``, ``"selective"``, ``"full"``)
applies that plan to every body block that has it (Megatron's global policies).

Example:
    >>> from fitgraph.cost.devices import get_device
    >>> from fitgraph.dist.block_cost import price_block
    >>> from fitgraph.dist.cluster import LINKS
    >>> from fitgraph.dist.gpt_blocks import gpt_layer
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> from fitgraph.dist.memory import MIXED_ADAM
    >>> layer = price_block(gpt_layer(GptShape(24, 2304, 24), 1, 1), get_device("a100-80gb"),
    ...                     LINKS["nvlink3"])
    >>> st = plan_stage([layer] * 24, in_flight=4, budget=80 * 2**30, precision=MIXED_ADAM)
    >>> st.plan.count("none"), st.plan.count("drop:attn_dropout"), st.peak_bytes <= 80 * 2**30
    (21, 3, True)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .block_cost import BlockCost, MemoryOption, hull
from .memory import Precision, optimizer_temp_bytes, parameter_bytes
from .ops import stage_params

__all__ = ["StagePlan", "backward_excess", "hull", "plan_stage"]


@dataclass(frozen=True)
class StagePlan:
    """A stage's blocks under a memory plan: seconds per micro-batch and bytes on its device."""

    blocks: tuple[str, ...]
    plan: tuple[str, ...]          # per block, its memory option's name
    fwd_s: float
    bwd_s: float                   # recompute included
    bwd_w_s: float                 # weight-gradient part (zero-bubble schedules defer it)
    recompute_s: float
    recompute_flops: float
    params: float
    in_flight: float               # the most micro-batches held (per block when they differ)
    kept_bytes: float              # per micro-batch
    held_bytes: float              # activations on the device at the schedule's worst moment
    working_bytes: float
    weights: float
    gradients: float
    optimizer: float
    offload_bytes: float = 0.0     # held activations parked in host memory at that moment
    offload_s: float = 0.0         # copy time per micro-batch not hidden behind compute

    @property
    def activations(self) -> float:
        return self.held_bytes

    @property
    def peak_bytes(self) -> float:
        """The sum of the parts (the breakdown adds up to it)."""
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.working_bytes)

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s


def plan_stage(costs: Sequence[BlockCost], in_flight: float | Sequence[float], budget: float,
               precision: Precision, zero: int = 0, dp: int = 1,
               recompute: str = "auto", names: Sequence[str] | None = None,
               host_bandwidth: float | None = None, cpu: bool = False,
               segments: Sequence[int] | None = None) -> StagePlan | None:
    """The stage of ``costs`` (its blocks in order, named ``names``) under the least recompute
    that fits ``budget`` bytes, or None when even the most recompute does not fit. A named
    ``recompute`` is applied whether it fits or not (the caller reads ``peak_bytes``).

    With ``host_bandwidth`` (bytes/s each way between the device and host memory apart from
    it) ``"auto"`` may also park the activations of micro-batches waiting for their backward in
    host memory (every block keeps its current micro-batch's): each parked byte goes out after
    the forward and comes back before the backward, hidden behind a micro-batch's compute up to
    ``host_bandwidth × (fwd + bwd) / 2`` bytes per micro-batch (free, taken first), beyond that
    exposed — weighed per byte against recompute's next step. Needs one in-flight count for
    every block (not interleaved).

    The working bytes are what the step needs beyond the activations held at its worst
    moment: the backward of a micro-batch walks its blocks last to first, each needing its
    working set while the blocks after it have freed what they kept
    (``backward_excess``); the optimizer step, once every activation is gone, its temporaries
    (``cpu``: torch's one tensor at a time, ``memory.optimizer_temp_bytes``).

    ``segments``: the sizes of the chunks the blocks form on one device (interleaved, ZB-V):
    a parameter two chunks share is a copy in each (the runtime's pipeline stages are
    modules of their own)."""
    if not costs:
        raise ValueError("a stage needs at least one block")
    flights = ([float(in_flight)] * len(costs) if isinstance(in_flight, (int, float))
               else [float(f) for f in in_flight])
    if len(flights) != len(costs):
        raise ValueError(f"{len(flights)} in-flight counts for {len(costs)} blocks")
    blocks = [c.block for c in costs]
    if segments:
        edges = [0]
        for size in segments:
            edges.append(edges[-1] + size)
        params = sum(stage_params(blocks[a:b]) for a, b in zip(edges, edges[1:]))
    else:
        params = stage_params(blocks)
    static = parameter_bytes(params, precision, zero, dp)
    gather = _gathered(blocks, precision) if zero >= 3 else 0.0
    fixed = sum(static.values()) + gather
    offload = None
    if host_bandwidth and recompute == "auto" and len(set(flights)) == 1 and flights[0] > 1:
        window = sum(c.fwd_s + c.bwd_s for c in costs)
        offload = (host_bandwidth, window, flights[0])
    parked, exposed = 0.0, 0.0
    if recompute == "auto":
        got = _greedy(costs, flights, budget - fixed, offload)
        if got is None:
            return None
        choice, parked, exposed = got
    else:
        choice = [c.option(recompute) if c.block.role == "body" and _has(c, recompute)
                  else c.options[0] for c in costs]
    kept = sum(o.kept_bytes for o in choice)
    held = sum(f * o.kept_bytes for f, o in zip(flights, choice)) - parked
    working = backward_excess(choice) + gather
    largest = max(c.block.largest_param for c in costs)
    step_temp = optimizer_temp_bytes(precision, largest, params, zero, dp, cpu)
    working = max(working, step_temp - held)
    buffers = sum(c.block.buffer_bytes for c in costs)
    plan = StagePlan(
        blocks=tuple(names) if names is not None else tuple(c.block.name for c in costs), plan=tuple(o.name for o in choice),
        fwd_s=sum(c.fwd_s for c in costs),
        bwd_s=sum(c.bwd_s for c in costs) + sum(o.recompute_s for o in choice) + exposed,
        bwd_w_s=sum(c.bwd_w_s for c in costs), recompute_s=sum(o.recompute_s for o in choice),
        recompute_flops=sum(o.recompute_flops for o in choice),
        params=params, in_flight=max(flights), kept_bytes=kept, held_bytes=held,
        working_bytes=working,
        weights=static["weights"] + buffers, gradients=static["gradients"],
        optimizer=static["optimizer"],
        offload_bytes=parked, offload_s=exposed)
    if recompute == "auto" and plan.peak_bytes > budget * (1 + 1e-12):
        return None
    return plan


def _gathered(blocks, precision: Precision) -> float:
    """Bytes of whole weights a ZeRO-3 stage holds beside its shards at its worst moment."""
    # NOTE: as FSDP2 runs it (dist.runtime.data_parallel): each body block is a unit of its
    # own, gathered for its forward and again for its backward while the next one's gather is
    # under way (two at a time); the chain's ends (embedding, head) belong to the stage's root
    # unit, gathered through the stage's whole forward and backward
    ends = [b for b in blocks if b.role != "body"]
    body = [stage_params([b]) for b in blocks if b.role == "body"]
    return precision.weight * ((stage_params(ends) if ends else 0.0) + 2 * max(body, default=0.0))


def backward_excess(choice: Sequence[MemoryOption]) -> float:
    """The most a micro-batch's backward needs beyond holding all its blocks' kept bytes:
    block ``j``'s working set less what the blocks after it kept (freed by then).

    Example:
        >>> from fitgraph.dist.block_cost import MemoryOption
        >>> opts = [MemoryOption("none", (), 10.0, 0.0, 25.0, 0.0),
        ...         MemoryOption("none", (), 10.0, 0.0, 4.0, 0.0)]
        >>> backward_excess(opts)
        15.0
    """
    excess, later = 0.0, 0.0
    for o in reversed(choice):
        excess = max(excess, o.working_bytes - later)
        later += o.kept_bytes
    return excess


def _has(cost: BlockCost, name: str) -> bool:
    return any(o.name == name for o in cost.options)


def _greedy(costs: Sequence[BlockCost], flights: Sequence[float], room: float,
            offload: tuple[float, float, float] | None = None
            ) -> tuple[list[MemoryOption], float, float] | None:
    """Per block, the option of the least recompute whose activations and working bytes fit
    in ``room``; with ``offload`` = (host bandwidth, compute seconds per micro-batch, in-flight
    count), also the bytes parked in host memory and their exposed seconds per micro-batch."""
    if room < 0:
        return None
    groups: dict[tuple[int, float], list[int]] = {}
    for i, c in enumerate(costs):
        groups.setdefault((id(c), flights[i]), []).append(i)
    keys = list(groups)
    opts = {g: costs[groups[g][0]].options for g in keys}
    hulls = {g: list(costs[groups[g][0]].hull) or hull(opts[g]) for g in keys}
    # per group: hull position h (its blocks at hull[h]) and j of them already at hull[h + 1]
    state = {g: [0, 0] for g in keys}

    def at(g: tuple[int, float], h: int) -> MemoryOption:
        return opts[g][hulls[g][min(h, len(hulls[g]) - 1)]]

    def sums() -> tuple[float, float, float]:
        """(held bytes, parkable bytes: all but one micro-batch of each, working bytes)"""
        held, one, working = 0.0, 0.0, 0.0
        for g in keys:
            h, j = state[g]
            a, b = at(g, h), at(g, h + 1)
            kept = (len(groups[g]) - j) * a.kept_bytes + j * b.kept_bytes
            held += g[1] * kept
            one += kept
            working = max(working, a.working_bytes if j < len(groups[g]) else 0.0,
                          b.working_bytes if j else 0.0)
        return held, held - one, working

    bandwidth, window, flight = offload if offload else (0.0, 0.0, 1.0)
    # NOTE: parked bytes per micro-batch go out and come back (2x over the link); what a
    # micro-batch's compute hides is free, the rest costs 2 / bandwidth per micro-batch byte,
    # i.e. 2 / (bandwidth (f - 1)) seconds per byte of the peak — recompute's unit
    free = bandwidth * window / 2 * (flight - 1)
    price = 2 / (bandwidth * (flight - 1)) if offload else math.inf
    parked = 0.0

    def excess() -> float:
        nonlocal parked
        held, parkable, working = sums()
        cap = parkable if offload else 0.0
        parked = min(parked, cap)
        over = held - parked + working - room
        if over > 0 and offload:
            take = min(over, max(0.0, min(free, cap) - parked))   # the free part first
            parked += take
            over -= take
        return over

    heap: list[tuple[float, int, tuple[int, float]]] = []

    def push(g: tuple[int, float]) -> None:
        h = state[g][0]
        if h + 1 < len(hulls[g]):
            # NOTE: a block held f times frees f bytes per byte dropped: its price per byte
            # held is the slope over f
            heapq.heappush(heap, (_slope(opts[g], hulls[g], h) / max(g[1], 1e-30),
                                  groups[g][0], g))

    for g in keys:
        push(g)
    over = excess()
    while over > 0:
        if offload and (not heap or price < heap[0][0]):
            _, parkable, _ = sums()
            take = min(over, parkable - parked)
            if take > 0:
                parked += take
                over = excess()
                continue
        if not heap:
            return None
        _, _, g = heapq.heappop(heap)
        h, j = state[g]
        count = len(groups[g])
        step = g[1] * (at(g, h).kept_bytes - at(g, h + 1).kept_bytes)
        j = min(count, j + max(1, math.ceil(over / step)) if step > 0 else count)
        state[g] = [h + 1, 0] if j >= count else [h, j]
        over = excess()
        push(g)
    out: list[MemoryOption] = [costs[0].options[0]] * len(costs)
    for g in keys:
        h, j = state[g]
        for k, i in enumerate(groups[g]):
            out[i] = at(g, h + (k < j))
    held, _, working = sums()
    parked = max(0.0, min(parked, held + working - room))   # no more than the fit needs
    exposed = 0.0
    if offload and parked > 0:
        exposed = max(0.0, 2 * parked / (flight - 1) / bandwidth - window)
    return out, parked, exposed


def _slope(opts: Sequence[MemoryOption], hl: list[int], h: int) -> float:
    a, b = opts[hl[h]], opts[hl[h + 1]]
    return (b.recompute_s - a.recompute_s) / (a.kept_bytes - b.kept_bytes)
