"""``fitgraph::pack_bits`` / ``fitgraph::unpack_bits``: eight bits to a byte and back, exactly;
``fitgraph::unpack_scaled``: the packed bits back as the float mask they were made into."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fitgraph.execute.bit_packing import pack_bits, packs_alike, unpack_bits, unpack_scaled
from fitgraph.execute.ops import resolve_target
from fitgraph.graph.own_ops import PACK_BITS, UNPACK_BITS


def test_every_byte_pattern_packs_to_its_value_and_back():
    values = torch.arange(256)
    bits = ((values[:, None] >> torch.arange(8)) & 1).bool()
    packed = pack_bits(bits)
    assert packed.shape == (256, 1)   # NOTE: rows of bytes: the last dim / 8
    assert packed.dtype == torch.uint8 and torch.equal(packed[:, 0], values.to(torch.uint8))
    assert torch.equal(unpack_bits(packed, [256, 8]), bits)
    assert packs_alike("cpu")


@pytest.mark.parametrize("seed", range(6))
def test_random_bits_of_any_density_and_shape_round_trip(seed):
    g = torch.Generator().manual_seed(seed)
    shape = [int(s) for s in torch.randint(1, 9, (3,), generator=g)] + [8]
    density = float(torch.rand((), generator=g))
    bits = torch.rand(shape, generator=g) < density
    packed = pack_bits(bits)
    assert packed.shape == tuple(shape[:-1]) + (1,)
    back = unpack_bits(packed, shape)
    assert back.dtype == torch.bool and back.shape == bits.shape and torch.equal(back, bits)
    # NOTE: a bool tensor holds only 0 and 1 bytes: anything else would compare alike but
    # misbehave in later arithmetic
    assert int(back.view(torch.uint8).max()) <= 1


_SCALINGS = [("aten.div_.Scalar", 0.9), ("aten.mul_.Tensor", 1.7), ("aten.div_.Tensor", 0.3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_unpack_scaled_is_the_mask_bit_for_bit(dtype, seed):
    """The bits converted to ``dtype`` and put through the scalings by the same kernels, on
    random shapes (flat or in rows), densities and chains of scalings."""
    g = torch.Generator().manual_seed(seed)
    shape = [int(s) for s in torch.randint(1, 7, (2,), generator=g)] + [8 * (seed + 1)]
    if seed % 2:
        shape = [shape[0] * shape[1] * shape[2]]   # NOTE: flat: one row of bytes
    bits = torch.rand(shape, generator=g) < float(torch.rand((), generator=g))
    chain = _SCALINGS[:seed % 4]
    mask = bits.to(dtype)
    for target, c in chain:
        resolve_target(target)(mask, c)
    made = unpack_scaled(pack_bits(bits), shape, dtype, ",".join(t for t, _ in chain),
                         [c for _, c in chain])
    assert made.dtype == dtype and made.shape == mask.shape and made.is_contiguous()
    assert torch.equal(made, mask)


def test_unpack_scaled_refuses_what_is_not_a_scaling():
    with pytest.raises(ValueError, match="aten.add_.Scalar is not an in-place scaling"):
        unpack_scaled(pack_bits(torch.ones(8, dtype=torch.bool)), [8], torch.float32,
                      "aten.add_.Scalar", [1.0])


def test_the_graph_targets_resolve_to_the_ops():
    bits = torch.rand(4, 16) < 0.3
    packed = resolve_target(PACK_BITS)(bits)
    assert torch.equal(resolve_target(UNPACK_BITS)(packed, [4, 16]), bits)


def test_fake_tensors_get_the_real_shapes():
    with FakeTensorMode():
        bits = torch.empty(6, 8, dtype=torch.bool)
        packed = pack_bits(bits)
        out = unpack_bits(packed, [6, 8])
    assert (packed.shape, packed.dtype) == ((6, 1), torch.uint8)
    assert (out.shape, out.dtype) == ((6, 8), torch.bool)


def test_a_last_dim_not_a_multiple_of_8_packs_flat():
    bits = torch.rand(4, 6) < 0.5
    packed = pack_bits(bits)
    assert packed.shape == (3,) and torch.equal(unpack_bits(packed, [4, 6]), bits)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_a_slice_of_rows_or_whole_bytes_unpacks_alone(dim):
    # NOTE: what a part of a split region reads: a strided slice of the packed rows
    bits = torch.rand(2, 6, 32, generator=torch.Generator().manual_seed(dim)) < 0.4
    packed = pack_bits(bits)
    lo, hi = (1, 2) if dim == 0 else (2, 5) if dim == 1 else (1, 3)
    part = packed.narrow(dim, lo, hi - lo)
    scale = 8 if dim == 2 else 1
    want = bits.narrow(dim, lo * scale, (hi - lo) * scale)
    assert torch.equal(unpack_bits(part, list(want.shape)), want)


@pytest.mark.parametrize("bad", [torch.ones(7, dtype=torch.bool), torch.ones(8),
                                 torch.ones(4, 4, dtype=torch.bool).t()])
def test_what_cannot_be_packed_says_so(bad):
    with pytest.raises(ValueError, match="contiguous bool tensor of a multiple of 8"):
        pack_bits(bad)


def test_the_mask_remake_bench_times_both_ways():
    from fitgraph.bench.mask_remake import markdown, run

    rows = run(rounds=3)
    assert len(rows) == 3 and all(r["chain_ms"] > 0 and r["gather_ms"] > 0 for r in rows)
    assert "one gather" in markdown(rows)
