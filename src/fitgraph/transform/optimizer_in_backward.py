"""Optimizer-in-backward: update each parameter as soon as its gradient is complete, and free
that gradient at once, instead of keeping every gradient until ``optimizer.step()``.

A captured step with an optimizer holds one update node per parameter (``capture.optimizer``),
placed after the whole backward, and every gradient is a step output (``grad:<name>``) kept to
the end so that ``.grad`` can be written back. That puts all gradients in memory at once. Here
the graph is rewritten into a copy that any planner plans like a captured step:

- nodes are renumbered into an order where each update runs right after its last dependency
  (``graph.deps``: the last write of its gradient, the last read of the weight, the last access
  of its optimizer state), so the captured order is itself optimizer-in-backward;
- the ``grad:<name>`` outputs of updated parameters are removed, so every planner frees a
  gradient after its last use: the update. ``.grad`` is left untouched by the step (None, as
  with torch's ``register_post_accumulate_grad_hook`` recipe), which is why it is opt-in.

The values are bitwise those of ``loss.backward(); optimizer.step()``: the new order is a
topological order of the dependencies, and each update is torch's own single-tensor update.
It is impossible when an update must wait for another parameter's complete gradient (global
gradient-norm clipping reads all gradients before any update); ``why_not`` names that node.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.transform.optimizer_in_backward import optimizer_in_backward, why_not
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> g = fitgraph.capture(model, torch.randn(4, 8), lambda m, b: m(b).square().mean(), opt)
    >>> why_not(g) is None
    True
    >>> oib = optimizer_in_backward(g)
    >>> sorted(k for k in oib.outputs if k.startswith("grad:")), oib.meta["optimizer_in_backward"]
    ([], ['0.weight', '0.bias', '2.weight', '2.bias'])
    >>> [n.name for n in oib.nodes if n.phase.value == "optimizer"]   # last layer first
    ['sgd_2.bias', 'sgd_2.weight', 'sgd_0.bias', 'sgd_0.weight']
"""

from __future__ import annotations

import dataclasses

from ..graph.analysis import verify_graph
from ..graph.deps import dependencies
from ..graph.ir import Graph, Node

__all__ = ["OptimizerInBackwardError", "early_update_order", "optimizer_in_backward",
           "update_nodes", "why_not"]

_UPDATE_PREFIX = "fitgraph.optimizer."
_NAMED = 3  # NOTE: how many parameter names a message lists before "..."


class OptimizerInBackwardError(ValueError):
    """The step cannot update parameters during the backward; the message says which node
    prevents it."""


def update_nodes(graph: Graph) -> list[Node]:
    """The per-parameter optimizer updates of ``graph``, in node order."""
    return [n for n in graph.nodes if n.target.startswith(_UPDATE_PREFIX)]


def _grad_storage(graph: Graph, update: Node) -> int:
    return graph.values[update.args[1].id].storage  # NOTE: args are (param, grad, [state...])


def why_not(graph: Graph, deps: dict[int, set[int]] | None = None) -> str | None:
    """None if every update can run as soon as its own gradient is complete, else why not,
    naming the node that makes an update wait for other parameters' gradients."""
    updates = update_nodes(graph)
    if not updates:
        return ("the step has no optimizer update: capture it with the optimizer "
                "(fitgraph.capture(model, batch, loss_fn, optimizer))")
    deps = dependencies(graph) if deps is None else deps
    bit = {}
    for u in updates:  # NOTE: parameters whose gradients share a storage share one bit
        bit.setdefault(_grad_storage(graph, u), len(bit))
    own = {u.id: 1 << bit[_grad_storage(graph, u)] for u in updates}
    # reach[n]: the gradients (bits) whose storage n or one of its dependencies reads
    reach: dict[int, int] = {}
    for n in graph.nodes:
        r = 0
        for d in deps[n.id]:
            r |= reach[d]
        if n.id not in own:
            for st in {graph.values[v].storage for v in n.inputs} & bit.keys():
                r |= 1 << bit[st]
        reach[n.id] = r
    blocked = next((u for u in updates if reach[u.id] & ~own[u.id]), None)
    if blocked is None:
        return None
    culprit = _culprit(graph, deps, reach, blocked, own[blocked.id])
    names = [u.kwargs["param"] for u in updates if reach[culprit.id] & own[u.id]]
    listed = ", ".join(names[:_NAMED]) + (", ..." if len(names) > _NAMED else "")
    return (f"node {culprit.name} ({culprit.target}, module {culprit.module or '<top>'}) "
            f"combines the gradients of {len(names)} parameters ({listed}) and the update of "
            f"{blocked.kwargs['param']} waits for it: every gradient must be complete before "
            "any update (global gradient-norm clipping does this), so the gradients are kept "
            "until the optimizer phase")


