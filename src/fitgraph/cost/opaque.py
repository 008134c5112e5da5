"""Nodes that read an opaque byte buffer another op made: profiled after that op, on its output.

Some forward ops hand their backward a buffer only their own kernel can read: oneDNN's LSTM and
GRU layers (``mkldnn_rnn_layer``'s workspace -> ``mkldnn_rnn_layer_backward``), cuDNN's and
MIOpen's RNN reserve (``_cudnn_rnn`` / ``miopen_rnn``), cuDNN batch norm's reserve. PyTorch
types every one of them as bytes (uint8), and their size and layout are the kernel's own; the
captured shape may not even be their size (fake tensors give oneDNN's workspace 0 bytes). Fed
random bytes, such a backward follows garbage: ``nn.LSTM``'s killed the process (segmentation
fault) when the profiler ran it alone on synthetic inputs.

The rule is structural, not a list of names: a uint8 storage that an ATen op makes (not a
graph input, not fitgraph's own bit packing, not a random draw — those hold valid bytes of
any value) is *opaque*, and a node reading one is measured with its makers: the node that
made the buffer and every earlier node that aliases or writes it run first, on synthetic
inputs, and the node is timed on their real outputs (the maker's other outputs too: an LSTM
backward reads the forward's output and final states beside its workspace); its remaining
inputs are synthetic as usual. A user's ``x.to(torch.uint8)`` read later is treated the same
way: valid either way, its profile only runs one op more. In situ (``cost/in_situ.py``) every
value but the graph's inputs is already real.

``ProfiledCostModel.measurement(graph, node).inputs`` and ``.priced_apart(graph)`` say which
nodes were measured this way.

The same route serves any node whose alone-run fails on synthetic inputs (a
``cholesky_ex(check_errors=True)`` of a matrix the step makes positive-definite): the profiler
runs it again after all its producers (``producers``), on their real outputs, and says so.

Sizes: where the captured size of an opaque buffer is short of what its maker really left
allocated (``Measurement.end_bytes``; oneDNN's LSTM workspace: 0 bytes captured, 3 MiB real
for a 2-layer, 128-wide LSTM on 8 x 50 steps), ``ProfiledCostModel.profile`` gives the storage
the measured size (``resize``), so the simulator counts what the step holds from the forward
to the backward (law 2): the graph's storage bytes change, its shapes (and cache keys) do not.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> b = GraphBuilder(); x = b.add_input("x", (4, 8), "float32", Role.INPUT)
    >>> y, ws = b.add_node("aten.mkldnn_rnn_layer.default", [x], [((4, 8), "float32"),
    ...                    ((0,), "uint8")])
    >>> gx = b.add_node("aten.mkldnn_rnn_layer_backward.default", [x, y, ws],
    ...                 [((4, 8), "float32")])[0]
    >>> o = opaque_inputs(b.finish({"loss": gx}))
    >>> o.chains
    {1: (0,)}
    >>> o.describe(1)[:47]
    'after mkldnn_rnn_layer_0 (aten.mkldnn_rnn_layer'
    >>> o.describe(0)
    'synthetic'
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph.analysis import new_storages
from ..graph.ir import Graph

__all__ = ["OPAQUE_DTYPE", "OpaqueInputs", "opaque_inputs", "producers"]

# NOTE: ATen types workspaces and reserves as Byte (uint8) tensors, whatever they hold
OPAQUE_DTYPE = "uint8"
_OWN_PREFIX = "fitgraph."  # NOTE: fitgraph's own ops (packed mask bits): valid bytes of any value


@dataclass(frozen=True, slots=True)
class OpaqueInputs:
    """``storages``: opaque storage id -> the node that made it; ``chains``: node id -> the
    nodes (in graph order) to run before it so that its opaque inputs are real."""

    storages: dict[int, int]
    chains: dict[int, tuple[int, ...]]
    graph: Graph

    def makes(self, node_id: int) -> list[int]:
        """The opaque storages ``node_id`` makes."""
        return [st for st, nid in self.storages.items() if nid == node_id]

    def resize(self, node_id: int, end_bytes: int, fresh_bytes: int) -> int:
        """Give the one opaque storage ``node_id`` makes the bytes its maker really left
        allocated beyond the captured ones (``end_bytes - fresh_bytes``); returns the bytes
        added (0 where nothing was short, or the maker makes several opaque storages: then
        which one is short is unknown, and ``alias_mismatches`` still reports it)."""
        made = self.makes(node_id)
        short = end_bytes - fresh_bytes
        if len(made) != 1 or short <= 0:
            return 0
        self.graph.storages[made[0]].nbytes += short
        return short

    def describe(self, node_id: int) -> str:
        """How ``node_id``'s inputs are made for its profile, in words."""
        chain = self.chains.get(node_id)
        if not chain:
            return "synthetic"
        node = self.graph.nodes[node_id]
        bufs = sorted({self.graph.values[v].name for v in node.inputs
                       if self.graph.values[v].storage in self.storages})
        makers = ", ".join(f"{self.graph.nodes[p].name} ({self.graph.nodes[p].target})"
                           for p in chain)
        return (f"after {makers}, on its real outputs: {', '.join(bufs)} "
                "opaque (a kernel's own workspace; random bytes could crash it)")


def opaque_inputs(graph: Graph) -> OpaqueInputs:
    """The opaque byte storages of ``graph`` and, for every node reading one, the nodes to run
    first (their own opaque inputs' makers included)."""
    fresh = new_storages(graph)
    made: dict[int, int] = {}
    for n in graph.nodes:
        if n.random or n.target.startswith(_OWN_PREFIX):
            continue
        for st in fresh[n.id]:
            if any(graph.values[v].dtype == OPAQUE_DTYPE and graph.values[v].storage == st
                    for v in n.outputs if v is not None):
                made[st] = n.id
    if not made:
        return OpaqueInputs({}, {}, graph)
    touch: dict[int, list[int]] = {st: [] for st in made}  # storage -> nodes making/writing it
    for n in graph.nodes:
        hit = {graph.values[v].storage for v in (*n.mutates, *(o for o in n.outputs if o is not None))}
        for st in hit & touch.keys():
            touch[st].append(n.id)
    chains: dict[int, tuple[int, ...]] = {}
    for n in graph.nodes:
        need: set[int] = set()
        todo = [n.id]
        while todo:
            nid = todo.pop()
            for v in graph.nodes[nid].inputs:
                st = graph.values[v].storage
                for p in touch.get(st, ()):
                    if p < nid and p not in need:
                        need.add(p)
                        todo.append(p)  # NOTE: a maker may itself read an opaque buffer
        if need:
            chains[n.id] = tuple(sorted(need))
    return OpaqueInputs(made, chains, graph)


def producers(graph: Graph, node_id: int) -> tuple[int, ...]:
    """Every node whose outputs ``node_id`` reads, directly or through others, in graph order
    (the step's prefix that makes its inputs from the graph's inputs)."""
    seen: set[int] = set()
    todo = [node_id]
    while todo:
        for v in graph.nodes[todo.pop()].inputs:
            p = graph.values[v].producer
            if p is not None and p not in seen:
                seen.add(p)
                todo.append(p)
    return tuple(sorted(seen))
