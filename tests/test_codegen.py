"""The executor's plan compiled to straight-line Python runs exactly as eager."""

from __future__ import annotations

import torch
from helpers import check_same_as_eager

import fitgraph
from fitgraph.execute.executor import Executor
from fitgraph.plan.instructions import Compute, Free, Recompute


class _Mixed(torch.nn.Module):
    """Constants of every kind in op arguments: inf, dtypes, lists of tensors, tuples out."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, x):
        h = self.drop(self.lin(x)).clamp(min=-float("inf"), max=3.0)
        a, b = h.split([2, 4], dim=1)                   # a tuple of outputs
        d = torch.cat([b, a], dim=1).to(torch.float64)  # a list of refs, a dtype kwarg
        return (d.max(dim=1).values * 0.5).to(torch.float32)


def _loss(m, x):
    return m(x).square().mean()


def test_mixed_constants_run_bitwise_like_eager_with_an_optimizer():
    torch.manual_seed(0)
    check_same_as_eager(_Mixed(), torch.randn(5, 6), _loss,
                        make_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), steps=2)


def test_source_inlines_every_compute_and_free_of_a_deterministic_step():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    batch = torch.randn(3, 4)
    g = fitgraph.capture(model, batch, _loss)
    plan = fitgraph.eager_plan(g)
    ex = Executor(g, plan, model)
    body = ex.source.splitlines()[1:-1]
    computes = sum(isinstance(i, Compute) for i in plan)
    frees = sum(isinstance(i, Free) for i in plan)
    assert len(body) == computes + frees
    assert not any("(ex, " in line for line in body)   # nothing falls back to a method


def test_random_recompute_falls_back_to_the_replaying_method():
    from fitgraph.graph.recompute_rules import recomputable
    from fitgraph.plan.remat import remat_plan

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.5),
                                torch.nn.Linear(64, 1))
    batch = torch.randn(32, 16)
    g = fitgraph.capture(model, batch, _loss)
    ok = recomputable(g)
    drop = [n.id for n in g.nodes if n.random and not ok[n.id]]
    assert drop, "the dropout's mask chain should be recomputable"
    plan = remat_plan(g, drop)
    replays = [i for i in plan if isinstance(i, Recompute) and g.nodes[i.node].random]
    assert replays
    ex = Executor(g, plan, model)
    # NOTE: the first compute saves the RNG state and the recompute replays it: both by method
    assert sum("(ex, " in line for line in ex.source.splitlines()) >= 2 * len(replays)
    torch.manual_seed(1)
    want = _loss(model, batch)
    want.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    got = ex(batch)
    assert torch.equal(got, want.detach())
    for p, gr in zip(model.parameters(), grads):
        assert torch.equal(p.grad, gr)


def test_ops_are_called_without_their_python_wrapper():
    """Each ATen op is bound as its C++ callable (``OpOverload._op``): the wrapper's Python
    frame costs ~0.3 us an op, percents of a step of thousands of small ops (GRU, Mamba)."""
    model, x = _Mixed(), torch.randn(5, 6)
    g = fitgraph.capture(model, x, _loss)
    ex = Executor(g, fitgraph.eager_plan(g), model)
    bound = list(ex._run.__globals__.values())
    assert not any(isinstance(v, torch._ops.OpOverload) for v in bound)
    assert any(v is torch.ops.aten.addmm.default._op for v in bound)
