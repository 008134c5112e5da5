"""``fitgraph.backend``: a torch.compile backend that plans forward and backward together.

For users who keep their own training loop. AOTAutograd hands the backend's partition function
the joint forward+backward ATen graph; fitgraph converts it to its IR, costs it (measured on
this machine and cached, like ``fitgraph.optimize``), runs a solver within the budget, and
splits the joint graph so that the forward saves only what the plan keeps: the backward
recomputes the rest. Both halves then run as they are (like torch's ``aot_eager``).

Example:
    >>> import torch, fitgraph
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64),
    ...                                                   torch.nn.GELU()) for _ in range(4)])
    >>> be = fitgraph.backend(budget=0.8)                # or "800MB", bytes, latency_limit=1.2
    >>> compiled = torch.compile(model, backend=be)
    >>> compiled(torch.randn(256, 64)).square().mean().backward()   # .grad as in eager
    >>> r = be.last_report                               # what it planned; print(r) for a table
    >>> r.planned_peak_bytes <= r.budget_bytes and r.planned_saved_bytes < r.eager_saved_bytes
    True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import warnings
from typing import Any

import torch

from ..capture.errors import CaptureError
from ..graph.ir import Graph, Role
from ..solvers import SOLVERS, BudgetInfeasible, Problem, Solution, solve, solve_smallest
from ..solvers.collector import fewer_collections
from ..units import (
    LEAST_BUDGET_BYTES,
    SMALLEST,
    budget_bytes,
    check_budget,
    check_latency_limit,
    is_fraction,
    is_smallest,
)
from .backend_report import BackendReport
from .boundary_hold import HoldCostModel, StepShares, boundary_node, graph_key
from .emit import EmitError
from .unread_grads import LeafRuns, drop_grads

# NOTE: torch._dynamo and the partitioners (2 s to import) load when a backend is made, not
# with ``import fitgraph``

__all__ = ["INNER", "FitgraphBackend", "backend"]

# NOTE: what runs the two halves: as they are (ATen kernels, the plan's memory exactly), or
# compiled by inductor (fused kernels; the plan decides only what the forward saves)
INNER = ("aot_eager", "inductor")
DYNAMIC_SHAPES = ("refuse", "unplanned")
# NOTE: solvers whose plans may run on a rewritten graph (operator fission's parts), realised by
# modules written from the plan (compile_backend.emit) rather than torch's extraction
REWRITING = frozenset({"auto", "fission"})


@functools.cache
def _passthrough_infeasible() -> type:
    from torch._dynamo.exc import ShortenTraceback

    class BudgetInfeasibleInCompile(BudgetInfeasible, ShortenTraceback):
        """BudgetInfeasible that Dynamo lets through unwrapped.

        NOTE: Dynamo wraps every backend exception in BackendCompilerFailed except its
        ShortenTraceback family, so a user's ``except fitgraph.BudgetInfeasible`` would never
        match; this subclass of both reaches the user with the solver's message."""

        def __init__(self, e: BudgetInfeasible) -> None:
            RuntimeError.__init__(self, str(e))
            self.__dict__.update(e.__dict__)
            self.first_useful_frame = None

    # NOTE: tracebacks name it as the user knows it
    cls = BudgetInfeasibleInCompile
    cls.__module__, cls.__name__, cls.__qualname__ = "fitgraph", "BudgetInfeasible", "BudgetInfeasible"
    return cls


