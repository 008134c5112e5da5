"""Run elementwise ops on the tensor a reshape views: ``f(x.view(s))`` becomes ``f(x).view(s)``.

A language-model head is captured as a 2-D matmul (``[batch x seq, vocab]``) viewed as 3-D, and
the token loss flattens it back to 2-D (``view_chains`` collapses that round trip). Ops between
the two reshapes — Gemma-2's logit soft-capping (``tanh(logits / cap) * cap``), a temperature,
an activation between two linear layers — run on the 3-D view, and their gradients on 3-D
views of 2-D tensors: the round trip no longer collapses, and to operator fission the 3-D
tensors are a wall (the flattened token axis splits in at most ``batch`` parts). Gemma-2's
chunked loss then kept the 2 MiB soft-capped logits, their tanh and the logits' gradient whole
at the least peak.

An elementwise op whose every tensor operand is a reshape view of a dense tensor of one shape
(or a 0-dim tensor, broadcast alike) computes the same elements in the same order on those
tensors themselves: it is made to, and its result viewed back to the shape it had. Chains of
such ops move one after the other, and the reshape round trips around them collapse
(``view_chains``). Results are bitwise the same.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.elementwise_views import elementwise_before_reshapes
    >>> model = torch.nn.Linear(8, 5)
    >>> batch = (torch.randn(2, 3, 8), torch.tensor([[0, 1, 2], [3, 4, 0]]))
    >>> def loss_fn(m, b):   # soft-capped logits, as Gemma-2's
    ...     logits = torch.tanh(m(b[0]) / 30.0) * 30.0
    ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[1].flatten())
    >>> g = fitgraph.capture(model, batch, loss_fn)
    >>> g2 = elementwise_before_reshapes(g)
    >>> [n.name for n in g2.nodes if n.name.endswith(".reshaped")][:2]
    ['div.reshaped', 'tanh.reshaped']
    >>> bool(execute(g2, fitgraph.eager_plan(g2), model, batch) == loss_fn(model, batch))
    True
"""

from __future__ import annotations

from ..graph.analysis import flatten_refs, verify_graph
from ..graph.dim_rules import RULES
from ..graph.dim_rules_pointwise import elementwise
from ..graph.ir import Graph, Node, ValueRef, contiguous_strides
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec, map_refs

__all__ = ["RESHAPE_VIEWS", "elementwise_before_reshapes"]

# NOTE: ops whose output is the input's elements in the same order, as a view of its storage
RESHAPE_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default"})
ELEMENTWISE = frozenset(t for t, rule in RULES.items() if rule is elementwise)


def elementwise_before_reshapes(graph: Graph) -> Graph:
    """A copy of ``graph`` where each elementwise op on reshape views of dense tensors of one
    shape runs on those tensors and is viewed back (see the module doc); ``graph`` itself where
    there is none."""
    w = GraphWriter(graph)
    flat: dict[int, int] = {}   # new value id -> the dense tensor it is a reshape view of
    moved = 0
    for n in graph.nodes:
        bases = _bases(w, n, flat)
        if bases is None:
            w.copy_node(n)
            if n.target in RESHAPE_VIEWS:
                _note_reshape(w, n, flat)
            continue
        moved += 1
        old = graph.values[n.outputs[0]]
        base_shape = w.values[next(iter(bases.values()))].shape
        kw = dict(phase=n.phase, module=n.module, device=w.device_of(w.whole[n.inputs[0]]))
        reads = {w.whole[v]: bases.get(w.whole[v], w.whole[v]) for v in n.inputs}
        args = map_refs(map_refs(n.args, w.whole), reads)
        storage = w.mapped_storage(old.storage)
        e = w.add_node(n.name, n.target, args, dict(n.kwargs),
                       [OutSpec(f"{old.name}.flat",
                                Meta(base_shape, contiguous_strides(base_shape), 0), old.dtype,
                                storage=storage, role=old.role)],
                       flops=n.flops, **kw)[0]
        view = w.add_node(f"{n.name}.reshaped", "aten.view.default", (ValueRef(e), list(old.shape)),
                          {}, [OutSpec(old.name, Meta(old.shape, old.stride, 0), old.dtype,
                                       storage=storage, role=old.role)], **kw)[0]
        w.whole[old.id] = view
        flat[view] = e
    if not moved:
        return graph
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _bases(w: GraphWriter, n: Node, flat: dict[int, int]) -> dict[int, int] | None:
    """new operand id -> the dense tensor it views, for each operand that is not 0-dim, where
    ``n`` can run on those tensors (see the module doc); None where it cannot."""
    if (n.target not in ELEMENTWISE or n.mutates or n.random or n.out_is_tuple
            or len(n.outputs) != 1 or n.outputs[0] is None or flatten_refs(n.kwargs)
            or any(v not in w.whole for v in n.inputs)):
        return None
    out = w.old.values[n.outputs[0]]
    if out.stride != contiguous_strides(out.shape) or out.storage_offset:
        return None
    bases: dict[int, int] = {}
    for v in n.inputs:
        new = w.whole[v]
        val = w.values[new]
        if val.shape == ():
            continue  # NOTE: a 0-dim operand broadcasts over any shape alike
        if new not in flat or val.shape != out.shape:
            return None   # NOTE: broadcast or not a reshape view: the elements would differ
        bases[new] = flat[new]
    shapes = {w.values[b].shape for b in bases.values()}
    if len(shapes) != 1 or shapes == {out.shape}:
        return None
    return bases


def _note_reshape(w: GraphWriter, n: Node, flat: dict[int, int]) -> None:
    """Remember the new reshape view of node ``n`` where it views a dense tensor as laid out
    (same dtype and offset): through a chain of such views, the first one."""
    out = w.whole[n.outputs[0]]
    src = w.whole[n.inputs[0]]
    x, y = w.values[src], w.values[out]
    base = flat.get(src, src)
    b = w.values[base]
    if (x.dtype == y.dtype == b.dtype and y.stride == contiguous_strides(y.shape)
            and b.stride == contiguous_strides(b.shape) and b.storage_offset == y.storage_offset == 0
            and b.storage == y.storage):
        flat[out] = base
