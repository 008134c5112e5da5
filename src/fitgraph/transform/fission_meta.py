"""Tensor layouts of fission parts, computed like ATen does, without torch.

A part of a fissioned node reads slices and writes smaller outputs; the IR must know each part
value's shape, strides and storage offset exactly (the simulator counts its storage, the
profiler measures the op on these layouts). Fresh outputs are dense in the stride order of the
whole op's output; views follow ATen's own rules (``computeStride`` for ``view``,
``inferExpandGeometry`` for ``expand``, ...). A view ATen could not make (a ``view`` of a
non-contiguous slice) is reported as None: the part then reshapes with a copy.

Example:
    >>> from fitgraph.transform.fission_meta import Meta, narrow, view_meta
    >>> x = Meta((4, 6), (6, 1), 0)
    >>> narrow(x, 1, 2, 3)                       # a column slice: same strides, shifted
    Meta(shape=(4, 3), stride=(6, 1), offset=2)
    >>> view_meta("aten.view.default", (None, [12]), [narrow(x, 1, 2, 3)]) is None
    True
    >>> view_meta("aten.t.default", (None,), [x])
    Meta(shape=(6, 4), stride=(1, 6), offset=0)
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

__all__ = ["VIEW_TARGETS", "Meta", "dense_like", "is_dense", "narrow", "view_meta"]


class Meta(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def narrow(m: Meta, dim: int, start: int, length: int) -> Meta:
    """``m.narrow(dim, start, length)``."""
    shape = list(m.shape)
    shape[dim] = length
    return Meta(tuple(shape), m.stride, m.offset + start * m.stride[dim])


def is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a tensor laid out so covers its elements without gaps or overlaps, in any order
    of its dims (a clone keeps such strides; an elementwise op's output takes them)."""
    dims = sorted((s, n) for s, n in zip(stride, shape) if n != 1)
    expected = 1
    for st, size in dims:
        if st != expected:
            return False
        expected *= size
    return True


