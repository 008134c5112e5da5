"""Turn a rematerialization decision on the joint graph into torch's forward and backward
modules.

The backward reads some forward values. Those the plan keeps are *saved* (forward outputs that
autograd stashes); a value the plan drops is not: the backward module re-creates it by running
its forward producer again, from saved values, recursively. torch's own
``_extract_fwd_bwd_modules`` builds both modules from the saved list (the backward copies every
forward node it can compute from what it receives); ``reordering_to_mimic_autograd_engine``
then moves each recomputation just before its first use, as fitgraph's ``remat_plan`` does, so
recomputed values live briefly instead of from the start of the backward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._functorch import partitioners as P
from torch._functorch.compile_utils import raise_getitems

from ..capture.joint import JointGraph
from ..execute.ops import resolve_target
from ..graph.analysis import new_storages
from .schedule import Schedule, in_plan_order

__all__ = ["Split", "must_save", "saved_bytes", "saved_values", "split_joint", "write_over"]


@dataclass(frozen=True)
class Split:
    fw: fx.GraphModule
    bw: fx.GraphModule
    saved: tuple[str, ...]         # fx names of the saved tensors, in the forward's output order
    recomputed: tuple[str, ...]    # fx names of forward ATen nodes the backward runs again
    saved_bytes: int               # bytes of the saved activations (resident storages excluded)


def _is_sym(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def must_save(joint: fx.GraphModule) -> set[fx.Node]:
    """Forward nodes torch's partitioners never recompute: impure ops (random ones included:
    on CPU they are not functionalized, so a recompute would draw new numbers) and nodes torch
    tags MUST_SAVE (effectful ops, mutation sources read by the backward, collectives)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if not P.config.unsafe_allow_optimization_of_collectives:
        P.force_save_collectives(joint)
    P.force_save_effectful_ops(joint)
    P.force_save_bw_mutation_src(joint)
    out = set()
    for node in joint.graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE or node.is_impure(
                impure_random=True):
            out.add(node)
    return out


def _deps(node: fx.Node) -> list[fx.Node]:
    """What re-running ``node`` needs (a getitem re-runs the multi-output op it reads)."""
    if node.target is operator.getitem:
        return list(node.args[0].all_input_nodes)
    return list(node.all_input_nodes)


def saved_values(jg: JointGraph, dropped: set[int]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(saved tensors, saved symbolic values) when the IR nodes ``dropped`` are recomputed.

    Start from every forward value a backward node reads (what eager autograd keeps); a value
    in a dropped storage (the dropped node's output, or a view of it) is replaced by what
    re-creating it needs, recursively; anything else is saved."""
    g = jg.graph
    fresh = new_storages(g)
    gone = {s for nid in dropped for s in fresh[nid]}

    def recompute(node: fx.Node) -> bool:
        if node.op != "call_function" or node not in jg.forward:
            return False
        vid = jg.value_of.get(node)
        return vid is not None and g.values[vid].storage in gone

    saved: dict[fx.Node, None] = {}
    syms: dict[fx.Node, None] = {}
    seen: set[fx.Node] = set()
    stack = [n for n in jg.forward if any(u not in jg.forward for u in n.users)]
    stack.reverse()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_sym(node):
            syms[node] = None
        elif node in jg.value_of and not recompute(node):
            saved[node] = None
        elif node in jg.value_of or node.op == "call_function":
            # NOTE: a multi-output op read directly is handled through its getitems
            stack.extend(reversed(_deps(node)))
    return list(saved), list(syms)


def saved_bytes(jg: JointGraph, nodes: list[fx.Node]) -> int:
    """Bytes of the distinct non-resident storages of ``nodes`` (what saving them holds)."""
    g = jg.graph
    resident = set(g.input_storages())
    storages = {g.values[jg.value_of[n]].storage for n in nodes if n in jg.value_of}
    return sum(g.storages[s].nbytes for s in storages - resident)


def split_joint(joint: fx.GraphModule, jg: JointGraph, schedule: Schedule | None = None
                ) -> Split:
    """Forward and backward modules that save what ``saved_values`` says for the schedule's
    recomputes, the backward recomputing the rest, both in the schedule's order (without a
    schedule: nothing recomputed, the captured order)."""
    schedule = schedule or Schedule()
    saved, syms = saved_values(jg, set(schedule.recompute))
    fw, bw = P._extract_fwd_bwd_modules(joint, saved, saved_sym_nodes=syms,
                                        num_fwd_outputs=jg.num_fwd_outputs)
    # NOTE: as default_partition: drop nodes the extraction copied but nothing reads (a random
    # op the backward could compute is never used there: its outputs are saved)
    fw.graph.eliminate_dead_code(is_impure_node=P.is_not_collective)
    bw.graph.eliminate_dead_code(is_impure_node=P.is_not_collective)
    fw.recompile()
    bw.recompile()
    forward_names = {n.name: n for n in jg.forward if n.op == "call_function"}
    recomputed = tuple(n.name for n in bw.graph.nodes if n.op == "call_function"
                       and n.name in forward_names and n.target is not operator.getitem)
    random = [n for n in recomputed if forward_names[n].is_impure(impure_random=True)]
    if random:
        raise AssertionError(f"fitgraph partition: the backward would re-run impure/random "
                             f"forward ops {random}; they must be saved (a fitgraph bug)")
    if schedule.fw_pos or schedule.bw_pos:
        # NOTE: the extraction keeps the joint order, recomputes first in the backward; the
        # plan's order recomputes each value just before its first use
        ir_id = {n.name: i for i, n in enumerate(jg.fx_nodes)}
        fw, bw = in_plan_order(fw, schedule.fw_pos, ir_id), in_plan_order(bw, schedule.bw_pos,
                                                                            ir_id)
    # NOTE: getitems as early as possible, as default_partition does: frees unused outputs
    return Split(raise_getitems(fw), raise_getitems(bw), tuple(n.name for n in saved),
                 recomputed, saved_bytes(jg, saved))


def write_over(bw: fx.GraphModule, rewritten: dict[str, tuple[str, str]]) -> fx.GraphModule:
    """``bw`` with each node named in ``rewritten`` (fx name -> (out= overload, its keyword);
    ``solvers.grads_in_place``'s choice on the IR) writing into the gradient it reads first.

    NOTE: the IR said that gradient is touched last by this node in the plan's order, which
    is the backward module's; a later reader here is a fitgraph bug (the simulated peak would
    miss a tensor), never a gradient written over while still read."""
    if not rewritten:
        return bw
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    done = set()
    for node in bw.graph.nodes:
        if node.op != "call_function" or node.name not in rewritten:
            continue
        target, keyword = rewritten[node.name]
        dy = node.args[0]
        if (not isinstance(dy, fx.Node) or dy.op != "call_function"
                or any(order[u] > order[node] for u in dy.users)):
            raise AssertionError(f"fitgraph partition: {node.name} cannot write over "
                                 f"{getattr(dy, 'name', dy)} (read later in the backward "
                                 "module); this is a fitgraph bug")
        node.target = resolve_target(target)
        node.kwargs = {**node.kwargs, keyword: dy}
        done.add(node.name)
    if done != set(rewritten):
        raise AssertionError(f"fitgraph partition: the backward module lacks "
                             f"{sorted(set(rewritten) - done)[:5]}; this is a fitgraph bug")
    bw.recompile()
    return bw
