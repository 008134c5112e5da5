"""Optimizer updates in row chunks: a large parameter's update run on slices of its rows, one
after another, so that the update's temporaries are a slice's size, not the parameter's.

torch's single-tensor Adam makes two parameter-sized temporaries per update (``denom``:
``exp_avg_sq.sqrt()``, then that divided by the bias correction; and one more for a gradient
negated by ``maximize`` or decayed into, coupled weight decay); SGD one or two (weight decay,
Nesterov, ``maximize``). Once remat has emptied the backward, a language model's peak is often
the update of its largest parameter — weights, every gradient (kept to the step's end), the
optimizer's state, and twice the embedding table in temporaries (Llama small: 16 of its
126 MiB). Here such an update (the node's ``chunks``: ``execute.optimizer_ops`` runs torch's
own update on ``chunks`` row slices of the parameter, its gradient and its state, the step
counter advanced once) keeps ``1 / chunks`` of those bytes. Every update is elementwise, so
the values are the same bit for bit where ``kernel_facts().optimizer_chunks_alike`` says the
device's kernels make them so (a probe: on this CPU float32 and float64 by the single-tensor and
foreach updates, not bfloat16, and not the fused Adam in float32, whose vector body and scalar
tail round apart); elsewhere the rule does not match. It costs a launch per chunk more (nothing measurable on the CPU; on a GPU,
microseconds a chunk): ``auto`` plans on it where the updates bound every plan's peak
(``solvers.portfolio``) — not a rule of the coordinated search, whose every candidate ``auto``
plans.

Matched: ``fitgraph.optimizer.*`` updates of a real parameter of at least ``MIN_BYTES`` with
at least two rows, whose parameter, gradient and state are laid out contiguously (a row slice
is then one contiguous block) and whose update makes parameter-sized temporaries.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.transform.optimizer_chunks import chunk_updates, find_chunkable_updates
    >>> model = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 8))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> g = fitgraph.capture(model, torch.randint(0, 4096, (4, 16)),
    ...                      lambda m, b: m(b).square().mean(), opt)
    >>> [(g.nodes[m.node].name, m.chunks) for m in find_chunkable_updates(g)]
    [('adam_0.weight', 4)]
    >>> [n.kwargs.get("chunks") for n in chunk_updates(g).nodes if n.name == "adam_0.weight"]
    [4]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..graph.ir import Graph, Node, contiguous_strides
from ..graph.kernel_facts import kernel_facts

__all__ = ["CHUNK_BYTES", "MIN_BYTES", "ChunkedUpdate", "chunk_updates", "find_chunkable_updates",
           "temporaries"]

_PREFIX = "fitgraph.optimizer."
# NOTE: a chunk is at most this large: 1 MiB slices keep an update's temporaries small next to
# a zoo model's activations, and an update of 1 MiB takes ~0.5 ms on this CPU, far over the
# ~30 us a call of torch's update costs
CHUNK_BYTES = 1 << 20
MIN_BYTES = 2 * CHUNK_BYTES


@dataclass(frozen=True)
class ChunkedUpdate:
    """One update to run in ``chunks`` row slices; ``bytes_saved``: the temporaries' bytes it
    no longer holds at once."""

    node: int
    chunks: int
    bytes_saved: int
    flops_saved: float = 0.0


def temporaries(kind: str, hyper: dict) -> int:
    """How many parameter-sized temporaries torch's single-tensor update of ``kind`` holds at
    once with the param group's ``hyper`` (module doc).

    Example:
        >>> temporaries("adam", {"weight_decay": 0.01, "decoupled_weight_decay": True})
        2
        >>> temporaries("sgd", {"weight_decay": 0.0, "nesterov": False, "maximize": False})
        0
    """
    if kind == "adam":
        grad_made = hyper.get("maximize") or (hyper.get("weight_decay")
                                              and not hyper.get("decoupled_weight_decay"))
        return 2 + bool(grad_made)
    if kind != "sgd":
        return 0   # NOTE: only Adam's and SGD's updates are run in row chunks
    made = sum(bool(hyper.get(k)) for k in ("weight_decay", "nesterov", "maximize"))
    return min(made, 2)


def find_chunkable_updates(graph: Graph) -> list[ChunkedUpdate]:
    """Every optimizer update worth running in row chunks (module doc)."""
    found = []
    for n in graph.nodes:
        if not n.target.startswith(_PREFIX) or n.kwargs.get("chunks", 1) > 1:
            continue
        p = graph.values[n.inputs[0]]
        kind = n.target[len(_PREFIX):]
        temps = temporaries(kind, n.kwargs["hyper"])
        if (temps == 0 or p.nbytes < MIN_BYTES or len(p.shape) == 0 or p.shape[0] < 2
                or not _contiguous(graph, n)):
            continue
        if not kernel_facts().optimizer_chunks_alike(graph.storage_of(n.inputs[0]).device,
                                                     p.dtype, kind,
                                                     bool(n.kwargs["hyper"].get("fused"))):
            continue
        chunks = min(p.shape[0], -(-p.nbytes // CHUNK_BYTES))
        found.append(ChunkedUpdate(n.id, chunks, temps * (p.nbytes - p.nbytes // chunks)))
    return found


def _contiguous(graph: Graph, node: Node) -> bool:
    """The parameter, gradient and every parameter-shaped state contiguous (0-d step counters
    aside), so that a slice of rows is one block of each."""
    shape = graph.values[node.inputs[0]].shape
    for vid in node.inputs:
        v = graph.values[vid]
        if v.shape == () and vid != node.inputs[0]:
            continue
        if v.shape != shape or v.stride != contiguous_strides(shape) or v.dtype.startswith(
                "complex"):
            return False
    return True


def chunk_updates(graph: Graph) -> Graph:
    """``graph`` with every match of ``find_chunkable_updates`` run in row chunks (``graph``
    itself where none): the nodes' ``chunks`` set, nothing else changed."""
    matches = {m.node: m.chunks for m in find_chunkable_updates(graph)}
    if not matches:
        return graph
    nodes = [dataclasses.replace(n, kwargs={**n.kwargs, "chunks": matches[n.id]})
             if n.id in matches else n for n in graph.nodes]
    return dataclasses.replace(graph, nodes=nodes, meta=dict(graph.meta))
