"""``fitgraph.optimize``: plan a training step within a memory budget; get a drop-in step.

Example:
    >>> import torch, fitgraph
    >>> layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)]
    >>> model, batch = torch.nn.Sequential(*layers), torch.randn(512, 256)
    >>> step = fitgraph.optimize(model, batch, lambda m, b: m(b).square().mean(), budget=0.8)
    >>> loss = step(batch)                       # .grad written exactly as loss.backward() would
    >>> r = step.report()
    >>> r.planned_peak_bytes <= r.budget_bytes and r.measured_peak_bytes == r.planned_peak_bytes
    True
"""

from __future__ import annotations

import dataclasses
import pickle
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from . import progress as _progress
from .ambient import autocast_as, autocast_state, no_autocast, step_key
from .capture.api import capture
from .capture.calling import LossFn, compute_loss
from .capture.combined_optimizer import as_optimizer, members
from .capture.errors import CaptureError
from .capture.optimizer_kinds import kind_of
from .capture.wrappers import unwrapped
from .cost import measures_here
from .execute.executor import Executor
from .execute.meter import MemoryMeter
from .execute.optimizer_ops import has_step_pre_hooks, init_missing_state
from .execute.slots import ModelSlots
from .graph.analysis import graph_fingerprint
from .graph.ir import Graph
from .measure import _sync
from .plan.instructions import Plan
from .plan.verify import verify_plan
from .python_values import StepValues
from .sim.simulate import SimResult, simulate
from .solvers import Problem, Solution, solve, solve_smallest
from .solvers.grads_in_place import grads_in_place
from .transform.optimizer_in_backward import (
    OptimizerInBackwardError,
    why_not,
)
from .transform.registry import TRANSFORMS
from .units import (
    budget_bytes,
    check_budget,
    check_latency_limit,
    format_bytes,
    is_smallest,
)

__all__ = ["OptimizeReport", "TrainStep", "graph_fingerprint", "load", "optimize"]

SAVE_FORMAT = 1


def _shapes(shapes: tuple) -> str:
    """A batch's leaf shapes in a progress line: (2, 512), (2, 512)."""
    return ", ".join(str(tuple(s[0])) if isinstance(s[0], tuple) else str(s[0]) for s in shapes)


@dataclass
class OptimizeReport:
    """What fitgraph did for one batch shape. Simulated numbers use the same cost model."""

    solver: str
    budget_bytes: int | None
    latency_limit: float | None
    eager_peak_bytes: int          # simulated eager plan (= measured eager PyTorch, law 2)
    planned_peak_bytes: int        # simulated plan
    eager_step_s: float            # simulated eager plan
    planned_step_s: float          # simulated plan
    solve_s: float
    cost_model: str
    nodes: int
    recomputes: int
    measured_peak_bytes: int | None = None   # filled after the plan's first step ran
    measured_step_s: float | None = None     # median of the steps run after the first
    notes: dict = field(default_factory=dict)

    def __str__(self) -> str:
        def ratio(a, b):
            return "-" if a is None or b is None else f"{a / b:.2f}x"

        def ms(s):
            return "-" if s is None else f"{s * 1e3:,.1f} ms"

        target = (f"budget {format_bytes(self.budget_bytes)}" if self.budget_bytes is not None
                  else f"latency limit {self.latency_limit:.2f}x eager")
        # NOTE: "auto" names the solver whose plan it returned
        solver = (f"{self.solver}: {self.notes['winner']}" if "winner" in self.notes
                  else self.solver)
        check = self.notes.get("latency_check")
        if isinstance(check, dict) and check.get("plan") == "eager PyTorch":
            # NOTE: even the eager plan timed over the limit: the step runs eager PyTorch,
            # whose peak is the eager plan's (law 2)
            solver += "; runs eager PyTorch: every plan timed over the latency limit"
        lines = [f"fitgraph plan ({solver}, {target}; {self.nodes} nodes, "
                 f"{self.recomputes} recomputes, solved in {self.solve_s:.2f} s; costs: "
                 f"{self.cost_model})",
                 f"{'':14s}{'eager':>14s}{'planned':>14s}{'measured':>14s}{'planned/eager':>15s}",
                 f"{'peak memory':14s}{format_bytes(self.eager_peak_bytes):>14s}"
                 f"{format_bytes(self.planned_peak_bytes):>14s}"
                 f"{format_bytes(self.measured_peak_bytes):>14s}"
                 f"{ratio(self.planned_peak_bytes, self.eager_peak_bytes):>15s}",
                 f"{'step time':14s}{ms(self.eager_step_s):>14s}{ms(self.planned_step_s):>14s}"
                 f"{ms(self.measured_step_s):>14s}"
                 f"{ratio(self.planned_step_s, self.eager_step_s):>15s}"]
        return "\n".join(lines)


