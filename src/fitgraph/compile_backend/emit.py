"""Forward and backward modules that run a plan over a *rewritten* joint graph, node for node.

``partition.split_joint`` realises a remat plan on the joint graph torch traced: it hands torch's
extraction the saved values, and the backward copies the forward nodes it recomputes. A plan
over a graph that operator fission rewrote (an op run in parts into a buffer that ``copy_``
fills, gradients accumulated with ``add_``) has nodes the joint graph lacks, and in-place writes
whose readers read the buffer, not the write: torch's extraction, which follows data flow from
the outputs, would drop them. So the modules are written here from the plan itself: the forward
module runs the plan's instructions up to its first backward node, the backward module the
rest, each instruction one fx node in the plan's order (a recompute is a node of its own). The
forward returns the region's outputs, then every value the backward reads that it made (the
saved tensors, as torch's partitioners lay them out); the backward takes those, then the
tangents, and returns one gradient (or None) per primal. fx frees each value after its last
use in a module, which is where the plan frees it (or earlier), so the modules hold what the
simulator walked.

Example:
    >>> import torch, fitgraph
    >>> m = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.Linear(256, 16))
    >>> be = fitgraph.backend(budget=0.8, solver="auto", time_budget=5)
    >>> torch.compile(m, backend=be)(torch.randn(256, 16)).square().mean().backward()
    >>> be.last_report.notes["modules"]      # the modules were written from the plan
    'emitted'
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from ..execute.ops import GRAD_MODE_OPS, OVERSIZED_OUTPUT_OPS
from ..graph.ir import Graph, Phase, ValueRef
from ..graph.recompute_rules import recompute_without_writes
from ..plan.instructions import Compute, Free, Plan, Recompute
from .partition import Split

__all__ = ["EmitError", "check_emittable", "emit_split", "phased"]

_BACKWARD = (Phase.BACKWARD, Phase.OPTIMIZER)


class EmitError(NotImplementedError):
    """The plan cannot run as a forward module then a backward module (the caller falls back
    to a plan ``partition.split_joint`` realises)."""


def phased(graph: Graph, plan: Plan) -> Plan:
    """``plan`` with every forward node's first computation moved before the first backward
    node (stable otherwise). A joint graph's tangents are inputs, so a reordering solver may
    run a backward node early; the modules cannot: autograd runs the forward whole first.
    Frees stay where they are (a value made earlier is freed at the same point: valid)."""
    first_bw = next((i for i, ins in enumerate(plan) if isinstance(ins, Compute)
                     and graph.nodes[ins.node].phase in _BACKWARD), None)
    if first_bw is None:
        return plan
    late = [i for i, ins in enumerate(plan) if i > first_bw and isinstance(ins, Compute)
            and graph.nodes[ins.node].phase not in _BACKWARD]
    if not late:
        return plan
    moved = set(late)
    ins = list(plan.instructions)
    order = ins[:first_bw] + [ins[i] for i in late] + [
        x for i, x in enumerate(ins) if i >= first_bw and i not in moved]
    return Plan(tuple(order), dict(plan.meta))


def _fx_name(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _target(graph: Graph, nid: int):
    node = graph.nodes[nid]
    if node.target in GRAD_MODE_OPS or node.target.startswith("fitgraph.optimizer."):
        raise EmitError(f"{node.target} ({node.name}) runs only in fitgraph's executor")
    ns, name, overload = node.target.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except AttributeError as e:
        raise EmitError(f"op {node.target} ({node.name}) is not in this torch") from e


def _split_at(graph: Graph, plan: Plan) -> int:
    """Index of the plan's first backward instruction; EmitError where the forward's nodes
    do not all run before it, or for instructions the modules cannot run."""
    other = sorted({ins.op for ins in plan if not isinstance(ins, (Compute, Free, Recompute))})
    if other:
        raise EmitError(f"{', '.join(other)} instructions")
    first_bw = next((i for i, ins in enumerate(plan) if isinstance(ins, (Compute, Recompute))
                     and graph.nodes[ins.node].phase in _BACKWARD), len(plan))
    if any(isinstance(ins, Compute) and graph.nodes[ins.node].phase not in _BACKWARD
           for ins in plan.instructions[first_bw:]):
        raise EmitError("forward nodes after the backward's first")
    return first_bw


def check_emittable(graph: Graph, plan: Plan) -> None:
    """EmitError where the two modules cannot run ``plan`` (before any module is written)."""
    at = _split_at(graph, plan)
    made = set(graph.inputs)
    for ins in plan.instructions[:at]:
        if isinstance(ins, (Compute, Recompute)):
            made.update(v for v in graph.nodes[ins.node].outputs if v is not None)
    late = [graph.values[v].name for k, v in graph.outputs.items()
            if k.startswith("out:") and v not in made]
    if late:
        # NOTE: a joint graph with no forward-tagged node (a region dividing by a float
        # input) has its outputs' producers in the IR's backward; torch's extraction places
        # them by data flow
        raise EmitError(f"forward outputs {late[:3]} are made in the backward")
    pinned = set(graph.meta.get("pinned", ()))
    for ins in plan:
        if isinstance(ins, (Compute, Recompute)):
            _target(graph, ins.node)
            n = graph.nodes[ins.node]
            if isinstance(ins, Recompute) and (n.random or n.name in pinned):
                raise EmitError(f"{n.name} recomputed: random or impure, it must run once")


class _Module:
    """One fx graph being written: values (IR id -> fx node) and the nodes run so far."""

    def __init__(self, graph: Graph) -> None:
        self.g, self.fx = graph, fx.Graph()
        self.env: dict[int, fx.Node] = {}
        self.recomputed: list[str] = []

    def ref(self, a: Any) -> Any:
        if isinstance(a, ValueRef):
            if a.id not in self.env:
                raise EmitError(f"value {self.g.values[a.id].name} is read where the plan "
                                "has not made it")
            return self.env[a.id]
        if isinstance(a, tuple):
            return tuple(self.ref(x) for x in a)
        if isinstance(a, list):
            return [self.ref(x) for x in a]
        if isinstance(a, dict):
            return {k: self.ref(v) for k, v in a.items()}
        return a

    def run(self, ins: Compute | Recompute) -> None:
        g, nid = self.g, ins.node
        node = g.nodes[nid]
        args = list(self.ref(node.args))
        if isinstance(ins, Recompute):
            for i in recompute_without_writes(g, nid):
                args[i] = None
            self.recomputed.append(node.name)
        name = _fx_name(node.name) + ("_re" if isinstance(ins, Recompute) else "")
        call = self.fx.create_node("call_function", _target(g, nid), tuple(args),
                                   self.ref(node.kwargs), name=name)
        if node.target in OVERSIZED_OUTPUT_OPS:
            # NOTE: as execute.ops._compacting: the output in a storage of its own size
            call = self.fx.call_function(torch.ops.aten.clone.default, (call,),
                                         {"memory_format": torch.contiguous_format})
        if node.out_is_tuple:
            for i, vid in enumerate(node.outputs):
                if vid is not None:
                    self.env[vid] = self.fx.call_function(operator.getitem, (call, i))
        elif node.outputs and node.outputs[0] is not None:
            self.env[node.outputs[0]] = call


def emit_split(joint: fx.GraphModule, graph: Graph, plan: Plan, num_fwd_outputs: int) -> Split:
    """The forward and backward modules that run ``plan`` over ``graph`` (a rewrite of
    ``joint``'s IR: the same inputs by name, the same ``out:i``/``grad:i`` outputs).
    ``check_emittable`` first: EmitError where the plan cannot run as the two modules."""
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    at = _split_at(graph, plan)
    runs = [ins for ins in plan if isinstance(ins, (Compute, Recompute))]
    fw_runs = [ins for ins in plan.instructions[:at] if isinstance(ins, (Compute, Recompute))]
    bw_runs = runs[len(fw_runs):]
    placeholders = {n.name: n for n in joint.graph.find_nodes(op="placeholder")}
    tangents = [n for n in placeholders.values() if "tangents" in str(n.target)]
    out_node = next(iter(joint.graph.find_nodes(op="output")))
    joint_outs = list(out_node.args[0])

    fw = _Module(graph)
    inputs: dict[int, tuple[str, str]] = {}
    for vid, label in zip(graph.inputs, graph.input_names):
        kind, _, name = label.partition(":")
        inputs[vid] = (kind, name)
    for ph in placeholders.values():
        if ph in tangents:
            continue
        node = fw.fx.placeholder(ph.name)
        node.meta = dict(ph.meta)
    by_name = {n.name: n for n in fw.fx.nodes}
    for vid, (kind, name) in inputs.items():
        if kind == "const":
            fw.env[vid] = fw.fx.get_attr(name)
        elif kind != "tangent":
            if name not in by_name:
                raise EmitError(f"graph input {name} is not a placeholder of the joint graph")
            fw.env[vid] = by_name[name]
    for ins in fw_runs:
        fw.run(ins)

    # NOTE: what the backward reads before making it: the saved values (primals included)
    made: set[int] = set()
    saved: list[int] = []
    grads = {k: v for k, v in graph.outputs.items() if k.startswith("grad:")}
    for ins in bw_runs:
        for vid in graph.nodes[ins.node].inputs:
            kind = inputs.get(vid, ("",))[0]
            if vid not in made and kind not in ("tangent", "const") and vid not in saved:
                saved.append(vid)
        made.update(v for v in graph.nodes[ins.node].outputs if v is not None)
    for vid in grads.values():
        if vid not in made and inputs.get(vid, ("",))[0] not in ("tangent", "const") \
                and vid not in saved:
            saved.append(vid)
    missing = [graph.values[v].name for v in saved if v not in fw.env]
    if missing:
        raise EmitError(f"the backward reads {missing[:3]}, which the forward does not keep")

    outs = []
    for i, o in enumerate(joint_outs[:num_fwd_outputs]):
        vid = graph.outputs.get(f"out:{i}")
        if o is None or vid is None:
            outs.append(None)
            continue
        if vid not in fw.env:
            raise EmitError(f"forward output {graph.values[vid].name} is made in the backward")
        outs.append(fw.env[vid])
    fw_out = fw.fx.output(tuple(outs + [fw.env[v] for v in saved]))
    descs = out_node.meta.get("desc")
    if descs is not None:
        fw_out.meta["desc"] = list(descs[:num_fwd_outputs]) + [
            SavedForBackwardsAOTOutput(i) for i in range(len(saved))]

    bw = _Module(graph)
    for vid in saved:
        bw.env[vid] = bw.fx.placeholder(fw.env[vid].name)
    for ph in tangents:
        node = bw.fx.placeholder(ph.name)
        node.meta = dict(ph.meta)
        vid = next((v for v, (k, n) in inputs.items() if k == "tangent" and n == ph.name), None)
        if vid is not None:
            bw.env[vid] = node
    for vid, (kind, name) in inputs.items():
        if kind == "const":
            bw.env[vid] = bw.fx.get_attr(name)
    for ins in bw_runs:
        bw.run(ins)
    grad_outs = []
    for j, o in enumerate(joint_outs[num_fwd_outputs:]):
        vid = graph.outputs.get(f"grad:{j}")
        grad_outs.append(None if o is None or vid is None else bw.env[vid])
    bw_out = bw.fx.output(tuple(grad_outs))
    if descs is not None:
        bw_out.meta["desc"] = list(descs[num_fwd_outputs:])

    fw_gm, bw_gm = fx.GraphModule(joint, fw.fx), fx.GraphModule(joint, bw.fx)
    _propagate_fakes(fw_gm, bw_gm, placeholders, tangents, len(saved))
    resident = set(graph.input_storages())
    nbytes = sum(graph.storages[s].nbytes
                 for s in {graph.values[v].storage for v in saved} - resident)
    return Split(fw_gm, bw_gm, tuple(fw.env[v].name for v in saved),
                 tuple(bw.recomputed), nbytes)


def _propagate_fakes(fw: fx.GraphModule, bw: fx.GraphModule, placeholders: dict,
                     tangents: list, n_saved: int) -> None:
    """``meta['val']`` (fake tensors) on every node of both modules, as torch's partitioners
    leave them: AOTAutograd reads the saved tensors' metadata after partitioning."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    primals = [n.meta.get("val") for n in fw.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode([v for v in primals if isinstance(v, torch.Tensor)]
                            + [t.meta.get("val") for t in tangents])
    if mode is None:
        raise EmitError("the joint graph's inputs carry no fake tensors")
    with mode:
        FakeTensorProp(fw, mode).propagate_dont_convert_inputs(*primals)
        fw_out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        saved = [n.meta["val"] for n in fw_out[len(fw_out) - n_saved:]]
        bw_in = list(bw.graph.find_nodes(op="placeholder"))
        for node, val in zip(bw_in, saved):
            node.meta["val"] = val
        FakeTensorProp(bw, mode).propagate_dont_convert_inputs(
            *saved, *[t.meta.get("val") for t in tangents])
