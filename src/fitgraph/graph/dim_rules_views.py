"""Dimension rules of views and shape ops: which dim of the input each output dim comes from.

A reshape groups dims whose products match (``[B, S, D] -> [B*S, D]``: {B, S} -> {B*S}); the
outermost dim of a group can be cut into contiguous blocks, and a block of the axis may be
several elements on each side: here one unit is 1 row of B and S rows of B*S. Where two dims
merge into one, the inner dim (S) can be cut too: in B*S its part is strided (``outer``).

Example:
    >>> from fitgraph.graph.ir import Node, Phase, ValueRef
    >>> from fitgraph.graph.dim_rules_views import view
    >>> n = Node(0, "view", "aten.view.default", (ValueRef(0), [16, 8]), {}, (0,), (1,), (),
    ...          Phase.FORWARD, "")
    >>> [(s.operands[0].unit, s.outputs[0].unit) for s in view(n, [(2, 8, 8)], [(16, 8)])]
    [(1, 8), (1, 1), (1, 1)]
    >>> view(n, [(2, 8, 8)], [(16, 8)])[1].outputs      # the 8 rows of S in each row of B
    (Along(0, outer=2),)
"""

from __future__ import annotations

from math import lcm, prod

from .dim_types import Along, SizeArg, Split, arg_of, norm_dim

__all__ = ["cat", "expand", "identity_dims", "permute", "select", "select_backward", "slice_",
           "slice_backward", "split", "squeeze", "stack", "t", "transpose", "unbind",
           "unpack_bits", "unsqueeze", "view"]

Shape = tuple[int, ...]


def _mapped(pairs: list[tuple[int, int]], ins, outs, n_out: int = 1) -> list[Split]:
    """Splits for (input dim, output dim) pairs of a one-operand op; every output follows."""
    return [Split((Along(i),), (Along(o),) * n_out) for i, o in pairs if ins[0][i] >= 2]


def _groups(a: Shape, b: Shape) -> list[tuple[list[int], list[int]]]:
    """Dims of ``a`` and ``b`` (size-1 dims left out) grouped by equal products."""
    ia = [i for i, s in enumerate(a) if s != 1]
    ib = [i for i, s in enumerate(b) if s != 1]
    out, i, j = [], 0, 0
    while i < len(ia) and j < len(ib):
        ga, gb = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(ia[i])
                pa *= a[ia[i]]
                i += 1
            else:
                gb.append(ib[j])
                pb *= b[ib[j]]
                j += 1
        out.append((ga, gb))
    return out