class FitgraphBackend:
    """A torch.compile backend (``torch.compile(model, backend=this)``) that plans each
    compiled forward+backward graph within a memory budget. ``reports`` holds one
    ``BackendReport`` per planned graph (Dynamo compiles one per graph break and per new
    shape); ``last_report`` is the latest."""

    def __init__(self, budget=None, latency_limit: float | None = None, solver: str = "hotspot",
                 time_budget: float = 30.0, cost_model=None, inner: str = "aot_eager",
                 dynamic_shapes: str = "refuse", progress=None) -> None:
        if dynamic_shapes not in DYNAMIC_SHAPES:
            raise ValueError(f"dynamic_shapes={dynamic_shapes!r}: one of "
                             f"{', '.join(DYNAMIC_SHAPES)}")
        if inner not in INNER:
            raise ValueError(f"inner={inner!r}: one of {', '.join(INNER)}")
        if budget is not None and latency_limit is not None:
            raise ValueError("give at most one of budget= and latency_limit=")
        if solver not in SOLVERS:
            raise KeyError(f"unknown solver {solver!r}; known: {sorted(SOLVERS)}")
        if solver in REWRITING and inner != "aot_eager":
            raise ValueError(f"solver={solver!r} plans rewritten graphs (operator fission), "
                             "which fitgraph.backend runs with inner='aot_eager' only")
        check_budget(budget)  # NOTE: a malformed budget fails now, not at the first call
        check_latency_limit(latency_limit)
        self.budget, self.latency_limit = budget, latency_limit
        self.solver, self.time_budget, self.cost_model = solver, time_budget, cost_model
        self.reports: list[BackendReport] = []
        self.inner, self.dynamic_shapes, self.progress = inner, dynamic_shapes, progress
        # NOTE: one line per graph run unplanned (dynamic_shapes="unplanned"), saying why
        self.unplanned: list[str] = []
        # NOTE: set by a step by regions (``boundary_hold``): graph key -> bytes the rest of
        # the step holds between this graph's forward and backward; and, while
        # ``forward_runs`` is a list, the report index of each planned forward as it runs
        self.boundary_holds: dict[str, int] = {}
        # NOTE: and what of a step's bytes budget each graph may use (``StepShares``: the
        # budget less what the rest of the step keeps), planned at the least peak where no
        # plan fits
        self.step_shares: StepShares | None = None
        self.forward_runs: list[int] | None = None
        # NOTE: and, while a ``LeafRuns``, each forward's leaf inputs that require grad; graph
        # key -> primal indices whose gradients no one could read (``unread_grads``)
        self.leaf_runs: LeafRuns | None = None
        self.unread_grads: dict[str, set[int]] = {}
        self._partitioned: int | None = None
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        self._compiler = aot_autograd(fw_compiler=self._fw_compiler, bw_compiler=boxed_nop,
                                      partition_fn=self._partition,
                                      keep_inference_input_mutations=True)
        self.__name__ = "fitgraph"  # NOTE: Dynamo names the backend in its messages

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs):
        if self.inner == "inductor":
            return _inductor_with_partition(self._partition, gm, example_inputs)
        return self._compiler(gm, example_inputs, **kwargs)

    def _fw_compiler(self, gm: torch.fx.GraphModule, example_inputs: list):
        """The forward as it is (``boxed_nop``), noting its report's index in
        ``forward_runs`` each time it runs while that is a list (a step by regions reads the
        order its regions run in)."""
        from torch._dynamo.backends.debugging import boxed_nop

        run, index = boxed_nop(gm, example_inputs), self._partitioned
        self._partitioned = None  # NOTE: an inference graph is compiled without a partition
        if index is None:
            return run

        key = self.reports[index].graph_key

        def forward(args):
            if self.forward_runs is not None:
                self.forward_runs.append(index)
            if self.leaf_runs is not None:
                self.leaf_runs.note(key, args)
            return run(args)

        forward._boxed_call = True
        return forward

    @property
    def last_report(self) -> BackendReport:
        if not self.reports:
            raise RuntimeError("nothing planned yet: run the compiled model forward and "
                               "backward once (graphs run without grad are not planned)")
        return self.reports[-1]

    # -- planning -------------------------------------------------------------------------------
    def _cost(self, graph: Graph):
        from ..cost import choose_cost_model

        device = graph.storages[graph.values[graph.inputs[0]].storage].device
        self.cost_model = choose_cost_model(self.cost_model, device)
        self.cost_model.prepare(graph)
        if self.inner == "inductor":
            # NOTE: inductor fuses pointwise ops into the kernels around them: recomputing one
            # in the backward is free there, as its own partitioner assumes (cost.fused)
            from ..cost.fused import FusedCostModel

            return FusedCostModel(self.cost_model)
        return self.cost_model

    def _solve(self, graph: Graph, banned: set[int], cm, eager: Solution, hold: int = 0,
               share: int | None = None) -> Solution:
        """The plan. With a ``hold`` (``boundary_hold``): planned with those bytes held at the
        forward's end, and without where the budget cannot hold them too. With a ``share``
        (a step by regions' bytes budget less what the rest of the step keeps resident):
        planned within those bytes, at the least peak where no plan fits (the step's
        measured peak then says so), never an error in the middle of a step."""
        if hold and boundary_node(graph) is not None:
            try:
                held = self._solve(graph, banned, HoldCostModel(cm, hold), eager,
                                   share=share)
            except BudgetInfeasible:
                return self._solve(graph, banned, cm, eager, share=share)
            # NOTE: the report's peak and time are the region's own, without the hold
            from ..sim.simulate import simulate

            sim = simulate(held.graph_for(graph), held.plan, cm)
            return dataclasses.replace(held, sim=sim, notes=held.notes | {"hold_bytes": hold})
        if share is not None:
            try:
                # NOTE: where the rest of the step leaves nothing (or fewer bytes than a
                # budget may name: a user's 1000 is a mistake, a share of 1000 bytes is not),
                # the least peak
                return self._plan(graph, banned, cm, eager,
                                  share if share >= LEAST_BUDGET_BYTES else SMALLEST)
            except BudgetInfeasible as e:
                return self._least(e, graph, banned, cm, eager)
        try:
            return self._plan(graph, banned, cm, eager, self.budget)
        except BudgetInfeasible as e:
            if not is_fraction(self.budget):
                raise
            # NOTE: a fraction applies to each compiled graph's own eager peak, and a graph
            # break makes small graphs of a step (a loss after a logging call) whose fixed
            # bytes no plan brings under it: such a graph runs at its least peak, said aloud;
            # bytes stay a hard limit
            warnings.warn(f"fitgraph.backend: compiled graph {len(self.reports) + 1} "
                          f"({len(graph.nodes)} nodes) cannot reach budget {self.budget} of its "
                          f"own eager peak ({e}); it runs at the least peak found. A fraction "
                          "applies to each graph torch.compile makes (graph breaks split a "
                          "step): give the budget in bytes for a hard limit", stacklevel=2)
            least = self._least(e, graph, banned, cm, eager)
            return dataclasses.replace(least, notes=dict(least.notes, fraction_unreachable=str(e)))

    def _least(self, e: BudgetInfeasible, graph: Graph, banned: set[int], cm,
               eager: Solution) -> Solution:
        """The plan at the least peak where ``e`` says none fits: the one riding on it, else
        planned at the smallest budget."""
        if e.solution is None:
            return self._plan(graph, banned, cm, eager, SMALLEST)
        if self.solver not in REWRITING:
            return e.solution
        # NOTE: a rewriting solver's least peak runs on its own graph: as modules written from
        # its plan, as ``_plan`` runs its plans (passed on as it was, the partition read its
        # plan against the captured graph's node ids)
        try:
            return _emitted(e.solution, graph, cm)
        except EmitError:
            return self._plan(graph, banned, cm, eager, SMALLEST)

    def _plan(self, graph: Graph, banned: set[int], cm, eager: Solution, budget) -> Solution:
        graph = _banning(graph, banned, pinned=self.solver in REWRITING)
        fn = SOLVERS[self.solver]
        # NOTE: the forward must run whole before the backward (the tangents arrive then), and
        # the modules run in the captured order: a solver that can reorder is asked not to
        # (a phase-respecting order could be realised later by sorting the modules' nodes);
        # the backward module recomputes each saved-away node once: no drops per use
        params = inspect.signature(fn).parameters
        keep_order = {k: False for k in ("reorder", "per_use") if k in params}
        refused = None
        if self.solver in REWRITING:
            try:
                return _emitted(self._run(graph, cm, eager, budget, fn, {}), graph, cm)
            except BudgetInfeasible as e:
                raise _passthrough_infeasible()(e) from None
            except EmitError as e:
                # NOTE: a plan the two modules cannot run (offloading, say): remat alone, and
                # the report says why (law 6: no silent fallback)
                fn, keep_order, refused = SOLVERS["hotspot"], {"reorder": False,
                                                              "per_use": False}, str(e)
        try:
            sol = self._run(graph, cm, eager, budget, fn, keep_order)
        except BudgetInfeasible as e:
            raise _passthrough_infeasible()(e) from None
        if refused is None:
            return sol
        return dataclasses.replace(sol, notes=sol.notes | {
            "modules": f"{self.solver}'s plan refused ({refused}): hotspot's, extracted"})

    def _run(self, graph: Graph, cm, eager: Solution, budget, fn, keep: dict) -> Solution:
        with fewer_collections():  # NOTE: as solvers.solve runs every solver
            if is_smallest(budget):
                return solve_smallest(graph, cm, lambda p: fn(p, **keep),
                                      time_budget_s=self.time_budget)
            limit = budget_bytes(budget, eager_peak_bytes=eager.sim.peak_bytes)
            return fn(Problem(graph, cm, budget_bytes=limit, latency_limit=self.latency_limit,
                              time_budget_s=self.time_budget), **keep)

    def _unplanned(self, joint: torch.fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int,
                   static: list[int] | None, symbolic: list[str]):
        """torch's own partition of a graph traced with dynamic shapes (``dynamic_shapes=
        "unplanned"``): it runs as eager PyTorch would, saving what eager saves; said once in a
        warning and in ``unplanned``."""
        from torch._functorch import partitioners as P

        ops = sum(n.op == "call_function" for n in joint.graph.nodes)
        self.unplanned.append(f"a graph of {ops} ops traced with dynamic shapes (symbolic "
                              f"inputs {', '.join(symbolic[:3])}{' ...' if len(symbolic) > 3 else ''}"
                              "): not planned, it saves what eager PyTorch saves")
        if len(self.unplanned) == 1:
            warnings.warn(f"fitgraph.backend: {self.unplanned[0]}; torch.compile traced it "
                          "with dynamic shapes after a shape or a Python number changed "
                          "between calls", stacklevel=2)
        self._partitioned = None
        return P.default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                   static_lifetime_input_indices=static)

    def _partition(self, joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs
                   ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """AOTAutograd's partition hook: plan the joint graph, return (forward, backward)."""
        from .. import progress

        with progress.listening(self.progress), progress.stage(
                f"planning compiled graph {len(self.reports) + 1} "
                f"({len(joint.graph.nodes)} nodes)"):
            return self._planned_partition(joint, joint_inputs, **kwargs)

    def _planned_partition(self, joint: torch.fx.GraphModule, joint_inputs: Any, *,
                           num_fwd_outputs: int,
                           static_lifetime_input_indices: list[int] | None = None,
                           **kwargs) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        from torch._functorch import partitioners as P

        from ..capture.joint import joint_to_graph
        from ..solvers.grads_in_place import OUT_VARIANTS, grads_in_place
        from .emit import emit_split
        from .partition import must_save, split_joint, write_over
        from .schedule import schedule_of

        t0 = time.perf_counter()
        symbolic = [ph.name for ph in joint.graph.find_nodes(op="placeholder")
                    if not isinstance(ph.meta.get("val"), torch.Tensor)]
        if symbolic and self.dynamic_shapes == "unplanned":
            return self._unplanned(joint, joint_inputs, num_fwd_outputs,
                                   static_lifetime_input_indices, symbolic)
        if P.has_recomputable_ops(joint):
            raise CaptureError("the compiled code uses activation checkpointing "
                               "(torch.utils.checkpoint); fitgraph.backend plans the "
                               "recomputation itself: remove the checkpoint calls from the "
                               "compiled region", op="torch.utils.checkpoint")
        # NOTE: the key of the joint as traced, before any gradient is left out of it
        key = graph_key(joint.code, [getattr(n.meta.get("val"), "shape", None)
                                     for n in joint.graph.find_nodes(op="placeholder")])
        unread = drop_grads(joint, num_fwd_outputs, self.unread_grads.get(key, set()))
        keep = must_save(joint)
        jg = joint_to_graph(joint, num_fwd_outputs, static_lifetime_input_indices)
        ids = {n: i for i, n in enumerate(jg.fx_nodes)}
        banned = {ids[n] for n in keep if n in ids}
        cm = self._cost(jg.graph)
        eager = solve(Problem(jg.graph, cm, latency_limit=1.0), "eager")
        planned = self.budget is not None or self.latency_limit is not None
        share = None if self.step_shares is None else self.step_shares.share(
            key, _weight_bytes(jg.graph), _param_grad_bytes(jg.graph),
            {r.graph_key: r.planned_saved_bytes for r in self.reports})
        sol = (self._solve(jg.graph, banned, cm, eager, self.boundary_holds.get(key, 0), share)
               if planned else eager)
        if planned and self.inner == "aot_eager":
            # NOTE: activation backwards written over their dying gradients (bitwise); under
            # inductor its own kernels decide where outputs go
            sol = grads_in_place(sol, jg.graph, cm)
        if sol.notes.get("modules") == "emitted":
            # NOTE: the plan's own nodes, in its order (a rewritten graph: compile_backend.emit)
            split = emit_split(joint, sol.graph_for(jg.graph), sol.plan, num_fwd_outputs)
            eager_split = split_joint(joint, jg)
        else:
            schedule = schedule_of(jg.graph, sol.plan, self.solver if planned else "eager")
            split = split_joint(joint, jg, schedule)
            if sol.graph is not None:
                over = {jg.fx_nodes[n.id].name: OUT_VARIANTS[jg.graph.nodes[n.id].target]
                        for n in sol.graph.nodes if n.target != jg.graph.nodes[n.id].target}
                split = dataclasses.replace(split, bw=write_over(split.bw, over))
            _check_realized(jg, set(schedule.recompute), banned,
                            {ids[n] for n in jg.fx_nodes if n.name in set(split.recomputed)})
            eager_split = split_joint(joint, jg) if schedule.recompute else split
        self.reports.append(BackendReport(
            solver=sol.solver if planned else "none",
            budget_bytes=budget_bytes(self.budget, eager_peak_bytes=eager.sim.peak_bytes),
            latency_limit=self.latency_limit, nodes=len(jg.graph.nodes),
            forward_nodes=sum(n.op == "call_function" for n in jg.forward),
            eager_peak_bytes=eager.sim.peak_bytes, planned_peak_bytes=sol.sim.peak_bytes,
            eager_step_s=eager.sim.latency_s, planned_step_s=sol.sim.latency_s,
            eager_saved_bytes=eager_split.saved_bytes,
            planned_saved_bytes=split.saved_bytes, saved_tensors=len(split.saved),
            recomputed_nodes=len(split.recomputed), recomputed=split.recomputed,
            solve_s=sol.solve_s if planned else 0.0, plan_s=time.perf_counter() - t0,
            cost_model=getattr(cm, "name", type(cm).__name__),
            notes=dict(sol.notes) | ({"budget": "smallest"} if is_smallest(self.budget) else {})
            | ({} if share is None else {"share_bytes": share})
            | ({"unread_grads": unread} if unread else {}),
            resident_bytes=jg.graph.resident_bytes, graph_key=key,
            weight_bytes=_weight_bytes(jg.graph)))
        self._partitioned = len(self.reports) - 1
        return split.fw, split.bw


def _inductor_with_partition(partition, gm: torch.fx.GraphModule, example_inputs: list):
    """Inductor's own pipeline (decompositions, joint-graph passes, its fused kernels) with
    fitgraph's plan as the partitioner, through ``torch._inductor.config.custom_partitioner_fn``.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    try:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn
    except ImportError:
        CustomPartitionerFn = None
    if CustomPartitionerFn is None or not hasattr(inductor_config, "custom_partitioner_fn"):
        raise RuntimeError(f"fitgraph.backend(inner='inductor') needs inductor's "
                           f"custom_partitioner_fn hook, which torch {torch.__version__} lacks: "
                           "upgrade torch or use inner='aot_eager'")

    import torch._functorch.config as functorch_config

    # NOTE: no compile caches: a cached graph skips the partitioner (no plan, another budget's)
    with inductor_config.patch(custom_partitioner_fn=_partitioner_class()(partition),
                               fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs)


@functools.cache
def _partitioner_class() -> type:
    """``CustomPartitionerFn`` calling fitgraph's partition; made on first use (inductor loads
    with it) and set in this module by name, so inductor's cache-key pickling finds it."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class PlannedPartition(CustomPartitionerFn):
        def __init__(self, partition):
            self.partition = partition

        def __call__(self, joint, joint_inputs, **kwargs):
            kwargs.pop("compiler", None)
            return self.partition(joint, joint_inputs, **kwargs)

        def uuid(self):
            return None  # NOTE: no code cache: a cached graph would keep another budget's plan

        def __getstate__(self):
            return {}    # NOTE: pickled only into inductor's cache key, which uuid() skips

    PlannedPartition.__qualname__ = PlannedPartition.__name__ = "_PlannedPartition"
    globals()["_PlannedPartition"] = PlannedPartition
    return PlannedPartition


