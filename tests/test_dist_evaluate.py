"""One parallel configuration predicted (``fitgraph.dist.evaluate``): honest memory (each
stage's peak is the sum of its parts, its activations what the simulated schedule holds, the
closed form the same), Adam's state under ZeRO, full recompute's time and FLOPs (Megatron's
eq. 3), units, the binding memory term, determinism, what cannot be evaluated, and the
prediction of Megatron-LM's Table 1 published configurations.
"""

from __future__ import annotations

import itertools
import re
import statistics

import pytest

from fitgraph.bench.dist_megatron import _cluster as megatron_cluster
from fitgraph.bench.dist_megatron import _published_fix
from fitgraph.cost.devices import get_device
from fitgraph.dist.block_cost import price_block
from fitgraph.dist.cluster import LINKS, Cluster, dgx_a100
from fitgraph.dist.config import Parallelism
from fitgraph.dist.evaluate import GIB, evaluate
from fitgraph.dist.gpt_blocks import gpt_blocks
from fitgraph.dist.megatron_table import TABLE1, GptShape
from fitgraph.dist.memory import MIXED_ADAM, MIXED_SGD
from fitgraph.dist.model import GptModel
from fitgraph.dist.planner import plan

SHAPE = GptShape(8, 1024, 16, seq=512)
MODEL = GptModel(SHAPE)
TERMS = ("weights", "gradients", "optimizer", "activations", "working")


def two_nodes_of_four(flop_efficiency: float | None = None) -> Cluster:
    device = get_device("a100-80gb")
    if flop_efficiency is not None:
        device = device.replace(flop_efficiency=flop_efficiency)
    return Cluster(device, 4, 2, LINKS["nvlink3"], LINKS["hdr-ib"])


CLUSTER = two_nodes_of_four()


def _par(tp=2, pp=2, dp=2, mb=1, m=8, schedule="1f1b", **kw) -> Parallelism:
    return Parallelism(tp=tp, pp=pp, dp=dp, micro_batch=mb, n_micro=m, schedule=schedule,
                       chunks=2 if schedule == "interleaved" else 1, **kw)


def _check_honest(par: Parallelism, budget: float | None = None):
    """Both predictions of ``par``; asserts the memory law on every stage."""
    sim = evaluate(MODEL, CLUSTER, par, simulated=True, budget=budget)
    closed = evaluate(MODEL, CLUSTER, par, simulated=False, budget=budget)
    assert sim is not None and closed is not None
    assert sim.timeline is not None and closed.timeline is None
    assert len(sim.stages) == len(closed.stages) == par.pp == len(sim.timeline.peak_bytes)
    for s, c, held in zip(sim.stages, closed.stages, sim.timeline.peak_bytes):
        parts = s.memory()
        assert tuple(parts) == TERMS
        assert s.peak_bytes == pytest.approx(sum(parts.values()), rel=1e-12)
        plan_ = s.plan
        assert (parts["weights"], parts["gradients"], parts["optimizer"], parts["working"]) == (
            plan_.weights, plan_.gradients, plan_.optimizer, plan_.working_bytes)
        # the activations are what the simulated schedule holds on that device at its worst
        # (less what the memory plan parks in host memory at that moment, if it parks any)
        parked = getattr(plan_, "offload_bytes", 0.0)
        assert 0 <= parked <= held
        assert s.activations + parked == pytest.approx(held, rel=1e-9)
        # and the closed form (the schedule's in-flight counts) agrees with the simulation
        assert c.activations == pytest.approx(s.activations, rel=1e-9)
        assert c.plan == s.plan
    assert sim.peak_bytes_per_device == max(s.peak_bytes for s in sim.stages)
    if sim.fits:
        assert sim.peak_bytes_per_device <= sim.budget_bytes * (1 + 1e-9)
    else:
        assert sim.peak_bytes_per_device > sim.budget_bytes
    return sim, closed


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "zb-h1"])
def test_honest_memory_for_every_zero_sp_and_recompute(schedule):
    for zero, sp, recompute in itertools.product(range(4), (False, True),
                                                 ("auto", "full", "none", "selective")):
        _check_honest(_par(schedule=schedule, zero=zero, sp=sp, recompute=recompute))


