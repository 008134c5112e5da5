"""Run a convolution that reads a concatenation once per operand, forward and backward.

``y = conv(cat([x1, ..., xn], dim=1), W)`` is the fusion layer of feature pyramids (SegFormer's
decode head: four scales upsampled, concatenated, a 1x1 convolution), U-Net decoders (a skip
connection concatenated to the upsampled path, a 3x3 convolution) and DenseNets. The forward
makes the whole concatenation beside its operands; the backward
``convolution_backward(g, cat, W)`` reads it again to make the weight gradient, and makes the
whole input gradient, which the concatenation's backward then only slices back into its
operands' gradients. At SegFormer's least peak these are the largest items (2 MiB each, with the
operands). A convolution with ``groups=1`` is a sum over its input channels, so each operand's
share is a convolution of its own, with the weight's columns ``sk`` of that operand:

- forward: ``y = conv(x1, W[:, s1], b) + conv(x2, W[:, s2]) + ...`` (out-of-place adds, so
  that ``y`` stays recomputable);
- backward, per operand ``k``: ``convolution_backward(g, xk, W[:, sk])`` makes exactly operand
  ``k``'s input gradient and columns ``sk`` of the weight gradient (concatenated back along
  dim 1; the bias gradient from the first).

A concatenation that every reader now reads per operand is no longer made. Results: the same
sums over the same elements, grouped by the kernel per call (allclose, not promised bitwise):
used where fission is (``split_backward``).

A convolution or its backward qualifies where its input is a ``cat`` along dim 1 of same-dtype
operands of its rank, not transposed, with one group (each part's output laid out like the
whole op's, as fission's parts are); a backward where its input gradient (if made) is read only by
``slice`` nodes along dim 1 that each take exactly one operand's channels (as autograd spells
the concatenation's backward), none written in place, and each of their readers makes, on meta
tensors, the layouts the graph records when it reads the operand's own gradient.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.per_operand_convolution import convolutions_per_operand
    >>> class Fuse(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(3, 4, 1)
    ...         self.fuse = torch.nn.Conv2d(8, 4, 3, padding=1)
    ...     def forward(self, x):
    ...         return self.fuse(torch.cat([self.a(x).relu(), self.b(x).relu()], 1))
    >>> model, x = Fuse(), torch.randn(2, 3, 8, 8)
    >>> loss_fn = lambda m, b: m(b).square().mean()
    >>> g = fitgraph.capture(model, x, loss_fn)
    >>> g2 = convolutions_per_operand(g)
    >>> sorted(n.name for n in g2.nodes if n.target == "aten.convolution_backward.default"
    ...        and n.module == "fuse")
    ['convolution_backward.part0', 'convolution_backward.part1']
    >>> torch.allclose(execute(g2, fitgraph.eager_plan(g2), model, x), loss_fn(model, x))
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph.analysis import flatten_refs, users, verify_graph
from ..graph.ir import Graph, Node, ValueRef
from .elementwise_expands import strides_kept
from .fission_meta import Meta, dense_like, narrow
from .fission_writer import GraphWriter, OutSpec

__all__ = ["CatConvolutions", "convolutions_per_operand", "find_convolutions_per_operand"]

CAT = "aten.cat.default"
CONVOLUTION = "aten.convolution.default"
CONV_BACKWARD = "aten.convolution_backward.default"
SLICE = "aten.slice.Tensor"
ADD = "aten.add.Tensor"
CHANNELS = 1


@dataclass(frozen=True)
class _Operands:
    """A concatenation's operands (value ids) and their channel offsets and counts."""

    values: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class _Backward:
    """How one convolution backward runs per operand: the slice nodes that take each operand's
    gradient (none: not read) and the layout of each part's input gradient (None: not made)."""

    operands: _Operands
    slices: tuple[tuple[int, ...], ...]
    grad_metas: tuple[Meta | None, ...]


@dataclass(frozen=True)
class CatConvolutions:
    """A concatenation along the channels that only convolutions read (forward and backward),
    each of which can run per operand: rewritten, the concatenation is not made.
    ``bytes_saved``: its bytes (the forward keeps it for the weight gradient)."""

    cat: int
    convolutions: tuple[int, ...]
    bytes_saved: int
    flops_saved: float = 0.0


