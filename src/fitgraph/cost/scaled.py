"""``ScaledCostModel``: a split graph's node costs from its original graph's, nothing profiled.

Operator fission (``transform.fission``) rewrites a graph: a region's nodes become k parts
named ``<original>.part<i>`` (a part split again: ``.part<i>.part<j>``), plus a few new nodes
(slices, the buffers parts are copied into, partial sums added up, a mean loss combined). The
fission search simulates dozens of such graphs; a measured cost model would profile every part's
new shapes. This wrapper answers from the costs of the graph it was built on instead:

* a node whose name, ``.part<i>`` suffixes stripped, is a node of the original graph that runs a
  kernel costs that node's time with its launch floor kept and the rest scaled by the part's
  share of the work; workspace scales by the same share (rounded up). A node copied unchanged
  costs exactly the original's.
* a half of a separated backward (``transform.fission_halo_grads``: ``<name>.input`` and
  ``<name>.weight``, either maybe split further) is such a share of the whole backward node it
  came from (``origin``): its FLOPs are its half of the whole's, its bytes what it reads and
  writes itself. A spatial split runs a convolution chain's backward through separated halves,
  so this is what lets the search cost halo splits without profiling them.
* a view (no kernel: ``is_metadata_node``) costs its original view's time, or the median view
  of the original graph if it has none;
* any other new node costs one launch floor plus its bytes moved at the original graph's
  seconds per byte; no workspace.

The share of the work is not simply the share of the split dim: a part still reads its whole
inputs (an LM head's weight) and a partial sum still reads and writes its whole accumulator, so
a part's bytes shrink less than its FLOPs. The original graph's costs calibrate a roofline —
the launch floor (its cheapest kernel), seconds per byte (its FLOP-free kernels' median rate,
weighted by bytes),
seconds per FLOP (its fastest FLOP rate) — and the share is the ratio of that roofline's work,
``max(flops * s_per_flop, bytes * s_per_byte)``, of the part to the original's. On a roofline
base model this reproduces the roofline; on a measured one it keeps each node's own measured
speed. All of it is a function of the base model's costs of the original graph: deterministic.
The estimate guides a search; the graph it picks is then measured (``solvers.fission.search``
profiles that one graph).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.dim_region import grow_region
    >>> from fitgraph.transform.fission import split_region
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.cost.scaled import ScaledCostModel
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (4096, 256), "float32", Role.INPUT)
    >>> w = b.add_input("w", (256, 256), "float32", Role.PARAMETER)
    >>> h = b.add_node("aten.mm.default", [x, w], [((4096, 256), "float32")], name="mm",
    ...                flops=2 * 4096 * 256 * 256)[0]
    >>> y = b.add_node("aten.relu.default", [h], [((4096, 256), "float32")], name="relu")[0]
    >>> s = b.add_node("aten.sum.default", [y], [((), "float32")], name="sum")[0]
    >>> g = b.finish({"loss": s})
    >>> g2 = split_region(g, grow_region(g, x, 0), 4)
    >>> roof = RooflineCostModel(get_device("a100-80gb"))
    >>> scaled = ScaledCostModel(roof, g)           # knows g's costs only
    >>> part = next(n for n in g2.nodes if n.name == "mm.part1")
    >>> round(scaled.node_cost(g2, part).seconds / roof.node_cost(g2, part).seconds, 3)
    1.0
"""

from __future__ import annotations

import math
import re
import statistics
from collections import OrderedDict

from ..graph.ir import Graph, Node
from .base import BaseCostModel, CostModel, NodeCost
from .roofline import is_metadata_node

__all__ = ["ScaledCostModel", "origin", "original_name"]

_PART = re.compile(r"(\.part\d+)+$")
# NOTE: the suffixes ``separate_input_grads`` gives the two nodes a backward becomes
_HALF = re.compile(r"\.(input|weight)$")
_FROM_SHAPE = ("aten.new_empty", "aten.new_zeros", "aten.new_ones", "aten.new_full")
# NOTE: split graphs whose cost tables are kept (a search simulates one graph many times in a
# row, then moves on; older tables are only memory)
_KEEP_GRAPHS = 16


def original_name(name: str) -> str:
    """``"mm_3.part1.part0"`` -> ``"mm_3"``: the node a fission part was made from."""
    return _PART.sub("", name)


def origin(name: str) -> tuple[str, ...]:
    """The names of the original node a (split, separated) node may come from, most specific
    first: its ``original_name``, then, for a half of a separated backward, the whole node's.

    Example:
        >>> origin("convolution_backward_2.input.part1")
        ('convolution_backward_2.input', 'convolution_backward_2')
        >>> origin("convolution_backward.part0.weight")     # separated after a split
        ('convolution_backward.part0.weight', 'convolution_backward')
        >>> origin("mm_3.part1")
        ('mm_3',)
    """
    first = original_name(name)
    whole = _HALF.sub("", first)
    return (first,) if whole == first else (first, original_name(whole))


