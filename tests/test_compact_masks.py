"""Dropout masks kept as bits (``transform.compact_masks``): the re-made mask equals the drawn
one bit for bit, in every float dtype; a remat plan that drops the re-made masks runs bitwise
equal to eager, measures what it simulates, and keeps less than the same plan without bits."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph.cost import ProfiledCostModel
from fitgraph.execute import execute
from fitgraph.graph.own_ops import UNPACK_SCALED
from fitgraph.measure import measure_plan
from fitgraph.plan.remat import remat_plan
from fitgraph.sim import simulate
from fitgraph.transform.compact_masks import compact_masks, dropout_masks


class _Mlp(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.up = torch.nn.Linear(64, 512, dtype=dtype)
        self.down = torch.nn.Linear(512, 64, dtype=dtype)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        return self.down(self.drop(torch.tanh(self.up(self.drop(x)))))


def _case(dtype=torch.float32):
    torch.manual_seed(0)
    return _Mlp(dtype), torch.randn(256, 64, dtype=dtype), lambda m, b: m(b).square().mean()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "bool"])
@pytest.mark.parametrize("drawn", [True, False], ids=["bits-drawn", "bits-read"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bits_remake_the_mask_and_training_matches_eager(dtype, drawn, packed, monkeypatch):
    """Both forms: bits drawn straight into a bool tensor (the CPU's) and bits read from the
    float mask (``mask != 0``, where a device's draws may differ by dtype); each kept packed
    eight to a byte (where ``packs_alike``) or as a bool tensor."""
    from fitgraph.execute import bit_packing
    from fitgraph.transform import compact_masks as cm

    assert cm.draws_alike("cpu")  # NOTE: this CPU's bernoulli_ draws alike for bool and float
    assert bit_packing.packs_alike("cpu")
    monkeypatch.setattr(cm, "draws_alike", lambda device: drawn)
    monkeypatch.setattr(bit_packing, "packs_alike", lambda device: packed)
    model, batch, loss_fn = _case(dtype)
    twin = copy.deepcopy(model)
    g = fitgraph.capture(twin, batch, loss_fn)
    c = compact_masks(g)
    assert len(dropout_masks(g)) == 2 and not dropout_masks(c)
    kinds = {n.target for n in c.nodes if n.name.endswith(".mask.bits")}
    assert kinds == ({"aten.bernoulli_.float"} if drawn else {"aten.ne.Scalar"})
    kept = [c.values[n.outputs[0]] for n in c.nodes if n.name.endswith(".mask.packed")]
    assert [(v.dtype, v.nbytes) for v in kept] == ([("uint8", 256 * 64 // 8),
                                                    ("uint8", 256 * 512 // 8)] if packed else [])
    assert sum(n.random for n in c.nodes) == 2  # NOTE: one draw per mask, never two
    la = eager_step(model, batch, loss_fn, seed=3)
    torch.manual_seed(3)
    lb = execute(c, fitgraph.eager_plan(c), twin, batch)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(model, twin)


def test_dropping_the_remade_masks_lowers_the_peak_bitwise_and_as_simulated(tmp_path):
    model, batch, loss_fn = _case()
    g = fitgraph.capture(copy.deepcopy(model), batch, loss_fn)
    c = compact_masks(g)
    full = [n for n in c.nodes if n.name.endswith(".mask.full")]
    # NOTE: each mask re-made from its packed bytes in one gather, no bool bits between
    assert [n.target for n in full] == [UNPACK_SCALED] * 2
    assert not any(n.name.endswith(".mask.unpacked") for n in c.nodes)
    cost = _profiled(c, tmp_path)
    plan = remat_plan(c, [n.id for n in full])
    sim = simulate(c, plan, cost)
    eager = simulate(g, fitgraph.eager_plan(g), _profiled(g, tmp_path))
    assert sim.peak_bytes < eager.peak_bytes
    # NOTE: into the backward go one bit an element where the float mask took four bytes (the
    # hidden layer's mask: the input's is not read by the backward, no gradient flows there)
    n_bits = 256 * 512
    assert _kept(eager) - _kept(sim) == 4 * n_bits - n_bits // 8
    _assert_measures_as_simulated_and_runs_bitwise(c, plan, sim, model, batch, loss_fn)


def _kept(sim):
    """Bytes live going into the backward."""
    return sim.live_after[sim.phase_starts["backward"] - 1]


def _assert_measures_as_simulated_and_runs_bitwise(c, plan, sim, model, batch, loss_fn):
    twin = copy.deepcopy(model)
    measured = measure_plan(c, plan, twin, batch, repeats=0)
    assert measured.peak_bytes == sim.peak_bytes
    twin.zero_grad(set_to_none=True)
    la = eager_step(model, batch, loss_fn, seed=5)
    torch.manual_seed(5)
    lb = execute(c, plan, twin, batch)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(model, twin)


def _profiled(g, path):
    cm = ProfiledCostModel(cache=path, repeats=1, warmup=0, progress=False)
    cm.profile(g)
    return cm


class _HandMask(torch.nn.Module):
    def __init__(self, through_view: bool):
        super().__init__()
        self.lin, self.through_view = torch.nn.Linear(16, 16), through_view

    def forward(self, x):
        mask = torch.empty_like(x).bernoulli_(0.5).div_(0.5)
        return self.lin(x * mask) * (mask.t().t() if self.through_view else mask)


def test_masks_of_a_size_not_a_multiple_of_8_stay_bool_bits():
    model = torch.nn.Sequential(torch.nn.Linear(9, 9), torch.nn.Dropout(0.5))
    batch = torch.randn(7, 9)
    loss_fn = lambda m, b: m(b).square().sum()  # noqa: E731
    twin = copy.deepcopy(model)
    c = compact_masks(fitgraph.capture(twin, batch, loss_fn))
    names = [n.name for n in c.nodes if ".mask." in n.name]
    assert any(n.endswith(".mask.bits") for n in names)
    assert not any(n.endswith((".mask.packed", ".mask.unpacked")) for n in names)
    la = eager_step(model, batch, loss_fn, seed=2)
    torch.manual_seed(2)
    assert torch.equal(la, execute(c, fitgraph.eager_plan(c), twin, batch))


@pytest.mark.parametrize("through_view", [False, True])
def test_masks_read_through_a_view_are_left_alone(through_view):
    batch = torch.randn(8, 16)
    g = fitgraph.capture(_HandMask(through_view), batch, lambda m, b: m(b).sum())
    assert len(dropout_masks(g)) == (0 if through_view else 1)
    assert (compact_masks(g) is g) == through_view


def test_chains_keep_the_bits_and_never_replay_the_draw():
    """A remat move for a re-made mask re-makes it from the bits (and resident inputs) alone:
    its forward chain holds no random draw and no bits; captured graphs have no bits."""
    from fitgraph.solvers.remat.candidates import forward_chains, random_bits, remat_candidates

    model, batch, loss_fn = _case()
    g = fitgraph.capture(model, batch, loss_fn)
    c = compact_masks(g)
    assert not random_bits(g)
    bits = random_bits(c)
    # NOTE: on the CPU the bits are drawn straight into a bool tensor: its blank is bits too,
    # and so are the bits packed eight to a byte (unpacking them is a cheap recompute)
    assert sorted(c.nodes[i].name for i in bits) == sorted(
        n.name for n in c.nodes
        if n.name.endswith((".mask.bits", ".mask.blank", ".mask.packed"))) != []
    assert not bits & remat_candidates(c)  # NOTE: re-made, bits would replay the draw
    chains = forward_chains(c, remat_candidates(c))
    full = [n.id for n in c.nodes if n.name.endswith(".mask.full")]
    assert len(full) == 2
    for nid in full:
        chain = chains[nid]
        assert not any(c.nodes[i].random or i in bits for i in chain)
        read = {v for i in chain for v in c.nodes[i].inputs if c.values[v].producer not in chain}
        assert all(c.values[v].producer is None or c.values[v].producer in bits for v in read)


class _FusedDropout(torch.nn.Module):
    """Dropout as CUDA runs it: one ``native_dropout`` kernel (output and bool mask), here
    called directly so that the CPU captures the same node."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        for lin in self.layers:
            x, _ = torch.native_dropout(torch.tanh(lin(x)), 0.2, True)
        return x


def test_fused_dropout_output_is_a_remat_candidate_and_replays_bitwise():
    """CUDA's ``native_dropout`` writes its mask into the drawn storage and outputs the dropped
    tensor: it is no "bits" node; re-made, it replays the draw, bitwise like eager."""
    from fitgraph.solvers.remat.candidates import random_bits, remat_candidates

    torch.manual_seed(0)
    model, batch = _FusedDropout(), torch.randn(512, 64)

    def loss_fn(m, b):
        return m(b).square().mean()

    g = fitgraph.capture(model, batch, loss_fn)
    fused = {n.id for n in g.nodes if n.target == "aten.native_dropout.default"}
    assert len(fused) == 4 and not random_bits(g)
    assert fused <= remat_candidates(g)
    a, b = model, copy.deepcopy(model)
    step = fitgraph.optimize(b, batch, loss_fn, budget=0.6, solver="hotspot", time_budget=10)
    replayed = {ins.node for ins in step.plan if type(ins).__name__ == "Recompute"}
    assert replayed & fused, "the plan re-makes no dropout"
    for i in range(2):
        la = eager_step(a, batch, loss_fn, seed=i)
        torch.manual_seed(i)
        assert torch.equal(la, step(batch))
        assert_bitwise_equal_models(a, b)
        for p in [*a.parameters(), *b.parameters()]:
            p.grad = None
    r = step.report()
    assert r.measured_peak_bytes == r.planned_peak_bytes <= r.budget_bytes


def test_fused_dropout_masks_are_packed_bitwise_and_as_simulated(tmp_path):
    """CUDA's fused ``native_dropout`` makes its mask as bool already: ``compact_masks`` packs
    it eight to a byte; a plan that re-makes the unpacked bits keeps 1/8 of the mask's bytes
    into the backward, runs bitwise like eager and measures what it simulates."""
    from fitgraph.graph.own_ops import PACK_BITS
    from fitgraph.solvers.remat.candidates import random_bits

    torch.manual_seed(0)
    model, batch = _FusedDropout(), torch.randn(512, 64)

    def loss_fn(m, b):
        return m(b).square().mean()

    g = fitgraph.capture(copy.deepcopy(model), batch, loss_fn)
    masks = dropout_masks(g)
    assert len(masks) == 4 and all(m.fused for m in masks)
    c = compact_masks(g)
    assert not dropout_masks(c), "packed already"
    packs = {n.id for n in c.nodes if n.target == PACK_BITS}
    assert len(packs) == 4 and packs <= random_bits(c), "the packed draw is never re-made"
    unpacked = [n.id for n in c.nodes if n.name.endswith(".mask.unpacked")]
    cost = _profiled(c, tmp_path)
    plan = remat_plan(c, unpacked)
    sim = simulate(c, plan, cost)
    eager = simulate(g, fitgraph.eager_plan(g), _profiled(g, tmp_path))
    n_bits = 4 * 512 * 64
    assert _kept(eager) - _kept(sim) == n_bits - n_bits // 8
    assert sim.peak_bytes < eager.peak_bytes
    _assert_measures_as_simulated_and_runs_bitwise(c, plan, sim, model, batch, loss_fn)