def find_convolutions_per_operand(graph: Graph) -> list[CatConvolutions]:
    """Every concatenation that ``convolutions_per_operand`` no longer makes, with the
    convolutions that read it (the rule's matches: ``transform.rules``)."""
    scan = _scan(graph)
    return [CatConvolutions(n.id, tuple(scan.readers[n.outputs[0]]),
                            graph.storages[graph.values[n.outputs[0]].storage].nbytes)
            for n in _unmade_cats(graph, scan, _per_operand(graph, scan))]


def convolutions_per_operand(graph: Graph,
                             matches: list[CatConvolutions] | None = None) -> Graph:
    """A copy of ``graph`` where each convolution (forward or backward) that reads a
    concatenation runs once per operand (or those reading the concatenations of ``matches``,
    some of ``find_convolutions_per_operand``'s), and a concatenation no longer read is not
    made (see the module doc); ``graph`` itself where none qualifies."""
    scan = _scan(graph)
    found = _per_operand(graph, scan)
    if matches is not None:
        chosen = {c for m in matches for c in m.convolutions}
        found = {k: p for k, p in found.items() if k in chosen}
    if not found:
        return graph
    skipped = {s for p in found.values() if isinstance(p, _Backward)
               for group in p.slices for s in group}
    skipped |= {n.id for n in _unmade_cats(graph, scan, found)}
    w = GraphWriter(graph)
    for n in graph.nodes:
        p = found.get(n.id)
        if isinstance(p, _Backward):
            _write_backward(w, graph, n, p)
        elif p is not None:
            _write_forward(w, graph, n, p)
        elif n.id not in skipped:
            w.copy_node(n)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


@dataclass(frozen=True)
class _Scan:
    """What the checks read of a graph: each value's readers, the storages some node writes in
    place, the step's outputs."""

    readers: dict[int, list[int]]
    written: set[int]
    outputs: set[int]


def _scan(graph: Graph) -> _Scan:
    return _Scan(users(graph), {graph.values[v].storage for n in graph.nodes for v in n.mutates},
                 set(graph.outputs.values()))


def _per_operand(graph: Graph, scan: _Scan) -> dict[int, _Operands | _Backward]:
    """Each convolution (forward or backward) that can run per operand, with how."""
    found: dict[int, _Operands | _Backward] = {}
    for n in graph.nodes:
        if n.target == CONVOLUTION:
            p = _forward(graph, n, scan.written, scan.outputs)
        elif n.target == CONV_BACKWARD:
            p = _backward(graph, n, scan.readers, scan.written, scan.outputs)
        else:
            continue
        if p is not None:
            found[n.id] = p
    return found


def _unmade_cats(graph: Graph, scan: _Scan,
                 found: dict[int, _Operands | _Backward]) -> list[Node]:
    """The concatenations that every reader of which, in ``found``, reads per operand."""
    cats = []
    for n in graph.nodes:
        out = n.outputs[0] if n.target == CAT else None
        if (out is not None and out not in scan.outputs
                and graph.values[out].storage not in scan.written
                and all(r in found and flatten_refs((graph.nodes[r].args,
                                                       graph.nodes[r].kwargs)).count(out) == 1
                        for r in scan.readers[out])):
            # NOTE: read per operand by every reader, and by none as another of its operands
            cats.append(n)
    return cats


def _ref(arg) -> int | None:
    return arg.id if isinstance(arg, ValueRef) else None


def _operands(graph: Graph, n: Node) -> _Operands | None:
    """The operands of the concatenation convolution ``n`` (or its backward) reads as its input,
    where ``n`` can run per operand (None: it cannot)."""
    args = n.args
    transposed, groups = (args[6], args[8]) if n.target == CONVOLUTION else (args[7], args[9])
    if transposed or groups != 1 or n.mutates or n.kwargs:
        return None
    x = _ref(args[0] if n.target == CONVOLUTION else args[1])
    if x is None or graph.values[x].producer is None:
        return None
    cat = graph.nodes[graph.values[x].producer]
    xv = graph.values[x]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if cat.target != CAT or not isinstance(dim, int) or dim % len(xv.shape) != CHANNELS:
        return None
    values = [_ref(a) for a in cat.args[0]]
    if (len(values) < 2 or None in values
            or any(len(graph.values[o].shape) != len(xv.shape)
                   or graph.values[o].dtype != xv.dtype for o in values)):
        return None
    sizes = [graph.values[o].shape[CHANNELS] for o in values]
    return _Operands(tuple(values), tuple(sum(sizes[:k]) for k in range(len(sizes))),
                     tuple(sizes))


