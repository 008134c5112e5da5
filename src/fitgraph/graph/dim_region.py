"""Fission regions: the connected nodes through which one split dimension flows.

``grow_region(graph, value, dim)`` starts from a dim of a value and adds, one neighbour at a time,
every producer and user whose dimension rule has a split that agrees with the dims assigned so
far. It stops at ops without a rule, random and listed boundary ops, ops that would need a
value already split in the region whole (or the reverse), and readers of a partial sum. Inputs
a node needs whole (``None``) must not depend on the region: the region stays *convex* (no path
leaves it and comes back), so it can run as one block in k parts. Units: a value's ``units``
entry is how many of its elements along its dim make one unit of the region's split axis;
values reached through a convolution's halo have none (their ranges follow the windows).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, ValueRef
    >>> from fitgraph.graph.dim_region import grow_region
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (8, 4), "float32", Role.INPUT)
    >>> w = b.add_input("w", (4, 6), "float32", Role.PARAMETER)
    >>> h = b.add_node("aten.mm.default", [x, w], [((8, 6), "float32")])[0]
    >>> y = b.add_node("aten.relu.default", [h], [((8, 6), "float32")])[0]
    >>> s = b.add_node("aten.sum.dim_IntList", [y], [((6,), "float32")], args=(ValueRef(y), [0]))[0]
    >>> r = grow_region(b.finish({"loss": s}), x, 0)
    >>> r.nodes, r.dims[w], r.dims[s], r.length
    ((0, 1, 2), None, Reduced('sum'), 8)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from fractions import Fraction
from math import lcm

from .dim_convex import convexity_cut, order_edges
from .dim_rules import row_wise
from .dim_types import Along, Entry, Reduced, Split
from .dims import node_shapes, operands, splits_or_reason, value_entries
from .ir import Graph, Phase, Role

__all__ = ["Region", "RegionIndex", "grow_region", "node_region", "regions"]

_MISSING = object()


@dataclass(frozen=True, slots=True)
class Region:
    """A convex set of nodes that can run in parts along one split axis.

    ``dims``: value id -> split dim, None (read whole by every part) or Reduced (a partial
    result: combined where it leaves the region). ``units``: value id -> its elements along
    its dim per unit of the axis (absent behind a halo). ``splits``: node id -> the split it
    runs (op-level detail: units, windows, size arguments). ``boundary``: neighbouring nodes
    left out -> why. ``outers``: value id -> ``outer`` for a value whose split dim is two dims
    merged, cut along the inner one (``Along.outer``; a linear layer's ``[B*T, F]`` rows cut
    along T): a row-wise op's rule says ``Along(d)``, and the region says where its rows are.
    """

    start: tuple[int, int]
    nodes: tuple[int, ...]
    splits: dict[int, Split]
    dims: dict[int, int | None | Reduced]
    units: dict[int, int]
    boundary: dict[int, str] = field(default_factory=dict)
    length: int = 0               # units of the split axis (0: the axis is halo-only)
    anchor: int = -1              # the first node that joined: convexity cuts keep its side
    outers: dict[int, int] = field(default_factory=dict)

    @property
    def halo(self) -> bool:
        """True when parts' rows follow windows (a convolution, pooling or resampling split
        spatially): a part reads extra rows, or makes rows that are right only inside it, or
        max-pool indices that are positions in its own slice."""
        return any(_windowed(e) for s in self.splits.values() for e in s.operands + s.outputs)


class RegionIndex:
    """What growing regions of one graph needs, computed once: the order edges, the readers of
    each value, and each node's splits (filled as asked)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.succ, self.pred = order_edges(graph)
        self.users = _users(graph)
        self.options: dict[int, list[tuple[Split, dict, set]] | str] = {}