def _emitted(sol: Solution, graph: Graph, cm) -> Solution:
    """``sol`` marked to run as modules written from its plan (``compile_backend.emit``):
    the forward's nodes moved before the backward's where a reordering solver interleaved
    them (simulated again), EmitError where the two modules cannot run it."""
    from ..sim.simulate import simulate
    from .emit import check_emittable, phased

    g = sol.graph_for(graph)
    plan = phased(g, sol.plan)
    check_emittable(g, plan)
    sim = sol.sim if plan is sol.plan else simulate(g, plan, cm)
    return dataclasses.replace(sol, plan=plan, sim=sim, notes=sol.notes | {"modules": "emitted"})


def _check_realized(jg, drop: set[int], banned: set[int], realized: set[int]) -> None:
    """The modules must recompute exactly the plan's nodes, and no random or impure one.

    NOTE: the simulated peak is the truth only for what really runs (DESIGN law 4: one plan,
    no second idea of what happens); a mismatch is a fitgraph bug, never a quietly other plan."""
    if drop & banned:
        names = sorted(jg.fx_nodes[i].name for i in drop & banned)
        raise AssertionError(f"the plan recomputes nodes that must be saved (random or "
                             f"impure): {names}; this is a fitgraph bug")
    if realized != drop:
        names = sorted(jg.fx_nodes[i].name for i in realized ^ drop)[:10]
        raise AssertionError(f"the backward recomputes {len(realized)} nodes, the plan "
                             f"{len(drop)}; differing: {names}; this is a fitgraph bug")