def _forward(graph: Graph, n: Node, written: set[int], outputs: set[int]) -> _Operands | None:
    """The operands convolution ``n`` runs per (None: it does not qualify)."""
    if len(n.args) != 9:
        return None
    ops = _operands(graph, n)
    y = graph.values[n.outputs[0]]
    if ops is None or y.id in outputs or y.storage in written:
        return None
    return ops


def _backward(graph: Graph, n: Node, readers: dict[int, list[int]], written: set[int],
              outputs: set[int]) -> _Backward | None:
    """How backward ``n`` runs per operand (None: it does not qualify)."""
    if len(n.args) != 11:
        return None
    ops = _operands(graph, n)
    if ops is None:
        return None
    slices: list[list[int]] = [[] for _ in ops.values]
    mask = list(n.args[10])
    gi = n.outputs[0] if mask[0] else None
    if gi is not None:
        if gi in outputs or graph.values[gi].storage in written:
            return None
        for r in readers[gi]:
            k = _operand_slice(graph, graph.nodes[r], gi, ops)
            if k is None:
                return None
            slices[k].append(r)
    # NOTE: a part's fresh output is laid out like the whole op's (fission's rule,
    # ``fission_meta.dense_like``); meta kernels are not asked: on the CPU a channels-last
    # input makes a channels-last output, where the meta kernel makes a contiguous one
    metas: list[Meta | None] = []
    for group, size in zip(slices, ops.sizes):
        shape = _with_channels(graph.values[gi].shape, size) if group else ()
        metas.append(Meta(shape, dense_like(shape, graph.values[gi].stride), 0) if group
                     else None)
    for k, group in enumerate(slices):
        for s in group:
            out = graph.nodes[s].outputs[0]
            if not all(strides_kept(graph, graph.nodes[r], out, metas[k].stride)
                       for r in readers[out]):
                return None
    gw = n.outputs[1] if mask[1] else None
    # NOTE: the weight gradient is concatenated back, a dense tensor: a step output must be
    # recorded dense, and its readers (the copy into ``.grad``) must make from it what they
    # made from the kernel's
    if gw is not None:
        dense = dense_like(graph.values[gw].shape, graph.values[gw].stride)
        if ((gw in outputs and graph.values[gw].stride != dense)
                or not all(strides_kept(graph, graph.nodes[r], gw, dense)
                           for r in readers[gw])):
            return None
    return _Backward(ops, tuple(tuple(s) for s in slices), tuple(metas))


def _operand_slice(graph: Graph, r: Node, gi: int, ops: _Operands) -> int | None:
    """The operand whose channels slice node ``r`` takes from input gradient ``gi`` (None: ``r``
    is not such a slice, or is written in place)."""
    if r.target != SLICE or r.mutates or r.kwargs or _ref(r.args[0]) != gi:
        return None
    rank = len(graph.values[gi].shape)
    full = graph.values[gi].shape[CHANNELS]
    dim, start, end, step = (list(r.args[1:]) + [0, None, None, 1][len(r.args) - 1:])[:4]
    if not isinstance(dim, int) or dim % rank != CHANNELS or step != 1:
        return None
    start = 0 if start is None else start + full if start < 0 else start
    end = full if end is None else min(end + full if end < 0 else end, full)
    for k, (off, size) in enumerate(zip(ops.offsets, ops.sizes)):
        if (start, end) == (off, off + size):
            return k
    return None


def _with_channels(shape: tuple[int, ...], channels: int) -> tuple[int, ...]:
    return shape[:CHANNELS] + (channels,) + shape[CHANNELS + 1:]


def _weight_part(w: GraphWriter, n: Node, weight: int, k: int, ops: _Operands) -> int:
    """A view of the weight's input channels of operand ``k``."""
    wv = w.values[weight]
    off, size = ops.offsets[k], ops.sizes[k]
    return w.add_node(f"{n.name}.weight{k}", SLICE, (ValueRef(weight), CHANNELS, off, off + size),
                      {}, [OutSpec(f"{wv.name}.part{k}", narrow(w.meta(weight), CHANNELS, off,
                                                                size),
                                   wv.dtype, storage=wv.storage, role=wv.role)],
                      device=w.device_of(weight), phase=n.phase, module=n.module)[0]


