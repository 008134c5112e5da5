"""bench.instruction_times: every instruction timed in place, grouped beside the cost model's charge."""

import torch
from test_hotspot import Ms

import fitgraph
from fitgraph.bench.instruction_times import _grouped, misses, timed_plans
from fitgraph.solvers import Problem, solve


def test_each_instruction_is_timed_and_the_model_is_not_stepped():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(4, 8)
    g = fitgraph.capture(model, batch, lambda m, b: m(b).square().mean(), opt)
    plan = solve(Problem(g, Ms(), latency_limit=1.0), "eager").plan
    assert any(n.target.startswith("fitgraph.optimizer.") for n in g.nodes)
    before = [p.detach().clone() for p in model.parameters()]
    times = timed_plans({"eager": (g, plan)}, model, opt, batch, repeats=2)["eager"]
    assert len(times) == len(plan) and all(t >= 0 for t in times)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    meas, sim = _grouped(g, plan, times, Ms())
    computes = sum(1 for ins in plan if type(ins).__name__ == "Compute")
    assert abs(sum(sim.values()) - computes * 1e-3) < 1e-12
    assert sum(meas.values()) == sum(times)
    top = misses(meas, sim, 2)
    assert len(top) == 2 and abs(top[0][1] - top[0][2]) >= abs(top[1][1] - top[1][2])