def grow_region(graph: Graph, value_id: int, dim: int, *, whole: str = "independent",
                exclude: dict[int, str] | None = None, index: RegionIndex | None = None,
                keep_length: bool = False, min_length: int = 0,
                re_made: bool = False) -> Region:
    """The maximal convex region through which ``dim`` of ``value_id`` flows.

    ``whole``: which inputs a part may read whole — "independent": any value that does not
    depend on the region (attention's keys when its queries are split, a loss's scale);
    "weights": only values that do not depend on the batch (weights, masks, constants).
    ``exclude``: node id -> why it must stay out. ``index``: a ``RegionIndex`` of ``graph``,
    to share when growing many regions of one graph. ``keep_length``: leave out nodes that
    would make the split axis coarser than ``dim`` of ``value_id`` (a reshape that ties its
    elements to a shorter dimension: tokens [batch x sequence] back to batch), so the region
    keeps that dim's full length. ``min_length``: leave out only those that would leave the
    axis fewer than ``min_length`` units (Swin's scores are [windows x heads, ...] and its
    attention's output is [windows, ...]: the axis may coarsen to the windows, not to the
    images). ``re_made``: the region's forward nodes are to be re-made in the backward
    (``transform.recompute_copies``), where they read forward tensors outside the region as
    saved: a path through forward nodes outside it that make statistics (no larger than a unit
    of the axis) does not break its convexity (a group norm's, between its input and its
    normalised output).
    """
    if whole not in ("independent", "weights"):
        raise ValueError(f"whole must be 'independent' or 'weights', not {whole!r}")
    nd = len(graph.values[value_id].shape)
    dim = dim + nd if dim < 0 else dim
    batch_dep = _batch_dependent(graph) if whole == "weights" else None
    excluded = dict(exclude or {})
    if index is None:
        index = RegionIndex(graph)
    elif index.graph is not graph:
        raise ValueError("index was built for another graph")
    while True:
        region = _grow(graph, value_id, dim, excluded, batch_dep, index, keep_length,
                       min_length)
        if not region.nodes:
            return region
        saved = _small_forward(graph, value_id, region.length) if re_made else frozenset()
        cut = convexity_cut(set(region.nodes), region.anchor, index.succ, index.pred, saved)
        if not cut:
            return region
        for nid, via in cut.items():
            excluded.setdefault(nid, region.boundary.get(nid) or (
                f"on the far side of {graph.nodes[via].name}, which is outside the region but "
                "depends on it and feeds it: the region would not be convex"))


def _small_forward(graph: Graph, start: int, length: int) -> frozenset:
    """Forward nodes whose every output is at most one unit of ``start`` along the region's
    axis: statistics (a group norm's mean per sample and channel), which a region re-made in
    the backward reads as saved; a larger tensor (another block's activations) kept from the
    forward for it would cost what re-making saves."""
    unit = graph.values[start].nbytes // max(length, 1)
    return frozenset(n.id for n in graph.nodes if n.phase is Phase.FORWARD and all(
        o is None or graph.values[o].nbytes <= unit for o in n.outputs))


def node_region(graph: Graph, nid: int, value_id: int, dim: int) -> Region:
    """The region of node ``nid`` alone, split along ``dim`` of ``value_id`` (one of its
    operands or outputs); empty, with the reason in ``boundary``, if it has no such split.

    A node alone is the smallest region: splitting it cuts its own transient memory (the
    output it makes whole anyway, its workspace: a convolution's backward at the peak)
    without holding anything else live longer.

    Example:
        >>> from fitgraph.graph.ir import GraphBuilder, Role
        >>> b = GraphBuilder(); x = b.add_input("x", (6, 4), "float32", Role.INPUT)
        >>> y = b.add_node("aten.relu.default", [x], [((6, 4), "float32")])[0]
        >>> r = node_region(b.finish({"loss": y}), 0, y, 1)
        >>> r.nodes, r.dims, r.length
        ((0,), {0: 1, 1: 1}, 4)
    """
    node = graph.nodes[nid]
    nd = len(graph.values[value_id].shape)
    dim = dim + nd if dim < 0 else dim
    got = splits_or_reason(graph, node)
    why, splits = (got, []) if isinstance(got, str) else (None, got)
    for split in splits:
        table = value_entries(node, split)
        e = None if table is None else table.get(value_id)
        if not (isinstance(e, Along) and e.dim == dim):
            continue
        plain = [(v, a) for v, a in table.items() if isinstance(a, Along) and a.window is None]
        v0, a0 = plain[0]
        dims = {v: (a.dim if isinstance(a, Along) else a) for v, a in table.items()}
        return Region((value_id, dim), (nid,), {nid: split}, dims,
                      {v: a.unit for v, a in plain}, {},
                      graph.values[v0].shape[a0.dim] // (a0.unit * a0.outer), nid,
                      {v: a.outer for v, a in plain if a.outer > 1})
    notes = sorted({s.note for s in splits if s.note})
    reason = why or (f"no split of {node.target} along dim {dim} of "
                     f"{graph.values[value_id].name}" + (f" ({'; '.join(notes)})" if notes else ""))
    return Region((value_id, dim), (), {}, {}, {}, {nid: reason})


