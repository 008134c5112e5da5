"""Combining a fission region's parts into whole tensors, after each part and after the block.

What leaves the region must exist whole for the rest of the graph:

- a tensor the parts make in row blocks is assembled in a preallocated whole tensor
  (``new_empty_strided`` with the original layout): each part copies the rows it owns into
  its slice right after the last node writing it (a part that holds more rows, from a halo,
  copies only its own; max-pool indices are rebased to the whole plane first);
- a partial sum (a weight gradient) is summed in place into the first part's result (products
  accumulate with ``addmm_``); input gradients of a spatial split, which overlap by the halo,
  add into a zeroed whole tensor;
- a mean loss is re-weighted once after the block; an empty tensor every part makes alike is
  the last part's; views leave through ``as_strided`` of their whole base.

``PartsCombiner`` is the splitter's half that does this (``fission._Splitter`` derives from it);
it uses the splitter's graph writer ``w``, region ``r``, row planner ``rows`` and its tables
(``part``, ``acc``, ``buffers``, ``leaving``...).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.dim_region import grow_region
    >>> from fitgraph.transform.fission import split_region
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (8, 4), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((8, 4), "float32")], name="relu")[0]
    >>> z = b.add_node("aten.neg.default", [y], [((8, 4), "float32")], name="neg")[0]
    >>> g = b.finish({"loss": z, "kept": y})        # y leaves the region: assembled whole
    >>> g2 = split_region(g, grow_region(g, x, 0), 2)
    >>> [n.name for n in g2.nodes if n.target == "aten.copy_.default"]
    ['relu.copy0', 'neg.copy0', 'relu.copy1', 'neg.copy1']
"""

from __future__ import annotations

from ..graph.dim_types import Along, Reduced
from ..graph.dims import operands
from ..graph.ir import Phase, Role, ValueRef, contiguous_strides
from .fission_halo_nodes import rebase_indices, rows_view
from .fission_meta import Meta
from .fission_order import FissionError
from .fission_outer import inner_rows, unflattened
from .fission_writer import OutSpec

__all__ = ["ACCUMULATE", "THREADED", "PartsCombiner", "part_role"]

# NOTE: products whose partial sums a part adds in place into the first part's result
# (``acc.addmm_(a, b)``): no second whole-size partial (a tied LM head's weight gradient is as
# large as the embedding)
ACCUMULATE = {"aten.mm.default": "aten.addmm_.default", "aten.bmm.default": "aten.baddbmm_.default"}
# NOTE: scatters whose parts add their rows into the result so far in place (the first part's
# base operand replaced by it): ``dim_rules_index.index_scatter``'s rows in parts
THREADED = {"aten.index_put.default": "aten.index_put_.default",
            "aten._unsafe_index_put.default": "aten.index_put_.default"}

_HALF = ("bfloat16", "float16")



def part_role(phase: Phase) -> Role:
    """The role of a value a part makes in ``phase``."""
    return Role.ACTIVATION if phase in (Phase.FORWARD, Phase.LOSS) else Role.TEMPORARY


def _ref(vid: int) -> ValueRef:
    return ValueRef(vid)


