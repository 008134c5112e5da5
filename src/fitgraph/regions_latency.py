"""A latency limit on a step planned by regions, checked by measurement against eager PyTorch.

``fitgraph.backend`` plans each compiled region for the limit on its simulated time. What the
simulation does not see lands on the measured step: the regions route's own cost (Dynamo's
guards, AOTAutograd's wrappers, the fx modules' interpreter: a few percent on wav2vec2 before
any plan) and what recomputing in the backward module costs beyond the ops' times. So a step
whose regions were simulated within 1.10x ran 1.12x-1.14x eager.

``checked_compile`` times the user's forward and backward through the compiled regions against
the same in eager PyTorch, in paired rounds (``latency_check.paired``), both without side
effects (``.grad`` put back, buffers restored, the RNG forked). Where the
median ratio is over the limit, the regions are compiled and planned again for a limit scaled
by what the simulation missed, up to ``latency_check.MAX_TRIES`` plans; then the regions
unplanned (nothing recomputed) are the last resort, and where they too are over the limit
(the route's own cost) the try that measured fastest is kept. Each plan is a new backend, so Dynamo
compiles each region once more per try (its cache entries count toward
``torch._dynamo.config.recompile_limit``). The optimizer step, the same in both, is left out:
the ratio is the forward and backward's, which is stricter than the whole step's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RegionsTry", "checked_compile"]

# NOTE: calls that compile before a try is timed: Dynamo compiles a region again at the second
# call where a Python float read from data becomes a graph input
SETTLE_CALLS = 4


@dataclass
class RegionsTry:
    """One compile of the step's regions: the limit it was planned for (None: unplanned), its
    simulated ratio (the regions' planned over eager times), the measured ratio of the forward
    and backward to eager PyTorch's, and the largest planned region peak."""

    planned_for: float | None
    simulated: float
    measured: float
    spread: float
    peak_bytes: int

    def as_dict(self) -> dict:
        return {"planned_for": None if self.planned_for is None else round(self.planned_for, 4),
                "simulated": round(self.simulated, 4), "measured": round(self.measured, 4),
                "spread": round(self.spread, 4), "peak_bytes": self.peak_bytes}


@dataclass
class Compiled:
    """The compiled loss that ``checked_compile`` kept, its backend, the graph breaks seen
    while compiling it, and the tries (``notes()`` for the report)."""

    loss: Callable[[Any], torch.Tensor]
    backend: Any
    breaks: Counter = field(default_factory=Counter)
    limit: float | None = None
    tries: list[RegionsTry] = field(default_factory=list)
    kept: int | None = None   # index into tries; None: not measured

    def notes(self) -> dict:
        t = None if self.kept is None else self.tries[self.kept]
        plan = ("not measured" if t is None else
                "unplanned" if t.planned_for is None else f"try {self.kept + 1}")
        return {"limit": self.limit, "plan": plan,
                "measured": None if t is None else round(t.measured, 4),
                "tries": [x.as_dict() for x in self.tries]}


def _settle(timer: Callable[[], float]) -> Counter:
    """Call ``timer`` (a side-effect-free forward and backward through the compiled loss) until a call
    compiles nothing; the graph breaks seen while compiling."""
    from torch._dynamo.utils import counters

    breaks: Counter = Counter()
    for _ in range(SETTLE_CALLS):
        seen = Counter(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
        timer()
        breaks += Counter(counters["graph_break"]) - seen
        if counters["stats"]["unique_graphs"] == graphs:
            break
    return breaks


def _simulated(reports: list) -> tuple[float, int]:
    """(the regions' planned over eager simulated time, the largest planned region peak)."""
    eager = sum(r.eager_step_s for r in reports)
    planned = sum(r.planned_step_s for r in reports)
    return (planned / eager if eager > 0 else 1.0,
            max((r.planned_peak_bytes for r in reports), default=0))


def checked_compile(compute_loss: Callable[[Any], torch.Tensor], model: torch.nn.Module,
                    batch: Any, loss_fn, limit: float, make_backend: Callable,
                    time_budget: float) -> Compiled:
    """``torch.compile(compute_loss)`` with ``make_backend(limit, time_budget)`` (a
    ``fitgraph.backend``; None: unplanned) for the tightest limit whose measured forward and
    backward is within ``limit`` of eager PyTorch's (the module doc says how)."""
    from . import latency_check
    from .cost import measures_here

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    eager = latency_check.torch_forward_backward(model, batch, loss_fn, device, into_grad=True)
    out = Compiled(loss=compute_loss, backend=None, limit=limit)
    made: list[tuple] = []    # (loss, backend, breaks) of each try, as out.tries

    def attempt(target: float | None, share: float) -> float | None:
        """Compile for ``target``, time it (None: op costs not measured here)."""
        backend = make_backend(target, share)
        loss = torch.compile(compute_loss, backend=backend)
        timer = latency_check.torch_forward_backward(model, batch, loss_fn, device,
                                                     loss_of=loss, into_grad=True)
        made.append((loss, backend, _settle(timer)))
        if not measures_here(backend.cost_model):
            return None
        simulated, peak = _simulated(backend.reports)
        measured, spread = latency_check.paired(timer, eager)
        out.tries.append(RegionsTry(target, simulated, measured, spread, peak))
        return measured

    target = limit
    for i in range(latency_check.MAX_TRIES):
        # NOTE: a try after the first gets half the time: planning time stays within 2x
        share = time_budget if i == 0 else time_budget / 2 / (latency_check.MAX_TRIES - 1)
        measured = attempt(target, share)
        if measured is None or measured <= limit or target <= 1.0:
            # NOTE: op costs from a model of other hardware (nothing here to measure against),
            # within the limit, or planned for eager's simulated time already
            break
        # NOTE: what the simulation missed, as a factor: plan for a limit that much lower
        target = max(1.0, target * out.tries[-1].simulated / measured)
    if out.tries and out.tries[-1].measured > limit:
        # NOTE: the last resort: the regions as torch.compile makes them, nothing recomputed;
        # where it too is over the limit (the route's own cost), the fastest try is kept
        attempt(None, time_budget)
    within = [i for i, t in enumerate(out.tries) if t.measured <= limit]
    out.kept = (None if not out.tries else within[0] if within else
                min(range(len(out.tries)), key=lambda i: out.tries[i].measured))
    out.loss, out.backend, out.breaks = made[-1 if out.kept is None else out.kept]
    return out