def _weight_bytes(graph: Graph) -> int:
    """Bytes of the graph's weights and buffers (inputs that outlive the step)."""
    storages = (graph.storages[st] for st in graph.input_storages())
    return sum(st.nbytes for st in storages if st.role in (Role.PARAMETER, Role.BUFFER))


def _param_grad_bytes(graph: Graph) -> int:
    """Bytes of the gradients the graph makes for its weights (outputs ``grad:i`` of a
    parameter input ``i``)."""
    out = 0
    for key, vid in graph.outputs.items():
        if key.startswith("grad:"):
            st = graph.storages[graph.values[graph.inputs[int(key[5:])]].storage]
            if st.role is Role.PARAMETER:
                out += graph.storages[graph.values[vid].storage].nbytes
    return out


def _banning(graph: Graph, banned: set[int], pinned: bool = False) -> Graph:
    """The graph the solver sees: ``banned`` nodes marked as writing their own outputs.

    NOTE: fitgraph's plans may recompute random ops because its executor replays their RNG
    state; these fw/bw modules cannot, so random and impure ops must never be recomputed.
    ``recomputable`` refuses nodes that write in place, and marking a node as writing its own
    fresh outputs changes nothing else (no one reads them earlier; the simulator's memory
    accounting does not look at ``mutates``). Costs are unchanged: cache keys ignore it."""
    if not banned:
        return graph
    if pinned:
        # NOTE: a graph that transformations rewrite (operator fission) keeps its writes
        # truthful (verify_graph): the ban is by name (graph.recompute_rules.recomputable), and the
        # modules refuse a recomputed random node (compile_backend.emit)
        return dataclasses.replace(graph, meta=graph.meta | {
            "pinned": tuple(graph.nodes[i].name for i in sorted(banned))})
    nodes = [dataclasses.replace(n, mutates=tuple(dict.fromkeys(
        (*n.mutates, *(o for o in n.outputs if o is not None))))) if n.id in banned else n
        for n in graph.nodes]
    return dataclasses.replace(graph, nodes=nodes)


