"""Measure a training step — eager PyTorch's or a plan's — honestly: allocator bytes and medians.

Peaks are reported like the simulator's: the bytes resident before the step (weights, buffers,
batch, optimizer state) plus the meter's peak above them. Time is the median of several steps
after warm-up; memory is measured in a separate run because the profiler slows steps down.

Example:
    >>> import torch
    >>> from fitgraph.measure import measure_eager
    >>> m = torch.nn.Linear(64, 64)
    >>> r = measure_eager(m, torch.randn(32, 64), lambda m, b: m(b).square().mean(), repeats=2)
    >>> r.peak_bytes > r.resident_bytes
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .capture.calling import LossFn, compute_loss
from .execute.executor import Executor
from .execute.meter import MemoryMeter
from .graph.ir import Graph
from .plan.instructions import Plan

__all__ = ["StepMeasurement", "constant_bytes", "eager_step", "measure_eager", "measure_plan",
           "resident_bytes", "time_interleaved", "trainable_grad_bytes"]

WARMUP_STEPS = 1


@dataclass(frozen=True)
class StepMeasurement:
    peak_bytes: int          # resident + peak allocated during the step
    resident_bytes: int      # weights, buffers, batch, optimizer state, existing before the step
    step_s: float            # median wall time of one step
    step_times: tuple[float, ...]


def _storages_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the ``.grad`` storages the model's parameters hold (each storage once)."""
    return _storages_bytes([p.grad for p in model.parameters() if p.grad is not None])


def trainable_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes the gradients of the model's trainable parameters take once made, whether or not
    they exist now (``grad_bytes`` counts those that do)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def resident_bytes(model: torch.nn.Module, batch: Any,
                   optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes that exist before a step: parameters, buffers, batch leaves, optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers()) + tree_flatten(batch)[0]
    if optimizer is not None:
        for st in optimizer.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return _storages_bytes(tensors)


def constant_bytes(graph: Graph) -> int:
    """Bytes of the tensor constants a captured graph holds (``const:`` inputs: scalars that
    Python numbers became, tables traced as constants): they exist before each step, held by
    the graph, as the simulator counts them, where ``resident_bytes`` sees the model alone."""
    others = {graph.values[v].storage for v, name in zip(graph.inputs, graph.input_names)
              if not name.startswith("const:")}
    held = {graph.values[v].storage for v, name in zip(graph.inputs, graph.input_names)
            if name.startswith("const:")} - others
    return sum(graph.storages[st].nbytes for st in held)


def _run(step: Callable[[], Any], zero: Callable[[], None], repeats: int, device) -> tuple[
        int, tuple[float, ...]]:
    for _ in range(WARMUP_STEPS):
        zero()
        step()
    times = []
    for _ in range(repeats):
        zero()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    zero()
    with MemoryMeter(device) as meter:
        step()
    return meter.peak_bytes, tuple(times)


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _zeroer(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    def zero() -> None:
        # NOTE: steady-state training: gradients set to None before each step
        for p in model.parameters():
            p.grad = None
    del optimizer
    return zero


def eager_step(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None = None,
               optimizer: torch.optim.Optimizer | None = None) -> Callable[[], torch.Tensor]:
    """One eager PyTorch step as a callable: forward, loss, ``backward()``,
    ``optimizer.step()``; returns the loss."""
    def step():
        loss = compute_loss(model, batch, loss_fn)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss.detach()
    return step


def time_interleaved(steps: dict[str, Callable[[], Any]], model: torch.nn.Module,
                     rounds: int, device=None) -> dict[str, StepMeasurement]:
    """Each of ``steps`` timed in ``rounds`` rounds, the steps one after another within a
    round and in the reverse order every other round (none always runs on another's warm
    caches; drift lands on all alike), after a warm-up round; gradients set to None before
    each step. Returns each step's times (``step_s``: the median; no peak: 0 bytes).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(4, 1)
        >>> t = time_interleaved({"a": lambda: m(torch.ones(4)).sum().backward()}, m, 3)
        >>> len(t["a"].step_times)
        3
    """
    zero = _zeroer(model, None)
    names = list(steps)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            zero()
            _sync(device)
            t0 = time.perf_counter()
            steps[name]()
            _sync(device)
            if r:   # NOTE: round 0 warms up
                times[name].append(time.perf_counter() - t0)
    zero()
    return {k: StepMeasurement(0, 0, _median(tuple(v)), tuple(v)) for k, v in times.items()}


def measure_eager(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None = None,
                  optimizer: torch.optim.Optimizer | None = None, *, repeats: int = 3,
                  device=None) -> StepMeasurement:
    """Eager PyTorch: forward, loss, ``backward()``, ``optimizer.step()``."""
    step = eager_step(model, batch, loss_fn, optimizer)
    zero = _zeroer(model, optimizer)
    zero()
    step()  # NOTE: the first step creates optimizer state; resident bytes include it afterwards
    res = resident_bytes(model, batch, optimizer)
    peak, times = _run(step, zero, repeats, device)
    return StepMeasurement(res + peak, res, _median(times), times)


def measure_plan(graph: Graph, plan: Plan, model: torch.nn.Module, batch: Any,
                 optimizer: torch.optim.Optimizer | None = None, *, repeats: int = 3,
                 device=None) -> StepMeasurement:
    """Execute ``plan`` repeatedly. The graph must be captured with the optimizer's current
    state (capture after a first step when using an optimizer)."""
    ex = Executor(graph, plan, model, optimizer)
    zero = _zeroer(model, optimizer)
    res = resident_bytes(model, batch, optimizer) + constant_bytes(graph)
    peak, times = _run(lambda: ex(batch), zero, repeats, device)
    return StepMeasurement(res + peak, res, _median(times), times)


def _median(times: tuple[float, ...]) -> float:
    return statistics.median(times) if times else float("nan")
