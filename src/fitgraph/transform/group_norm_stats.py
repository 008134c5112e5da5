"""Run a group norm from its statistics, so that fission can cut its input along the time.

``native_group_norm`` makes the mean and 1/std of each (sample, group) over the group's
channels and every position, then normalises; its backward sums over them again. Their dim
rules (``dim_rules_norm``) offer samples and whole groups only, so a region along the time or
space stops there: wav2vec2 and HuBERT normalise their first convolution layer's output
([batch, 512, T/5], a group per channel), the largest tensors of their step, and their least
peak sat at its backward. Here both are written as ops that split along every position:

- forward: ``var, mean = var_mean(x.view(N, G, -1))``, ``rstd = rsqrt(var + eps)``, and
  ``y = addcmul(shift, x, scale)`` with ``scale = rstd * weight`` and ``shift = bias - mean *
  scale`` per (sample, channel). Re-made in the backward (``recompute_copies``), ``y`` reads
  the saved statistics, so a region re-makes the layer from its input, part by part.
- backward, ATen's own formula (``aten/src/ATen/native/cpu/group_norm_kernel.cpp``): per
  (sample, channel) ``ds = sum(dy * x)`` and ``db = sum(dy)`` over the positions (partial sums
  along a cut), the weight and bias gradients from them, and ``dx = rstd * weight * dy + c2 *
  x + c3`` with ``c2, c3`` per (sample, group) from the sums.
- where ``dx`` is read only by a convolution's backward that makes its weight (and bias)
  gradients, not its input's (the first layer: the audio needs no gradient), those are linear
  in ``dx`` and are made as ``conv_bw(rstd * weight * dy) + conv_bw(c2 * x + c3)``: the first
  term runs in the same parts as the sums, the second from ``x`` alone once the sums are known,
  and ``dx`` (a whole [batch, 512, T/5] tensor after the sums) is never made.

The same sums over the same elements in another order: allclose, not bitwise (used where
fission is, ``split_backward``). A group norm qualifies in float32 or float64 (weight and bias
alike, or absent) on a contiguous input of rank 3 or more whose channels its groups divide;
any other stays as captured.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.group_norm_stats import group_norms_from_stats
    >>> model = torch.nn.Sequential(torch.nn.Conv1d(1, 8, 5, 2), torch.nn.GroupNorm(8, 8),
    ...                             torch.nn.GELU(), torch.nn.Conv1d(8, 4, 3))
    >>> x = torch.randn(2, 1, 64)
    >>> loss_fn = lambda m, b: m(b).square().mean()
    >>> g = group_norms_from_stats(fitgraph.capture(model, x, loss_fn))
    >>> any("group_norm" in n.target for n in g.nodes)
    False
    >>> torch.allclose(execute(g, fitgraph.eager_plan(g), model, x), loss_fn(model, x))
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..graph.analysis import users, verify_graph
from ..graph.ir import Graph, Node, Phase, Role, ValueRef, contiguous_strides
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["group_norms_from_stats"]

GROUP_NORM = "aten.native_group_norm.default"
GROUP_NORM_BACKWARD = "aten.native_group_norm_backward.default"
CONV_BACKWARD = "aten.convolution_backward.default"
_FLOATS = ("float32", "float64")


@dataclass(frozen=True)
class _Shape:
    """A group norm's sizes: samples, channels, positions (their dims' sizes), groups."""

    n: int
    c: int
    positions: tuple[int, ...]
    groups: int
    dtype: str

    @property
    def per(self) -> int:
        return self.c // self.groups

    @property
    def count(self) -> int:
        """Elements each (sample, group) statistic is over."""
        return self.per * prod(self.positions)

    @property
    def spatial(self) -> list[int]:
        return list(range(2, 2 + len(self.positions)))

    @property
    def column(self) -> tuple[int, ...]:
        """A per-(sample, channel) tensor's shape, broadcast over the positions."""
        return (self.n, self.c) + (1,) * len(self.positions)


