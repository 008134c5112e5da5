"""Operator fission: run a region of the graph in k parts along one split dimension.

``split_region(graph, region, k)`` returns a rewritten Graph that every planner, the simulator
and the executor handle unchanged. The region's nodes (``graph.dim_region``) are replaced by k
copies, ``<orig>.part<i>``, run one part after the other, so a part's intermediates are freed
before the next part starts:

- a part reads slices of the region's inputs (``aten.slice``: views, no copies) and the inputs
  the region reads whole;
- an output the rest of the graph reads is assembled (``fission_combine``) in a preallocated
  whole tensor
  (``new_empty_strided`` with the original layout, each part ``copy_``-ed into its slice right
  after its last write), or, for a partial result (``Reduced``), summed in place into the first
  part's output (weight gradients; products accumulate with ``addmm_``), or re-weighted once
  after the parts (a mean-reduced loss: ``sum(loss_i * w_i) / sum(w_i)``, skipping parts whose
  weight is 0); views of those leave through ``as_strided``; a partial sum the graph then adds
  to a running sum nothing else reads is accumulated into that sum (``sums_in_place``);
- size arguments are rewritten per part (``dims.part_args``); FLOPs scale with the part.

The region's peak drops to about 1/k of its activations. Calling ``split_region`` again on the
result, with a region grown in it, splits further (a part split along another dim).

Which rows of each tensor a part reads and makes comes from a row planner
(``fission_rows.UnitRows``: one axis of units). A region split spatially through convolutions,
pooling or resampling has a halo (``fission_halo.HaloRows``): a part reads its input rows with
the halo its windows need (a view; zero rows added only at the border of the whole tensor,
``fission_halo_nodes``), computes intermediates with their own halo, and keeps its own block;
input gradients of neighbouring parts that overlap add into a zeroed whole tensor; max-pool
indices are rebased to the whole plane. What cannot be done exactly raises ``FissionError``
naming the node.

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

    Two 3x3 convolutions split along the rows of an 8x8 image: each part reads 6 input rows
    (its 4 + a halo of 2), padded by one zero row at the image's border only; the first
    convolution makes 5 rows, the second the part's 4:

    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (1, 1, 8, 8), "float32", Role.INPUT)
    >>> w = b.add_input("w", (1, 1, 3, 3), "float32", Role.PARAMETER)
    >>> conv = lambda v: (ValueRef(v), ValueRef(w), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    >>> h = b.add_node("aten.convolution.default", [x, w], [((1, 1, 8, 8), "float32")],
    ...                args=conv(x), name="conv")[0]
    >>> y = b.add_node("aten.convolution.default", [h, w], [((1, 1, 8, 8), "float32")],
    ...                args=conv(h), name="conv2")[0]
    >>> g = b.finish({"loss": y})
    >>> g2 = split_region(g, grow_region(g, x, 2), 2)
    >>> [(n.name, g2.values[n.outputs[0]].shape[2]) for n in g2.nodes][:5]
    [('x.slice0', 6), ('x.pad0', 7), ('conv.part0', 5), ('conv.pad0', 6), ('conv2.part0', 4)]
"""

from __future__ import annotations

from ..graph.analysis import new_storages, users, verify_graph
from ..graph.dim_region import Region, adds_whole
from ..graph.dim_rules import SHAPE_ONLY
from ..graph.dim_rules_index import MADE_ALIKE
from ..graph.dim_types import Along, Reduced
from ..graph.dims import operands, part_args
from ..graph.ir import Graph, Phase, contiguous_strides
from .fission_combine import ACCUMULATE, THREADED, PartsCombiner, part_role
from .fission_halo import HaloRows
from .fission_halo_nodes import pad_rows, rows_view
from .fission_meta import VIEW_TARGETS, Meta, dense_like, narrow, view_meta
from .fission_order import FissionError, block_order, part_bounds, real_writes
from .fission_outer import inner_part
from .fission_rows import Rows, UnitRows
from .fission_writer import GraphWriter, OutSpec, substitute_refs
from .sums_in_place import sums_in_place

__all__ = ["FissionError", "part_bounds", "split_region"]

_RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")

# NOTE: kernels that read these operands (``dims.operands`` positions) as flat contiguous arrays
# without checking: a part's strided slice gives wrong numbers (layer norm backward's mean/rstd)
# or an error (group norm); the part gets a contiguous copy of its slice. Found by running
# every zoo split on uncopied slices.
MUST_BE_CONTIGUOUS = {
    "aten.native_layer_norm_backward.default": (2, 3),
    "aten.native_group_norm.default": (0,),
    "aten.native_group_norm_backward.default": (0, 1, 2, 3),
}


def split_region(graph: Graph, region: Region, k: int, *, verify: bool = True) -> Graph:
    """A new graph in which ``region`` runs in ``k`` parts (see the module doc). ``verify``:
    check the IR invariants of the result (``verify_graph``); a search that makes many split
    graphs and keeps one may verify only the one it keeps."""
    return _Splitter(graph, region, k).run(verify)


class _Splitter(PartsCombiner):
    def __init__(self, graph: Graph, region: Region, k: int) -> None:
        if not region.nodes:
            why = "".join(f"; {graph.nodes[n].name}: {r}" for n, r in region.boundary.items())
            raise FissionError(f"the region is empty: nothing to split{why}")
        self.g, self.r, self.k = graph, region, k
        if graph.meta.get("backward_after_forward") and len(
                {graph.nodes[n].phase is Phase.BACKWARD for n in region.nodes}) > 1:
            # NOTE: a compiled region's backward runs only once its whole forward has run
            # (capture.joint): parts that interleave the two cannot run there
            raise FissionError("the region spans the forward and the backward of a compiled "
                               "graph, whose backward starts after its whole forward")
        if not region.halo:
            if region.length == 0:
                raise FissionError("the region has no split axis in units: nothing says where "
                                   "its parts start")
            for vid, d in region.dims.items():
                if isinstance(d, int) and vid not in region.units:
                    raise FissionError(f"{graph.values[vid].name} has no unit along dim {d}")
        elif k < 2:
            part_bounds(0, k)  # NOTE: the same error as for any region
        if region.halo and region.outers:
            raise FissionError("a region split through windows and along the inner dim of a "
                               "merged dim: not supported")
        self.inside = set(region.nodes)
        self.w = GraphWriter(graph)
        self.part: dict[tuple[int, int], int] = {}     # (old value, part) -> new value
        self.slices: dict[tuple, int] = {}             # (value, part, rows) -> view / padded
        self.part_inputs: dict[tuple[int, int], list[int]] = {}   # (node, part) -> its inputs
        self._plan_outputs()
        if region.halo:
            owned = [self.root_of[st] for st in self.leaving_roots
                     if isinstance(region.dims.get(self.root_of[st]), int)]
            self.rows: HaloRows | UnitRows = HaloRows(graph, region, k, owned)
        else:
            self.rows = UnitRows(graph, region, k)

    # -- what leaves the region -----------------------------------------------------------------
    def _plan_outputs(self) -> None:
        g, inside = self.g, self.inside
        readers = users(g)
        graph_outs = set(g.outputs.values())
        produced = [o for nid in self.r.nodes for o in g.nodes[nid].outputs if o is not None]
        # NOTE: a shape-only reader (a dropout's ``empty_like`` blank) runs before the block,
        # made from the shape alone (``GraphWriter._shape_only``): it keeps no whole copy live
        leaving = [v for v in produced
                   if v in graph_outs or any(u not in inside and g.nodes[u].target not in
                                             SHAPE_ONLY for u in readers[v])]
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
        summed = {v for nid in self.r.nodes
                  for v, e in zip(operands(g.nodes[nid]), self.r.splits[nid].operands)
                  if isinstance(e, Reduced)}
        for v in leaving:
            if v in summed:
                raise FissionError(f"{g.values[v].name} is a partial sum read after the region "
                                   "and summed with others in it: not supported")
            e = self.r.dims.get(v)
            # NOTE: an empty tensor (evaluation batch norm's saved statistics) is the same
            # whole tensor in every part: the last part's leaves
            if e is None and g.values[v].numel and not self._made_alike(v):
                raise FissionError(f"{g.values[v].name} is produced whole by every part and "
                                   "read after the region: not supported")
        self.mean_weights: dict[int, int] = {}        # loss value -> its weight value
        for nid in self.r.nodes:
            n = g.nodes[nid]
            for o, e in zip(n.outputs, self.r.splits[nid].outputs):
                if isinstance(e, Reduced) and e.how == "weighted_mean" and o in leaving:
                    self.mean_weights[o] = n.outputs[e.weight]
                if isinstance(e, Along) and e.rebase and o is not None:
                    # NOTE: positions in a part's own slice: only a reader that rebases them
                    # to its own slice (a max-pool backward) may read them in the region
                    inner = [g.nodes[u].name for u in readers[o] if u in inside and not any(
                        isinstance(a, Along) and a.rebase for v, a in zip(
                            operands(g.nodes[u]), self.r.splits[u].operands) if v == o)]
                    if inner:
                        raise FissionError(f"{n.name}: its max-pool indices are read inside the "
                                           f"region (by {inner[0]}): they are positions in a "
                                           "part's own slice; not supported")

        self._direct_sums(readers)

    def _direct_sums(self, readers: dict[int, list[int]]) -> None:
        """Products whose partial sums reach an accumulated output through views alone
        (attention's ``dV = P^T dO``, viewed back to ``[B, H, T, d]``): every part's product
        accumulates into the first part's in place (``baddbmm_``), and the views are made
        once, by the first part. Else each part made a whole-size product and added it: two
        whole tensors at once (BEiT's smallest peak held two of each).

        ``direct_roots``: such products' outputs; ``direct_views``: the view nodes between;
        ``direct_leaving``: the accumulated outputs they reach."""
        g, inside = self.g, self.inside
        self.direct_roots: set[int] = set()
        self.direct_views: set[int] = set()
        self.direct_leaving: set[int] = set()
        for nid in self.r.nodes:
            n = g.nodes[nid]
            o = n.outputs[0] if n.outputs else None
            e = self.r.splits[nid].outputs[0] if n.outputs else None
            if (n.target not in ACCUMULATE or o is None or o in self.leaving
                    or not isinstance(e, Reduced) or e.how != "sum" or e.overlap is not None):
                continue
            v, views = o, []
            while not self._accumulated(v):
                nxt = readers[v]
                if len(nxt) != 1 or nxt[0] not in inside or v in self.leaving:
                    break
                u = g.nodes[nxt[0]]
                ue = self.r.splits[u.id].outputs[0] if u.outputs else None
                if (u.target not in VIEW_TARGETS or u.mutates or len(u.outputs) != 1
                        or u.outputs[0] is None or not isinstance(ue, Reduced)
                        or g.values[u.outputs[0]].storage != g.values[o].storage):
                    break
                views.append(u.id)
                v = u.outputs[0]
            if views and self._accumulated(v) and not any(u in inside for u in readers[v]):
                self.direct_roots.add(o)
                self.direct_views.update(views)
                self.direct_leaving.add(v)

    # -- the rewrite ----------------------------------------------------------------------------
    def run(self, verify: bool = True) -> Graph:
        g, w = self.g, self.w
        before, after = block_order(g, self.r.nodes)
        for nid in before:
            w.copy_node(g.nodes[nid])
        self.buffers: dict[int, int] = {}             # storage -> new whole buffer value
        self.acc: dict[int, int] = {}                 # Reduced value -> accumulated new value
        for i in range(self.k):
            for nid in self.r.nodes:
                self._emit_part(nid, i)
                self._after_part_node(nid, i)
        self._finish_block()
        for nid in after:
            w.copy_node(g.nodes[nid])
        meta = dict(g.meta)
        meta["fission"] = list(meta.get("fission", [])) + [{
            "start": g.values[self.r.start[0]].name, "dim": self.r.start[1], "k": self.k,
            "nodes": len(self.r.nodes), "halo": self.r.halo}]
        out = w.finish(meta)
        if verify:
            verify_graph(out)
        # NOTE: a weight gradient's parts accumulate into the running sum it is added to
        # (ALBERT's shared layer: one whole accumulator per use beside the sum, at its peak)
        return sums_in_place(out, verify)

    def _input_part(self, vid: int, e: Along, rows: Rows, i: int, phase: Phase,
                    module: str) -> int:
        """The rows of a value a part reads along its dim: a view of the part that made it (or
        the part itself), or a slice of the whole if made outside; padded at the border."""
        g, w = self.g, self.w
        v = g.values[vid]
        d = e.dim
        padded = rows.pad_lo or rows.pad_hi
        key = (vid, i, rows, e.window.fill if padded else None)   # NOTE: zero and -inf pads
        if key in self.slices:
            return self.slices[key]
        if v.producer in self.inside:
            base = self.part[(vid, i)]
            c0, c1 = self.rows.covers(vid, i)
            if (rows.start, rows.stop) != (c0, c1):
                base = rows_view(w, base, d, rows.start - c0, rows.stop - c0,
                                 f"{v.name}.view{i}", phase, module)
        elif self.r.outers.get(vid, 1) > 1:   # NOTE: never padded: no halo with outers
            base = inner_part(w, w.whole[vid], d, self.r.outers[vid], rows.start, rows.stop,
                              f"{v.name}.part{i}", phase, module)
        else:
            base = w.whole[vid]
            spec = OutSpec(f"{v.name}.part{i}",
                           narrow(w.meta(base), d, rows.start, rows.stop - rows.start), v.dtype,
                           storage=w.values[base].storage, role=w.values[base].role)
            base = w.add_node(
                f"{v.name}.slice{i}", "aten.slice.Tensor", (_ref(base), d, rows.start, rows.stop),
                {}, [spec], phase=phase, module=module, device=w.device_of(base))[0]
        if padded:
            base = pad_rows(w, base, d, rows.pad_lo, rows.pad_hi, e.window.fill,
                            f"{v.name}.pad{i}", phase, module)
        self.slices[key] = base
        return base

    def _emit_part(self, nid: int, i: int) -> None:
        g, w, r = self.g, self.w, self.r
        n = g.nodes[nid]
        split = r.splits[nid]
        ops = operands(n)
        if i > 0 and nid in self.direct_views:
            return  # NOTE: the first part's views see every part's product (``_direct_sums``)
        if i > 0 and adds_whole(split):
            # NOTE: the first part added the whole tensor to its partial sum; the others pass
            # theirs on, and the parts' sum is the whole plus every partial sum
            partial = next(v for v, e in zip(ops, split.operands) if isinstance(e, Reduced))
            self.part[(n.outputs[0], i)] = self.part[(partial, i)]
            return
        ins: list[int] = []
        for vid, e in zip(ops, split.operands):
            if isinstance(e, Reduced):   # NOTE: a sum of partial sums reads its part's own
                ins.append(self.part[(vid, i)])
                continue
            if e is None and vid in real_writes(n):
                raise FissionError(f"{n.name} writes {g.values[vid].name} in place whole: "
                                   "every part would write it again")
            if e is None:
                if g.values[vid].producer in self.inside:
                    if not g.values[vid].numel or self._made_alike(vid):
                        # NOTE: empty, or zeros of a given size: every part made it alike
                        ins.append(self.part[(vid, i)])
                        continue
                    raise FissionError(f"{n.name} reads {g.values[vid].name} whole, but the "
                                       "region makes it in parts")
                ins.append(w.whole[vid])
            else:
                rows = self.rows.reads(nid, len(ins), vid, i)
                part = self._input_part(vid, e, rows, i, n.phase, n.module)
                if e.rebase:  # NOTE: max-pool indices, read by its backward
                    x_rows = self.rows.reads(nid, 1, ops[1], i)
                    part = self._indices_for(nid, vid, part, i, ins[1], x_rows)
                ins.append(part)
        for q in MUST_BE_CONTIGUOUS.get(n.target, ()):
            ins[q] = self._contiguous(ins[q], n, i)
        self.part_inputs[(nid, i)] = ins
        in_shapes = [w.values[v].shape for v in ins]
        out_shapes = []
        for j, (o, e) in enumerate(zip(n.outputs, split.outputs)):
            if o is None:
                out_shapes.append(None)
                continue
            shape = list(g.values[o].shape)
            along = e.overlap if isinstance(e, Reduced) else e
            if isinstance(along, Along):
                shape[along.dim] = self.rows.makes(nid, j, o, i).size * self.r.outers.get(o, 1)
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
        flops = n.flops * self.rows.share(nid, i)
        o = n.outputs[0]
        threaded = n.target in THREADED and isinstance(split.outputs[0], Reduced)
        if threaded and not self._accumulated(o):
            raise FissionError(f"{n.name}: its parts add into the one before's result, which "
                               "is read inside the region: not supported")
        if i > 0 and (threaded or n.target in ACCUMULATE) and (
                self._accumulated(o) or o in self.direct_roots):
            acc = self.acc[o]
            # NOTE: a product adds into the accumulator (``addmm_``); a scatter adds its rows
            # into the parts' result so far in place of its base, so the base is added once
            target, args = ((THREADED[n.target], (_ref(acc),) + tuple(args)[1:]) if threaded
                            else (ACCUMULATE[n.target], (_ref(acc),) + tuple(args)))
            mutated = [acc]
            specs = [OutSpec(f"{g.values[o].name}.acc{i}", w.meta(acc), g.values[o].dtype,
                             storage=w.values[acc].storage, role=w.values[acc].role)]
        outs = w.add_node(f"{n.name}.part{i}", target, args, kwargs, specs, phase=n.phase,
                          module=n.module, device=self._device(n), mutates=tuple(mutated),
                          random=n.random, flops=flops, out_is_tuple=n.out_is_tuple)
        if target in ACCUMULATE.values() or target in THREADED.values():
            self.acc[o] = outs[0]
            return
        for j, (o, new) in enumerate(zip(n.outputs, outs)):
            if o is not None:
                self.part[(o, i)] = self._cropped(nid, j, o, new, i)

    def _cropped(self, nid: int, j: int, o: int, new: int, i: int) -> int:
        """A part's output without the rows it makes beyond what it covers (the gradient of
        a padded input's pad rows: a view), with the zero rows it needs past the last window."""
        e = self.r.splits[nid].outputs[j]
        along = e.overlap if isinstance(e, Reduced) else e
        if not isinstance(along, Along) or along.window is None:
            return new
        rows = self.rows.makes(nid, j, o, i)
        n = self.g.nodes[nid]
        name = self.g.values[o].name
        if rows.pad_lo or rows.pad_hi:
            new = rows_view(self.w, new, along.dim, rows.pad_lo,
                            rows.pad_lo + rows.stop - rows.start, f"{name}.crop{i}", n.phase,
                            n.module)
        zeros = self.rows.zero_rows(nid, j, i)
        if zeros:
            new = pad_rows(self.w, new, along.dim, 0, zeros, "zero", f"{name}.zeros{i}",
                           n.phase, n.module)
        return new

    def _contiguous(self, vid: int, n, i: int) -> int:
        """``vid`` itself if contiguous, else a contiguous copy made just before ``n``'s part."""
        w = self.w
        v = w.values[vid]
        want = contiguous_strides(v.shape)
        if all(a == b for a, b, size in zip(v.stride, want, v.shape) if size != 1):
            return vid
        spec = OutSpec(f"{v.name}.contiguous", Meta(v.shape, want, 0), v.dtype,
                       role=part_role(n.phase))
        return w.add_node(f"{v.name}.contiguous", "aten.contiguous.default", (_ref(vid),), {},
                          [spec], phase=n.phase, module=n.module, device=w.device_of(vid))[0]

    def _made_alike(self, vid: int) -> bool:
        """Whether every part makes ``vid`` whole and the same (zeros of a given size)."""
        nid = self.g.values[vid].producer
        return (nid in self.inside and self.g.nodes[nid].target in MADE_ALIKE
                and self.r.dims.get(vid, 0) is None)

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
        role = part_role(n.phase)
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

def _ref(vid: int):
    from ..graph.ir import ValueRef

    return ValueRef(vid)