def regions(graph: Graph, starts: list[tuple[int, int]], **kw) -> list[Region]:
    """Regions grown from each (value id, dim) start, skipping starts inside an earlier one."""
    out: list[Region] = []
    kw.setdefault("index", RegionIndex(graph))
    for vid, dim in starts:
        if any(r.dims.get(vid) == dim for r in out):
            continue
        r = grow_region(graph, vid, dim, **kw)
        if r.nodes:
            out.append(r)
    return out


def _grow(graph: Graph, start: int, dim: int, excluded: dict[int, str],
          batch_dep: set[int] | None, index: RegionIndex, keep_length: bool = False,
          min_length: int = 0) -> Region:
    users = index.users
    dims: dict[int, Entry] = {start: Along(dim)}
    units: dict[int, Fraction | None] = {start: Fraction(1)}
    chosen: dict[int, Split] = {}
    boundary: dict[int, str] = {}
    # NOTE: candidates join in captured order (a heap of node ids), not in discovery order: a
    # producer decides its outputs' dims before a later reader can ask for them whole (the
    # loss joins before the backward that reads its total weight)
    heap: list[int] = []
    first = None
    floor = (start, graph.values[start].shape[dim], min_length) if min_length else None
    kinds = {"halo": False, "outer": False}   # NOTE: see _join's ``kinds``

    def offer(v: int) -> None:
        producer = graph.values[v].producer
        for nid in ([producer] if producer is not None else []) + users[v]:
            if nid not in chosen and nid not in boundary:
                heapq.heappush(heap, nid)

    offer(start)
    while heap:
        nid = heapq.heappop(heap)
        if nid in chosen or nid in boundary:
            continue
        if nid in excluded:
            boundary[nid] = excluded[nid]
            continue
        got = _join(graph, nid, dims, units, batch_dep, index.options, keep_length, floor, kinds)
        if isinstance(got, str):
            boundary[nid] = got
            continue
        chosen[nid] = got[0]
        first = nid if first is None else first
        for v2, e in got[1].items():
            if isinstance(e, Along):
                offer(v2)
            elif e == _SUMS and v2 in graph.nodes[nid].outputs:
                # NOTE: a partial sum's readers that may add it to others (_sum_of_partials)
                for u in users[v2]:
                    if u not in chosen and u not in boundary and \
                            graph.nodes[u].target in SUMS_OF_PARTIALS:
                        heapq.heappush(heap, u)
    return _finish(graph, start, dim, chosen, dims, units, boundary, first)


def _options(graph: Graph, nid: int, cache: dict) -> list[tuple[Split, dict, set]] | str:
    """The splits of a node with their value tables, or why it has none (cached: regrowing
    asks again)."""
    if nid not in cache:
        node = graph.nodes[nid]
        got = splits_or_reason(graph, node)
        if isinstance(got, str):
            cache[nid] = got
        else:
            ops = operands(node)
            cache[nid] = [(s, t, set(ops)) for s in got
                          if (t := value_entries(node, s, ops)) is not None]
    return cache[nid]


