"""What a collective costs on a link: the α–β model, in seconds for bytes.

For ``n`` devices each holding ``nbytes`` (all-reduce, reduce-scatter input) or ``nbytes / n``
(all-gather input), on a link of latency α and per-device bandwidth β⁻¹ (``cluster.Link``):

- ring all-reduce: a reduce-scatter then an all-gather, ``2 (n-1) α + 2 (n-1)/n · nbytes · β``;
- tree all-reduce (NCCL's double binary tree): a reduce up and a broadcast down two trees,
  each carrying half the bytes, ``2 ⌈log2 n⌉ α + 2 · nbytes · β`` — a latency logarithmic in
  ``n``, a bandwidth term a little above the ring's; ``all_reduce_s`` takes the faster of the
  two, as NCCL picks by size (small messages and large groups: the tree);
- ring reduce-scatter and all-gather: ``(n-1) α + (n-1)/n · nbytes · β``;
- point-to-point (a pipeline stage's activations): ``α + nbytes · β``.

One device costs nothing. These are the bandwidth-optimal algorithms NCCL runs for large
messages; small messages are latency-bound, which the α terms carry.

Example:
    >>> from fitgraph.dist.cluster import LINKS
    >>> nv = LINKS["nvlink3"]
    >>> round(all_reduce_s(2**30, 8, nv) * 1e3, 2)   # 1 GiB over 8 GPUs of one node, in ms
    6.31
    >>> all_reduce_s(2**30, 1, nv)
    0.0
"""

from __future__ import annotations

import math

from .cluster import Link

__all__ = ["all_gather_s", "all_reduce_s", "p2p_s", "reduce_scatter_s"]


def _check(nbytes: float, n: int) -> None:
    if nbytes < 0 or n < 1:
        raise ValueError(f"a collective of {nbytes} bytes over {n} devices")


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """Each of ``n`` devices ends with the sum of its ``nbytes / n`` shard (ring)."""
    _check(nbytes, n)
    if n == 1:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Each of ``n`` devices ends with all ``nbytes`` from the ``nbytes / n`` it held (ring)."""
    return reduce_scatter_s(nbytes, n, link)


def all_reduce_s(nbytes: float, n: int, link: Link, algorithm: str = "auto") -> float:
    """Each of ``n`` devices ends with the sum of everyone's ``nbytes``: ``"ring"`` (a
    reduce-scatter then an all-gather), ``"tree"`` (double binary tree) or ``"auto"`` (the
    faster)."""
    ring = reduce_scatter_s(nbytes, n, link) + all_gather_s(nbytes, n, link)
    if algorithm == "ring" or n == 1:
        return ring
    tree = 2 * math.ceil(math.log2(n)) * link.latency_s + 2 * nbytes / link.bandwidth
    if algorithm == "tree":
        return tree
    if algorithm != "auto":
        raise ValueError(f"all-reduce algorithm {algorithm!r}: ring, tree or auto")
    return min(ring, tree)


def p2p_s(nbytes: float, link: Link) -> float:
    """One device sends ``nbytes`` to another."""
    _check(nbytes, 1)
    return link.latency_s + nbytes / link.bandwidth
