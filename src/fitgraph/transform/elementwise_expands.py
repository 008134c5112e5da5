"""Run elementwise ops before the expands they read: ``f(x.expand(s), c)`` becomes
``f(x, c).expand(s)``.

Hugging Face builds a causal mask once per step as a bool ``[1, 1, T, T]`` expanded over the
batch, and turns it into the float mask the attention adds with ``where(mask, 0, min)``: the
``where`` writes every batch row, a ``[B, 1, T, T]`` float tensor that every block reads and
the backward's re-made attention reads again, so it lives all step. Its rows are all alike.
Run on the tensor the expand reads, the op makes one row, and the expand views it over the
batch: the same elements (each is the op of the same operands), bitwise, in ``1/B`` of the
bytes. Gemma-2 makes two such masks (sliding and global), 0.5 MiB each at the sweep's size,
live at its smallest peak.

An op qualifies where it is elementwise (``dim_rules_pointwise.elementwise``), writes nothing
in place, makes one dense tensor that is not a step output, reads at least one expand (of a
tensor of the same rank: PyTorch's type promotion treats 0-dim tensors apart) and otherwise
0-dim tensors or tensors that broadcast, and where every reader of what it makes computes
elementwise too, or is an attention kernel that reads it as its mask (``MASK_READERS``; a view
or an in-place write of a stride-0 tensor would not do what it did), making, on meta tensors,
the strides it made (so a later view of what it makes holds). A bidirectional mask's ``where``
qualifies once ``constant_predicates`` has made the mask an expand.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.elementwise_expands import elementwise_before_expands
    >>> model = torch.nn.Linear(8, 8)
    >>> def loss_fn(m, x):
    ...     rows = torch.ones(1, 8, 8, dtype=torch.bool).tril().expand(4, 8, 8)
    ...     mask = torch.where(rows, 0.0, -1e4)
    ...     return (m(x) + mask).softmax(-1).square().sum()
    >>> x = torch.randn(4, 8, 8)
    >>> g = fitgraph.capture(model, x, loss_fn)
    >>> g2 = elementwise_before_expands(g)
    >>> [n.name for n in g2.nodes if n.name.endswith(".expanded")]
    ['where.expanded']
    >>> bool(execute(g2, fitgraph.eager_plan(g2), model, x) == loss_fn(model, x))
    True
"""

from __future__ import annotations

import math

from ..graph.analysis import flatten_refs, verify_graph
from ..graph.dim_rules import RULES
from ..graph.dim_rules_pointwise import elementwise
from ..graph.ir import DTYPE_BYTES, Graph, Node, ValueRef, contiguous_strides
from ..graph.kernel_facts import kernel_facts
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec, map_refs

__all__ = ["EXPAND", "elementwise_before_expands", "expanded_strides", "strides_kept"]

EXPAND = "aten.expand.default"
ELEMENTWISE = frozenset(t for t, rule in RULES.items() if rule is elementwise)
# NOTE: attention kernels that read their additive mask through its strides: an expanded mask
# (stride 0 over the batch or the query rows) gives bitwise the outputs and gradients of the
# dense one (tests/test_elementwise_expands.py); the CUDA kernels are not listed (the
# memory-efficient one pads and copies a mask whose rows are not aligned)
MASK_READERS = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
})


