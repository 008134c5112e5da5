"""The BatchNorm rules (``transform.norm_from_stats``): the backward reads the BatchNorm's
output and its activation re-made from the saved statistics — bitwise the step's results and
running statistics on random shapes and layouts, the forward's copies freed early, the
matches refused where the rewrite would read changed tensors, and the kernel probe."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fitgraph
from fitgraph.execute import execute
from fitgraph.graph.analysis import verify_graph
from fitgraph.graph.kernel_facts import Conservative, use_kernel_facts
from fitgraph.sim.simulate import simulate
from fitgraph.transform.norm_from_stats import batch_norm_from_stats, find_norms_from_stats
from fitgraph.transform.rules import RULES

_ACTS = {"relu": lambda: torch.nn.ReLU(), "relu_": lambda: torch.nn.ReLU(inplace=True),
         "silu": lambda: torch.nn.SiLU(), "none": lambda: torch.nn.Identity()}


class Block(torch.nn.Module):
    """conv -> BatchNorm -> activation -> conv, and a residual block whose sum lies between its
    second BatchNorm and the activation."""

    def __init__(self, c, act, affine, dims):
        super().__init__()
        conv, bn = ((torch.nn.Conv1d, torch.nn.BatchNorm1d) if dims == 1
                    else (torch.nn.Conv2d, torch.nn.BatchNorm2d))
        self.c1, self.b1, self.a1 = conv(3, c, 3, padding=1), bn(c, affine=affine), _ACTS[act]()
        self.c2, self.b2 = conv(c, c, 3, padding=1), bn(c, affine=affine)
        self.a2 = _ACTS[act]()
        self.head = conv(c, 2, 1)

    def forward(self, x):
        h = self.a1(self.b1(self.c1(x)))
        h = self.a2(self.b2(self.c2(h)) + h)
        return self.head(h).square().mean()


def _run(graph, model, batch, channels_last):
    m = copy.deepcopy(model)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    loss = execute(graph, fitgraph.eager_plan(graph), m, batch)
    grads = {k: p.grad for k, p in m.named_parameters()}
    return loss, grads, {k: b.clone() for k, b in m.named_buffers()}


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 5), st.integers(1, 9), st.sampled_from(sorted(_ACTS)), st.booleans(),
       st.sampled_from([1, 2]), st.booleans(), st.booleans())
def test_results_and_running_statistics_are_bitwise_on_random_shapes(
        n, c, act, affine, dims, channels_last, through_sums):
    torch.manual_seed(0)
    channels_last = channels_last and dims == 2
    model = Block(c, act, affine, dims)
    size = (n, 3, 7) if dims == 1 else (n, 3, 5, 6)
    batch = torch.randn(size)
    if channels_last:
        batch = batch.contiguous(memory_format=torch.channels_last)
    g = fitgraph.capture(copy.deepcopy(model).to(
        memory_format=torch.channels_last) if channels_last else copy.deepcopy(model), batch)
    matches = find_norms_from_stats(g, through_sums)
    g2 = batch_norm_from_stats(g, through_sums)
    # NOTE: the backward reads the first BatchNorm's activation (or, without one, its output);
    # the second's only through the residual sum
    assert len(matches) == 1 + through_sums
    verify_graph(g2)
    la, ga, ba = _run(g, model, batch, channels_last)
    lb, gb, bb = _run(g2, model, batch, channels_last)
    assert torch.equal(la, lb)
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k
    for k in ba:
        assert torch.equal(ba[k], bb[k]), k   # NOTE: running statistics updated once


def test_the_forward_copy_dies_in_the_forward():
    """The activation the backward read is freed after its last forward reader: the eager
    plan's peak falls (by less than its bytes: the copy is alive in the backward)."""
    torch.manual_seed(0)
    model, batch = Block(16, "relu", True, 2), torch.randn(4, 3, 16, 16)
    g = fitgraph.capture(model, batch)
    g2 = batch_norm_from_stats(g)
    from fitgraph.cost import RooflineCostModel, get_device

    cm = RooflineCostModel(get_device("cpu-generic"))
    before, after = (simulate(x, fitgraph.eager_plan(x), cm) for x in (g, g2))
    saved = sum(m.bytes_saved for m in find_norms_from_stats(g))
    assert saved == 4 * 16 * 16 * 16 * 4
    assert before.peak_bytes - saved < after.peak_bytes < before.peak_bytes
    assert after.latency_s > before.latency_s      # NOTE: a normalization pass more


def test_an_in_place_write_after_the_norm_refuses_the_match():
    """A weight the optimizer updates in the backward (before the re-made output is read)
    would re-make another output: not matched."""
    class Written(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.bn(self.conv(x))
            z = y.relu()
            y.add_(1.0)            # NOTE: the BatchNorm's output changed after the activation
            return (z * y).sum()

    g = fitgraph.capture(Written(), torch.randn(2, 3, 4, 4))
    assert not find_norms_from_stats(g, through_sums=True)


def _mean(model, batch):
    return model(batch).mean()


def test_eval_mode_and_no_backward_reader_do_not_match():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 2))
    batch = torch.randn(2, 3, 6, 6)
    assert find_norms_from_stats(fitgraph.capture(model, batch, _mean))
    model.eval()
    assert not find_norms_from_stats(fitgraph.capture(model, batch, _mean))


