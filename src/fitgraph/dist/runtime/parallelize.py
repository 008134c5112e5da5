"""``parallelize``: a model, its loss and optimizer, and a multi-device plan → a training step
that every rank of a launch runs (``torchrun --nproc-per-node N train.py``).

What it applies, in this order (torchtitan's): the launch checked against the plan (world size,
model, batch); the step traced and cut into the plan's pipeline chunks
(``dist.runtime.stage_split``); this rank's chunks made data parallel as the plan's ZeRO stage
says (``dist.runtime.data_parallel``); the chunks as ``torch.distributed.pipelining`` stages
run by the plan's schedule; the optimizer rebuilt over this rank's parameters.

Example (in each process of a launch; ``run_processes`` starts local ones):
    >>> step = parallelize(model, batch, loss_fn, optimizer, plan="plan.json")  # doctest: +SKIP
    >>> for batch in loader:                                                   # doctest: +SKIP
    ...     loss = step(batch)      # the global batch's loss, on every rank
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from ..graph_model import param_signature
from ..planner import DistPlan
from .batches import FlatBatch
from .data_parallel import replicate_chunk
from .fx_layouts import TensorParallelError
from .layout import PlanMismatch, RankLayout
from .local_optimizer import local_optimizer, orthogonalises
from .memory_plan import apply_memory_plan, block_ops, block_options
from .stage_split import END, StepModule, chunk_metas, split_step
from .step import DistStep
from .tensor_parallel import shard_chunk

__all__ = ["PlanMismatch", "parallelize"]

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved": "ScheduleInterleaved1F1B", "zb-v": "ScheduleZBVZeroBubble",
             "zb-h1": "ScheduleInterleavedZeroBubble"}
MULTI = {"interleaved", "zb-v", "zb-h1"}     # schedules that take a list of stages


def parallelize(model: torch.nn.Module, example_batch: Any, loss_fn=None, optimizer=None, *,
                plan: DistPlan | str | Path | dict = "auto", local_batches: bool = False,
                measure_memory: bool = False) -> DistStep:
    """This rank's part of ``plan`` for ``model``: a ``DistStep``, called once per step with a
    batch structured as ``example_batch`` (the global batch; with ``local_batches=True``, this
    data-parallel replica's part). ``loss_fn(model, batch)`` returns the loss (None: the
    model's output's ``.loss``, as Hugging Face models return it). ``optimizer``: an
    optimizer of ``model``'s parameters, not yet stepped (rebuilt over this rank's, with the
    same options per group), a list of them (Muon for the matrices, AdamW for the rest: not
    under tensor parallelism or FSDP, which shard Muon's matrices), or a function of a
    parameter list. ``plan``: a ``DistPlan``, its
    saved JSON (a path or the dict), or ``"auto"``: planned on rank 0 for this launch's
    processes (``dist.runtime.auto_plan``).

    The process group is the launch's (``torchrun`` sets it up through the environment; gloo
    on CPU). After this, train through the returned step: the model's parameters and buffers
    that this rank does not run are released (emptied) and the others are no longer the ones
    updated (``step.named_parameters()`` are this rank's; ``step.full_parameters()`` whole).
    ``measure_memory``: meter this rank's allocator from its first step on, for
    ``step.report()`` (slower steps).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo" if _device(model).type == "cpu" else "nccl")
    auto = isinstance(plan, str) and plan == "auto"
    # NOTE: Muon needs whole matrices: no tensor parallelism, ZeRO at most 1
    fix = {"tp": 1, "max_zero": 1} if orthogonalises(optimizer) else {}
    if auto:
        if local_batches:
            raise PlanMismatch("plan='auto' plans for the global batch, and which ranks are "
                               "replicas is the plan's to say: give the global batch "
                               "(local_batches=False) or a saved plan")
        plan = _auto_plan(model, example_batch, loss_fn, fix, optimizer)
    plan = _as_plan(plan)
    par = plan.parallelism
    layout = RankLayout.of(par, dist.get_rank(), dist.get_world_size())
    if par.tp > 1 and not plan.tp_styles:
        raise PlanMismatch(f"the plan splits tensors {par.tp} ways but names no split weights "
                           f"(a plan of a model by its shape): plan the captured model")
    _check_model(plan, model)
    _check_fits(plan, layout, _device(model))
    state_keys = frozenset(model.state_dict())
    flat = FlatBatch.of(example_batch)
    batched = FlatBatch.batched(
        flat.tensors, par.micro_batch * par.n_micro * (1 if local_batches else par.dp))
    micro_args = _micro_args(flat, par, batched, local_batches)
    chunks = plan.chunks or [{"device": s["index"], "blocks": s["blocks"]} for s in plan.stages]
    starts = chunk_starts(chunks)
    split = split_step(StepModule(model, loss_fn, flat), micro_args, starts)
    mesh = layout.mesh(_device(model).type)
    notes = [n for n in [split.weights_note, _batch_norm_note(model, par)] if n]
    mine = [ch for ch, c in zip(split.chunks, chunks) if c["device"] == layout.stage]
    shared = _shared_groups(split, chunks, layout, mesh)
    weights = split.weights
    stages = []
    metas = chunk_metas(split.chunks, micro_args)
    tp_params: dict = {}
    failed = None
    for ch in mine if par.tp > 1 else ():
        try:
            # NOTE: after the stages' metadata: what crosses a cut is whole on every shard
            tp_params.update(shard_chunk(ch, plan.tp_styles, par.tp, layout.shard,
                                         mesh["tp"].get_group(), sp=bool(par.sp)))
        except TensorParallelError as e:
            failed = e
            break
    if par.tp > 1 and _on_any_rank(failed is not None, _device(model)):
        # NOTE: every rank learns it (one all-reduce), so none waits on a collective the
        # failed ones never reach
        if not auto:
            raise failed or TensorParallelError(
                "another rank's chunk cannot be split as the plan says (its error names the "
                "op): plan with --fix tp=1")
        warnings.warn(f"fitgraph.dist: the runtime cannot split this model's tensors as "
                      f"planned ({failed or 'on another rank'}); planning again without "
                      "tensor parallelism", stacklevel=2)
        return parallelize(model, example_batch, loss_fn, optimizer,
                           plan=_auto_plan(model, example_batch, loss_fn, {**fix, "tp": 1},
                                           optimizer),
                           measure_memory=measure_memory)
    options = block_options(plan, layout.stage)
    signatures = block_ops(plan, layout.stage)
    for ch in mine:
        apply_memory_plan(ch, options, signatures, notes)
    for ch in mine:
        run = replicate_chunk(ch, par.zero, mesh["dp"], tuple(options))
        ins, outs = metas[ch.index]
        stages.append(PipelineStage(run, ch.index, len(chunks), _device(model),
                                    input_args=ins, output_args=outs,
                                    group=mesh["pp"].get_group()))
    params = list({id(p): (ch.model_name(n), p) for ch in mine
                   for n, p in ch.named_parameters()}.values())
    zero1 = mesh["dp"].get_group() if par.zero == 1 and par.dp > 1 else None
    opt = local_optimizer(optimizer, model, params, shard_group=zero1)
    if (par.tp > 1 or par.zero >= 2) and orthogonalises(opt):
        raise PlanMismatch(
            f"Muon updates each matrix from the whole of it (Newton–Schulz), and under "
            f"{'tensor parallelism' if par.tp > 1 else f'ZeRO-{par.zero} (FSDP)'} each rank "
            "holds a shard of it: plan with --fix tp=1 and zero at most 1 (pipeline, data "
            "parallel, ZeRO-1 keep matrices whole), or use another optimizer")
    schedule = _schedule(par, stages)
    release_unused(model, [t for ch in mine for t in [*ch.parameters(), *ch.buffers()]])
    del split
    for note in notes:
        # NOTE: law 5: what runs otherwise than planned is said now, not only in report()
        warnings.warn(f"fitgraph.dist (rank {layout.rank}): {note}", stacklevel=2)
    return DistStep(plan=plan, layout=layout, mesh=mesh, flat=flat, chunks=mine, stages=stages,
                    schedule=schedule, optimizer=opt, shared=shared,
                    local_batches=local_batches, notes=notes, batched=batched,
                    weights=weights, tp_params=tp_params, measure_memory=measure_memory,
                    state_keys=state_keys,
                    tp_partial=frozenset(n for ch in mine
                                         for n in getattr(ch, "tp_partial_grads", ())))


def _auto_plan(model, example_batch, loss_fn, fix: dict, optimizer) -> DistPlan:
    import torch.distributed as dist

    from .auto_plan import auto_plan

    flat = FlatBatch.of(example_batch)
    rows = max((t.shape[0] for t in flat.tensors if t.dim()), default=1)
    return auto_plan(model, example_batch, loss_fn, dist.get_world_size(), rows,
                     _device(model), fix=fix, optimizer=optimizer)


def _on_any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of the launch (every rank calls it)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t)
    return bool(t.item())


