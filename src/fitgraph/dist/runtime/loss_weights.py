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

import operator
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
    micro-batches weigh alike. The loss may be made inside the traced modules (a Hugging Face
    model computing its own loss from ``labels``)."""
    loss, frames = _loss_node(body)
    if loss is None or loss.target not in _LOSSES:
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
    try:
        graph, leaves = _target_graph(args["target"], frames, root_leaf)
    except _NotFromBatch:
        return None, ("the loss's targets are not made from the batch alone: its micro-"
                      "batches are weighed alike")
    return LossWeights(torch.fx.GraphModule(torch.nn.Module(), graph), leaves,
                       int(args["ignore_index"])), ""


class _NotFromBatch(Exception):
    pass


def _loss_node(body) -> tuple[torch.fx.Node | None, list]:
    """The node that makes the value ``body`` returns, followed into the traced modules that
    return it; and the frames it is in: ``(module, its call in the frame before)``."""
    frames = [(body, None)]
    out = next(n for n in body.graph.nodes if n.op == "output")
    node = out.args[0]
    while True:
        if isinstance(node, (tuple, list)):
            if len(node) != 1:
                return None, frames
            node = node[0]
        if not isinstance(node, torch.fx.Node):
            return None, frames
        index = None
        if (node.op == "call_function" and node.target is operator.getitem
                and isinstance(node.args[0], torch.fx.Node)
                and node.args[0].op == "call_module"):
            node, index = node.args[0], node.args[1]
        if node.op != "call_module":
            return node, frames
        sub = frames[-1][0].get_submodule(node.target)
        if not hasattr(sub, "graph"):
            return None, frames
        frames.append((sub, node))
        result = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        node = result[index] if index is not None else result


def _target_graph(target, frames: list, root_leaf: dict[str, int]) -> tuple:
    """A graph of the batch tensors that makes ``target`` (in ``frames[-1]``), crossing the
    traced modules' boundaries; the batch tensors it reads."""
    graph = torch.fx.Graph()
    env: dict = {}
    leaves: list[int] = []
    inputs = [[n for n in m.graph.nodes if n.op == "placeholder"] for m, _ in frames]

    def copy(node, level: int):
        key = (level, node)
        if key in env:
            return env[key]
        if node.op == "placeholder" and level == 0:
            if node.name not in root_leaf:
                raise _NotFromBatch
            made = graph.placeholder(node.name)
            leaves.append(root_leaf[node.name])
        elif node.op == "placeholder":
            call = frames[level][1]
            at = inputs[level].index(node)
            if call.kwargs or at >= len(call.args) or not isinstance(call.args[at],
                                                                       torch.fx.Node):
                raise _NotFromBatch
            made = copy(call.args[at], level - 1)
        elif node.op != "call_function":
            raise _NotFromBatch
        else:
            made = graph.node_copy(node, lambda x: copy(x, level))
        env[key] = made
        return made

    if not isinstance(target, torch.fx.Node):
        raise _NotFromBatch
    graph.output(copy(target, len(frames) - 1))
    return graph, leaves
