"""Targets of the ops that fitgraph itself writes into graphs (names only, no torch here: the
planning core reads them; the kernels are registered by ``execute/bit_packing.py``).

Example:
    >>> from fitgraph.graph.own_ops import PACK_BITS
    >>> PACK_BITS.split(".")[0]
    'fitgraph'
"""

from __future__ import annotations

__all__ = ["PACK_BITS", "UNPACK_BITS"]

PACK_BITS = "fitgraph.pack_bits.default"      # bool bits -> uint8, eight to a byte
UNPACK_BITS = "fitgraph.unpack_bits.default"  # uint8 packed bits -> bool of a shape