def _culprit(graph: Graph, deps: dict[int, set[int]], reach: dict[int, int], update: Node,
             own: int) -> Node:
    """Among the update's ancestors that read other gradients, the one that reads the most
    (where they are combined, e.g. the stack of per-gradient norms); the earliest on ties."""
    seen, stack = set(), [update.id]
    while stack:
        for d in deps[stack.pop()]:
            if d not in seen:
                seen.add(d)
                stack.append(d)
    foreign = [nid for nid in sorted(seen) if reach[nid] & ~own]
    return graph.nodes[max(foreign, key=lambda nid: (reach[nid].bit_count(), -nid))]


def early_update_order(graph: Graph, deps: dict[int, set[int]] | None = None) -> list[int]:
    """The captured order with each update moved up to right after its last dependency
    (updates that become ready together keep their captured order)."""
    deps = dependencies(graph) if deps is None else deps
    updates = {u.id for u in update_nodes(graph)}
    rest = [n.id for n in graph.nodes if n.id not in updates]
    index = {nid: i for i, nid in enumerate(rest)}
    anchor: dict[int, int] = {}  # update -> index in ``rest`` of the node it follows (-1: none)
    after: dict[int, list[int]] = {}
    for nid in sorted(updates):
        anchor[nid] = max((index[d] if d in index else anchor[d] for d in deps[nid]), default=-1)
        after.setdefault(anchor[nid], []).append(nid)
    order = list(after.get(-1, ()))
    for i, nid in enumerate(rest):
        order.append(nid)
        order.extend(after.get(i, ()))
    return order


def optimizer_in_backward(graph: Graph) -> Graph:
    """A copy of ``graph`` whose captured order updates each parameter right after its gradient
    is complete and whose gradients are not step outputs (freed after their update). Raises
    OptimizerInBackwardError with ``why_not``'s reason when that is impossible.

    ``graph.meta["optimizer_in_backward"]`` lists the parameters whose ``.grad`` the step no
    longer writes. Parameters the optimizer does not update keep their ``grad:`` output.
    """
    deps = dependencies(graph)
    reason = why_not(graph, deps)
    if reason is not None:
        raise OptimizerInBackwardError(f"optimizer-in-backward is impossible: {reason}")
    order = early_update_order(graph, deps)
    new_id = {old: new for new, old in enumerate(order)}
    nodes = [dataclasses.replace(graph.nodes[old], id=new) for new, old in enumerate(order)]
    values = [dataclasses.replace(v, producer=None if v.producer is None else new_id[v.producer])
              for v in graph.values]
    storages = [dataclasses.replace(s) for s in graph.storages]
    updated = [u.kwargs["param"] for u in update_nodes(graph)]
    gone = {f"grad:{name}" for name in updated}
    # NOTE: the gradients stay Role.GRADIENT (reports still show them) but are no longer
    # outputs: a planner frees each one after its last reader, the update
    outputs = {k: v for k, v in graph.outputs.items() if k not in gone}
    meta = {**graph.meta, "optimizer_in_backward": updated}
    out = Graph(nodes, values, storages, list(graph.inputs), list(graph.input_names), outputs,
                meta)
    verify_graph(out)
    return out
