"""The graph IR: one training step as nodes over values over storages. Plain Python, no torch.

A ``Graph`` is what ``fitgraph.capture`` returns: every ATen op of the forward, loss, backward and
optimizer update, in the order eager PyTorch runs them. Memory is accounted per *storage*, because
views and in-place ops share one: a ``Value`` is one tensor (shape, strides, dtype) that lives in
a ``Storage`` (bytes, device). Analyses (liveness, users, topological index) are side tables built
by ``fitgraph.graph.analysis``; nothing is bolted onto the nodes.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (4, 8), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((4, 8), "float32")], phase=Phase.FORWARD)[0]
    >>> g = b.finish(outputs={"loss": y})
    >>> len(g.nodes), g.storages[g.values[y].storage].nbytes
    (1, 128)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "Graph",
    "GraphBuilder",
    "Node",
    "Phase",
    "Role",
    "Storage",
    "Value",
    "ValueRef",
    "contiguous_strides",
    "storage_bytes",
]

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


class Role(str, enum.Enum):
    """What a storage is for; the simulator's breakdown of the peak groups by it."""

    INPUT = "input"            # the batch
    PARAMETER = "parameter"    # trainable weights
    BUFFER = "buffer"          # running stats, masks, frozen weights
    OPTIMIZER_STATE = "optimizer_state"
    CONSTANT = "constant"      # tensors baked into the graph at capture
    ACTIVATION = "activation"  # produced in the forward or loss phase
    TEMPORARY = "temporary"    # produced in the backward/optimizer phase, not a final gradient
    GRADIENT = "gradient"      # a parameter's gradient, a graph output
    OUTPUT = "output"          # the loss

    @property
    def resident(self) -> bool:
        """True for storages that exist before the step starts and outlive it."""
        return self in (Role.INPUT, Role.PARAMETER, Role.BUFFER, Role.OPTIMIZER_STATE,
                        Role.CONSTANT)


class Phase(str, enum.Enum):
    INPUT = "input"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True, slots=True)
class ValueRef:
    """A reference to a Value inside a node's ``args``/``kwargs`` (which otherwise hold constants)."""

    id: int


@dataclass(slots=True)
class Storage:
    id: int
    nbytes: int
    device: str
    role: Role
    name: str  # the first value's name, for reports


@dataclass(slots=True)
class Value:
    id: int
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    storage: int
    storage_offset: int
    role: Role
    phase: Phase
    module: str               # module path that produced it ("" = top level / outside modules)
    producer: int | None      # node id; None for graph inputs

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of this tensor's elements (its storage may be larger: see Storage.nbytes)."""
        return self.numel * self.itemsize


@dataclass(slots=True)
class Node:
    id: int
    name: str
    target: str                    # "aten.addmm.default", or "fitgraph.optimizer.adam"
    args: tuple[Any, ...]          # constants and ValueRefs, nested lists/tuples allowed
    kwargs: dict[str, Any]
    inputs: tuple[int, ...]        # value ids read (deduplicated, in order of first use)
    outputs: tuple[int | None, ...]  # value ids returned, None where the op returns a non-tensor
    mutates: tuple[int, ...]       # value ids written in place
    phase: Phase
    module: str
    random: bool = False           # draws from the RNG (dropout): never silently re-drawn
    flops: float = 0.0
    bytes_moved: int = 0           # bytes read + written, for roofline models
    out_is_tuple: bool = False     # the op returns a tuple/list (outputs index into it)


@dataclass(slots=True)
class Graph:
    """One captured training step. ``nodes`` are in the order eager PyTorch runs them."""

    nodes: list[Node]
    values: list[Value]
    storages: list[Storage]
    inputs: list[int]                      # value ids, the order the executor binds them
    input_names: list[str]                 # "param:l1.weight", "buffer:bn.running_mean", "batch:0", ...
    outputs: dict[str, int]                # "loss" and "grad:<param name>" -> value id
    meta: dict[str, Any] = field(default_factory=dict)

    def value(self, ref: ValueRef | int) -> Value:
        return self.values[ref.id if isinstance(ref, ValueRef) else ref]

    def storage_of(self, value_id: int) -> Storage:
        return self.storages[self.values[value_id].storage]

    @property
    def resident_bytes(self) -> int:
        """Bytes that exist before the step runs: weights, buffers, batch, optimizer state."""
        return sum(self.storages[st].nbytes for st in self.input_storages())

    def input_storages(self) -> list[int]:
        """Storages of the graph inputs, deduplicated (tied weights share one)."""
        return list(dict.fromkeys(self.values[v].storage for v in self.inputs))

    def summary(self) -> dict[str, Any]:
        by_phase: dict[str, int] = {}
        for n in self.nodes:
            by_phase[n.phase.value] = by_phase.get(n.phase.value, 0) + 1
        return {"nodes": len(self.nodes), "values": len(self.values),
                "storages": len(self.storages), "nodes_by_phase": by_phase,
                "resident_bytes": self.resident_bytes}


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def storage_bytes(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, itemsize: int) -> int:
    """Bytes a storage needs to hold a strided tensor (as torch computes it)."""
    if any(s == 0 for s in shape):
        return 0
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    return (offset + extent) * itemsize


