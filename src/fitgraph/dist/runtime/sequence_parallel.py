"""Sequence parallelism in a tensor-parallel chunk's rewrite (Korthikanti et al. 2022): the
rules ``tensor_parallel._Rewrite`` follows parts of the sequence (``SeqSplit``) with.

A row-parallel linear reduce-scatters its sums along a dim other than the features (the
sequence, or the rows before it where that does not divide), and what follows it — dropout,
residual adds, norms over the features, means over them, reshapes that keep that dim — runs
on this shard's part up to the next column-parallel linear, which gathers its input. A whole
tensor that meets a part is cut to this shard's part (``SeqScatter``: its gradient gathered),
or, where it broadcasts along that dim, kept whole: a parameter's gradient (a norm's weight, a
row-parallel bias) is then partial and the step sums it over the shards once
(``partial_names``; Megatron's all-reduce of the sequence-parallel norms' gradients), another
tensor's at once (``GradSum``). An op without a rule for parts gets its input gathered first
(``SeqGather``), and so does what leaves the chunk.

Example (inside a launch; ``shard_chunk(..., sp=True)`` uses it):
    >>> SeqSplit(1)
    SeqSplit(dim=1)
"""

from __future__ import annotations

import torch

from .fx_layouts import ELEMENTWISE, SeqSplit, Sharded, TensorParallelError, ndim, prod, shape
from .tp_layers import GradSum, SeqGather, SeqScatter

__all__ = ["SeqSplit", "SequenceParallelRules"]

aten = torch.ops.aten