def group_norms_from_stats(graph: Graph) -> Graph:
    """A copy of ``graph`` where each qualifying group norm and its backward run from the
    statistics (see the module doc); ``graph`` itself where none qualifies."""
    readers = users(graph)
    forward = {n.id: s for n in graph.nodes if n.target == GROUP_NORM
               and (s := _qualifies(graph, n, x_at=0, weight_at=1, bias_at=2, group_at=6))}
    backward: dict[int, _Shape] = {}
    linear: dict[int, int] = {}   # NOTE: convolution backward -> the group norm backward it reads
    for n in graph.nodes:
        if n.target != GROUP_NORM_BACKWARD:
            continue
        s = _qualifies(graph, n, x_at=1, weight_at=4, bias_at=None, group_at=8)
        if s is None or graph.values[n.inputs[0]].shape != graph.values[n.args[1].id].shape:
            continue
        backward[n.id] = s
        conv = _linear_reader(graph, n, readers)
        if conv is not None:
            linear[conv] = n.id
    if not forward and not backward:
        return graph
    w = GraphWriter(graph)
    terms: dict[int, tuple] = {}   # NOTE: gn backward -> (first term's outputs, c2, c3)
    for n in graph.nodes:
        if n.id in forward:
            _write_forward(w, n, forward[n.id])
        elif n.id in backward:
            conv = next((graph.nodes[c] for c, b in linear.items() if b == n.id), None)
            got = _write_backward(w, graph, n, backward[n.id], conv)
            if got is not None:
                terms[n.id] = got
        elif n.id in linear and linear[n.id] in terms:
            _write_linear(w, graph, n, backward[linear[n.id]], terms[linear[n.id]],
                          graph.nodes[linear[n.id]])
        else:
            w.copy_node(n)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _qualifies(graph: Graph, n: Node, *, x_at: int, weight_at: int, bias_at: int | None,
               group_at: int) -> _Shape | None:
    """The sizes of group norm (or backward) ``n`` where it can be rewritten, else None."""
    if n.mutates or n.kwargs or len(n.args) <= group_at:
        return None
    x = n.args[x_at]
    if not isinstance(x, ValueRef):
        return None
    xv = graph.values[x.id]
    tensors = [a for a in (n.args[weight_at], None if bias_at is None else n.args[bias_at])
               if a is not None]
    if (len(xv.shape) < 3 or xv.dtype not in _FLOATS or xv.stride != contiguous_strides(xv.shape)
            or not all(isinstance(a, ValueRef) and graph.values[a.id].dtype == xv.dtype
                       and graph.values[a.id].shape == (xv.shape[1],) for a in tensors)):
        return None
    groups = n.args[group_at]
    if not isinstance(groups, int) or groups < 1 or xv.shape[1] % groups:
        return None
    return _Shape(xv.shape[0], xv.shape[1], tuple(xv.shape[2:]), groups, xv.dtype)


def _linear_reader(graph: Graph, n: Node, readers: dict[int, list[int]]) -> int | None:
    """The convolution backward that alone reads ``n``'s input gradient and makes only weight
    and bias gradients from it (None: no such reader)."""
    mask = list(n.args[9])
    gx = n.outputs[0] if mask[0] else None
    if gx is None or gx in graph.outputs.values() or len(readers[gx]) != 1:
        return None
    conv = graph.nodes[readers[gx][0]]
    if (conv.target != CONV_BACKWARD or conv.kwargs or len(conv.args) != 11
            or conv.args[0] != ValueRef(gx) or ValueRef(gx) in conv.args[1:]):
        return None
    if any((p := graph.values[v].producer) is not None and p > n.id
           for v in conv.inputs if v != gx):
        return None   # NOTE: its first term runs with the sums, where its other inputs exist
    cmask = list(conv.args[10])
    # NOTE: each gradient is written as the sum of two terms, a fresh contiguous tensor
    dense = all(graph.values[o].stride == contiguous_strides(graph.values[o].shape)
                for o, want in zip(conv.outputs[1:], cmask[1:]) if want)
    return conv.id if not cmask[0] and any(cmask[1:]) and dense else None


class _Emit:
    """Adds the small ops of one rewrite: every new value is fresh and contiguous."""

    def __init__(self, w: GraphWriter, n: Node, s: _Shape) -> None:
        self.w, self.n, self.s = w, n, s
        self.device = w.device_of(next(w.whole[v] for v in n.inputs if v in w.whole))
        self.role = Role.ACTIVATION if n.phase is Phase.FORWARD else Role.TEMPORARY
        self.count = 0

    def op(self, target: str, args: tuple, shape: tuple[int, ...], kwargs: dict | None = None,
           *, name: str | None = None, storage: int | None = None, role: Role | None = None,
           view_of: int | None = None) -> int:
        self.count += 1
        name = name or f"{self.n.name}.{target.split('.')[1]}{self.count}"
        if view_of is not None:
            storage = self.w.values[view_of].storage
        meta = Meta(shape, contiguous_strides(shape), 0)
        spec = OutSpec(name, meta, self.s.dtype, storage=storage, role=role or self.role)
        return self.w.add_node(name, target, tuple(_ref(a) for a in args), dict(kwargs or {}),
                               [spec], phase=self.n.phase, module=self.n.module,
                               device=self.device, flops=float(prod(shape)))[0]

    def per_channel(self, v: int) -> int:
        """(N, G) -> (N, C): each group's value for its channels."""
        s = self.s
        if s.per == 1:
            return v
        return self.op("aten.repeat_interleave.self_int", (v, s.per, 1), (s.n, s.c))

    def column(self, v: int) -> int:
        """(N, C) -> (N, C, 1, ...), a view that broadcasts over the positions."""
        return self.op("aten.view.default", (v, list(self.s.column)), self.s.column, view_of=v)


