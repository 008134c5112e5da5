"""The ``auto`` solver (hotspot, and fission where it wins) and ``optimize``'s default.

- where the loss region is the floor of remat's peak, at the budget hotspot barely reaches,
  ``auto`` picks fission and is faster than hotspot; its plan runs allclose to eager;
- where nothing at the peak can be split (or the eager plan fits), it returns hotspot's plan
  without running fission; where fission runs but does not win, hotspot's plan too;
- ``fitgraph.optimize`` uses it by default: below hotspot's floor the split plan runs, allclose
  to eager, at the measured peak it planned; it saves and loads with its split graph.
(The random-graph property test in test_solvers.py covers ``auto`` with every solver.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import eager_step

import fitgraph
from fitgraph import zoo
from fitgraph.api import graph_fingerprint
from fitgraph.cost import ProfiledCostModel, RooflineCostModel, get_device
from fitgraph.cost.base import BaseCostModel, NodeCost
from fitgraph.execute import execute
from fitgraph.graph.ir import GraphBuilder, Phase, Role
from fitgraph.solvers import BudgetInfeasible, Problem, solve

CPU = RooflineCostModel(get_device("cpu-generic"))


def _lm_like(depth=6, width=512, classes=4096, rows=512):
    """An MLP with a 4096-class cross-entropy: its layers' activations are remat's to drop,
    the logits, loss and gradient are a floor only fission cuts."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, width)]
    for _ in range(depth - 1):
        layers += [torch.nn.GELU(), torch.nn.Linear(width, width)]
    model = torch.nn.Sequential(*layers, torch.nn.GELU(), torch.nn.Linear(width, classes))
    batch = (torch.randn(rows, 32), torch.randint(0, classes, (rows,)))
    return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _hotspot_floor(g, cm) -> int:
    resident = solve(Problem(g, cm, latency_limit=1.0), "eager").sim.resident_bytes
    with pytest.raises(BudgetInfeasible) as e:
        solve(Problem(g, cm, budget_bytes=resident), "hotspot")
    return e.value.smallest_peak_bytes


def assert_close_to_eager(model, batch, loss_fn, graph, plan, rtol=1e-4, atol=1e-5):
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    want = eager_step(ref, batch, loss_fn)
    torch.manual_seed(0)
    got = execute(graph, plan, m, batch)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol * (1 + q.grad.abs().max()))


def test_auto_splits_the_loss_where_hotspot_barely_fits():
    model, batch, loss_fn = _lm_like()
    g = fitgraph.capture(model, batch, loss_fn)
    budget = _hotspot_floor(g, CPU)
    hot = solve(Problem(g, CPU, budget_bytes=budget), "hotspot")
    auto = solve(Problem(g, CPU, budget_bytes=budget), "auto")
    assert auto.solver == "auto" and auto.notes["winner"] == "fission", auto.notes["why"]
    assert auto.graph is not None and "_log_softmax" in auto.notes["splits"][0]
    assert auto.sim.peak_bytes <= budget
    assert auto.sim.latency_s < hot.sim.latency_s
    assert auto.notes["hotspot"]["latency_s"] == hot.sim.latency_s
    assert "beats hotspot" in auto.notes["why"]
    assert_close_to_eager(model, batch, loss_fn, auto.graph, auto.plan)
    again = solve(Problem(g, CPU, budget_bytes=budget), "auto")
    assert again.plan.instructions == auto.plan.instructions          # deterministic
    assert graph_fingerprint(again.graph) == graph_fingerprint(auto.graph)


def test_auto_latency_mode_lowest_peak_within_the_limit():
    model, batch, loss_fn = _lm_like(depth=3, width=256)
    g = fitgraph.capture(model, batch, loss_fn)
    eager = solve(Problem(g, CPU, latency_limit=1.0), "eager").sim
    hot = solve(Problem(g, CPU, latency_limit=1.05), "hotspot")
    auto = solve(Problem(g, CPU, latency_limit=1.05), "auto")
    assert auto.sim.latency_s <= 1.05 * eager.latency_s
    assert auto.sim.peak_bytes <= hot.sim.peak_bytes
    assert auto.notes["winner"] == ("fission" if auto.graph is not None else "hotspot")


