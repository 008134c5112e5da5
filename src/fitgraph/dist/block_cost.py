"""A block priced on a device: seconds of its forward and backward (tensor-parallel collectives
included, not overlapped, as Megatron-LM runs them) and its time–memory curve.

Each op takes the roofline time of its FLOPs and bytes on the device (``DeviceSpec.peak`` and
``bandwidth``, achievable fractions included; a kernel never shorter than the launch cost), and
each collective the α–β time on the tensor-parallel group's link.

The curve is the block's memory plan, op by op: dropping an op's saved outputs means re-running
it in the backward, and with it every op it reads from that is not kept (unsaved outputs, other
dropped ones). Every subset of droppable ops is priced (2^k, k ≤ ``EXACT_OPS``; a greedy order
by bytes freed per second beyond) and the Pareto front kept: from "keep everything" to "full
recompute" (keep the input only), through Megatron's selective recompute and the points between.

Example:
    >>> from fitgraph.cost.devices import get_device
    >>> from fitgraph.dist.cluster import LINKS
    >>> from fitgraph.dist.gpt_blocks import gpt_layer
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> cost = price_block(gpt_layer(GptShape(24, 2304, 24), 1, 1), get_device("a100-80gb"),
    ...                    LINKS["nvlink3"])
    >>> [o.name for o in (cost.options[0], cost.options[-1])]
    ['none', 'full']
    >>> round(cost.options[-1].recompute_s / cost.fwd_s, 9)   # full recompute: one forward
    1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import combinations

import numpy as np

from ..cost.devices import DeviceSpec
from .cluster import Link
from .collectives import all_gather_s, all_reduce_s, reduce_scatter_s
from .ops import INPUT, Block, Collective, Op

__all__ = ["EXACT_OPS", "BlockCost", "MemoryOption", "hull", "op_seconds", "op_times",
           "price_block", "price_blocks"]

EXACT_OPS = 14
_COLLECTIVE = {"all_reduce": all_reduce_s, "all_gather": all_gather_s,
               "reduce_scatter": reduce_scatter_s}


@dataclass(frozen=True)
class MemoryOption:
    """One point of a block's curve: re-make ``dropped`` ops' outputs in the backward."""

    name: str
    dropped: tuple[str, ...]
    kept_bytes: float      # per micro-batch, from the forward to the backward (input included)
    recompute_s: float     # added to the backward
    working_bytes: float   # alive during the block's backward (re-made outputs, gradients)
    recompute_flops: float = 0.0


@dataclass(frozen=True)
class BlockCost:
    """A block's seconds per micro-batch on one device, and its memory plans (``options``,
    kept bytes decreasing, recompute time increasing; ``options[0]`` keeps everything)."""

    block: Block
    fwd_s: float
    bwd_s: float          # input and weight gradients, no recompute
    bwd_w_s: float        # the weight-gradient part of ``bwd_s``
    fwd_comm_s: float     # tensor-parallel collectives inside ``fwd_s``
    bwd_comm_s: float
    options: tuple[MemoryOption, ...]
    hull: tuple[int, ...] = ()     # the curve's lower convex hull (``stage.hull``), indices

    def option(self, name: str) -> MemoryOption:
        for o in self.options:
            if o.name == name:
                return o
        named = [o.name for o in self.options]
        raise ValueError(f"block {self.block.name} has no memory plan {name!r}: {named}")


def op_seconds(flops: float, nbytes: float, matmul: bool, device: DeviceSpec,
               dtype: str = "bfloat16") -> float:
    """Roofline seconds of one kernel, never below the device's launch cost."""
    compute = flops / device.peak(dtype if matmul else "float32") if flops else 0.0
    return max(compute, nbytes / device.bandwidth, device.kernel_overhead_s)


