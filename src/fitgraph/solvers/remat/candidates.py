"""What a remat solver may drop: recomputable forward nodes, and the chains that go with them.

Example:
    >>> from fitgraph.solvers.remat.candidates import MIN_RECOMPUTE_S
    >>> MIN_RECOMPUTE_S > 0
    True
"""

from __future__ import annotations

from ...graph.analysis import new_storages, users
from ...graph.ir import Graph, Phase
from ...graph.own_ops import PACK_BITS
from ...graph.recompute_rules import recomputable

__all__ = ["MIN_RECOMPUTE_S", "forward_chains", "random_bits", "remat_candidates"]

# NOTE: recompute cost floor, so that free-looking ops (views) do not divide by zero
MIN_RECOMPUTE_S = 1e-7


def remat_candidates(g: Graph, ok: dict[int, str] | None = None,
                     fresh: dict[int, list[int]] | None = None) -> set[int]:
    """Forward/loss nodes that allocate and may be dropped and recomputed (``ok``, ``fresh``:
    ``recomputable(g)`` and ``new_storages(g)`` if the caller has them), except random bits.

    NOTE: bits (``random_bits``) are a draw kept at a bit an element so that nothing ever
    replays it; re-made, they replay it, the dearest forward op on a CPU. Left as candidates,
    hotspot re-ran whole attention blocks of GPT-2 small draw included (9.4 ms for 2 MiB of
    bits): without them, 0.375x of the eager peak within 1.10x instead of 0.424x. A plan that
    replays draws is still planned, on the captured graph (``auto`` plans both)."""
    ok = recomputable(g) if ok is None else ok
    fresh = new_storages(g) if fresh is None else fresh
    bits = random_bits(g)
    return {n.id for n in g.nodes
            if not ok[n.id] and fresh[n.id] and n.phase in (Phase.FORWARD, Phase.LOSS)
            and n.id not in bits}


def random_bits(g: Graph) -> set[int]:
    """Nodes that make random bits: a bool output made by reading a storage that a random op
    wrote (``transform.compact_masks``'s ``mask != 0``), or in a storage that one writes (the
    bits drawn straight into a bool tensor, and the empty tensor they are drawn into), and the
    ``fitgraph::pack_bits`` of such bits or of a drawn storage (a fused dropout's mask)."""
    drawn = {g.values[v].storage for n in g.nodes if n.random
             for v in (*n.mutates, *(o for o in n.outputs if o is not None))}
    # NOTE: every output bool: CUDA's fused ``native_dropout`` writes its mask into a drawn
    # storage too, but its other output is the dropped tensor itself (as big as the input): a
    # remat candidate like any draw (replayed), else every dropout output of a step stays
    # (GPT-2 paper on an H100: hotspot's least peak 12.6 GiB, per-block checkpointing 6.3 GiB)
    bits = {n.id for n in g.nodes
            if any(o is not None for o in n.outputs)
            and all(g.values[o].dtype == "bool" for o in n.outputs if o is not None)
            and (any(g.values[v].storage in drawn for v in n.inputs)
                 or any(o is not None and g.values[o].storage in drawn for o in n.outputs))}
    # NOTE: bits packed eight to a byte are the same draw, kept smaller still (their unpacking
    # is a deterministic recompute from the packed bytes, and a candidate)
    return bits | {n.id for n in g.nodes if n.target == PACK_BITS
                   and any(g.values[v].producer in bits or g.values[v].storage in drawn
                           for v in n.inputs)}


def forward_chains(g: Graph, candidates: set[int]) -> dict[int, set[int]]:
    """node -> itself plus, transitively, the candidate producers of its inputs whose outputs
    are read by no backward node (kept alive only to recompute it), except random bits
    (``random_bits``).

    NOTE: a chain never absorbs a node that compacts a random draw into bits: those bits
    (a bit an element, packed) are what makes their readers a cheap deterministic recompute;
    absorbed, the move that drops a re-made dropout mask would replay the draw behind it,
    the dearest forward op on a CPU. Captured graphs have no such node (their masks are
    floats read by the backward), so this changes only ``compact_masks``'s rewrites.
    """
    readers = users(g)
    members: dict[int, list[int]] = {}
    for v in g.values:
        members.setdefault(v.storage, []).append(v.id)
    backward = {n.id for n in g.nodes if n.phase in (Phase.BACKWARD, Phase.OPTIMIZER)}
    bits = random_bits(g)

    only: dict[int, bool] = {}

    def forward_only(nid: int) -> bool:
        if nid not in only:  # NOTE: memoised: chains overlap, and a storage has many readers
            only[nid] = not any(r in backward for o in g.nodes[nid].outputs if o is not None
                                for v in members[g.values[o].storage] for r in readers[v])
        return only[nid]

    fresh = new_storages(g)
    forward = (Phase.FORWARD, Phase.LOSS)
    out: dict[int, set[int]] = {}
    for nid in sorted(candidates):
        group, stack, walked = {nid}, [nid], set()
        while stack:
            for v in g.nodes[stack.pop()].inputs:
                p = g.values[v].producer
                if p is None or p in group or p in walked:
                    continue
                if (p not in candidates and not fresh[p] and not g.nodes[p].mutates
                        and g.nodes[p].phase in forward):
                    # NOTE: a view (a reshape, a transpose, a select) neither allocates nor writes: the
                    # chain goes on through it to what made its storage. nn.MultiheadAttention's
                    # packed q, k, v is ``clone(squeeze(transpose(view(add(mm)))))``: stopped
                    # at the views, dropping the clone kept the add (as big) to recompute it
                    walked.add(p)
                    stack.append(p)
                elif p in candidates and p not in bits and forward_only(p):
                    group.add(p)
                    stack.append(p)
        out[nid] = group
    return out