def chunk_starts(chunks: list[dict]) -> list[str]:
    """Where each chunk after the first begins: its first block's module path, or, for the
    chain's end (``<rest>``: the final norm, head and loss, no module of its own), after the
    block before it (``path + END``)."""
    starts = []
    for before, c in zip(chunks, chunks[1:]):
        first = c["blocks"][0]
        if not first.startswith("<"):
            starts.append(first)
        elif first == "<rest>" and not before["blocks"][-1].startswith("<"):
            starts.append(before["blocks"][-1] + END)
        else:
            raise PlanMismatch(f"a chunk of the plan begins with {first}, which is not a "
                               f"module of the model to cut before: plan again with more "
                               f"blocks per stage")
    return starts


def release_unused(model: torch.nn.Module, kept: list) -> None:
    """Empty the model's parameters and buffers whose storage this rank's chunks do not use
    (other stages', and tensors that tensor or data parallelism copied into shards): a rank
    holds its part of the model only."""
    keep = set()
    for t in kept:
        t = t.to_local() if hasattr(t, "to_local") else t
        keep.add(t.untyped_storage().data_ptr())
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.untyped_storage().data_ptr() not in keep:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _as_plan(plan) -> DistPlan:
    if isinstance(plan, DistPlan):
        return plan
    if isinstance(plan, dict):
        return DistPlan.from_json(plan)
    if isinstance(plan, (str, Path)) and os.path.exists(plan):
        return DistPlan.load(plan)
    raise TypeError(f"plan: a DistPlan, its JSON dict or the path of a saved plan, not "
                    f"{plan!r}")