def op_times(op: Op, device: DeviceSpec, dtype: str = "bfloat16") -> tuple[float, float,
                                                                         float]:
    """Seconds of ``op``'s forward, backward and the backward's weight-gradient part on
    ``device``, its collectives apart: as the op gives them, by its GEMMs' shapes on a device
    that times GEMMs (``fitgraph.hw``), else the roofline of its FLOPs and bytes."""
    shaped = getattr(device, "gemm_seconds", None) if dtype != "float32" else None
    shaped = shaped if op.gemms else None
    if op.seconds is not None:
        fwd = op.seconds
    elif shaped:
        fwd = sum(shaped(m, n, k, b) for m, n, k, b in op.gemms)
    else:
        fwd = op_seconds(op.flops + op.vector_flops, op.bytes, op.matmul, device, dtype)
    if op.bwd_seconds is not None:
        bwd = op.bwd_seconds
    elif shaped:
        # NOTE: dA = dC·Bᵀ ([M, N]·[N, K]) and dB = Aᵀ·dC ([K, M]·[M, N])
        bwd = sum(shaped(m, k, n, b) + shaped(k, n, m, b) for m, n, k, b in op.gemms)
    else:
        bwd = op_seconds(op.bwd_flops + op.bwd_vector_flops, op.bwd_bytes, op.matmul, device,
                         dtype)
    if op.bwd_w_seconds is not None:
        bwd_w = op.bwd_w_seconds
    elif shaped and op.bwd_w_flops:
        bwd_w = sum(shaped(k, n, m, b) for m, n, k, b in op.gemms)
    else:
        # NOTE: a matmul's weight gradient is a matmul of the same shape class as its input
        # gradient; its share of the backward is its share of the FLOPs.
        bwd_w = bwd * (op.bwd_w_flops / op.bwd_flops) if op.bwd_flops else 0.0
    return fwd, bwd, bwd_w


def _comm_seconds(comms: tuple[Collective, ...], tp: int, link: Link) -> float:
    return sum(_COLLECTIVE[c.kind](c.nbytes, tp, link) for c in comms)


def price_block(block: Block, device: DeviceSpec, tp_link: Link,
                dtype: str = "bfloat16") -> BlockCost:
    """Seconds and memory plans of ``block`` on ``device``, its collectives on ``tp_link``."""
    times = {op.name: op_times(op, device, dtype) for op in block.ops}
    fwd = {op.name: times[op.name][0] + _comm_seconds(op.fwd_comm, block.tp, tp_link)
           for op in block.ops}
    fwd_comm = sum(_comm_seconds(op.fwd_comm, block.tp, tp_link) for op in block.ops)
    bwd_comm = sum(_comm_seconds(op.bwd_comm, block.tp, tp_link) for op in block.ops)
    bwd = sum(t[1] for t in times.values()) + bwd_comm
    bwd_w = sum(t[2] for t in times.values())
    options = _curve(block, fwd)
    return BlockCost(block, sum(fwd.values()), bwd, bwd_w, fwd_comm, bwd_comm, options,
                     tuple(hull(options)))


def hull(options: Sequence[MemoryOption]) -> list[int]:
    """Indices of the lower convex hull of a curve (kept bytes decreasing): the steps in the
    order a greedy should take them, each freeing bytes at a higher price than the last."""
    out: list[int] = [0]
    for i in range(1, len(options)):
        if options[i].kept_bytes >= options[out[-1]].kept_bytes:
            continue
        while len(out) >= 2:
            a, b = options[out[-2]], options[out[-1]]
            c = options[i]
            # NOTE: slope = seconds per byte freed; drop b when a->c is no dearer than a->b.
            ab = (b.recompute_s - a.recompute_s) / (a.kept_bytes - b.kept_bytes)
            ac = (c.recompute_s - a.recompute_s) / (a.kept_bytes - c.kept_bytes)
            if ac <= ab:
                out.pop()
            else:
                break
        out.append(i)
    return out


def price_blocks(blocks, device: DeviceSpec, tp_link: Link, dtype: str,
                 cache: dict) -> list[BlockCost]:
    """``price_block`` of each block, blocks of one kind priced once (memoized in ``cache``:
    identical layers share one ``BlockCost`` object, which the stage planner groups by)."""
    out = []
    for b in blocks:
        key = ("price", device, b.kind, b.ops, b.params, b.input_bytes, b.role, tp_link, dtype)
        if key not in cache:
            cache[key] = price_block(b, device, tp_link, dtype)
        out.append(cache[key])
    return out


def _rerun(block: Block, dropped: frozenset[str]) -> list[Op]:
    """The ops the backward re-runs to re-make ``dropped`` ops' saved outputs."""
    by_name = {op.name: op for op in block.ops}
    need: set[str] = set()
    stack = list(dropped)
    while stack:
        name = stack.pop()
        if name in need:
            continue
        need.add(name)
        for r in by_name[name].reads:
            if r != INPUT and (r in dropped or by_name[r].saved == 0):
                stack.append(r)
    return [op for op in block.ops if op.name in need]


_STRUCTURE: dict[tuple, tuple[list[frozenset[str]], np.ndarray, np.ndarray]] = {}