class ScaledCostModel(BaseCostModel):
    """Costs of graphs rewritten from ``graph`` (fission), from ``base``'s costs of ``graph``.

    Args:
        base: any cost model that can cost ``graph`` (a ``ProfiledCostModel`` that profiled
            it, a roofline model).
        graph: the original graph.

    ``calls_to_base`` counts the base model's ``node_cost`` calls (one per node of ``graph``).
    """

    def __init__(self, base: CostModel, graph: Graph) -> None:
        self.base, self.graph = base, graph
        self.name = f"{base.name}, fission parts scaled"
        self.rng_state_bytes = base.rng_state_bytes
        self.copies_overlap = base.copies_overlap
        self.host_memory_apart = base.host_memory_apart
        self._costs = [base.node_cost(graph, n) for n in graph.nodes]
        self.calls_to_base = len(self._costs)
        self._by_name = {n.name: n for n in graph.nodes}
        views = [c.seconds for n, c in zip(graph.nodes, self._costs)
                 if is_metadata_node(graph, n)]
        kernels = [(n, c.seconds) for n, c in zip(graph.nodes, self._costs)
                   if not is_metadata_node(graph, n)]
        self.view_s = statistics.median(views) if views else 0.0
        self.launch_s = min((s for _, s in kernels), default=0.0)
        self.seconds_per_byte = _weighted_median(
            [((s - self.launch_s) / n.bytes_moved, n.bytes_moved) for n, s in kernels
             if not n.flops and n.bytes_moved > 0])
        self.seconds_per_flop = min(((s - self.launch_s) / n.flops for n, s in kernels
                                     if n.flops > 0), default=0.0)
        self._tables: OrderedDict[int, tuple[Graph, list[NodeCost]]] = OrderedDict()

    # -- the CostModel protocol -----------------------------------------------------------------
    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        if graph is self.graph:
            return self._costs[node.id]
        key = id(graph)
        memo = self._tables.get(key)
        if memo is None or memo[0] is not graph:
            memo = (graph, [self._estimate(graph, n) for n in graph.nodes])
            self._tables[key] = memo
            if len(self._tables) > _KEEP_GRAPHS:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return memo[1][node.id]

    def copy_seconds(self, nbytes: int) -> float:
        return self.base.copy_seconds(nbytes)

    # -- estimates ------------------------------------------------------------------------------
    def work(self, node: Node) -> float:
        """Seconds of ``node`` beyond its launch on the roofline calibrated on the original."""
        return max(node.flops * self.seconds_per_flop, node.bytes_moved * self.seconds_per_byte)

    def share(self, node: Node, orig: Node) -> float:
        """The part of ``orig``'s work ``node`` does, at most all of it (1.0 when ``orig`` has
        none to share)."""
        whole = self.work(orig)
        if whole <= 0:
            return 1.0
        # NOTE: at most 1: a node remade from a shape (``ones_like`` -> ``new_ones``) counts the
        # bytes of an input it only takes the dtype of
        return min(1.0, self.work(node) / whole)

    def _original(self, node: Node) -> Node | None:
        """The node of the original graph ``node`` was made from (None: a new node). A half of
        a separated backward maps to the whole backward only if it runs the same op: its cost
        is then a share of the whole's, as a part's is."""
        names = origin(node.name)
        orig = self._by_name.get(names[0])
        if orig is None and len(names) > 1:
            whole = self._by_name.get(names[1])
            if whole is not None and whole.target == node.target:
                orig = whole
        return orig

    def _estimate(self, graph: Graph, node: Node) -> NodeCost:
        orig = self._original(node)
        orig_view = orig is not None and is_metadata_node(self.graph, orig)
        if is_metadata_node(graph, node):
            return self._costs[orig.id] if orig_view else NodeCost(self.view_s, 0)
        if orig is None or orig_view:
            # NOTE: a new kernel (a copy into a buffer, a partial sum added, a view of a part
            # that had to become a copy): one launch and its bytes at the graph's own rate
            return NodeCost(self.launch_s + _moved(graph, node) * self.seconds_per_byte, 0)
        base = self._costs[orig.id]
        if (node.flops, node.bytes_moved, node.target) == (orig.flops, orig.bytes_moved,
                                                           orig.target):
            return base  # NOTE: copied unchanged
        share = self.share(node, orig)
        floor = min(self.launch_s, base.seconds)
        return NodeCost(floor + (base.seconds - floor) * share,
                        math.ceil(base.workspace_bytes * _rows_share(node, orig, share)))

    def __repr__(self) -> str:
        return f"ScaledCostModel({self.base!r}, {len(self.graph.nodes)} nodes)"


def _half_fraction(node: Node, whole: Node) -> float:
    """The share of ``whole``'s FLOPs that a half of it gets when separated (1.0: ``node`` is
    no half): one per gradient kind it makes, input and weight (the bias rides with the weight).

    NOTE: the rule ``transform.fission_halo_grads`` splits FLOPs by; read off the outputs, which
    parts keep (None where a half makes nothing), so that no cost module imports a transform.
    """
    def kinds(n: Node) -> int:
        return sum(1 for o in n.outputs[:2] if o is not None)

    if node.outputs == whole.outputs or len(node.outputs) != len(whole.outputs):
        return 1.0
    return kinds(node) / max(kinds(whole), 1)


def _rows_share(node: Node, orig: Node, share: float) -> float:
    """The share of ``orig``'s workspace a node needs: its share of the work, except for a
    half of a separated backward, which needs the whole's workspace for its rows.

    NOTE: a backward making both gradients runs them one after the other: its workspace is the
    larger of theirs (measured on CPU convolutions: the input half's is the whole's), so a half
    is charged all of it (over its part's rows), never half of it.
    """
    fraction = _half_fraction(node, orig)
    if fraction == 1.0 or not orig.flops:
        return share
    return min(1.0, node.flops / (orig.flops * fraction))


def _weighted_median(pairs: list[tuple[float, int]]) -> float:
    """The value at half the total weight of (value, weight) pairs (0.0 if none)."""
    total, seen = sum(w for _, w in pairs), 0
    for value, w in sorted(pairs):
        seen += w
        if 2 * seen >= total:
            return value
    return 0.0


def _moved(graph: Graph, node: Node) -> int:
    """Bytes a node moves; an op made from a shape (``new_ones(like, size)``) reads no input."""
    if node.target.startswith(_FROM_SHAPE):
        return node.bytes_moved - sum(graph.values[v].nbytes for v in node.inputs)
    return node.bytes_moved
