"""Which forward ops of a captured step run on each tensor-parallel device's part of the
sequence under sequence parallelism, as ``dist.runtime`` runs them (``graph_model`` prices
those at ``1/tp``).

A row-parallel matmul's sums are reduce-scattered along the dim before its features (the
sequence): its output is a part. From there parts flow forward through the ops the runtime
runs on parts — elementwise ops, dropout, norms over the features, means and sums over other
dims, views that keep the split dim (which dim of each output follows is fission's dimension
rules' answer, ``graph.dims``) — and stop at anything else: a matmul gathers its input whole
(a column-parallel one for its slice of the features, another one to run whole), and so does
an op the runtime has no rule for parts for. A whole tensor that meets a part (the residual
stream entering a stage, a norm's weight) does not make the op whole. So the first norm of a
stage's first block reads the whole stream it receives and runs whole, as at run time.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.dist.graph_tp import tensor_parallel_map
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
    ...                           torch.nn.Linear(32, 8), torch.nn.LayerNorm(8))
    >>> g = fitgraph.capture(mlp, torch.randn(4, 6, 8), lambda m, b: m(b).square().mean())
    >>> parts = sequence_parts(g, tensor_parallel_map(g, 2))
    >>> sorted({g.nodes[n].target for n in parts})     # the second matmul, then its rows
    ['aten.addmm.default', 'aten.native_layer_norm.default', 'aten.view.default']
"""

from __future__ import annotations

from ..graph.dim_types import Along
from ..graph.dims import DimRuleMissing, node_splits, operands
from ..graph.ir import Graph, Phase
from .graph_tp import TensorParallelMap

__all__ = ["ROW_OPS", "sequence_parts"]

# NOTE: the ops ``dist.runtime.sequence_parallel`` runs on parts, by their names in a captured
# (decomposed) graph: elementwise ops, dropout, norms, means and sums, views
ROW_OPS = frozenset({
    "add", "sub", "mul", "div", "neg", "gelu", "relu", "silu", "tanh", "sigmoid", "exp", "pow",
    "rsqrt", "where", "masked_fill", "clone", "alias", "_to_copy", "erf", "cos", "sin",
    "native_dropout", "native_layer_norm", "mean", "sum", "view", "_unsafe_view", "reshape",
})


def sequence_parts(graph: Graph, tpm: TensorParallelMap) -> set[int]:
    """The forward nodes that run on parts of the sequence (module doc); the row-parallel
    matmuls, whose outputs are the first parts, among them."""
    dims: dict[int, int] = {}      # value id -> the dim its part is cut along
    on: set[int] = set()
    for m in tpm.reduce_bytes:
        out = graph.nodes[m].outputs[0]
        shape = graph.values[out].shape
        if len(shape) >= 2:
            dims[out] = len(shape) - 2
            on.add(m)
    for node in graph.nodes:
        if node.phase is not Phase.FORWARD or node.id in on or node.id in tpm.sliced_nodes:
            continue
        ops = operands(node)
        if not any(v in dims for v in ops) or node.target.split(".")[1] not in ROW_OPS:
            continue
        outs = _part_dims(graph, node, ops, dims)
        if outs is None:
            continue
        on.add(node.id)
        dims.update(outs)
    return on


def _part_dims(graph: Graph, node, ops: list[int], dims: dict[int, int]) -> dict | None:
    """The dims ``node``'s outputs are parts along where it runs on its operands' parts
    (``dims``), or None where no split of it keeps them."""
    if node.random:
        # NOTE: dropout: element by element, each device drawing its own part's mask
        d = dims[next(v for v in ops if v in dims)]
        return {o: d for o in node.outputs if o is not None}
    try:
        splits = node_splits(graph, node)
    except DimRuleMissing:
        return None
    for split in splits:
        if all(isinstance(e, Along) and e.dim == dims[v]
               for v, e in zip(ops, split.operands) if v in dims) and all(
                isinstance(e, Along) for o, e in zip(node.outputs, split.outputs)
                if o is not None):
            return {o: e.dim for o, e in zip(node.outputs, split.outputs) if o is not None}
    return None
