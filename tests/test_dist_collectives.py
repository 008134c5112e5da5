"""The cluster and the α–β costs of its collectives (``fitgraph.dist``), torch-free."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fitgraph.dist import (
    LINKS,
    Cluster,
    all_gather_s,
    all_reduce_s,
    dgx_a100,
    p2p_s,
    reduce_scatter_s,
)


def test_a_group_within_a_node_talks_over_its_link_and_across_nodes_over_the_network():
    c = dgx_a100(nodes=2)
    assert c.devices == 16 and c.node_of(7) == 0 and c.node_of(8) == 1
    assert c.link(range(8)) is LINKS["nvlink3"]
    assert c.link([7, 8]) is LINKS["hdr-ib"]
    with pytest.raises(ValueError, match="device 16 is not in a cluster of 16"):
        c.node_of(16)
    with pytest.raises(ValueError):
        Cluster(c.device, 0, 1, c.intra, c.inter)


@given(st.floats(0, 2**34), st.integers(1, 4096))
def test_ring_costs_add_up_and_approach_their_bandwidth_bound(nbytes, n):
    link = LINKS["hdr-ib"]
    ar = all_reduce_s(nbytes, n, link, "ring")
    assert ar == pytest.approx(reduce_scatter_s(nbytes, n, link) + all_gather_s(nbytes, n, link))
    # NOTE: a ring sends each byte (n-1)/n of the way twice: never more than 2 nbytes / bw,
    # plus the latency of its 2 (n-1) steps
    assert ar <= 2 * nbytes / link.bandwidth + 2 * (n - 1) * link.latency_s + 1e-12
    if n == 1:
        assert ar == 0.0
    assert all_reduce_s(nbytes, n + 1, link, "ring") >= ar
    # NCCL's choice is never slower than the ring
    assert all_reduce_s(nbytes, n, link) <= ar


def test_small_messages_are_latency_bound_and_large_ones_bandwidth_bound():
    nv = LINKS["nvlink3"]
    assert all_reduce_s(8, 8, nv, "ring") == pytest.approx(14 * nv.latency_s, rel=1e-3)
    big = all_reduce_s(2**30, 8, nv)
    assert big == pytest.approx(2 * 7 / 8 * 2**30 / nv.bandwidth, rel=0.01)
    assert p2p_s(2**20, nv) == pytest.approx(nv.latency_s + 2**20 / nv.bandwidth)
    with pytest.raises(ValueError):
        all_reduce_s(-1, 4, nv)


def test_small_messages_take_the_tree_and_large_ones_the_ring():
    ib = LINKS["hdr-ib"]
    # 64 devices, 24 KB (a vocabulary-parallel loss's statistics): 2 log2(64) = 12 steps of
    # latency instead of the ring's 126
    small = all_reduce_s(24e3, 64, ib)
    assert small == pytest.approx(12 * ib.latency_s + 2 * 24e3 / ib.bandwidth)
    assert small < all_reduce_s(24e3, 64, ib, "ring")
    # 1 GiB over 8: the ring's 2 (n-1)/n of the bytes beats the tree's 2
    assert all_reduce_s(2**30, 8, ib) == all_reduce_s(2**30, 8, ib, "ring")
    with pytest.raises(ValueError, match="ring, tree or auto"):
        all_reduce_s(1, 4, ib, "butterfly")
