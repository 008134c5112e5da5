"""A step that cannot be captured whole, planned region by region through torch.compile.

``fitgraph.optimize`` captures the whole step as one static graph. Code that reads data into
Python (``.item()``, ``.tolist()``, ``.numpy()``) or makes shapes from data (a CTC loss,
boolean masks, a dynamic mixture-of-experts dispatch) cannot be one graph. torch.compile
handles it with graph breaks: Dynamo compiles the pieces it can trace and runs the code between
them eagerly. ``RegionsStep`` runs the step that way with ``fitgraph.backend`` planning each
compiled region (forward and backward together) within the budget, and reports what was left
out: every graph break with its reason, each region's plan, and the measured peak of the whole
step. Code between regions runs as in eager PyTorch: what it saves for the backward is not
planned, and the optimizer update runs as ``optimizer.step()``.

The report also says what this route costs in memory: the bytes the measured step saved for
the backward, by the planned regions and by the code between them (unplanned).

The budget applies to each region: a fraction of the region's own eager peak, or bytes for the
region's peak; the step's peak (optimizer state and what the eager code keeps included) is
measured at the first step after compiling settles (the second or third) and checked against a
bytes budget. Where that step runs over a bytes budget, or the budget is "smallest", the
regions are planned again once (``compile_backend.boundary_hold``): each with the bytes the
regions inside its forward-to-backward window need, and for a bytes budget within what the rest
of the step (weights, gradients, optimizer state, what earlier regions saved) leaves of it;
the plan measured lower is kept, and a step still over the budget warns.

A latency limit is checked by measurement at the first call: the regions' forward and backward
timed against eager PyTorch's, planned again for a tighter limit where they run over, the
regions unplanned as the last resort (``regions_latency``; ``report().notes["latency_check"]``).

Example:
    >>> import torch, fitgraph
    >>> class Scaled(torch.nn.Module):           # .item(): a graph break
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 1)
    ...     def forward(self, x):
    ...         h = self.a(x).relu()
    ...         return self.b(h / (1 + h.mean().item()))
    >>> model, x = Scaled(), torch.randn(64, 32)
    >>> step = fitgraph.optimize(model, x, lambda m, b: m(b).square().mean(),
    ...                          latency_limit=1.5, graph_breaks="regions")
    >>> loss = step(x)                           # compiles and plans each region
    >>> r = step.report()
    >>> len(r.regions) >= 2 and "item" in r.graph_breaks[0]
    True
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture.calling import LossFn, compute_loss
from .capture.combined_optimizer import as_optimizer
from .capture.errors import CaptureError
from .compile_backend.backend_report import BackendReport
from .compile_backend.unread_grads import LeafRuns
from .execute.meter import MemoryMeter
from .measure import _sync, grad_bytes, resident_bytes, trainable_grad_bytes
from .units import format_bytes, is_smallest, parse_budget

__all__ = ["RegionsReport", "RegionsStep", "breaks_into_regions"]


def breaks_into_regions(e: CaptureError) -> bool:
    """Whether a capture error came from tracing the step (data read into Python, shapes made
    from data, an op make_fx cannot trace), which torch.compile may trace around with graph
    breaks; not an unsupported optimizer or a malformed batch or loss."""
    return e.__cause__ is not None and not isinstance(e.__cause__, CaptureError)


@dataclass
class RegionsReport:
    """What ``RegionsStep`` planned and what it left to eager PyTorch."""

    reason: str                        # why the whole step could not be captured
    graph_breaks: list[str]            # each distinct break: its reason's first line (xN)
    regions: list[BackendReport]       # one per compiled region planned
    budget_bytes: int | None           # a bytes budget, checked against the measured step
    measured_peak_bytes: int | None = None
    measured_step_s: float | None = None
    # NOTE: bytes saved for the backward in the measured step: by the planned regions, and
    # by the code between them (eager, not planned: what the regions route costs in memory)
    regions_saved_bytes: int | None = None
    eager_saved_bytes: int | None = None
    notes: dict = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fitgraph plan by regions: the whole step could not be captured "
                 f"({self.reason.splitlines()[0]})",
                 f"  {len(self.regions)} region(s) planned by fitgraph.backend; "
                 f"{len(self.graph_breaks)} graph break(s), the code between regions ran "
                 "eagerly (what it saves for the backward is not planned):"]
        lines += [f"    - {b}" for b in self.graph_breaks]
        for i, r in enumerate(self.regions):
            held = r.notes.get("hold_bytes")
            lines.append(f"  region {i}: peak {format_bytes(r.eager_peak_bytes)} -> "
                         f"{format_bytes(r.planned_peak_bytes)} (simulated), "
                         f"{r.recomputed_nodes} recomputed" + (
                             "" if not held else
                             f", planned with {format_bytes(held)} held by later regions") + (
                             "" if "share_bytes" not in r.notes else
                             f", within {format_bytes(r.notes['share_bytes'])} of the step's "
                             "budget"))
        if self.eager_saved_bytes is not None:
            lines.append(f"  saved for the backward: {format_bytes(self.regions_saved_bytes)} by "
                         f"the planned regions, {format_bytes(self.eager_saved_bytes)} by the "
                         "code between them (eager, not planned)")
        check = self.notes.get("latency_check")
        if check and check["tries"]:
            tries = ", ".join(f"{'unplanned' if t['planned_for'] is None else t['planned_for']}"
                              f" -> {t['measured']:.3f}" for t in check["tries"])
            lines.append(f"  latency limit {check['limit']}: kept {check['plan']}, forward and "
                         f"backward measured {check['measured']:.3f}x eager PyTorch's (planned "
                         f"for -> measured: {tries})")
        if "boundary_holds" in self.notes:
            lines.append(f"  {self.notes['boundary_holds']}")
        lines += [f"  unplanned: {u}" for u in self.notes.get("unplanned", ())]
        if "not_measured" in self.notes:
            lines.append(f"  step: not measured yet ({self.notes['not_measured']})")
        lines.append(f"  step: measured peak {format_bytes(self.measured_peak_bytes)}"
                     + ("" if self.budget_bytes is None else
                        f" (budget {format_bytes(self.budget_bytes)})")
                     + ("" if self.measured_step_s is None else
                        f", {self.measured_step_s * 1e3:,.1f} ms"))
        return "\n".join(lines)


class _SavedBytes:
    """Saved-tensor hooks that add up the bytes autograd saves for the backward, apart for the
    compiled regions and for the eager code between them (each storage once).

    NOTE: a compiled region runs as one autograd Function of AOTAutograd's runtime, which
    saves its tensors when that Function's ``apply`` returns: the frame that packs them is
    AOTAutograd's own; every other pack comes from an op the eager code ran. The hooks return
    the tensor itself, so what is saved, and when it is freed, is unchanged."""

    _AOT = "_aot_autograd"

    def __init__(self) -> None:
        self.regions: dict[int, int] = {}
        self.eager: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        import sys

        # NOTE: autograd.Function.apply's Python wrapper sits between: look a few frames up
        f, region = sys._getframe(1), False
        for _ in range(3):
            if f is None:
                break
            region = region or self._AOT in f.f_code.co_filename
            f = f.f_back
        st = t.untyped_storage()
        into = self.regions if region else self.eager
        into.setdefault(st.data_ptr(), st.nbytes())
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def totals(self) -> tuple[int, int]:
        """(bytes saved by the regions, by the eager code), a storage both saved counted once
        (for the regions)."""
        eager = {k: v for k, v in self.eager.items() if k not in self.regions}
        return sum(self.regions.values()), sum(eager.values())


@contextlib.contextmanager
def _dynamo_quiet():
    """Dynamo logs every graph break as a warning with the user's stack; the report lists
    them once, so its logger is quieted while regions compile (restored after)."""
    log = logging.getLogger("torch._dynamo")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


# NOTE: fitgraph.backend objects made for steps by regions in this process (``room_to_compile``)
_BACKENDS = [0]


@contextlib.contextmanager
def room_to_compile():
    """Dynamo's recompile limit raised by what steps by regions compiled in this process.

    Each backend compiles each region's code once more, at most twice (a Python float read
    from data becomes an input at the second compile), and Dynamo counts entries per code
    object: the tries of ``regions_latency`` stay in its cache unused, and every step's
    regions share code (``RegionsStep._compute_loss``, ``compute_loss``, a model class's
    forward). Without the room, a later step's regions ran eagerly, unplanned: a fifth step
    in one process compiled nothing."""
    from torch._dynamo import config

    from .latency_check import MAX_TRIES

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{name: getattr(config, name) + 2 * (_BACKENDS[0] + MAX_TRIES + 1)}):
        yield


def _first_line(reason: str) -> str:
    """A graph break's reason in one line: Dynamo's title and its explanation (which names
    the op: "Operator `aten.nonzero.default`'s output shape depends on input Tensor data")."""
    lines = [x.strip() for x in reason.strip().splitlines() if x.strip()]
    if not lines:
        return "(no reason given)"
    why = next((x.removeprefix("Explanation:").strip() for x in lines[1:]
                if x.startswith("Explanation:")), "")
    return f"{lines[0]}: {why}" if why else lines[0]


class RegionsStep:
    """``step(batch) -> loss`` for a model whose step has graph breaks: the regions planned by
    ``fitgraph.backend``, the rest eager; then ``loss.backward()``, gradient clipping and
    ``optimizer.step()`` as a training loop would run them. Made by ``fitgraph.optimize`` when
    the whole step cannot be captured (``graph_breaks="regions"``)."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn | None,
                 optimizer: torch.optim.Optimizer | None, *, budget, latency_limit,
                 time_budget: float, cost_model, clip_grad_norm: float | None,
                 reason: CaptureError, measure_latency: bool = True, exact: bool = False,
                 progress=None) -> None:
        self.model, self.loss_fn, self.optimizer = model, loss_fn, as_optimizer(optimizer)
        self.exact, self.progress = exact, progress
        self.clip_grad_norm, self.reason = clip_grad_norm, reason
        self.budget, self.latency_limit, self.time_budget = budget, latency_limit, time_budget
        self.cost_model = cost_model
        # NOTE: with a latency limit the regions are compiled at the first call, timed against
        # eager PyTorch and planned again where they run over (``regions_latency``)
        self._unchecked = latency_limit is not None and measure_latency
        self.latency_check: dict | None = None
        self.backend = self._backend(None if self._unchecked else latency_limit, time_budget)
        # NOTE: dynamic=None: a float that changes at every step (read with .item()) becomes
        # a graph input at the second compile instead of a recompile per value
        self._loss = torch.compile(self._compute_loss, backend=self.backend)
        self._breaks: Counter[str] = Counter()
        self._settled, self._calls, self._warned_recompiling = False, 0, False
        self.measured_peak_bytes: int | None = None
        self.regions_saved_bytes: int | None = None
        self.eager_saved_bytes: int | None = None
        self.step_times: list[float] = []
        # NOTE: None until a step was measured; then the first plan's state while a second
        # plan with boundary holds settles, () once decided (``_hold_across``)
        self._held: dict | tuple | None = None
        self._to_measure = True
        self._outside_at_measure, self._grads_made = 0, False
        self._unread_grads: dict[str, set[int]] = {}
        self.hold_note: str | None = None

    def _compute_loss(self, batch: Any) -> torch.Tensor:
        return compute_loss(self.model, batch, self.loss_fn)

    def _backend(self, latency_limit: float | None, time_budget: float):
        """A ``fitgraph.backend`` for the budget or ``latency_limit`` (neither: unplanned),
        sharing the cost model (its measured op times) with the backends made before."""
        from .compile_backend import backend

        _BACKENDS[0] += 1
        # NOTE: exact: hotspot (remat inside each region), bitwise as eager; else the whole
        # portfolio (operator fission's parts too, allclose), as fitgraph.optimize plans
        # NOTE: dynamic_shapes="unplanned": compiled with dynamic=None (see __init__), a region
        # whose sizes changed between calls (a dynamic MoE dispatch, M2M100's positions) is
        # traced again with symbolic sizes; it runs as eager would, and the report says so
        return backend(budget=self.budget, latency_limit=latency_limit,
                       solver="hotspot" if self.exact else "auto",
                       time_budget=time_budget, cost_model=self.cost_model,
                       dynamic_shapes="unplanned", progress=self.progress)

    def _check_latency(self, batch: Any) -> None:
        """Compile the regions for the latency limit, timed against eager PyTorch
        (``regions_latency.checked_compile``); keep the plan that measures within it."""
        from .regions_latency import checked_compile

        made: list = []

        def make(limit: float | None, time_budget: float):
            if made and made[-1].cost_model is not None:
                self.cost_model = made[-1].cost_model  # NOTE: profiled once, then shared
            made.append(self._backend(limit, time_budget))
            return made[-1]

        with _dynamo_quiet(), room_to_compile():
            kept = checked_compile(self._compute_loss, self.model, batch, self.loss_fn,
                                   self.latency_limit, make, self.time_budget)
        self._loss, self.backend = kept.loss, kept.backend
        self._breaks += kept.breaks
        self.latency_check = kept.notes()
        self._unchecked = False

    @property
    def device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def _run(self, batch: Any) -> torch.Tensor:
        with room_to_compile():
            loss = self._loss(batch)
        loss.backward()
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        if self.optimizer is not None:
            self.optimizer.step()
        return loss.detach()

    def __call__(self, batch: Any) -> torch.Tensor:
        from torch._dynamo.utils import counters

        if self._unchecked:
            self._check_latency(batch)
        if not self._settled:
            # NOTE: a call that compiles plans regions, profiling their ops on real tensors
            # under meters of their own: it is neither measured nor timed. Dynamo may compile
            # again at the second call (a Python float read from data becomes an input), so
            # calls are measured once one compiled nothing
            seen = Counter(counters["graph_break"])
            graphs = counters["stats"]["unique_graphs"]
            with _dynamo_quiet():
                loss = self._run(batch)
            if not isinstance(self._held, dict):  # NOTE: a second plan breaks alike
                self._breaks += Counter(counters["graph_break"]) - seen
            compiled = counters["stats"]["unique_graphs"] - graphs
            self._settled = compiled == 0 and self._calls > 0
            self._calls += 1
            if compiled and self._calls > 2 and not self._warned_recompiling:
                self._warned_recompiling = True
                self._warn_recompiling()
            return loss
        if self._to_measure:
            self._to_measure = False
            resident_before = resident_bytes(self.model, batch, self.optimizer)
            before = resident_before + grad_bytes(self.model)
            saved = _SavedBytes()
            self.backend.forward_runs, self.backend.leaf_runs = [], LeafRuns()
            try:
                with MemoryMeter(self.device) as meter, \
                        torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    loss = self._run(batch)
                runs, leaves = self.backend.forward_runs, self.backend.leaf_runs
            finally:
                self.backend.forward_runs = self.backend.leaf_runs = None
            # NOTE: the step's autograd graph is gone: a leaf it made and let go is dead now
            self._unread_grads = leaves.unread()
            self.regions_saved_bytes, self.eager_saved_bytes = saved.totals()
            self.measured_peak_bytes = before + meter.peak_bytes
            # NOTE: what the step keeps outside its regions in a training loop's steady state:
            # the optimizer's state as its step left it, every trainable weight's gradient
            # (made by the backwards, which set to None or not: a region's backward runs with
            # the gradients of the regions whose backwards ran before it)
            self._outside_at_measure = (resident_bytes(self.model, batch, self.optimizer)
                                        + trainable_grad_bytes(self.model))
            self._grads_made = before == resident_before
            if not self._hold_across(runs):
                self._check_budget()
            return loss
        _sync(self.device)
        t0 = time.perf_counter()
        loss = self._run(batch)
        _sync(self.device)
        self.step_times.append(time.perf_counter() - t0)
        return loss

    step = __call__

    @property
    def settled(self) -> bool:
        """Whether the regions' plan is final and its step measured: after the third call,
        or the sixth where the regions were planned again with the bytes held across them."""
        return not self._to_measure

    # NOTE: plan the regions again with what the rest of the step holds (``boundary_hold``)
    hold_across_regions = True

    def _hold_across(self, runs: list[int]) -> bool:
        """After a measured step: plan the regions again, each with the bytes the regions
        that run inside its forward-to-backward window hold (``boundary_hold``), where that
        may lower the step's peak: at the smallest budget, or at a bytes budget the step ran
        over, where each region then plans within what the rest of the step leaves of the
        budget (``StepShares``). True while that second plan is being compiled and
        measured; the plan measured lower is kept (a second plan that does not help is
        dropped, its compiled graphs unused)."""
        from .compile_backend.boundary_hold import holds_by_graph, step_shares

        if self._held is not None:  # NOTE: the second plan was measured: keep the lower one
            first, self._held = self._held, ()
            if first and self.measured_peak_bytes >= first["measured_peak_bytes"]:
                self.__dict__.update(first)
                self.hold_note = "planned again with the bytes held across regions: " \
                    "measured no lower, the first plan kept"
            elif first:
                self.hold_note = (f"planned again with the bytes held across regions: "
                                  f"measured {format_bytes(first['measured_peak_bytes'])} -> "
                                  f"{format_bytes(self.measured_peak_bytes)}")
            return False
        limit = self._budget_bytes()
        over = limit is not None and self.measured_peak_bytes > limit
        reports = self.backend.reports
        holds = holds_by_graph(reports, runs) if is_smallest(self.budget) or over else {}
        # NOTE: a bytes budget is the step's: each region plans within what the rest of the
        # step leaves of it (at first each region had the whole budget for its own peak)
        shares = step_shares(reports, runs, limit, self._outside_at_measure,
                             self._grads_made) if over else None
        unread = self._unread_grads if is_smallest(self.budget) or over else {}
        if not self.hold_across_regions or not (holds or shares or unread):
            self._held = ()
            return False
        self._held = {k: getattr(self, k) for k in (
            "_loss", "backend", "measured_peak_bytes", "regions_saved_bytes",
            "eager_saved_bytes", "_breaks")}
        self.backend = self._backend(self.latency_limit, self.time_budget)
        self.backend.boundary_holds, self.backend.step_shares = holds, shares
        self.backend.unread_grads = unread
        self._loss = torch.compile(self._compute_loss, backend=self.backend)
        # NOTE: the first plan's measurements stay in the report until the second's replace them
        self._settled, self._calls, self._to_measure = False, 0, True
        return True

    def _warn_recompiling(self) -> None:
        # NOTE: a guard that fails at every call makes Dynamo compile (and fitgraph.backend
        # plan) again at every step, and the step is never measured. Seen on torch 2.11: its
        # tensorify_python_scalars specializes a float read with .item() that Python arithmetic
        # uses (`1 + x.item()`: `1.0 + s` is not one of the ops it turns into tensor ops), so
        # each new value is a recompile; torch 2.13 keeps it an input. Said, not worked around
        warnings.warn(f"the step by regions compiled again at call {self._calls}: a guard of a "
                      "region fails at every call (a Python float read with .item() that torch "
                      "specializes to its value, as some versions do for `1 + x.item()`: "
                      "computing on the tensor before .item() avoids it). Each call compiles "
                      "and plans that region again until torch.compile's recompile_limit, "
                      "after which torch runs it eagerly, unplanned; the step is measured at "
                      "the first call that compiles nothing (TORCH_LOGS=recompiles says which "
                      "guard fails)", stacklevel=3)

    def _budget_bytes(self) -> int | None:
        """The budget where it is bytes (checked against the measured step); None for a
        fraction, which refers to each region's own eager peak."""
        if self.budget is None or isinstance(self.budget, float) or str(
                self.budget).strip().endswith("%") or is_smallest(self.budget):
            return None
        return parse_budget(self.budget, eager_peak_bytes=1)

    def _check_budget(self) -> None:
        limit = self._budget_bytes()
        if limit is not None and self.measured_peak_bytes > limit:
            warnings.warn(f"the step by regions peaked at {format_bytes(self.measured_peak_bytes)}"
                          f", over the budget {format_bytes(limit)}: the budget holds for each "
                          "planned region, not for the eager code between them nor the "
                          "optimizer state; see step.report()", stacklevel=3)

    def report(self) -> RegionsReport:
        breaks = [_first_line(r) + (f" (x{n})" if n > 1 else "")
                  for r, n in sorted(self._breaks.items())]
        # NOTE: while a second plan settles, the report is the first plan's, as measured
        backend = self._held["backend"] if isinstance(self._held, dict) else self.backend
        return RegionsReport(
            reason=str(self.reason), graph_breaks=breaks, regions=list(backend.reports),
            budget_bytes=self._budget_bytes(), measured_peak_bytes=self.measured_peak_bytes,
            regions_saved_bytes=self.regions_saved_bytes,
            eager_saved_bytes=self.eager_saved_bytes,
            measured_step_s=statistics.median(self.step_times) if self.step_times else None,
            notes=({} if self._settled or self.measured_peak_bytes is not None else {
                "not_measured": f"each of the {self._calls} call(s) so far compiled: the step "
                                "is measured at the first call that compiles nothing"})
            | ({} if self.latency_check is None else {"latency_check": self.latency_check})
            | ({} if self.hold_note is None else {"boundary_holds": self.hold_note})
            | ({"unplanned": list(backend.unplanned)} if backend.unplanned else {}))

    def save(self, path: str) -> None:
        raise NotImplementedError("a step planned by regions cannot be saved: its regions are "
                                  "torch.compile graphs, compiled again in each process")
