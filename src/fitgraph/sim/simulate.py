"""The simulator: walks a Plan and reports peak bytes, memory over time and latency. No torch.

It is the executor's twin (DESIGN law 4): both dispatch on ``instr.op`` over the same Plan.
Memory is counted per storage, from the moment the graph's inputs exist (weights, buffers,
batch, optimizer state: the *resident* bytes) to the end of the step. During a node, its fresh
outputs and its measured workspace are both live, so a node's transient peak is
``live + fresh outputs + workspace``. Latency runs two clocks: the compute stream and a copy
stream for Offload/Prefetch, joined at Wait. A copy starts when it is issued and the copy stream
is free (the copy stream first waits for the compute stream, so the data is ready); an offloaded
storage leaves device memory and counts as host memory at the Wait that ends its offload, and is
device memory again from the moment its prefetch starts (see ``fitgraph.plan.instructions``).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.plan.eager import eager_plan
    >>> from fitgraph.sim.simulate import simulate
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Free(BaseCostModel):  # a cost model where every node takes 1 ms and no workspace
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    ...     def copy_seconds(self, nbytes): return 0.0
    >>> b = GraphBuilder(); x = b.add_input("x", (256,), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((256,), "float32")])[0]
    >>> z = b.add_node("aten.sum.default", [y], [((), "float32")])[0]
    >>> r = simulate(b.finish({"loss": z}), eager_plan(b.finish({"loss": z})), Free())
    >>> r.peak_bytes, round(r.latency_s, 6)
    (2052, 0.002)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.base import CostModel
from ..graph.analysis import new_storages
from ..graph.ir import Graph, Phase, Role
from ..graph.recompute_rules import is_view_node
from ..plan.instructions import Compute, Free, Offload, Plan, Prefetch, Recompute, Wait

__all__ = ["BREAKDOWN_GROUPS", "CopySpan", "SimResult", "Simulator", "TensorAtPeak", "simulate"]

# NOTE: the breakdown groups a user reads; roles map onto them
BREAKDOWN_GROUPS = {
    Role.PARAMETER: "weights", Role.BUFFER: "weights", Role.CONSTANT: "weights",
    Role.INPUT: "inputs", Role.OPTIMIZER_STATE: "optimizer_state", Role.GRADIENT: "gradients",
    Role.ACTIVATION: "activations", Role.TEMPORARY: "temporaries", Role.OUTPUT: "temporaries",
}
TOP_TENSORS = 10


@dataclass(frozen=True, slots=True)
class TensorAtPeak:
    name: str
    nbytes: int
    role: str
    module: str
    phase: str


@dataclass(frozen=True, slots=True)
class CopySpan:
    """One copy on the copy stream: issued by instruction ``pc``, it ran from ``start`` to
    ``end`` (seconds on the step's clock); ``kind`` is "offload" or "prefetch"."""

    pc: int
    storage: int
    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    peak_bytes: int                    # device bytes, resident included
    peak_instruction: int              # index into the plan where the peak happens
    resident_bytes: int                # bytes that exist before the step (weights, batch, ...)
    live_after: tuple[int, ...]        # device bytes live after each instruction
    peak_during: tuple[int, ...]       # device bytes at the high point of each instruction
    time_after: tuple[float, ...]      # compute-stream clock after each instruction (s)
    latency_s: float                   # the step: max of compute and copy clocks
    compute_s: float
    copy_s: float
    host_peak_bytes: int               # offloaded bytes on the host, at most
    breakdown: dict[str, int]          # bytes at the peak by group (+ "workspace")
    top_tensors: tuple[TensorAtPeak, ...]
    phase_starts: dict[str, int] = field(default_factory=dict)  # phase -> first instruction
    peak_live: frozenset[int] = frozenset()  # storages live at the peak (planners target these)
    copies: tuple[CopySpan, ...] = ()  # every Offload/Prefetch copy, in issue order
    stall_s: float = 0.0               # compute-stream time spent waiting for copies at Waits

    @property
    def activation_bytes_at_peak(self) -> int:
        return self.breakdown.get("activations", 0) + self.breakdown.get("temporaries", 0)


class Simulator:
    """Interprets a Plan: ``getattr(self, "run_" + ins.op)`` per instruction, like the executor."""

    def __init__(self, graph: Graph, cost_model: CostModel) -> None:
        self.graph, self.cost = graph, cost_model
        self.fresh = new_storages(graph)
        self.nbytes = [s.nbytes for s in graph.storages]
        self.copies_overlap = bool(cost_model.copies_overlap)

    def run(self, plan: Plan) -> SimResult:
        g = self.graph
        self.live: set[int] = set(g.input_storages())
        self.host: set[int] = set()
        self.host_bytes = 0
        self.copying: dict[int, str] = {}  # storage -> "offload" | "prefetch" in flight
        self.copy_done: dict[int, float] = {}
        self.copies: list[CopySpan] = []
        self.stall_s = 0.0
        self.live_bytes = sum(self.nbytes[s] for s in self.live)
        self.t_compute = self.t_copy = 0.0
        self.compute_s = self.copy_s = 0.0
        resident = self.live_bytes
        live_after, peak_during, time_after = [], [], []
        peak, peak_pc, peak_set, peak_ws = resident, -1, set(self.live), 0
        host_peak = 0
        phase_starts: dict[str, int] = {}
        for pc, ins in enumerate(plan):
            self.pc = pc
            self.transient = self.live_bytes
            self.workspace, self.node = 0, None
            getattr(self, "run_" + ins.op)(ins)
            if self.node is not None:
                phase_starts.setdefault(g.nodes[self.node].phase.value, pc)
            high = max(self.transient, self.live_bytes)
            if high > peak:
                peak, peak_pc, peak_ws = high, pc, self.workspace
                peak_set = set(self.live)
            host_peak = max(host_peak, self.host_bytes)
            live_after.append(self.live_bytes)
            peak_during.append(high)
            time_after.append(self.t_compute)
        breakdown, top = self._breakdown(peak_set, peak_ws)
        return SimResult(
            peak_bytes=peak, peak_instruction=peak_pc, resident_bytes=resident,
            live_after=tuple(live_after), peak_during=tuple(peak_during),
            time_after=tuple(time_after), latency_s=max(self.t_compute, self.t_copy),
            compute_s=self.compute_s, copy_s=self.copy_s, host_peak_bytes=host_peak,
            breakdown=breakdown, top_tensors=top, phase_starts=phase_starts,
            peak_live=frozenset(peak_set), copies=tuple(self.copies), stall_s=self.stall_s)

    # -- instructions -------------------------------------------------------------------------
    def run_compute(self, ins: Compute | Recompute) -> None:
        node = self.graph.nodes[ins.node]
        cost = self.cost.node_cost(self.graph, node)
        fresh = self.fresh[ins.node]
        added = sum(self.nbytes[s] for s in fresh)
        # NOTE: a view allocates nothing, so it holds no workspace, whatever a cost table says
        # (measured, it is 0); solvers re-create views for free on that promise
        workspace = 0 if is_view_node(self.graph, ins.node, self.fresh) else cost.workspace_bytes
        if node.random and isinstance(ins, Recompute):
            # NOTE: replaying the RNG: restoring the main stream after the op makes a transient
            # copy of the generator state while the outputs are live (see the executor)
            workspace = max(workspace, self.cost.rng_state_bytes)
        self.transient = self.live_bytes + added + workspace
        self.workspace, self.node = workspace, ins.node
        self.live.update(fresh)
        self.live_bytes += added
        self.t_compute += cost.seconds
        self.compute_s += cost.seconds

    run_recompute = run_compute

    def run_free(self, ins: Free) -> None:
        for st in ins.storages:
            self.live.discard(st)
            self.live_bytes -= self.nbytes[st]

    def _copy(self, storage: int, kind: str) -> None:
        secs = self.cost.copy_seconds(self.nbytes[storage])
        start = max(self.t_copy, self.t_compute)  # NOTE: a copy starts once its data is ready
        self.t_copy = start + secs
        if not self.copies_overlap:
            # NOTE: a device without a copy engine (the CPU executor copies in line): the
            # compute stream does the copy, so nothing runs beside it
            self.t_compute = self.t_copy
        self.copy_s += secs
        self.copy_done[storage] = self.t_copy
        self.copying[storage] = kind
        self.copies.append(CopySpan(self.pc, storage, kind, start, self.t_copy))

    def run_offload(self, ins: Offload) -> None:
        self._copy(ins.storage, "offload")

    def run_prefetch(self, ins: Prefetch) -> None:
        self._copy(ins.storage, "prefetch")
        if ins.storage not in self.live:  # NOTE: device memory from the moment the copy starts
            self.live.add(ins.storage)
            self.live_bytes += self.nbytes[ins.storage]

    def run_wait(self, ins: Wait) -> None:
        done = self.copy_done.get(ins.storage, 0.0)
        if done > self.t_compute:
            self.stall_s += done - self.t_compute
            self.t_compute = done
        kind = self.copying.pop(ins.storage, None)
        if kind == "offload":
            # NOTE: the copy is complete here: the data is on host and the device bytes go
            self.host.add(ins.storage)
            self.host_bytes += self.nbytes[ins.storage]
            if ins.storage in self.live:
                self.live.discard(ins.storage)
                self.live_bytes -= self.nbytes[ins.storage]
        elif kind == "prefetch" and ins.storage in self.host:
            self.host.discard(ins.storage)  # NOTE: the host copy is needed until the data is back
            self.host_bytes -= self.nbytes[ins.storage]

    # -- reports ------------------------------------------------------------------------------
    def _breakdown(self, storages: set[int], workspace: int):
        g = self.graph
        groups: dict[str, int] = {}
        for st in storages:
            grp = BREAKDOWN_GROUPS[g.storages[st].role]
            groups[grp] = groups.get(grp, 0) + self.nbytes[st]
        if workspace:
            groups["workspace"] = workspace
        first_value: dict[int, int] = {}
        for v in g.values:
            first_value.setdefault(v.storage, v.id)
        ranked = sorted(storages, key=lambda s: (-self.nbytes[s], s))[:TOP_TENSORS]
        top = []
        for st in ranked:
            v = g.values[first_value[st]]
            top.append(TensorAtPeak(v.name, self.nbytes[st], g.storages[st].role.value,
                                    v.module, v.phase.value if v.phase != Phase.INPUT else "input"))
        return dict(sorted(groups.items())), tuple(top)


def simulate(graph: Graph, plan: Plan, cost_model: CostModel) -> SimResult:
    """Simulate ``plan``: peak bytes, bytes after every instruction, latency, peak breakdown."""
    return Simulator(graph, cost_model).run(plan)
