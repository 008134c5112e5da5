"""Rows of a region split spatially: halos accumulated back through a chain of windows.

A region cut along a spatial dim (height or width of convolutions, pooling, resampling) has
no single axis of units: a 3x3 convolution's output rows ``[a, b)`` read input rows
``[a-1, b+1)``, a stride-2 one twice as many, a 2x upsampling half. ``HaloRows`` plans each
part backwards from what leaves the region:

- each tensor the rest of the graph reads is cut into k *owned* row blocks (proportional
  to its size, so blocks of tensors at different resolutions line up); part i must make
  its block;
- walking the region's nodes in reverse, a node makes the hull of the rows its readers in
  the part need (its op rows: output rows of a convolution, rows of an elementwise op), and
  reads the rows those need: through the window of a windowed operand (the halo, with pad
  rows where it reaches past the border of the whole tensor), through units otherwise;
- a node whose output is a partial result over the split dim (a weight gradient, a loss)
  runs exactly its owned op rows — the parts' partial results then add up to the whole —
  and its other outputs must not be needed beyond them;
- an output with a window (a convolution's input gradient gathered from its output rows,
  bilinear resampling) is right only inside: a node runs the op rows ``covering`` what is
  needed, and makes a few more rows (its ``image``) that no reader uses.

Intermediate tensors of a part are thus computed with their own halo (the overlap is
recomputed by the neighbouring part) and readers take the rows they need as views. Plain
Python: the simulator sees the parts' larger shapes, hence the halo's extra work and bytes.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, ValueRef
    >>> from fitgraph.graph.dim_region import grow_region
    >>> from fitgraph.transform.fission_halo import HaloRows
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (1, 1, 8, 8), "float32", Role.INPUT)
    >>> w = b.add_input("w", (1, 1, 3, 3), "float32", Role.PARAMETER)
    >>> conv = lambda v: (ValueRef(v), ValueRef(w), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    >>> h = b.add_node("aten.convolution.default", [x, w], [((1, 1, 8, 8), "float32")],
    ...                args=conv(x))[0]
    >>> y = b.add_node("aten.convolution.default", [h, w], [((1, 1, 8, 8), "float32")],
    ...                args=conv(h))[0]
    >>> g = b.finish({"loss": y})
    >>> rows = HaloRows(g, grow_region(g, x, 2), 2, owned_values=[y])
    >>> rows.owned(y, 0), rows.covers(h, 0), rows.reads(0, 0, x, 0)   # rows 0..3 of y
    ((0, 4), (0, 5), Rows(start=0, stop=6, pad_lo=1, pad_hi=0))
    >>> rows.reads(1, 0, h, 1)      # the second part reads h's rows 3..7 and one pad row
    Rows(start=3, stop=8, pad_lo=0, pad_hi=1)
"""

from __future__ import annotations

from collections.abc import Iterable

from ..graph.dim_region import Region
from ..graph.dim_types import Along, Reduced
from ..graph.dims import operands
from ..graph.ir import Graph
from .fission_order import FissionError, real_writes
from .fission_rows import Rows

__all__ = ["HaloRows", "owned_block"]


def owned_block(size: int, k: int, i: int) -> tuple[int, int]:
    """Part ``i``'s block of ``size`` rows cut in ``k``, proportionally (``floor(i*size/k)``):
    blocks of a 32-row tensor and of its 16-row stride-2 image start at matching rows."""
    return i * size // k, (i + 1) * size // k