class _V(int):
    """A value id to pass as a ValueRef (``_Emit.op``'s args mix refs and constants)."""


def _ref(a):
    return ValueRef(int(a)) if isinstance(a, _V) else a


def _write_forward(w: GraphWriter, n: Node, s: _Shape) -> None:
    """native_group_norm(x, weight, bias, N, C, HxW, G, eps) from var_mean and addcmul."""
    e = _Emit(w, n, s)
    x = _V(w.whole[n.args[0].id])
    weight = _V(w.whole[n.args[1].id]) if n.args[1] is not None else None
    bias = _V(w.whole[n.args[2].id]) if n.args[2] is not None else None
    old_y, old_mean, old_rstd = (w.old.values[o] for o in n.outputs)
    flat = _V(e.op("aten.view.default", (x, [s.n, s.groups, -1]),
                   (s.n, s.groups, s.count), view_of=x))
    ng = (s.n, s.groups)
    moments = w.add_node(f"{n.name}.var_mean", "aten.var_mean.correction",
                         (ValueRef(flat), [2]), {"correction": 0},
                         [OutSpec(f"{n.name}.var", Meta(ng, contiguous_strides(ng), 0), s.dtype,
                                  role=e.role),
                          OutSpec(old_mean.name, Meta(ng, contiguous_strides(ng), 0), s.dtype,
                                  storage=w.mapped_storage(old_mean.storage), role=old_mean.role)],
                         phase=n.phase, module=n.module, device=e.device,
                         flops=2.0 * s.n * s.c * s.count / s.per, out_is_tuple=True)
    var, mean = _V(moments[0]), _V(moments[1])
    shifted = _V(e.op("aten.add.Tensor", (var, n.args[7]), ng))
    rstd = _V(e.op("aten.rsqrt.default", (shifted,), ng, name=old_rstd.name,
                   storage=w.mapped_storage(old_rstd.storage), role=old_rstd.role))
    nc = (s.n, s.c)
    rstd_c, mean_c = _V(e.per_channel(rstd)), _V(e.per_channel(mean))
    scale = _V(e.op("aten.mul.Tensor", (rstd_c, weight), nc)) if weight is not None else rstd_c
    moved = _V(e.op("aten.mul.Tensor", (mean_c, scale), nc))
    shift = _V(e.op("aten.sub.Tensor", (bias, moved), nc) if bias is not None
               else e.op("aten.neg.default", (moved,), nc))
    y = e.op("aten.addcmul.default", (_V(e.column(shift)), x, _V(e.column(scale))),
             old_y.shape, name=old_y.name, storage=w.mapped_storage(old_y.storage),
             role=old_y.role)
    w.whole[old_y.id], w.whole[old_mean.id], w.whole[old_rstd.id] = y, mean, rstd


