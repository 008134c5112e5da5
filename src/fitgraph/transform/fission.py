"""Operator fission: run a region of the graph in k parts along one split dimension.

``split_region(graph, region, k)`` returns a rewritten Graph that every planner, the simulator
and the executor handle unchanged. The region's nodes (``graph.dim_region``) are replaced by k
copies, ``<orig>.part<i>``, run one part after the other, so a part's intermediates are freed
before the next part starts:

- a part reads slices of the region's inputs (``aten.slice``: views, no copies) and the inputs
  the region reads whole;
- an output the rest of the graph reads is assembled in a preallocated whole tensor
  (``new_empty_strided`` with the original layout, each part ``copy_``-ed into its slice right
  after its last write), or, for a partial result (``Reduced``), summed in place into the first
  part's output (weight gradients; products accumulate with ``addmm_``), or re-weighted once
  after the parts (a mean-reduced loss: ``sum(loss_i * w_i) / sum(w_i)``, skipping parts whose
  weight is 0); views of those leave through ``as_strided``;
- size arguments are rewritten per part (``dims.part_args``); FLOPs scale with the part.

The region's peak drops to about 1/k of its activations. Calling ``split_region`` again on the
result, with a region grown in it, splits further (a part split along another dim). Regions
with a halo (a convolution split spatially) are refused with ``FissionError`` for now.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, ValueRef
    >>> from fitgraph.graph.dim_region import grow_region
    >>> from fitgraph.transform.fission import split_region
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (8, 4), "float32", Role.INPUT)
    >>> w = b.add_input("w", (4, 6), "float32", Role.PARAMETER)
    >>> h = b.add_node("aten.mm.default", [x, w], [((8, 6), "float32")], name="mm")[0]
    >>> y = b.add_node("aten.relu.default", [h], [((8, 6), "float32")], name="relu")[0]
    >>> s = b.add_node("aten.sum.default", [y], [((), "float32")], name="sum")[0]
    >>> g = b.finish({"loss": s})
    >>> g2 = split_region(g, grow_region(g, x, 0), 2)
    >>> [n.name for n in g2.nodes if n.target != "aten.slice.Tensor"]
    ['mm.part0', 'relu.part0', 'sum.part0', 'mm.part1', 'relu.part1', 'sum.part1', 'sum.acc1']
    >>> g2.values[g2.outputs["loss"]].shape
    ()
"""

from __future__ import annotations

from ..graph.analysis import new_storages, users, verify_graph
from ..graph.dim_region import Region
from ..graph.dim_types import Along, Reduced
from ..graph.dims import operands, part_args
from ..graph.ir import Graph, Phase, Role, contiguous_strides
from .fission_meta import VIEW_TARGETS, Meta, dense_like, narrow, view_meta
from .fission_order import FissionError, block_order, part_bounds
from .fission_writer import GraphWriter, OutSpec, substitute_refs

__all__ = ["FissionError", "part_bounds", "split_region"]

_RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")

# NOTE: kernels that read these operands (``dims.operands`` positions) as flat contiguous arrays
# without checking: a part's strided slice gives wrong numbers (layer norm backward's mean/rstd)
# or an error (group norm); the part gets a contiguous copy of its slice. Found by running
# every zoo split on uncopied slices.
# NOTE: products whose partial sums a part adds in place into the first part's result
# (``acc.addmm_(a, b)``): no second whole-size partial (a tied LM head's weight gradient is as
# large as the embedding)
ACCUMULATE = {"aten.mm.default": "aten.addmm_.default", "aten.bmm.default": "aten.baddbmm_.default"}

MUST_BE_CONTIGUOUS = {
    "aten.native_layer_norm_backward.default": (2, 3),
    "aten.native_group_norm.default": (0,),
    "aten.native_group_norm_backward.default": (0, 1, 2, 3),
}


def split_region(graph: Graph, region: Region, k: int) -> Graph:
    """A new graph in which ``region`` runs in ``k`` parts (see the module doc)."""
    return _Splitter(graph, region, k).run()


