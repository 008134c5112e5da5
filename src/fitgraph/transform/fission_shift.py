"""Read a shifted causal-LM loss over the whole token range, its dropped positions ignored.

People write the next-token loss as ``cross_entropy(logits[:, :-1].reshape(-1, V),
ids[:, 1:].reshape(-1))`` (or ``logits[..., :-1, :].contiguous()``, with label smoothing, a
per-token mask, an upcast). Captured, the loss reads a *slice* of the [B, T, V] logits: a
``.contiguous()`` copy of it (B x (T-1) x V), and the backward writes its gradient into a
zeroed whole-size buffer (``slice_backward``). The B x (T-1) rows do not line up with the
B x T rows of the LM head, so operator fission can cut that region only along the batch,
and the whole-size gradient buffer stays the step's peak.

``unshift_losses`` rewrites such a loss to read every position: the slice and its copy go, the
log-softmax and loss run over all B x T rows, the targets (and any per-token tensor the loss
reads) are padded at the dropped positions (targets with the loss's ``ignore_index``, others
with 0), and what the rest of the graph reads per token is narrowed back. An ignored row adds
nothing to the loss, its count or its gradient (its gradient rows are exactly 0, as
``slice_backward`` wrote them), so the step computes the same numbers — summed over rows in
another order. The chain is then the unshifted loss, which fission runs chunk by chunk with
the LM head (``transform.view_chains`` reads through the reshapes).

Only ops that keep rows apart and make zero gradient rows from zero rows are rewritten (views,
casts, log-softmax and its backward, the NLL loss, sums over classes, adds, negations); any
other op reading the sliced logits leaves the graph as it is (``graph.meta["unshift_skipped"]`` says
why).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.fission_shift import unshift_losses
    >>> model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11))
    >>> ids = torch.randint(0, 11, (2, 6))
    >>> def loss_fn(m, b):
    ...     logits = m(b)
    ...     return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11),
    ...                                              b[:, 1:].reshape(-1))
    >>> g = fitgraph.capture(model, ids, loss_fn)
    >>> g2 = unshift_losses(g)
    >>> [n.target for n in g2.nodes].count("aten.slice_backward.default")
    0
    >>> loss = execute(g2, fitgraph.eager_plan(g2), model, ids)
    >>> bool(torch.isclose(loss, loss_fn(model, ids)))
    True
"""

from __future__ import annotations

from ..graph.analysis import users, verify_graph
from ..graph.dim_types import arg_of, norm_dim
from ..graph.ir import Graph, Node, ValueRef, contiguous_strides
from .fission_meta import VIEW_TARGETS, Meta, dense_like, view_meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["unshift_losses"]

_SLICE, _SLICE_BACKWARD = "aten.slice.Tensor", "aten.slice_backward.default"
_CLONES = frozenset({"aten.clone.default"})
# NOTE: ops a lifted row keeps to itself, and whose gradient rows are 0 where their inputs'
# rows are (so the dropped rows' gradient stays exactly 0)
_ROWWISE = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.unsqueeze.default", "aten.expand.default", "aten.alias.default", "aten.detach.default",
    "aten.clone.default", "aten._to_copy.default", "aten._log_softmax.default",
    "aten._log_softmax_backward_data.default", "aten.nll_loss_forward.default",
    "aten.nll_loss_backward.default", "aten.sum.dim_IntList", "aten.add.Tensor",
    "aten.neg.default", _SLICE, _SLICE_BACKWARD,
})
_SIZED = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
          "aten.expand.default"}
_TARGET_ARG = {"aten.nll_loss_forward.default": 1, "aten.nll_loss_backward.default": 2}


class _Shift:
    """One sliced logits tensor [B, T, V] -> [B, T', V] (positions ``[s, e)`` of dim 1)."""

    def __init__(self, graph: Graph, node: Node) -> None:
        self.g, self.slice = graph, node
        self.base = node.inputs[0]
        b, t, v = graph.values[self.base].shape
        out = graph.values[node.outputs[0]].shape
        self.B, self.T, self.V, self.Tk = b, t, v, out[1]
        start = arg_of(node, 2, "start") or 0
        self.s = start + t if start < 0 else min(start, t)
        self.e = self.s + self.Tk
        self.N, self.M = b * self.Tk, b * t

    def rows(self, shape: tuple[int, ...]) -> bool:
        """True for a per-token tensor of the sliced positions ([N, ...] or [B, T', ...])."""
        return (len(shape) >= 1 and shape[0] == self.N) or (
            len(shape) >= 2 and shape[:2] == (self.B, self.Tk))

    def wide(self, shape: tuple[int, ...]) -> bool:
        """A per-token tensor over the vocabulary (what must never be padded or narrowed)."""
        return self.rows(shape) and self.V in shape[1:]

    def lift(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) >= 2 and shape[:2] == (self.B, self.Tk):
            return (self.B, self.T) + shape[2:]
        return (self.M,) + shape[1:] if shape and shape[0] == self.N else shape