def backend(budget=None, latency_limit: float | None = None, solver: str = "hotspot",
            time_budget: float = 30.0, cost_model=None,
            inner: str = "aot_eager", dynamic_shapes: str = "refuse",
            progress=None) -> FitgraphBackend:
    """A torch.compile backend that fits each compiled training graph in a memory budget.

    ``budget``: bytes, a size string ("800MB", "12GiB"), or a fraction of the simulated eager
    peak of the compiled forward+backward graph (0.6, "60%"), or "smallest" (each graph at
    the least peak the solver reaches); or ``latency_limit``: a factor of
    the eager step time (1.2), then the peak is minimised within it; neither saves every value
    the backward reads (torch's default partition). ``solver``: a registered solver; "auto"
    (the portfolio, operator fission included: results allclose) runs its plans as modules
    written from the plan (``compile_backend.emit``), needs ``inner="aot_eager"``, and falls
    back to hotspot where a plan cannot run as a forward then a backward module (offloading).
    ``time_budget``: seconds the solver may spend per graph. ``cost_model``: None measures ops
    on this machine (cached), a device name ("a100-80gb") or ``DeviceSpec`` plans with a
    roofline model, or any CostModel. Random ops (dropout) are never recomputed, so gradients
    equal eager PyTorch's. An impossible budget raises ``fitgraph.BudgetInfeasible`` at the
    first call. See ``FitgraphBackend`` for the reports.

    ``inner``: "aot_eager" runs the planned forward and backward as they are (ATen kernels:
    the simulated peak is what runs); "inductor" compiles them with inductor (fused kernels;
    the plan chooses what the forward saves and the backward recomputes, inductor how). For
    inductor the plan prices pointwise ops and views as free (``cost.fused.FusedCostModel``:
    inductor runs them inside the kernels around them, so recomputing a batch norm's
    normalize and ReLU costs nothing, a convolution its measured time); the reports' peaks
    are still those of the ATen graph and their times those of that pricing: measure the
    compiled step.

    ``dynamic_shapes``: what to do with a graph torch.compile traced with symbolic sizes
    (``dynamic=True``, or a recompile after a shape changed): "refuse" raises a CaptureError
    that says to compile with ``dynamic=False``; "unplanned" runs it with torch's own
    partition (what eager saves), with a warning and a line in ``FitgraphBackend.unplanned``
    (a step by regions does so, and says it in its report).

    ``progress``: True says on standard error what each graph's planning does (a callable
    gets the lines); None is quiet unless the caller listens (``fitgraph.progress``).
    """
    return FitgraphBackend(budget, latency_limit, solver, time_budget, cost_model, inner,
                           dynamic_shapes, progress)