def dense_like(shape: tuple[int, ...], like: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides for ``shape`` in the memory order of strides ``like`` (largest first; ties
    keep dim order): a part's fresh output is laid out like the whole op's output."""
    order = sorted(range(len(shape)), key=lambda d: (-like[d], d))
    stride = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _infer_size(size, numel: int) -> list[int]:
    size = list(size)
    if -1 in size:
        i = size.index(-1)
        rest = prod(s for j, s in enumerate(size) if j != i)
        size[i] = numel // rest if rest else 0
    return size


def compute_stride(old_shape, old_stride, new_shape) -> tuple[int, ...] | None:
    """ATen's ``computeStride``: strides viewing ``old`` as ``new_shape``, None if impossible."""
    if not old_shape:
        return tuple(1 for _ in new_shape)
    if prod(old_shape) == 0:
        return tuple(1 for _ in new_shape)  # NOTE: never reached: parts are never empty
    new_stride = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = old_stride[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[tensor_d]
        if tensor_d == 0 or (old_shape[tensor_d - 1] != 1
                             and old_stride[tensor_d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base = old_stride[tensor_d - 1]
                tensor_numel = view_numel = 1
    if view_d != -1:
        return None
    return tuple(new_stride)


def _view(args, x: Meta) -> Meta | None:
    size = _infer_size(args[1], prod(x.shape))
    st = compute_stride(x.shape, x.stride, size)
    return None if st is None else Meta(tuple(size), st, x.offset)


def _expand(args, x: Meta) -> Meta:
    sizes = list(args[1])
    n, nx = len(sizes), len(x.shape)
    out_shape, out_stride = [0] * n, [0] * n
    for i in range(n - 1, -1, -1):
        d = nx - (n - i)
        size = x.shape[d] if d >= 0 else 1
        stride = x.stride[d] if d >= 0 else (out_shape[i + 1] * out_stride[i + 1] if i + 1 < n
                                             else 1)
        target = size if sizes[i] == -1 else sizes[i]
        if size != target:
            size, stride = target, 0
        out_shape[i], out_stride[i] = size, stride
    return Meta(tuple(out_shape), tuple(out_stride), x.offset)


def _permute(x: Meta, order) -> Meta:
    return Meta(tuple(x.shape[d] for d in order), tuple(x.stride[d] for d in order), x.offset)


def _transpose(args, x: Meta) -> Meta:
    n = len(x.shape)
    a, b = _norm(args[1], n), _norm(args[2], n)
    order = list(range(n))
    order[a], order[b] = b, a
    return _permute(x, order)


def _squeeze(args, x: Meta) -> Meta:
    n = len(x.shape)
    dims = args[1] if len(args) > 1 else None
    if dims is None:
        gone = {d for d in range(n) if x.shape[d] == 1}
    else:
        dims = [dims] if isinstance(dims, int) else dims
        gone = {_norm(d, n) for d in dims if x.shape[_norm(d, n)] == 1}
    keep = [d for d in range(n) if d not in gone]
    return _permute(x, keep)


def _unsqueeze(args, x: Meta) -> Meta:
    n = len(x.shape)
    d = _norm(args[1], n + 1)
    stride = 1 if d >= n else x.shape[d] * x.stride[d]
    return Meta(x.shape[:d] + (1,) + x.shape[d:], x.stride[:d] + (stride,) + x.stride[d:],
                x.offset)


def _select(args, x: Meta) -> Meta:
    n = len(x.shape)
    d = _norm(args[1], n)
    i = args[2] + x.shape[d] if args[2] < 0 else args[2]
    return Meta(x.shape[:d] + x.shape[d + 1:], x.stride[:d] + x.stride[d + 1:],
                x.offset + i * x.stride[d])


def _slice(args, x: Meta) -> Meta:
    n = len(x.shape)
    d = _norm(args[1] if len(args) > 1 else 0, n)
    size = x.shape[d]
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = args[3] if len(args) > 3 and args[3] is not None else size
    step = args[4] if len(args) > 4 else 1
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    m = narrow(x, d, start, (end - start + step - 1) // step)
    stride = list(m.stride)
    stride[d] *= step
    return Meta(m.shape, tuple(stride), m.offset)


def _split(args, x: Meta, index: int, sizes=None) -> Meta:
    n = len(x.shape)
    d = _norm(args[2] if len(args) > 2 else 0, n)
    if sizes is None:
        each = args[1]
        sizes = [min(each, x.shape[d] - s) for s in range(0, x.shape[d], each)]
    start = sum(sizes[:index])
    return narrow(x, d, start, sizes[index])


def _unbind(args, x: Meta, index: int) -> Meta:
    d = _norm(args[1] if len(args) > 1 else 0, len(x.shape))
    return _select((None, d, index), x)


VIEW_TARGETS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.expand.default", "aten.permute.default", "aten.transpose.int", "aten.t.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
    "aten.select.int", "aten.slice.Tensor", "aten.split.Tensor",
    "aten.split_with_sizes.default", "aten.unbind.int", "aten.alias.default",
    "aten.detach.default",
})


def view_meta(target: str, args: tuple, ins: list[Meta], index: int = 0) -> Meta | None:
    """The layout of output ``index`` of view op ``target`` (args as the node's, with its
    tensor input's layout ``ins[0]``); None when ATen could not make it a view."""
    x = ins[0]
    if target in ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
        return _view(args, x)
    if target == "aten.expand.default":
        return _expand(args, x)
    if target == "aten.permute.default":
        return _permute(x, [_norm(d, len(x.shape)) for d in args[1]])
    if target == "aten.transpose.int":
        return _transpose(args, x)
    if target == "aten.t.default":
        return _permute(x, list(range(len(x.shape)))[::-1])
    if target == "aten.unsqueeze.default":
        return _unsqueeze(args, x)
    if target.startswith("aten.squeeze."):
        return _squeeze(args, x)
    if target == "aten.select.int":
        return _select(args, x)
    if target == "aten.slice.Tensor":
        return _slice(args, x)
    if target == "aten.split.Tensor":
        return _split(args, x, index)
    if target == "aten.split_with_sizes.default":
        return _split(args, x, index, list(args[1]))
    if target == "aten.unbind.int":
        return _unbind(args, x, index)
    if target in ("aten.alias.default", "aten.detach.default"):
        return x
    raise KeyError(f"no layout rule for the view op {target}: add one to "
                   "fitgraph/transform/fission_meta.py")