@pytest.mark.parametrize("tp,pp,dp,mb,m,schedule", [
    (1, 4, 2, 1, 2, "1f1b"),          # fewer micro-batches than stages
    (1, 4, 2, 2, 3, "zb-h1"),
    (1, 4, 2, 1, 2, "gpipe"),
    (2, 4, 1, 2, 8, "interleaved"),
    (1, 4, 2, 1, 4, "interleaved"),
    (1, 8, 1, 1, 16, "1f1b"),         # ten blocks over eight stages
    (1, 8, 1, 1, 16, "zb-h1"),
    (4, 1, 2, 2, 4, "1f1b"),
])
def test_honest_memory_at_other_depths(tp, pp, dp, mb, m, schedule):
    for zero in (0, 1, 3):
        _check_honest(_par(tp, pp, dp, mb, m, schedule, zero=zero))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "zb-h1"])
def test_honest_memory_when_auto_must_recompute(schedule):
    """A budget between the parameters' bytes and the no-recompute peak: ``auto`` re-makes some
    activations, every stage still adds up and fits (or says it does not)."""
    par = _par(tp=1, pp=4, dp=2, mb=2, m=8, schedule=schedule)
    free = evaluate(MODEL, CLUSTER, par)
    static = max(s.plan.weights + s.plan.gradients + s.plan.optimizer for s in free.stages)
    squeezed = 0
    for frac in (0.5, 0.75, 0.9):
        budget = static + frac * (free.peak_bytes_per_device - static)
        sim, _ = _check_honest(par, budget)
        squeezed += sum(name != "none" for s in sim.stages for name in s.plan.plan)
        squeezed += sum(getattr(s.plan, "offload_bytes", 0.0) > 0 for s in sim.stages)
        if sim.fits:
            assert sim.step_s >= free.step_s * (1 - 1e-12)   # re-making costs time
    assert squeezed > 0


def _stage_params_by_hand(tp: int, pp: int) -> float:
    """12 l h^2 + 13 l h (layers) + s h (positions) + 2h (final norm), split by tp, and the
    tied vocabulary weight once per end of the pipeline (one copy when pp = 1)."""
    n, h, s, v = SHAPE.layers, SHAPE.hidden, SHAPE.seq, SHAPE.vocab
    per_device = n * ((12 * h * h + 7 * h) / tp + 6 * h) + s * h + 2 * h
    return per_device + v * h / tp * (1 if pp == 1 else 2)


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 4), (2, 1, 4), (1, 1, 8)])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_adams_state_is_counted_and_zero_shards_it(tp, pp, dp, zero):
    pred = evaluate(MODEL, CLUSTER, _par(tp, pp, dp, m=4, zero=zero, recompute="none"))
    assert sum(s.plan.params for s in pred.stages) == pytest.approx(
        _stage_params_by_hand(tp, pp), rel=1e-12)
    for s in pred.stages:
        p = s.plan.params
        # bf16 weights 2 B, bf16 gradients 2 B, fp32 master 4 B + Adam's two moments 8 B
        assert s.plan.weights == pytest.approx(2 * p / (dp if zero >= 3 else 1), rel=1e-12)
        assert s.plan.gradients == pytest.approx(2 * p / (dp if zero >= 2 else 1), rel=1e-12)
        assert s.plan.optimizer == pytest.approx(12 * p / (dp if zero >= 1 else 1), rel=1e-12)
        if zero == 0:
            assert s.plan.weights + s.plan.gradients + s.plan.optimizer == pytest.approx(
                16 * p, rel=1e-12)


def test_sgd_holds_no_moments():
    pred = evaluate(MODEL, CLUSTER, _par(1, 1, 8, m=2), precision=MIXED_SGD)
    p = pred.stages[0].plan.params
    assert pred.stages[0].plan.optimizer == pytest.approx(4 * p, rel=1e-12)   # master only


@pytest.mark.parametrize("tp,pp,dp,schedule", [(2, 2, 2, "1f1b"), (1, 4, 2, "gpipe"),
                                               (2, 1, 4, "1f1b"), (1, 2, 4, "interleaved")])
