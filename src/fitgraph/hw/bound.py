"""The least step time any multi-device plan of a model can reach on a chip: what lets the
co-search skip a configuration without planning it, safely.

Every plan the planner makes runs each sample's forward and backward somewhere: at a
tensor-parallel width ``t`` and micro-batch ``b`` one device spends ``T(t, b)`` seconds on the
ops of all the blocks (``dist.block_cost.op_times``: the very times the planner prices, their
collectives left out) for ``b`` samples' share ``1/t``. Spread perfectly over ``devices`` with no
communication, bubble, recompute or optimizer step, a step of ``B`` samples takes
``B · min over (t, b, sp) of t · T(t, b) / b / devices``; a plan adds to each of those terms,
never takes away, so its step is never shorter (for the widths and micro-batches the search
may use: ``widths``, by default every width up to ``MAX_TP`` that divides the devices, and
``micro_batches``).

A captured model (``dist.GraphModel``) is bounded the same way: the planner times its blocks
by its units' nodes, scaled linearly with the micro-batch and split, not re-timed, over a
tensor-parallel group — so no plan's busiest device computes less than the whole step's
nodes (``GraphModel.timed_nodes``, on the chip: ``hw.cost_model``) times ``B`` over the
captured batch, over ``devices``.

Example:
    >>> from fitgraph.dist import GptShape
    >>> from fitgraph.hw.chip import CHIPS
    >>> shape = GptShape(24, 2048, 16, seq=1024)
    >>> fast, slow = (step_bound(CHIPS[c], shape, 64, 512) for c in ("h100", "a100"))
    >>> fast < slow
    True
"""

from __future__ import annotations

from ..dist.block_cost import op_times
from ..dist.megatron_table import GptShape
from ..dist.model import GptModel
from ..dist.search import MICRO_BATCHES
from .chip import Chip
from .device import chip_device

__all__ = ["MAX_TP", "graph_step_bounds", "step_bound", "step_bounds"]

# NOTE: Phaze's widest tensor parallelism (its --phaze_max_tmp_width 8); the co-search plans
# with the same limit
MAX_TP = 8


def step_bound(chip: Chip, shape: GptShape, devices: int, global_batch: int, *,
               widths: tuple[int, ...] | None = None,
               micro_batches: tuple[int, ...] = MICRO_BATCHES,
               dtype: str = "bfloat16") -> float:
    """Seconds: no plan of ``shape`` on ``devices`` ``chip``s steps ``global_batch`` samples
    faster (see the module's note)."""
    return step_bounds([chip], shape, devices, global_batch, widths=widths,
                       micro_batches=micro_batches, dtype=dtype)[0]


def step_bounds(chips: list[Chip], shape: GptShape, devices: int, global_batch: int, *,
                widths: tuple[int, ...] | None = None,
                micro_batches: tuple[int, ...] = MICRO_BATCHES,
                dtype: str = "bfloat16") -> list[float]:
    """``step_bound`` of each chip, fast over many: an op's time depends on the arrays, SRAM
    and HBM bandwidth (a GEMM) or on the vector units and HBM bandwidth (the rest), so each
    width's two sums are made once per distinct part and added per chip."""
    model = GptModel(shape)
    if widths is None:
        widths = tuple(t for t in range(1, MAX_TP + 1) if devices % t == 0)
    runs = [(t, b, sp) for t in widths if t <= devices and not model.why_not(t, 1, False)
            for b in micro_batches for sp in ((False, True) if t > 1 else (False,))
            if not model.why_not(t, b, sp)]
    if not runs:
        raise ValueError(f"{model.name}: no tensor-parallel width in {widths} runs it")
    # per run: the ops of all its blocks, each with how many blocks share it
    ops = []
    for t, b, sp in runs:
        count: dict[int, tuple[object, int]] = {}
        for block in model.blocks(t, b, sp):
            key = id(block.ops)
            count[key] = (block.ops, count.get(key, (None, 0))[1] + 1)
        ops.append([(op, n) for block_ops, n in count.values() for op in block_ops])
    arrays: dict[tuple, list[float]] = {}
    vectors: dict[tuple, list[float]] = {}
    out = []
    for chip in chips:
        a_key = (chip.tensor_cores, chip.array_rows, chip.array_cols, chip.dataflow,
                 chip.sram_bytes, chip.hbm_bandwidth, chip.clock_hz)
        v_key = (chip.vector_cores, chip.vector_lanes, chip.vector_clock_hz or chip.clock_hz,
                 chip.hbm_bandwidth)
        if a_key not in arrays or v_key not in vectors:
            device = chip_device(chip)
            sums = [_sums(run_ops, device, dtype) for run_ops in ops]
            arrays.setdefault(a_key, [g for g, _ in sums])
            vectors.setdefault(v_key, [v for _, v in sums])
        best = min(t * (g + v) / b for (t, b, _), g, v in zip(runs, arrays[a_key],
                                                             vectors[v_key]))
        out.append(global_batch * best / devices)
    return out


def _sums(ops, device, dtype: str) -> tuple[float, float]:
    """Forward + backward seconds of the GEMM ops and of the others."""
    gemm = vector = 0.0
    for op, n in ops:
        fwd, bwd, _ = op_times(op, device, dtype)
        if op.gemms:
            gemm += n * (fwd + bwd)
        else:
            vector += n * (fwd + bwd)
    return gemm, vector


def graph_step_bounds(chips: list[Chip], model, devices: int, global_batch: int) -> list[float]:
    """``step_bound`` of each chip for a captured model (a ``dist.GraphModel``): its timed
    nodes' seconds on the chip, the GEMMs summed once per distinct arrays and the rest once
    per distinct vector units, peak and HBM."""
    from .cost_model import ChipCostModel, node_gemms

    graph = model._chain.graph
    nodes = [graph.nodes[m] for m in model.timed_nodes()]
    gemm_nodes = [n for n in nodes if node_gemms(graph, n)]
    other_nodes = [n for n in nodes if not node_gemms(graph, n)]
    arrays: dict[tuple, float] = {}
    others: dict[tuple, float] = {}
    out = []
    for chip in chips:
        a_key = (chip.tensor_cores, chip.array_rows, chip.array_cols, chip.dataflow,
                 chip.sram_bytes, chip.hbm_bandwidth, chip.clock_hz)
        o_key = (chip.vector_flops(), chip.peak_flops(), chip.hbm_bandwidth)
        if a_key not in arrays or o_key not in others:
            cm = ChipCostModel(chip)
            arrays.setdefault(a_key, sum(cm.node_cost(graph, n).seconds for n in gemm_nodes))
            others.setdefault(o_key, sum(cm.node_cost(graph, n).seconds for n in other_nodes))
        seconds = arrays[a_key] + others[o_key]
        out.append(seconds * global_batch / (model.batch_size * devices))
    return out
