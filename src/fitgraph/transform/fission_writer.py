"""Writing a rewritten graph: fresh node, value and storage lists, old ids mapped to new ones.

Fission rebuilds the whole graph (nodes renumbered in their new order, values and storages of
the removed region dropped), so that every planner, the simulator and the executor see a plain
captured-like Graph. ``GraphWriter`` copies untouched nodes with their references remapped and
adds new ones from layouts (``fission_meta.Meta``).

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.transform.fission_writer import GraphWriter
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    >>> g = b.finish({"loss": y})
    >>> w = GraphWriter(g)
    >>> w.copy_node(g.nodes[0])
    0
    >>> w.finish().nodes[0].name
    'relu_0'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..graph.analysis import REF_FREE_TYPES, flatten_refs
from ..graph.ir import (
    DTYPE_BYTES,
    Graph,
    Node,
    Phase,
    Role,
    Storage,
    Value,
    ValueRef,
    contiguous_strides,
    storage_bytes,
)
from .fission_meta import Meta

__all__ = ["GraphWriter", "OutSpec", "substitute_refs"]

# NOTE: shape-only ops (dim_rules.SHAPE_ONLY) -> the op making the same tensor from a shape, and
# which of the original args follow the size ("stride": the output's strides)
_LIKE = {
    "aten.empty_like.default": ("aten.new_empty_strided.default", ("stride",)),
    "aten.zeros_like.default": ("aten.new_zeros.default", ()),
    "aten.ones_like.default": ("aten.new_ones.default", ()),
    "aten.full_like.default": ("aten.new_full.default", (1,)),
}


def substitute_refs(obj: Any, new_ids: Iterator[int]) -> Any:
    """``obj`` with its ValueRefs replaced, in ``flatten_refs`` order, by refs to ``new_ids``."""
    return _replace_refs(obj, lambda _: next(new_ids))


def map_refs(obj: Any, mapping: dict[int, int]) -> Any:
    """``obj`` with each ValueRef's id mapped through ``mapping``, in one pass."""
    return _replace_refs(obj, mapping.__getitem__)


def _replace_refs(obj: Any, new_id: Callable[[int], int]) -> Any:
    """A new nested structure with each ValueRef ``r`` (in ``flatten_refs`` order) replaced by
    ``ValueRef(new_id(r.id))``; constants shared."""
    if isinstance(obj, ValueRef):
        return ValueRef(new_id(obj.id))
    if isinstance(obj, (tuple, list)):
        out = [o if type(o) in REF_FREE_TYPES else _replace_refs(o, new_id) for o in obj]
        return tuple(out) if isinstance(obj, tuple) else out
    if isinstance(obj, dict):
        return {k: v if type(v) in REF_FREE_TYPES else _replace_refs(v, new_id)
                for k, v in obj.items()}
    return obj


class OutSpec:
    """One output of a new node: its name, layout, dtype, and the storage it lives in (None: a
    fresh storage of ``role``)."""

    __slots__ = ("name", "meta", "dtype", "storage", "role")

    def __init__(self, name: str, meta: Meta, dtype: str, storage: int | None = None,
                 role: Role = Role.TEMPORARY) -> None:
        self.name, self.meta, self.dtype, self.storage, self.role = name, meta, dtype, storage, role


