"""Parts cut along the inner dim of a merged dim: a linear layer's ``[B*T, F]`` rows cut along T.

A region split along the tokens of ``[B, T, D]`` tensors reaches the linear layers' rows as
``[B*T, D]`` (a reshape merges batch and tokens). There part ``[a, b)`` of the tokens is rows
``o*T + a .. o*T + b`` for every ``o < B``: strided (``Along.outer``). A region input cut so
is seen as ``[B, T, D]`` (a view), sliced, and copied into the part's own ``[B*(b-a), D]``
(its rows are not one block); a part's output is written back into the whole tensor through
the same ``[B, T, ...]`` view of it. Parts made inside the region are the parts' own dense
tensors, which the region's reshapes merge and unmerge as views.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
    >>> from fitgraph.transform.fission_writer import GraphWriter
    >>> b = GraphBuilder(); x = b.add_input("x", (2 * 8, 4), "float32", Role.INPUT)
    >>> w = GraphWriter(b.finish({}))
    >>> part = inner_part(w, w.whole[x], 0, 2, 2, 5, "x.part0", Phase.FORWARD, "")
    >>> w.values[part].shape, [n.target for n in w.nodes]
    ((6, 4), ['aten.view.default', 'aten.slice.Tensor', 'aten.reshape.default'])
"""

from __future__ import annotations

from ..graph.ir import Phase, Role, ValueRef, contiguous_strides
from .fission_meta import Meta, narrow, view_meta
from .fission_order import FissionError
from .fission_writer import GraphWriter, OutSpec

__all__ = ["inner_part", "inner_rows", "unflattened"]


def unflattened(w: GraphWriter, vid: int, dim: int, outer: int, name: str, phase: Phase,
                module: str) -> int:
    """A view of ``vid`` with ``dim`` seen as ``[outer, size/outer]``."""
    v = w.values[vid]
    shape = list(v.shape[:dim]) + [outer, v.shape[dim] // outer] + list(v.shape[dim + 1:])
    meta = view_meta("aten.view.default", (None, shape), [w.meta(vid)])
    if meta is None:  # NOTE: an unflatten of one dim is always a view; kept as a guard
        raise FissionError(f"{v.name}: dim {dim} cannot be viewed as [{outer}, ...]")
    spec = OutSpec(name, meta, v.dtype, storage=v.storage, role=v.role)
    return w.add_node(name, "aten.view.default", (ValueRef(vid), shape), {}, [spec],
                      phase=phase, module=module, device=w.device_of(vid))[0]


def inner_rows(w: GraphWriter, vid: int, dim: int, outer: int, start: int, stop: int,
               name: str, phase: Phase, module: str) -> int:
    """A view of rows ``[start, stop)`` of the inner dim of ``vid``'s ``dim`` seen as
    ``[outer, inner]``: shape ``[..., outer, stop - start, ...]``."""
    u = unflattened(w, vid, dim, outer, f"{name}.rows", phase, module)
    v = w.values[u]
    spec = OutSpec(name, narrow(w.meta(u), dim + 1, start, stop - start), v.dtype,
                   storage=v.storage, role=v.role)
    return w.add_node(name, "aten.slice.Tensor", (ValueRef(u), dim + 1, start, stop), {}, [spec],
                      phase=phase, module=module, device=w.device_of(u))[0]


def inner_part(w: GraphWriter, vid: int, dim: int, outer: int, start: int, stop: int,
               name: str, phase: Phase, module: str) -> int:
    """Those rows as a part's own dense tensor ``[..., outer * (stop - start), ...]`` (a copy:
    the rows are strided in ``vid``)."""
    rows = inner_rows(w, vid, dim, outer, start, stop, f"{name}.strided", phase, module)
    v = w.values[vid]
    shape = list(v.shape)
    shape[dim] = outer * (stop - start)
    role = Role.ACTIVATION if phase in (Phase.FORWARD, Phase.LOSS) else Role.TEMPORARY
    spec = OutSpec(name, Meta(tuple(shape), contiguous_strides(tuple(shape)), 0), v.dtype,
                   role=role)
    return w.add_node(name, "aten.reshape.default", (ValueRef(rows), shape), {}, [spec],
                      phase=phase, module=module, device=w.device_of(vid))[0]