def _structure(block: Block, subsets: list[frozenset[str]]):
    """Per subset of dropped ops: which ops it drops and which it re-runs, as 0/1 matrices
    (cached per block structure: the curve of every shape of a kind is priced by two
    products)."""
    key = (tuple((op.name, op.reads, op.saved > 0) for op in block.ops), tuple(subsets))
    hit = _STRUCTURE.get(key)
    if hit is None:
        names = [op.name for op in block.ops]
        drops = np.array([[n in d for n in names] for d in subsets], dtype=float)
        reruns = np.zeros_like(drops)
        for row, d in enumerate(subsets):
            for op in _rerun(block, d):
                reruns[row, names.index(op.name)] = 1.0
        hit = _STRUCTURE[key] = (subsets, drops, reruns)
    return hit


def _curve(block: Block, fwd: dict[str, float]) -> tuple[MemoryOption, ...]:
    droppable = [op.name for op in block.ops if op.saved > 0 and op.recomputable]
    named = {frozenset(): "none"}
    if droppable:
        named[frozenset(droppable)] = "full"
    for name, dropped in block.options:
        named.setdefault(frozenset(dropped), name)
    if len(droppable) <= EXACT_OPS:
        subsets = [frozenset(c) for k in range(len(droppable) + 1)
                   for c in combinations(droppable, k)]
    else:
        # NOTE: the named plans may be among the greedy's steps: each subset once
        subsets = list(dict.fromkeys(_greedy_subsets(block, droppable, fwd) + list(named)))
    subsets, drops, reruns = _structure(block, subsets)
    saved = np.array([op.saved for op in block.ops])
    times = np.array([fwd[op.name] for op in block.ops])
    freed, recompute = drops @ saved, reruns @ times
    flops = reruns @ np.array([op.flops for op in block.ops])
    # NOTE: the Pareto front (fewer kept bytes must cost more time), named plans kept even
    # when dominated, so that a user's "selective" is always there to ask for.
    order = np.lexsort((-freed, recompute))
    keep: list[int] = []
    most = -1.0
    for i in order:
        if freed[i] > most:
            keep.append(int(i))
            most = freed[i]
    keep += [i for i, d in enumerate(subsets) if d in named and i not in keep]
    out = [MemoryOption(named.get(subsets[i], "drop:" + "+".join(sorted(subsets[i]))),
                        tuple(op.name for op in block.ops if op.name in subsets[i]),
                        block.saved_bytes - float(freed[i]), float(recompute[i]),
                        float(freed[i]) + block.bwd_temp_bytes, float(flops[i])) for i in keep]
    for name, dropped, parts in block.fission:
        # NOTE: ops re-made in parts: the same bytes kept and seconds spent as dropping them
        # whole, but their outputs and gradients alive one part at a time — in every plan
        # that re-makes them (the plan that re-makes just them is renamed after the fission)
        d = frozenset(dropped)
        gone = sum(op.saved for op in block.ops if op.name in d)
        whole = gone + block.bwd_temp_bytes
        out = [replace(o, name=name if frozenset(o.dropped) == d else o.name,
                       working_bytes=o.working_bytes - whole + whole / parts)
               if d <= frozenset(o.dropped) else o for o in out]
        if not any(frozenset(o.dropped) == d for o in out):
            ops = _rerun(block, d)
            out.append(MemoryOption(name, tuple(op.name for op in block.ops if op.name in d),
                                    block.saved_bytes - gone, sum(fwd[op.name] for op in ops),
                                    whole / parts, sum(op.flops for op in ops)))
    out.sort(key=lambda o: (-o.kept_bytes, o.recompute_s, o.name))
    return tuple(out)


def _greedy_subsets(block: Block, droppable: list[str],
                    fwd: dict[str, float]) -> list[frozenset[str]]:
    """Drop one op at a time, the most bytes freed per second re-run first."""
    out, dropped = [frozenset()], frozenset()
    left = list(droppable)
    base = {op.name: op.saved for op in block.ops}
    while left:
        def gain(name: str, dropped: frozenset[str] = dropped) -> tuple[float, str]:
            d = dropped | {name}
            cost = sum(fwd[op.name] for op in _rerun(block, d)) or 1e-30
            return (-sum(base[x] for x in d) / cost, name)
        pick = min(left, key=gain)
        left.remove(pick)
        dropped = dropped | {pick}
        out.append(dropped)
    return out