def _join(graph: Graph, nid: int, dims: dict, units: dict, batch_dep: set[int] | None,
          cache: dict, keep_length: bool = False,
          floor: tuple[int, int, int] | None = None,
          kinds: dict[str, bool] | None = None) -> tuple[Split, dict] | str:
    """The first split of node ``nid`` that agrees with ``dims`` (assigned in place), or why not.

    ``kinds`` (updated in place): whether the region so far reads through windows (``halo``)
    and cuts the inner dim of a merged dim (``outer``); a split that would make it do both is
    passed over (fission cannot run such a region), so the region stops there."""
    opts = _options(graph, nid, cache)
    if isinstance(opts, str):
        return opts
    kinds = {"halo": False, "outer": False} if kinds is None else kinds
    coarser = mixed = False
    for split, table, ops in opts:
        got = _agree(table, dims, units, ops, batch_dep,
                     lambda s=split: _row_wise(graph, graph.nodes[nid], s))
        if got is _MISSING:
            continue
        ratio, extra = got
        # NOTE: HuBERT's convolutions along the time reach the feature projection's linear
        # layer, whose rows are [batch x time]: grown through it, the whole region failed to
        # split ("windows and the inner dim of a merged dim")
        halo = kinds["halo"] or any(_windowed(e) for e in split.operands + split.outputs)
        outer = kinds["outer"] or extra > 1 or any(
            isinstance(e, Along) and e.outer > 1 for e in table.values())
        if halo and outer:
            mixed = True
            continue
        # NOTE: a region unit a fraction of the op's (a convolution in 2 groups of 16 channels
        # reached where the region's unit is a channel): the op's units are whole only if the
        # region's unit grows to one of them, for every value (RegNet: cut in 8 parts of 4
        # channels, each part's convolution had 0 groups)
        whole = 1 if ratio is None else ratio.denominator
        new = [ratio * e.unit for vid, e in table.items() if vid not in dims
               and isinstance(e, Along) and e.window is None] if ratio is not None else []
        if ((keep_length or floor) and ratio is not None
                and (whole > 1 or any(u.denominator > 1 for u in new))
                and (keep_length or _length_after(units, new, whole, floor) < floor[2])):
            coarser = True  # NOTE: a unit of the axis would be a fraction of this value's unit
            continue
        for vid, e in table.items():
            if vid in dims:
                continue
            if isinstance(e, Along) and extra > 1:
                e = replace(e, outer=extra)
            dims[vid] = e
            if isinstance(e, Along):
                units[vid] = None if ratio is None or e.window is not None else ratio * e.unit
        if whole > 1:
            for vid, u in units.items():
                if u is not None:
                    units[vid] = u * whole
        kinds["halo"], kinds["outer"] = halo, outer
        return split, table
    node = graph.nodes[nid]
    if mixed:
        return ("would cut the inner dim of a merged dim in a region that reads through "
                "windows (a convolution along its time or space): fission runs neither with "
                "the other")
    if coarser:
        return ("would cut the split axis coarser (a reshape ties it to a shorter dimension); "
                "the region keeps its length")
    summed = _sum_of_partials(graph, node, dims)
    if summed is not None:
        return summed
    partial = [graph.values[v].name for v in node.inputs if isinstance(dims.get(v), Reduced)]
    if partial:
        return (f"reads {partial[0]}, a partial result of the region: it exists whole only "
                "after the region, once its parts are combined")
    seen = {graph.values[v].name: dims[v] for v in node.inputs + node.outputs if v in dims}
    notes = sorted({s.note for s, _, _ in opts if s.note})
    why = f" ({'; '.join(notes)})" if notes else ""
    return f"no split of {node.target} agrees with the region's dims {seen}{why}"


# NOTE: ops that are linear in their tensor operands, run on partial sums alike: the sum of
# the parts' results is the result on the sums
_SUMS = Reduced()
SUMS_OF_PARTIALS = frozenset({"aten.add.Tensor", "aten.view.default",
                              "aten._unsafe_view.default", "aten.reshape.default"})


def _sum_of_partials(graph: Graph, node, dims: dict) -> tuple[Split, dict] | None:
    """The split of ``node`` as a partial sum (assigned in ``dims``) where it adds or views
    partial sums of the region, else None. An addition may take one whole tensor too: the
    first part adds it (``adds_whole``).

    NOTE: a tensor read by several ops sums their gradients: attention's input gets four,
    from its query, key and value projections and the residual. Run in parts along the heads,
    each projection's was a partial sum of its own: three whole accumulators through the
    region (ALBERT's attention re-made along its heads, at its peak). Their sum with the
    residual's is one."""
    if node.target not in SUMS_OF_PARTIALS or node.mutates or len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    ops = operands(node)
    if out is None or out in dims or not ops:
        return None
    entries = tuple(_SUMS if dims.get(v) == _SUMS else None for v in ops)
    if _SUMS not in entries:
        return None
    if node.target == "aten.add.Tensor":
        if (node.kwargs.get("alpha", 1) != 1 or len(ops) != 2 or len(node.args) > 2
                or any(dims.get(v) not in (None, _SUMS) for v in ops)
                or any(graph.values[v].shape != graph.values[out].shape
                       or graph.values[v].dtype != graph.values[out].dtype for v in ops)):
            return None   # NOTE: a broadcast operand would be added once per part
    elif entries != (_SUMS,):
        return None
    table = dict(zip(ops, entries))
    table[out] = _SUMS
    for v, e in table.items():
        dims.setdefault(v, e)
    return Split(entries, (_SUMS,), note="a partial sum of partial sums"), table