def elementwise_before_expands(graph: Graph) -> Graph:
    """A copy of ``graph`` where each elementwise op that reads expands runs on the tensors
    they expand and is expanded after (see the module doc); ``graph`` itself where none can."""
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(graph.values[v].storage, []).append(n)
    outputs = set(graph.outputs.values())
    w = GraphWriter(graph)
    expanded: dict[int, int] = {}   # new value id -> the tensor its expand reads
    moved = 0
    for n in graph.nodes:
        small = _small_shape(w, graph, n, expanded, readers, outputs)
        if small is None:
            w.copy_node(n)
            if n.target == EXPAND:
                _note_expand(w, n, expanded)
            continue
        moved += 1
        old = graph.values[n.outputs[0]]
        kw = dict(phase=n.phase, module=n.module, device=w.device_of(w.whole[n.inputs[0]]))
        reads = {w.whole[v]: expanded.get(w.whole[v], w.whole[v]) for v in n.inputs}
        args = map_refs(map_refs(n.args, w.whole), reads)
        st = graph.storages[old.storage]
        storage = w.new_storage(math.prod(small) * DTYPE_BYTES[old.dtype], st.device, st.role,
                                st.name)
        share = math.prod(small) / max(old.numel, 1)
        e = w.add_node(n.name, n.target, args, dict(n.kwargs),
                       [OutSpec(f"{old.name}.small", Meta(small, contiguous_strides(small), 0),
                                old.dtype, storage=storage, role=old.role)],
                       flops=n.flops * share, **kw)[0]
        stride = expanded_strides(small, contiguous_strides(small), old.shape)
        view = w.add_node(f"{n.name}.expanded", EXPAND, (ValueRef(e), list(old.shape)), {},
                          [OutSpec(old.name, Meta(old.shape, stride, 0), old.dtype,
                                   storage=storage, role=old.role)], **kw)[0]
        w.whole[old.id] = view
        expanded[view] = e
    if not moved:
        return graph
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _small_shape(w: GraphWriter, graph: Graph, n: Node, expanded: dict[int, int],
                 readers: dict[int, list[Node]], outputs: set[int]) -> tuple[int, ...] | None:
    """The shape ``n`` makes when it reads the tensors its expands read (None: ``n`` does not
    qualify, or that shape is its own)."""
    if (n.target not in ELEMENTWISE or n.mutates or n.random or n.out_is_tuple
            or len(n.outputs) != 1 or n.outputs[0] is None or flatten_refs(n.kwargs)
            or any(v not in w.whole for v in n.inputs)):
        return None
    out = graph.values[n.outputs[0]]
    later = readers.get(out.storage, ())
    if (out.id in outputs or out.stride != contiguous_strides(out.shape) or out.storage_offset
            or not all(_reads_alike(r, out.id) for r in later)):
        return None
    shapes = []
    for v in n.inputs:
        new = w.whole[v]
        shapes.append(w.values[expanded.get(new, new)].shape)
    if not any(w.whole[v] in expanded for v in n.inputs):
        return None
    small = _broadcast(shapes)
    if small is None:
        return None
    if small == out.shape or len(small) != len(out.shape):
        return None
    stride = expanded_strides(small, contiguous_strides(small), out.shape)
    if not all(strides_kept(graph, r, out.id, stride) for r in later):
        return None
    return small


def _reads_alike(n: Node, vid: int) -> bool:
    """Whether node ``n`` reads value ``vid`` as it would read it expanded: an elementwise op,
    or an attention kernel reading it as its mask alone; neither writing in place."""
    if n.mutates:
        return False
    if n.target in ELEMENTWISE:
        return True
    mask = n.kwargs.get("attn_mask")
    return (n.target in MASK_READERS and isinstance(mask, ValueRef) and mask.id == vid
            and vid not in flatten_refs(n.args))


def expanded_strides(shape: tuple[int, ...], stride: tuple[int, ...],
                     out: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a tensor of ``shape`` and ``stride`` expanded to ``out`` (0 where it
    broadcasts, and on the dims the expand puts in front)."""
    lead = len(out) - len(shape)
    aligned = (1,) * lead + tuple(shape), (0,) * lead + tuple(stride)
    return tuple(0 if s == 1 and o != 1 else t for s, t, o in zip(*aligned, out))


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to (None: they do not broadcast)."""
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for k, size in enumerate(s, rank - len(s)):
            if size != 1 and out[k] not in (1, size):
                return None
            out[k] = size if size != 1 else out[k]
    return tuple(out)


def strides_kept(graph: Graph, n: Node, vid: int, stride: tuple[int, ...]) -> bool:
    """Whether node ``n``, run on meta tensors with value ``vid`` strided as ``stride``, makes
    tensors strided as the graph records them (the runtime's answer: ``graph.kernel_facts``;
    False without one). True where ``stride`` is the one recorded: the node reads what it
    read (an op that cannot run on meta tensors, a captured optimizer's update, included)."""
    if tuple(stride) == tuple(graph.values[vid].stride):
        return True
    return kernel_facts().strides_kept(graph, n, vid, stride)


def _note_expand(w: GraphWriter, n: Node, expanded: dict[int, int]) -> None:
    """Remember the new expand of node ``n`` where it reads a tensor of its own rank."""
    out, src = w.whole[n.outputs[0]], w.whole[n.inputs[0]]
    if len(w.values[src].shape) == len(w.values[out].shape) >= 1:
        expanded[out] = src
