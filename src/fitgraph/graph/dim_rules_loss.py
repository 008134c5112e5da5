"""Dimension rules of the pointwise losses ATen computes in one op: ``mse_loss``, ``huber_loss``,
``smooth_l1_loss``, ``soft_margin_loss``, ``binary_cross_entropy`` and their backwards.

Each is elementwise in its input and target (and ``binary_cross_entropy``'s weight, where it
has the input's shape), then reduced: unreduced (``reduction="none"``) every dim splits and the
output follows; summed, the parts' sums add up (``Reduced("sum")``) and the backward reads the
incoming gradient whole. Mean-reduced, a part would divide by its own element count: no split
is offered — ``transform.loss_sums`` rewrites such a loss as its sum divided once, which
splits.

Example:
    >>> from fitgraph.graph.ir import Node, Phase, ValueRef
    >>> from fitgraph.graph.dim_rules_loss import pointwise_loss
    >>> n = Node(0, "mse", "aten.mse_loss.default", (ValueRef(0), ValueRef(1), 2), {}, (0, 1),
    ...          (2,), (), Phase.LOSS, "")
    >>> [(s.operands, s.outputs) for s in pointwise_loss(n, [(4, 3), (4, 3)], [()])]
    [((Along(0), Along(0)), (Reduced('sum'),)), ((Along(1), Along(1)), (Reduced('sum'),))]
"""

from __future__ import annotations

from .dim_types import Along, Reduced, Split, arg_of, per_arg

__all__ = ["LOSSES", "pointwise_loss", "pointwise_loss_backward", "reduction_index"]

NONE, MEAN, SUM = 0, 1, 2
# NOTE: forward op -> backward op; binary_cross_entropy takes its weight before the reduction
LOSSES = {f"aten.{name}.default": f"aten.{name}_backward.default"
          for name in ("mse_loss", "huber_loss", "smooth_l1_loss", "soft_margin_loss",
                       "binary_cross_entropy")}
_WEIGHTED = ("aten.binary_cross_entropy.default", "aten.binary_cross_entropy_backward.default")


def reduction_index(target: str) -> int:
    """The position of ``reduction`` in ``target``'s arguments (forward or backward)."""
    forward = 3 if target in _WEIGHTED else 2
    return forward + (target not in LOSSES)


def _dims(node, shapes: list) -> list[int]:
    """The dims a part may cut: every one of at least two rows, where the operands (input,
    target, a weight) all have the input's shape."""
    shape = shapes[0]
    if any(tuple(s) != tuple(shape) for s in shapes[1:]):
        return []
    return [d for d, size in enumerate(shape) if size >= 2]


def pointwise_loss(node, ins, outs) -> list[Split]:
    """loss(self, target[, weight], reduction, ...) -> loss: unreduced, every dim follows;
    summed, the parts add up; mean-reduced, nothing (module doc)."""
    reduction = arg_of(node, reduction_index(node.target), "reduction", MEAN)
    if reduction == MEAN:
        return []
    return [Split(per_arg(node, {0: Along(d), 1: Along(d), 2: Along(d), "weight": Along(d)}),
                  (Reduced("sum") if reduction == SUM else Along(d),))
            for d in _dims(node, ins)]


def pointwise_loss_backward(node, ins, outs) -> list[Split]:
    """loss_backward(grad, self, target[, weight], reduction, ...) -> grad_input: unreduced,
    the gradient follows every dim; summed, it is read whole (a scalar); mean-reduced, nothing."""
    reduction = arg_of(node, reduction_index(node.target), "reduction", MEAN)
    if reduction == MEAN:
        return []
    splits = []
    for d in _dims(node, ins[1:]):
        grad = Along(d) if reduction == NONE else None
        if grad is not None and tuple(ins[0]) != tuple(ins[1]):
            continue
        entries = per_arg(node, {0: grad, 1: Along(d), 2: Along(d), 3: Along(d),
                                 "weight": Along(d)})
        splits.append(Split(entries, (Along(d),)))
    return splits
