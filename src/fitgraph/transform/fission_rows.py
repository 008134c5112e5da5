"""Which rows of each tensor a fission part reads and makes: the planner the splitter follows.

The splitter (``transform.fission``) asks one question per tensor a part touches: which rows
along the region's split dim. ``UnitRows`` answers for regions with one split axis of units
(batch, tokens, heads, channels): part ``[a, b)`` of the axis is rows ``[a*unit, b*unit)`` of
every tensor, the same rows read, made and kept. ``fission_halo.HaloRows`` answers for regions
split spatially through windows (convolutions, pooling, resampling), where a part reads more
rows than it keeps and each tensor's rows follow from what its readers need.

A ``Rows`` is ``[start, stop)`` of a tensor plus pad rows a part adds around them (a window at
the border of the whole tensor) or finds around them in an output (rows to crop).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.dim_region import grow_region
    >>> from fitgraph.transform.fission_rows import UnitRows
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (6, 4), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((6, 4), "float32")])[0]
    >>> g = b.finish({"loss": y})
    >>> rows = UnitRows(g, grow_region(g, x, 0), 2)
    >>> rows.reads(0, 0, x, 1), rows.owned(y, 1), rows.share(0, 1)
    (Rows(start=3, stop=6, pad_lo=0, pad_hi=0), (3, 6), 0.5)
"""

from __future__ import annotations

from typing import NamedTuple

from ..graph.dim_region import Region
from ..graph.ir import Graph
from .fission_order import part_bounds

__all__ = ["Rows", "UnitRows"]


class Rows(NamedTuple):
    """Rows ``[start, stop)`` of a tensor along the split dim, with ``pad_lo``/``pad_hi`` rows
    around them (added by the part where it reads, cropped where it makes)."""

    start: int
    stop: int
    pad_lo: int = 0
    pad_hi: int = 0

    @property
    def size(self) -> int:
        """Rows of the part's tensor, pads included."""
        return self.pad_lo + self.stop - self.start + self.pad_hi

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.stop


class UnitRows:
    """Rows of a region with one axis of units: every tensor is cut at the same places.

    ``reads(nid, q, vid, i)``: rows of operand ``q`` (value ``vid``) node ``nid`` reads in part
    ``i``; ``makes(nid, j, vid, i)``: rows of its output ``j``; ``covers(vid, i)``: rows a region
    value's part holds; ``owned(vid, i)``: the rows of it part ``i`` contributes to the whole
    tensor; ``share(nid, i)``: the part's share of the node's work.
    """

    def __init__(self, graph: Graph, region: Region, k: int) -> None:
        self.units = region.units
        self.length = region.length
        self.bounds = part_bounds(region.length, k)

    def _rows(self, vid: int, i: int) -> Rows:
        a, b = self.bounds[i]
        u = self.units[vid]
        return Rows(a * u, b * u)

    def reads(self, nid: int, q: int, vid: int, i: int) -> Rows:
        return self._rows(vid, i)

    def makes(self, nid: int, j: int, vid: int, i: int) -> Rows:
        return self._rows(vid, i)

    def covers(self, vid: int, i: int) -> tuple[int, int]:
        return self._rows(vid, i).span

    def owned(self, vid: int, i: int) -> tuple[int, int]:
        return self._rows(vid, i).span

    def zero_rows(self, nid: int, j: int, i: int) -> int:
        return 0

    def share(self, nid: int, i: int) -> float:
        a, b = self.bounds[i]
        return (b - a) / self.length
