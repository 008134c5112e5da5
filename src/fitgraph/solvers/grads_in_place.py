"""An activation's gradient written over the gradient it is made from, where that one dies there.

Eager autograd runs every activation's backward (``gelu_backward(dy, x)``, ReLU's
``threshold_backward``, ``silu_backward``, dropout's ``native_dropout_backward``, ...) into a new
tensor beside ``dy``, and ``dy`` is freed right after: at that op two activation-sized tensors
are live where one would do. A transformer's MLP backward peaks there (``[tokens, 4 x hidden]``
twice), and so does a convolution stack's (wav2vec2's first layer: four 3.1 MiB tensors at its
GELU backward, one of them this op's output).

``grads_in_place(sol, graph, cm)`` rewrites a plan after it is made: where ``dy`` is made in the
backward, read last by the activation's backward, laid out as its output, and the plan neither
recomputes that node nor moves either tensor to the host, the node runs its ``out=`` variant
(``gelu_backward.grad_input(dy, x, grad_input=dy)``) and its output lives in ``dy``'s storage:
the plan's free of ``dy`` moves to where the output was freed. The kernels are the same and an
output that wholly overlaps its input is how PyTorch's in-place ops run, so the results are
bitwise eager's; the plan only gets lower (simulated again, and kept only where it is).

Example:
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.graph.ir import GraphBuilder, Phase, Role
    >>> from fitgraph.plan.eager import eager_plan
    >>> from fitgraph.sim.simulate import simulate
    >>> from fitgraph.solvers.base import Solution
    >>> b = GraphBuilder()
    >>> x, w = (b.add_input(n, (256, 256), "float32", Role.INPUT) for n in ("x", "w"))
    >>> bw = dict(phase=Phase.BACKWARD)
    >>> dy = b.add_node("aten.mm.default", [x, w], [((256, 256), "float32")], name="dy", **bw)[0]
    >>> dx = b.add_node("aten.gelu_backward.default", [dy, x], [((256, 256), "float32")],
    ...                 name="dx", **bw)[0]
    >>> s = b.add_node("aten.sum.default", [dx], [((), "float32")], name="s", **bw)[0]
    >>> g = b.finish({"loss": s})
    >>> cm = RooflineCostModel(get_device("cpu-generic"))
    >>> plan = eager_plan(g)
    >>> sol = grads_in_place(Solution(plan, simulate(g, plan, cm), "eager", 0.0), g, cm)
    >>> sol.graph.nodes[1].target, sol.sim.peak_bytes < simulate(g, plan, cm).peak_bytes
    ('aten.gelu_backward.grad_input', True)
"""

from __future__ import annotations

import dataclasses

from ..cost.base import CostModelWrapper, NodeCost
from ..graph.analysis import new_storages, storage_accesses
from ..graph.ir import Graph, Phase, ValueRef
from ..plan.instructions import Compute, Free, Plan, Recompute
from ..sim.simulate import simulate
from .base import Solution

__all__ = ["OUT_VARIANTS", "grads_in_place"]

# NOTE: pointwise backward ops whose first argument is the gradient they scale, and their out=
# variant with its keyword: TensorIterator kernels, which run an output that is wholly one of
# their inputs as the in-place ops do
OUT_VARIANTS = {
    f"aten.{name}.default": (f"aten.{name}.{overload}", keyword)
    for name, overload, keyword in (
        ("gelu_backward", "grad_input", "grad_input"),
        ("threshold_backward", "grad_input", "grad_input"),
        ("silu_backward", "grad_input", "grad_input"),
        ("sigmoid_backward", "grad_input", "grad_input"),
        ("tanh_backward", "grad_input", "grad_input"),
        ("hardtanh_backward", "grad_input", "grad_input"),
        ("elu_backward", "grad_input", "grad_input"),
        ("leaky_relu_backward", "grad_input", "grad_input"),
        ("softplus_backward", "grad_input", "grad_input"),
        ("hardsigmoid_backward", "grad_input", "grad_input"),
        ("hardswish_backward", "out", "out"),
        ("native_dropout_backward", "out", "out"),
    )
}


def grads_in_place(sol: Solution, graph: Graph, cost_model) -> Solution:
    """``sol`` with every activation backward that can write over its dying gradient doing so
    (module doc): its graph rewritten, its plan's frees moved, simulated again; ``sol`` itself
    where none can, or where the rewrite does not lower the peak."""
    g = sol.graph_for(graph)
    nodes = _in_place_nodes(g, sol.plan)
    if not nodes:
        return sol
    g2, plan = _rewritten(g, sol.plan, nodes)
    cost_model.prepare(g2)  # NOTE: the out= variants' own times, for whoever asks later
    # NOTE: timed as the ops they were (the same kernels): measured apart, a variant's time
    # differs by the machine's noise, and a plan made at its latency limit would then read
    # over it (the simulated step must not move where only the output's storage did)
    sim = simulate(g2, plan, _SameKernels(cost_model, g, set(nodes)))
    if sim.peak_bytes > sol.sim.peak_bytes:
        return sol
    return dataclasses.replace(sol, plan=plan, sim=sim, graph=g2, notes=dict(
        sol.notes, grads_in_place=len(nodes)))