class GraphBuilder:
    """Builds a Graph incrementally; used by capture and by tests that make graphs by hand."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.values: list[Value] = []
        self.storages: list[Storage] = []
        self.inputs: list[int] = []
        self.input_names: list[str] = []

    def new_storage(self, nbytes: int, device: str, role: Role, name: str) -> int:
        self.storages.append(Storage(len(self.storages), nbytes, device, role, name))
        return len(self.storages) - 1

    def new_value(self, name: str, shape, dtype: str, *, storage: int | None = None,
                  stride=None, offset: int = 0, role: Role = Role.ACTIVATION,
                  phase: Phase = Phase.FORWARD, module: str = "", producer: int | None = None,
                  device: str = "cpu") -> int:
        shape = tuple(int(s) for s in shape)
        stride = tuple(int(s) for s in stride) if stride is not None else contiguous_strides(shape)
        if storage is None:
            nbytes = storage_bytes(shape, stride, offset, DTYPE_BYTES[dtype])
            storage = self.new_storage(nbytes, device, role, name)
        self.values.append(Value(len(self.values), name, shape, stride, dtype, storage, offset,
                                 role, phase, module, producer))
        return len(self.values) - 1

    def add_input(self, name: str, shape, dtype: str, role: Role, *, storage: int | None = None,
                  stride=None, offset: int = 0, device: str = "cpu") -> int:
        vid = self.new_value(name, shape, dtype, storage=storage, stride=stride, offset=offset,
                             role=role, phase=Phase.INPUT, device=device)
        self.inputs.append(vid)
        self.input_names.append(name)
        return vid

    def add_node(self, target: str, inputs: list[int], outputs: list[tuple], *,
                 phase: Phase = Phase.FORWARD, module: str = "", mutates: tuple[int, ...] = (),
                 random: bool = False, flops: float = 0.0, name: str | None = None,
                 args: tuple | None = None, kwargs: dict | None = None,
                 alias_of: dict[int, int] | None = None) -> list[int]:
        """Add a node. ``outputs`` are (shape, dtype) pairs; ``alias_of`` maps an output index
        to the input value whose storage it shares (views, in-place results)."""
        nid = len(self.nodes)
        name = name or f"{target.split('.')[1] if '.' in target else target}_{nid}"
        role = Role.ACTIVATION if phase in (Phase.FORWARD, Phase.LOSS) else Role.TEMPORARY
        out_ids = []
        for i, (shape, dtype) in enumerate(outputs):
            st = self.values[alias_of[i]].storage if alias_of and i in alias_of else None
            out_ids.append(self.new_value(f"{name}" if len(outputs) == 1 else f"{name}.{i}",
                                          shape, dtype, storage=st, role=role, phase=phase,
                                          module=module, producer=nid))
        args = tuple(ValueRef(v) for v in inputs) if args is None else args
        self.nodes.append(Node(nid, name, target, args, kwargs or {}, tuple(dict.fromkeys(inputs)),
                               tuple(out_ids), tuple(mutates), phase, module, random, flops,
                               0, len(outputs) > 1))
        return out_ids

    def finish(self, outputs: dict[str, int], meta: dict | None = None, *,
               inputs_first: bool = False) -> Graph:
        """The graph. ``inputs_first``: number the inputs before every computed value (inputs
        added after nodes, like the optimizer's state, move to the front): graph rewriters
        emit inputs first, so value ids then carry over unchanged; ``outputs`` holds the
        builder's ids, and ids the caller kept are stale (use the graph's)."""
        if inputs_first:
            new = self.number_inputs_first()
            outputs = {k: new.get(v, v) for k, v in outputs.items()}
        g = Graph(self.nodes, self.values, self.storages, self.inputs, self.input_names,
                  dict(outputs), dict(meta or {}))
        for key, vid in g.outputs.items():
            st = g.storages[g.values[vid].storage]
            if st.id not in set(g.input_storages()):
                st.role = Role.OUTPUT if key == "loss" else Role.GRADIENT
                g.values[vid].role = st.role
        return g

    def number_inputs_first(self) -> dict[int, int]:
        """Renumber the values so that the inputs come first (each group in its order); node
        ids and storages are unchanged. Returns old id -> new id of every value that moved
        (empty where the inputs came first already), for ids the caller kept."""
        is_input = set(self.inputs)
        first_computed = next((v.id for v in self.values if v.id not in is_input), None)
        if first_computed is None or all(i < first_computed for i in self.inputs):
            return {}
        order = [v.id for v in self.values if v.id in is_input]
        order += [v.id for v in self.values if v.id not in is_input]
        new = {old: i for i, old in enumerate(order)}
        values = [self.values[old] for old in order]
        for i, v in enumerate(values):
            v.id = i
        self.values = values
        for n in self.nodes:
            n.args, n.kwargs = _renumber(n.args, new), _renumber(n.kwargs, new)
            n.inputs = tuple(new[v] for v in n.inputs)
            n.outputs = tuple(None if v is None else new[v] for v in n.outputs)
            n.mutates = tuple(new[v] for v in n.mutates)
        self.inputs = [new[v] for v in self.inputs]
        return new


def _renumber(obj: Any, new: dict[int, int]) -> Any:
    """``obj`` (nested tuples, lists, dicts of constants and ValueRefs) with refs renumbered."""
    if isinstance(obj, ValueRef):
        return ValueRef(new[obj.id])
    if isinstance(obj, (tuple, list)):
        out = [_renumber(o, new) for o in obj]
        return tuple(out) if isinstance(obj, tuple) else out
    if isinstance(obj, dict):
        return {k: _renumber(v, new) for k, v in obj.items()}
    return obj