def _check_fits(plan: DistPlan, layout: RankLayout, device: torch.device) -> None:
    """Refuse, before the first step, a stage the plan says does not fit (or, on a GPU,
    whose predicted peak is over the device's memory), naming the rank and the term."""
    stage = next((s for s in plan.stages if s["index"] == layout.stage), None)
    if stage is None:
        return
    peak = stage["peak_bytes"]
    capacity = None
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
    over = (not plan.fits and peak > plan.predicted.get("budget_bytes", float("inf"))) or (
        capacity is not None and peak > capacity)
    if over:
        terms = stage.get("memory", {})
        big = max(terms, key=terms.get) if terms else "?"
        limit = capacity if capacity is not None else plan.predicted["budget_bytes"]
        raise PlanMismatch(
            f"rank {layout.rank} (stage {layout.stage}) does not fit: its predicted peak "
            f"{peak / 2**30:.2f} GiB is over {limit / 2**30:.2f} GiB; its largest term is "
            f"{big} ({terms.get(big, 0) / 2**30:.2f} GiB). Plan with more devices, a smaller "
            f"micro-batch or recompute (fitgraph plan-dist ... --fix recompute=full)")


def _check_model(plan: DistPlan, model: torch.nn.Module) -> None:
    if not plan.param_signature:
        return
    mine = param_signature((n, tuple(p.shape)) for n, p in model.named_parameters())
    if mine != plan.param_signature:
        raise PlanMismatch(f"the plan was made for another model (its parameters' names and "
                           f"shapes differ from {type(model).__name__}'s): plan for this one")


def _micro_args(flat: FlatBatch, par, batched: list[bool], local_batches: bool) -> tuple:
    if not any(batched):
        rows = par.micro_batch * par.n_micro * (1 if local_batches else par.dp)
        sizes = sorted({t.shape[0] for t in flat.tensors if t.dim()})
        raise PlanMismatch(f"the plan's {'replica batch' if local_batches else 'global batch'} "
                           f"is {rows} samples, but the example batch's tensors have "
                           f"{sizes} rows")
    return tuple(t[:par.micro_batch] if b else t for t, b in zip(flat.tensors, batched))


def _device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _batch_norm_note(model: torch.nn.Module, par) -> str:
    """Why a model normalizing over its batch in training mode differs from one process."""
    norms = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if not norms or par.n_micro * par.dp == 1:
        return ""
    more = f" and {len(norms) - 1} more" if len(norms) > 1 else ""
    return (f"{norms[0]}{more} normalize over each micro-batch of {par.micro_batch} samples in "
            f"training mode, not over the whole batch of {par.micro_batch * par.n_micro * par.dp}"
            f": outputs and running statistics differ from one process's (eval-mode "
            f"normalization, or a norm over features such as GroupNorm, runs alike)")


def _shared_groups(split, chunks: list[dict], layout: RankLayout, mesh) -> list[tuple]:
    """(model name, process group or None) of each parameter several chunks hold that this
    rank's chunks hold: the group joins the stages holding it (None: only this one)."""
    out = []
    for name in split.shared:
        stages = {c["device"] for ch, c in zip(split.chunks, chunks)
                  if name in ch.model_names()}
        # NOTE: made on every rank alike (groups are created by all); a rank not holding the
        # parameter takes no part in its sum (no zeros of its size kept for a collective)
        group = layout.stages_group(stages, mesh)
        if layout.stage in stages:
            out.append((name, group))
    return out


def _schedule(par, stages: list):
    import torch.distributed.pipelining as pl

    cls = getattr(pl, SCHEDULES[par.schedule])

    def loss_is_output(output, factor):
        # NOTE: the last chunk returns the loss itself; ``factor`` is the micro-batch's share
        # of the whole batch's loss (``DistStep._factors``)
        return output * factor.to(output.dtype).reshape(())

    if par.schedule in MULTI:
        return cls(stages, par.n_micro, loss_fn=loss_is_output)
    (stage,) = stages
    return cls(stage, par.n_micro, loss_fn=loss_is_output)