def _write_forward(w: GraphWriter, graph: Graph, n: Node, ops: _Operands) -> None:
    """Write convolution ``n`` as one per operand, summed (the bias added by the first)."""
    kw = dict(phase=n.phase, module=n.module, device=w.device_of(w.whole[n.args[1].id]))
    y = graph.values[n.outputs[0]]
    meta = Meta(y.shape, y.stride, 0)
    total, acc = sum(ops.sizes), None
    for k, (o, size) in enumerate(zip(ops.values, ops.sizes)):
        view = _weight_part(w, n, w.whole[n.args[1].id], k, ops)
        bias = w.remapped((n.args[2],), {})[0][0] if k == 0 else None
        part = w.add_node(f"{n.name}.part{k}", CONVOLUTION,
                          (ValueRef(w.whole[o]), ValueRef(view), bias, *n.args[3:9]), {},
                          [OutSpec(f"{y.name}.part{k}", meta, y.dtype, role=y.role)],
                          flops=n.flops * size / total, **kw)[0]
        if acc is None:
            acc = part
            continue
        last = k == len(ops.values) - 1
        acc = w.add_node(f"{n.name}.sum{k}", ADD, (ValueRef(acc), ValueRef(part)), {},
                         [OutSpec(y.name if last else f"{y.name}.sum{k}", meta, y.dtype,
                                  storage=w.mapped_storage(y.storage) if last else None,
                                  role=y.role)], flops=y.numel, **kw)[0]
    w.whole[y.id] = acc


def _write_backward(w: GraphWriter, graph: Graph, n: Node, p: _Backward) -> None:
    """Write backward ``n`` as one backward per operand, its weight gradient concatenated."""
    kw = dict(phase=n.phase, module=n.module)
    mask = list(n.args[10])
    weight = w.whole[n.args[2].id]
    device = w.device_of(weight)
    gw_parts, gb = [], None
    ops = p.operands
    total = sum(ops.sizes)
    for k, (o, size) in enumerate(zip(ops.values, ops.sizes)):
        view = _weight_part(w, n, weight, k, ops)
        outs: list[OutSpec | None] = [None, None, None]
        if p.grad_metas[k] is not None:
            gi = graph.values[n.outputs[0]]
            outs[0] = OutSpec(f"{gi.name}.part{k}", p.grad_metas[k], gi.dtype, role=gi.role)
        if mask[1]:
            gw = graph.values[n.outputs[1]]
            shape = list(gw.shape)
            shape[CHANNELS] = size
            outs[1] = OutSpec(f"{gw.name}.part{k}",
                              Meta(tuple(shape), dense_like(tuple(shape), gw.stride), 0),
                              gw.dtype, role=gw.role)
        if mask[2] and k == 0:
            b = graph.values[n.outputs[2]]
            outs[2] = OutSpec(b.name, Meta(b.shape, b.stride, b.storage_offset), b.dtype,
                              storage=w.mapped_storage(b.storage), role=b.role)
        part_mask = [outs[0] is not None, outs[1] is not None, outs[2] is not None]
        args = (ValueRef(w.whole[n.args[0].id]), ValueRef(w.whole[o]), ValueRef(view),
                *n.args[3:10], part_mask)
        made = w.add_node(f"{n.name}.part{k}", CONV_BACKWARD, args, {}, outs, device=device,
                          flops=n.flops * size / total, out_is_tuple=True, **kw)
        for s in p.slices[k]:
            w.whole[graph.nodes[s].outputs[0]] = made[0]
        if made[1] is not None:
            gw_parts.append(made[1])
        if made[2] is not None:
            gb = made[2]
    if mask[1]:
        gw = graph.values[n.outputs[1]]
        w.whole[gw.id] = w.add_node(
            f"{n.name}.weight_grad", CAT, ([ValueRef(v) for v in gw_parts], CHANNELS), {},
            [OutSpec(gw.name, Meta(gw.shape, dense_like(gw.shape, gw.stride), 0), gw.dtype,
                     storage=w.mapped_storage(gw.storage), role=gw.role)],
            device=device, **kw)[0]
    if gb is not None:
        w.whole[n.outputs[2]] = gb