class SequenceParallelRules:
    """The rewrite's rules for parts of the sequence (a mixin of ``tensor_parallel._Rewrite``:
    ``tp``, ``group``, ``inserted``, ``gathered``, ``partial`` and ``modules`` are its)."""

    def _seq_dim(self, node) -> int | None:
        """The dim a row-parallel output is split along with sequence parallelism: the one
        before the features (the sequence), else an earlier one, that ``tp`` divides."""
        size = shape(node)
        return next((d for d in range(len(size) - 2, -1, -1)
                     if size[d] >= self.tp and size[d] % self.tp == 0), None)

    def _put_before(self, gm, node, arg, module) -> torch.fx.Node:
        """``module(arg)`` put into ``gm``'s graph in place of ``node``'s input ``arg``."""
        k = self.inserted.get(id(gm), 0)
        self.inserted[id(gm)] = k + 1
        name = f"fitgraph_sp_{k}"
        gm.add_module(name, module)
        owner = gm.graph.owning_module
        if owner is not None and owner is not gm:
            owner.add_module(name, module)   # NOTE: an unflattened module's graph is another's
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, (arg,))
        new.meta["val"] = arg.meta["val"]   # NOTE: shapes in ``meta`` are the whole ones
        node.replace_input_with(arg, new)
        return new

    def _whole_read_by_parts(self, gm, node, a) -> None:
        """``node`` reads whole tensor ``a`` with parts: its gradient is partial. A parameter's
        is summed once a step (``partial_names``); another tensor's at once (``GradSum``)."""
        if a.op == "get_attr":
            t = _attr(gm, a.target)
            if isinstance(t, torch.nn.Parameter):
                self.partial.setdefault(id(t), [t, 0])[1] += 1
                return
            if isinstance(t, torch.Tensor) and not t.requires_grad:
                return
        self._put_before(gm, node, a, GradSum(self.group))

    def partial_names(self, chunk) -> frozenset[str]:
        """The chunk's parameters whose gradients are partial (read by parts only), by model
        name; a parameter read both by parts and whole is refused."""
        reads: dict[int, int] = {}
        for gm in {id(m): m for m in self.modules}.values():
            for n in gm.graph.nodes:
                if n.op == "get_attr":
                    t = _attr(gm, n.target)
                    reads[id(t)] = reads.get(id(t), 0) + len(n.users)
        names = {id(p): chunk.model_name(n) for n, p in chunk.named_parameters()}
        for pid, (p, by_parts) in self.partial.items():
            if by_parts and reads.get(pid, 0) != by_parts:
                raise TensorParallelError(
                    f"parameter {names.get(pid, tuple(p.shape))} is read both by parts of the "
                    "sequence and whole: plan without sequence parallelism (--fix sp=0)")
        return frozenset(names[pid] for pid in self.partial if pid in names)

    def _gather_inputs(self, gm, node, lay) -> None:
        """Every part (``SeqSplit``) ``node`` reads, gathered whole first: once for all its
        readers in ``gm`` (Q, K and V projections kept whole read one norm's output: three
        gathers would hold three whole copies for their backward)."""
        for a in list(node.all_input_nodes):
            s = lay.get(a)
            if not isinstance(s, SeqSplit):
                continue
            whole = self.gathered.get((id(gm), a))
            if whole is None:
                whole = self._put_before(gm, node, a, SeqGather(s.dim, self.group))
                self.gathered[(id(gm), a)] = whole
                lay[whole] = None
            else:
                node.replace_input_with(a, whole)

    def _seq_op(self, gm, node, lay):
        """The layout of ``node``'s output where it reads parts (``SeqSplit``), or None
        where it has no rule for parts (its inputs are then gathered)."""
        t = node.target
        x = node.args[0]
        sx = lay.get(x)
        if t in ELEMENTWISE:
            return self._seq_same(gm, node, lay)
        if t is aten._assert_tensor_metadata.default and not any(
                node.kwargs.get(k) is not None for k in ("size", "stride")) and len(node.args) < 2:
            # NOTE: ``.to(dtype)``'s check of a dtype or device, true of a part as of the whole;
            # it outputs nothing (an empty layout, not None: no gather)
            return ()
        if t in (aten.layer_norm.default, aten.native_layer_norm.default,
                 aten.rms_norm.default) and isinstance(sx, SeqSplit) \
                and sx.dim < ndim(x) - len(node.args[1]):
            for a in node.all_input_nodes:
                if a is not x:
                    self._whole_read_by_parts(gm, node, a)
            if t is aten.native_layer_norm.default:
                return (sx, sx, sx)
            return sx
        if t in (aten.mean.dim, aten.sum.dim_IntList) and isinstance(sx, SeqSplit):
            nd = ndim(x)
            over = node.args[1] if len(node.args) > 1 else None
            dims = {d % nd for d in (range(nd) if over is None else over)}
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            if sx.dim not in dims:
                return SeqSplit(sx.dim if keep else sx.dim - sum(d < sx.dim for d in dims))
            return None
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default) \
                and isinstance(sx, SeqSplit):
            src, dst = shape(x), shape(node)
            before = prod(src[:sx.dim])
            e = next((e for e in range(len(dst)) if prod(dst[:e]) == before
                      and dst[e] == src[sx.dim]), None)
            if e is None:
                return None
            local = list(dst)
            local[e] //= self.tp
            node.args = (x, local, *node.args[2:])
            return SeqSplit(e)
        return None

    def _seq_same(self, gm, node, lay):
        """An elementwise op reading parts: its output a part; each whole tensor it reads cut
        to this shard's part, or where it broadcasts along the split dim kept whole with its
        gradient summed over the shards."""
        out_nd = ndim(node)
        dims = {lay[a].dim + out_nd - ndim(a) for a in node.all_input_nodes
                if isinstance(lay.get(a), SeqSplit)}
        if len(dims) != 1 or any(isinstance(lay.get(a), Sharded) for a in node.all_input_nodes):
            return None
        (d,) = dims
        for a in list(node.all_input_nodes):
            if lay.get(a) is not None or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            da = d - (out_nd - ndim(a))
            if da < 0 or shape(a)[da] == 1:
                self._whole_read_by_parts(gm, node, a)
            else:
                lay[self._put_before(gm, node, a, SeqScatter(da, self.group))] = SeqSplit(da)
        return SeqSplit(d)


def _attr(gm, target: str):
    """What a ``get_attr`` node of ``gm`` reads (a dotted path of attributes)."""
    t = gm
    for name in target.split("."):
        t = getattr(t, name)
    return t