@dataclass
class _Planned:
    graph: Graph                   # what the plan runs on (a solver may have rewritten it)
    solution: Solution
    eager: SimResult
    fingerprint: str | None = None  # of the captured graph, which ``load`` captures again
    executor: Executor | None = None
    measured_peak_bytes: int | None = None
    step_times: list[float] = field(default_factory=list)
    # NOTE: loaded without a batch: the first batch's capture must fingerprint the same
    unverified: bool = False
    # NOTE: no plan, the eager plan included, ran within the latency limit against eager
    # PyTorch (the executor runs ops one by one that eager runs in C++): run eager PyTorch
    eager_pytorch: bool = False


class TrainStep:
    """A planned training step: ``step(batch) -> loss`` leaves ``.grad`` / weights / optimizer
    state exactly as eager PyTorch would (with optimizer-in-backward, ``.grad`` stays None: each
    gradient is freed right after its update). Made by ``fitgraph.optimize`` or ``fitgraph.load``."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn | None,
                 optimizer: torch.optim.Optimizer | None, *, budget, latency_limit,
                 time_budget: float, solver: str, cost_model, on_new_shape: str,
                 optimizer_in_backward: bool | str = False,
                 clip_grad_norm: float | None = None, exact: bool = False,
                 measure_latency: bool = True, progress=None) -> None:
        if on_new_shape not in ("replan", "error"):
            raise ValueError("on_new_shape must be 'replan' or 'error'")
        if optimizer_in_backward not in (False, True, "auto"):
            raise ValueError("optimizer_in_backward must be False, True or 'auto'")
        self.in_backward, self.clip_grad_norm = optimizer_in_backward, clip_grad_norm
        # NOTE: a list of optimizers (Muon + AdamW) steps as one (capture.combined_optimizer)
        self.model, self.loss_fn, self.optimizer = model, loss_fn, as_optimizer(optimizer)
        self.budget, self.latency_limit = budget, latency_limit
        self.time_budget, self.solver, self.on_new_shape = time_budget, solver, on_new_shape
        self.cost_model, self.progress = cost_model, progress
        self.exact, self.measure_latency = exact, measure_latency
        self._plans: dict[tuple, _Planned] = {}
        self._last: tuple | None = None
        self._slots = ModelSlots(model)
        self._modules, self._params = list(model.modules()), list(model.parameters())
        # NOTE: Python values the step reads as constants (fitgraph.python_values)
        self._values = StepValues(model, loss_fn)
        self._autocast: tuple = ()   # NOTE: the caller's autocast, captured in (fitgraph.ambient)

    # -- planning -------------------------------------------------------------------------------
    def _cost(self):
        from .cost import choose_cost_model

        # NOTE: ops are timed where the model runs: a CUDA model's costs are its kernels'
        self.cost_model = choose_cost_model(self.cost_model, self.device)
        return self.cost_model

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (the CPU for a model without any)."""
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def _state_key(self) -> tuple:
        """The optimizer state each param group keeps at steady state (the plan's graph reads
        it from the first step on: ``capture(..., steady_state=True)``)."""
        if self.optimizer is None:
            return ()
        kinds = [kind_of(m) for m in members(self.optimizer) for _ in m.param_groups]
        return tuple(k.keys(g) if k is not None else ()
                     for k, g in zip(kinds, self.optimizer.param_groups))

    def _key(self, batch: Any) -> tuple:
        """(batch structure and shapes, optimizer state keys, the model's modes, trainable
        parameters and autocast: ``ambient.step_key``): a plan is valid for one of each, and a
        step after ``model.eval()``, a freeze or inside ``torch.autocast`` plans again."""
        leaves, spec = tree_flatten(batch)
        # NOTE: a leaf that is no tensor keys by its value: capture then names it (CaptureError)
        shapes = tuple((tuple(t.shape), str(t.dtype).removeprefix("torch."))
                       if isinstance(t, torch.Tensor) else (type(t).__name__, repr(t))
                       for t in leaves)
        return ((str(spec), shapes), *self._model_key())

    def _graph_key(self, graph: Graph) -> tuple:
        shapes = tuple((graph.values[v].shape, graph.values[v].dtype)
                       for v, name in zip(graph.inputs, graph.input_names)
                       if name.startswith("batch:"))
        return ((str(graph.meta["batch_spec"]), shapes), *self._model_key())

    def _model_key(self) -> tuple:
        """What a plan depends on besides the batch: the optimizer's state keys, the model's
        modes, trainable parameters and autocast (``ambient.step_key``), and the Python values
        the step reads (``python_values``)."""
        return self._state_key(), step_key(self._modules, self._params), self._values.now()

    def _plan(self, batch: Any, graph: Graph | None = None, plan: Plan | None = None,
              solver: str = "loaded") -> _Planned:
        if graph is None:
            with _progress.stage("capturing forward, backward and optimizer step"):
                graph = self._capture(batch)
        cm = self._cost()
        with _progress.stage(f"costing {len(graph.nodes)} ops ({cm.name})"):
            cm.prepare(graph)
        eager = solve(Problem(graph, cm, latency_limit=1.0), "eager")
        if plan is not None:
            verify_plan(graph, plan)
            sol = Solution(plan, simulate(graph, plan, cm), solver, 0.0)
        else:
            budget = budget_bytes(self.budget, eager_peak_bytes=eager.sim.peak_bytes)
            if is_smallest(self.budget):
                sol = solve_smallest(graph, cm, lambda p: solve(p, self.solver),
                                     time_budget_s=self.time_budget, exact=self.exact)
            elif self.latency_limit is not None and self.measure_latency and measures_here(cm):
                with _progress.stage(f"solving ({self.solver}) and timing the plan against "
                                     f"eager's step"):
                    sol = self._within_measured_limit(graph, cm, eager, batch)
            else:
                with _progress.stage(f"solving ({self.solver}, up to {self.time_budget:g} s)"):
                    sol = solve(Problem(graph, cm, budget_bytes=budget,
                                        latency_limit=self.latency_limit,
                                        time_budget_s=self.time_budget, exact=self.exact),
                                self.solver)
            # NOTE: activation backwards written over the gradients they read where those die
            # there: the same kernels, bitwise, a lower peak (solvers.grads_in_place)
            sol = grads_in_place(sol, graph, cm)
            _progress.note(f"plan: peak {format_bytes(sol.sim.peak_bytes)} (eager "
                           f"{format_bytes(eager.sim.peak_bytes)}), step "
                           f"{sol.sim.latency_s * 1e3:,.1f} ms simulated (eager "
                           f"{eager.sim.latency_s * 1e3:,.1f} ms)")
        if graph.meta.get("user_checkpoints"):
            # NOTE: law 5: said, not silent (capture.user_checkpoints)
            sol.notes["user_checkpoints"] = (
                f"{graph.meta['user_checkpoints']} torch.utils.checkpoint call(s) of the model "
                "were traced as plain calls: the plan chooses what to recompute, and a budget "
                "fraction refers to the step without them")
        if sol.sim.host_peak_bytes and not cm.host_memory_apart:
            # NOTE: law 5: said, not silent; auto never offloads where host and device are one
            sol.notes["host_memory"] = (
                f"the plan offloads up to {format_bytes(sol.sim.host_peak_bytes)} into host "
                "buffers, but host and device are one memory here: those bytes stay in this "
                "RAM, off the device peak only as a GPU's host memory would be")
            warnings.warn(f"fitgraph: {sol.notes['host_memory']}; solver='auto' does not "
                          "offload here", stacklevel=4)
        # NOTE: operator fission plans a rewritten graph: the plan runs on Solution.graph
        planned = _Planned(sol.graph_for(graph), sol, eager.sim, graph_fingerprint(graph))
        checked = sol.notes.get("latency_check") or {}
        factor = checked.get("eager_factor")
        planned.eager_pytorch = bool(
            checked.get("plan") == "eager" and factor is not None
            and factor > self.latency_limit and not graph.meta.get("optimizer_in_backward"))
        if planned.eager_pytorch:
            sol.notes["latency_check"] = dict(checked, plan="eager PyTorch")
        return planned

    def _within_measured_limit(self, graph: Graph, cm, eager: Solution,
                               batch: Any = None) -> Solution:
        """The solver's plan for the latency limit, checked by measurement against eager
        and planned again for a tighter limit where it runs over (``latency_check``)."""
        from . import latency_check

        tries = []

        def solve_for(limit: float) -> Solution:
            # NOTE: a try after the first gets half the time: planning time stays within 2x
            share = self.time_budget if not tries else self.time_budget / 2 / (
                latency_check.MAX_TRIES - 1)
            tries.append(limit)
            # NOTE: each try measured as it will run (solvers.grads_in_place)
            return grads_in_place(solve(Problem(graph, cm, latency_limit=limit,
                                                time_budget_s=share, exact=self.exact),
                                        self.solver), graph, cm)

        torch_fb = (latency_check.torch_forward_backward(self.model, batch, self.loss_fn,
                                                         self.device)
                    if batch is not None and self.clip_grad_norm is None else None)
        sol, checked = latency_check.check(graph, self.latency_limit, solve_for, cm,
                                           eager.sim.latency_s, torch_fb, batch)
        if sol is None:
            sol = dataclasses.replace(eager, solver=self.solver)
        return dataclasses.replace(sol, notes=dict(sol.notes, latency_check=checked.notes()))

    def _capture(self, batch: Any) -> Graph:
        # NOTE: the graph of every step but the first (optimizer state present): one plan for
        # the whole loop, made up front; the first step creates the state it reads
        # (``init_missing_state``), so a fraction budget refers to the steady-state step
        with autocast_as(self._autocast):
            graph = capture(self.model, batch, self.loss_fn, self.optimizer,
                            clip_grad_norm=self.clip_grad_norm, steady_state=True)
        if self.optimizer is not None and has_step_pre_hooks(self.optimizer):
            # NOTE: a pre-hook reads every .grad before the first update, as in eager: no
            # update may be moved into the backward (graph.deps)
            graph.meta["updates_after_backward"] = True
        if self.in_backward is False:
            return graph
        reason = ("the optimizer has step pre-hooks, which read every gradient before any "
                  "update" if graph.meta.get("updates_after_backward") else why_not(graph))
        if reason is None:
            return TRANSFORMS["optimizer_in_backward"](graph).graph
        if self.in_backward is True:
            raise OptimizerInBackwardError(f"optimizer_in_backward=True is impossible: {reason}; "
                                           "pass optimizer_in_backward='auto' to keep gradients")
        # NOTE: "auto" keeps the gradients, and says so (law 5: no silent fallback)
        warnings.warn(f"optimizer-in-backward is off: {reason}", stacklevel=5)
        graph.meta["optimizer_in_backward_off"] = reason
        return graph

    def plan_for(self, batch: Any) -> _Planned:
        key = self._key(batch)
        if key not in self._plans:
            shapes_seen = {k[0] for k in self._plans}
            if shapes_seen and key[0] not in shapes_seen and self.on_new_shape == "error":
                raise ValueError(f"batch shapes {key[0][1]} differ from the planned ones "
                                 f"{sorted(s[1] for s in shapes_seen)}; optimize(..., "
                                 "on_new_shape='replan') plans each new shape (cached)")
            self._values.say_changed(self._plans, key)
            # NOTE: captured in the caller's autocast; profiled, planned and run without it
            self._autocast = autocast_state()
            with no_autocast(), _progress.listening(self.progress), _progress.stage(
                    f"planning the step for batch shapes {_shapes(key[0][1])}"):
                planned = self._plan(batch)
            self._plans, key = self._values.forget_forward_changes(self._plans, key)
            self._plans[key] = planned
        self._last = key
        return self._plans[key]

    # -- running --------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> torch.Tensor:
        planned = self.plan_for(batch)   # NOTE: sets self._last, its key
        if planned.unverified:
            self._autocast = autocast_state()
            self._verify(planned, batch)
        if planned.eager_pytorch:
            return self._measured(planned, batch, lambda: self._eager_step(batch))
        updated = planned.graph.meta.get("optimizer_in_backward", ())
        tensors = self._slots.tensors()
        params = tensors[0]
        stale = next((n for n in updated if params[n].grad is not None), None)
        if stale is not None:
            # NOTE: eager would add this .grad into the update; the in-backward step never reads it
            raise ValueError(f"parameter {stale} has a .grad, which an optimizer-in-backward "
                             "step would ignore: call optimizer.zero_grad(set_to_none=True) "
                             "before the step")
        if planned.executor is None:
            planned.executor = Executor(planned.graph, planned.solution.plan, self.model,
                                        self.optimizer)
        fresh = (init_missing_state(planned.graph, self.model, self.optimizer, params,
                                    planned.executor.input_specs)
                 if self.optimizer is not None else frozenset())
        planned.executor.fresh_state = fresh
        # NOTE: SGD's first update copies each gradient into a new momentum buffer (a
        # transient the steady-state plan does not hold): measure a later step instead
        sgd_first = bool(fresh) and "sgd" in str(planned.graph.meta.get("optimizer")).split("+")
        with no_autocast():
            if sgd_first:
                return planned.executor(batch, tensors)
            return self._measured(planned, batch, lambda: planned.executor(batch, tensors))

    def _measured(self, planned: _Planned, batch: Any, run) -> torch.Tensor:
        """``run()``: its peak measured the first time, its time after."""
        if planned.measured_peak_bytes is None:
            from .measure import constant_bytes, grad_bytes, resident_bytes

            # NOTE: what exists before the step (weights, batch, state, earlier .grad, the
            # graph's constants) plus the meter's peak above it; the first run of each plan is
            # measured
            before = (resident_bytes(self.model, batch, self.optimizer) + grad_bytes(self.model)
                      + constant_bytes(planned.graph))
            with MemoryMeter(self.device) as meter:
                loss = run()
            planned.measured_peak_bytes = before + meter.peak_bytes
            return loss
        _sync(self.device)
        t0 = time.perf_counter()
        loss = run()
        _sync(self.device)   # NOTE: CUDA kernels run on after the call returns: time them to the end
        planned.step_times.append(time.perf_counter() - t0)
        return loss

    def _eager_step(self, batch: Any) -> torch.Tensor:
        """The step as eager PyTorch runs it (``_Planned.eager_pytorch``)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is not None:
            stale = next((n for n, p in self.model.named_parameters() if p.grad is not None), None)
            if stale is not None:  # NOTE: the same rule as every other fitgraph step
                raise ValueError(f"parameter {stale} already has a .grad; with an optimizer in "
                                 "the step gradients are not accumulated across steps: call "
                                 "optimizer.zero_grad(set_to_none=True) before the step")
        loss = compute_loss(self.model, batch, self.loss_fn)
        loss.backward()
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        if self.optimizer is not None:
            self.optimizer.step()
        return loss.detach()

    step = __call__

    def _verify(self, planned: _Planned, batch: Any) -> None:
        """A plan loaded without a batch runs only on the step it was made for: the first
        batch's capture must fingerprint as the saved one (same ops: a forward that changed
        while its parameters did not is refused, not run with the saved graph's ops)."""
        with warnings.catch_warnings():  # NOTE: "auto" warned when the plan was made
            warnings.simplefilter("ignore")
            fresh = self._capture(batch)
        if graph_fingerprint(fresh) != planned.fingerprint:
            raise ValueError("the loaded plan was made for another graph: the step captured "
                             "from this model, loss and batch differs from the saved one (the "
                             "model's forward or the loss changed?); optimize it again")
        planned.unverified = False

    # -- reporting ------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._current().solution.plan

    @property
    def graph(self) -> Graph:
        return self._current().graph

    def _current(self) -> _Planned:
        if not self._plans:
            raise RuntimeError("nothing planned yet: call the step or plan_for(batch) first")
        return self._plans[self._last] if self._last in self._plans else next(
            iter(self._plans.values()))

    def report(self) -> OptimizeReport:
        p = self._current()
        s = p.solution
        notes = dict(s.notes)
        apart = getattr(self._cost(), "priced_apart", None)
        if apart is not None and (how := apart(p.graph)):
            # NOTE: ops that cannot run alone on synthetic inputs (an LSTM's backward reads its
            # forward's opaque workspace): how each was measured instead (finding 2)
            notes["priced_apart"] = how
        if self.in_backward is not False:
            notes["optimizer_in_backward"] = (
                "off: " + p.graph.meta["optimizer_in_backward_off"]
                if "optimizer_in_backward_off" in p.graph.meta else "on")
        return OptimizeReport(
            solver=s.solver,
            budget_bytes=budget_bytes(self.budget, eager_peak_bytes=p.eager.peak_bytes),
            latency_limit=self.latency_limit, eager_peak_bytes=p.eager.peak_bytes,
            planned_peak_bytes=s.sim.peak_bytes, eager_step_s=p.eager.latency_s,
            planned_step_s=s.sim.latency_s, solve_s=s.solve_s, cost_model=self._cost().name,
            nodes=len(p.graph.nodes), recomputes=s.plan.counts().get("recompute", 0),
            measured_peak_bytes=p.measured_peak_bytes,
            measured_step_s=statistics.median(p.step_times) if p.step_times else None,
            notes=notes)

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Save the current plan with its graph; ``fitgraph.load`` refuses it for another graph."""
        from torch.utils._pytree import treespec_dumps

        p = self._current()
        # NOTE: the batch's TreeSpec goes through torch's own serializer (pickling it is
        # deprecated); the graph is stored without it and gets it back on load
        meta = {k: v for k, v in p.graph.meta.items() if k != "batch_spec"}
        graph = Graph(p.graph.nodes, p.graph.values, p.graph.storages, p.graph.inputs,
                      p.graph.input_names, p.graph.outputs, meta)
        blob = {"format": SAVE_FORMAT, "fingerprint": p.fingerprint or graph_fingerprint(p.graph),
                "graph": graph, "batch_spec": treespec_dumps(p.graph.meta["batch_spec"]), "plan": p.solution.plan, "solver": p.solution.solver,
                "budget": self.budget, "latency_limit": self.latency_limit,
                "optimizer_in_backward": self.in_backward, "clip_grad_norm": self.clip_grad_norm,
                "exact": self.exact,
                "torch": torch.__version__}
        with open(path, "wb") as f:
            pickle.dump(blob, f)


def optimize(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None = None,
             optimizer: torch.optim.Optimizer | None = None, budget=None,
             latency_limit: float | None = None, time_budget: float = 30.0, *,
             solver: str = "auto", cost_model=None, on_new_shape: str = "replan",
             optimizer_in_backward: bool | str = False,
             clip_grad_norm: float | None = None, exact: bool = False,
             graph_breaks: str = "regions", measure_latency: bool = True,
             progress=None) -> TrainStep:
    """Plan one training step of ``model`` on batches shaped like ``batch``.

    ``budget``: bytes, a size string ("12GiB", "800MB"), a fraction of the eager peak (0.5), or
    ``"smallest"`` (the least peak the solver reaches: the search an infeasible budget runs,
    its plan kept); or ``latency_limit``: a factor of the eager step time (1.10), then the peak is minimised
    within it. ``cost_model``: None or "measured" measures ops on this machine (cached); a
    device name ("a100-80gb") or ``DeviceSpec`` plans with a roofline model; a cost model
    object is used as given (``cost.choose_cost_model``, as ``fitgraph.backend`` reads it). Raises ``BudgetInfeasible`` naming the smallest
    peak reached and what dominates it. A batch of new shapes is re-planned (cached per shape)
    or, with ``on_new_shape="error"``, refused. ``time_budget``: the solvers' seconds; a budget
    below what remat alone reaches also runs ``split_backward`` (regions re-made in the
    backward in parts), for at least 240 s more, before it is reported infeasible; it stops
    at its first plan within the budget (a retry at the smallest peak reported is quick).

    ``solver``: a registered solver (``fitgraph.solvers.SOLVERS``); the default ``"auto"``
    runs ``hotspot`` (remat and reordering) and, where the peak holds a region it can split,
    ``fission``, and keeps the faster plan (``report().notes["winner"]`` / ``["why"]``).

    ``optimizer_in_backward``: True updates each parameter as soon as its gradient is complete
    and frees the gradient (``.grad`` stays None; ``OptimizerInBackwardError`` names what makes
    it impossible, e.g. ``clip_grad_norm``); "auto" does so when possible and otherwise keeps
    the gradients, with a warning and ``report().notes["optimizer_in_backward"]`` saying why.
    ``clip_grad_norm``: clip the gradients' global norm before the update, as
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)``.

    ``measure_latency``: with ``latency_limit`` and measured op costs, the plan is timed
    against the eager plan on this machine (paired rounds on synthetic inputs) and made again
    for a tighter limit where it runs over (``fitgraph.latency_check``; the tries in
    ``report().notes["latency_check"]``); False trusts the simulation.

    ``graph_breaks``: where the whole step cannot be captured as one graph (``.item()``, a CTC
    loss, boolean masks, a dynamic expert dispatch), "regions" (default) warns and returns a
    ``fitgraph.regions.RegionsStep``: torch.compile with ``fitgraph.backend`` plans each region
    it can trace, the code between regions runs eagerly, and ``report()`` lists every graph
    break and what each region reached; "error" raises the ``CaptureError`` instead.

    ``exact``: the guarantee on results. False (default): every transformation, operator fission
    included, whose results are allclose to eager's (fission sums a split op's parts in another
    order); ``report().notes["winner"]`` says whether fission was chosen. True: only plans whose
    loss, gradients and updated weights are eager's bit for bit (rematerialization, reordering,
    offloading, dropout masks kept as bits).

    ``progress``: True says on standard error what planning does and what each option
    reached (capture, costing, each solver's best plan, re-planning); a callable gets each
    line instead; None (default) is quiet unless the caller listens (``fitgraph.progress``).

    ``optimizer``: a torch optimizer, or a list of them over disjoint parameters (Muon for the
    matrices and AdamW for the rest), stepped as one (``capture.combined_optimizer``).

    One plan serves the whole training loop: it is made here for the steady-state step (the
    optimizer's state present, as from the second step on; the first step creates that state
    as torch would), and a fraction budget refers to that step's eager peak. Each step counts as
    ``optimizer.step()``: step hooks run and LR schedulers see it.
    """
    if (budget is None) == (latency_limit is None):
        raise ValueError("give exactly one of budget= and latency_limit=")
    check_budget(budget)  # NOTE: a bad budget fails now, not after seconds of capture
    check_latency_limit(latency_limit)
    if graph_breaks not in ("regions", "error"):
        raise ValueError("graph_breaks must be 'regions' or 'error'")
    model, optimizer = unwrapped(model), as_optimizer(optimizer)
    step = TrainStep(model, loss_fn, optimizer, budget=budget, latency_limit=latency_limit,
                     time_budget=time_budget, solver=solver, cost_model=cost_model,
                     on_new_shape=on_new_shape, optimizer_in_backward=optimizer_in_backward,
                     clip_grad_norm=clip_grad_norm, exact=exact,
                     measure_latency=measure_latency, progress=progress)
    try:
        step.plan_for(batch)
    except CaptureError as e:
        from .regions import RegionsStep, breaks_into_regions

        if graph_breaks == "error" or not breaks_into_regions(e) or optimizer_in_backward is True:
            raise
        # NOTE: law 5: not silent. The warning says what was not captured and what runs instead
        warnings.warn(f"fitgraph: the whole step cannot be captured as one graph ({e}); "
                      "planning the regions torch.compile can trace instead, the code between "
                      "them runs eagerly: see step.report() (graph_breaks='error' raises)",
                      stacklevel=2)
        return RegionsStep(model, loss_fn, optimizer, budget=budget,
                           latency_limit=latency_limit, time_budget=time_budget,
                           cost_model=cost_model, clip_grad_norm=clip_grad_norm, reason=e,
                           measure_latency=measure_latency, exact=exact, progress=progress)
    return step


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         loss_fn: LossFn | None = None, batch: Any = None, **kwargs) -> TrainStep:
    """Load a saved plan for ``model``. Its parameters and buffers must match the saved graph's,
    and the step captured again from ``batch`` (and ``loss_fn``) must fingerprint the same: at
    once with ``batch=``, else at the first step (its batch is captured before anything runs)."""
    with open(path, "rb") as f:
        try:
            blob = pickle.load(f)
        except Exception as e:  # NOTE: any unreadable file gets the same clear error
            raise ValueError(f"{path}: not a fitgraph plan ({type(e).__name__})") from e
    if not isinstance(blob, dict) or blob.get("format") != SAVE_FORMAT:
        raise ValueError(f"{path}: not a fitgraph plan (saved by TrainStep.save, format "
                         f"{SAVE_FORMAT})")
    from torch.utils._pytree import treespec_loads

    graph: Graph = blob["graph"]
    graph.meta["batch_spec"] = treespec_loads(blob["batch_spec"])
    have = {f"param:{n}": (tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for n, p in model.named_parameters() if p.requires_grad}
    have.update({f"buffer:{n}": (tuple(b.shape), str(b.dtype).removeprefix("torch."))
                 for n, b in model.named_buffers()})
    want = {name: (graph.values[v].shape, graph.values[v].dtype)
            for v, name in zip(graph.inputs, graph.input_names)
            if name.startswith(("param:", "buffer:"))}
    if {k: v for k, v in have.items() if k in want} != want or not set(want) <= set(have):
        missing = sorted(set(want) - set(have))[:3]
        raise ValueError(f"{path}: the plan was made for another model (parameters/buffers "
                         f"differ, e.g. {missing or 'shapes'}); optimize this model instead")
    step = TrainStep(model, loss_fn, optimizer, budget=blob["budget"],
                     latency_limit=blob["latency_limit"], time_budget=kwargs.get("time_budget", 30.0),
                     solver=blob["solver"], cost_model=kwargs.get("cost_model"),
                     on_new_shape=kwargs.get("on_new_shape", "replan"),
                     optimizer_in_backward=blob.get("optimizer_in_backward", False),
                     clip_grad_norm=blob.get("clip_grad_norm"), exact=blob.get("exact", False))
    if batch is not None:
        with warnings.catch_warnings():  # NOTE: "auto" warned when the plan was made
            warnings.simplefilter("ignore")
            fresh = step._capture(batch)
        if graph_fingerprint(fresh) != blob["fingerprint"]:
            raise ValueError(f"{path}: the plan was made for another graph (the step captured "
                             "from this model and batch differs); optimize it again")
    planned = step._plan(None, graph=graph, plan=blob["plan"], solver=blob["solver"])
    planned.fingerprint = blob["fingerprint"]
    planned.unverified = batch is None
    step._last = step._graph_key(graph)
    step._plans[step._last] = planned
    return step
