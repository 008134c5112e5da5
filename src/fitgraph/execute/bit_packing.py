"""Bits packed eight to a byte: the ops ``fitgraph::pack_bits``, ``fitgraph::unpack_bits`` and
``fitgraph::unpack_scaled``.

A dropout mask kept as bits (``transform.compact_masks``) costs one byte an element as a bool
tensor; packed it costs one bit. ``pack_bits(bits)`` takes a contiguous bool tensor whose size is
a multiple of 8 and returns ``numel / 8`` bytes, element ``8 * i + j`` in bit ``j`` of byte
``i``; ``unpack_bits(packed, shape)`` gives the bool tensor back. Both are integer arithmetic on
8-byte words (no per-bit loop, no branch): each byte of a bool tensor is 0 or 1, so one 64-bit
multiply gathers a word's eight flags into its top byte, and one multiply, an ``and``, an add and
a shift spread a byte back over a word. On this CPU (one thread) 1.2M elements pack in 0.08 ms
and unpack in 0.12 ms — a third of the bool-to-float conversion that re-makes the mask.

``unpack_scaled(packed, shape, dtype, ops, scales)`` re-makes a dropout's float mask from its
packed bits in one pass: a table of the 256 bytes' eight elements — 0 or 1 of ``dtype``, put
through the in-place scalings ``ops`` (aten targets, e.g. ``"aten.div_.Scalar"``) by ``scales``,
the very kernels the mask was made with, so bit for bit the mask — is indexed by the bytes
(``index_select``: 0.36-0.43 of the time of unpacking, converting and scaling on this CPU,
``python -m fitgraph.bench.mask_remake``).

The words rely on int64 arithmetic wrapping around (two's complement, little-endian words), which
every PyTorch backend does in practice but no contract promises: ``packs_alike(device)`` checks
all 256 byte patterns on the device before a plan relies on it, and ``compact_masks`` keeps bool
bits where it says no.

Memory: ``pack_bits`` allocates one word per output byte (``numel`` bytes) as a workspace
before its output; ``unpack_bits`` writes its output in place of the words it computes (its
output is that storage, ``numel`` bytes), no workspace; ``unpack_scaled`` allocates the bytes
as int32 indices (``numel / 2`` bytes) and the 8 KiB table before its output.

Example:
    >>> import torch
    >>> from fitgraph.execute.bit_packing import pack_bits, unpack_bits
    >>> bits = torch.tensor([True, False, True, True, False, False, False, True] * 2)
    >>> packed = pack_bits(bits)
    >>> packed.tolist()        # bit j of byte i is element 8 * i + j
    [141, 141]
    >>> torch.equal(unpack_bits(packed, [16]), bits)
    True
    >>> mask = bits.float().div_(0.9)
    >>> torch.equal(unpack_scaled(packed, [16], torch.float32, "aten.div_.Scalar", [0.9]), mask)
    True
"""

from __future__ import annotations

import torch

from ..graph.own_ops import MASK_SCALINGS, packed_shape

__all__ = ["pack_bits", "packed_shape", "packs_alike", "unpack_bits", "unpack_scaled"]

# NOTE: the flag of byte j (bit 8j) times 2**(56 - 7j) lands on bit 56 + j, and no two partial
# products meet below bit 56 + 8: the top byte is the eight flags in order
_GATHER = 0x0102040810204080
_COPIES = 0x0101010101010101           # a byte repeated in every byte of the word
_SELECT = 0x8040201008040201 - (1 << 64)  # byte j keeps bit j (as a signed int64)
_ROUND_UP = 0x7F7F7F7F7F7F7F7F         # a nonzero byte (at most 0x80) gets bit 7 set, no carry
_LOW_BITS = 0x0101010101010101


def _words(bits: torch.Tensor) -> torch.Tensor:
    if bits.dtype != torch.bool or not bits.is_contiguous() or bits.numel() % 8:
        raise ValueError("pack_bits takes a contiguous bool tensor of a multiple of 8 elements, "
                         f"got {bits.dtype} {tuple(bits.shape)}")
    return bits.reshape(-1).view(torch.uint8).view(torch.int64)


