"""The laws on a CUDA device (the GPU tier: ``pytest -m gpu``; skipped without CUDA).

Zoo models (small configs) on the GPU: the eager plan is bitwise eager PyTorch and the simulated
peak equals the measured one (the allocator's requested bytes); ``fitgraph.optimize`` plans,
profiles and meters on the model's device, keeps its budget and matches eager; offloading runs
on a copy stream with pinned buffers; the torch.compile backend runs there; and ``bench`` puts
``save_on_cpu`` (the offloading baseline, CUDA only) beside fitgraph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph import zoo
from fitgraph.cost import ProfiledCostModel
from fitgraph.execute import execute
from fitgraph.execute.meter import MemoryMeter
from fitgraph.measure import measure_eager, measure_plan
from fitgraph.sim import simulate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _deterministic():
    # NOTE: cuDNN may pick a different (non-bitwise) algorithm per call unless told not to, and
    # some backward kernels (upsample_bilinear2d's, max_pool2d's) add with atomics unless
    # deterministic algorithms are asked for; nll_loss2d's forward has no deterministic kernel
    # (warn_only: it runs, and eager PyTorch itself differs run to run there)
    old = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
           torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old[:2]
    torch.use_deterministic_algorithms(old[2], warn_only=old[3])


def _eager_repeats_bitwise(case) -> bool:
    """Whether eager PyTorch itself gives the same bits twice on this case (law 1 asks fitgraph
    for no more than that)."""
    a, b = copy.deepcopy(case.model), copy.deepcopy(case.model)
    la = eager_step(a, case.batch, case.loss_fn, seed=0)
    lb = eager_step(b, case.batch, case.loss_fn, seed=0)
    return torch.equal(la, lb) and all(torch.equal(p.grad, q.grad) for p, q in
                                       zip(a.parameters(), b.parameters()))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _grads_close(a, b, rtol=1e-3, atol=1e-5):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=name)


def test_meter_counts_requested_bytes_and_blocks():
    dev = torch.device("cuda")
    with MemoryMeter(dev) as m:
        x = torch.empty(1000, dtype=torch.uint8, device=dev)   # one 1024-byte block
        del x
    assert m.peak_bytes == 1000 and m.block_peak_bytes == 1024 and m.end_bytes == 0


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "vit-b16", "unet"])
def test_cuda_eager_plan_is_eager_and_simulator_tells_truth(name):
    case = zoo.build(name, "small", device="cuda")
    bitwise = _eager_repeats_bitwise(case)
    assert bitwise or name == "unet", f"{name}: eager PyTorch differs from itself"
    a, b = case.model, copy.deepcopy(case.model)
    oa, ob = _adamw(a.parameters()), _adamw(b.parameters())
    for step in range(2):   # NOTE: the second step runs with AdamW's state
        la = eager_step(a, case.batch, case.loss_fn, oa, seed=step)
        g = fitgraph.capture(b, case.batch, case.loss_fn, ob)
        torch.manual_seed(step)
        lb = execute(g, fitgraph.eager_plan(g), b, case.batch, ob)
        torch.cuda.synchronize()
        if bitwise:
            assert torch.equal(la, lb), f"{name} step {step}: loss {la} != {lb}"
            assert_bitwise_equal_models(a, b, oa, ob)
        else:
            torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
            for p, q in zip(a.parameters(), b.parameters()):
                torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
    g = fitgraph.capture(b, case.batch, case.loss_fn, ob)
    plan = fitgraph.eager_plan(g)
    cm = ProfiledCostModel("cuda", repeats=1, warmup=0, progress=False)
    cm.profile(g)
    sim = simulate(g, plan, cm)
    measured = measure_plan(g, plan, b, case.batch, ob, repeats=0, device="cuda")
    eager = measure_eager(b, case.batch, case.loss_fn, ob, repeats=0, device="cuda")
    assert sim.peak_bytes == measured.peak_bytes, (
        f"{name}: simulated {sim.peak_bytes} != measured {measured.peak_bytes}")
    assert abs(measured.peak_bytes - eager.peak_bytes) <= 0.05 * eager.peak_bytes


@pytest.mark.parametrize("name,solver,budget", [("gpt2", "auto", 0.6), ("unet", "auto", 0.5),
                                                ("vit-b16", "joint", 0.6),
                                                ("unet", "fission", 0.4)])
def test_cuda_optimize_keeps_budget_and_matches_eager(name, solver, budget):
    case = zoo.build(name, "small", device="cuda")
    a, b = case.model, copy.deepcopy(case.model)
    oa, ob = _adamw(a.parameters()), _adamw(b.parameters())
    step = fitgraph.optimize(b, case.batch, case.loss_fn, ob, budget=budget, solver=solver,
                             time_budget=20)
    assert step.cost_model.device.type == "cuda"
    for i in range(3):
        la = eager_step(a, case.batch, case.loss_fn, oa, seed=i)
        torch.manual_seed(i)
        lb = step(case.batch)
        torch.cuda.synchronize()
        torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-5)
        _grads_close(a, b)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
    r = step.report()
    assert r.planned_peak_bytes <= r.budget_bytes < r.eager_peak_bytes
    assert r.measured_peak_bytes == r.planned_peak_bytes, str(r)
    assert r.measured_step_s is not None


def test_cuda_backend_plans_and_matches_eager():
    case = zoo.build("gpt2", "small", device="cuda")
    a, b = case.model, copy.deepcopy(case.model)
    be = fitgraph.backend(budget=0.9)
    compiled = torch.compile(b, backend=be)
    torch.manual_seed(0)
    la = case.loss(a)
    la.backward()
    torch.manual_seed(0)
    lb = case.loss(compiled)
    lb.backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-5)
    _grads_close(a, b)
    r = be.last_report
    assert r.planned_peak_bytes <= r.budget_bytes


def test_cuda_bench_has_save_on_cpu_beside_fitgraph():
    from fitgraph.bench.harness import bench_model, fitgraph_at

    case = zoo.build("gpt2", "small", device="cuda")
    rows = bench_model(case, [0.6], systems=["eager", "checkpoint", "save_on_cpu", "fitgraph"],
                       repeats=2, time_budget=10, progress=lambda _: None)
    by = {(r.system, r.budget): r for r in rows if not r.matched}
    eager, soc = by[("eager", None)], by[("save_on_cpu", None)]
    assert not soc.error and soc.peak_bytes < eager.peak_bytes
    for peer in (soc, by[("checkpoint", None)]):
        ours = fitgraph_at(rows, peer)
        assert ours is not None and not ours.error, peer
        assert ours.peak_bytes <= peer.peak_bytes