class PartsCombiner:
    """The splitter's methods that make whole tensors of what the parts make (module doc)."""

    def _accumulated(self, o: int | None) -> bool:
        """True for a partial sum the parts add up in place (one that leaves the region, and
        does not weigh a mean: those are combined with it, see ``_combine_mean``)."""
        e = self.r.dims.get(o)
        return isinstance(e, Reduced) and e.how == "sum" and e.overlap is None \
            and o in self.leaving and o not in self.mean_weights.values()

    def _is_acc(self, o: int, i: int) -> bool:
        return i == 0 and self._accumulated(o)

    # -- combining the parts --------------------------------------------------------------------
    def _after_part_node(self, nid: int, i: int) -> None:
        g, w, r = self.g, self.w, self.r
        n = g.nodes[nid]
        dev = self._device(n)
        for st in self.leaving_roots:
            root = self.root_of[st]
            if self.last_write[st] != nid or not isinstance(r.dims[root], int):
                continue
            self._copy_into_buffer(root, i, n, dev)
        for j, (o, e) in enumerate(zip(n.outputs, r.splits[nid].outputs)):
            if not isinstance(e, Reduced):
                continue
            if e.overlap is not None and o is not None:
                self._add_overlapping(nid, j, o, e.overlap.dim, i, dev)
            elif self._accumulated(o) or o in self.direct_roots:
                if i == 0:
                    self.acc[o] = self.part[(o, 0)]
                elif o in self.direct_roots or o in self.direct_leaving:
                    continue  # NOTE: its product accumulated in place (``_direct_sums``)
                elif n.target not in ACCUMULATE and n.target not in THREADED:
                    acc = self.acc[o]
                    spec = OutSpec(f"{g.values[o].name}.acc{i}", w.meta(acc), g.values[o].dtype,
                                   storage=w.values[acc].storage, role=w.values[acc].role)
                    self.acc[o] = w.add_node(
                        f"{n.name}.acc{i}", "aten.add_.Tensor", (_ref(acc), _ref(self.part[(o, i)])),
                        {}, [spec], phase=n.phase, module=n.module, device=dev,
                        mutates=(acc,))[0]

    def _whole_buffer(self, v, like: int, n, dev: str, zeros: bool = False) -> int:
        """A whole tensor with ``v``'s layout, in a new storage of ``v``'s role (zeroed for
        overlapping parts to add into)."""
        w = self.w
        role = self.g.storages[v.storage].role
        spec = OutSpec(f"{v.name}", Meta(v.shape, v.stride, v.storage_offset), v.dtype, role=role)
        kw = dict(phase=n.phase, module=n.module, device=dev)
        if zeros and v.stride == contiguous_strides(v.shape) and not v.storage_offset:
            buf = w.add_node(f"{v.name}.zeros", "aten.new_zeros.default",
                             (_ref(like), list(v.shape)), {}, [spec], **kw)[0]
        else:
            buf = w.add_node(f"{v.name}.buffer", "aten.new_empty_strided.default",
                             (_ref(like), list(v.shape), list(v.stride)), {}, [spec], **kw)[0]
            if zeros:
                spec = OutSpec(f"{v.name}.zeroed", w.meta(buf), v.dtype,
                               storage=w.values[buf].storage, role=role)
                w.add_node(f"{v.name}.zero", "aten.zero_.default", (_ref(buf),), {}, [spec],
                           mutates=(buf,), **kw)
        w.storage_map[v.storage] = w.values[buf].storage
        return buf

    def _into_rows(self, buf: int, d: int, start: int, stop: int, src: int, target: str,
                   names: tuple[str, str], n, dev: str) -> None:
        """``buf[start:stop] <- src`` along ``d``: ``copy_`` or ``add_`` into a view (``names``:
        of the view and of the write)."""
        dst = rows_view(self.w, buf, d, start, stop, names[0], n.phase, n.module)
        self._write(dst, src, target, names[1], n, dev)

    def _write(self, dst: int, src: int, target: str, name: str, n, dev: str) -> None:
        """``dst <- src`` in place (``copy_`` or ``add_``)."""
        w = self.w
        v = w.values[dst]
        spec = OutSpec(name, w.meta(dst), v.dtype, storage=v.storage, role=v.role)
        w.add_node(name, target, (_ref(dst), _ref(src)), {}, [spec], phase=n.phase,
                   module=n.module, device=dev, mutates=(dst,))

    def _copy_into_buffer(self, root: int, i: int, n, dev: str) -> None:
        g, w = self.g, self.w
        v = g.values[root]
        src = self.part[(root, i)]
        st = v.storage
        if st not in self.buffers:
            self.buffers[st] = self._whole_buffer(v, src, n, dev)
        d = self.r.dims[root]
        o0, o1 = self.rows.owned(root, i)
        c0, c1 = self.rows.covers(root, i)
        if (o0, o1) != (c0, c1):
            src = rows_view(w, src, d, o0 - c0, o1 - c0, f"{v.name}.own{i}", n.phase, n.module)
        if self._rebases(root):
            src = self._rebased(root, src, i, n)
        outer = self.r.outers.get(root, 1)
        if outer > 1:   # NOTE: strided rows (the inner dim of a merged dim): through [outer, ..]
            src = unflattened(w, src, d, outer, f"{v.name}.rows{i}", n.phase, n.module)
            dst = inner_rows(w, self.buffers[st], d, outer, o0, o1, f"{v.name}.slice{i}",
                             n.phase, n.module)
            self._write(dst, src, "aten.copy_.default", f"{v.name}.copy{i}", n, dev)
            return
        self._into_rows(self.buffers[st], d, o0, o1, src, "aten.copy_.default",
                        (f"{v.name}.slice{i}", f"{v.name}.copy{i}"), n, dev)

    def _rebases(self, vid: int) -> bool:
        n = self.g.nodes[self.g.values[vid].producer]
        e = self.r.splits[n.id].outputs[n.outputs.index(vid)]
        return isinstance(e, Along) and e.rebase

    def _index_plane(self, vid: int, i: int, whole: int) -> tuple[tuple[int, ...], int]:
        """(spatial shape, offset along the split dim in whole rows) of the plane max-pool
        indices ``vid`` index in part ``i``: the padded input of the part of the pooling that
        made them, or, made outside the region, the whole input plane of ``whole``."""
        g = self.g
        p = g.values[vid].producer
        if p not in self.inside:
            return g.values[whole].shape[-2:], 0
        split = self.r.splits[p]
        if not any(isinstance(e, Along) and e.rebase for e in split.outputs):
            raise FissionError(f"{g.nodes[p].name} ({g.nodes[p].target}) makes max-pool indices "
                               "through a view in the region: not supported in parts")
        return self._window_plane(p, i)

    def _window_plane(self, nid: int, i: int) -> tuple[tuple[int, ...], int]:
        """(spatial shape, offset in whole rows) of the padded windowed input of node ``nid``'s
        part ``i`` (a pooling's, or its backward's)."""
        split = self.r.splits[nid]
        q = next(q for q, e in enumerate(split.operands) if isinstance(e, Along) and e.window)
        x = operands(self.g.nodes[nid])[q]
        rows = self.rows.reads(nid, q, x, i)
        return self.w.values[self.part_inputs[(nid, i)][q]].shape[-2:], rows.start - rows.pad_lo

    def _split_plane_dim(self, vid: int) -> int:
        """The split dim of a 4-d value, counted from the first spatial dim."""
        return self.r.dims[vid] - (len(self.g.values[vid].shape) - 2)

    def _rebased(self, vid: int, src: int, i: int, n) -> int:
        """Max-pool indices of part ``i`` (positions in its padded input plane) as positions in
        the whole input plane."""
        split = self.r.splits[n.id]
        q = next(q for q, e in enumerate(split.operands) if isinstance(e, Along) and e.window)
        x = operands(n)[q]
        plane, shift = self._index_plane(vid, i, x)
        return rebase_indices(self.w, src, self._split_plane_dim(vid), shift, plane,
                              self.g.values[x].shape[-2:],
                              f"{self.g.values[vid].name}.rebase{i}", n.phase, n.module)

    def _indices_for(self, nid: int, vid: int, part: int, i: int, x_part: int,
                     x_rows) -> int:
        """Indices ``vid`` (a part ``part`` of them) as positions in the padded input plane of
        node ``nid``'s part ``i`` (a max-pool backward, whose input part is ``x_part`` over
        rows ``x_rows``)."""
        n = self.g.nodes[nid]
        x = operands(n)[1]
        src_plane, src_shift = self._index_plane(vid, i, x)
        dst_plane = self.w.values[x_part].shape[-2:]
        dst_shift = x_rows.start - x_rows.pad_lo
        if (src_plane, src_shift) == (dst_plane, dst_shift):
            return part
        return rebase_indices(self.w, part, self._split_plane_dim(vid), src_shift - dst_shift,
                              src_plane, dst_plane, f"{self.g.values[vid].name}.local{i}",
                              n.phase, n.module)

    def _add_overlapping(self, nid: int, j: int, o: int, d: int, i: int, dev: str) -> None:
        """Part ``i``'s input gradient (over its haloed rows) added into the whole, zeroed
        once before the first part: neighbouring parts overlap by the halo and add there."""
        v, n = self.g.values[o], self.g.nodes[nid]
        src = self.part[(o, i)]
        if o not in self.acc:
            self.acc[o] = self._whole_buffer(v, src, n, dev, zeros=True)
        start, stop = self.rows.makes(nid, j, o, i).span
        self._into_rows(self.acc[o], d, start, stop, src, "aten.add_.Tensor",
                        (f"{v.name}.slice{i}", f"{v.name}.add{i}"), n, dev)

    def _combine_mean(self, o: int, wt: int) -> None:
        """A mean-reduced loss from its parts' means and weights, once after the block:
        ``sum(where(w != 0, l * w, 0)) / sum(w)`` over the stacked parts (a part whose weight
        is 0 has a nan mean); the summed weights are the whole total weight."""
        g, w = self.g, self.w
        v, n = g.values[o], g.nodes[g.values[o].producer]
        if v.shape != () or g.values[wt].shape != ():
            raise FissionError(f"{n.name}: only scalar weighted means are combined")
        kw = dict(phase=n.phase, module=n.module, device=self._device(n))
        stacked, scalar = Meta((self.k,), (1,), 0), Meta((), (), 0)
        made_role = part_role(n.phase)

        def step(name, target, args, meta=stacked, dtype=v.dtype, role=made_role, kwargs=None):
            return w.add_node(f"{n.name}.{name}", target, args, kwargs or {},
                              [OutSpec(f"{v.name}.{name}", meta, dtype, role=role)], **kw)[0]

        # NOTE: a half-precision loss is combined in float32 and rounded once at the end, as
        # the loss kernel accumulates: each step in bfloat16 would round again (a few ulps)
        wide = v.dtype in _HALF
        calc = "float32" if wide else v.dtype
        losses = step("losses", "aten.stack.default",
                      ([_ref(self.part[(o, i)]) for i in range(self.k)],))
        ws = step("weights", "aten.stack.default",
                  ([_ref(self.part[(wt, i)]) for i in range(self.k)],))
        if wide:
            losses = self._cast(step, "losses32", losses, calc, stacked)
            ws = self._cast(step, "weights32", ws, calc, stacked)
        prod = step("weighted", "aten.mul.Tensor", (_ref(losses), _ref(ws)), dtype=calc)
        kept = step("kept", "aten.ne.Scalar", (_ref(ws), 0), dtype="bool")
        terms = step("terms", "aten.where.ScalarOther", (_ref(kept), _ref(prod), 0.0),
                     dtype=calc)
        num = step("sum", "aten.sum.default", (_ref(terms),), meta=scalar, dtype=calc)
        wt_role = g.storages[g.values[wt].storage].role
        total = step("total_weight", "aten.sum.default", (_ref(ws),), meta=scalar, dtype=calc,
                     role=made_role if wide else wt_role)
        mean = step("mean", "aten.div.Tensor", (_ref(num), _ref(total)), meta=scalar, dtype=calc,
                    role=made_role if wide else g.storages[v.storage].role)
        if wide:
            mean = self._cast(step, "mean16", mean, v.dtype, scalar, g.storages[v.storage].role)
            total = self._cast(step, "total16", total, g.values[wt].dtype, scalar, wt_role)
        w.whole[o] = mean
        w.storage_map[v.storage] = w.values[w.whole[o]].storage
        if wt in self.leaving:
            w.whole[wt] = total
            w.storage_map[g.values[wt].storage] = w.values[total].storage

    @staticmethod
    def _cast(step, name: str, vid: int, dtype: str, meta: Meta, role: Role | None = None) -> int:
        """``vid`` cast to ``dtype`` by ``step`` (``_combine_mean``'s node maker)."""
        import torch  # NOTE: local (planning modules import without torch): a dtype object

        kw = {} if role is None else {"role": role}
        return step(name, "aten._to_copy.default", (_ref(vid),), meta=meta, dtype=dtype,
                    kwargs={"dtype": getattr(torch, dtype)}, **kw)

    def _finish_block(self) -> None:
        """Map every value that leaves the region to its whole tensor in the new graph."""
        g, w = self.g, self.w
        for o in self.leaving:
            if self.r.dims.get(o) is None:  # NOTE: empty whole tensors (checked in planning)
                w.whole[o] = self.part[(o, self.k - 1)]
                w.storage_map[g.values[o].storage] = w.values[w.whole[o]].storage
        for o, wt in self.mean_weights.items():
            self._combine_mean(o, wt)
        for o, acc in self.acc.items():
            if o in self.leaving:
                w.whole[o] = acc
                w.storage_map[g.values[o].storage] = w.values[acc].storage
        for st, buf in self.buffers.items():
            w.whole[self.root_of[st]] = buf
        for o in self.leaving:
            if o in w.whole:
                continue
            v = g.values[o]
            base = self._whole_base(v.storage, o)
            meta = Meta(v.shape, v.stride, v.storage_offset)
            if w.meta(base) == meta:
                w.whole[o] = base
                continue
            n = g.nodes[v.producer]
            spec = OutSpec(v.name, meta, v.dtype, storage=w.values[base].storage,
                           role=w.values[base].role)
            w.whole[o] = w.add_node(f"{v.name}.whole", "aten.as_strided.default",
                                    (_ref(base), list(v.shape), list(v.stride), v.storage_offset),
                                    {}, [spec], phase=n.phase, module=n.module,
                                    device=self._device(n))[0]

    def _whole_base(self, storage: int, o: int) -> int:
        """A whole new value living in ``storage`` (made before or by the block)."""
        g, w = self.g, self.w
        if storage in self.root_of:
            root = self.root_of[storage]
            if root not in w.whole:
                raise FissionError(f"{g.values[o].name} is a view of "
                                   f"{g.values[root].name}, which the region does not assemble")
            return w.whole[root]
        for vid, new in w.whole.items():
            if g.values[vid].storage == storage:
                return new
        raise FissionError(f"{g.values[o].name}: no whole tensor of its storage exists")
