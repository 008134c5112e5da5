"""Read a solver's Plan as what the forward and backward modules must run, and in which order.

A fw/bw split can realise a plan whose forward runs whole before the backward (the tangents
arrive only then) and whose recomputes all happen in the backward, each node at most once (the
backward module holds one copy of each recomputed node). Within that, any order the plan chose
is kept: both modules' nodes are sorted by their plan positions, so what runs is what the
simulator walked (DESIGN law 4).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from ..graph.ir import Graph, Phase
from ..plan.instructions import Compute, Free, Plan, Recompute

__all__ = ["Schedule", "in_plan_order", "schedule_of"]

_BACKWARD = (Phase.BACKWARD, Phase.OPTIMIZER)


@dataclass(frozen=True)
class Schedule:
    recompute: frozenset[int] = frozenset()            # IR nodes the backward runs again
    fw_pos: dict[int, int] = field(default_factory=dict)  # IR node -> position in the forward
    bw_pos: dict[int, int] = field(default_factory=dict)  # IR node -> position in the backward


def schedule_of(graph: Graph, plan: Plan, solver: str) -> Schedule:
    """The Schedule of ``plan``; NotImplementedError saying why if a fw/bw split cannot run it."""
    why = ""
    other = sorted({ins.op for ins in plan if not isinstance(ins, (Compute, Free, Recompute))})
    computes = [ins.node for ins in plan if isinstance(ins, Compute)]
    recomputes = [ins.node for ins in plan if isinstance(ins, Recompute)]
    first_bw = next((i for i, ins in enumerate(plan) if isinstance(ins, Compute)
                     and graph.nodes[ins.node].phase in _BACKWARD), len(plan))
    last_fw = max((i for i, ins in enumerate(plan) if isinstance(ins, Compute)
                   and graph.nodes[ins.node].phase not in _BACKWARD), default=-1)
    if other:
        why = f"{', '.join(other)} instructions"
    elif sorted(computes) != list(range(len(graph.nodes))):
        why = "a schedule that does not compute every node once"
    elif last_fw > first_bw:
        why = "backward nodes before the end of the forward"
    elif any(isinstance(ins, Recompute) for ins in plan.instructions[:last_fw + 1]):
        # NOTE: a recompute after the forward's last node, before the first backward one
        # (it reads what the recompute makes), is the backward module's first work
        why = "recomputes inside the forward"
    elif len(set(recomputes)) != len(recomputes):
        why = "a node recomputed more than once"
    if why:
        raise NotImplementedError(
            f"solver {solver!r} planned {why}; fitgraph.backend realises plans that run the "
            "forward whole, then the backward with each recompute once: use a solver that "
            "keeps to that ('hotspot', 'knapsack', 'checkpoint_blocks', 'ilp')")
    fw_pos, bw_pos = {}, {}
    for i, ins in enumerate(plan):
        if isinstance(ins, Recompute) or isinstance(ins, Compute) and i >= first_bw:
            bw_pos[ins.node] = i
        elif isinstance(ins, Compute):
            fw_pos[ins.node] = i
    return Schedule(frozenset(recomputes), fw_pos, bw_pos)


def in_plan_order(gm: fx.GraphModule, pos: dict[int, int], ir_id: dict[str, int]
                  ) -> fx.GraphModule:
    """``gm`` with its nodes in plan order: placeholders, then each node at its position
    (``pos`` by IR node id, ``ir_id`` maps fx names to IR ids; a getitem follows the op it
    reads), then the output."""
    keys: dict[fx.Node, tuple[float, int]] = {}

    def key(node: fx.Node) -> tuple[float, int]:
        if node in keys:
            return keys[node]
        if node.op in ("placeholder", "get_attr"):
            k = (-1.0, 0)  # NOTE: get_attr: a constant the graph holds (HF GPT-2's masks)
        elif node.op == "output":
            k = (float("inf"), 0)
        elif node.target is operator.getitem:
            k = (key(node.args[0])[0] + 0.5, 0)
        elif node.name in ir_id and ir_id[node.name] in pos:
            k = (float(pos[ir_id[node.name]]), 0)
        elif node.name in ir_id:
            # NOTE: a node the plan runs in the other module: torch's module extraction moves
            # backward nodes that need no tangent into the forward (seen: a Python float read
            # with .item(), a graph input, divides an activation; the backward's own copy of
            # the division lands in the forward). Run it as soon as it can run; the simulated
            # peak then misses it (the region's report is the plan's, not this order's)
            k = (max((key(a)[0] for a in node.all_input_nodes), default=-1.0) + 0.25, 0)
        else:
            raise AssertionError(f"fx node {node.name} ({node.target}) has no place in the plan "
                                 "(a fitgraph bug)")
        keys[node] = k
        return k

    nodes = list(gm.graph.nodes)
    order = sorted(range(len(nodes)), key=lambda i: (key(nodes[i]), i))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in order:
        env[nodes[i]] = graph.node_copy(nodes[i], lambda x: env[x])
    graph.lint()
    return fx.GraphModule(gm, graph)
