"""The optimizer-chunks rule (``transform.optimizer_chunks``): a large parameter's update run on
row slices — bitwise eager's parameters and optimizer state over steps (first steps that make
the state included) for every update branch, the update's temporaries measured as simulated
and smaller, matches refused where chunks would change bits or save nothing, and the search
picking it where the update is the peak."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph.cost import ProfiledCostModel, RooflineCostModel, get_device
from fitgraph.cost.base import CostModelWrapper, NodeCost
from fitgraph.execute import execute
from fitgraph.graph.analysis import verify_graph
from fitgraph.graph.kernel_facts import Conservative, kernel_facts, use_kernel_facts
from fitgraph.measure import measure_plan
from fitgraph.sim.simulate import simulate
from fitgraph.transform.optimizer_chunks import (
    CHUNK_BYTES,
    chunk_updates,
    find_chunkable_updates,
    temporaries,
)
from fitgraph.transform.rules import RULES

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_coupled_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1,
                                                        amsgrad=True),
    "adam_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True,
                                               weight_decay=0.01),
    "sgd_decay": lambda ps: torch.optim.SGD(ps, lr=1e-2, weight_decay=0.01),
}


class Table(torch.nn.Module):
    """A large embedding table (the update worth chunking: 3 MiB, 1,031 rows: slices of
    uneven sizes) and a small head (not matched)."""

    def __init__(self, rows=1031, dim=762):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(rows, dim), torch.nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.emb(x)).square().mean()


class Row(torch.nn.Module):
    """One parameter of one row (3 MiB): no row slices to make."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(1, 3 * CHUNK_BYTES // 4))

    def forward(self, x):
        return (self.w * x).square().mean()


def _loss(m, b):
    return m(b)


def _case():
    torch.manual_seed(0)
    return Table(), torch.randint(0, 1031, (4, 8))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_steps_are_bitwise_eager_and_the_state_made_by_the_first(opt):
    """Three steps (the first makes the optimizer state: SGD's momentum buffer a copy of the
    gradient, Adam's moments and step) run through the chunked graph: loss, weights, ``.grad``
    and optimizer state bitwise eager's."""
    model, batch = _case()
    a, b = model, copy.deepcopy(model)
    oa, ob = OPTIMIZERS[opt](a.parameters()), OPTIMIZERS[opt](b.parameters())
    for step in range(3):
        la = eager_step(a, batch, _loss, oa, seed=step)
        g = fitgraph.capture(b, batch, _loss, ob)
        matches = find_chunkable_updates(g)
        assert [g.nodes[m.node].name.split("_", 1)[1] for m in matches] == ["emb.weight"]
        assert matches[0].chunks == 3
        g2 = chunk_updates(g)
        verify_graph(g2)
        torch.manual_seed(step)
        lb = execute(g2, fitgraph.eager_plan(g2), b, batch, ob)
        assert torch.equal(la, lb), step
        assert_bitwise_equal_models(a, b, oa, ob)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)