class _SameKernels(CostModelWrapper):
    """``base``, with a rewritten node's time that of the node it was in ``graph`` and its
    own workspace (measured: Hardswish's out= variant allocates 256 B its functional one
    does not)."""

    def __init__(self, base, graph: Graph, rewritten: set[int]) -> None:
        super().__init__(base)
        self.graph, self.rewritten = graph, rewritten

    def node_cost(self, graph: Graph, node) -> NodeCost:
        if node.id in self.rewritten:
            was = self.base.node_cost(self.graph, self.graph.nodes[node.id])
            return NodeCost(was.seconds, self.base.node_cost(graph, node).workspace_bytes)
        return self.base.node_cost(graph, node)


def _in_place_nodes(graph: Graph, plan: Plan) -> list[int]:
    """The nodes whose output can take their gradient input's storage (module doc)."""
    values = graph.values
    accesses = storage_accesses(graph)
    fresh = new_storages(graph)
    kept = {values[v].storage for v in graph.inputs} | {
        values[v].storage for v in graph.outputs.values()}
    computed: dict[int, int] = {}
    moved: set[int] = set()
    recomputed: set[int] = set()
    last: dict[int, int] = {}   # NOTE: node -> its last position in the plan
    for pc, ins in enumerate(plan.instructions):
        if type(ins) is Compute:
            computed[ins.node] = computed.get(ins.node, 0) + 1
            last[ins.node] = pc
        elif isinstance(ins, Recompute):
            recomputed.add(ins.node)
            last[ins.node] = pc
        elif hasattr(ins, "storage"):
            moved.add(ins.storage)  # NOTE: offload, prefetch, wait
    out = []
    for n in graph.nodes:
        if (n.target not in OUT_VARIANTS or n.phase is not Phase.BACKWARD or n.mutates
                or len(n.outputs) != 1 or n.outputs[0] is None or n.out_is_tuple
                or not n.args or not isinstance(n.args[0], ValueRef)
                or computed.get(n.id) != 1 or n.id in recomputed):
            continue
        dy, o = values[n.args[0].id], values[n.outputs[0]]
        st = dy.storage
        made = accesses.get(st, [None])[0]
        if (st in kept or o.storage in kept or st in moved or o.storage in moved
                or o.storage not in fresh[n.id] or accesses[st][-1] != n.id
                # NOTE: the last to touch dy in the plan's order too (a solver may reorder)
                or any(last.get(r, -1) > last[n.id] for r in accesses[st])
                or made is None or graph.nodes[made].phase is not Phase.BACKWARD
                or (dy.shape, dy.stride, dy.dtype) != (o.shape, o.stride, o.dtype)
                or any(values[v].storage == st for v in n.inputs if v != dy.id)
                or _remade(graph, st, recomputed)):
            continue
        out.append(n.id)
    return out


def _remade(graph: Graph, st: int, recomputed: set[int]) -> bool:
    """Whether the plan recomputes a node that makes a value in storage ``st``.

    NOTE: a re-make of ``dy`` after the write would be written over; one before it is safe,
    but which comes first is the plan's order: left as it is."""
    return any(o is not None and graph.values[o].storage == st
               for r in recomputed for o in graph.nodes[r].outputs)


def _rewritten(graph: Graph, plan: Plan, nids: list[int]) -> tuple[Graph, Plan]:
    """``graph`` with nodes ``nids`` writing into their gradient input, and ``plan`` with the
    frees moved: ``dy``'s storage is freed where the output's was."""
    nodes, values = list(graph.nodes), list(graph.values)
    into: dict[int, int] = {}   # NOTE: an output's storage -> the gradient's it now lives in
    at: dict[int, int] = {}     # NOTE: node -> its gradient's storage, not freed after it now

    def root(st: int) -> int:
        # NOTE: a chain (dropout's backward, then the activation's) lives in the first one
        while st in into:
            st = into[st]
        return st

    by_storage: dict[int, list[int]] = {}
    for v in graph.values:
        by_storage.setdefault(v.storage, []).append(v.id)
    for nid in nids:
        n = graph.nodes[nid]
        dy, o = graph.values[n.args[0].id], graph.values[n.outputs[0]]
        target, keyword = OUT_VARIANTS[n.target]
        nodes[nid] = dataclasses.replace(n, target=target, kwargs={
            **n.kwargs, keyword: ValueRef(dy.id)}, mutates=(dy.id,))
        base = values[dy.id]
        # NOTE: the output and its views (same storage) move, offsets kept relative to it
        for vid in by_storage[o.storage]:
            v = graph.values[vid]
            values[vid] = dataclasses.replace(v, storage=base.storage, storage_offset=(
                v.storage_offset - o.storage_offset + base.storage_offset))
        into[o.storage] = dy.storage
        at[nid] = dy.storage
    instructions, pending = [], set()
    for ins in plan.instructions:
        if type(ins) is Compute and ins.node in at:
            pending.add(at[ins.node])
        elif isinstance(ins, Free):
            sts = tuple(dict.fromkeys(root(st) for st in ins.storages if st not in pending))
            pending -= set(ins.storages)
            if not sts:
                continue
            ins = dataclasses.replace(ins, storages=sts)
        instructions.append(ins)
    return (dataclasses.replace(graph, nodes=nodes, values=values),
            dataclasses.replace(plan, instructions=tuple(instructions)))