def view(node, ins, outs) -> list[Split]:
    """view/_unsafe_view/reshape(x, size): the outermost dims of matching groups, in blocks."""
    a, b = ins[0], outs[0]
    if 0 in a:
        return []
    splits = []
    for ga, gb in _groups(a, b):
        total = prod(a[i] for i in ga)
        ta, tb = total // a[ga[0]], total // b[gb[0]]  # elements per row of each outer dim
        block = lcm(ta, tb)
        if total // block < 2:
            continue
        size = SizeArg((1, gb[0]), ("out", 0), gb[0])
        splits.append(Split((Along(ga[0], block // ta),), (Along(gb[0], block // tb),),
                            sizes=(size,)))
        splits += _inner(a, b, ga, gb)
    return splits


def _inner(a: Shape, b: Shape, ga: list[int], gb: list[int]) -> list[Split]:
    """Two dims merged into one (``[B, T, D] -> [B*T, D]``) or one unmerged into two: a cut
    along the inner dim (T), in every row of the outer (B): the merged side is ``Along`` with
    ``outer=B``. A linear layer's rows are its batch and tokens merged: at batch 2, cut along
    the outer dim only, its tokens would go in two parts at most."""
    if len(ga) == 2 and len(gb) == 1 and a[ga[1]] >= 2:
        return [Split((Along(ga[1]),), (Along(gb[0], outer=a[ga[0]]),),
                      sizes=(SizeArg((1, gb[0]), ("out", 0), gb[0]),), note="inner")]
    if len(ga) == 1 and len(gb) == 2 and b[gb[1]] >= 2:
        return [Split((Along(ga[0], outer=b[gb[0]]),), (Along(gb[1]),),
                      sizes=(SizeArg((1, gb[1]), ("out", 0), gb[1]),), note="inner")]
    return []


def unpack_bits(node, ins, outs) -> list[Split]:
    """fitgraph::unpack_bits(packed, shape): bytes -> bits of ``shape``, element 8i+j in bit j
    of byte i. Packed in rows (``own_ops.packed_shape``: ``shape`` with its last dim / 8), it
    cuts along any dim, the last in whole bytes (8 bits a unit); packed flat, it is a reshape
    whose input holds eight elements a byte: its outermost dim of size > 1 cuts into blocks of
    whole bytes when a row of it is a multiple of 8 elements. Either way a part unpacks its own
    bytes (a dropout mask's bits unpacked per part of a split region).

    Example:
        >>> from fitgraph.graph.ir import Node, Phase, ValueRef
        >>> n = Node(0, "unpack", "fitgraph.unpack_bits.default", (ValueRef(0), [4, 3, 8]), {},
        ...          (0,), (1,), (), Phase.FORWARD, "")
        >>> [(s.operands[0].unit, s.outputs[0].dim) for s in unpack_bits(n, [(12,)], [(4, 3, 8)])]
        [(3, 0)]
        >>> [(s.operands[0].dim, s.outputs[0].unit) for s in
        ...  unpack_bits(n, [(4, 3, 1)], [(4, 3, 8)])]
        [(0, 1), (1, 1)]
    """
    packed, shape = ins[0], outs[0]
    if len(packed) == len(shape) and len(shape) > 1:
        splits = []
        for d, s in enumerate(shape):
            bytes_ = packed[d] if d == len(shape) - 1 else s
            if bytes_ < 2:
                continue
            unit = 8 if d == len(shape) - 1 else 1
            splits.append(Split((Along(d),), (Along(d, unit),),
                                sizes=(SizeArg((1, d), ("out", 0), d),)))
        return splits
    d = next((i for i, s in enumerate(shape) if s != 1), None)
    if d is None or shape[d] < 2:
        return []
    row = prod(shape[d + 1:])
    if row % 8:
        return []
    return [Split((Along(0, row // 8),), (Along(d),), sizes=(SizeArg((1, d), ("out", 0), d),))]


def expand(node, ins, outs) -> list[Split]:
    """expand(x, size): new or size-1 dims are read whole (broadcast) by every part."""
    x, out = ins[0], outs[0]
    sizes = arg_of(node, 1, "size")
    splits = []
    for d, s in enumerate(out):
        if s < 2:
            continue
        k = d - (len(out) - len(x))
        src = Along(k) if k >= 0 and x[k] == s else None
        fix = () if sizes[d] == -1 else (SizeArg((1, d), ("out", 0), d),)
        splits.append(Split((src,), (Along(d),), sizes=fix))
    return splits


def identity_dims(node, ins, outs) -> list[Split]:
    """Ops whose outputs have their input's shape dim for dim (clone, detach, alias)."""
    return _mapped([(i, i) for i in range(len(ins[0]))], ins, outs, len(outs))


def permute(node, ins, outs) -> list[Split]:
    nd = len(ins[0])
    order = [norm_dim(d, nd) for d in arg_of(node, 1, "dims")]
    return _mapped([(i, o) for o, i in enumerate(order)], ins, outs)


def transpose(node, ins, outs) -> list[Split]:
    nd = len(ins[0])
    d0, d1 = norm_dim(arg_of(node, 1, "dim0"), nd), norm_dim(arg_of(node, 2, "dim1"), nd)
    swap = {d0: d1, d1: d0}
    return _mapped([(i, swap.get(i, i)) for i in range(nd)], ins, outs)


def t(node, ins, outs) -> list[Split]:
    nd = len(ins[0])
    return _mapped([(i, nd - 1 - i) for i in range(nd)], ins, outs)


def unsqueeze(node, ins, outs) -> list[Split]:
    d = norm_dim(arg_of(node, 1, "dim"), len(ins[0]) + 1)
    return _mapped([(i, i if i < d else i + 1) for i in range(len(ins[0]))], ins, outs)


def squeeze(node, ins, outs) -> list[Split]:
    """squeeze.dim / squeeze.dims / squeeze.default: size-1 dims go, the others keep order."""
    x = ins[0]
    dims = arg_of(node, 1, "dim", None)
    if dims is None:
        gone = {i for i, s in enumerate(x) if s == 1}
    else:
        dims = [dims] if isinstance(dims, int) else dims
        gone = {norm_dim(d, len(x)) for d in dims if x[norm_dim(d, len(x))] == 1}
    kept = [i for i in range(len(x)) if i not in gone]
    return _mapped([(i, o) for o, i in enumerate(kept)], ins, outs)


def select(node, ins, outs) -> list[Split]:
    """select(x, dim, index): the selected dim goes; the others follow."""
    nd = len(ins[0])
    d = norm_dim(arg_of(node, 1, "dim"), nd)
    return _mapped([(i, i if i < d else i - 1) for i in range(nd) if i != d], ins, outs)


def select_backward(node, ins, outs) -> list[Split]:
    """select_backward(grad, input_sizes, dim, index): the gradient's dims, the selected one
    re-inserted (zeros elsewhere)."""
    out = outs[0]
    d = norm_dim(arg_of(node, 2, "dim"), len(out))
    splits = []
    for o in range(len(out)):
        if o != d and out[o] >= 2:
            i = o if o < d else o - 1
            splits.append(Split((Along(i),), (Along(o),), sizes=(SizeArg((1, o), ("out", 0), o),)))
    return splits


def slice_backward(node, ins, outs) -> list[Split]:
    """slice_backward(grad, input_sizes, dim, start, end, step): the gradient placed in zeros
    of the input's size; every dim but the sliced one follows (HuBERT's positional convolution
    drops its last frame: its backward, along the batch or the channels)."""
    out = outs[0]
    d = norm_dim(arg_of(node, 2, "dim"), len(out))
    return [Split((Along(o),), (Along(o),), sizes=(SizeArg((1, o), ("out", 0), o),))
            for o in range(len(out)) if o != d and out[o] >= 2]


def slice_(node, ins, outs) -> list[Split]:
    """slice(x, dim, start, end, step): every other dim follows; the sliced dim too when the
    slice is the whole dim."""
    x = ins[0]
    d = norm_dim(arg_of(node, 1, "dim", 0), len(x))
    start, end, step = arg_of(node, 2, "start"), arg_of(node, 3, "end"), arg_of(node, 4, "step", 1)
    whole = start in (None, 0) and (end is None or end >= x[d]) and step == 1
    return _mapped([(i, i) for i in range(len(x)) if i != d or whole], ins, outs)


def split(node, ins, outs) -> list[Split]:
    """split.Tensor / split_with_sizes(x, sizes, dim): every output follows the other dims."""
    x = ins[0]
    d = norm_dim(arg_of(node, 2, "dim", 0), len(x))
    return _mapped([(i, i) for i in range(len(x)) if i != d], ins, outs, len(outs))


def unbind(node, ins, outs) -> list[Split]:
    x = ins[0]
    d = norm_dim(arg_of(node, 1, "dim", 0), len(x))
    return _mapped([(i, i if i < d else i - 1) for i in range(len(x)) if i != d], ins, outs,
                   len(outs))


def cat(node, ins, outs) -> list[Split]:
    """cat(tensors, dim): every operand follows the dims other than the joined one; an empty
    1-D operand, which torch's cat skips (a cache's first ``torch.cat([empty, keys])``), is
    read whole by every part."""
    out = outs[0]
    d = norm_dim(arg_of(node, 1, "dim", 0), len(out))
    if any(len(s) != len(out) and tuple(s) != (0,) for s in ins):
        return []
    return [Split(tuple(Along(i) if len(s) == len(out) else None for s in ins), (Along(i),))
            for i in range(len(out)) if i != d and out[i] >= 2]


def stack(node, ins, outs) -> list[Split]:
    """stack(tensors, dim): the new dim is not split; the others follow."""
    out = outs[0]
    d = norm_dim(arg_of(node, 1, "dim", 0), len(out))
    return [Split((Along(i if i < d else i - 1),) * len(ins), (Along(i),))
            for i in range(len(out)) if i != d and out[i] >= 2]
