"""The small nodes a spatially split part adds around its ops: row views, border pads, index
rebasing.

- ``rows_view``: rows ``[start, stop)`` of a tensor along a dim (``aten.slice``, a view): the
  rows a reader needs of a part's larger tensor, the crop of a part's padded output;
- ``pad_rows``: the zero (or -inf, for max pooling) rows a window reads past the border of
  the whole tensor (``aten.constant_pad_nd``, a copy): a part runs its op with that padding
  set to 0, so interior edges take real neighbour rows and only the border is padded;
- ``rebase_indices``: max-pool indices are flat positions in the part's (haloed, padded)
  input plane; the whole tensor's are positions in the whole plane.

Each returns the new value id. Layouts follow ATen (fresh outputs dense in their input's
stride order), so the IR stays exact for the simulator.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.ir import Phase
    >>> from fitgraph.transform.fission_writer import GraphWriter
    >>> from fitgraph.transform.fission_halo_nodes import pad_rows, rows_view
    >>> b = GraphBuilder(); x = b.add_input("x", (1, 2, 8, 8), "float32", Role.INPUT)
    >>> w = GraphWriter(b.finish({}))
    >>> top = rows_view(w, w.whole[x], 2, 0, 5, "x.rows", Phase.FORWARD, "")
    >>> w.values[top].shape, w.values[top].storage == w.values[w.whole[x]].storage
    ((1, 2, 5, 8), True)
    >>> padded = pad_rows(w, top, 2, 1, 0, "zero", "x.pad", Phase.FORWARD, "")
    >>> w.values[padded].shape, w.nodes[-1].args[1]
    ((1, 2, 6, 8), [0, 0, 1, 0])
"""

from __future__ import annotations

from ..graph.ir import Phase, Role, ValueRef
from .fission_meta import Meta, dense_like, narrow
from .fission_writer import GraphWriter, OutSpec

__all__ = ["pad_rows", "rebase_indices", "rows_view"]

_FILL = {"zero": 0.0, "-inf": float("-inf")}


def rows_view(w: GraphWriter, vid: int, dim: int, start: int, stop: int, name: str,
              phase: Phase, module: str) -> int:
    """A view of rows ``[start, stop)`` of ``vid`` along ``dim``."""
    v = w.values[vid]
    spec = OutSpec(name, narrow(w.meta(vid), dim, start, stop - start), v.dtype,
                   storage=v.storage, role=v.role)
    return w.add_node(name, "aten.slice.Tensor", (ValueRef(vid), dim, start, stop), {}, [spec],
                      phase=phase, module=module, device=w.device_of(vid))[0]


def _fresh(w: GraphWriter, like: int, shape: tuple[int, ...], name: str, phase: Phase,
           dtype: str | None = None) -> OutSpec:
    v = w.values[like]
    role = Role.ACTIVATION if phase in (Phase.FORWARD, Phase.LOSS) else Role.TEMPORARY
    return OutSpec(name, Meta(shape, dense_like(shape, v.stride), 0), dtype or v.dtype, role=role)


def pad_rows(w: GraphWriter, vid: int, dim: int, lo: int, hi: int, fill: str, name: str,
             phase: Phase, module: str) -> int:
    """``vid`` with ``lo`` rows before and ``hi`` rows after it along ``dim``, of ``fill``."""
    v = w.values[vid]
    pad = [0, 0] * (len(v.shape) - 1 - dim) + [lo, hi]
    shape = list(v.shape)
    shape[dim] += lo + hi
    return w.add_node(name, "aten.constant_pad_nd.default", (ValueRef(vid), pad, _FILL[fill]),
                      {}, [_fresh(w, vid, tuple(shape), name, phase)], phase=phase,
                      module=module, device=w.device_of(vid))[0]


def rebase_indices(w: GraphWriter, vid: int, dim: int, shift: int, part_plane: tuple[int, ...],
                   whole_plane: tuple[int, ...], name: str, phase: Phase, module: str) -> int:
    """Max-pool indices (flat positions in a part's input plane of spatial shape
    ``part_plane``, whose row 0 is row ``shift`` of the whole plane along ``dim``) as positions
    in the whole plane ``whole_plane``. ``dim`` counts from the plane's first spatial dim."""
    v = w.values[vid]
    kw = dict(phase=phase, module=module, device=w.device_of(vid))

    def op(target: str, args: tuple, tag: str) -> int:
        spec = _fresh(w, vid, v.shape, f"{name}.{tag}", phase, dtype=v.dtype)
        return w.add_node(f"{name}.{tag}", target, args, {}, [spec], **kw)[0]

    if len(part_plane) != 2:
        raise ValueError("max-pool indices are rebased in 2-d planes only")
    width, whole_width = part_plane[1], whole_plane[1]
    if dim == 0:
        # NOTE: rows shift; the width is the whole's (only rows are split)
        return op("aten.add.Tensor", (ValueRef(vid), shift * whole_width), "rebased")
    row = w.add_node(f"{name}.row", "aten.div.Scalar_mode", (ValueRef(vid), width),
                     {"rounding_mode": "floor"},
                     [_fresh(w, vid, v.shape, f"{name}.row", phase)], **kw)[0]
    col = op("aten.remainder.Scalar", (ValueRef(vid), width), "col")
    scaled = op("aten.mul.Tensor", (ValueRef(row), whole_width), "scaled")
    flat = op("aten.add.Tensor", (ValueRef(scaled), ValueRef(col)), "flat")
    return op("aten.add.Tensor", (ValueRef(flat), shift), "rebased")
