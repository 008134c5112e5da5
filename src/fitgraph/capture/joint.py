"""Convert AOTAutograd's joint forward+backward graph (what a torch.compile backend's
``partition_fn`` receives) into fitgraph's Graph IR, keeping the fx node of every IR node.

The joint graph's placeholders are ``primals_*`` (weights, buffers, user inputs: all resident)
and ``tangents_*`` (the gradients of the forward outputs); its output node returns the
``num_fwd_outputs`` forward outputs, then one gradient (or None) per primal. Forward nodes are
the ones torch's partitioners place in the forward module (``forward_region``); the IR runs
them all before the backward, as the two modules do.
Every node carries ``meta['val']`` (a FakeTensor), so conversion reuses ``convert.py``.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Phase, Role
from .convert import ConvertState, _convert_op
from .errors import CaptureError

__all__ = ["JointGraph", "joint_to_graph", "module_path"]

_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\]\.?")


@dataclass
class JointGraph:
    """The IR of a joint graph and its links back to the fx nodes."""

    graph: Graph
    fx_nodes: list[torch.fx.Node]              # IR node id -> fx node
    value_of: dict[torch.fx.Node, int]          # tensor-valued fx node -> IR value id
    forward: set[torch.fx.Node]                 # forward region (primal placeholders included)
    num_fwd_outputs: int


def module_path(node: torch.fx.Node) -> str:
    """``h.0.attn`` from Dynamo's ``nn_module_stack`` (``L['self'].h.0.attn``); backward nodes
    use the stack of the forward node they differentiate. A module's k-th call (Dynamo keys
    it ``<id>@k``) is labelled ``@k`` as ``fitgraph.capture`` labels it: ALBERT's shared layer
    run four times is ``groups.0``, ``groups.0@1``, ... (a block per call)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    label = plain = ""
    for key, value in stack.items():
        path = _plain_path(str(value[0]))
        label = label + path[len(plain):] if plain and path.startswith(plain + ".") else path
        plain = path
        call = str(key).rpartition("@")[2] if "@" in str(key) else ""
        if call.isdigit() and int(call) and path:
            label += f"@{call}"
    return label


def _plain_path(path: str) -> str:
    path = _DYNAMO_ROOT.sub("", path)
    # NOTE: Dynamo spells some submodules as indexing: ``layers[0]``, ``blocks['a']``
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).strip(".")


