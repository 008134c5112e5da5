"""One training step of a multi-device plan, run by every rank of the launch.

``DistStep(batch)`` takes the global batch (the same on every rank, as in a one-process loop)
or, built with ``local_batches=True``, this replica's part of it (a ``DistributedSampler``'s);
runs the plan's micro-batches through this rank's pipeline chunks with the plan's schedule;
sums the gradients of parameters that several chunks hold (a tied embedding and head); steps
the optimizer; and returns the global step's loss on every rank: the mean of the micro-batch
losses over all replicas, which is the whole batch's loss where the loss is a mean over
samples (as a one-process loop's gradient accumulation assumes).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from .batches import FlatBatch
from .collective_frees import frees_on_this_thread
from .layout import RankLayout

__all__ = ["DistStep", "StepRecord"]


@dataclass
class StepRecord:
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)    # in this rank's chunks, per step
    optimizer: list[float] = field(default_factory=list)
    _open: float = 0.0

    def timed(self, fn):
        """``fn`` (a stage's forward or backward of one micro-batch), its time counted."""
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._open += time.perf_counter() - start
        return run


class DistStep:
    """Made by ``fitgraph.dist.parallelize``; call it with a batch, once per step."""

    def __init__(self, *, plan, layout: RankLayout, mesh, flat: FlatBatch, chunks: list,
                 stages: list, schedule, optimizer, shared: list[tuple[str, Any]],
                 local_batches: bool, notes: list[str], batched: list[bool],
                 weights=None, tp_params: dict | None = None,
                 measure_memory: bool = False, state_keys: frozenset = frozenset(),
                 tp_partial: frozenset = frozenset()) -> None:
        self.plan = plan
        self.layout = layout
        self.mesh = mesh
        self.flat = flat
        self.chunks = chunks            # this rank's ChunkModules (unwrapped)
        self.stages = stages
        self.schedule = schedule
        self.optimizer = optimizer
        self.shared = shared            # (model name, group of its holding stages or None)
        self.local_batches = local_batches
        self.notes = notes
        self.weights = weights          # LossWeights: micro-batches' shares of the loss
        self.tp_params = tp_params or {}   # model name -> TpParam: how tensor parallelism split it
        # NOTE: parameters whose gradients are partial sums over the tensor-parallel shards
        # (read by parts of the sequence: ``tensor_parallel.partial_names``)
        self.tp_partial = tp_partial
        self.record = StepRecord()
        for st in stages:
            # NOTE: the time inside this rank's chunks, apart from waiting and communication
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(st, name):
                    setattr(st, name, self.record.timed(getattr(st, name)))
        self.measure_memory = measure_memory
        self.state_keys = state_keys    # the user's model's state-dict names
        self._meter = None
        self._held = None               # HeldAliases while metering
        self._resident = 0
        self._peak: int | None = None
        self._bucketed = plan.parallelism.dp > 1 and plan.parallelism.zero <= 1
        par = plan.parallelism
        self._batched = batched         # which batch tensors carry the samples (dim 0)
        self._last_device = (plan.chunks[-1]["device"] if plan.chunks else par.pp - 1)
        # NOTE: the model's precision and device: the loss returned, and every rank's
        # operand of its all-reduce (NCCL reduces device tensors only)
        first = next((p for ch in chunks for p in ch.parameters() if p.is_floating_point()),
                     None)
        self._dtype = first.dtype if first is not None else torch.float32
        self._device = first.device if first is not None else torch.device("cpu")

    # ------------------------------------------------------------------ the step
    def __call__(self, batch: Any) -> torch.Tensor:
        if self.measure_memory and self._meter is None and self._peak is None:
            self._start_meter()
        start = time.perf_counter()
        tensors = self._local(batch)
        losses: list = []
        # NOTE: every rank passes the batch and the target; the schedule reads them on the
        # ranks of its first and last chunks only. The "target" of a micro-batch is the factor
        # its loss is scaled by (``_factors``)
        target = self._factors(batch, tensors)
        self.record._open = 0.0
        self.schedule.step(*tensors, target=target, losses=losses, return_outputs=False)
        self.record.compute.append(self.record._open)
        self._sum_partial_grads()
        self._sum_shared_grads()
        if self._held is not None:
            self._held.release(wait_s=1.0)
        opt_start = time.perf_counter()
        self.optimizer.step()
        self.record.optimizer.append(time.perf_counter() - opt_start)
        # NOTE: DDP's gradients are views of its buckets: kept (zeroed), not dropped — a
        # dropped one comes back as a new tensor beside its bucket at the next backward
        self.optimizer.zero_grad(set_to_none=not self._bucketed)
        loss = self._global_loss(losses)
        self.record.seconds.append(time.perf_counter() - start)
        self.record.losses.append(float(loss))
        return loss

    def _local(self, batch: Any) -> list:
        tensors = self.flat.leaves_of(batch)
        par = self.plan.parallelism
        rows = par.micro_batch * par.n_micro
        size = rows if self.local_batches else rows * par.dp
        for t, b in zip(tensors, self._batched):
            if b and t.shape[0] != size:
                what = "this replica's part" if self.local_batches else "the global batch"
                raise ValueError(f"a batch of {t.shape[0]} samples, but the plan's "
                                 f"{what} is {size} samples")
        if self.local_batches:
            return tensors
        return self.flat.replica_part(tensors, self.layout.replica, par.dp, size)

    def _factors(self, batch: Any, local: list) -> torch.Tensor:
        """Each of this replica's micro-batches' loss factor: its weight times the number
        of micro-batches of the whole batch over the whole weight, so that the schedule's mean
        over micro-batches and the replicas' mean of gradients give the whole batch's loss."""
        par = self.plan.parallelism
        n, mb = par.n_micro, par.micro_batch
        if self.weights is None:
            return torch.ones(n, dtype=torch.float64)

        def weights_of(tensors: list, parts: int) -> torch.Tensor:
            return torch.cat([self.weights.of([t[i * mb:(i + 1) * mb] if b else t
                                               for t, b in zip(tensors, self._batched)])
                              for i in range(parts)]).double()

        mine = weights_of(local, n)
        if self.local_batches:
            total = mine.sum().reshape(1)
            if self.layout.dp > 1:
                import torch.distributed as dist

                dist.all_reduce(total, group=self.mesh["dp"].get_group())
            total = total[0]
        else:
            total = weights_of(self.flat.leaves_of(batch), n * par.dp).sum()
        return mine * (n * par.dp) / total

    def _sum_partial_grads(self) -> None:
        """The gradients of parameters each tensor-parallel shard holds a part of (row-
        parallel biases, added by one shard; with sequence parallelism, norms' weights read
        by parts of the sequence) summed over the shards, in one collective a step."""
        if not self.tp_partial:
            return
        import torch.distributed as dist

        params = list({id(p): p for ch in self.chunks for n, p in _named(ch)
                       if n in self.tp_partial and p.requires_grad}.values())
        for p in params:
            if p.grad is None:   # NOTE: not reached by this rank's chunks this step
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.mesh["tp"].get_group())
        start = 0
        for g in grads:
            g.copy_(flat[start:start + g.numel()].view_as(g))
            start += g.numel()

    def _sum_shared_grads(self) -> None:
        """A parameter held by chunks on several ranks (a tied embedding and head): its
        gradient is the sum of theirs, on each of them (the copies stay equal)."""
        if not self.shared:
            return
        import torch.distributed as dist

        for name, group in self.shared:
            mine = list({id(p): p for ch in self.chunks for n, p in _named(ch)
                         if n == name}.values())
            if not any(p.requires_grad for p in mine):
                continue            # NOTE: frozen alike on every rank holding it
            grads = [_local(p.grad) for p in mine if p.grad is not None]
            if not grads:           # NOTE: not reached by this rank's chunks this step
                grads = [torch.zeros_like(_local(mine[0].detach()))]
            # NOTE: summed in place, into the first copy's gradient: a tensor made here and
            # freed after a gloo collective may be released on gloo's thread, where the
            # allocator meter does not see it go (and it costs the bytes of the parameter)
            total = grads[0]
            for g in grads[1:]:
                total += g
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in mine:
                if p.grad is None:
                    p.grad = _like(p, total.clone())
                elif _local(p.grad) is not total:
                    _local(p.grad).copy_(total)

    def _global_loss(self, losses: list) -> torch.Tensor:
        import torch.distributed as dist

        lay = self.layout
        mine = lay.stage == self._last_device and lay.shard == 0
        # NOTE: summed in float64 on every rank (those without losses too: the all-reduce's
        # dtypes must agree), returned at the model's precision, at least float32's
        value = torch.stack([x.detach().double() for x in losses]).mean() if (mine and losses) \
            else torch.zeros((), dtype=torch.float64, device=self._device)
        value = value.reshape(())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
        return (value / lay.dp).to(torch.promote_types(self._dtype, torch.float32))

    # ------------------------------------------------------------------ measuring
    def _start_meter(self) -> None:
        from ...execute.meter import MemoryMeter

        # NOTE: what the rank holds as its first step begins: its parameters and buffers
        # (whose bytes the meter cannot see freed or kept); everything later is the meter's
        self._resident = storage_bytes(t for ch in self.chunks
                                       for t in [*ch.parameters(), *ch.buffers()])
        self._meter = MemoryMeter()
        self._metering = ExitStack()
        self._metering.enter_context(self._meter)
        # NOTE: gloo frees a collective's buffers on its own threads, unseen by the meter:
        # while metering, collectives run on aliases this thread drops (collective_frees)
        self._held = self._metering.enter_context(frees_on_this_thread())

    def _stop_meter(self) -> None:
        if self._meter is not None:
            self._metering.close()
            self._held = None
            self._peak = self._resident + self._meter.peak_bytes
            self._meter = None

    def report(self):
        """Every rank's measured step beside the plan's prediction (a ``DistReport``; every
        rank calls it, and gets all ranks' rows). Ends the memory measurement."""
        import torch.distributed as dist

        from .rank_report import DistReport, RankReport

        self._stop_meter()
        lay = self.layout
        stage = next((s for s in self.plan.stages if s["index"] == lay.stage), {})
        mine = RankReport(lay.rank, lay.stage, lay.replica, lay.shard,
                          list(self.record.seconds), self.plan.predicted.get("step_s", 0.0),
                          self._peak, stage.get("peak_bytes", 0.0),
                          dict(stage.get("memory", {})), list(self.notes),
                          compute=list(self.record.compute),
                          predicted_compute_s=stage.get("time", {}).get("busy_s", 0.0),
                          optimizer=list(self.record.optimizer),
                          resident_bytes=self._resident if self._peak is not None else None)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
        return DistReport(rows)

    # ------------------------------------------------------------------ results
    def named_parameters(self):
        """This rank's parameters by their names in the user's model (a parameter two chunks
        of this rank hold, once)."""
        seen = set()
        for ch in self.chunks:
            for name, p in _named(ch):
                if name not in seen:
                    seen.add(name)
                    yield name, p

    def save(self, path: str) -> None:
        """A ``torch.distributed.checkpoint`` of the model's state, by the model's own names:
        every rank calls it; ``fitgraph.dist.runtime.checkpoint.load_unsplit`` (or
        ``dcp.load`` into ``model.state_dict()``) reads it back into the whole model."""
        from .checkpoint import save

        save(self, path)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's stage's parameters whole (gathered from their data-parallel and
        tensor-parallel shards; every rank of the launch calls it)."""
        return {name: self.unsharded(name, p.data, data_parallel=True).clone()
                for name, p in sorted(self.named_parameters(), key=lambda x: x[0])}

    def unsharded(self, name: str, t: torch.Tensor, data_parallel: bool) -> torch.Tensor:
        """``t`` (model parameter ``name`` on this rank) whole along tensor parallelism
        (gathered from the shards: every rank of the stage calls it alike) and, with
        ``data_parallel``, along FSDP's shards too; else as it is."""
        import torch.distributed as dist

        from .tensor_parallel import untake

        how = self.tp_params.get(name)
        if how is None and not data_parallel:
            return t.detach()
        t = t.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        t = t.contiguous()
        if how is None:
            return t
        shards = [torch.empty_like(t) for _ in range(self.layout.tp)]
        dist.all_gather(shards, t, group=self.mesh["tp"].get_group())
        return untake(shards, how.dim, how.parts)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a sharded tensor's local part)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _named(chunk):

    return [(chunk.model_name(n), p) for n, p in chunk.named_parameters()]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local
