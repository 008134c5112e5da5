"""How a tensor-parallel shard's op splits its output, given its inputs' slices: the rules
``tensor_parallel``'s rewrite follows a column-parallel slice by (elementwise ops, reshapes
into and out of heads, transposes, splits of fused projections, joins of slices, matmuls
and attention over heads, indexing along other dims). Each returns the output's layout
(``Sharded``), rewriting the node's shape arguments to the slice's where it has any, or
raises ``TensorParallelError`` naming the op.
"""

from __future__ import annotations

import torch

from .fx_layouts import Sharded, TensorParallelError
from .fx_layouts import flat as _flat
from .fx_layouts import ndim as _ndim
from .fx_layouts import prod as _prod
from .fx_layouts import shape as _shape
from .tp_layers import SeqScatter

__all__ = ["SliceRules"]

aten = torch.ops.aten


class SliceRules:
    """The rules, a mixin of ``tensor_parallel._Rewrite`` (its ``tp``, ``group`` and
    ``_put_before``)."""

    tp: int
    group: object

    def _cat(self, node, lay):
        """Slices joined along another dim (Phi's rotated and passed halves of each head) or
        stacked along a new one (GPT-J's rotation of pairs): the slices' layout, past the
        new dim; an empty 1-D operand (a cache's first ``cat``) is skipped, as torch skips
        it."""
        nd = _ndim(node)
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % nd
        stack = node.target is aten.stack.default
        layouts = set()
        for a in node.args[0]:
            if lay.get(a) is not None:
                layouts.add(lay[a])
            elif _shape(a) != (0,):
                raise TensorParallelError(f"{node.name} joins a slice with {a.name}, whole")
        (layout,) = layouts if len(layouts) == 1 else (None,)
        if layout is None or (layout.dim == dim and not stack):
            raise TensorParallelError(f"{node.name}: a cat of slices split differently or "
                                      f"along the joined dim")
        return Sharded(layout.dim + (dim <= layout.dim), layout.parts) if stack else layout

    def _flatten(self, node, lay):
        """Dims merged: the split dim before or after them moves with them; the first of
        them may be the split one (each shard's rows, then the rest: a slice of the merge)."""
        s = lay[node.args[0]]
        nd = _ndim(node.args[0])
        start = (node.args[1] if len(node.args) > 1 else 0) % nd
        end = (node.args[2] if len(node.args) > 2 else -1) % nd
        if s.dim < start or (s.dim == start and s.parts == 1):
            return s
        if s.dim > end:
            return Sharded(s.dim - (end - start), s.parts)
        raise TensorParallelError(f"{node.name}: flattening dims {start}..{end} merges the "
                                  f"split dim {s.dim} after another")

    def _cut_whole(self, gm, node, a, dim: int, layout: Sharded, what: str) -> None:
        """``node`` reads ``a`` whole along the split dim ``dim`` of ``a`` (T5's position
        bias, one per head, beside each shard's heads): this shard's slice of it, its
        gradient gathered (``SeqScatter``); not beside the parts of a fused projection."""
        if layout.parts != 1:
            raise TensorParallelError(f"{node.name} ({node.target}) mixes a slice of a fused "
                                      f"projection with {a.name}, {what}")
        self._put_before(gm, node, a, SeqScatter(dim, self.group))

    def _same(self, gm, node, lay):
        """Elementwise: the slice's layout; another input whole along its dim is cut to the
        shard's slice (``_cut_whole``), one that broadcasts along it read as it is."""
        out_nd = _ndim(node)
        layout = None
        for a in _flat(node.args) + _flat(list(node.kwargs.values())):
            if not isinstance(a, torch.fx.Node):
                continue
            s = lay.get(a)
            nd = _ndim(a)
            if s is not None:
                here = Sharded(s.dim + out_nd - nd, s.parts)
                if layout is not None and layout != here:
                    raise TensorParallelError(f"{node.name}: inputs split differently")
                layout = here
        for a in _flat(node.args) + _flat(list(node.kwargs.values())):
            if isinstance(a, torch.fx.Node) and lay.get(a) is None and _ndim(a) > 0:
                d = layout.dim - (out_nd - _ndim(a))
                if d >= 0 and _shape(a)[d] != 1:
                    self._cut_whole(gm, node, a, d, layout, "whole along the split dim")
        return layout

    def _reshape(self, node, lay):
        s = lay[node.args[0]]
        src, dst = _shape(node.args[0]), _shape(node)
        before = _prod(src[:s.dim])
        e, acc = 0, 1
        while e < len(dst) and acc < before:
            acc *= dst[e]
            e += 1
        if acc != before or e >= len(dst):
            raise TensorParallelError(f"{node.name}: a reshape that cuts across the split dim")
        if dst[e] == src[s.dim] or (s.parts == 1 and dst[e] > src[s.dim]
                                     and dst[e] % src[s.dim] == 0):
            out = Sharded(e, s.parts)
        elif s.parts == 1 and src[s.dim] % dst[e] == 0 and dst[e] % self.tp == 0:
            out = Sharded(e, 1)
        else:
            raise TensorParallelError(f"{node.name}: reshaping {list(src)} to {list(dst)} "
                                      f"splits dim {s.dim} so that its slices are not whole")
        local = list(dst)
        if local[e] % self.tp:
            raise TensorParallelError(f"{node.name}: dim {e} of {list(dst)} does not divide "
                                      f"by {self.tp}")
        local[e] //= self.tp
        node.args = (node.args[0], local, *node.args[2:])
        return out, True

    def _transpose(self, node, lay):
        s = lay[node.args[0]]
        nd = _ndim(node)
        a, b = node.args[1] % nd, node.args[2] % nd
        d = b if s.dim == a else a if s.dim == b else s.dim
        return Sharded(d, s.parts)

    def _split(self, node, lay):
        s = lay[node.args[0]]
        nd = _ndim(node.args[0])
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
        n_out = len(node.meta["val"])
        if dim != s.dim:
            return tuple(s for _ in range(n_out)), False
        whole = _shape(node.args[0])[dim]
        sizes = [v.shape[dim] for v in node.meta["val"]]
        if len(set(sizes)) != 1 or len(sizes) != s.parts or sizes[0] * s.parts != whole \
                or sizes[0] % self.tp:
            raise TensorParallelError(f"{node.name} splits the split dim into {sizes}, not the "
                                      f"{s.parts} parts the column-parallel layer made")
        local = sizes[0] // self.tp
        if node.target is aten.chunk.default:
            pass   # NOTE: as many chunks of the shard: each a part's slice (Phi-3's gate/up)
        elif node.target is aten.split.Tensor:
            node.args = (node.args[0], local, *node.args[2:])
        else:
            node.args = (node.args[0], [local] * len(sizes), *node.args[2:])
        return tuple(Sharded(dim, 1) for _ in range(n_out)), True

    def _matmul(self, node, lay):
        a, b = node.args[0], node.args[1]
        sa, sb = lay.get(a), lay.get(b)
        nd = _ndim(node)
        batch = nd - 2
        ok = (sa is not None and sb is not None
              and sa.dim - (_ndim(a) - nd) == sb.dim - (_ndim(b) - nd)
              and sa.dim - (_ndim(a) - nd) < batch)
        if not ok:
            raise TensorParallelError(f"{node.name}: a matmul of slices that is not along a "
                                      f"batch dim of both (heads)")
        return Sharded(sa.dim - (_ndim(a) - nd), 1)

    def _attention(self, gm, node, lay):
        """Attention over the shard's heads; a query, key or value computed whole (a
        cross-attention's keys and values of the encoder's output, which the plan keeps
        whole: ``dist.graph_tp``) and a mask per head are cut to those heads (one that
        broadcasts over them is read as it is)."""
        q, k, v = node.args[:3]
        layouts = {lay.get(q), lay.get(k), lay.get(v)} - {None}
        if len(layouts) != 1 or next(iter(layouts)).dim >= _ndim(q) - 2:
            raise TensorParallelError(f"{node.name}: attention over slices other than heads")
        layout = next(iter(layouts))
        for a in (q, k, v, *node.args[3:4], node.kwargs.get("attn_mask")):
            if isinstance(a, torch.fx.Node) and lay.get(a) is None:
                d = layout.dim - (_ndim(q) - _ndim(a))
                if d >= 0 and _shape(a)[d] != 1:
                    self._cut_whole(gm, node, a, d, layout, "whole over the heads")
        return layout

    def _metadata_check(self, node) -> None:
        """Export's check of a ``.to()``'s input, on a slice: its dtype and device hold for
        the slice, its size and stride are the whole's (dropped); it outputs nothing."""
        dtype = node.args[3] if len(node.args) > 3 else node.kwargs.get("dtype")
        node.args = node.args[:1]
        node.kwargs = {**{k: v for k, v in node.kwargs.items()
                          if k not in ("size", "stride", "dtype")},
                       **({"dtype": dtype} if dtype is not None else {})}

    def _indexing(self, node, lay):
        s = lay[node.args[0]]
        nd_in = _ndim(node.args[0])
        t = node.target
        if t is aten.unsqueeze.default:
            d = node.args[1] % (nd_in + 1)
            return Sharded(s.dim + (d <= s.dim), s.parts)
        d = node.args[1] % nd_in
        if d == s.dim:
            raise TensorParallelError(f"{node.name}: indexing along the split dim")
        if t in (aten.select.int, aten.squeeze.dim) and (t is aten.select.int
                                                        or _shape(node.args[0])[d] == 1):
            return Sharded(s.dim - (d < s.dim), s.parts)
        return s

    def _expand(self, node, lay):
        """A slice expanded along other dims (grouped-query attention's keys repeated per
        query head: ``[b, kv, 1, t, d]`` to ``[b, kv, rep, t, d]``): its sizes made the
        slice's."""
        s = lay[node.args[0]]
        size = list(node.args[1])
        d = s.dim + len(size) - _ndim(node.args[0])
        if size[d] != -1:
            if size[d] % self.tp:
                raise TensorParallelError(f"{node.name}: expanding the split dim")
            size[d] //= self.tp
        node.args = (node.args[0], size, *node.args[2:])
        return Sharded(d, s.parts)
