"""The moves of the ``hotspot`` greedy, and how it ranks them, vectorised.

A move is a set of nodes to drop together: one candidate with its forward-only chain
(``candidates.forward_chains``), one candidate dropped per use (``plan.remat.per_use``: what a
recompute re-makes of it only to feed other recomputes is freed after them), one block's
insides (``blocks.block_drop_sets``, what ``torch.utils.checkpoint`` around the block drops),
or every block at once. Per-node tables are indexed by drop-set entry: node ids, then per-use
entries (``n + id``). A move's score is
the bytes it frees among the storages live at the simulated peak per second of recompute it
adds; the greedy tries the best-scoring move first. Moves are stored as one flat array of node
ids with offsets, so that scoring all of them is a few numpy reductions, not a Python loop over
thousands of moves per greedy step.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
    >>> from fitgraph.cost.base import NodeCost
    >>> from fitgraph.plan.remat import remat_tables
    >>> from fitgraph.solvers.remat.moves import build_moves
    >>> from fitgraph.cost.base import BaseCostModel
    >>> class Ms(BaseCostModel):
    ...     name = "toy"
    ...     def node_cost(self, g, n): return NodeCost(1e-3, 0)
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.PARAMETER)
    >>> a = b.add_node("aten.relu.default", [x], [((4,), "float32")], module="h.0")[0]
    >>> y = b.add_node("aten.neg.default", [a], [((4,), "float32")], module="h.0")[0]
    >>> gy = b.add_node("aten.mul.Tensor", [y, a], [((4,), "float32")], phase=Phase.BACKWARD)[0]
    >>> g = b.finish({"loss": gy})
    >>> m = build_moves(g, Ms(), remat_tables(g))
    >>> m.keys   # every block at once, (2, "*"), is block h.0 here: one move
    [(0, '0'), (0, '1'), (0, '~0'), (0, '~1'), (1, 'h.0')]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...cost.base import CostModel
from ...graph.ir import Graph
from ...plan.remat import RematTables, per_use
from .blocks import block_drop_sets, blocks_of
from .candidates import MIN_RECOMPUTE_S, forward_chains, remat_candidates

__all__ = ["ALL_BLOCKS", "ALL_INNER_BLOCKS", "Moves", "build_moves"]

ALL_BLOCKS = (2, "*")
ALL_INNER_BLOCKS = (2, "**")


@dataclass
class Moves:
    keys: list[tuple]              # sorted: singles (0, node; 0, ~node per use), blocks
    nodes: list[frozenset[int]]    # per move: drop-set entries          (1, name), all blocks
    flat: np.ndarray               # every move's entries, concatenated in key order
    starts: np.ndarray             # where each move begins in ``flat``
    candidate: np.ndarray          # entry -> may be dropped
    node_bytes: np.ndarray         # entry -> bytes its node allocates
    seconds: np.ndarray            # entry -> recompute seconds (floored at MIN_RECOMPUTE_S)
    maker: np.ndarray              # storage -> node that allocates it, -1 for inputs
    shape: list[tuple]             # per move: its ops and their sizes (equal for copies)
    blocks: list[frozenset[int]]   # every block's drop set (also those equal to another move)
    every_block: frozenset[int]    # all (outermost) blocks' drop sets together
    every_inner_block: frozenset[int]  # all innermost blocks' drop sets together
    per_use: np.ndarray            # per move: drops a node per use

    def hot_nodes(self, peak_made: np.ndarray) -> np.ndarray:
        """Mask of the candidates (entries) that allocate a storage live at the peak."""
        makers = self.maker[peak_made]
        hot = np.zeros(len(self.candidate) // 2, dtype=bool)
        hot[makers[makers >= 0]] = True
        return np.concatenate([hot, hot]) & self.candidate

    def ranked(self, hot: np.ndarray, dropped: np.ndarray, banned: np.ndarray,
               own_only: bool, k: int) -> list[int]:
        """Up to ``k`` moves that add a hot node not yet dropped, best score first (ties in
        key order)."""
        score = self._scores(hot, dropped, banned, own_only)
        ok = np.flatnonzero(np.isfinite(score))
        return ok[np.argsort(score[ok], kind="stable")][:k].tolist()

    def _scores(self, hot, dropped, banned, own_only) -> np.ndarray:
        fresh_hot = hot & ~dropped
        counts = np.add.reduceat(fresh_hot[self.flat].astype(np.int64), self.starts)
        ok = (counts > 0) & ~banned
        freed = np.add.reduceat(np.where(fresh_hot, self.node_bytes, 0)[self.flat], self.starts)
        free = dropped | ~self.candidate if own_only else dropped
        secs = np.add.reduceat(np.where(free, 0.0, self.seconds)[self.flat], self.starts)
        return np.where(ok, -freed / np.where(ok, secs, 1.0), np.inf)

    def best(self, hot: np.ndarray, dropped: np.ndarray, banned: np.ndarray,
             own_only: bool = False) -> list[int]:
        """The moves (indices, in key order) freeing the most peak bytes per recompute second
        that add a hot node not yet dropped: several when they tie (the same op in each layer
        of a model); none if no move qualifies. ``own_only`` counts only the seconds of the
        candidates themselves, not of the in-place writers they pull in (a second opinion:
        the greedy is myopic, and either count wins on some model)."""
        if not self.keys:
            return []
        fresh_hot = hot & ~dropped
        counts = np.add.reduceat(fresh_hot[self.flat].astype(np.int64), self.starts)
        ok = (counts > 0) & ~banned
        if not ok.any():
            return []
        freed = np.add.reduceat(np.where(fresh_hot, self.node_bytes, 0)[self.flat], self.starts)
        free = dropped | ~self.candidate if own_only else dropped
        secs = np.add.reduceat(np.where(free, 0.0, self.seconds)[self.flat], self.starts)
        score = np.where(ok, -freed / np.where(ok, secs, 1.0), np.inf)
        return np.flatnonzero(score == score.min()).tolist() if score.min() < 0 else \
            [int(np.argmin(score))]


def build_moves(g: Graph, cost_model: CostModel, tables: RematTables) -> Moves:
    """Every move of ``g``, with the per-node tables ``Moves.best`` ranks them by."""
    ok, fresh = tables.allowed, tables.fresh
    n = len(g.nodes)
    candidates = remat_candidates(g, ok, fresh)
    chain = forward_chains(g, candidates)
    table: dict[tuple, frozenset[int]] = {(0, str(nid)): frozenset(chain[nid])
                                          for nid in sorted(candidates)}
    # NOTE: per use: a value that feeds recomputes far apart (block 3's input, recomputed early
    # in the backward, and block 2's MLP, late) is not held in between
    table.update({(0, f"~{nid}"): frozenset({nid, per_use(g, nid)}) for nid in sorted(candidates)})
    # NOTE: blocks of every level: a Swin stage and each of its layers (Hugging Face
    # checkpoints both, nested: the stage's recompute keeps only its layers' outputs)
    blocks = block_drop_sets(g, ok, fresh, nested=True)
    table.update({(1, blk): frozenset(nodes & candidates) for blk, nodes in blocks.items()})
    outer = [nodes for blk, nodes in blocks.items() if len(blocks_of(blk)) == 1]
    inner = [nodes for blk, nodes in blocks.items()
             if not any(other.startswith(blk + ".") for other in blocks)]
    if outer:  # NOTE: every block at once: the greedy can always reach checkpointing's plan
        table[ALL_BLOCKS] = frozenset(set().union(*outer) & candidates)
    if inner:  # NOTE: and every innermost block at once (nested checkpointing's inner level)
        table[ALL_INNER_BLOCKS] = frozenset(set().union(*inner) & candidates)
    # NOTE: with the in-place chains they pull in (dropout's bernoulli_, div_): what a move
    # really recomputes, so that its score counts their seconds
    table = {k: frozenset(v).union(*(tables.chain_of.get(nid, ()) for nid in v if nid < n))
             for k, v in table.items()}
    seen: set[frozenset[int]] = set()
    keys = []
    for k in sorted(table):  # NOTE: two keys with the same nodes are one move (the first key)
        if table[k] and table[k] not in seen:
            seen.add(table[k])
            keys.append(k)
    nodes = [table[k] for k in keys]
    sizes = np.array([len(v) for v in nodes], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    flat = np.array([nid for v in nodes for nid in sorted(v)], dtype=np.int64)
    candidate = np.zeros(n, dtype=bool)
    candidate[sorted(candidates)] = True
    node_bytes = np.array([sum(g.storages[s].nbytes for s in fresh[i]) for i in range(n)],
                          dtype=np.int64)
    seconds = np.zeros(n)
    for nid in sorted({x % n for x in set().union(*nodes)}):
        seconds[nid] = max(cost_model.node_cost(g, g.nodes[nid]).seconds, MIN_RECOMPUTE_S)
    # NOTE: a per-use entry costs (at least) its node's recompute once more, frees its bytes
    candidate, node_bytes, seconds = (np.concatenate([a, a]) for a in
                                      (candidate, node_bytes, seconds))
    maker = np.full(len(g.storages), -1, dtype=np.int64)
    for nid, ss in fresh.items():
        for st in ss:
            maker[st] = nid
    block_sets = [table[k] for k in sorted(table) if k[0] == 1 and table[k]]
    shape = [tuple(sorted(("~" * (i >= n) + g.nodes[i % n].target, int(node_bytes[i]))
                          for i in v)) for v in nodes]
    return Moves(keys, nodes, flat, starts, candidate, node_bytes, seconds, maker, shape,
                 block_sets, table.get(ALL_BLOCKS, frozenset()),
                 table.get(ALL_INNER_BLOCKS, frozenset()),
                 np.array([max(v) >= n for v in nodes], dtype=bool))
