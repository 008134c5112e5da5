"""Mean-reduced pointwise losses as their sums divided once, so that a region runs through them.

``F.mse_loss`` (a diffusion model's loss), ``huber_loss``, ``smooth_l1_loss``,
``soft_margin_loss`` and ``binary_cross_entropy`` are one ATen op each, and reduced by the mean
they divide by the number of elements: run in parts, each part would divide by its own count,
so fission cannot split them, and a region along the batch stops at the loss — the model's
output and the loss's gradient stay whole between forward and backward, and the step cannot be
run batch part by batch part (a U-Net trained with ``F.mse_loss`` at 0.6 of its eager peak:
remat alone, 1.16x eager's step; the same loss spelled ``(out - y).square().mean()``, which
splits, 0.89x). Here the forward is the sum-reduced op divided by the whole count after it,
and the backward the sum-reduced backward of the incoming gradient divided by that count
first: both split along any dim (``graph.dim_rules_loss``). Results are allclose to eager's,
not bitwise (the count divides the gradient before the product, not after).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.loss_sums import losses_as_sums
    >>> model = torch.nn.Linear(8, 4)
    >>> batch = (torch.randn(6, 8), torch.randn(6, 4))
    >>> loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> g = losses_as_sums(fitgraph.capture(model, batch, loss_fn))
    >>> [n.target.split(".")[1] for n in g.nodes if "mse" in n.name]
    ['mse_loss', 'div', 'div', 'mse_loss_backward']
    >>> loss = execute(g, fitgraph.eager_plan(g), model, batch)
    >>> bool(torch.isclose(loss, loss_fn(model, batch)))
    True
"""

from __future__ import annotations

from ..graph.analysis import verify_graph
from ..graph.dim_rules_loss import LOSSES, MEAN, SUM, reduction_index
from ..graph.dim_types import arg_of
from ..graph.ir import Graph, Node, Role, ValueRef, contiguous_strides
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["losses_as_sums", "mean_losses"]

_ALL = frozenset(LOSSES) | frozenset(LOSSES.values())


def mean_losses(graph: Graph) -> list[int]:
    """The mean-reduced pointwise loss nodes (forwards and backwards) of ``graph``."""
    return [n.id for n in graph.nodes if n.target in _ALL
            and arg_of(n, reduction_index(n.target), "reduction", MEAN) == MEAN]


def losses_as_sums(graph: Graph) -> Graph:
    """A copy of ``graph`` whose mean-reduced pointwise losses are sums divided by the element
    count (module doc); ``graph`` itself where it has none."""
    found = set(mean_losses(graph))
    if not found:
        return graph
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.id not in found:
            w.copy_node(n)
        elif n.target in LOSSES:
            _forward(w, graph, n)
        else:
            _backward(w, graph, n)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _summed(node: Node, w: GraphWriter, grad: int | None = None) -> tuple[tuple, dict]:
    """``node``'s args remapped, its reduction the sum, its incoming gradient ``grad``."""
    args, kwargs = w.remapped(node.args, node.kwargs)
    i = reduction_index(node.target)
    if i < len(args):
        args = args[:i] + (SUM,) + args[i + 1:]
    else:
        kwargs = dict(kwargs, reduction=SUM)
    if grad is not None:
        args = (ValueRef(grad),) + args[1:]
    return args, kwargs


def _count(graph: Graph, node: Node, pos: int) -> int:
    """The element count of the loss's input (argument ``pos``): what the mean divides by."""
    return graph.values[arg_of(node, pos, "self").id].numel


def _forward(w: GraphWriter, graph: Graph, n: Node) -> None:
    """loss(x, y, mean) as div(loss(x, y, sum), x.numel())."""
    out = graph.values[n.outputs[0]]
    kw = dict(phase=n.phase, module=n.module, device=graph.storages[out.storage].device)
    args, kwargs = _summed(n, w)
    scalar = Meta(out.shape, out.stride, out.storage_offset)
    total = w.add_node(f"{n.name}.sum", n.target, args, kwargs,
                       [OutSpec(f"{out.name}.sum", scalar, out.dtype, role=Role.TEMPORARY)],
                       flops=n.flops, **kw)[0]
    w.whole[n.outputs[0]] = w.add_node(
        n.name, "aten.div.Scalar", (ValueRef(total), _count(graph, n, 0)), {},
        [OutSpec(out.name, scalar, out.dtype, w.mapped_storage(out.storage), out.role)], **kw)[0]


def _backward(w: GraphWriter, graph: Graph, n: Node) -> None:
    """loss_backward(g, x, y, mean) as loss_backward(div(g, x.numel()), x, y, sum)."""
    g = graph.values[n.args[0].id]
    out = graph.values[n.outputs[0]]
    kw = dict(phase=n.phase, module=n.module, device=graph.storages[out.storage].device)
    scaled = w.add_node(f"{n.name}.scaled", "aten.div.Scalar",
                        (ValueRef(w.whole[g.id]), _count(graph, n, 1)), {},
                        [OutSpec(f"{g.name}.scaled", Meta(g.shape, contiguous_strides(g.shape), 0),
                                 g.dtype, role=Role.TEMPORARY)], **kw)[0]
    args, kwargs = _summed(n, w, grad=scaled)
    w.whole[n.outputs[0]] = w.add_node(
        n.name, n.target, args, kwargs,
        [OutSpec(out.name, Meta(out.shape, out.stride, out.storage_offset), out.dtype,
                 w.mapped_storage(out.storage), out.role)], flops=n.flops, **kw)[0]