def test_the_update_measures_the_peak_it_simulates_and_holds_less():
    """Law 2 on the rule's graph, with the update at the step's peak: the allocator meter
    measures the simulated peak to the byte, and the chunked update's temporaries (Adam's:
    two parameter-sized tensors) are a third as large."""
    model, batch = _case()
    opt = OPTIMIZERS["adamw"](model.parameters())
    eager_step(model, batch, _loss, opt)
    g = fitgraph.capture(model, batch, _loss, opt)
    g2 = chunk_updates(g)
    cost = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    peaks = []
    for graph in (g, g2):
        cost.profile(graph)
        plan = fitgraph.eager_plan(graph)
        sim = simulate(graph, plan, cost)
        measured = measure_plan(graph, plan, model, batch, opt, repeats=0)
        assert measured.peak_bytes == sim.peak_bytes
        peaks.append(sim.peak_bytes)
    table = model.emb.weight.nbytes
    saved = find_chunkable_updates(g)[0].bytes_saved
    assert saved == 2 * (table - table // 3)
    assert peaks[0] - peaks[1] >= saved - table // 10


def test_what_is_not_matched():
    """Small parameters, updates without temporaries (plain SGD), one-row parameters, an
    already chunked graph, and the CPU's fused Adam (its chunks round apart) are not matched;
    without the kernel fact nothing is."""
    torch.manual_seed(0)
    model, batch = _case()
    plain = fitgraph.capture(model, batch, _loss, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not find_chunkable_updates(plain)
    assert temporaries("sgd", {"momentum": 0.9}) == 0
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    assert not find_chunkable_updates(fitgraph.capture(model, batch, _loss, fused))
    g = fitgraph.capture(model, batch, _loss, OPTIMIZERS["adamw"](model.parameters()))
    assert find_chunkable_updates(g) and not find_chunkable_updates(chunk_updates(g))
    row = Row()
    assert not find_chunkable_updates(fitgraph.capture(
        row, torch.randn(()), _loss, torch.optim.AdamW(row.parameters())))
    before = use_kernel_facts(Conservative())
    try:
        assert not find_chunkable_updates(g)
        assert chunk_updates(g) is g
    finally:
        use_kernel_facts(before)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_probe_says_which_kernels_chunk_alike(dtype):
    """On this CPU the single-tensor and foreach updates chunk bit for bit in float32 and
    float64; the probe refuses what it cannot run (integers) and the CPU's fused Adam in
    float32 (checked: its chunks differ)."""
    for kind in ("adam", "sgd"):
        assert kernel_facts().optimizer_chunks_alike("cpu", dtype, kind, False)
    assert not kernel_facts().optimizer_chunks_alike("cpu", "int64", "adam", False)
    assert not kernel_facts().optimizer_chunks_alike("cpu", "float32", "adam", True)


def test_the_profiler_keys_a_chunked_update_apart():
    from fitgraph.cost.profiler import node_signature

    model, batch = _case()
    g = fitgraph.capture(model, batch, _loss, OPTIMIZERS["adamw"](model.parameters()))
    g2 = chunk_updates(g)
    (m,) = find_chunkable_updates(g)
    assert node_signature(g, g.nodes[m.node]) != node_signature(g2, g2.nodes[m.node])
    other = next(n for n in g.nodes if n.target.startswith("fitgraph.optimizer.")
                 and n.id != m.node)
    assert node_signature(g, other) == node_signature(g2, g2.nodes[other.id])


class _Temporaries(CostModelWrapper):
    """A roofline that also prices an Adam update's temporaries (two slices of its parameter:
    what the allocator measures, ``test_the_update_measures_the_peak_it_simulates...``), so the
    planner's choice does not ride on a noisy measured time."""

    def node_cost(self, graph, node):
        c = self.base.node_cost(graph, node)
        if not node.target.startswith("fitgraph.optimizer."):
            return c
        p = graph.values[node.inputs[0]]
        return NodeCost(c.seconds, 2 * -(-p.nbytes // node.kwargs.get("chunks", 1)))


def _update_floor(graph, cm):
    """The most bytes live during an optimizer update of the graph's eager plan."""
    from fitgraph.plan.instructions import Compute

    plan = fitgraph.eager_plan(graph)
    sim = simulate(graph, plan, cm)
    return max(sim.peak_during[i] for i, ins in enumerate(plan.instructions)
               if isinstance(ins, Compute) and graph.nodes[ins.node].phase.value == "optimizer")


def test_auto_chunks_the_updates_where_they_bound_the_peak():
    """A step whose peak is the table's update (a tiny batch: few activations). Latency mode:
    auto plans the chunked graph, below what it reaches on the captured one. Budget mode: a
    budget under the whole update's floor but over the chunked one's is met only in chunks;
    one over it leaves the graph as captured."""
    from fitgraph.solvers import BudgetInfeasible, Problem, solve
    from fitgraph.solvers.portfolio import _solve_auto

    # NOTE: auto's own rewrite where it pays, so not a rule of the search (its candidate
    # would be the graph auto plans already)
    assert "optimizer_chunks" not in RULES
    model, batch = _case()
    opt = OPTIMIZERS["adamw"](model.parameters())
    eager_step(model, batch, _loss, opt)
    g = fitgraph.capture(model, batch, _loss, opt)
    cm = _Temporaries(RooflineCostModel(get_device("cpu-generic")))
    s = solve(Problem(g, cm, latency_limit=1.2, time_budget_s=5), "auto")
    plain = _solve_auto(Problem(g, cm, latency_limit=1.2, time_budget_s=5), True)
    assert "in row chunks" in s.notes["optimizer_chunks"]
    assert [n.kwargs.get("chunks") for n in s.graph.nodes if n.name == "adam_emb.weight"] == [3]
    assert s.sim.peak_bytes < plain.sim.peak_bytes
    whole, chunked = _update_floor(g, cm), _update_floor(chunk_updates(g), cm)
    assert chunked < whole
    between = (whole + chunked) // 2
    with pytest.raises(BudgetInfeasible):
        _solve_auto(Problem(g, cm, budget_bytes=between, time_budget_s=5), False)
    fits = solve(Problem(g, cm, budget_bytes=between, time_budget_s=5), "auto")
    assert fits.sim.peak_bytes <= between and fits.graph is not None
    roomy = solve(Problem(g, cm, budget_bytes=whole + 1, time_budget_s=5), "auto")
    assert roomy.notes["optimizer_chunks"] == "every update fits the budget whole"
    (a, oa), (b, ob) = copy.deepcopy((model, opt)), copy.deepcopy((model, opt))
    la = eager_step(a, batch, _loss, oa, seed=1)
    torch.manual_seed(1)
    assert torch.equal(la, execute(fits.graph, fits.plan, b, batch, ob))
    assert_bitwise_equal_models(a, b, oa, ob)
