"""The vocabulary of dimension rules: how one node can run in k parts along a dimension.

A ``Split`` is one way to run a node in parts. The parts partition one *split axis* of ``L``
units; every tensor the node touches either follows the axis (``Along``: part ``[a, b)`` of the
axis is elements ``[a*unit, b*unit)`` of that tensor's ``dim``, or of its inner dim in every
outer row where ``dim`` is two dims merged: ``outer``), is needed whole by every part
(``None``: weights, masks, a loss scale), or — for outputs — is a partial result the parts
combine (``Reduced``). A windowed operand (convolution, pooling along a spatial dim) reads a
halo: its range follows from the partition through its ``Window``, not from ``unit``. An
output with a window (a convolution's input gradient gathered from its output rows, bilinear
resampling) holds the rows its ``image`` says, right only where every row they are made from
is in the part: a part needing rows ``[a, b)`` runs the op rows ``covering`` them.

Plain data, no torch: the planner reasons on these; the fission executor follows them.

Example:
    >>> from fitgraph.graph.dim_types import Window
    >>> w = Window(kernel=3, stride=1, padding=1, dilation=1)
    >>> w.input_range(0, 4, in_size=8)    # output rows 0..3 read input rows 0..4, one pad row
    (0, 5, 1, 0)
    >>> w.input_range(4, 8, in_size=8)
    (3, 8, 0, 1)
    >>> w.covering(3, 5, out_size=8)      # input rows 3..4 are read by output rows 2..5
    (2, 6)
"""

from __future__ import annotations

from dataclasses import dataclass

from .analysis import flatten_refs

__all__ = ["Along", "Entry", "Reduced", "Resample", "SizeArg", "Split", "Window", "arg_of", "norm_dim",
           "per_arg"]


