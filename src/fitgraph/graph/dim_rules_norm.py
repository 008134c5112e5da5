"""Dimension rules of normalisation layers and losses: statistics decide what can be cut.

Layer norm normalises each row: every leading dim splits, the normalised dims do not. Batch
norm in training normalises each channel over (N, H, W): only channels split — a part of the
batch would compute its own batch statistics, another function. Group norm normalises each
(sample, group): samples split, channels split by whole groups. A loss reduced by its mean is
a mean of per-part means re-weighted by each part's total weight.

Example:
    >>> from fitgraph.graph.ir import Node, Phase, ValueRef
    >>> from fitgraph.graph.dim_rules_norm import native_batch_norm
    >>> n = Node(0, "bn", "aten.native_batch_norm.default",
    ...          (ValueRef(0), ValueRef(1), ValueRef(2), ValueRef(3), ValueRef(4), True, 0.1, 1e-5),
    ...          {}, (0, 1, 2, 3, 4), (5, 6, 7), (), Phase.FORWARD, "")
    >>> [s.outputs[0].dim for s in native_batch_norm(n, [(8, 4, 6, 6)] + [(4,)] * 4, [None] * 3)]
    [1]
"""

from __future__ import annotations

from .dim_types import Along, Reduced, SizeArg, Split, arg_of, per_arg

__all__ = [
    "native_batch_norm", "native_batch_norm_backward", "native_group_norm",
    "native_group_norm_backward", "native_layer_norm", "native_layer_norm_backward",
    "nll_loss", "nll_loss_backward",
]

_TRAIN_NOTE = ("batch and spatial dims are not splittable in training mode: the batch "
               "statistics are over (N, H, W); only channels split")


def _lead(node, ins, shape_arg: int) -> int:
    return len(ins[0]) - len(arg_of(node, shape_arg, "normalized_shape"))


def native_layer_norm(node, ins, outs) -> list[Split]:
    """(x, normalized_shape, weight, bias, eps) -> (out, mean, rstd): leading dims split."""
    return [Split(per_arg(node, {0: Along(i)}), (Along(i), Along(i), Along(i)))
            for i in range(_lead(node, ins, 1)) if ins[0][i] >= 2]


def native_layer_norm_backward(node, ins, outs) -> list[Split]:
    """(grad, x, normalized_shape, mean, rstd, weight, bias, mask) -> (gx, gw, gb).

    The weight and bias gradients are partial sums over the rows where the mask requests them;
    with the input gradient alone (``transform.fission_halo_grads`` separates it) a part runs
    any rows, so a region along the time runs on from a norm's backward into a convolution
    chain's, which gathers rows beyond its own (wav2vec2/HuBERT's feature projection)."""
    mask = arg_of(node, 7, "output_mask")
    outs_kind = tuple(Reduced() if want else None for want in mask[1:3])
    splits = []
    for i in range(_lead(node, ins, 2)):
        if ins[0][i] >= 2:
            ops = per_arg(node, {0: Along(i), 1: Along(i), 3: Along(i), 4: Along(i)})
            splits.append(Split(ops, (Along(i), *outs_kind)))
    return splits


def native_batch_norm(node, ins, outs) -> list[Split]:
    """(x, weight, bias, running_mean, running_var, training, momentum, eps) ->
    (out, save_mean, save_invstd). Training: channels only (see _TRAIN_NOTE). Evaluation: a
    per-channel affine map with the running statistics, split along every dim; its saved
    outputs are empty tensors every part makes alike."""
    x = ins[0]
    c = Along(0)
    splits = []
    if not arg_of(node, 5, "training"):
        for d, size in enumerate(x):
            if size >= 2 and d != 1:
                splits.append(Split(per_arg(node, {0: Along(d)}), (Along(d), None, None),
                                    note="evaluation: per-channel affine, running statistics"))
        if len(x) > 1 and x[1] >= 2:
            ops = per_arg(node, {0: Along(1), 1: c, 2: c, 3: c, 4: c})
            splits.append(Split(ops, (Along(1), None, None)))
        return splits
    if x[1] < 2:
        return []
    ops = per_arg(node, {0: Along(1), 1: c, 2: c, 3: c, 4: c})
    return [Split(ops, (Along(1), c, c), note=_TRAIN_NOTE)]


