"""Count a loss's targets apart from the loss, so its forward and backward fission together.

A mean-reduced ``nll_loss`` divides by its total weight (the number of targets not ignored).
``nll_loss_forward`` returns that count, and ``nll_loss_backward`` reads it whole: split along
tokens, the forward makes it in parts (a partial sum), so a region holding the forward can never
hold the backward, and the whole log-softmax [tokens, vocab] must be kept between them.
Here the backward reads a count made from the targets alone (``(target != ignore).sum()``, an
integer, cast to the loss's dtype as ``nll_loss_forward`` casts its own integer count: bitwise
the same, in bfloat16 too), which does not depend on the logits; a region can then run logits,
loss and its gradient chunk by chunk, the classic chunked cross-entropy.

Sum- and unreduced losses (``reduction="sum"``, as Hugging Face's ``num_items_in_batch``
division; ``reduction="none"`` with a per-token mask) pass the forward's total weight to the
backward too, which does not use it: it gets the value the forward makes (the count; 0 for
``"none"``) made apart the same way, so the region is not cut there either.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.fission_loss import count_targets_apart
    >>> model = torch.nn.Linear(8, 5)
    >>> batch = (torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 4, -100]))
    >>> loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    >>> g = count_targets_apart(fitgraph.capture(model, batch, loss_fn))
    >>> [n.name for n in g.nodes if n.name.startswith("nll_loss_forward.")]
    ['nll_loss_forward.kept', 'nll_loss_forward.counted', 'nll_loss_forward.count']
    >>> loss = execute(g, fitgraph.eager_plan(g), model, batch)
    >>> bool(torch.isclose(loss, loss_fn(model, batch)))
    True
"""

from __future__ import annotations

from dataclasses import replace

from ..graph.analysis import flatten_refs, verify_graph
from ..graph.dim_types import arg_of
from ..graph.ir import Graph, Node, Role, ValueRef, contiguous_strides
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["count_targets_apart", "counted_losses", "counting_nodes"]

_FORWARD = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")
_BACKWARD = ("aten.nll_loss_backward.default", "aten.nll_loss2d_backward.default")
_NONE, _MEAN, _SUM = 0, 1, 2
_TOTAL_WEIGHT = 6  # NOTE: position of total_weight in nll_loss_backward's args
_RESHAPES = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
                       "aten.squeeze.dim", "aten.squeeze.default", "aten.unsqueeze.default",
                       "aten.alias.default", "aten.detach.default", "aten.clone.default"})
_COUNT_STEPS = ("kept", "counted", "none", "count")
_WHY = ("counts a loss's targets apart for its backward: in a region it would become a partial "
        "sum the backward cannot read")


def counting_nodes(graph: Graph) -> dict[int, str]:
    """node id -> why it stays out of fission regions: the counts ``count_targets_apart``
    made (a region along the tokens would otherwise absorb them; pass as ``exclude``)."""
    names = set(graph.meta.get("counting_nodes", ()))
    return {n.id: _WHY for n in graph.nodes if n.name in names}


def counted_losses(graph: Graph) -> list[tuple[int, int]]:
    """(forward node, backward node) pairs where the backward reads the forward's total weight
    and a count of the targets makes it: no class weights where the weight counts (mean and
    sum reductions; unreduced, the total weight is 0 whatever the weights)."""
    out = []
    for n in graph.nodes:
        reduction = arg_of(n, 4, "reduction")
        if n.target not in _BACKWARD or reduction not in (_NONE, _MEAN, _SUM):
            continue
        if reduction != _NONE and arg_of(n, 3, "weight") is not None:
            continue
        tw = arg_of(n, _TOTAL_WEIGHT, "total_weight")
        if not isinstance(tw, ValueRef):
            continue
        fwd = graph.values[tw.id].producer
        if fwd is not None and graph.nodes[fwd].target in _FORWARD \
                and graph.nodes[fwd].outputs[1] == tw.id:
            out.append((fwd, n.id))
    return out


