"""Random bits are profiled as random bits: a dropout mask kept as bits is drawn at its density
for the ops that read it, keyed apart from a ones-filled bool."""

from __future__ import annotations

import pytest
import torch

import fitgraph
from fitgraph.cost.drawn_bits import UNKNOWN_DENSITY, bit_densities
from fitgraph.cost.profiler import node_signature
from fitgraph.execute.synthetic import SyntheticRunner
from fitgraph.transform.compact_masks import compact_masks


def _bits_graph(p_drop: float = 0.25):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Dropout(p_drop),
                                torch.nn.Linear(256, 10))
    g = fitgraph.capture(model, torch.randn(64, 32), lambda m, b: m(b).square().mean())
    return compact_masks(g)


def test_the_bits_of_a_dropout_mask_are_as_dense_as_its_keep_probability():
    from fitgraph.execute.bit_packing import unpack_bits
    from fitgraph.graph.own_ops import UNPACK_SCALED

    g = _bits_graph(0.25)
    dens = bit_densities(g)
    # NOTE: the drawn bits and the same bits packed eight to a byte (the mask is re-made from
    # them in one gather: no bool bits between)
    kinds = sorted(g.storages[st].name.rsplit(".", 1)[-1] for st in dens)
    assert kinds == ["blank", "packed"]
    assert list(dens.values()) == [pytest.approx(0.75)] * 2
    unpack = next(n for n in g.nodes if n.target == UNPACK_SCALED)
    packed = g.values[unpack.inputs[0]]
    env = SyntheticRunner(g, torch.device("cpu"), dens).inputs(unpack)
    bits = unpack_bits(env[packed.id], [packed.numel * 8])
    assert bits.float().mean().item() == pytest.approx(0.75, abs=0.02)
    # NOTE: the measurement of random bits is not the one of ones: keyed apart
    assert node_signature(g, unpack, dens) != node_signature(g, unpack)
    ones = SyntheticRunner(g, torch.device("cpu")).inputs(unpack)
    assert not torch.equal(ones[packed.id], env[packed.id])


def test_a_captured_graph_has_no_random_bits_and_other_readings_are_unknown():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
    g = fitgraph.capture(model, torch.randn(4, 8), lambda m, b: m(b).sum())
    assert bit_densities(g) == {}  # NOTE: captured masks are floats
    x = torch.rand(4, 8)
    g2 = fitgraph.capture(torch.nn.Linear(8, 8), x,
                          lambda m, b: torch.where(torch.rand_like(b) > 0.3, m(b), 0.0).sum())
    assert list(bit_densities(g2).values()) == [UNKNOWN_DENSITY]
