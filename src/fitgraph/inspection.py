"""``fitgraph inspect``: capture a step, simulate its eager plan, measure it, compare.

Example:
    >>> import torch
    >>> from fitgraph.inspection import inspect_step
    >>> m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    >>> r = inspect_step(m, torch.randn(16, 32), lambda m, b: m(b).mean(), repeats=1)
    >>> r.simulated_peak_bytes == r.measured_peak_bytes
    True
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .capture.api import capture
from .capture.calling import LossFn
from .capture.combined_optimizer import as_optimizer
from .graph.ir import Graph
from .plan.eager import eager_plan
from .sim.simulate import SimResult, simulate

__all__ = ["InspectResult", "available_memory_bytes", "inspect_step"]


@dataclass
class InspectResult:
    model: str
    nodes: int
    nodes_by_phase: dict[str, int]
    values: int
    storages: int
    capture_s: float
    cost_model: str
    resident_bytes: int
    simulated_peak_bytes: int
    predicted_step_s: float
    breakdown: dict[str, int]
    top_tensors: list[dict]
    simulate_only: bool
    simulate_only_reason: str = ""
    measured_peak_bytes: int | None = None      # executing the eager plan
    measured_step_s: float | None = None
    eager_peak_bytes: int | None = None         # eager PyTorch itself
    eager_step_s: float | None = None
    profile_s: float = 0.0
    timeline: list[int] = field(default_factory=list, repr=False)
    phase_starts: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def sim_vs_measured(self) -> float | None:
        if self.measured_peak_bytes is None:
            return None
        return self.simulated_peak_bytes / self.measured_peak_bytes

    @property
    def time_prediction_ratio(self) -> float | None:
        if self.measured_step_s is None:
            return None
        return self.predicted_step_s / self.measured_step_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        d["sim_vs_measured"] = self.sim_vs_measured
        d["time_prediction_ratio"] = self.time_prediction_ratio
        return d


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (only to decide whether a run fits, never to measure)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# NOTE: leave room for Python, the profiler and the allocator's own overhead
MEMORY_HEADROOM = 0.8


def _is_meta(model: torch.nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def inspect_step(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, cost_model=None,
                 simulate_only: bool | None = None, repeats: int = 3, name: str | None = None,
                 progress: bool = False, reprofile: bool = False) -> InspectResult:
    """Capture, simulate and (when it fits in this machine's memory) measure one step.

    ``cost_model``: None or ``"measured"`` for the measured cost model of this device (ops
    profiled and cached), a device name (``"a100-80gb"``) or ``DeviceSpec`` for a roofline
    model, or a cost model object (``cost.choose_cost_model``). Simulate-only happens when asked,
    when the model lives on the meta device, or when the predicted peak exceeds free memory.
    """
    from .cost import (
        DeviceSpec,
        ProfiledCostModel,
        RooflineCostModel,
        choose_cost_model,
        get_device,
    )

    meta = _is_meta(model)
    optimizer = as_optimizer(optimizer)   # NOTE: a list (Muon + AdamW) steps as one
    if optimizer is not None and not meta:
        from .measure import measure_eager
        # NOTE: one eager step first, so optimizer state exists and the graph is steady-state
        measure_eager(model, batch, loss_fn, optimizer, repeats=0)
    g = capture(model, batch, loss_fn, optimizer)
    plan = eager_plan(g)
    measured = cost_model is None or (isinstance(cost_model, str)
                                      and cost_model.strip().lower().startswith("measured"))
    # NOTE: the device's roofline guesses whether the step fits here (cpu-generic where the
    # cost model measures or is the caller's own)
    roofline = (choose_cost_model(cost_model)
                if isinstance(cost_model, str | DeviceSpec) and not measured
                else RooflineCostModel(get_device("cpu-generic")))
    reason = ""
    if simulate_only is None:
        simulate_only = False
        if meta:
            simulate_only, reason = True, "the model is on the meta device (no real weights)"
        else:
            guess = simulate(g, plan, roofline).peak_bytes
            free = available_memory_bytes()
            if guess - g.resident_bytes > MEMORY_HEADROOM * free:
                simulate_only = True
                reason = (f"predicted peak {guess / 2**30:.1f} GiB exceeds this machine's free "
                          f"memory ({free / 2**30:.1f} GiB)")
    elif simulate_only:
        reason = "asked for (--simulate-only)"
    profile_s = 0.0
    if simulate_only or not measured and isinstance(cost_model, str | DeviceSpec):
        cm = roofline
    elif not measured:
        cm = choose_cost_model(cost_model)
    else:
        cm = (ProfiledCostModel(progress=progress, refresh=reprofile) if cost_model is None
              else choose_cost_model(cost_model))
        t0 = time.perf_counter()
        cm.profile(g)
        profile_s = time.perf_counter() - t0
    sim = simulate(g, plan, cm)
    res = _result(name or type(model).__name__, g, sim, cm, simulate_only, reason)
    res.profile_s = profile_s
    if not simulate_only:
        from .measure import measure_eager, measure_plan

        mp = measure_plan(g, plan, model, batch, optimizer, repeats=repeats)
        me = measure_eager(model, batch, loss_fn, optimizer, repeats=repeats)
        res.measured_peak_bytes, res.measured_step_s = mp.peak_bytes, mp.step_s
        res.eager_peak_bytes, res.eager_step_s = me.peak_bytes, me.step_s
    return res


def _result(name: str, g: Graph, sim: SimResult, cm, simulate_only: bool,
            reason: str) -> InspectResult:
    s = g.summary()
    return InspectResult(
        model=name, nodes=s["nodes"], nodes_by_phase=s["nodes_by_phase"], values=s["values"],
        storages=s["storages"], capture_s=g.meta.get("capture_s", 0.0), cost_model=cm.name,
        resident_bytes=sim.resident_bytes, simulated_peak_bytes=sim.peak_bytes,
        predicted_step_s=sim.latency_s, breakdown=dict(sim.breakdown),
        top_tensors=[asdict(t) for t in sim.top_tensors], simulate_only=simulate_only,
        simulate_only_reason=reason, timeline=list(sim.peak_during),
        phase_starts=dict(sim.phase_starts))