def _part_role(phase: Phase) -> Role:
    return Role.ACTIVATION if phase in (Phase.FORWARD, Phase.LOSS) else Role.TEMPORARY


class _Splitter:
    def __init__(self, graph: Graph, region: Region, k: int) -> None:
        if not region.nodes:
            raise FissionError("the region is empty: nothing to split")
        if region.halo or region.length == 0:
            raise FissionError("regions with a halo (convolutions or pooling split spatially) "
                               "are not executable yet: split along batch or channels")
        self.g, self.r, self.k = graph, region, k
        self.bounds = part_bounds(region.length, k)
        self.inside = set(region.nodes)
        for vid, d in region.dims.items():
            if isinstance(d, int) and vid not in region.units:
                raise FissionError(f"{graph.values[vid].name} has no unit along dim {d}")
        self.w = GraphWriter(graph)
        self.part: dict[tuple[int, int], int] = {}     # (old value, part) -> new value
        self.slices: dict[tuple[int, int], int] = {}
        self._plan_outputs()

    # -- what leaves the region -----------------------------------------------------------------
    def _plan_outputs(self) -> None:
        g, inside = self.g, self.inside
        readers = users(g)
        graph_outs = set(g.outputs.values())
        produced = [o for nid in self.r.nodes for o in g.nodes[nid].outputs if o is not None]
        leaving = [v for v in produced
                   if v in graph_outs or any(u not in inside for u in readers[v])]
        fresh = new_storages(g)
        self.root_of: dict[int, int] = {}             # region-fresh storage -> its first value
        for nid in self.r.nodes:
            for st in fresh[nid]:
                self.root_of[st] = next(o for o in g.nodes[nid].outputs
                                        if o is not None and g.values[o].storage == st)
        self.leaving = leaving
        self.leaving_roots = sorted({g.values[v].storage for v in leaving} & set(self.root_of))
        self.last_write: dict[int, int] = {}          # storage -> last region node writing it
        for nid in self.r.nodes:
            n = g.nodes[nid]
            for v in list(n.mutates) + [o for o in n.outputs if o is not None]:
                if v in n.mutates or g.values[v].storage in fresh[nid]:
                    self.last_write[g.values[v].storage] = nid
        for v in leaving:
            e = self.r.dims.get(v)
            if e is None:
                raise FissionError(f"{g.values[v].name} is produced whole by every part and "
                                   "read after the region: not supported")
        self.mean_weights: dict[int, int] = {}        # loss value -> its weight value
        for nid in self.r.nodes:
            n = g.nodes[nid]
            for o, e in zip(n.outputs, self.r.splits[nid].outputs):
                if isinstance(e, Reduced) and e.how == "weighted_mean" and o in leaving:
                    self.mean_weights[o] = n.outputs[e.weight]
                if isinstance(e, Reduced) and e.overlap is not None:
                    raise FissionError("overlapping partial results (halo) are not supported")

    # -- the rewrite ----------------------------------------------------------------------------
    def run(self) -> Graph:
        g, w = self.g, self.w
        before, after = block_order(g, self.r.nodes)
        for nid in before:
            w.copy_node(g.nodes[nid])
        self.buffers: dict[int, int] = {}             # storage -> new whole buffer value
        self.acc: dict[int, int] = {}                 # Reduced value -> accumulated new value
        for i, (a, b) in enumerate(self.bounds):
            for nid in self.r.nodes:
                self._emit_part(nid, i, a, b)
                self._after_part_node(nid, i, a, b)
        self._finish_block()
        for nid in after:
            w.copy_node(g.nodes[nid])
        meta = dict(g.meta)
        meta["fission"] = list(meta.get("fission", [])) + [{
            "start": g.values[self.r.start[0]].name, "dim": self.r.start[1], "k": self.k,
            "nodes": len(self.r.nodes)}]
        out = w.finish(meta)
        verify_graph(out)
        return out

    def _units(self, vid: int, a: int, b: int) -> tuple[int, int]:
        u = self.r.units[vid]
        return a * u, (b - a) * u

    def _input_part(self, vid: int, i: int, a: int, b: int, phase: Phase, module: str) -> int:
        """The part of a value the region reads along its dim: its slice if made outside."""
        g, w = self.g, self.w
        if self.g.values[vid].producer in self.inside:
            return self.part[(vid, i)]
        if (vid, i) not in self.slices:
            d = self.r.dims[vid]
            start, n = self._units(vid, a, b)
            base = w.whole[vid]
            v = g.values[vid]
            spec = OutSpec(f"{v.name}.part{i}", narrow(w.meta(base), d, start, n), v.dtype,
                           storage=w.values[base].storage, role=w.values[base].role)
            self.slices[(vid, i)] = w.add_node(
                f"{v.name}.slice{i}", "aten.slice.Tensor", (_ref(base), d, start, start + n), {},
                [spec], phase=phase, module=module, device=w.device_of(base))[0]
        return self.slices[(vid, i)]

    def _emit_part(self, nid: int, i: int, a: int, b: int) -> None:
        g, w, r = self.g, self.w, self.r
        n = g.nodes[nid]
        split = r.splits[nid]
        ops = operands(n)
        ins: list[int] = []
        for vid, e in zip(ops, split.operands):
            if e is None and vid in n.mutates:
                raise FissionError(f"{n.name} writes {g.values[vid].name} in place whole: "
                                   "every part would write it again")
            if e is None:
                if g.values[vid].producer in self.inside:
                    raise FissionError(f"{n.name} reads {g.values[vid].name} whole, but the "
                                       "region makes it in parts")
                ins.append(w.whole[vid])
            else:
                ins.append(self._input_part(vid, i, a, b, n.phase, n.module))
        for q in MUST_BE_CONTIGUOUS.get(n.target, ()):
            ins[q] = self._contiguous(ins[q], n, i)
        in_shapes = [w.values[v].shape for v in ins]
        out_shapes = []
        for o, e in zip(n.outputs, split.outputs):
            if o is None:
                out_shapes.append(None)
                continue
            shape = list(g.values[o].shape)
            if isinstance(e, Along):
                shape[e.dim] = self._units(o, a, b)[1]
            out_shapes.append(tuple(shape))
        args, kwargs = part_args(n, split, in_shapes, out_shapes)
        it = iter(ins)
        args, kwargs = substitute_refs(args, it), substitute_refs(kwargs, it)
        target = n.target
        specs: list[OutSpec | None] = []
        for j, (o, shape) in enumerate(zip(n.outputs, out_shapes)):
            if o is None:
                specs.append(None)
                continue
            spec, target = self._out_spec(n, j, o, shape, ops, ins, args, target, i)
            specs.append(spec)
        mutated = [ins[ops.index(v)] for v in n.mutates]
        flops = n.flops * (b - a) / r.length
        o = n.outputs[0]
        if i > 0 and n.target in ACCUMULATE and self._accumulated(o):
            acc = self.acc[o]
            target, args = ACCUMULATE[n.target], (_ref(acc),) + tuple(args)
            mutated = [acc]
            specs = [OutSpec(f"{g.values[o].name}.acc{i}", w.meta(acc), g.values[o].dtype,
                             storage=w.values[acc].storage, role=w.values[acc].role)]
        outs = w.add_node(f"{n.name}.part{i}", target, args, kwargs, specs, phase=n.phase,
                          module=n.module, device=self._device(n), mutates=tuple(mutated),
                          random=n.random, flops=flops, out_is_tuple=n.out_is_tuple)
        if target in ACCUMULATE.values():
            self.acc[o] = outs[0]
            return
        for o, new in zip(n.outputs, outs):
            if o is not None:
                self.part[(o, i)] = new

    def _contiguous(self, vid: int, n, i: int) -> int:
        """``vid`` itself if contiguous, else a contiguous copy made just before ``n``'s part."""
        w = self.w
        v = w.values[vid]
        want = contiguous_strides(v.shape)
        if all(a == b for a, b, size in zip(v.stride, want, v.shape) if size != 1):
            return vid
        spec = OutSpec(f"{v.name}.contiguous", Meta(v.shape, want, 0), v.dtype,
                       role=_part_role(n.phase))
        return w.add_node(f"{v.name}.contiguous", "aten.contiguous.default", (_ref(vid),), {},
                          [spec], phase=n.phase, module=n.module, device=w.device_of(vid))[0]

    def _device(self, n) -> str:
        vids = [o for o in n.outputs if o is not None] or list(n.inputs)
        return self.g.storages[self.g.values[vids[0]].storage].device

    def _out_spec(self, n, j: int, o: int, shape, ops: list[int], ins: list[int], args,
                  target: str, i: int) -> tuple[OutSpec, str]:
        """The layout and storage of output ``j`` of a part (and the target, which a view that
        cannot be made turns into a reshape that copies)."""
        g, w = self.g, self.w
        v = g.values[o]
        name = f"{v.name}.part{i}"
        role = _part_role(n.phase)
        if self._is_acc(o, i):
            role = g.storages[v.storage].role
        alias = next((q for q, u in enumerate(ops) if g.values[u].storage == v.storage), None)
        if alias is None:
            meta = Meta(tuple(shape), dense_like(tuple(shape), v.stride), 0)
            return OutSpec(name, meta, v.dtype, role=role), target
        base = ins[alias]
        if ops[alias] in n.mutates:
            return OutSpec(name, w.meta(base), v.dtype, storage=w.values[base].storage,
                           role=w.values[base].role), target
        if n.target not in VIEW_TARGETS:
            raise FissionError(f"{n.name} ({n.target}) returns a view of its input; no layout "
                               "rule says which (add one to transform/fission_meta.py)")
        meta = view_meta(n.target, args, [w.meta(base)], j)
        if meta is None:
            if n.target not in _RESHAPES:
                raise FissionError(f"{n.name}: ATen cannot make this view of a part")
            self._check_no_write_through(n, v.storage)
            size = tuple(shape)
            meta = Meta(size, dense_like(size, tuple(range(len(size), 0, -1))), 0)
            return OutSpec(name, meta, v.dtype, role=role), "aten.reshape.default"
        return OutSpec(name, meta, v.dtype, storage=w.values[base].storage,
                       role=w.values[base].role), target

    def _check_no_write_through(self, n, storage: int) -> None:
        """A part's view became a copy: no later region node may write through it (the write
        would miss the viewed tensor)."""
        for nid in self.r.nodes:
            if nid > n.id and any(self.g.values[m].storage == storage
                                  for m in self.g.nodes[nid].mutates):
                raise FissionError(f"{n.name}: a part's view must be a copy, and "
                                   f"{self.g.nodes[nid].name} writes through it")

    def _accumulated(self, o: int | None) -> bool:
        """True for a partial sum the parts add up in place (one that leaves the region, and
        does not weigh a mean: those are combined with it, see ``_combine_mean``)."""
        e = self.r.dims.get(o)
        return isinstance(e, Reduced) and e.how == "sum" and o in self.leaving \
            and o not in self.mean_weights.values()

    def _is_acc(self, o: int, i: int) -> bool:
        return i == 0 and self._accumulated(o)

    # -- combining the parts --------------------------------------------------------------------
    def _after_part_node(self, nid: int, i: int, a: int, b: int) -> None:
        g, w, r = self.g, self.w, self.r
        n = g.nodes[nid]
        dev = self._device(n)
        for st in self.leaving_roots:
            root = self.root_of[st]
            if self.last_write[st] != nid or not isinstance(r.dims[root], int):
                continue
            self._copy_into_buffer(root, i, a, b, n, dev)
        for o, e in zip(n.outputs, r.splits[nid].outputs):
            if not isinstance(e, Reduced):
                continue
            if self._accumulated(o):
                if i == 0:
                    self.acc[o] = self.part[(o, 0)]
                elif n.target not in ACCUMULATE:
                    acc = self.acc[o]
                    spec = OutSpec(f"{g.values[o].name}.acc{i}", w.meta(acc), g.values[o].dtype,
                                   storage=w.values[acc].storage, role=w.values[acc].role)
                    self.acc[o] = w.add_node(
                        f"{n.name}.acc{i}", "aten.add_.Tensor", (_ref(acc), _ref(self.part[(o, i)])),
                        {}, [spec], phase=n.phase, module=n.module, device=dev,
                        mutates=(acc,))[0]

    def _copy_into_buffer(self, root: int, i: int, a: int, b: int, n, dev: str) -> None:
        g, w = self.g, self.w
        v = g.values[root]
        src = self.part[(root, i)]
        st = v.storage
        if st not in self.buffers:
            meta = Meta(v.shape, v.stride, v.storage_offset)
            spec = OutSpec(f"{v.name}", meta, v.dtype, role=g.storages[st].role)
            self.buffers[st] = w.add_node(
                f"{v.name}.buffer", "aten.new_empty_strided.default",
                (_ref(src), list(v.shape), list(v.stride)), {}, [spec], phase=n.phase,
                module=n.module, device=dev)[0]
            w.storage_map[st] = w.values[self.buffers[st]].storage
        buf = self.buffers[st]
        d = self.r.dims[root]
        start, length = self._units(root, a, b)
        dst_spec = OutSpec(f"{v.name}.slice{i}", narrow(w.meta(buf), d, start, length), v.dtype,
                           storage=w.values[buf].storage, role=w.values[buf].role)
        dst = w.add_node(f"{v.name}.slice{i}", "aten.slice.Tensor",
                         (_ref(buf), d, start, start + length), {}, [dst_spec], phase=n.phase,
                         module=n.module, device=dev)[0]
        spec = OutSpec(f"{v.name}.copy{i}", w.meta(dst), v.dtype, storage=w.values[dst].storage,
                       role=w.values[dst].role)
        w.add_node(f"{v.name}.copy{i}", "aten.copy_.default", (_ref(dst), _ref(src)), {}, [spec],
                   phase=n.phase, module=n.module, device=dev, mutates=(dst,))

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
        part_role = _part_role(n.phase)

        def step(name, target, args, meta=stacked, dtype=v.dtype, role=part_role):
            return w.add_node(f"{n.name}.{name}", target, args, {},
                              [OutSpec(f"{v.name}.{name}", meta, dtype, role=role)], **kw)[0]

        losses = step("losses", "aten.stack.default",
                      ([_ref(self.part[(o, i)]) for i in range(self.k)],))
        ws = step("weights", "aten.stack.default",
                  ([_ref(self.part[(wt, i)]) for i in range(self.k)],))
        prod = step("weighted", "aten.mul.Tensor", (_ref(losses), _ref(ws)))
        kept = step("kept", "aten.ne.Scalar", (_ref(ws), 0), dtype="bool")
        terms = step("terms", "aten.where.ScalarOther", (_ref(kept), _ref(prod), 0.0))
        num = step("sum", "aten.sum.default", (_ref(terms),), meta=scalar)
        total = step("total_weight", "aten.sum.default", (_ref(ws),), meta=scalar,
                     role=g.storages[g.values[wt].storage].role)
        w.whole[o] = step("mean", "aten.div.Tensor", (_ref(num), _ref(total)), meta=scalar,
                          role=g.storages[v.storage].role)
        w.storage_map[v.storage] = w.values[w.whole[o]].storage
        if wt in self.leaving:
            w.whole[wt] = total
            w.storage_map[g.values[wt].storage] = w.values[total].storage

    def _finish_block(self) -> None:
        """Map every value that leaves the region to its whole tensor in the new graph."""
        g, w = self.g, self.w
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


def _ref(vid: int):
    from ..graph.ir import ValueRef

    return ValueRef(vid)
