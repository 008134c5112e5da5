"""Repeated blocks of a model, from module paths: ``h.3``, ``encoder.layer.11``, ``layer2.1``;
each call of a block called more than once is a block of its own (``groups.0@2``: the capture
labels the k-th call ``@k``, as ALBERT runs its one shared layer four times).

Example:
    >>> from fitgraph.solvers.remat.blocks import block_of, blocks_of
    >>> block_of("encoder.layer.3.attention.self"), block_of("lm_head")
    ('encoder.layer.3', None)
    >>> block_of("encoder.groups.0@2.layers.0.ffn"), blocks_of("encoder.groups.0@2.layers.0.ffn")
    ('encoder.groups.0@2', ['encoder.groups.0@2', 'encoder.groups.0@2.layers.0'])
"""

from __future__ import annotations

import re

from ...graph.analysis import new_storages, users
from ...graph.ir import Graph, Phase
from ...graph.recompute_rules import recomputable

__all__ = ["block_drop_sets", "block_of", "blocks_of"]

# NOTE: a numbered component, and its call where the module ran more than once
_BLOCK = re.compile(r"^(.*?\.\d+(?:@\d+)?)(?:\.|$)")
_NUMERIC = re.compile(r"\.\d+(?:@\d+)?(?=\.|$)")


def block_of(module: str) -> str | None:
    """The block (path up to its first numeric component) a module belongs to, if any."""
    m = _BLOCK.match(module)
    return m.group(1) if m else None


def blocks_of(module: str) -> list[str]:
    """Every block a module is in, outermost first: a path up to each numeric component
    (Swin's ``layers.0`` stage and its ``layers.0.blocks.1`` layer; Hugging Face checkpoints
    both, nested)."""
    return [module[:m.end()] for m in _NUMERIC.finditer(module)]


def block_drop_sets(g: Graph, ok: dict[int, str] | None = None,
                    fresh: dict[int, list[int]] | None = None,
                    nested: bool = False) -> dict[str, set[int]]:
    """block -> its recomputable forward nodes whose outputs stay inside the block: what
    ``torch.utils.checkpoint`` around that block drops after the forward (random ops excluded).
    ``ok``, ``fresh``: ``recomputable(g)`` and ``new_storages(g)`` if the caller has them.
    ``nested``: the blocks of every level (``blocks_of``), not only the outermost."""
    ok = recomputable(g) if ok is None else ok
    fresh = new_storages(g) if fresh is None else fresh
    readers = users(g)
    out: dict[str, set[int]] = {}
    for n in g.nodes:
        if n.phase is not Phase.FORWARD or ok[n.id] or not fresh[n.id]:
            continue
        levels = blocks_of(n.module)
        for blk in levels if nested else levels[:1]:
            # NOTE: outputs read by the forward outside the block are the block's outputs: kept
            leaves = any(g.nodes[r].phase is Phase.FORWARD
                         and not _inside(g.nodes[r].module, blk)
                         for o in n.outputs if o is not None for r in readers[o])
            if not leaves:
                out.setdefault(blk, set()).add(n.id)
    return dict(sorted(out.items()))


def _inside(module: str, block: str) -> bool:
    return module == block or module.startswith(block + ".")
