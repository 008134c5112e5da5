"""Fold the mask predicates that index arithmetic decides: ``m & (q_idx >= 0)`` becomes
``m`` expanded.

Hugging Face builds a bidirectional attention mask from index tensors: the mask function
``q_idx >= 0`` (``arange(T)[:, None] >= 0``: true everywhere) and'ed with the padding mask
read at ``kv_idx`` (a bool ``[B, 1, 1, T]``). The ``&`` broadcasts the two to a bool
``[B, 1, T, T]``, and each block then writes a float ``[B, 1, T, T]`` from it with
``where(mask, 0, -inf)`` (0.5 MiB at B=2, T=256, per block, read again by every block's
attention backward). Eager PyTorch skips all of it where the padding mask is all ones (a
check on the data, which a traced step cannot make).

Here integer ranges are followed from ``arange`` through additions, scalings and views; a
comparison they decide is a constant, and so are ``new_ones``/``full`` booleans and the
``&``/``|``/``~`` of constants. An ``&`` with a true operand (or a ``|`` with a false one) is
its other operand broadcast: it becomes an ``expand`` of it (a view, no bytes), and an
``expand`` of such a view expands what it views. ``elementwise_expands`` then runs each
block's ``where`` on the ``[B, 1, 1, T]`` mask and expands it. The result holds the same
elements (bitwise); a fold is made only where every reader of the tensor, run on meta
tensors, makes the strides it made (a view other than ``expand``, an in-place write or a
graph output keeps the tensor as it was).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.constant_predicates import fold_constant_predicates
    >>> model = torch.nn.Linear(8, 8)
    >>> def loss_fn(m, x):
    ...     keep = x[:, :, 0] > -9.0                                     # [B, T], from data
    ...     rows = torch.arange(8)[:, None] >= 0                         # [T, 1], all true
    ...     mask = torch.where(rows & keep[:, None, :], 0.0, -1e4)       # [B, T, T]
    ...     return (m(x) + mask).softmax(-1).square().sum()
    >>> x = torch.randn(4, 8, 8)
    >>> g = fitgraph.capture(model, x, loss_fn)
    >>> g2 = fold_constant_predicates(g)
    >>> [n.target for n in g2.nodes if n.name.startswith("bitwise_and")]
    ['aten.expand.default']
    >>> bool(execute(g2, fitgraph.eager_plan(g2), model, x) == loss_fn(model, x))
    True
"""

from __future__ import annotations

import operator

from ..graph.analysis import new_storages, verify_graph
from ..graph.ir import Graph, Node, ValueRef
from .elementwise_expands import EXPAND, expanded_strides, strides_kept
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["fold_constant_predicates"]

_INTS = frozenset({"int64", "int32", "int16", "int8", "uint8"})
# NOTE: ops whose output holds only values of their first input (a range stays a bound)
_SAME_VALUES = frozenset(f"aten.{op}" for op in (
    "unsqueeze.default", "squeeze.default", "squeeze.dim", "squeeze.dims", "view.default",
    "_unsafe_view.default", "reshape.default", "expand.default", "permute.default",
    "transpose.int", "t.default", "slice.Tensor", "select.int", "clone.default",
    "alias.default", "detach.default", "lift_fresh_copy.default", "contiguous.default"))
_COMPARE = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}
_AND = frozenset({"aten.bitwise_and.Tensor", "aten.logical_and.default"})
_OR = frozenset({"aten.bitwise_or.Tensor", "aten.logical_or.default"})
_NOT = frozenset({"aten.bitwise_not.default", "aten.logical_not.default"})


def fold_constant_predicates(graph: Graph) -> Graph:
    """A copy of ``graph`` with each ``&`` of a true constant (``|`` of a false one) made an
    expand of its other operand (see the module doc); ``graph`` itself where none is."""
    folds = _folds(graph)
    if not folds:
        return graph
    w = GraphWriter(graph)
    base: dict[int, int] = {}   # new value id of a folded view -> the tensor it views
    for n in graph.nodes:
        src = folds.get(n.id)
        if src is None and n.target == EXPAND and w.whole.get(n.inputs[0]) in base:
            src = n.inputs[0]
        if src is None:
            w.copy_node(n)
            continue
        new_src = w.whole[src]
        new_src = base.get(new_src, new_src)
        out = graph.values[n.outputs[0]]
        small = w.values[new_src]
        stride = expanded_strides(small.shape, small.stride, out.shape)
        view = w.add_node(n.name, EXPAND, (ValueRef(new_src), list(out.shape)), {},
                          [OutSpec(out.name, Meta(out.shape, stride, small.storage_offset),
                                   out.dtype, storage=small.storage, role=out.role)],
                          phase=n.phase, module=n.module, device=w.device_of(new_src))[0]
        w.whole[out.id] = view
        base[view] = new_src
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _folds(graph: Graph) -> dict[int, int]:
    """node id -> the value its output is, broadcast, for the folds whose readers keep their
    strides."""
    consts = _constants(graph)
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(graph.values[v].storage, []).append(n)
    outputs = set(graph.outputs.values())
    fresh = new_storages(graph)
    folds = {}
    for n in graph.nodes:
        if n.id in consts or len(n.outputs) != 1 or n.mutates or len(n.inputs) != 2:
            continue
        keep = True if n.target in _AND else False if n.target in _OR else None
        if keep is None or not all(isinstance(a, ValueRef) for a in n.args[:2]):
            continue
        a, b = (r.id for r in n.args[:2])
        other = b if consts.get(a) is keep else a if consts.get(b) is keep else None
        out = graph.values[n.outputs[0]]
        if other is None or graph.values[other].dtype != out.dtype:
            continue
        o = graph.values[other]
        # NOTE: a fold to the operand's own shape saves nothing
        if len(o.shape) > len(out.shape) or o.numel == out.numel:
            continue
        stride = expanded_strides(o.shape, o.stride, out.shape)
        if _readers_keep(graph, out.id, stride, readers, outputs, fresh):
            folds[n.id] = other
    return folds


