"""Tables a step builds in place from nothing and reads again in its backward, made constants of
the graph: evaluated once at capture, as eager PyTorch's caches hold them.

BEiT (and Data2Vec's vision model) builds its relative position index in every forward:
``zeros`` filled through slices and selects from ``arange`` coordinates shifted in place. Eager
PyTorch builds it once (Hugging Face caches it, ``compile_compatible_method_lru_cache``) and
reads the cached tensor at every step; a trace sees the cache, a constant, or — where the
tracer counts as compiling, which turns the cache off — the ops that build it. Built in the
graph, the index lives from the forward to the backward's gradient of the bias table that
reads it again, and its builders' temporaries (coordinates twice its size) come first: remat
cannot make it again, since a recompute re-makes what a node made, not the writes into its
views (``graph.recompute_rules.inplace_chains``). The same model then planned otherwise from one capture
to the next: 1.257x the lower bound with the ops, 1.239x with the constant.

Here a storage qualifies where every node that makes or writes it depends on no graph input
but constants (no batch, no weight, no random draw), at least one node writes it in place,
a backward node reads it, and nothing outside the nodes that build it reads what they make
but the whole tensor. Those nodes are run once (on the tensors they would make) and the
tensor they leave is a new ``const:`` input; the nodes are dropped. Every step then reads the
same values it made before: bitwise.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.capture.fold_tables import fold_constant_tables
    >>> model = torch.nn.Linear(8, 8)
    >>> def loss_fn(m, x):
    ...     table = torch.zeros(8, 8)
    ...     table[1:, 1:] = torch.arange(49.0).view(7, 7)
    ...     return (m(x) * table).square().sum()
    >>> g = fitgraph.capture(model, torch.randn(8, 8), loss_fn)
    >>> [n for n in g.input_names if n.startswith("const:_folded")]
    ['const:_folded_table_0']
    >>> any(n.target == "aten.zeros.default" for n in g.nodes)
    False
"""

from __future__ import annotations

from ..graph.analysis import flatten_refs, new_storages, storage_accesses, verify_graph
from ..graph.ir import Graph, Phase, Role
from ..transform.fission_meta import Meta
from ..transform.fission_writer import GraphWriter

__all__ = ["FOLDED_PREFIX", "fold_constant_tables"]

FOLDED_PREFIX = "_folded_table_"