def adds_whole(split: Split) -> bool:
    """Whether a split adds a whole tensor to a partial sum: the first part adds it, the
    others pass their partial sum on (``_sum_of_partials``)."""
    return any(isinstance(e, Reduced) for e in split.operands) and None in split.operands


def _row_wise(graph: Graph, node, split: Split) -> bool:
    return row_wise(node, split, *node_shapes(graph, node))


def _agree(table: dict, dims: dict, units: dict, ops: set[int], batch_dep: set[int] | None,
           is_row_wise=lambda: False):
    """(the ratio region-units / op-units, the ``outer`` the region adds to the op's entries)
    if ``table`` agrees with ``dims`` (ratio None: no unit fixed yet, through a halo), else
    _MISSING. A row-wise op's plain entries (``is_row_wise()``, asked only then) agree with values
    cut along the inner dim of a merged dim: it runs each row on its own, wherever they sit."""
    ratio: Fraction | None = None
    linked = False
    extra: int | None = None
    for vid, e in table.items():
        have = dims.get(vid, _MISSING)
        if have is _MISSING:
            if e is None and batch_dep is not None and vid in batch_dep:
                return _MISSING  # NOTE: "weights" mode: a batch-dependent value read whole
            continue
        if isinstance(have, Reduced) and vid in ops:
            return _MISSING  # NOTE: a partial sum exists only where the region ends
        if isinstance(have, Along):
            if not isinstance(e, Along) or e.dim != have.dim:
                return _MISSING
            if e.outer == have.outer:
                add = 1
            elif e.outer == 1 and is_row_wise():
                add = have.outer
            else:
                return _MISSING
            if extra is not None and add != extra:
                return _MISSING   # NOTE: strided rows in one operand, contiguous in another
            extra = add
            linked = True
            if units.get(vid) is not None and e.window is None:
                r = units[vid] / e.unit
                if ratio is not None and r != ratio:
                    return _MISSING
                ratio = r
        elif have != e:
            return _MISSING
    return (ratio, extra) if linked else _MISSING


def _length_after(units: dict, new: list[Fraction], whole: int,
                  floor: tuple[int, int, int]) -> int:
    """The axis's length (as ``_finish`` counts it) were ``new`` units joined, every unit
    ``whole`` times larger; ``floor`` is (start value, its dim's size, the least length)."""
    start, size, _ = floor
    fracs = [u * whole for u in [*units.values(), *new] if u is not None]
    scale = lcm(*(u.denominator for u in fracs))
    return size // int(units[start] * whole * scale)


def _finish(graph: Graph, start: int, dim: int, chosen: dict[int, Split], dims: dict,
            units: dict, boundary: dict[int, str], anchor: int | None) -> Region:
    """Integer units (the region's unit is the smallest block every value can be cut in)."""
    fracs = [u for u in units.values() if u is not None]
    scale = lcm(*(u.denominator for u in fracs)) if fracs else 1
    int_units = {v: int(u * scale) for v, u in units.items() if u is not None}
    out_dims = {v: (e.dim if isinstance(e, Along) else e) for v, e in dims.items()}
    outers = {v: e.outer for v, e in dims.items() if isinstance(e, Along) and e.outer > 1}
    size = graph.values[start].shape[dim]
    length = size // int_units[start] if start in int_units else 0
    return Region((start, dim), tuple(sorted(chosen)), dict(sorted(chosen.items())),
                  out_dims, int_units, dict(sorted(boundary.items())), length,
                  -1 if anchor is None else anchor, outers)


def _windowed(e: Entry) -> bool:
    if isinstance(e, Reduced):
        return e.overlap is not None
    return isinstance(e, Along) and (e.window is not None or e.rebase)


def _users(graph: Graph) -> dict[int, list[int]]:
    table: dict[int, list[int]] = {v.id: [] for v in graph.values}
    for n in graph.nodes:
        for v in n.inputs:
            table[v].append(n.id)
    return table


def _batch_dependent(graph: Graph) -> set[int]:
    """Values computed from the batch (Role.INPUT), transitively."""
    dep = {v for v in graph.inputs if graph.values[v].role == Role.INPUT}
    for n in graph.nodes:
        if any(v in dep for v in n.inputs):
            dep.update(o for o in n.outputs if o is not None)
    return dep
