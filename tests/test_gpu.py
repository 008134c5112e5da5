"""The laws on a CUDA device (the GPU tier: ``pytest -m gpu``; skipped without CUDA).

Zoo models (small configs) on the GPU: the eager plan is bitwise eager PyTorch and the simulated
peak equals the measured one (the allocator's requested bytes); ``fitgraph.optimize`` plans,
profiles and meters on the model's device, keeps its budget and matches eager; offloading runs
on a copy stream with pinned buffers; the torch.compile backend runs there; and ``bench`` puts
``save_on_cpu`` (the offloading baseline, CUDA only) beside fitgraph.
"""

from __future__ import annotations

import copy
import warnings

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
    # TF32 (cuDNN's default for convolutions) rounds a product's inputs to 10 bits: a plan that
    # splits a convolution's batch sums its weight gradient from parts that round apart, 1e-3
    # off eager; in float32 the parts differ from the whole by the order of the sum alone
    old = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
           torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old[:2]
    torch.use_deterministic_algorithms(old[2], warn_only=old[3])
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old[4:]


def _eager_repeats_bitwise(case) -> bool:
    """Whether eager PyTorch itself gives the same bits twice on this case (law 1 asks fitgraph
    for no more than that): not where torch warns that a kernel it ran has no deterministic
    implementation (U-Net's ``nll_loss2d`` adds with atomics: two runs may agree by chance)."""
    a, b = copy.deepcopy(case.model), copy.deepcopy(case.model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        la = eager_step(a, case.batch, case.loss_fn, seed=0)
        lb = eager_step(b, case.batch, case.loss_fn, seed=0)
    if any("does not have a deterministic implementation" in str(w.message) for w in seen):
        return False
    return torch.equal(la, lb) and all(torch.equal(p.grad, q.grad) for p, q in
                                       zip(a.parameters(), b.parameters()))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _same_state(a, oa, b, ob):
    """``b`` and ``ob`` take ``a``'s parameters and ``oa``'s state, in place (the plan holds
    them). NOTE: a plan that is allclose, not bitwise (a split sums in another order), would
    otherwise drift from eager step by step: AdamW's first updates are about ``lr * sign(g)``,
    so a gradient element near 0 that rounds to the other sign moves its weight by ``2 * lr``.
    Each step is then compared from the same state, as one step of eager's."""
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters()):
            q.copy_(p)
            for k, v in oa.state[p].items():
                if torch.is_tensor(v):
                    ob.state[q][k].copy_(v)


def _grads_close(a, b, rtol=1e-3, atol=1e-5, step=0):
    """Gradients allclose, the absolute tolerance scaled by each gradient's largest element (a
    split sums a weight gradient in another order: elements that cancel keep the error of the
    large terms), as the CPU fission tests compare."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol * (1 + scale),
                                   msg=lambda m, n=name: f"step {step}, grad of {n}: {m}")


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
        torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-5, msg=f"step {i}")
        _grads_close(a, b, step=i)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
        _same_state(a, oa, b, ob)
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
    from fitgraph.bench.harness import bench_model
    from fitgraph.bench.verdicts import fitgraph_at

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


class _Dropouts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        for lin in self.layers:
            x = self.drop(torch.tanh(lin(x)))
        return x


def test_cuda_dropout_masks_are_fused_packed_bitwise_and_as_simulated():
    """``nn.Dropout`` on CUDA runs one fused ``native_dropout`` kernel whose mask is bool:
    ``compact_masks`` packs it eight to a byte; the plan that re-makes the unpacked masks runs
    bitwise like eager (the draws are not replayed) and measures the bytes it simulates."""
    from fitgraph.graph.own_ops import PACK_BITS
    from fitgraph.plan.remat import remat_plan
    from fitgraph.solvers.remat.candidates import random_bits
    from fitgraph.transform.compact_masks import compact_masks, dropout_masks

    torch.manual_seed(0)
    model, batch = _Dropouts().cuda(), torch.randn(512, 64, device="cuda")

    def loss_fn(m, b):
        return m(b).square().mean()

    g = fitgraph.capture(copy.deepcopy(model), batch, loss_fn)
    masks = dropout_masks(g)
    assert len(masks) == 4 and all(m.fused for m in masks), masks
    c = compact_masks(g)
    packs = {n.id for n in c.nodes if n.target == PACK_BITS}
    assert len(packs) == 4 and packs <= random_bits(c)
    unpacked = [n.id for n in c.nodes if n.name.endswith(".mask.unpacked")]
    plan = remat_plan(c, unpacked)
    cm = ProfiledCostModel("cuda", repeats=1, warmup=0, progress=False)
    cm.profile(c)
    sim = simulate(c, plan, cm)
    twin = copy.deepcopy(model)
    measured = measure_plan(c, plan, twin, batch, repeats=0, device="cuda")
    assert measured.peak_bytes == sim.peak_bytes
    eager = measure_eager(copy.deepcopy(model), batch, loss_fn, repeats=0, device="cuda")
    assert measured.peak_bytes < eager.peak_bytes
    twin.zero_grad(set_to_none=True)
    la = eager_step(model, batch, loss_fn, seed=5)
    torch.manual_seed(5)
    lb = execute(c, plan, twin, batch)
    torch.cuda.synchronize()
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(model, twin)


def test_cuda_clipping_runs_the_foreach_kernels_bitwise_like_eager():
    """``clip_grad_norm`` is captured as torch runs it on CUDA (``_foreach_norm``, then
    ``_foreach_mul_`` on the gradients, before the updates) and stays bitwise eager, also under
    a plan that rematerializes."""
    case = zoo.build("gpt2", "small", device="cuda")
    a, b = case.model, copy.deepcopy(case.model)
    oa, ob = _adamw(a.parameters()), _adamw(b.parameters())
    g = fitgraph.capture(b, case.batch, case.loss_fn, ob, clip_grad_norm=0.05)
    assert any(n.target == "aten._foreach_norm.Scalar" for n in g.nodes)
    step = fitgraph.optimize(b, case.batch, case.loss_fn, ob, budget=0.7, solver="hotspot",
                             time_budget=20, clip_grad_norm=0.05)
    for i in range(2):
        torch.manual_seed(i)
        la = case.loss(a)
        la.backward()
        assert torch.nn.utils.clip_grad_norm_(a.parameters(), 0.05) > 0.05
        oa.step()
        torch.manual_seed(i)
        lb = step(case.batch)
        torch.cuda.synchronize()
        assert torch.equal(la.detach(), lb)
        assert_bitwise_equal_models(a, b, oa, ob)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
    r = step.report()
    assert r.measured_peak_bytes == r.planned_peak_bytes <= r.budget_bytes