class GraphWriter:
    """Builds the rewritten graph of ``old``. ``whole``: old value id -> new value id of the
    same (whole) tensor; ``storage_map``: old storage id -> new storage id."""

    def __init__(self, old: Graph) -> None:
        self.old = old
        self.nodes: list[Node] = []
        self.values: list[Value] = []
        self.storages: list[Storage] = []
        self.whole: dict[int, int] = {}
        self.storage_map: dict[int, int] = {}
        for vid in old.inputs:
            v = old.values[vid]
            self.whole[vid] = self._value(v.name, Meta(v.shape, v.stride, v.storage_offset),
                                          v.dtype, self.mapped_storage(v.storage), v.role,
                                          v.phase, v.module, None)

    # -- storages and values --------------------------------------------------------------------
    def mapped_storage(self, old_storage: int) -> int:
        if old_storage not in self.storage_map:
            s = self.old.storages[old_storage]
            self.storage_map[old_storage] = self.new_storage(s.nbytes, s.device, s.role, s.name)
        return self.storage_map[old_storage]

    def new_storage(self, nbytes: int, device: str, role: Role, name: str) -> int:
        self.storages.append(Storage(len(self.storages), nbytes, device, role, name))
        return len(self.storages) - 1

    def _value(self, name: str, meta: Meta, dtype: str, storage: int, role: Role, phase: Phase,
               module: str, producer: int | None) -> int:
        self.values.append(Value(len(self.values), name, tuple(meta.shape), tuple(meta.stride),
                                 dtype, storage, meta.offset, role, phase, module, producer))
        return len(self.values) - 1

    def meta(self, vid: int) -> Meta:
        v = self.values[vid]
        return Meta(v.shape, v.stride, v.storage_offset)

    def device_of(self, vid: int) -> str:
        return self.storages[self.values[vid].storage].device

    # -- nodes ----------------------------------------------------------------------------------
    def add_node(self, name: str, target: str, args: tuple, kwargs: dict, outs: list[OutSpec | None],
                 *, phase: Phase, module: str, device: str, mutates: tuple[int, ...] = (),
                 random: bool = False, flops: float = 0.0, out_is_tuple: bool = False) -> list[int | None]:
        """Add a node reading the refs in ``args``/``kwargs``; returns its output value ids."""
        nid = len(self.nodes)
        out_ids: list[int | None] = []
        for spec in outs:
            if spec is None:
                out_ids.append(None)
                continue
            st = spec.storage
            if st is None:
                nbytes = storage_bytes(spec.meta.shape, spec.meta.stride, spec.meta.offset,
                                       DTYPE_BYTES[spec.dtype])
                st = self.new_storage(nbytes, device, spec.role, spec.name)
            out_ids.append(self._value(spec.name, spec.meta, spec.dtype, st, spec.role, phase,
                                       module, nid))
        inputs = tuple(dict.fromkeys(flatten_refs((args, kwargs))))
        moved = sum(self.values[v].nbytes for v in inputs)
        moved += sum(self.values[o].nbytes for o in out_ids if o is not None)
        self.nodes.append(Node(nid, name, target, tuple(args), dict(kwargs), inputs,
                               tuple(out_ids), tuple(mutates), phase, module, random, flops,
                               moved, out_is_tuple))
        return out_ids

    def remapped(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` of an old node with their refs mapped through ``whole``."""
        return map_refs(args, self.whole), map_refs(kwargs, self.whole)

    def copy_node(self, node: Node) -> int:
        """Copy an untouched node: its refs remapped through ``whole``, its outputs new values
        in the mapped storages."""
        nid = len(self.nodes)
        whole = self.whole
        # NOTE: a node's refs are among its inputs (verify_graph), so the inputs tell what is
        # missing and whether anything moved without flattening the args: a search splits one
        # graph a hundred times, and every copy walks every node after the region
        missing = [v for v in node.inputs if v not in whole]
        if missing and node.target in _LIKE:
            return self._shape_only(node)
        if missing:
            raise RuntimeError(f"fission: node {node.name} reads "
                               f"{self.old.values[missing[0]].name}, which the rewritten graph "
                               "has not produced yet (a bug in the node order)")
        inputs = tuple([whole[v] for v in node.inputs])
        if inputs == node.inputs:
            args, kwargs = node.args, dict(node.kwargs)
        else:
            args, kwargs = self.remapped(node.args, node.kwargs)
        # NOTE: a view (or an in-place write) returns its input's storage: where that input
        # now reads another tensor (a copy re-made in the backward), so does the view (the
        # backward's detach of a saved softmax, left in the forward's storage, kept it alive)
        aliased = {} if inputs == node.inputs else {
            self.old.values[v].storage: self.values[n].storage
            for v, n in zip(node.inputs, inputs)}
        outs = []
        for o in node.outputs:
            if o is None:
                outs.append(None)
                continue
            v = self.old.values[o]
            st = aliased.get(v.storage)
            new = self._value(v.name, Meta(v.shape, v.stride, v.storage_offset), v.dtype,
                              self.mapped_storage(v.storage) if st is None else st, v.role,
                              v.phase, v.module, nid)
            whole[o] = new
            outs.append(new)
        self.nodes.append(Node(nid, node.name, node.target, args, kwargs, inputs, tuple(outs),
                               tuple([whole[v] for v in node.mutates]), node.phase, node.module,
                               node.random, node.flops, node.bytes_moved, node.out_is_tuple))
        return nid

    def _shape_only(self, node: Node) -> int:
        """``empty_like(x)`` (a dropout's mask) whose ``x`` the region now makes later, in parts:
        the same fresh tensor made from shape and strides, with the dtype and device of a graph
        input (``new_empty_strided`` / ``new_zeros`` / ``new_ones`` / ``new_full``)."""
        out = self.old.values[node.outputs[0]]
        dev = self.old.storages[out.storage].device
        # NOTE: a graph input on the device gives the new tensor its device, and its dtype
        # unless a dtype= says it (compact_masks' bool bits; a float32 loss of a bfloat16
        # model, whose inputs are all bfloat16 or integers, gets one here)
        kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}
        on_dev = [new for vid, new in self.whole.items()
                  if self.old.values[vid].producer is None
                  and self.old.storages[self.old.values[vid].storage].device == dev]
        if not on_dev:
            raise RuntimeError(f"fission: {node.name} must run before the region but reads its "
                               f"shape from it, and no graph input lives on its device {dev}")
        same = [new for new in on_dev if self.values[new].dtype == out.dtype]
        base = (on_dev if kwargs.get("dtype") is not None else same or on_dev)[0]
        if kwargs.get("dtype") is None and self.values[base].dtype != out.dtype:
            import torch  # NOTE: local (planning modules import without torch): a dtype object

            kwargs["dtype"] = getattr(torch, out.dtype)
        new_target, extra = _LIKE[node.target]
        args = (ValueRef(base), list(out.shape)) + tuple(
            list(out.stride) if a == "stride" else node.args[a] for a in extra)
        if new_target != "aten.new_empty_strided.default" and out.stride != contiguous_strides(
                out.shape):
            raise RuntimeError(f"fission: {node.name} makes a non-contiguous tensor")
        meta = Meta(out.shape, out.stride, out.storage_offset)
        self.whole[node.outputs[0]] = self.add_node(
            node.name, new_target, args, kwargs,
            [OutSpec(out.name, meta, out.dtype, self.mapped_storage(out.storage), out.role)],
            phase=node.phase, module=node.module, device=dev, random=node.random)[0]
        return len(self.nodes) - 1

    def finish(self, meta: dict | None = None) -> Graph:
        old = self.old
        outputs = {k: self.whole[v] for k, v in old.outputs.items()}
        return Graph(self.nodes, self.values, self.storages, [self.whole[v] for v in old.inputs],
                     list(old.input_names), outputs, dict(old.meta if meta is None else meta))
