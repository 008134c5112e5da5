"""Dimension rules of elementwise ops, reductions and softmax.

A rule is ``rule(node, ins, outs) -> list[Split]``: ``ins`` are the shapes of the node's tensor
operands (``dims.operands`` order), ``outs`` the shapes of its outputs (None: not a tensor).
It lists every way the node can run in parts; a dim of size 1 is never offered (nothing to cut).

Example:
    >>> from fitgraph.graph.ir import Node, Phase, ValueRef
    >>> from fitgraph.graph.dim_rules_pointwise import elementwise
    >>> n = Node(0, "add", "aten.add.Tensor", (ValueRef(0), ValueRef(1)), {}, (0, 1), (2,), (),
    ...          Phase.FORWARD, "")
    >>> [s.operands for s in elementwise(n, [(2, 3, 4), (3, 1)], [(2, 3, 4)])]  # broadcasting
    [(Along(0), None), (Along(1), Along(0)), (Along(2), None)]
"""

from __future__ import annotations

from .dim_types import Along, Reduced, Split, arg_of, norm_dim

__all__ = ["elementwise", "log_softmax_like", "mean_dim", "moments", "softmax_backward", "sum_dim"]

Shape = tuple[int, ...]


def _broadcast_entry(shape: Shape, out_ndim: int, d: int, size: int) -> Along | None:
    """The dim of a broadcast operand that follows output dim ``d`` (None: broadcast over it)."""
    k = d - (out_ndim - len(shape))
    # NOTE: an operand of size 1 along d is read whole by every part (broadcasting)
    return Along(k) if k >= 0 and shape[k] == size else None


def elementwise(node, ins: list[Shape], outs: list[Shape | None]) -> list[Split]:
    """Unary/binary/ternary ops with broadcasting (add, mul, where, gelu, relu, clone, ...):
    every output dim is splittable; operands follow it or are broadcast (whole)."""
    out = outs[0]
    splits = []
    for d, size in enumerate(out):
        if size < 2:
            continue
        ops = tuple(_broadcast_entry(s, len(out), d, size) for s in ins)
        splits.append(Split(ops, (Along(d),) + (None,) * (len(outs) - 1)))
    return splits


def _reduced_dims(node, ndim: int) -> set[int]:
    dims = arg_of(node, 1, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(ndim))  # NOTE: aten's dim=None / dim=[] reduce over everything
    if isinstance(dims, int):
        dims = [dims]
    return {norm_dim(d, ndim) for d in dims}


def _reduction(node, ins, outs, reduced_ok: bool) -> list[Split]:
    shape = ins[0]
    red = _reduced_dims(node, len(shape))
    keep = bool(arg_of(node, 2, "keepdim", False))
    splits = []
    for i, size in enumerate(shape):
        if size < 2:
            continue
        if i in red:
            if reduced_ok:
                splits.append(Split((Along(i),), (Reduced(),),
                                    note="partial sums over the split dim add up"))
            continue
        o = i if keep else i - sum(1 for r in red if r < i)
        splits.append(Split((Along(i),), (Along(o),)))
    return splits


def sum_dim(node, ins, outs) -> list[Split]:
    """sum over dims: kept dims follow; a split along a summed dim makes partial sums."""
    return _reduction(node, ins, outs, reduced_ok=True)


def mean_dim(node, ins, outs) -> list[Split]:
    """mean over dims: kept dims follow.

    NOTE: a split along an averaged dim is not offered: parts of unequal length would need
    re-weighting by their lengths (use sum + a scale if that is ever wanted)."""
    return _reduction(node, ins, outs, reduced_ok=False)


def moments(node, ins, outs) -> list[Split]:
    """var/std/var_mean/std_mean(x, dim, *, correction, keepdim) over dims: the kept dims
    follow, every output alike (a variance over a split dim is no sum of the parts')."""
    shape = ins[0]
    red = _reduced_dims(node, len(shape))
    # NOTE: the ``.correction`` overloads take keepdim by keyword only (``arg_of``'s position
    # 2 would be another overload's ``unbiased``)
    keep = bool(node.kwargs.get("keepdim", False))
    splits = []
    for i, size in enumerate(shape):
        if size >= 2 and i not in red:
            o = i if keep else i - sum(1 for r in red if r < i)
            splits.append(Split((Along(i),), (Along(o),) * len(outs)))
    return splits


def log_softmax_like(node, ins, outs) -> list[Split]:
    """_softmax/_log_softmax/_safe_softmax(x, dim, ...): every dim but the normalised one."""
    shape = ins[0]
    dim = norm_dim(arg_of(node, 1, "dim"), len(shape))
    return [Split((Along(i),), (Along(i),)) for i, s in enumerate(shape) if i != dim and s >= 2]


def softmax_backward(node, ins, outs) -> list[Split]:
    """_softmax_backward_data/_log_softmax_backward_data(grad, out, dim, dtype)."""
    shape = ins[0]
    dim = norm_dim(arg_of(node, 2, "dim"), len(shape))
    return [Split((Along(i), Along(i)), (Along(i),))
            for i, s in enumerate(shape) if i != dim and s >= 2]