def count_targets_apart(graph: Graph) -> Graph:
    """A copy of ``graph`` whose losses' backwards read a count of the targets made apart
    (see the module doc); ``graph`` itself when it has no such loss."""
    pairs = counted_losses(graph)
    if not pairs:
        return graph
    fwd_of = dict(pairs)
    counts: dict[int, int] = {}     # backward node -> new count value
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.id in fwd_of:
            counts[fwd_of[n.id]] = _count(w, graph, n)
        if n.id in counts:
            n = _with_count(n, counts[n.id], w)
        w.copy_node(n)
    names = [n.name for n in w.nodes if n.name.rsplit(".", 1)[-1] in _COUNT_STEPS]
    out = w.finish(dict(graph.meta, counting_nodes=names))
    verify_graph(out)
    return out


def _count(w: GraphWriter, graph: Graph, fwd: Node) -> int:
    """Nodes computing the count of ``fwd``'s targets, just before it; the new value id."""
    import torch  # NOTE: local (planning modules import without torch): a cast names its dtype

    target = graph.values[_source(graph, arg_of(fwd, 1, "target").id)]
    tw = graph.values[fwd.outputs[1]]
    kw = dict(phase=fwd.phase, module=fwd.module, device=graph.storages[tw.storage].device)
    role = Role.ACTIVATION
    scalar = Meta((), (), 0)
    dense = Meta(target.shape, contiguous_strides(target.shape), 0)
    ignore = arg_of(fwd, 4, "ignore_index", -100)
    kept = w.add_node(f"{fwd.name}.kept", "aten.ne.Scalar", (ValueRef(w.whole[target.id]), ignore),
                      {}, [OutSpec(f"{fwd.name}.kept", dense, "bool", role=role)], **kw)[0]
    # NOTE: counted as an integer, then cast, as nll_loss_forward does: no constant of the
    # loss's dtype is needed (a float32 loss of a bfloat16 model has no input to make one from)
    counted = w.add_node(f"{fwd.name}.counted", "aten.sum.default", (ValueRef(kept),), {},
                         [OutSpec(f"{fwd.name}.counted", scalar, "int64", role=role)], **kw)[0]
    if arg_of(fwd, 3, "reduction", _MEAN) == _NONE:
        # NOTE: an unreduced loss's total weight is 0 (its backward does not read it)
        counted = w.add_node(f"{fwd.name}.none", "aten.mul.Scalar", (ValueRef(counted), 0), {},
                             [OutSpec(f"{fwd.name}.none", scalar, "int64", role=role)], **kw)[0]
    return w.add_node(f"{fwd.name}.count", "aten._to_copy.default", (ValueRef(counted),),
                      {"dtype": getattr(torch, tw.dtype)},
                      [OutSpec(f"{fwd.name}.count", scalar, tw.dtype, role=role)], **kw)[0]


def _source(graph: Graph, vid: int) -> int:
    """The tensor ``vid`` reshapes (through views that keep every element): the count reads it,
    not the loss's own view of it, which a region along the tokens would hold."""
    while True:
        p = graph.values[vid].producer
        if p is None or graph.nodes[p].target not in _RESHAPES:
            return vid
        src = graph.nodes[p].inputs[0]
        if graph.values[src].numel != graph.values[vid].numel:
            return vid
        vid = src


def _with_count(n: Node, count_new: int, w: GraphWriter) -> Node:
    """``n`` (a backward) reading the new count, registered in ``w.whole`` under a key no old
    value has, so that ``copy_node`` remaps it like any other."""
    old_tw = arg_of(n, _TOTAL_WEIGHT, "total_weight").id
    key = -1 - count_new
    w.whole[key] = count_new
    args = tuple(ValueRef(key) if i == _TOTAL_WEIGHT else a for i, a in enumerate(n.args))
    still = old_tw in flatten_refs((args, n.kwargs))
    inputs = tuple(v for v in n.inputs if v != old_tw or still) + (key,)
    return replace(n, args=args, inputs=inputs)
