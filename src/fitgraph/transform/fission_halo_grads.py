"""Separate input gradients from weight gradients, so a spatial region runs on through a backward.

``convolution_backward`` makes the input gradient and the weight (and bias) gradient in one
node. Split spatially, the weight gradient is a sum over the output gradient's rows: a part
must sum exactly its own rows. The input gradient, to feed the next backward op of a chain,
must be *complete* on the rows the next part needs: every output row whose window reaches
them must be in the part — more rows than its own. One node cannot do both, so a region ends
at each ``convolution_backward`` (its input gradient leaves as a partial result that the parts
add up). ``separate_input_grads`` rewrites each such node as two: ``<name>.input`` (output mask
``[True, False, False]``) and ``<name>.weight`` (``[False, gw, gb]``), both reading what the
original read; the input gradient then splits by gathering (``dim_rules_window``), and a region
grown in the result runs a whole convolution chain, forward and backward, part by part.
Evaluation-mode batch norm's backward is separated the same way (its weight gradient is a sum
over the rows too).

The two nodes do the work of the one (their FLOPs split accordingly); on every backend the
input and weight gradients are separate kernels anyway (on CPU the separated graph gives the
same bits). The fission search (``solvers.fission.spatial``) separates only the nodes whose
halves a spatial region it splits holds; ``cost.scaled`` costs a half as a share of the whole.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.transform.fission_halo_grads import separate_input_grads
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.ReLU(), torch.nn.Conv2d(3, 1, 3))
    >>> batch = torch.randn(1, 2, 8, 8)
    >>> g = separate_input_grads(fitgraph.capture(model, batch, lambda m, b: m(b).sum()))
    >>> [n.name for n in g.nodes if n.target == "aten.convolution_backward.default"]
    ['convolution_backward.input', 'convolution_backward.weight', 'convolution_backward_1']
    >>> from fitgraph.execute import execute
    >>> loss = execute(g, fitgraph.eager_plan(g), model, batch)
    >>> want = torch.autograd.grad(model(batch).sum(), model[0].weight)[0]
    >>> torch.testing.assert_close(model[0].weight.grad, want)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Node
from .fission_writer import GraphWriter

__all__ = ["SEPARABLE", "separable", "separate_input_grads"]

# NOTE: target -> position of the output mask in its args
SEPARABLE = {
    "aten.convolution_backward.default": 10,
    "aten.native_batch_norm_backward.default": 9,
    # NOTE: a layer norm's weight gradient is a sum over its rows too: wav2vec2/HuBERT project
    # their convolution stack's frames through a layer norm, whose backward ended every region
    # along the time there (a part must make the rows the next convolution's backward gathers)
    "aten.native_layer_norm_backward.default": 7,
}
_TRAIN = 7   # NOTE: native_batch_norm_backward's `train`: in training the gradient is not separable


def separable(node: Node) -> bool:
    """True for a backward node making an input gradient and a weight or bias gradient whose
    input gradient can be computed alone (convolutions, evaluation-mode batch norm)."""
    pos = SEPARABLE.get(node.target)
    if pos is None or len(node.args) <= pos:
        return False
    if node.target == "aten.native_batch_norm_backward.default" and node.args[_TRAIN]:
        return False
    mask = node.args[pos]
    return bool(mask[0]) and any(mask[1:]) and node.outputs[0] is not None


def separate_input_grads(graph: Graph, nodes: Iterable[int] | None = None) -> Graph:
    """A copy of ``graph`` whose separable backward nodes (``nodes``: only those ids) each
    become an input-gradient node and a weight-gradient node; ``graph`` itself when none is."""
    chosen = set(range(len(graph.nodes)) if nodes is None else nodes)
    todo = [n.id for n in graph.nodes if n.id in chosen and separable(n)]
    if not todo:
        return graph
    w = GraphWriter(graph)
    names = []
    for n in graph.nodes:
        if n.id not in todo:
            w.copy_node(n)
            continue
        for part in _halves(graph, n):
            w.copy_node(part)
            names.append(part.name)
    out = w.finish(dict(graph.meta, separated_grads=list(graph.meta.get("separated_grads", []))
                        + names))
    verify_graph(out)
    return out


def _halves(graph: Graph, n: Node) -> tuple[Node, Node]:
    """The input-gradient node and the weight-gradient node that replace ``n``."""
    pos = SEPARABLE[n.target]
    mask = list(n.args[pos])
    # NOTE: a convolution's input and weight gradients cost one forward each (the bias: a sum)
    shares = [1.0 if mask[0] else 0.0, 1.0 if mask[1] else 0.0]
    total = sum(shares) or 1.0
    out = []
    for name, keep, share in ((f"{n.name}.input", [True, False, False], shares[0]),
                              (f"{n.name}.weight", [False] + mask[1:], shares[1])):
        args = tuple(keep if i == pos else a for i, a in enumerate(n.args))
        outs = tuple(o if k else None for o, k in zip(n.outputs, keep))
        moved = sum(graph.values[v].nbytes for v in n.inputs)
        moved += sum(graph.values[o].nbytes for o in outs if o is not None)
        out.append(replace(n, name=name, args=args, outputs=outs, flops=n.flops * share / total,
                           bytes_moved=moved))
    return out[0], out[1]
