"""Seconds of a matrix multiplication on a ``Chip``: an analytical loop-nest model — the
arrays' utilization from the tile shapes, the SRAM's tiling limits and the HBM traffic they
imply — and of a vector op by its lanes and bandwidth.

A GEMM ``C[M, N] = A[M, K] · B[K, N]`` (``batch`` times) runs as:

- **On the arrays.** Weight-stationary (TPU MXU): each array holds a ``rows × cols`` tile of
  ``B`` (reduction × output columns) and streams ``A``'s rows through, ``M + rows + cols``
  cycles per tile (filling and draining the pipeline); the ``⌈K/rows⌉·⌈N/cols⌉`` tiles of
  each GEMM go round the arrays. Output-stationary (a GPU tensor core): each array accumulates
  a ``rows × cols`` tile of ``C`` over ``K`` in ``K + rows + cols`` cycles; the
  ``⌈M/rows⌉·⌈N/cols⌉`` tiles go round the arrays. Ragged edges and the last round's idle
  arrays are the utilization lost.
- **Through the SRAM.** ``C`` is computed in blocks ``Mb × Nb`` kept in SRAM (float32
  partial sums) while slices of ``A`` and ``B`` stream in, double-buffered, one array depth
  of the reduction at a time; each of ``A`` is read from HBM ``⌈N/Nb⌉`` times, ``B`` ``⌈M/Mb⌉``
  times, ``C`` written once. The blocks are the ones that fit and move the least.
- **Between the SRAM and the arrays.** Weight-stationary: each weight tile is loaded once,
  ``A`` streams in once per column of tiles (``⌈N/cols⌉`` times: a narrow array re-reads its
  input often) and ``C``'s float32 partial sums go out after each row of tiles and come back
  for the next (``2⌈K/rows⌉ − 1`` passes: a short array accumulates often); output-stationary: ``A`` once per column of tiles, ``B`` once per row of tiles
  (``⌈M/rows⌉``), ``C`` once. Over the SRAM's bandwidth (``Chip.sram_bandwidth``: its banks).
- The GEMM takes the longest of the three (they overlap), never less than one tile's
  pipeline.

Example (TPUv4 on a square bf16 GEMM: 8 arrays of 128×128 at 1.05 GHz, near peak):
    >>> from fitgraph.hw.chip import CHIPS
    >>> t = gemm_seconds(CHIPS["tpuv4"], 8192, 8192, 8192)
    >>> round(2 * 8192**3 / t / CHIPS["tpuv4"].peak_flops(), 2)
    0.97
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from .chip import Chip

__all__ = ["Gemm", "gemm_seconds", "gemm_timing", "vector_seconds"]

ACC = 4           # bytes of a float32 partial sum


@dataclass(frozen=True)
class Gemm:
    """The timing of one GEMM on a chip (``gemm_timing``)."""

    seconds: float
    compute_s: float      # on the arrays, tile by tile
    traffic_s: float      # HBM bytes over HBM bandwidth
    hbm_bytes: float
    sram_s: float         # bytes between the SRAM and the arrays over its bandwidth
    utilization: float    # FLOPs over the arrays' peak over ``seconds``
    block: tuple[int, int]  # the SRAM block of C (Mb, Nb)


def gemm_seconds(chip: Chip, m: int, n: int, k: int, batch: int = 1,
                 itemsize: int = 2) -> float:
    """Seconds of ``batch`` GEMMs ``[m, k] · [k, n]`` with ``itemsize``-byte inputs."""
    return gemm_timing(chip, m, n, k, batch, itemsize).seconds


def gemm_timing(chip: Chip, m: int, n: int, k: int, batch: int = 1,
                itemsize: int = 2) -> Gemm:
    if min(m, n, k, batch) < 1:
        raise ValueError(f"GEMM {batch} x [{m}, {k}] x [{k}, {n}]: every size must be >= 1")
    return _timing(chip.tensor_cores, chip.array_rows, chip.array_cols, chip.dataflow,
                   chip.sram_bytes, chip.hbm_bandwidth, chip.clock_hz, chip.sram_bandwidth,
                   int(m), int(n), int(k), int(batch), int(itemsize))


@lru_cache(maxsize=1 << 16)
def _timing(arrays: int, rows: int, cols: int, dataflow: str, sram: int, hbm_bw: float,
            clock: float, sram_bw: float, m: int, n: int, k: int, batch: int,
            itemsize: int) -> Gemm:
    cycles = _compute_cycles(arrays, rows, cols, dataflow, m, n, k, batch)
    compute_s = cycles / clock
    (mb, nb), traffic = _blocks(sram, rows, m, n, k, itemsize)
    traffic *= batch
    traffic_s = traffic / hbm_bw
    sram_s = batch * _feed_bytes(rows, cols, dataflow, m, n, k, itemsize) / sram_bw
    seconds = max(compute_s, traffic_s, sram_s)
    peak = 2.0 * arrays * rows * cols * clock
    return Gemm(seconds, compute_s, traffic_s, traffic, sram_s,
                2.0 * m * n * k * batch / (seconds * peak), (mb, nb))


def _feed_bytes(rows: int, cols: int, dataflow: str, m: int, n: int, k: int,
                itemsize: int) -> float:
    """Bytes one GEMM moves between the SRAM and the arrays."""
    a, b, c = m * k * itemsize, k * n * itemsize, m * n * itemsize
    if dataflow == "weight-stationary":
        return float(b + a * math.ceil(n / cols) + m * n * ACC * (2 * math.ceil(k / rows) - 1))
    return float(a * math.ceil(n / cols) + b * math.ceil(m / rows) + c)


def _compute_cycles(arrays: int, rows: int, cols: int, dataflow: str, m: int, n: int, k: int,
                    batch: int) -> float:
    if dataflow == "weight-stationary":
        tiles = math.ceil(k / rows) * math.ceil(n / cols) * batch
        per_tile = m + rows + cols
    else:
        tiles = math.ceil(m / rows) * math.ceil(n / cols) * batch
        per_tile = k + rows + cols
    return math.ceil(tiles / arrays) * per_tile


@lru_cache(maxsize=1 << 16)
def _blocks(sram: int, depth: int, m: int, n: int, k: int,
            itemsize: int) -> tuple[tuple[int, int], float]:
    """The SRAM block ``(Mb, Nb)`` of ``C`` that fits and moves the fewest HBM bytes, and
    those bytes."""
    a, b, c = m * k * itemsize, k * n * itemsize, m * n * itemsize
    kc = min(k, depth)
    best = None
    for mb in _sizes(m):
        for nb in _sizes(n):
            # NOTE: C's block in float32, A's and B's slices double-buffered
            if mb * nb * ACC + 2 * itemsize * kc * (mb + nb) > sram:
                continue
            moved = a * math.ceil(n / nb) + b * math.ceil(m / mb) + c
            if best is None or moved < best[1]:
                best = ((mb, nb), moved)
    if best is None:
        # NOTE: not even one row and column fit: every partial sum goes to HBM and back
        return (1, 1), float(a * n + b * m + (2 * ACC + itemsize) * m * n * math.ceil(k / kc))
    return best[0], float(best[1])


def _sizes(dim: int) -> list[int]:
    """Block sizes tried along a dimension: powers of two below it, and the whole of it."""
    out = [1 << i for i in range(max(1, dim.bit_length())) if (1 << i) < dim]
    return out + [dim]


def vector_seconds(chip: Chip, elements: float, flops_per_element: float,
                   hbm_bytes: float) -> float:
    """Seconds of an elementwise or reduction op on the vector units: its FLOPs on the
    lanes, or its bytes over HBM, whichever is longer."""
    return max(elements * flops_per_element / chip.vector_flops(),
               hbm_bytes / chip.hbm_bandwidth)