def unshift_losses(graph: Graph) -> Graph:
    """A copy of ``graph`` in which each shifted loss reads the whole token range (module doc);
    ``graph`` itself when there is none (or none it can rewrite)."""
    why: list[str] = []
    for n in graph.nodes:
        if n.target != _SLICE or len(graph.values[n.inputs[0]].shape) != 3:
            continue
        found = _lifted_nodes(graph, n)
        if isinstance(found, str):
            why.append(f"{n.name}: {found}")
            continue
        try:
            out = _Rewriter(graph, _Shift(graph, n), found).run()
        except ValueError as e:
            # NOTE: a rewrite this module cannot make leaves the loss as captured: fission
            # then cuts it along the batch only; never a failed plan
            why.append(f"{n.name}: {e}")
            continue
        verify_graph(out)
        return unshift_losses(out)  # NOTE: one slice at a time: ids change with each rewrite
    if why:
        return _with_meta(graph, why)
    return graph


def _with_meta(graph: Graph, why: list[str]) -> Graph:
    if graph.meta.get("unshift_skipped") == why:
        return graph
    return Graph(graph.nodes, graph.values, graph.storages, graph.inputs, graph.input_names,
                 graph.outputs, dict(graph.meta, unshift_skipped=why))


def _lifted_nodes(graph: Graph, sl: Node) -> set[int] | str:
    """The nodes to run over every position, or why the slice is left as it is."""
    x = graph.values[sl.inputs[0]]
    dim = norm_dim(arg_of(sl, 1, "dim", 0), 3)
    out = graph.values[sl.outputs[0]]
    if dim != 1 or arg_of(sl, 4, "step", 1) != 1 or out.shape[1] == x.shape[1]:
        return "not a slice of positions (dim 1, step 1)"
    if x.stride != contiguous_strides(x.shape) or x.storage_offset:
        return "the sliced tensor is not contiguous"
    sh = _Shift(graph, sl)
    if sh.N in (sh.B, sh.M) or sh.Tk == sh.V:
        # NOTE: one position kept (Funnel's ``x[:, :1]``, a CLS token), or a shape that names
        # two things: [N, ...] rows would be ambiguous with [B, ...] or the vocabulary
        return "the kept positions' shape is ambiguous (one position, or as long as the classes)"
    readers = users(graph)
    lifted = {sl.id}
    todo = [sl.id]
    ends = 0
    while todo:
        n = graph.nodes[todo.pop()]
        if n.target not in _ROWWISE:
            return f"{n.name} ({n.target}) may mix rows or make a nonzero gradient row"
        if n.mutates:
            return f"{n.name} writes in place"
        if n.target == _SLICE_BACKWARD:
            if not _undoes(graph, n, sh):
                return f"{n.name} is not the slice's backward"
            ends += 1
            continue  # NOTE: its output is the whole [B, T, V] gradient: the rewrite's end
        if n.target == _SLICE and n.id != sl.id:
            return f"{n.name} slices the sliced logits again"
        if n.target == "aten.sum.dim_IntList" and _summed(n, graph) != {
                len(graph.values[n.inputs[0]].shape) - 1}:
            return f"{n.name} sums over other dims than the classes"
        if n.target in ("aten._log_softmax.default", "aten._log_softmax_backward_data.default"):
            nd = len(graph.values[n.inputs[0]].shape)
            pos = 1 if n.target == "aten._log_softmax.default" else 2
            if norm_dim(arg_of(n, pos, "dim"), nd) != nd - 1:
                return f"{n.name} normalises over another dim than the classes"
        near = [o for o in n.outputs if o is not None and sh.wide(graph.values[o].shape)]
        near += [v for v in n.inputs if sh.wide(graph.values[v].shape) and v != sl.inputs[0]]
        for v in near:
            p = graph.values[v].producer
            for m in ([p] if p is not None else []) + readers[v]:
                if m not in lifted:
                    lifted.add(m)
                    todo.append(m)
        if any(sh.rows(graph.values[v].shape) and graph.values[v].producer is None
               and sh.wide(graph.values[v].shape) for v in n.inputs):
            return f"{n.name} reads a graph input over the vocabulary"
    if ends != 1:
        return "no single slice_backward writes the sliced logits' gradient"
    if not any(graph.nodes[nid].target == "aten.nll_loss_forward.default" for nid in lifted):
        return "no loss reads the sliced positions"
    for nid in lifted:
        for o in graph.nodes[nid].outputs:
            if o is not None and o in graph.outputs.values() and graph.values[o].shape:
                return f"{graph.values[o].name} is a graph output"
    return lifted