def native_batch_norm_backward(node, ins, outs) -> list[Split]:
    """(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask)
    -> (gx, gw, gb). Training: channels only (see _TRAIN_NOTE). Evaluation: the input
    gradient is pointwise along every other dim, the weight and bias gradients sum over it."""
    x = ins[0]
    c = Along(0)
    splits = []
    if not arg_of(node, 7, "train"):
        for d, size in enumerate(x):
            if size >= 2 and d != 1:
                ops = per_arg(node, {0: Along(d), 1: Along(d)})
                splits.append(Split(ops, (Along(d), Reduced(), Reduced()),
                                    note="evaluation: weight and bias gradients are partial sums"))
        if len(x) > 1 and x[1] >= 2:
            ops = per_arg(node, {0: Along(1), 1: Along(1), 2: c, 3: c, 4: c})
            splits.append(Split(ops, (Along(1), c, c)))
        return splits
    if x[1] < 2:
        return []
    ops = per_arg(node, {0: Along(1), 1: Along(1), 2: c, 3: c, 4: c, 5: c, 6: c})
    return [Split(ops, (Along(1), c, c), note=_TRAIN_NOTE)]


def native_group_norm(node, ins, outs) -> list[Split]:
    """(x, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd) with mean/rstd [N, G]."""
    n, c, g = ins[0][0], ins[0][1], arg_of(node, 6, "group")
    per = c // g
    splits = []
    if n >= 2:
        splits.append(Split(per_arg(node, {0: Along(0)}), (Along(0),) * 3,
                            sizes=(SizeArg((3,), ("in", 0), 0),)))
    if g >= 2:
        ch = Along(0, per)
        splits.append(Split(per_arg(node, {0: Along(1, per), 1: ch, 2: ch}),
                            (Along(1, per), Along(1), Along(1)),
                            sizes=(SizeArg((4,), ("in", 0), 1), SizeArg((6,), ("in", 0), 1, per)),
                            note="channels split by whole groups"))
    return splits


def native_group_norm_backward(node, ins, outs) -> list[Split]:
    """(grad, x, mean, rstd, weight, N, C, HxW, group, mask) -> (gx, gw, gb)."""
    n, c, g = ins[0][0], ins[0][1], arg_of(node, 8, "group")
    per = c // g
    splits = []
    if n >= 2:
        b = Along(0)
        splits.append(Split(per_arg(node, {0: b, 1: b, 2: b, 3: b}), (b, Reduced(), Reduced()),
                            sizes=(SizeArg((5,), ("in", 0), 0),)))
    if g >= 2:
        ch, x = Along(0, per), Along(1, per)
        ops = per_arg(node, {0: x, 1: x, 2: Along(1), 3: Along(1), 4: ch})
        splits.append(Split(ops, (x, ch, ch),
                            sizes=(SizeArg((6,), ("in", 0), 1), SizeArg((8,), ("in", 0), 1, per)),
                            note="channels split by whole groups"))
    return splits


_LOSS_NOTE = {
    0: "",
    1: "mean reduction: each part's loss is the mean over its own targets; the whole loss is "
       "sum(loss_i * total_weight_i) / sum(total_weight_i) (skip parts whose weight is 0: "
       "their loss is nan)",
    2: "sum reduction: the parts' losses add up",
}


def _loss_outputs(reduction: int, d: int) -> tuple:
    if reduction == 0:
        return (Along(d), Reduced())
    if reduction == 1:
        return (Reduced("weighted_mean", weight=1), Reduced())
    return (Reduced(), Reduced())


def _loss_dims(ins) -> list[tuple[int, int]]:
    """(dim of self, dim of target) pairs: every dim but the class dim 1."""
    self_nd, tgt_nd = len(ins[0]), len(ins[1])
    if self_nd < 2:
        return []
    pairs = [(0, 0)] + [(i, i - 1) for i in range(2, self_nd)]
    return [(s, t) for s, t in pairs if t < tgt_nd and ins[0][s] >= 2]


def nll_loss(node, ins, outs) -> list[Split]:
    """nll_loss_forward / nll_loss2d_forward(self, target, weight, reduction, ignore_index)
    -> (loss, total_weight): split along samples (and pixels)."""
    reduction = arg_of(node, 3, "reduction", 1)
    return [Split(per_arg(node, {0: Along(s), 1: Along(t)}), _loss_outputs(reduction, t),
                  note=_LOSS_NOTE[reduction]) for s, t in _loss_dims(ins)]


def nll_loss_backward(node, ins, outs) -> list[Split]:
    """nll_loss_backward / nll_loss2d_backward(grad, self, target, weight, reduction,
    ignore_index, total_weight): the whole total weight normalises every part."""
    reduction = arg_of(node, 4, "reduction", 1)
    splits = []
    for s, t in _loss_dims(ins[1:]):
        grad = Along(t) if reduction == 0 else None
        splits.append(Split(per_arg(node, {0: grad, 1: Along(s), 2: Along(t)}), (Along(s),)))
    return splits