def test_full_recompute_is_one_forward_of_the_body(tp, pp, dp, schedule):
    m, mb = 4, 2
    pred = evaluate(MODEL, CLUSTER, _par(tp, pp, dp, mb, m, schedule, recompute="full"))
    blocks = {b.name: b for b in gpt_blocks(SHAPE, tp, mb)}
    link = CLUSTER.link(range(tp))
    seen = []
    for s in pred.stages:
        body = [blocks[n] for n in s.plan.blocks if blocks[n].role == "body"]
        seen += [b.name for b in body]
        fwd = sum(price_block(b, CLUSTER.device, link).fwd_s for b in body)
        assert s.plan.recompute_s == pytest.approx(fwd, rel=1e-9)
        assert {n for n, b in zip(s.plan.plan, s.plan.blocks) if blocks[b].role == "body"} \
            <= {"full"}
    assert sorted(seen) == sorted(f"layer{i}" for i in range(SHAPE.layers))
    # executed = model FLOPs + one more forward of every layer for every sample:
    # Megatron's eq. 3 (96 B s l h^2 ...) against the model's 72 B s l h^2 ...
    B, s, n, h = pred.parallelism.global_batch, SHAPE.seq, SHAPE.layers, SHAPE.hidden
    extra = 24 * B * s * n * h * h * (1 + s / (6 * h))
    assert pred.executed_flops - pred.model_flops == pytest.approx(extra, rel=1e-9)
    assert pred.executed_flops == pytest.approx(SHAPE.flops_per_iteration(B), rel=1e-9)


def test_no_recompute_executes_the_model_flops():
    pred = evaluate(MODEL, CLUSTER, _par(recompute="none"))
    assert pred.executed_flops == pytest.approx(pred.model_flops, rel=1e-12)
    assert all(s.plan.recompute_s == 0 for s in pred.stages)


def test_twice_the_micro_batches_twice_the_compute():
    one = evaluate(MODEL, CLUSTER, _par(1, 1, 8, m=4))
    two = evaluate(MODEL, CLUSTER, _par(1, 1, 8, m=8))
    assert two.parallelism.global_batch == 2 * one.parallelism.global_batch
    assert two.pipeline_s == pytest.approx(2 * one.pipeline_s, rel=1e-9)
    assert two.stages[0].busy_s == pytest.approx(2 * one.stages[0].busy_s, rel=1e-9)
    # the optimizer step and the exposed gradient reduction do not scale with the batch
    s1, s2 = one.stages[0], two.stages[0]
    assert s2.optimizer_s == s1.optimizer_s and s2.dp_sync_s == s1.dp_sync_s

    def fixed(s):
        return s.optimizer_s + s.dp_sync_s + s.tied_sync_s

    assert (two.step_s - fixed(s2)) / (one.step_s - fixed(s1)) == pytest.approx(2, rel=0.05)
    assert one.step_s < two.step_s < 2 * one.step_s


def test_a_device_twice_as_efficient_is_faster_but_not_more_than_twice():
    par = _par()
    slow = evaluate(MODEL, two_nodes_of_four(0.32), par)
    fast = evaluate(MODEL, two_nodes_of_four(0.64), par)
    assert 1 < slow.step_s / fast.step_s <= 2
    assert fast.tflops_per_device > slow.tflops_per_device


@pytest.mark.parametrize("par", [_par(), _par(1, 4, 2, 2, 4, "zb-h1", recompute="full"),
                                 _par(2, 2, 2, 1, 4, "interleaved", sp=True)], ids=str)
def test_units(par):
    pred = evaluate(MODEL, CLUSTER, par)
    assert pred.tokens_per_s == pytest.approx(par.global_batch * SHAPE.seq / pred.step_s,
                                              rel=1e-12)
    assert pred.tflops_per_device == pytest.approx(
        pred.executed_flops / pred.step_s / par.devices / 1e12, rel=1e-12)
    peak = CLUSTER.device.peak_flops["bfloat16"]          # the datasheet's, for MFU
    assert pred.mfu == pytest.approx(pred.model_flops / pred.step_s / par.devices / peak,
                                     rel=1e-12)
    assert pred.model_flops == pytest.approx(MODEL.model_flops(par.global_batch), rel=1e-12)
    assert 0 < pred.mfu < 1
    assert pred.step_s == max(s.end_s for s in pred.stages) >= pred.pipeline_s
    assert [s.ranks for s in pred.stages] == [tuple(par.stage_ranks(d)) for d in range(par.pp)]


