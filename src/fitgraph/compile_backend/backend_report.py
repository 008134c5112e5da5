"""What the torch.compile backend planned for one compiled graph."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..units import format_bytes

__all__ = ["BackendReport"]


@dataclass(frozen=True)
class BackendReport:
    """One compiled forward+backward graph. Peaks and step times are simulated on the joint
    graph with the backend's cost model; "eager" is the budget-less partition (every forward
    value the backward reads is saved, as torch's default partition does)."""

    solver: str                    # "none" when no budget or latency limit was given
    budget_bytes: int | None
    latency_limit: float | None
    nodes: int                     # ATen nodes of the joint graph
    forward_nodes: int
    eager_peak_bytes: int
    planned_peak_bytes: int
    eager_step_s: float
    planned_step_s: float
    eager_saved_bytes: int         # activations the budget-less partition saves for the backward
    planned_saved_bytes: int       # activations this plan saves
    saved_tensors: int
    recomputed_nodes: int          # forward ATen nodes the backward runs again
    recomputed: tuple[str, ...]
    solve_s: float
    plan_s: float                  # the whole partition: conversion, profiling, solve, split
    cost_model: str
    notes: dict = field(default_factory=dict)   # "hold_bytes": planned with a boundary hold
    resident_bytes: int = 0        # what the joint graph's peak counts from: weights, inputs
    graph_key: str = ""            # the graph's identity across compiles (``boundary_hold``)
    weight_bytes: int = 0          # of resident_bytes: weights and buffers

    def __str__(self) -> str:
        target = ("the smallest peak" if self.notes.get("budget") == "smallest" else
                  "no budget: save everything" if self.budget_bytes is None
                  and self.latency_limit is None else
                  f"budget {format_bytes(self.budget_bytes)}" if self.budget_bytes is not None
                  else f"latency limit {self.latency_limit:.2f}x eager")
        ratio = self.planned_peak_bytes / self.eager_peak_bytes if self.eager_peak_bytes else 1.0
        return "\n".join([
            f"fitgraph torch.compile plan ({self.solver}, {target}; {self.nodes} nodes, "
            f"{self.recomputed_nodes} recomputed in the backward, solved in {self.solve_s:.2f} s;"
            f" costs: {self.cost_model})",
            f"  saved for backward  {format_bytes(self.eager_saved_bytes):>12s} -> "
            f"{format_bytes(self.planned_saved_bytes):>12s} ({self.saved_tensors} tensors)",
            f"  peak (simulated)    {format_bytes(self.eager_peak_bytes):>12s} -> "
            f"{format_bytes(self.planned_peak_bytes):>12s} ({ratio:.2f}x)",
            f"  step (simulated)    {self.eager_step_s * 1e3:>9,.1f} ms -> "
            f"{self.planned_step_s * 1e3:>9,.1f} ms"])