def _hull(spans: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
    spans = list(spans)
    if not spans:
        return None
    return min(s for s, _ in spans), max(e for _, e in spans)


class HaloRows:
    """The rows every part of a spatially split region reads and makes (see the module doc).

    Same questions as ``fission_rows.UnitRows``. ``owned_values``: the region values whose
    whole tensor is assembled from the parts (what leaves the region, or the storage it views).
    """

    def __init__(self, graph: Graph, region: Region, k: int, owned_values: Iterable[int]) -> None:
        self.g, self.r, self.k = graph, region, k
        self.owned_values = sorted(set(owned_values))
        self._owned_by_storage = {graph.values[v].storage: v for v in self.owned_values}
        self.length = {nid: self._op_length(nid) for nid in region.nodes}
        self._reads: dict[tuple[int, int, int], Rows] = {}
        self._makes: dict[tuple[int, int, int], Rows] = {}
        self._covers: dict[tuple[int, int], tuple[int, int]] = {}
        self._op: dict[tuple[int, int], tuple[int, int]] = {}
        self._zeros: dict[tuple[int, int, int], int] = {}
        for vid in self.owned_values:
            size = graph.values[vid].shape[region.dims[vid]]
            if size < k:
                raise FissionError(f"{graph.values[vid].name} has {size} rows along dim "
                                   f"{region.dims[vid]}: it cannot be cut in {k} parts")
        for i in range(k):
            self._plan_part(i)

    # -- the questions the splitter asks ----------------------------------------------------
    def reads(self, nid: int, q: int, vid: int, i: int) -> Rows:
        return self._reads[(nid, q, i)]

    def makes(self, nid: int, j: int, vid: int, i: int) -> Rows:
        return self._makes[(nid, j, i)]

    def covers(self, vid: int, i: int) -> tuple[int, int]:
        return self._covers[(vid, i)]

    def owned(self, vid: int, i: int) -> tuple[int, int]:
        return owned_block(self.g.values[vid].shape[self.r.dims[vid]], self.k, i)

    def zero_rows(self, nid: int, j: int, i: int) -> int:
        """Rows of zeros a part appends to its output ``j`` (input-gradient rows past the last
        window, which no output reads: a stride that does not divide the input)."""
        return self._zeros.get((nid, j, i), 0)

    def share(self, nid: int, i: int) -> float:
        lo, hi = self._op[(nid, i)]
        return (hi - lo) / self.length[nid]

    def op_rows(self, nid: int, i: int) -> tuple[int, int]:
        """The rows of node ``nid``'s own axis (a windowed op's output rows) part ``i`` runs."""
        return self._op[(nid, i)]

    # -- planning ----------------------------------------------------------------------------
    def _op_length(self, nid: int) -> int:
        """Rows of the node's own axis, from any operand or output that follows it in units."""
        n, split = self.g.nodes[nid], self.r.splits[nid]
        vids = operands(n) + list(n.outputs)
        for vid, e in zip(vids, split.operands + split.outputs):
            if vid is not None and isinstance(e, Along) and e.window is None:
                return self.g.values[vid].shape[e.dim] // e.unit
        entries = split.operands + split.outputs
        if (any(isinstance(e, Reduced) for e in entries)
                and all(e is None or isinstance(e, Reduced) for e in entries)):
            # NOTE: a sum of partial sums: each part adds its own (and the first a whole
            # tensor, ``adds_whole``: a weight gradient in two terms, one made before)
            return self.r.length
        raise FissionError(f"{n.name} ({n.target}): no operand or output follows the split "
                           "axis in units; its dimension rule must name one")

    def _plan_part(self, i: int) -> None:
        g, r = self.g, self.r
        need: dict[int, tuple[int, int]] = {v: self.owned(v, i) for v in self.owned_values}
        for nid in reversed(r.nodes):
            n, split = g.nodes[nid], r.splits[nid]
            op = self._op_range(nid, i, need)
            self._op[(nid, i)] = op
            for j, (o, e) in enumerate(zip(n.outputs, split.outputs)):
                if o is None:
                    continue
                rows = self._output_rows(o, e, op)
                if rows is None:
                    continue
                self._makes[(nid, j, i)] = rows
                if isinstance(e, Along):
                    want = need.get(o)
                    span = self._with_zeros(nid, j, i, e, o, rows, want, op)
                    self._covers[(o, i)] = span
                    if want is not None and not (span[0] <= want[0] and want[1] <= span[1]):
                        raise FissionError(
                            f"{n.name} ({n.target}): part {i} must make rows {want} of "
                            f"{g.values[o].name} along dim {e.dim} but makes {span} "
                            f"(op rows {op}{self._why(split)})")
            for q, (vid, e) in enumerate(zip(operands(n), split.operands)):
                if not isinstance(e, Along):
                    continue
                size = g.values[vid].shape[e.dim]
                if e.window is None:
                    rows = Rows(op[0] * e.unit, op[1] * e.unit)
                else:
                    rows = Rows(*e.window.input_range(op[0], op[1], size))
                    if op[0] >= op[1] and rows.stop > rows.start:
                        # NOTE: more parts than the op has rows: a part that runs none still
                        # reads a window's rows, which a kernel larger than them rejects (a
                        # 3x3 weight gradient past a stride-2 pool, 16 parts of 11 rows)
                        raise FissionError(
                            f"{n.name} ({n.target}): part {i} of {self.k} runs none of its "
                            f"{self.length[nid]} rows but reads {rows.stop - rows.start} rows "
                            "through its window: split it in fewer parts")
                self._reads[(nid, q, i)] = rows
                if vid in r.dims:
                    need[vid] = _hull([rows.span] + ([need[vid]] if vid in need else []))

    def _op_range(self, nid: int, i: int, need: dict[int, tuple[int, int]]) -> tuple[int, int]:
        """The op rows node ``nid`` runs in part ``i``: its owned block if it makes a partial
        result (or nothing it makes is needed), else the hull of what its readers need."""
        n, split = self.g.nodes[nid], self.r.splits[nid]
        length = self.length[nid]
        partial = any(isinstance(e, Reduced) for o, e in zip(n.outputs, split.outputs)
                      if o is not None)
        written = self._written_rows(nid, i, need)
        if partial:
            op = owned_block(length, self.k, i)
            if written and _hull([op] + written) != op:
                raise FissionError(f"{n.name} ({n.target}) writes in place rows its own part "
                                   "does not run, and makes a partial result: not supported")
            return op
        spans = list(written)
        for o, e in zip(n.outputs, split.outputs):
            if o is None or not isinstance(e, Along) or o not in need:
                continue
            a, b = need[o]
            if e.window is None:
                spans.append((a // e.unit, -(-b // e.unit)))
            else:
                spans.append(e.window.covering(a, b, length))
        op = _hull(spans)
        if op is None:
            return owned_block(length, self.k, i)
        return max(op[0], 0), min(op[1], length)

    def _with_zeros(self, nid: int, j: int, i: int, e: Along, o: int, rows: Rows,
                    want: tuple[int, int] | None, op: tuple[int, int]) -> tuple[int, int]:
        """The rows a part's output covers, extended by zero rows when a reader needs rows
        past the last window of the whole op (their gradient is zero)."""
        if want is None or e.window is None or want[1] <= rows.stop:
            return rows.span
        last = e.window.image(0, self.length[nid], self.g.values[o].shape[e.dim])[1]
        if rows.stop < last or op[1] < self.length[nid]:
            return rows.span
        self._zeros[(nid, j, i)] = want[1] - rows.stop
        return rows.start, want[1]

    def _written_rows(self, nid: int, i: int, need: dict) -> list[tuple[int, int]]:
        """Op rows an in-place node must run in part ``i`` so that every row of its operand's
        part that is read after it (or kept for the whole tensor) holds the written value: a
        part's operand may hold more rows than the node's readers need, from a neighbour's
        halo, and eager would have written them all."""
        g, r = self.g, self.r
        n, split = g.nodes[nid], r.splits[nid]
        spans = []
        for v in real_writes(n):
            e = split.operands[operands(n).index(v)]
            if g.values[v].producer not in set(r.nodes):
                raise FissionError(f"{n.name} ({n.target}) writes {g.values[v].name} in place, "
                                   "a tensor made outside the region: parts overlap by their "
                                   "halo and would write its rows twice; not supported")
            if not isinstance(e, Along) or e.window is not None:
                raise FissionError(f"{n.name} ({n.target}) writes {g.values[v].name} in place "
                                   "through a window or whole: not supported in parts")
            wanted = [need[v]] if v in need else []
            root = self._owned_by_storage.get(g.values[v].storage)
            if root is not None and root != v:
                if (g.values[root].shape, r.dims[root]) != (g.values[v].shape, r.dims[v]):
                    raise FissionError(f"{n.name} ({n.target}) writes in place a reshaped view "
                                       f"of {g.values[root].name}: not supported in parts")
                wanted.append(self.owned(root, i))
            spans += [(a // e.unit, -(-b // e.unit)) for a, b in wanted]
        return spans

    def _output_rows(self, o: int, e, op: tuple[int, int]) -> Rows | None:
        """The rows output ``o`` of a part covers (pads: rows of the part's tensor to crop)."""
        size = self.g.values[o].shape
        if isinstance(e, Along):
            if e.window is None:
                return Rows(op[0] * e.unit, op[1] * e.unit)
            return Rows(*e.window.image(op[0], op[1], size[e.dim]))
        if isinstance(e, Reduced) and e.overlap is not None:
            return Rows(*e.overlap.window.image(op[0], op[1], size[e.overlap.dim]))
        return None

    @staticmethod
    def _why(split) -> str:
        if any(isinstance(e, Reduced) for e in split.outputs):
            return ": it makes a partial result, so it runs exactly its own rows, and a reader " \
                   "needs more (separate its outputs: transform.fission_halo_grads)"
        return ": rows no window reads (stride gaps at the border)"