@dataclass(frozen=True, slots=True)
class Window:
    """A sliding window along one spatial dim (convolution, pooling).

    ``pad_path`` locates this dim's padding inside the node's args: a part runs with that
    padding set to 0 and its input explicitly padded by ``pad_lo``/``pad_hi`` rows of ``fill``
    (the op's own padding is symmetric, a part's is not).
    """

    kernel: int
    stride: int
    padding: int
    dilation: int
    fill: str = "zero"                      # "zero" (convolution) or "-inf" (max pooling)
    pad_path: tuple[int, ...] = ()

    def input_range(self, out_start: int, out_stop: int, in_size: int) -> tuple[int, int, int, int]:
        """Input rows ``[start, stop)`` (clipped to the tensor) that output rows
        ``[out_start, out_stop)`` read, and the pad rows ``(pad_lo, pad_hi)`` a part adds."""
        lo = out_start * self.stride - self.padding
        hi = (out_stop - 1) * self.stride - self.padding + self.dilation * (self.kernel - 1) + 1
        # NOTE: windows may read padding only (a 1x1 stride-2 convolution padded by 2): the
        # real rows are then empty, and pad_lo + rows + pad_hi still spans [lo, hi)
        start, stop = min(max(lo, 0), in_size), max(min(hi, in_size), 0)
        stop = max(stop, start)
        return start, stop, max(min(hi, 0) - lo, 0), max(hi - max(lo, in_size), 0)

    # NOTE: as an output's window (a convolution's input gradient computed by gathering), the
    # output rows of op rows [lo, hi) are the input rows those windows read
    image = input_range

    def covering(self, start: int, stop: int, out_size: int) -> tuple[int, int]:
        """Output rows ``[lo, hi)`` whose windows reach into input rows ``[start, stop)`` (every
        output an input row's gradient gathers from), widened so that their windows span
        those rows (strided windows with gaps between them); clipped to ``out_size``."""
        reach, s, p = self.dilation * (self.kernel - 1), self.stride, self.padding
        lo = min(-(-(start + p - reach) // s), (start + p) // s)
        hi = max((stop - 1 + p) // s, -(-(stop - 1 + p - reach) // s)) + 1
        return max(lo, 0), min(hi, out_size)

    def tiles(self, in_size: int, out_size: int) -> int:
        """Input rows per output row when the windows tile the input exactly (no halo, no
        padding, no row left over: a 1x1 convolution, a 2x2 stride-2 patch), else 0."""
        if self.padding or (self.kernel > 1 and self.dilation != 1):
            return 0
        if self.kernel == self.stride and in_size == out_size * self.stride:
            return self.stride
        return 1 if self.kernel == 1 and self.stride == 1 else 0


@dataclass(frozen=True, slots=True)
class Resample:
    """Bilinear resampling by an integer ``scale`` (align_corners=False), as an output's window:
    the op rows are the low-resolution rows.

    Forward (``backward=False``): op rows ``[lo, hi)`` of the input make output rows
    ``[scale*lo, scale*hi)``; an output row reads the two input rows around its source
    coordinate, so a row is right only where both are in the part (or clamped at the border
    of the whole tensor). Backward: op rows are the input gradient's rows, computed from the
    output gradient's ``scale`` rows each; a row is complete when its neighbours are in the part.
    """

    scale: int
    backward: bool = False

    def image(self, lo: int, hi: int, size: int) -> tuple[int, int, int, int]:
        """The output rows op rows ``[lo, hi)`` make, and no rows to crop."""
        s = 1 if self.backward else self.scale
        return lo * s, hi * s, 0, 0

    def covering(self, start: int, stop: int, op_size: int) -> tuple[int, int]:
        """Op rows a part needs for output rows ``[start, stop)`` to be right."""
        if self.backward:
            lo, hi = start - 1, stop + 1
        else:
            s = self.scale
            # NOTE: output row j reads input rows floor((j + 0.5)/s - 0.5) and the next one
            lo = (2 * start + 1 - s) // (2 * s)
            hi = (2 * (stop - 1) + 1 - s) // (2 * s) + 2
        # NOTE: an odd factor puts some source coordinates exactly on a row, which torch
        # computes in floating point (and a part from other offsets than the whole): one
        # more row each side. Even factors keep them a quarter row or more away from rows.
        margin = self.scale % 2
        return max(lo - margin, 0), min(hi + margin, op_size)


@dataclass(frozen=True, slots=True)
class Along:
    """The tensor is cut along ``dim``; one unit of the split axis is ``unit`` elements of it.

    ``window``: the range is read with a halo (see Window). ``rebase``: the values are flat
    positions in the part's (haloed, padded) input plane — max pooling's indices: combining
    unravels them with the part's plane shape, shifts the split coordinate by the part's
    ``start - pad_lo`` and ravels them with the whole plane's shape. ``outer``: ``dim`` is two
    dims merged, ``[outer, inner]`` (a linear layer's ``[B*T, F]`` rows), cut along the inner
    one: part ``[a, b)`` is elements ``[a*unit, b*unit)`` of the inner dim in every outer row.
    """

    dim: int
    unit: int = 1
    window: Window | None = None
    rebase: bool = False
    outer: int = 1

    def __repr__(self) -> str:  # NOTE: short: rules and regions print many of these
        extra = "".join(f", {k}={getattr(self, k)!r}" for k, default in
                        (("unit", 1), ("window", None), ("rebase", False), ("outer", 1))
                        if getattr(self, k) != default)
        return f"Along({self.dim}{extra})"


@dataclass(frozen=True, slots=True)
class Reduced:
    """Each part's output is a partial result over the split axis; the parts are combined.

    how="sum": summed (a weight gradient split along tokens). how="weighted_mean": each part is a
    mean over its own elements, combined as ``sum(out_i * w_i) / sum(w_i)`` with ``w_i`` the
    part's output ``weight`` (the mean-reduced loss and its total weight). ``overlap``: parts
    cover overlapping haloed ranges along ``overlap.dim`` and add where they overlap (the input
    gradient of a convolution split along a spatial dim).
    """

    how: str = "sum"
    weight: int | None = None
    overlap: Along | None = None

    def __repr__(self) -> str:
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("weight", "overlap")
                        if getattr(self, k) is not None)
        return f"Reduced({self.how!r}{extra})"


Entry = Along | Reduced | None


@dataclass(frozen=True, slots=True)
class SizeArg:
    """An argument that is the size of a split dim (a view's target shape, group norm's C):
    a part runs with ``part_shape[dim] // per`` there.

    ``path`` indexes into ``node.args`` (a str first element names a kwarg); ``tensor`` is
    ("in", operand index) or ("out", output index).
    """

    path: tuple[int | str, ...]
    tensor: tuple[str, int]
    dim: int
    per: int = 1


@dataclass(frozen=True, slots=True)
class Split:
    """One way to run a node in parts. ``operands`` follow ``dims.operands(node)`` (tensor
    arguments in argument order, repeats included); ``outputs`` follow ``node.outputs``. An
    operand is ``Reduced`` only where a region runs the node on its partial sums (an addition
    of them: ``dim_region.SUMS_OF_PARTIALS``)."""

    operands: tuple[Entry, ...]
    outputs: tuple[Entry, ...]
    sizes: tuple[SizeArg, ...] = ()
    note: str = ""


def arg_of(node, index: int, name: str, default=None):
    """A node's argument by position, else by keyword, else ``default`` (rules read ops' scalar
    arguments — dims, strides — through this, as make_fx may pass either way)."""
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def norm_dim(d: int, ndim: int) -> int:
    """A possibly negative dim as a position (a 0-d tensor's dim -1 stays 0)."""
    return d + max(ndim, 1) if d < 0 else d


def per_arg(node, table: dict, default: Along | None = None) -> tuple[Along | None, ...]:
    """Operand entries from entries per argument: ``table`` maps an arg position (or a kwarg's
    name) to one entry for every tensor in it, or to a list (one per tensor of a tensor list)."""
    out: list[Along | None] = []
    keyed = [(i, a) for i, a in enumerate(node.args)] + list(node.kwargs.items())
    for key, a in keyed:
        n = len(flatten_refs(a))
        e = table.get(key, default)
        out.extend(e[:n] if isinstance(e, list) else [e] * n)
    return tuple(out)