def _undoes(graph: Graph, n: Node, sh: _Shift) -> bool:
    sizes = list(arg_of(n, 1, "input_sizes"))
    dim = norm_dim(arg_of(n, 2, "dim"), len(sizes))
    start, end, step = arg_of(n, 3, "start"), arg_of(n, 4, "end"), arg_of(n, 5, "step")
    start = start + sh.T if start < 0 else min(start, sh.T)
    end = end + sh.T if end < 0 else min(end, sh.T)
    return sizes == [sh.B, sh.T, sh.V] and dim == 1 and step == 1 and (start, end) == (sh.s, sh.e)


def _summed(n: Node, graph: Graph) -> set[int]:
    nd = len(graph.values[n.inputs[0]].shape)
    dims = arg_of(n, 1, "dim")
    dims = [dims] if isinstance(dims, int) else list(dims or range(nd))
    return {norm_dim(d, nd) for d in dims}


class _Rewriter:
    def __init__(self, graph: Graph, sh: _Shift, lifted: set[int]) -> None:
        self.g, self.sh, self.lifted = graph, sh, lifted
        self.w = GraphWriter(graph)
        self.new: dict[int, int] = {}        # old value -> its lifted (all positions) value
        self.padded: dict[tuple[int, object], int] = {}
        self.narrowed: dict[int, int] = {}

    def run(self) -> Graph:
        g, w = self.g, self.w
        for n in g.nodes:
            if n.id in self.lifted:
                self._lift(n)
                continue
            for v in n.inputs:
                if v in self.new and v not in w.whole:  # NOTE: a lifted per-token tensor
                    w.whole[v] = self._narrow(v, n)
            w.copy_node(n)
        meta = dict(g.meta)
        meta["unshifted"] = list(meta.get("unshifted", [])) + [self.sh.slice.name]
        return w.finish(meta)

    # -- lifted nodes ---------------------------------------------------------------------------
    def _lift(self, n: Node) -> None:
        g, w, sh = self.g, self.w, self.sh
        if n.target == _SLICE:
            self._alias(n.outputs[0], w.whole[n.inputs[0]])
            return
        if n.target == _SLICE_BACKWARD:
            self._alias(n.outputs[0], self.new[n.inputs[0]])
            return
        if n.target in _CLONES and self.new.get(n.inputs[0]) is not None:
            src = self.new[n.inputs[0]]
            if w.values[src].stride == contiguous_strides(w.values[src].shape):
                self._alias(n.outputs[0], src)  # NOTE: it only made the slice contiguous
                return
        refs: dict[int, int] = {}
        for q, v in enumerate(_operand_ids(n)):
            if v in self.new:
                refs[v] = self.new[v]
            elif sh.rows(g.values[v].shape):
                ignore = arg_of(n, 5 if n.target.endswith("backward.default") else 4,
                                "ignore_index", -100)
                fill = ignore if _TARGET_ARG.get(n.target) == q else 0
                refs[v] = self._pad(v, fill, n)
            else:
                refs[v] = w.whole[v]
        args = _map(n.args, refs)
        kwargs = _map(n.kwargs, refs)
        outs: list[OutSpec | None] = []
        for j, o in enumerate(n.outputs):
            if o is None:
                outs.append(None)
                continue
            v = g.values[o]
            shape = sh.lift(v.shape)
            if n.target in _SIZED:
                args = (args[0], list(shape)) + tuple(args[2:])
            if n.target in VIEW_TARGETS:
                meta = view_meta(n.target, args, [w.meta(refs[n.inputs[0]])], j)
                if meta is None:
                    raise ValueError(f"{n.name}: no view of the lifted tensor (a bug)")
                src = refs[n.inputs[0]]
                outs.append(OutSpec(v.name, meta, v.dtype, storage=w.values[src].storage,
                                    role=w.values[src].role))
            else:
                meta = Meta(shape, dense_like(shape, v.stride), 0)
                outs.append(OutSpec(v.name, meta, v.dtype, role=g.storages[v.storage].role))
        scale = sh.M / sh.N
        made = w.add_node(n.name, n.target, args, kwargs, outs, phase=n.phase, module=n.module,
                          device=g.storages[g.values[n.outputs[0]].storage].device,
                          random=n.random, flops=n.flops * scale, out_is_tuple=n.out_is_tuple)
        for o, m in zip(n.outputs, made):
            if o is None:
                continue
            self.new[o] = m
            if not sh.rows(g.values[o].shape):
                w.whole[o] = m  # NOTE: a scalar (the loss, its total weight) is the same value
                w.storage_map.setdefault(g.values[o].storage, w.values[m].storage)

    def _alias(self, old: int, new: int) -> None:
        self.new[old] = new
        self.w.storage_map.setdefault(self.g.values[old].storage, self.w.values[new].storage)
        if not self.sh.rows(self.g.values[old].shape):
            self.w.whole[old] = new     # NOTE: slice_backward's [B, T, V]: the same tensor

    # -- the edges: per-token tensors padded in, narrowed out -----------------------------------
    def _pad(self, vid: int, fill, n: Node) -> int:
        """``vid`` ([N, ...] or [B, T', ...]) with ``fill`` at the dropped positions."""
        key = (vid, fill)
        if key in self.padded:
            return self.padded[key]
        g, w, sh = self.g, self.w, self.sh
        v = g.values[vid]
        src = w.whole[vid]
        kw = dict(phase=n.phase, module=n.module, device=w.device_of(src))
        rest = v.shape[1:] if v.shape[0] == sh.N and v.shape[:2] != (sh.B, sh.Tk) else v.shape[2:]
        three = (sh.B, sh.Tk) + tuple(rest)
        src = self._reshaped(src, three, f"{v.name}.rows", kw)
        full = (sh.B, sh.T) + tuple(rest)
        pad = [0, 0] * len(rest) + [sh.s, sh.T - sh.e]
        out = w.add_node(f"{v.name}.pad", "aten.constant_pad_nd.default", (ValueRef(src), pad, fill),
                         {}, [OutSpec(f"{v.name}.pad", Meta(full, contiguous_strides(full), 0),
                                      v.dtype, role=g.storages[v.storage].role)], **kw)[0]
        out = self._reshaped(out, sh.lift(v.shape), f"{v.name}.padded", kw)
        self.padded[key] = out
        return out

    def _narrow(self, vid: int, reader: Node) -> int:
        """The sliced positions of a lifted per-token value, for a reader outside the loss."""
        g, w, sh = self.g, self.w, self.sh
        v = g.values[vid]
        if sh.wide(v.shape):
            raise ValueError(f"{reader.name} reads {v.name} over the vocabulary (a bug)")
        src = self.new[vid]
        kw = dict(phase=reader.phase, module=reader.module, device=w.device_of(src))
        rest = w.values[src].shape[2:] if v.shape[:2] == (sh.B, sh.Tk) else \
            w.values[src].shape[1:]
        full = (sh.B, sh.T) + tuple(rest)
        src = self._reshaped(src, full, f"{v.name}.all", kw)
        kept = (sh.B, sh.Tk) + tuple(rest)
        m = w.meta(src)
        sl = w.add_node(f"{v.name}.kept", _SLICE, (ValueRef(src), 1, sh.s, sh.e), {},
                        [OutSpec(f"{v.name}.kept", Meta(kept, m.stride, m.offset + sh.s * m.stride[1]),
                                 v.dtype, storage=w.values[src].storage,
                                 role=w.values[src].role)], **kw)[0]
        dense = Meta(kept, contiguous_strides(kept), 0)
        cp = w.add_node(f"{v.name}.narrow", "aten.clone.default", (ValueRef(sl),), {},
                        [OutSpec(f"{v.name}.narrow", dense, v.dtype,
                                 role=g.storages[v.storage].role)], **kw)[0]
        out = self._reshaped(cp, v.shape, f"{v.name}.narrowed", kw)
        w.storage_map[v.storage] = w.values[out].storage
        self.narrowed[vid] = out
        return out

    def _reshaped(self, src: int, shape: tuple[int, ...], name: str, kw: dict) -> int:
        w = self.w
        if w.values[src].shape == tuple(shape):
            return src
        meta = view_meta("aten.view.default", (None, list(shape)), [w.meta(src)])
        if meta is None:
            raise ValueError(f"{name}: a per-token tensor the loss reads is not contiguous")
        return w.add_node(name, "aten.view.default", (ValueRef(src), list(shape)), {},
                          [OutSpec(name, meta, w.values[src].dtype, storage=w.values[src].storage,
                                   role=w.values[src].role)], **kw)[0]


def _operand_ids(n: Node) -> list[int]:
    from ..graph.analysis import flatten_refs

    return flatten_refs((n.args, n.kwargs))


def _map(obj, refs: dict[int, int]):
    from .fission_writer import map_refs

    return map_refs(obj, refs)