def test_auto_keeps_hotspot_where_fission_does_not_win():
    # NOTE: on a GPU roofline the parts' kernel launches cost more than hotspot's recomputes
    model, batch, loss_fn = _lm_like(depth=4, width=256)
    g = fitgraph.capture(model, batch, loss_fn)
    gpu = RooflineCostModel(get_device("rtx3090"))
    budget = _hotspot_floor(g, gpu)
    hot = solve(Problem(g, gpu, budget_bytes=budget), "hotspot")
    auto = solve(Problem(g, gpu, budget_bytes=budget), "auto")
    assert auto.notes["winner"] == "hotspot" and isinstance(auto.notes["fission"], dict)
    assert "fission found no split plan better" in auto.notes["why"]
    assert auto.graph is None and auto.plan == hot.plan


class _Ms(BaseCostModel):
    name = "1 ms per node"

    def node_cost(self, g, n):
        return NodeCost(1e-3, 0)

    def copy_seconds(self, nbytes):
        return 0.0


def _opaque_chain():
    """A forward and backward chain of an op no dimension rule knows: nothing can be split."""
    b = GraphBuilder()
    acts = [b.add_input("x", (64,), "float32", Role.PARAMETER)]
    for _ in range(6):
        acts.append(b.add_node("aten.op.default", [acts[-1]], [((4096,), "float32")])[0])
    grads = [b.add_node("aten.op.default", [acts[-1]], [((), "float32")], phase=Phase.LOSS)[0]]
    for a in reversed(acts[1:]):
        grads.append(b.add_node("aten.op.default", [grads[-1], a], [((4096,), "float32")],
                                phase=Phase.BACKWARD)[0])
    gx = b.add_node("aten.op.default", [grads[-1]], [((64,), "float32")], phase=Phase.BACKWARD)
    return b.finish({"loss": gx[0]})


def test_auto_returns_hotspot_without_a_region_to_split():
    g = _opaque_chain()
    eager = solve(Problem(g, _Ms(), latency_limit=1.0), "eager").sim
    budget = int(0.85 * eager.peak_bytes)
    hot = solve(Problem(g, _Ms(), budget_bytes=budget), "hotspot")
    auto = solve(Problem(g, _Ms(), budget_bytes=budget), "auto")
    assert auto.plan == hot.plan and auto.graph is None and auto.sim == hot.sim
    assert auto.notes["winner"] == "hotspot"
    assert auto.notes["fission"] == "not run: no region live at the eager peak can be split"
    fits = solve(Problem(g, _Ms(), budget_bytes=eager.peak_bytes), "auto")
    assert fits.notes["fission"].startswith("not run: the eager plan fits")
    with pytest.raises(BudgetInfeasible, match="'auto'") as e:
        solve(Problem(g, _Ms(), budget_bytes=eager.resident_bytes), "auto")
    assert e.value.solver == "auto" and e.value.smallest_peak_bytes > eager.resident_bytes