def test_without_the_kernel_fact_nothing_matches():
    """The planner without torch's kernels (``Conservative``) relies on nothing: no match."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1))
    g = fitgraph.capture(model, torch.randn(2, 3, 6, 6), _mean)
    assert find_norms_from_stats(g)
    before = use_kernel_facts(Conservative())
    try:
        assert not find_norms_from_stats(g)
    finally:
        use_kernel_facts(before)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_probe_refuses_what_it_cannot_remake_bitwise(dtype):
    from fitgraph.execute.torch_kernel_facts import TorchKernelFacts

    assert TorchKernelFacts().batch_norm_from_stats("cpu", "float32", 1e-5)
    assert not TorchKernelFacts().batch_norm_from_stats("cpu", dtype, 1e-5)


def test_both_rules_are_in_the_search():
    assert RULES["norm_from_stats"].exact and RULES["norm_from_stats_through_sums"].exact


@pytest.mark.parametrize("through_sums", [False, True])
def test_the_rewritten_step_measures_the_peak_it_simulates(through_sums):
    """Law 2 on the rule's graph: the allocator meter measures the simulated peak to the byte
    (the re-made outputs, the eval kernel's empty statistics included)."""
    from fitgraph.cost import ProfiledCostModel
    from fitgraph.measure import measure_plan

    torch.manual_seed(0)
    model, batch = Block(8, "relu_", True, 2), torch.randn(3, 3, 8, 8)
    g2 = batch_norm_from_stats(fitgraph.capture(model, batch), through_sums)
    cost = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cost.profile(g2)
    plan = fitgraph.eager_plan(g2)
    measured = measure_plan(g2, plan, model, batch, repeats=0)
    assert measured.peak_bytes == simulate(g2, plan, cost).peak_bytes


def test_remat_plans_on_the_rewrite_run_bitwise_and_the_search_tries_it():
    """Law 1 on the rule's graph under a plan that drops and re-makes (hotspot's least peak
    within 1.5x of its eager step): the step's results bitwise eager's; the search (bitwise
    only: ``exact``) plans both rules' graphs."""
    from fitgraph.cost import RooflineCostModel, get_device
    from fitgraph.solvers import Problem, solve

    torch.manual_seed(0)
    model, batch = Block(16, "relu", True, 2), torch.randn(8, 3, 24, 24)
    g = fitgraph.capture(copy.deepcopy(model), batch)
    g2 = batch_norm_from_stats(g, through_sums=True)
    cm = RooflineCostModel(get_device("cpu-generic"))
    sol = solve(Problem(g2, cm, latency_limit=1.5, exact=True), "hotspot")
    assert sol.plan.counts().get("recompute", 0) > 0
    la, ga, ba = _run(g, model, batch, False)
    lb, gb, bb = _run(g2, model, batch, False)
    m = copy.deepcopy(model)
    lc = execute(g2, sol.plan, m, batch)
    assert torch.equal(la, lc) and torch.equal(la, lb)
    for k, p in m.named_parameters():
        assert torch.equal(ga[k], p.grad), k
    s = solve(Problem(g, cm, latency_limit=1.5, time_budget_s=20, exact=True), "search")
    tried = {tuple(c["rules"]) for c in s.notes["candidates"]}
    # NOTE: the through-sums rule on its better half (the first block's norm) makes the plain
    # rule's graph: planned once, under whichever name reached it first
    assert ("norm_from_stats_through_sums",) in tried
    assert {("norm_from_stats",), ("norm_from_stats_through_sums (half)",)} & tried


@pytest.mark.parametrize("name", ["resnet", "mobilenet_v2"])
def test_hugging_face_cnns_run_bitwise_on_the_rewrite(name):
    """Models people have: Hugging Face's ResNet (BatchNorm → ReLU, residual sums) and
    MobileNetV2 (BatchNorm(eps=1e-3, momentum=0.997) → ReLU6, whose backward reads the
    BatchNorm's output itself; dropout in the head), random weights from configs."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "resnet":
        model = transformers.ResNetForImageClassification(transformers.ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3))
    else:
        model = transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config(
            image_size=32, depth_multiplier=0.25, num_labels=3))
    batch = (torch.randn(4, 3, 32, 32), torch.randint(0, 3, (4,)))

    def loss_fn(m, b):
        return m(pixel_values=b[0], labels=b[1]).loss

    g = fitgraph.capture(copy.deepcopy(model), batch, loss_fn)
    g2 = batch_norm_from_stats(g, through_sums=True)
    assert find_norms_from_stats(g, through_sums=True)
    runs = []
    for graph in (g, g2):
        m = copy.deepcopy(model)
        torch.manual_seed(5)   # NOTE: the same dropout draws
        loss = execute(graph, fitgraph.eager_plan(graph), m, batch)
        runs.append((loss, [p.grad for p in m.parameters()], list(m.buffers())))
    (la, ga, ba), (lb, gb, bb) = runs
    assert torch.equal(la, lb)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert all(torch.equal(x, y) for x, y in zip(ba, bb))
