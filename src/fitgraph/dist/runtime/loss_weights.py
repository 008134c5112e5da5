"""How much each micro-batch's loss weighs in the whole batch's.

A loss that is a mean over samples weighs every micro-batch alike. A token-level cross
entropy that ignores some labels (``ignore_index``: padding, unmasked tokens of a masked LM)
is a mean over the counted tokens, which micro-batches hold in different numbers: the whole
batch's loss is each micro-batch's weighted by its count, over the whole count. Found in the
traced step: the loss is a mean-reduced ``cross_entropy``/``nll_loss`` whose targets are made
from the batch's tensors alone; those ops are kept as a small graph that gives a micro-batch's
targets, and its weight is how many are not ``ignore_index``.

Example:
    >>> import torch
    >>> w = LossWeights(lambda labels: labels, [0], -100)
    >>> w.of([torch.tensor([[1, -100], [-100, -100]])]).tolist()
    [1]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["LossWeights", "find_loss_weights"]

_MEAN = 1
_LOSSES = {torch.ops.aten.cross_entropy_loss.default: 4, torch.ops.aten.nll_loss.default: 4,
           torch.ops.aten.nll_loss_nd.default: 4}   # op -> position of ignore_index


@dataclass
class LossWeights:
    targets: Callable            # the batch tensors at ``leaves`` -> the loss's targets
    leaves: list[int]            # which of the batch's tensors it reads
    ignore_index: int

    def of(self, tensors: list) -> torch.Tensor:
        """The weight of one micro-batch (``tensors``: all its batch tensors)."""
        t = self.targets(*(tensors[i] for i in self.leaves))
        return (t != self.ignore_index).sum().reshape(1)


def find_loss_weights(body: torch.fx.GraphModule, root_leaf: dict[str, int]) -> tuple[
        LossWeights | None, str]:
    """The weights of the loss the last chunk's ``body`` returns (``root_leaf``: its
    placeholders that are the batch's tensors, by their index), or None and why the
    micro-batches weigh alike."""
    out = next(n for n in body.graph.nodes if n.op == "output")
    loss = out.args[0]
    loss = loss[0] if isinstance(loss, (tuple, list)) and len(loss) == 1 else loss
    if not isinstance(loss, torch.fx.Node) or loss.target not in _LOSSES:
        return None, ""
    schema = loss.target._schema
    args = {a.name: (loss.args[i] if i < len(loss.args) else loss.kwargs.get(a.name,
                                                                             a.default_value))
            for i, a in enumerate(schema.arguments)}
    if args["reduction"] != _MEAN:
        return None, ""
    if args["weight"] is not None:
        return None, ("the loss is a class-weighted mean: its micro-batches are weighed alike, "
                      "which differs from one process's loss on the whole batch")
    target = args["target"]
    needed, order = _ancestors(target)
    if any(n.op == "get_attr" or (n.op == "placeholder" and n.name not in root_leaf)
           or n.op == "call_module" for n in needed):
        return None, ("the loss's targets are not made from the batch alone: its micro-"
                      "batches are weighed alike")
    graph = torch.fx.Graph()
    env: dict = {}
    leaves = []
    for n in order:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
            leaves.append(root_leaf[n.name])
        else:
            env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(env[target])
    return LossWeights(torch.fx.GraphModule(torch.nn.Module(), graph), leaves,
                       int(args["ignore_index"])), ""


def _ancestors(node: torch.fx.Node) -> tuple[set, list]:
    seen: set = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    order = [n for n in node.graph.nodes if n in seen]
    return seen, order