# NOTE: the targets these register are graph.own_ops.PACK_BITS and UNPACK_BITS
@torch.library.custom_op("fitgraph::pack_bits", mutates_args=())
def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``bits`` (contiguous bool, numel a multiple of 8) packed eight to a byte (uint8, of
    ``packed_shape(bits.shape)``)."""
    words = _words(bits) * _GATHER
    words >>= 56
    return words.to(torch.uint8).view(packed_shape(bits.shape))


@pack_bits.register_fake
def _(bits: torch.Tensor) -> torch.Tensor:
    return bits.new_empty(packed_shape(bits.shape), dtype=torch.uint8)


@torch.library.custom_op("fitgraph::unpack_bits", mutates_args=())
def unpack_bits(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """The bool tensor of ``shape`` that ``pack_bits`` packed into ``packed`` (read in its
    logical order: a strided slice of rows unpacks to the same slice of the bits)."""
    words = packed.to(torch.int64, memory_format=torch.contiguous_format)
    words.mul_(_COPIES).bitwise_and_(_SELECT).add_(_ROUND_UP)
    words >>= 7
    words.bitwise_and_(_LOW_BITS)
    return words.view(torch.uint8).view(torch.bool).view(shape)


@unpack_bits.register_fake
def _(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return packed.new_empty(shape, dtype=torch.bool)


@torch.library.custom_op("fitgraph::unpack_scaled", mutates_args=())
def unpack_scaled(packed: torch.Tensor, shape: list[int], dtype: torch.dtype, ops: str,
                  scales: list[float]) -> torch.Tensor:
    """The float mask of ``shape`` whose bits ``pack_bits`` packed into ``packed``: each bit as
    0 or 1 of ``dtype`` put through the in-place scalings ``ops`` (aten targets, comma-separated:
    a custom op takes no list of strings) by ``scales`` (module doc)."""
    values = torch.arange(256, dtype=torch.int32, device=packed.device)
    table = ((values[:, None] >> torch.arange(8, dtype=torch.int32, device=packed.device))
             & 1).to(dtype)
    for op, scale in zip(ops.split(",") if ops else [], scales, strict=True):
        if op not in MASK_SCALINGS:
            raise ValueError(f"unpack_scaled: {op} is not an in-place scaling "
                             f"({sorted(MASK_SCALINGS)})")
        # NOTE: the op looked up here: execute.ops (resolve_target) imports this module
        _, name, overload = op.split(".")
        getattr(getattr(torch.ops.aten, name), overload)(table, scale)
    index = packed.to(torch.int32, memory_format=torch.contiguous_format).view(-1)
    return torch.index_select(table, 0, index).view(shape)


@unpack_scaled.register_fake
def _(packed: torch.Tensor, shape: list[int], dtype: torch.dtype, ops: str,
      scales: list[float]) -> torch.Tensor:
    return packed.new_empty(shape, dtype=dtype)


_ALIKE: dict[str, bool] = {}


def packs_alike(device: str) -> bool:
    """Whether ``pack_bits``/``unpack_bits`` are exact on ``device``: every byte pattern packs
    to its value and unpacks back (the int64 words wrap around as assumed). Memoised per
    device; False for a device torch cannot reach here."""
    if device not in _ALIKE:
        try:
            values = torch.arange(256, dtype=torch.int64, device=device)
            bits = ((values[:, None] >> torch.arange(8, device=device)) & 1).bool()
            packed = pack_bits(bits)
            _ALIKE[device] = bool(torch.equal(packed.reshape(-1), values.to(torch.uint8))
                                  and torch.equal(unpack_bits(packed, [256, 8]), bits))
        except (RuntimeError, AssertionError):
            _ALIKE[device] = False
    return _ALIKE[device]