def test_a_tiny_budget_does_not_fit_and_names_the_stage_and_term():
    par = _par()
    roomy = evaluate(MODEL, CLUSTER, par)
    assert roomy.fits and roomy.binding == ""
    tiny = 0.05 * GIB
    pred = evaluate(MODEL, CLUSTER, par, budget=tiny)
    assert not pred.fits and pred.budget_bytes == tiny
    found = re.search(r"stage (\d+) needs .* its largest term is (\w+)", pred.binding)
    assert found, pred.binding
    stage = pred.stages[int(found.group(1))]
    # the stage furthest over budget, and its largest memory term
    assert stage.peak_bytes == max(s.peak_bytes for s in pred.stages)
    terms = stage.memory()
    assert found.group(2) == max(terms, key=terms.get)
    assert found.group(2) in TERMS


def test_determinism():
    par = _par(1, 4, 2, 2, 8, "zb-h1")
    a = evaluate(MODEL, CLUSTER, par)
    b = evaluate(MODEL, CLUSTER, par)
    assert a.step_s == b.step_s
    assert [s.plan for s in a.stages] == [s.plan for s in b.stages]
    assert a == b


def test_what_cannot_be_evaluated_is_named():
    with pytest.raises(ValueError, match=r"2x2x1 = 4 devices on a cluster of 8"):
        evaluate(MODEL, CLUSTER, Parallelism(tp=2, pp=2, dp=1, micro_batch=1, n_micro=4))
    with pytest.raises(ValueError, match=r"micro-batches \(3\) a multiple of the stages \(2\)"):
        evaluate(MODEL, CLUSTER, _par(m=3, schedule="interleaved"))
    with pytest.raises(ValueError, match="heads must divide"):
        evaluate(GptModel(GptShape(8, 1536, 12, seq=512)), CLUSTER, _par(tp=8, pp=1, dp=1))
    # more stages than blocks: no cut at all
    assert evaluate(GptModel(GptShape(2, 1024, 16, seq=512)), CLUSTER,
                    _par(tp=1, pp=8, dp=1)) is None


def test_a_shared_cache_does_not_leak_across_devices():
    par = _par()
    slow, fast = two_nodes_of_four(0.32), two_nodes_of_four(0.64)
    alone = evaluate(MODEL, fast, par).step_s
    cache: dict = {}
    evaluate(MODEL, slow, par, cache=cache)
    assert evaluate(MODEL, fast, par, cache=cache).step_s == pytest.approx(alone, rel=1e-12)


# -- Megatron-LM's Table 1: the published configurations, predicted --------------------------


@pytest.fixture(scope="module")
def table1_predictions():
    """Per row: eq. 3 TFLOP/s per GPU of the published configuration's predicted step."""
    out = []
    for row in TABLE1:
        p = plan(row.shape, megatron_cluster(row.gpus), row.batch, fix=_published_fix(row))
        par = p.parallelism
        assert (par.tp, par.pp, par.dp, par.micro_batch, par.schedule, par.recompute,
                par.overlap_grad_reduce) == (row.t, row.p, row.dp, 1, "1f1b", "full", False)
        assert p.fits, (row.billions, p.binding)
        out.append(row.shape.flops_per_iteration(row.batch) / p.predicted["step_s"]
                   / row.gpus / 1e12)
    return out


@pytest.mark.parametrize("i", range(len(TABLE1)), ids=[f"{r.billions:g}B" for r in TABLE1])
def test_table1_published_configuration_within_10_percent(table1_predictions, i):
    row = TABLE1[i]
    assert table1_predictions[i] == pytest.approx(row.tflops_per_gpu, rel=0.10)


def test_table1_mean_error_at_most_5_percent(table1_predictions):
    errors = [abs(t / row.tflops_per_gpu - 1) for t, row in zip(table1_predictions, TABLE1)]
    assert statistics.mean(errors) <= 0.05, errors


def test_table1_executed_flops_are_eq3_with_full_recompute():
    row = TABLE1[1]
    p = plan(row.shape, megatron_cluster(row.gpus), row.batch, fix=_published_fix(row))
    assert p.predicted["executed_flops"] == pytest.approx(
        row.shape.flops_per_iteration(row.batch), rel=1e-9)
    # with eq. 3's FLOPs, TFLOP/s per device is the report's
    assert p.predicted["tflops_per_device"] == pytest.approx(
        row.shape.flops_per_iteration(row.batch) / p.predicted["step_s"] / row.gpus / 1e12,
        rel=1e-9)


def test_megatron_cluster_is_dgx_a100_calibrated():
    c = megatron_cluster(64)
    base = dgx_a100(8)
    assert (c.devices, c.devices_per_node, c.intra, c.inter) == (64, 8, base.intra, base.inter)
    assert c.device.flop_efficiency < 1 and MIXED_ADAM.per_parameter == 16