def fold_constant_tables(graph: Graph) -> Graph:
    """``graph`` with each qualifying table a constant (see the module doc); ``graph`` itself
    where none qualifies."""
    tables = _tables(graph)
    if not tables:
        return graph
    import torch  # NOTE: local: the nodes that build the tables run here, once

    from ..execute.ops import ArgBinder, resolve_target

    build = sorted({nid for _, nodes in tables for nid in nodes})
    consts = graph.meta.get("constants", {})
    env: list = [None] * len(graph.values)
    for vid, name in zip(graph.inputs, graph.input_names):
        if name.startswith("const:"):
            env[vid] = consts[name.removeprefix("const:")]
    with torch.no_grad():
        for nid in build:
            n = graph.nodes[nid]
            args, kwargs = ArgBinder(n)(env)
            out = resolve_target(n.target)(*args, **kwargs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for o, t in zip(n.outputs, outs):
                if o is not None:
                    env[o] = t
    w = GraphWriter(graph)
    consts = dict(consts)
    inputs, names = [w.whole[v] for v in graph.inputs], list(graph.input_names)
    made: list[tuple[object, int]] = []   # NOTE: (table, its input): equal tables share one
    for base, _ in tables:
        v, t = graph.values[base], env[base]
        same = next((vid for u, vid in made if u.dtype == t.dtype and u.shape == t.shape
                     and u.stride() == t.stride() and u.device == t.device
                     and torch.equal(u, t)), None)
        if same is not None:
            # NOTE: each of BEiT's blocks builds the same index (eager's cache holds one)
            w.whole[base] = same
            continue
        key = f"{FOLDED_PREFIX}{len(made)}"
        consts[key] = t.clone()
        st = w.new_storage(graph.storages[v.storage].nbytes, graph.storages[v.storage].device,
                           Role.CONSTANT, f"const:{key}")
        w.whole[base] = w._value(f"const:{key}", Meta(v.shape, v.stride, v.storage_offset),
                                 v.dtype, st, Role.CONSTANT, Phase.INPUT, "", None)
        inputs.append(w.whole[base])
        names.append(f"const:{key}")
        made.append((t, w.whole[base]))
    skip = set(build)
    for n in graph.nodes:
        if n.id not in skip:
            w.copy_node(n)
    out = w.finish(dict(graph.meta, constants=consts))
    out = Graph(out.nodes, out.values, out.storages, inputs, names, out.outputs, out.meta)
    for _, vid in made:
        _narrow_index_table(out, vid)
    verify_graph(out)
    return out


# NOTE: where each op reads indices: the one argument an int32 table may feed (torch takes
# int32 indices as int64 ones, with the same results)
INDEX_ARGS = {"aten.index.Tensor": 1, "aten._unsafe_index.Tensor": 1,
              "aten.index_put.default": 1, "aten.index_put_.default": 1,
              "aten._unsafe_index_put.default": 1, "aten.index_select.default": 2,
              "aten.embedding.default": 1, "aten.embedding_dense_backward.default": 1}


def _narrow_index_table(graph: Graph, vid: int) -> None:
    """Stores the folded int64 table ``vid`` of ``graph`` as int32, in place, where its values
    fit and every reader (through views) reads it as indices.

    NOTE: BEiT's relative position index is [T*T] int64 (516 KiB at 257 tokens), resident for
    the whole step; at the least peak a plan reaches, that is 3% of it. Read as indices by the
    bias's gather and its gradient's scatter, int32 gives the same results at half the bytes."""
    import torch

    v = graph.values[vid]
    name = graph.input_names[graph.inputs.index(vid)].removeprefix("const:")
    table = graph.meta["constants"][name]
    if (v.dtype != "int64" or not table.numel()
            or table.min() < torch.iinfo(torch.int32).min
            or table.max() > torch.iinfo(torch.int32).max):
        return
    st = v.storage
    members = [u for u in graph.values if u.storage == st]
    ids = {u.id for u in members}
    for nid in storage_accesses(graph).get(st, ()):
        n = graph.nodes[nid]
        if all(o is None or graph.values[o].storage == st for o in n.outputs) and not n.mutates:
            continue   # NOTE: a view of the table: int32 too
        pos = INDEX_ARGS.get(n.target)
        elsewhere = [*(a for i, a in enumerate(n.args) if i != pos), n.kwargs]
        if pos is None or ids.intersection(flatten_refs(elsewhere)):
            return
    for u in members:
        u.dtype = "int32"
    graph.storages[st].nbytes //= 2
    graph.meta["constants"][name] = table.to(torch.int32)


def _tables(graph: Graph) -> list[tuple[int, list[int]]]:
    """(the table's whole value, the nodes that build it) for each qualifying table."""
    const_in = {v for v, name in zip(graph.inputs, graph.input_names) if name.startswith("const:")}
    free: set[int] = set()      # NOTE: nodes that depend on no graph input but constants
    for n in graph.nodes:
        if (n.phase is Phase.FORWARD and not n.random
                and all(v in const_in or graph.values[v].producer in free for v in n.inputs)):
            free.add(n.id)
    fresh = new_storages(graph)
    creator = {st: nid for nid, ss in fresh.items() for st in ss}
    keep = {graph.values[v].storage for v in graph.outputs.values()}
    readers: dict[int, list[int]] = {}
    writes: dict[int, list[int]] = {}   # NOTE: storage -> the nodes that write it in place
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n.id)
        for st in dict.fromkeys(graph.values[v].storage for v in n.mutates):
            writes.setdefault(st, []).append(n.id)
    out = []
    for st, nodes in storage_accesses(graph).items():
        c = creator.get(st)
        if c not in free or st in keep:
            continue
        writers = writes.get(st, [])
        if not writers or not all(w in free for w in writers):
            continue
        if not any(graph.nodes[nid].phase is Phase.BACKWARD for nid in nodes):
            continue
        base = next((o for o in graph.nodes[c].outputs if o is not None
                     and graph.values[o].storage == st and graph.values[o].storage_offset == 0
                     and graph.values[o].nbytes == graph.storages[st].nbytes), None)
        if base is None:
            continue
        build = _closure(graph, [c, *writers], free, fresh, writes)
        if build is None:
            continue
        inside = set(build)
        # NOTE: outside the build, only the whole table is read, and only after its last write
        leaks = [o for nid in build for o in graph.nodes[nid].outputs if o is not None
                 and o != base and any(r not in inside for r in readers.get(o, ()))]
        late = all(r > writers[-1] for r in readers.get(base, ()) if r not in inside)
        if leaks or not late:
            continue
        out.append((base, build))
    return out


def _closure(graph: Graph, nodes: list[int], free: set[int], fresh: dict[int, list[int]],
             writes: dict[int, list[int]]) -> list[int] | None:
    """``nodes`` and every node they read from, transitively, with every node that writes a
    storage they made (the coordinates BEiT shifts in place before it sums them), in order;
    None where one of them depends on more than constants, or writes a storage made elsewhere."""
    seen, todo = set(nodes), list(nodes)
    while todo:
        nid = todo.pop()
        if nid not in free:
            return None
        n = graph.nodes[nid]
        more = [graph.values[v].producer for v in n.inputs]
        more += [w for st in fresh[nid] for w in writes.get(st, ())]
        for p in more:
            if p is not None and p not in seen:
                seen.add(p)
                todo.append(p)
    made = {st for nid in seen for st in fresh[nid]}
    if any(graph.values[v].storage not in made for nid in seen for v in graph.nodes[nid].mutates):
        return None
    return sorted(seen)