def _readers_keep(graph: Graph, vid: int, stride: tuple[int, ...], readers: dict, outputs: set,
                  fresh: dict) -> bool:
    """Whether value ``vid``, strided as ``stride``, is read alike: every node reading its
    storage reads it through ``vid`` or expands of it, writes nothing in place, and is an
    expand or an op that allocates what it makes, with the strides it made; no step output."""
    strides = {vid: stride}   # NOTE: vid and the expands of it -> their strides once folded
    for r in readers.get(graph.values[vid].storage, ()):
        ins = [i for i in r.inputs if graph.values[i].storage == graph.values[vid].storage]
        if r.mutates or any(i not in strides for i in ins):
            return False
        if r.target == EXPAND:
            src, o = graph.values[r.inputs[0]], graph.values[r.outputs[0]]
            strides[o.id] = expanded_strides(src.shape, strides[src.id], o.shape)
        elif not fresh.get(r.id) or len(ins) != 1 or not strides_kept(graph, r, ins[0],
                                                                       strides[ins[0]]):
            return False
    return not strides.keys() & outputs


def _constants(graph: Graph) -> dict[int, bool]:
    """value id -> the bool every element of a constant tensor holds: made by ``new_ones`` and
    the like, or a comparison that integer ranges decide (followed from ``arange`` and numbers
    through additions, scalings and views). A tensor written in place anywhere is none."""
    ranges: dict[int, tuple[int, int]] = {}
    consts: dict[int, bool] = {}
    written = {graph.values[v].storage for n in graph.nodes for v in n.mutates}

    def rng(a):
        if isinstance(a, ValueRef):
            return ranges.get(a.id)
        return (a, a) if isinstance(a, int) and not isinstance(a, bool) else None

    for n in graph.nodes:
        if (len(n.outputs) != 1 or n.outputs[0] is None or n.mutates
                or graph.values[n.outputs[0]].storage in written):
            continue
        out = n.outputs[0]
        dtype = graph.values[out].dtype
        if dtype in _INTS:
            r = _range(n, rng)
            if r is not None:
                ranges[out] = r
        elif dtype == "bool":
            c = _bool(n, rng, consts)
            if c is not None:
                consts[out] = c
    return consts


def _range(n: Node, rng) -> tuple[int, int] | None:
    args, op = n.args, n.target.removeprefix("aten.")
    if op.startswith("arange."):
        nums = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        if len(nums) != len(args) or not nums or "step" in n.kwargs:
            return None
        # NOTE: arange's (end), (start, end), (start, end, step) are range's
        values = range(*nums) if len(nums) <= 3 else range(0)
        return (min(values[0], values[-1]), max(values[0], values[-1])) if values else None
    if n.target in _SAME_VALUES:
        return rng(args[0])
    if op in ("add.Tensor", "sub.Tensor", "add.Scalar", "sub.Scalar") and n.kwargs.get(
            "alpha", 1) == 1:
        x, y = rng(args[0]), rng(args[1]) if len(args) > 1 else None
        if x is None or y is None:
            return None
        return (x[0] + y[0], x[1] + y[1]) if op.startswith("add") else (x[0] - y[1], x[1] - y[0])
    if op in ("mul.Tensor", "mul.Scalar"):
        x, y = rng(args[0]), rng(args[1])
        if x is None or y is None:
            return None
        ends = [p * q for p in x for q in y]
        return min(ends), max(ends)
    return None


def _bool(n: Node, rng, consts: dict[int, bool]) -> bool | None:
    args, op = n.args, n.target.removeprefix("aten.")
    name, _, overload = op.partition(".")
    if name in _COMPARE and overload in ("Scalar", "Tensor"):
        x, y = rng(args[0]), rng(args[1])
        if x is None or y is None:
            return None
        cmp = _COMPARE[name]
        # NOTE: decided where it holds (or fails) for the ends that make it hardest
        if name in ("ge", "gt"):
            return True if cmp(x[0], y[1]) else False if not cmp(x[1], y[0]) else None
        return True if cmp(x[1], y[0]) else False if not cmp(x[0], y[1]) else None
    if op in ("new_ones.default", "ones.default"):
        return True
    if op in ("new_zeros.default", "zeros.default"):
        return False
    if op in ("full.default", "new_full.default"):
        value = args[-1]
        return value if isinstance(value, bool) else None
    if n.target in _SAME_VALUES:
        return consts.get(args[0].id) if isinstance(args[0], ValueRef) else None
    if n.target in _NOT:
        c = consts.get(args[0].id) if isinstance(args[0], ValueRef) else None
        return None if c is None else not c
    if n.target in _AND | _OR:
        cs = [consts.get(a.id) if isinstance(a, ValueRef) else None for a in args[:2]]
        absorbing = n.target in _OR   # NOTE: True absorbs an |, False an &
        if absorbing in cs:
            return absorbing
        if cs[0] is not None and cs[1] is not None:
            return cs[0]
    return None