# -- ZB-V: two chunks per device in a V -----------------------------------------------------

def test_zb_v_memory_is_what_the_simulator_holds_and_its_bubble_is_smaller():
    model = GptModel(GptShape(16, 1024, 16, seq=512))
    cluster = Cluster(get_device("a100-80gb"), 4, 2, LINKS["nvlink3"], LINKS["hdr-ib"])
    zbv = Parallelism(tp=1, pp=4, dp=2, micro_batch=1, n_micro=16, schedule="zb-v", chunks=2)
    one = Parallelism(tp=1, pp=4, dp=2, micro_batch=1, n_micro=16, schedule="1f1b")
    sim, closed = evaluate(model, cluster, zbv), evaluate(model, cluster, zbv, simulated=False)
    assert sim.fits
    for a, b in zip(sim.stages, closed.stages):
        assert a.activations == pytest.approx(b.activations, rel=1e-9)
        assert a.peak_bytes == pytest.approx(sum(a.memory().values()))
    # the V puts the embedding (first chunk) and the head (last) on device 0: one holder of
    # the tied embedding, no reduction between stages for it
    assert sim.stages[0].tied_sync_s == 0.0
    assert "embedding" in sim.stages[0].plan.blocks and "head" in sim.stages[0].plan.blocks
    base = evaluate(model, cluster, one)
    # the same devices, the same work: ZB-V's pipeline (the bubble it leaves) is shorter
    assert sim.pipeline_s < base.pipeline_s and sim.step_s < base.step_s


def test_zb_v_needs_two_chunks():
    with pytest.raises(ValueError, match="two chunks"):
        Parallelism(tp=1, pp=4, dp=2, micro_batch=1, n_micro=16, schedule="zb-v")


# -- stages of their own widths (Piper's heterogeneous stages) -------------------------------

def test_stages_of_their_own_widths_keep_the_laws():
    par = Parallelism(tp=2, pp=2, dp=2, micro_batch=2, n_micro=8, widths=((4, 1), (1, 4)))
    pred = evaluate(MODEL, CLUSTER, par)
    assert [(s.tp, s.dp) for s in pred.stages] == [(4, 1), (1, 4)]
    for s in pred.stages:
        assert s.peak_bytes == pytest.approx(sum(s.memory().values()))
    # every device in exactly one stage; each stage's replicas laid out by its own width
    ranks = [r for s in pred.stages for r in s.ranks]
    assert sorted(ranks) == list(range(8))
    assert par.dp_group(0) == [0] and par.dp_group(1) == [4, 5, 6, 7]
    assert par.stage_tp_group(0) == [0, 1, 2, 3] and par.stage_tp_group(1) == [4]
    # the one-wide stage holds all of its blocks' parameters, the four-wide a quarter
    assert pred.stages[1].dp_sync_s > 0 and pred.stages[0].dp_sync_s == 0


def test_stages_choosing_their_widths_are_no_slower_than_any_common_width():
    common = []
    for tp in (1, 2, 4):
        dp = 4 // tp
        par = Parallelism(tp=tp, pp=2, dp=dp, micro_batch=4 // dp, n_micro=8)
        got = evaluate(MODEL, CLUSTER, par, simulated=False)
        if got is not None and got.fits:
            common.append(max(s.plan.time_s for s in got.stages))
    chosen = evaluate(MODEL, CLUSTER, Parallelism(tp=1, pp=2, dp=4, micro_batch=1, n_micro=8,
                                                  per_stage=True), simulated=False)
    assert chosen.parallelism.widths and not chosen.parallelism.per_stage
    # the stage cut minimizes the slowest stage: choosing widths per stage can only lower it
    assert max(s.plan.time_s for s in chosen.stages) <= min(common) * (1 + 1e-9)


def test_stage_widths_must_fill_their_stage():
    with pytest.raises(ValueError, match="every stage has 4 devices"):
        Parallelism(tp=2, pp=2, dp=2, micro_batch=1, n_micro=8, widths=((4, 1), (2, 1)))
    with pytest.raises(ValueError, match="one chunk per device"):
        Parallelism(tp=2, pp=2, dp=2, micro_batch=1, n_micro=8, schedule="interleaved",
                    chunks=2, per_stage=True)