def test_optimize_defaults_to_auto_and_runs_the_split_graph(tmp_path):
    model, batch, loss_fn = _lm_like(depth=2, width=256, classes=2048, rows=256)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    g = fitgraph.capture(model, batch, loss_fn)
    cm.profile(g)
    budget = _hotspot_floor(g, cm) - 1   # NOTE: below remat's floor: only a split fits
    twin, ref = copy.deepcopy(model), copy.deepcopy(model)
    want = eager_step(ref, batch, loss_fn)
    step = fitgraph.optimize(model, batch, loss_fn, budget=budget, cost_model=cm)
    loss = step(batch)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    r = step.report()
    assert r.solver == "auto" and r.notes["winner"] == "fission" and "(auto: fission," in str(r)
    assert "hotspot cannot reach the budget" in r.notes["why"]
    assert r.measured_peak_bytes == r.planned_peak_bytes <= budget
    assert any(".part" in n.name for n in step.graph.nodes)
    path = str(tmp_path / "plan.fg")
    step.save(path)
    loaded = fitgraph.load(path, twin, loss_fn=loss_fn, batch=batch, cost_model=cm)
    assert loaded.plan == step.plan
    assert graph_fingerprint(loaded.graph) == graph_fingerprint(step.graph)
    assert torch.equal(loaded(batch), loss)
    for p, q in zip(twin.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.slow  # NOTE: a long run; the law is held in the default tier too
def test_auto_offloads_where_device_memory_is_apart_and_never_on_the_cpu():
    """On a GPU model joint (remat + offload) joins the portfolio and wins where copies hide;
    on the CPU, whose host is the same RAM, offloading frees nothing and is never tried."""
    case = zoo.build("gpt2", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    gpu = RooflineCostModel(get_device("rtx3090"))
    eager = solve(Problem(g, gpu, latency_limit=1.0), "eager").sim
    p = Problem(g, gpu, budget_bytes=int(0.6 * eager.peak_bytes), time_budget_s=30)
    auto, hot = solve(p, "auto"), solve(p, "hotspot")
    assert auto.sim.peak_bytes <= p.budget_bytes
    assert auto.sim.latency_s < hot.sim.latency_s, auto.notes["why"]
    assert auto.notes["winner"] in ("joint", "fission") and isinstance(auto.notes["joint"], dict)
    cpu = solve(Problem(g, CPU, budget_bytes=int(0.6 * eager.peak_bytes)), "auto")
    assert cpu.notes["joint"].startswith("not run: host and device are one memory")
    assert cpu.plan.counts().get("offload", 0) == 0


class _ResidualDropout(torch.nn.Module):
    """Six residual layers, each ``x + dropout(relu(linear(x)))``: their float masks are
    much of the peak."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(256, 256) for _ in range(6)])
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        for layer in self.layers:
            x = x + self.drop(torch.relu(layer(x)))
        return x


# NOTE: a roofline prices a random draw as a pass over its bytes; a CPU generates each number
# (bernoulli_ over GPT-2's 2M-element attention mask: 8.6 ms, against 0.82 ms to convert and
# scale the same mask's bits)
DRAW_FACTOR = 10


class _RooflineTimesMeasuredBytes(BaseCostModel):
    """Times from the generic CPU roofline, random draws ``DRAW_FACTOR`` times dearer (the same
    plan on any machine, however loaded), and bytes from the profile: measured workspaces (a
    Python scalar wrapped in a tensor, the RNG state a replayed draw sets) make measured ==
    simulated to the byte."""

    name = "roofline times, measured bytes"

    measures = True

    def __init__(self, measured):
        self.measured = measured
        self.rng_state_bytes = measured.rng_state_bytes

    def prepare(self, graph):
        self.measured.prepare(graph)

    def node_cost(self, g, n):
        seconds = CPU.node_cost(g, n).seconds * (DRAW_FACTOR if n.random else 1)
        return NodeCost(seconds, self.measured.node_cost(g, n).workspace_bytes)

    def copy_seconds(self, nbytes):
        return CPU.copy_seconds(nbytes)


def test_auto_keeps_dropout_masks_as_bits_where_that_lowers_the_peak(tmp_path):
    torch.manual_seed(0)
    model, batch = _ResidualDropout(), torch.randn(512, 256)
    loss_fn = lambda m, b: m(b).square().mean()  # noqa: E731
    g = fitgraph.capture(copy.deepcopy(model), batch, loss_fn)
    cm = _RooflineTimesMeasuredBytes(ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0,
                                                       progress=False))
    cm.prepare(g)
    # NOTE: on the roofline, making the bits and the float mask again is 5% of this step (on
    # a CPU the draw it saves is dearer): within 1.10 both graphs reach the same peak
    limit = 1.20
    hot = solve(Problem(g, cm, latency_limit=limit, time_budget_s=10), "hotspot")
    ref = copy.deepcopy(model)
    want = eager_step(ref, batch, loss_fn, seed=7)
    step = fitgraph.optimize(model, batch, loss_fn, latency_limit=limit, cost_model=cm,
                             time_budget=10)
    r = step.report()
    assert r.notes["compact_masks"]["peak_bytes"] < hot.sim.peak_bytes, r.notes["why"]
    # NOTE: the bits graph is what every later option plans on: fission too, which here also
    # runs the step in parts along its batch and wins
    assert r.notes["winner"] in ("hotspot (masks as bits)", "fission"), r.notes["why"]
    assert r.planned_peak_bytes < hot.sim.peak_bytes
    assert any(n.name.endswith(".mask.bits") for n in step.graph.nodes)
    torch.manual_seed(7)
    got = step(batch)
    if r.notes["winner"] == "fission":  # NOTE: parts sum in another order: allclose (law 1)
        torch.testing.assert_close(got, want)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    else:                               # NOTE: bitwise: the same draws, re-made
        assert torch.equal(got, want)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert step.report().measured_peak_bytes == r.planned_peak_bytes


def test_an_infeasible_budget_is_checked_against_the_least_peak_search(monkeypatch):
    """Budget mode's greedy may stall above a budget that another path reaches (the sweep's
    Marian: 11.5 MiB asked for 11.2, 11.14 reached when asked for less): auto then runs the
    least-peak search, returns its plan where it fits, and reports the lower smallest peak."""
    import dataclasses

    from fitgraph.solvers import portfolio

    g = fitgraph.capture(*_lm_like(depth=3, width=128, classes=256, rows=128))
    cm = RooflineCostModel(get_device("cpu-generic"))
    real = portfolio.solve_hotspot
    least = real(Problem(g, cm, latency_limit=1e9, time_budget_s=5))

    def stalled(problem):
        if problem.budget_bytes is not None:   # NOTE: budget mode stalls above the least peak
            raise BudgetInfeasible(problem.budget_bytes, least.sim.peak_bytes + 4096, "x", "h")
        return real(problem)
    monkeypatch.setattr(portfolio, "solve_hotspot", stalled)
    monkeypatch.setattr(portfolio, "solve_fission", lambda p, **k: stalled(p))
    sol = solve(Problem(g, cm, budget_bytes=least.sim.peak_bytes + 1024, time_budget_s=5), "auto")
    assert sol.sim.peak_bytes <= least.sim.peak_bytes + 1024
    assert "least-peak search" in sol.notes["why"]
    with pytest.raises(BudgetInfeasible) as e:
        solve(dataclasses.replace(Problem(g, cm, budget_bytes=1024, time_budget_s=5)), "auto")
    assert e.value.smallest_peak_bytes == least.sim.peak_bytes


class _Residual(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def test_auto_falls_back_to_dtr_where_hotspot_keeps_every_block_output():
    """A chain of residual blocks below what hotspot reaches (each block's output kept, each
    dropped value recomputed once): DTR's eviction recomputes values from values it
    recomputed, and auto returns its plan where it fits (run bitwise equal to eager), and its
    least peak (with its plan) where nothing fits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Residual(32) for _ in range(12)], torch.nn.Linear(32, 4))
    batch = torch.randn(1024, 32)
    loss_fn = lambda m, b: m(b).square().mean()  # noqa: E731
    g = fitgraph.capture(copy.deepcopy(model), batch, loss_fn)
    eager = solve(Problem(g, CPU, latency_limit=1.0), "eager").sim
    floor = _hotspot_floor(g, CPU)
    budget = int(0.3 * eager.peak_bytes)
    assert floor > budget   # NOTE: hotspot's least peak (0.35 of eager's) misses it
    # NOTE: exact: no fission, no split_backward (sums in parts): remat's plans alone
    sol = solve(Problem(g, CPU, budget_bytes=budget, time_budget_s=5, exact=True), "auto")
    assert sol.notes["winner"] == "dtr", sol.notes["why"]
    assert sol.sim.peak_bytes <= budget and sol.notes["dtr"]["peak_bytes"] <= budget
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    want = eager_step(ref, batch, loss_fn)
    assert torch.equal(execute(sol.graph_for(g), sol.plan, m, batch), want)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(BudgetInfeasible) as e:
        solve(Problem(g, CPU, budget_bytes=int(0.2 * eager.peak_bytes), time_budget_s=5,
                      exact=True), "auto")
    assert e.value.smallest_peak_bytes < floor
    assert e.value.solution.sim.peak_bytes == e.value.smallest_peak_bytes
