"""Targets of the ops that fitgraph itself writes into graphs (names only, no torch here: the
planning core reads them; the kernels are registered by ``execute/bit_packing.py``).

Example:
    >>> from fitgraph.graph.own_ops import PACK_BITS
    >>> PACK_BITS.split(".")[0]
    'fitgraph'
"""

from __future__ import annotations

__all__ = ["MASK_SCALINGS", "PACK_BITS", "UNPACK_BITS", "UNPACK_SCALED", "packed_shape"]

PACK_BITS = "fitgraph.pack_bits.default"      # bool bits -> uint8, eight to a byte
UNPACK_BITS = "fitgraph.unpack_bits.default"  # uint8 packed bits -> bool of a shape
# NOTE: uint8 packed bits -> a float mask of a shape: each bit as 0 or 1 of a dtype put through
# in-place scalings (a dropout's ``div_(p)``), in one gather from a 256-byte table
UNPACK_SCALED = "fitgraph.unpack_scaled.default"
# NOTE: the in-place scalings of a dropout mask by a constant (its ``div_(p)``) that
# ``compact_masks`` rewrites and ``unpack_scaled`` replays
MASK_SCALINGS = frozenset({"aten.div_.Scalar", "aten.mul_.Scalar", "aten.div_.Tensor",
                           "aten.mul_.Tensor"})


def packed_shape(shape) -> tuple[int, ...]:
    """The shape ``pack_bits`` gives bits of ``shape``: its rows of bytes (the last dim / 8)
    where the last dim is a multiple of 8, so that a slice of rows (any dim but the last) or of
    whole bytes is a slice of the packed tensor too and unpacks alone (a part of a split
    region); else 1-D.

    Example:
        >>> packed_shape((2, 4, 256)), packed_shape((3, 4, 6))
        ((2, 4, 32), (9,))
    """
    shape = tuple(shape)
    if shape and shape[-1] % 8 == 0:
        return shape[:-1] + (shape[-1] // 8,)
    n = 1
    for s in shape:
        n *= s
    return (n // 8,)
