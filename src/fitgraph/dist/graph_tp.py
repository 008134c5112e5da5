"""Megatron-style tensor parallelism of a captured graph, found from its structure.

A weight matmul whose activation input is whole on every device can be *column-parallel*: its
weight split along its output features, each device makes a slice of the output. From there
the slice is followed node by node with fitgraph's dimension rules (``graph.dims``, the rules
operator fission uses): an op whose rule carries the split dim through (bias add, GeLU, the
head reshape, attention over heads, dropout) runs on slices; a weight the split reaches is
split along the dim the rule says (the *row-parallel* weight of the second matmul); an output
the rule calls a partial sum (the row-parallel matmul's) is all-reduced and whole again. Weight
matmuls reading one input (Q, K and V; gate and up) are tried together, as Megatron shards them.
A group is refused — its matmuls stay whole on every device — when a slice would reach an op
that needs its input whole (a norm over the features), leave its block, a dim would not divide
by the width, or no rule knows how to split an op along it; the reason is kept.

The backward of each sliced forward op is sliced too, and the input gradient of each
column-parallel group is all-reduced (Megatron's ``f``). Sequence parallelism is not applied
to captured graphs.

Example:
    >>> import torch, fitgraph
    >>> class Mlp(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.norm = torch.nn.LayerNorm(64)
    ...         self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
    ...     def forward(self, x):
    ...         return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
    >>> g = fitgraph.capture(Mlp(), torch.randn(8, 64), lambda m, b: m(b).square().mean())
    >>> tpm = tensor_parallel_map(g, 4)
    >>> len(tpm.groups), len(tpm.reduce_bytes), sorted(tpm.styles.items())
    (1, 1, [('down.weight', 'rowwise'), ('up.bias', 'colwise'), ('up.weight', 'colwise')])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..graph.dim_types import Along, Reduced
from ..graph.dims import node_splits, value_entries
from ..graph.ir import Graph, Phase, Role

__all__ = ["MATMULS", "TensorParallelMap", "tensor_parallel_map"]

MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.linear.default",
           "aten.matmul.default", "aten.bmm.default")
_FWD = (Phase.FORWARD, Phase.LOSS)


@dataclass
class TensorParallelMap:
    """Which forward nodes run on slices at width ``tp``, and what that costs in collectives."""

    tp: int
    sliced_nodes: set[int] = field(default_factory=set)
    reduce_bytes: dict[int, int] = field(default_factory=dict)    # node -> all-reduced bytes
    input_grad_bytes: dict[int, int] = field(default_factory=dict)  # first column node -> bytes
    sharded_params: dict[int, int] = field(default_factory=dict)  # param storage -> split dim
    groups: list[tuple[str, ...]] = field(default_factory=list)    # accepted: column nodes
    refused: list[str] = field(default_factory=list)
    # parameter name -> "colwise" (split along its output features, a column group's weights
    # and biases) or "rowwise" (the row-parallel matmul's weight): what a runtime's
    # ``parallelize_module`` plan names (ColwiseParallel / RowwiseParallel)
    styles: dict[str, str] = field(default_factory=dict)


def _param_storages(graph: Graph) -> set[int]:
    return {graph.values[v].storage for v in graph.inputs
            if graph.values[v].role is Role.PARAMETER}


def _seeds(graph: Graph, params: set[int]) -> dict[int, list[tuple[int, int]]]:
    """Weight matmuls of the forward by the storage of their activation input:
    storage -> [(node id, output value)]."""
    out: dict[int, list[tuple[int, int]]] = {}
    for n in graph.nodes:
        if n.phase not in _FWD or n.target not in MATMULS or not n.outputs or n.outputs[0] is None:
            continue
        weights = [v for v in n.inputs if graph.values[v].storage in params]
        acts = [v for v in n.inputs if graph.values[v].storage not in params
                and len(graph.values[v].shape) >= 2]
        if len(weights) >= 1 and len(acts) == 1:
            out.setdefault(graph.values[acts[0]].storage, []).append((n.id, n.outputs[0]))
    return out


def _readers(graph: Graph) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            out.setdefault(v, []).append(n.id)
    return out


def tensor_parallel_map(graph: Graph, tp: int, block_of_node: dict[int, int] | None = None
                        ) -> TensorParallelMap:
    """The slicing of ``graph``'s forward over ``tp`` devices (``block_of_node``: node -> block,
    to refuse slices that would cross blocks; None: one block)."""
    if tp < 1:
        raise ValueError(f"tensor-parallel width {tp}")
    tpm = TensorParallelMap(tp)
    if tp == 1:
        return tpm
    params = _param_storages(graph)
    names_of = {graph.values[v].storage: name.split(":", 1)[1]
                for v, name in zip(graph.inputs, graph.input_names)
                if graph.values[v].role is Role.PARAMETER and ":" in name}
    readers = _readers(graph)
    block = block_of_node or {}
    order = {n.id: i for i, n in enumerate(graph.nodes)}
    sliced: dict[int, tuple[int, int]] = {}   # value -> (dim, outer) it is cut along
    for storage, members in sorted(_seeds(graph, params).items(),
                                   key=lambda kv: order[kv[1][0][0]]):
        if any(out in sliced or nid in tpm.sliced_nodes for nid, out in members):
            continue    # a row-parallel matmul of a group already taken
        got = _try_group(graph, tp, members, dict(sliced), params, readers, block)
        names = tuple(graph.nodes[nid].name for nid, _ in members)
        if isinstance(got, str):
            tpm.refused.append(f"{', '.join(names)}: {got}")
            continue
        new_sliced, nodes, reduces, weights, column = got
        sliced = new_sliced
        tpm.sliced_nodes |= nodes
        tpm.reduce_bytes.update(reduces)
        tpm.sharded_params.update(weights)
        for st in weights:
            if st in names_of:
                tpm.styles[names_of[st]] = "colwise" if st in column else "rowwise"
        first = members[0][0]
        x = [v for v in graph.nodes[first].inputs if graph.values[v].storage == storage][0]
        tpm.input_grad_bytes[first] = _nbytes(graph, x)
        tpm.groups.append(names)
    return tpm


def _nbytes(graph: Graph, v: int) -> int:
    val = graph.values[v]
    n = 1
    for s in val.shape:
        n *= s
    return n * _itemsize(val.dtype)


def _itemsize(dtype: str) -> int:
    for key, size in (("64", 8), ("32", 4), ("16", 2), ("8", 1), ("bool", 1)):
        if key in dtype:
            return size
    return 4


def _try_group(graph, tp, members, sliced, params, readers, block):
    """Slice a column group and follow the slices; (sliced, nodes, reduces, weights) or why
    not."""
    nodes: set[int] = set()
    reduces: dict[int, int] = {}
    weights: dict[int, int] = {}
    home = {block.get(nid, 0) for nid, _ in members}
    if len(home) != 1:
        return "its matmuls are in different blocks"
    home_block = home.pop()
    pending: list[int] = []
    for nid, out in members:
        nd = len(graph.values[out].shape)
        table = _split(graph, nid, out, (nd - 1, 1))
        if table is None:
            return f"{graph.nodes[nid].name} has no rule splitting its output features"
        why = _apply(graph, tp, nid, table, sliced, params, weights, reduces)
        if why:
            return why
        nodes.add(nid)
        pending.extend(readers.get(out, ()))
    column = set(weights)
    seen: set[int] = set()
    # NOTE: walk the forward in graph order from the group's outputs
    frontier = sorted(set(pending))
    while frontier:
        nid = frontier.pop(0)
        if nid in seen:
            continue
        seen.add(nid)
        node = graph.nodes[nid]
        if node.phase not in _FWD:
            continue            # the backward reads slices, sliced itself
        if block.get(nid, home_block) != home_block:
            return f"a slice would leave its block at {node.name}"
        ins = [v for v in node.inputs if v in sliced]
        if not ins:
            continue
        v = ins[0]
        table = (_split(graph, nid, v, sliced[v])
                 or _row_parallel(graph, nid, v, sliced[v], params)
                 or _same_shape(graph, nid, v, sliced[v])
                 or _strided_split(graph, nid, v, sliced[v], tp))
        if table is None:
            if node.target in ("aten.split.Tensor", "aten.split_with_sizes.default"):
                sizes = [graph.values[o].shape[sliced[v][0]] for o in node.outputs
                         if o is not None]
                return (f"{node.name} splits the sliced dim into parts of {sizes}, which do "
                        f"not all divide by {tp}")
            return (f"{node.name} ({node.target}) cannot run on slices of dim {sliced[v][0]} "
                    f"(it needs that dim whole)")
        why = _apply(graph, tp, nid, table, sliced, params, weights, reduces)
        if why:
            return why
        nodes.add(nid)
        for o in list(node.outputs) + list(node.mutates):
            if o is not None and o in sliced:
                for r in readers.get(o, ()):
                    if r not in seen:
                        frontier.append(r)
        frontier.sort()
    for v, _ in sliced.items():
        if v in graph.outputs.values():
            return "a slice would be a step output"
    return sliced, nodes, reduces, weights, column


# NOTE: ops whose outputs have their input's shape and whose elements are made independently:
# dropout's mask (each device draws its own slice, as Megatron's tensor-parallel RNG does)
_SAME_SHAPE = ("aten.empty_like.default", "aten.zeros_like.default", "aten.ones_like.default",
               "aten.full_like.default", "aten.rand_like.default", "aten.randn_like.default",
               "aten.bernoulli_.float", "aten.bernoulli.default", "aten.bernoulli.p",
               "aten.uniform_.default", "aten.normal_.default", "aten.fill_.Scalar",
               "aten.zero_.default")


def _split(graph, nid, v, cut):
    """The node's split that cuts ``v`` as ``cut`` = (dim, outer) does (value -> entry), if
    its dimension rule has one."""
    dim, outer = cut
    node = graph.nodes[nid]
    try:
        splits = node_splits(graph, node)
    except KeyError:
        return None
    for split in splits:
        table = value_entries(node, split)
        if table is None:
            continue
        e = table.get(v)
        if (isinstance(e, Along) and e.dim == dim and e.outer == outer and e.window is None
                and not e.rebase):
            return table
    if outer == 1:
        return None
    # NOTE: a dim that is two dims merged (batch x heads of a bmm) passes through an op whose
    # rule maps it element for element to same-sized dims (a bmm's batch dim): the merged
    # structure, and the cut of its inner dim, carries over to those dims
    size = graph.values[v].shape[dim]
    for split in splits:
        table = value_entries(node, split)
        if table is None:
            continue
        e = table.get(v)
        if not (isinstance(e, Along) and e.dim == dim and e.outer == 1 and e.unit == 1):
            continue
        alongs = {u: a for u, a in table.items() if isinstance(a, Along)}
        if all(a.unit == 1 and a.outer == 1 and a.window is None and not a.rebase
               and graph.values[u].shape[a.dim] == size for u, a in alongs.items()):
            return {u: (Along(a.dim, outer=outer) if isinstance(a, Along) else a)
                    for u, a in table.items()}
    return None


def _same_shape(graph, nid, v, cut):
    node = graph.nodes[nid]
    if node.target not in _SAME_SHAPE:
        return None
    shape = graph.values[v].shape
    table = {}
    for u in list(node.inputs) + [o for o in node.outputs if o is not None]:
        table[u] = Along(cut[0], outer=cut[1]) if graph.values[u].shape == shape else None
    return table


def _strided_split(graph, nid, v, cut, tp):
    """A fused projection's output (QKV in one matmul) split into its parts along the sliced
    dim: each part is sliced too when every part divides by the width — the fused weight is
    then sliced part by part (Megatron lays a fused QKV weight out so)."""
    node = graph.nodes[nid]
    dim, outer = cut
    if node.target not in ("aten.split.Tensor", "aten.split_with_sizes.default") or outer != 1:
        return None
    want = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    nd = len(graph.values[v].shape)
    if (want + nd if want < 0 else want) != dim:
        return None
    outs = [o for o in node.outputs if o is not None]
    if any(graph.values[o].shape[dim] % tp for o in outs):
        return None
    table = {v: Along(dim)}
    table.update({o: Along(dim) for o in outs})
    return table


def _row_parallel(graph, nid, v, cut, params):
    """A weight matmul with a bias (addmm, linear) reading a slice along its contracted dim:
    the parts' products are partial sums and the bias is added once, after the all-reduce
    (Megatron's row-parallel linear). Dimension rules do not split these (the bias would be
    added in every part), so this one case is read here."""
    node = graph.nodes[nid]
    dim, outer = cut
    if node.target not in ("aten.addmm.default", "aten.linear.default") or not node.outputs:
        return None
    val = graph.values[v]
    if dim != len(val.shape) - 1 or outer != 1:
        return None
    others = [u for u in node.inputs if u != v]
    weight = [u for u in others if graph.values[u].storage in params
              and len(graph.values[u].shape) == 2]
    if len(weight) != 1:
        return None
    w = weight[0]
    k = val.shape[-1]
    wshape = graph.values[w].shape
    # addmm(bias, x, W^T): W^T is (k, n), split along 0; linear(x, W, bias): W is (n, k), 1
    wdim = 0 if node.target == "aten.addmm.default" else 1
    if wshape[wdim] != k:
        return None
    table = {u: None for u in others}
    table[v] = Along(dim)
    table[w] = Along(wdim)
    table[node.outputs[0]] = Reduced("sum")
    return table


def _apply(graph, tp, nid, table, sliced, params, weights, reduces) -> str | None:
    node = graph.nodes[nid]
    for v, entry in table.items():
        is_out = v in node.outputs or v in node.mutates
        val = graph.values[v]
        if isinstance(entry, Along):
            if entry.window is not None or entry.rebase:
                return f"{node.name}: a windowed split"
            size = val.shape[entry.dim]
            units = size // max(entry.outer, 1) // max(entry.unit, 1)
            if units % tp or size % max(entry.outer, 1):
                return (f"{node.name}: dim {entry.dim} of size {size} does not divide by "
                        f"{tp}" + (f" ({units} units of {entry.unit})" if entry.unit > 1 else ""))
            cut = (entry.dim, entry.outer)
            if is_out:
                sliced[v] = cut
            elif v in sliced:
                if sliced[v] != cut:
                    return f"{node.name} reads a slice cut another way"
            elif val.storage in params:
                weights[val.storage] = entry.dim
            # else: a whole activation every device holds: each reads its own slice, free
        elif isinstance(entry, Reduced):
            if not is_out or entry.how != "sum" or entry.overlap is not None:
                return f"{node.name}: a partial {entry.how} is not a plain sum"
            reduces[nid] = reduces.get(nid, 0) + _nbytes(graph, v)
            sliced.pop(v, None)
        elif entry is None:
            if v in sliced:
                return f"{node.name} ({node.target}) needs a sliced input whole"
            if is_out:
                return f"{node.name} ({node.target}) makes a whole output from slices"
    return None