def _is_tangent(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def forward_region(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes torch's partitioners place in the forward module, in the order they run
    there: those up to the last forward-tagged node, then the ones that must be in the forward
    but sit after the backward in the joint graph (``copy_`` of a mutated buffer, e.g.
    BatchNorm's running statistics: the forward module runs them at its end)."""
    from torch._functorch.partitioners import _must_be_in_forward

    last = None
    for node in gm.graph.nodes:
        if node.meta.get("partitioner_tag") == "is_forward" or (
                node.op == "placeholder" and not _is_tangent(node)):
            last = node
    out: list[torch.fx.Node] = []
    rest = iter(gm.graph.nodes)
    for node in rest:
        if node.op == "output":
            return out
        if not _is_tangent(node):
            out.append(node)
        if node is last:
            break
    out += [n for n in rest if n.op == "call_function" and _must_be_in_forward(n)]
    return out


def _input_roles(gm: torch.fx.GraphModule, num_fwd_outputs: int,
                 static_inputs: set[int]) -> list[tuple[str, Role]]:
    """(name, role) of each placeholder: a primal with a gradient output is a parameter, other
    static-lifetime primals are buffers, the rest user inputs; tangents are inputs too."""
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    grads = list(out_node.args[0])[num_fwd_outputs:]
    names: list[tuple[str, Role]] = []
    primal = 0
    for ph in gm.graph.find_nodes(op="placeholder"):
        if _is_tangent(ph):
            names.append((f"tangent:{ph.name}", Role.INPUT))
            continue
        if primal < len(grads) and grads[primal] is not None:
            names.append((f"param:{ph.name}", Role.PARAMETER))
        elif primal in static_inputs:
            names.append((f"buffer:{ph.name}", Role.BUFFER))
        else:
            names.append((f"input:{ph.name}", Role.INPUT))
        primal += 1
    return names


def joint_to_graph(gm: torch.fx.GraphModule, num_fwd_outputs: int,
                   static_inputs: list[int] | None = None) -> JointGraph:
    """Convert the joint graph ``gm``; forward outputs become ``out:i``, gradients ``grad:i``
    (i = primal index). Raises CaptureError for what the IR cannot hold (symbolic shapes,
    non-ATen calls), naming the node."""
    forward = forward_region(gm)
    fwd_set = set(forward)
    cs = ConvertState()
    fx_nodes: list[torch.fx.Node] = []
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    roles = _input_roles(gm, num_fwd_outputs, set(static_inputs or ()))
    for ph, (name, role) in zip(placeholders, roles):
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise CaptureError(
                f"joint graph input {ph.name} is a {type(val).__name__}, not a tensor: the "
                "graph was traced with dynamic shapes, which fitgraph cannot plan; compile "
                "with torch.compile(..., dynamic=False) (each new shape is then planned anew)",
                op=ph.name)
        cs.fx_value[ph] = cs.value_for(val, name, role, Phase.INPUT, "", None, True)
    outputs: dict[str, int] = {}
    # NOTE: IR order is what the modules run: the forward module whole, then the backward
    order = forward + [n for n in gm.graph.nodes if n not in fwd_set]
    for node in order:
        if node.op == "placeholder":
            continue
        phase = Phase.FORWARD if node in fwd_set else Phase.BACKWARD
        if node.op == "get_attr":
            t = getattr(gm, node.target)
            cs.constants[node.target] = t
            cs.fx_value[node] = cs.value_for(t, f"const:{node.target}", Role.CONSTANT,
                                             Phase.INPUT, "", None, True)
            continue
        if node.op == "output":
            flat = list(node.args[0])
            for i, o in enumerate(flat):
                if o is None:
                    continue
                if not isinstance(o, torch.fx.Node) or o not in cs.fx_value:
                    raise CaptureError(f"joint graph output {i} ({o}) is not a tensor value",
                                       op="output")
                i_grad = i - num_fwd_outputs
                outputs[f"out:{i}" if i_grad < 0 else f"grad:{i_grad}"] = cs.fx_value[o]
            continue
        if node.target is operator.getitem:
            src, idx = node.args
            if src not in cs.fx_multi:
                raise CaptureError(f"getitem {node.name} of a non-tensor value {src.name}",
                                   op="getitem")
            vid = cs.fx_multi[src][idx]
            if vid is not None:
                cs.fx_value[node] = vid
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            raise CaptureError(
                f"joint graph node {node.name} calls {node.target!r}, not an ATen op (symbolic "
                "shapes?); fitgraph plans static ATen graphs: compile with "
                "torch.compile(..., dynamic=False)", module=module_path(node),
                op=str(node.target))
        fx_nodes.append(node)
        _convert_op(cs, node, phase, module_path(node))
    # NOTE: inputs numbered first (a constant read by a later node is an input made after
    # values): every graph rewriter emits them first, and fission's separated graphs must keep
    # each value's id (Longformer's region, a constant after the nodes, failed there)
    renumbered = cs.b.number_inputs_first()
    outputs = {k: renumbered.get(v, v) for k, v in outputs.items()}
    graph = cs.b.finish(outputs, meta={"constants": cs.constants, "source": "aot_autograd joint",
                                       "backward_after_forward": True})
    for key, vid in outputs.items():
        if key.startswith("out:") and graph.storages[graph.values[vid].storage].role is Role.GRADIENT:
            # NOTE: forward outputs are not gradients: they are what the model returns
            graph.storages[graph.values[vid].storage].role = Role.OUTPUT
            graph.values[vid].role = Role.OUTPUT
    verify_graph(graph)
    value_of = {n: renumbered.get(v, v) for n, v in cs.fx_value.items()}
    return JointGraph(graph, fx_nodes, value_of, fwd_set, num_fwd_outputs)