def _write_backward(w: GraphWriter, graph: Graph, n: Node, s: _Shape, conv: Node | None
                    ) -> tuple[list[int | None], int, int] | None:
    """native_group_norm_backward(dy, x, mean, rstd, weight, N, C, HxW, G, mask) from sums
    and elementwise ops. With ``conv``, the convolution backward that alone reads the input
    gradient: no input gradient, but that backward's first term (run here, beside the sums)
    and ``c2``, ``c3`` for its second (``_write_linear``)."""
    e = _Emit(w, n, s)
    dy, x, mean, rstd = (_V(w.whole[n.args[i].id]) for i in range(4))
    weight = _V(w.whole[n.args[4].id]) if n.args[4] is not None else None
    mask = list(n.args[9])
    nc, ng = (s.n, s.c), (s.n, s.groups)
    shape = graph.values[n.args[0].id].shape
    ds = _V(e.op("aten.sum.dim_IntList", (_V(e.op("aten.mul.Tensor", (dy, x), shape)),
                                          s.spatial), nc))
    db = _V(e.op("aten.sum.dim_IntList", (dy, s.spatial), nc))
    rstd_c, mean_c = _V(e.per_channel(rstd)), _V(e.per_channel(mean))
    first = av = None
    if mask[0]:
        a = _V(e.op("aten.mul.Tensor", (rstd_c, weight), nc)) if weight is not None else rstd_c
        av = _V(e.column(a))
    if conv is not None and mask[0]:
        # NOTE: made before anything that reads the sums: a region along the positions runs
        # it in the same parts as them
        first = _conv_term(w, conv, _V(e.op("aten.mul.Tensor", (dy, av), shape)), 0)

    def final(k: int, target: str, args: tuple, shape: tuple[int, ...]) -> None:
        old = graph.values[n.outputs[k]]
        w.whole[old.id] = e.op(target, args, shape, name=old.name,
                               storage=w.mapped_storage(old.storage), role=old.role)

    if mask[1]:
        centred = _V(e.op("aten.sub.Tensor", (ds, _V(e.op("aten.mul.Tensor", (db, mean_c), nc))),
                          nc))
        final(1, "aten.sum.dim_IntList",
              (_V(e.op("aten.mul.Tensor", (centred, rstd_c), nc)), [0]), (s.c,))
    if mask[2]:
        final(2, "aten.sum.dim_IntList", (db, [0]), (s.c,))
    if not mask[0]:
        return None
    dsw = _V(e.op("aten.mul.Tensor", (ds, weight), nc)) if weight is not None else ds
    dbw = _V(e.op("aten.mul.Tensor", (db, weight), nc)) if weight is not None else db
    if s.per > 1:
        dsw, dbw = (_V(e.op("aten.sum.dim_IntList",
                            (_V(e.op("aten.view.default", (t, [s.n, s.groups, s.per]),
                                     (s.n, s.groups, s.per), view_of=t)), [2]), ng))
                    for t in (dsw, dbw))
    # NOTE: c2 = (db * mean - ds) * rstd^3 / count; c3 = -c2 * mean - db * rstd / count
    cube = _V(e.op("aten.mul.Tensor", (_V(e.op("aten.mul.Tensor", (rstd, rstd), ng)), rstd), ng))
    diff = _V(e.op("aten.sub.Tensor", (_V(e.op("aten.mul.Tensor", (dbw, mean), ng)), dsw), ng))
    c2 = _V(e.op("aten.mul.Tensor",
                 (_V(e.op("aten.mul.Tensor", (diff, cube), ng)), 1.0 / s.count), ng))
    c3 = _V(e.op("aten.sub.Tensor",
                 (_V(e.op("aten.neg.default", (_V(e.op("aten.mul.Tensor", (c2, mean), ng)),),
                          ng)),
                  _V(e.op("aten.mul.Tensor",
                          (_V(e.op("aten.mul.Tensor", (dbw, rstd), ng)), 1.0 / s.count), ng))),
                 ng))
    c2v, c3v = (_V(e.column(_V(e.per_channel(t)))) for t in (c2, c3))
    if first is not None:
        return first, c2v, c3v
    inner = _V(e.op("aten.addcmul.default", (c3v, x, c2v), graph.values[n.args[1].id].shape))
    final(0, "aten.addcmul.default", (inner, dy, av), graph.values[n.outputs[0]].shape)
    return None


def _conv_term(w: GraphWriter, conv: Node, grad: int, k: int) -> list[int | None]:
    """Convolution backward ``conv`` on gradient ``grad``: term ``k`` of its weight (and bias)
    gradients."""
    args = list(w.remapped(tuple(conv.args[1:]), {})[0])  # NOTE: all but the gradient
    mask = list(conv.args[10])
    outs: list[OutSpec | None] = [None]
    for j in (1, 2):
        old = w.old.values[conv.outputs[j]] if mask[j] else None
        outs.append(None if old is None else OutSpec(
            f"{old.name}.term{k}", Meta(old.shape, contiguous_strides(old.shape), 0),
            old.dtype, role=Role.TEMPORARY))
    return w.add_node(f"{conv.name}.term{k}", CONV_BACKWARD, (ValueRef(grad), *args), {}, outs,
                      phase=conv.phase, module=conv.module, device=w.device_of(grad),
                      flops=conv.flops, out_is_tuple=True)


def _write_linear(w: GraphWriter, graph: Graph, conv: Node, s: _Shape, terms: tuple,
                  gn: Node) -> None:
    """Convolution backward ``conv`` (weight and bias gradients of a group norm's input
    gradient) as its first term's (made with the sums) plus its second's (see the module
    doc)."""
    e = _Emit(w, conv, s)
    first, c2v, c3v = terms
    x = _V(w.whole[gn.args[1].id])
    rest = e.op("aten.addcmul.default", (c3v, x, c2v), graph.values[gn.args[1].id].shape)
    second = _conv_term(w, conv, rest, 1)
    for j in (1, 2):
        if conv.args[10][j]:
            old = graph.values[conv.outputs[j]]
            w.whole[old.id] = e.op("aten.add.Tensor", (_V(first[j]), _V(second[j])), old.shape,
                                   name=old.name, storage=w.mapped_storage(old.storage),
                                   role=old.role)
