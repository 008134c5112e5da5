"""bench.derived.block_stack: the zoo model's own blocks, on what its first block receives."""

import pytest
import torch
import torch.nn.functional as F

import fitgraph
from fitgraph.bench.derived import block_stack
from fitgraph.bench.ilp_gap import gap_row
from fitgraph.cost.devices import DEVICES
from fitgraph.cost.roofline import RooflineCostModel
from fitgraph.solvers import Problem, solve


@pytest.mark.parametrize("name", ["gpt2", "llama", "resnet50"])
def test_block_stack_runs_the_models_blocks_on_their_recorded_input(name):
    case = block_stack(name, 2, batch_size=1)
    x, target = case.batch
    blocks = list(case.model.blocks)
    extras = [getattr(case.model, k) if isinstance(k, str) else k[0]
              for k in case.model._kinds]
    with torch.no_grad():  # NOTE: same seed: GPT-2's blocks use dropout
        torch.manual_seed(0)
        by_hand = F.mse_loss(blocks[1](blocks[0](x, *extras), *extras), target)
        torch.manual_seed(0)
        assert torch.equal(case.loss(), by_hand)
    # the input is what the full model's first block receives: not the raw batch
    assert x.dim() >= 3 and x.dtype == torch.float32


@pytest.mark.parametrize("name", ["bert-base", "resnet50"])
def test_block_stack_without_dropout_makes_no_dropout_masks(name):
    with_dropout = fitgraph.capture(*_parts(block_stack(name, 2, batch_size=1)))
    case = block_stack(name, 2, batch_size=1, dropout=False)
    g = fitgraph.capture(*_parts(case))
    def masks(graph):  # NOTE: SDPA counts as random whatever its dropout_p: not a mask
        return [n for n in graph.nodes if "bernoulli" in n.target or "dropout" in n.target]

    assert not masks(g)
    assert case.name.endswith("no dropout]")
    if name == "bert-base":
        assert masks(with_dropout)
    else:  # NOTE: batch norm still trains on the batch's statistics (and updates them)
        assert [n.target for n in g.nodes] == [n.target for n in with_dropout.nodes]


def _parts(case):
    return case.model, case.batch, case.loss_fn


def test_block_stack_refuses_more_blocks_than_the_model_has():
    with pytest.raises(ValueError, match="has 4 blocks"):
        block_stack("gpt2", 5)


def test_gap_row_bounds_hotspot_by_the_ilps_proof():
    case = block_stack("vit-b16", 1, batch_size=2)
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    cm = RooflineCostModel(DEVICES["rtx3090"])
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
    r = gap_row(g, cm, int(0.85 * eager.peak_bytes), eager, time_limit_s=20)
    assert r["ilp_status"] in ("optimal", "time limit")
    assert 1.0 <= r["ilp_time"] and 1.0 <= r["hotspot_time"]
    # the proven bound is never above the incumbent, so the bound ratio is the larger one
    assert r["vs_bound"] >= r["vs_ilp"] * (1 - 1e-12)
    if r["ilp_status"] == "optimal":
        assert r["vs_bound"] == pytest.approx(r["vs_ilp"], rel=1e-3)
    # NOTE: each node recomputed once: hotspot's model runs the same nodes, the same time
    m = r["in_hotspot_model"]
    assert m in ("recomputes twice", "not a drop set", "over budget") or m == pytest.approx(
        r["ilp_time"], rel=1e-9)
