"""Which nodes a plan may drop and recompute: the graph's own rules, read by every layer.

The remat plan (``plan.remat``), the simulator, the executor, the transforms and the solvers all
ask the same questions of a graph: which storages are built in place by a chain of writers
(dropout's mask), which in-place writes a recompute may skip (BatchNorm's running statistics),
which nodes may be recomputed at all and why not, and which nodes are views (re-run for free
with the storage they alias). They are properties of the graph, so they live here.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.recompute_rules import recomputable
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    >>> recomputable(b.finish({"loss": y}))
    {0: 'produces a step output or a view of resident memory'}
"""

from __future__ import annotations

from .analysis import new_storages, output_storages, storage_accesses
from .ir import Graph, Phase

__all__ = ["SIDE_EFFECT_WRITES", "inplace_chains", "is_view_node", "recomputable",
           "recompute_without_writes"]


def inplace_chains(graph: Graph) -> dict[int, tuple[int, ...]]:
    """storage -> (creator, in-place writers...) for storages built in place in the forward and
    only read after (dropout's mask: ``empty_like → bernoulli_ → div_``). Such a chain is
    recomputed as a unit, so its in-place writes are re-applied in order, once each."""
    fresh = new_storages(graph)
    creator = {s: nid for nid, ss in fresh.items() for s in ss}
    out: dict[int, tuple[int, ...]] = {}
    for st, nodes in storage_accesses(graph).items():
        c = creator.get(st)
        # NOTE: views of the storage read no values: fission's parts written into slices of
        # one buffer (``slice`` then ``copy_``, part by part) are a clean chain
        nodes = [nid for nid in nodes if nid == c or not is_view_node(graph, nid, fresh)]
        if c is None or len(nodes) < 2 or nodes[0] != c:
            continue
        writers = [nid for nid in nodes if st in {graph.values[v].storage
                                                   for v in graph.nodes[nid].mutates}]
        k = len(writers)
        if not writers or nodes[1:k + 1] != writers:
            continue  # NOTE: someone reads an intermediate version: not a clean chain
        if any(graph.nodes[w].phase is not Phase.FORWARD or len(graph.nodes[w].mutates) != 1
               for w in writers) or graph.nodes[c].phase is not Phase.FORWARD:
            continue
        out[st] = (c, *writers)
    return out


# NOTE: ops whose only in-place writes are side effects that do not change their outputs:
# target -> (argument positions written in place, position of the flag that must be True).
# A recompute passes None for those arguments (the executor: ``recompute_without_writes``), so
# the write happens once, at the first compute. BatchNorm in training mode normalises with the
# batch's statistics; the running statistics it updates do not enter its outputs.
SIDE_EFFECT_WRITES: dict[str, tuple[tuple[int, ...], int]] = {
    "aten.native_batch_norm.default": ((3, 4), 5),
}


def recompute_without_writes(graph: Graph, nid: int) -> tuple[int, ...]:
    """Argument positions a recompute of node ``nid`` passes as None so that it does not write
    in place again (its outputs are the same); () when the node writes nothing or must not be
    recomputed for its writes.

    Example:
        >>> from fitgraph.graph.ir import GraphBuilder, Role
        >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.INPUT)
        >>> y = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
        >>> recompute_without_writes(b.finish({"loss": y}), 0)
        ()
    """
    n = graph.nodes[nid]
    rule = SIDE_EFFECT_WRITES.get(n.target)
    if rule is None or not n.mutates:
        return ()
    positions, flag = rule
    args = n.args
    if len(args) <= max(*positions, flag) or args[flag] is not True:
        return ()
    written = {getattr(args[i], "id", None) for i in positions}
    return positions if set(n.mutates) <= written else ()


def recomputable(graph: Graph) -> dict[int, str]:
    """node id -> "" if its outputs may be dropped and recomputed, else the reason why not.

    Random ops are recomputable: the executor replays the RNG state they drew from (law 1).
    Never recomputed: ops that write in place (a recompute would apply the write twice) unless
    they belong to an in-place chain (``inplace_chains``, recomputed as a unit) or their writes
    are side effects a recompute can skip (``recompute_without_writes``: BatchNorm's running
    statistics), ops whose output storage is written in place later or that read a
    storage written in place later (outside such a chain), optimizer updates, and ops whose
    outputs are step outputs or views of resident storage, and nodes named in
    ``graph.meta["pinned"]`` (a compiled region's random and impure ops, which its modules
    cannot replay: ``compile_backend``). Optimizer updates do not count as
    later writes: ``graph.deps`` makes each wait for every recompute that may read its weight.
    """
    mutated_at: dict[int, list[int]] = {}
    for n in graph.nodes:
        if n.phase is Phase.OPTIMIZER:
            # NOTE: an update waits for every node whose recompute may read its weight
            # (graph.deps), also when it runs inside the backward (optimizer-in-backward), so
            # it never changes what a recompute reads; remat_plan checks it
            continue
        for v in n.mutates:
            mutated_at.setdefault(graph.values[v].storage, []).append(n.id)
    keep = output_storages(graph)
    fresh = new_storages(graph)
    chains = inplace_chains(graph)
    in_chain = {nid for ch in chains.values() for nid in ch}
    pinned = set(graph.meta.get("pinned", ()))
    out: dict[int, str] = {}
    for n in graph.nodes:
        why = ""
        if n.name in pinned:
            why = "pinned (its outputs are kept: graph.meta['pinned'])"
        elif n.mutates and n.id not in in_chain and not recompute_without_writes(graph, n.id):
            why = "writes in place"
        elif n.phase is Phase.OPTIMIZER:
            why = "optimizer update"
        elif any(s in keep for s in fresh[n.id]) or not fresh[n.id] and any(
                graph.values[o].storage in keep for o in n.outputs if o is not None):
            why = "produces a step output or a view of resident memory"
        else:
            touched = {graph.values[v].storage for v in n.inputs}
            touched |= {graph.values[o].storage for o in n.outputs if o is not None}
            view = is_view_node(graph, n.id, fresh)
            if any(m > n.id and not (s in chains and (n.id in chains[s] or view))
                   for s in touched for m in mutated_at.get(s, ())):
                why = "reads or produces a storage that a later node writes in place"
        out[n.id] = why
    return out


def is_view_node(graph: Graph, nid: int, fresh: dict[int, list[int]]) -> bool:
    """A view node: allocates nothing, writes nothing, draws no random numbers; re-run (for
    free) whenever the storage it aliases is recomputed."""
    n = graph.nodes[nid]
    return not fresh[nid] and not n.random and not n.mutates and n.phase is not Phase.OPTIMIZER
