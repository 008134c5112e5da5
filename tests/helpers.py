"""Shared test helpers: run a step eagerly and through fitgraph, compare bitwise."""

from __future__ import annotations

import copy

import torch

import fitgraph
from fitgraph.capture.calling import compute_loss
from fitgraph.execute import execute


def eager_step(model, batch, loss_fn=None, optimizer=None, seed=0):
    torch.manual_seed(seed)
    loss = compute_loss(model, batch, loss_fn)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


def fitgraph_step(model, batch, loss_fn=None, optimizer=None, seed=0, plan_fn=None):
    graph = fitgraph.capture(model, batch, loss_fn, optimizer)
    plan = (plan_fn or fitgraph.eager_plan)(graph)
    torch.manual_seed(seed)
    return execute(graph, plan, model, batch, optimizer), graph


def twins(model, make_optimizer=None):
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    oa = make_optimizer(a.parameters()) if make_optimizer else None
    ob = make_optimizer(b.parameters()) if make_optimizer else None
    return a, b, oa, ob


def assert_bitwise_equal_models(a, b, oa=None, ob=None):
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        assert torch.equal(pa, pb), f"parameter {na} differs"
        assert (pa.grad is None) == (pb.grad is None), f"grad presence of {na} differs"
        if pa.grad is not None:
            assert torch.equal(pa.grad, pb.grad), f"grad of {na} differs"
    for (na, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(ba, bb), f"buffer {na} differs"
    if oa is not None:
        for pa, pb in zip(a.parameters(), b.parameters()):
            sa, sb = oa.state.get(pa, {}), ob.state.get(pb, {})
            assert sorted(sa) == sorted(sb)
            for k in sa:
                assert torch.equal(sa[k], sb[k]), f"optimizer state {k} differs"


def check_same_as_eager(model, batch, loss_fn=None, make_optimizer=None, steps=1):
    """Run `steps` steps eagerly and through fitgraph's eager plan; assert bitwise equality."""
    a, b, oa, ob = twins(model, make_optimizer)
    graph = None
    for step in range(steps):
        la = eager_step(a, batch, loss_fn, oa, seed=step)
        lb, graph = fitgraph_step(b, batch, loss_fn, ob, seed=step)
        assert torch.equal(la, lb), f"step {step}: loss {la.item()} != {lb.item()}"
        assert_bitwise_equal_models(a, b, oa, ob)
        if oa is not None:
            oa.zero_grad(set_to_none=True)
            ob.zero_grad(set_to_none=True)
    return graph


def assert_runs_like_eager(a, b, graph, plan, case, seed=0):
    """One step of ``a`` eagerly and of ``plan`` on ``b`` (no optimizer): the same loss, the
    same gradients bitwise; ``b``'s gradients are cleared afterwards, ready to be measured."""
    la = eager_step(a, case.batch, case.loss_fn, seed=seed)
    torch.manual_seed(seed)
    lb = execute(graph, plan, b, case.batch)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b)
    for p in b.parameters():
        p.grad = None


def assert_solver_plan_runs_and_measures_as_simulated(name, solver, frac, time_budget_s=30.0):
    """Zoo model ``name`` (small), measured op costs: ``solver`` at ``frac`` of the eager peak
    gives a plan that runs bitwise like eager and measures its simulated peak, within budget.
    Returns the Solution."""
    from fitgraph import zoo
    from fitgraph.cost import ProfiledCostModel
    from fitgraph.measure import measure_plan
    from fitgraph.solvers import Problem, solve

    case = zoo.build(name, "small")
    a, b = case.model, copy.deepcopy(case.model)
    g = fitgraph.capture(b, case.batch, case.loss_fn)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager")
    budget = int(frac * eager.sim.peak_bytes)
    s = solve(Problem(g, cm, budget_bytes=budget, time_budget_s=time_budget_s), solver)
    assert_runs_like_eager(a, b, g, s.plan, case, seed=0)
    measured = measure_plan(g, s.plan, b, case.batch, repeats=0)
    assert measured.peak_bytes == s.sim.peak_bytes <= budget
    return s


def assert_split_like_eager(graph, split, model, batch, plan=None, seed=0, atol=1e-6):
    """``split`` (a graph run in parts) under ``plan`` (default: its eager plan) gives
    ``graph``'s loss and gradients, allclose (parts sum in another order); each runs on its
    own copy of ``model`` from the same RNG state."""
    def run(g, p):
        m = copy.deepcopy(model)
        torch.manual_seed(seed)
        loss = execute(g, p, m, batch)
        return loss, {n: q.grad for n, q in m.named_parameters()}

    la, ga = run(graph, fitgraph.eager_plan(graph))
    lb, gb = run(split, fitgraph.eager_plan(split) if plan is None else plan)
    torch.testing.assert_close(lb, la)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=atol)


# NOTE: small shapes: dimension rules and regions do not depend on sizes, the run time does
DIM_ZOO = {
    "gpt2": dict(batch_size=2, seq_len=16),
    "bert-base": dict(batch_size=2, seq_len=16),
    "llama": dict(batch_size=2, seq_len=16),
    "vit-b16": dict(batch_size=2, image_size=32),
    "resnet50": dict(batch_size=2, image_size=32),
    "unet": dict(batch_size=2, image_size=32),
}


def adamw_reference(model, loss_of, steps: int, lr: float):
    """``steps`` AdamW steps of ``model`` in one process (``loss_of()`` the step's loss): the
    losses, the updated parameters, and per parameter the elements whose first gradient is
    rounding noise (an exact zero: compared only for staying within AdamW's step bound)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, noise = [], {}
    for _ in range(steps):
        loss = loss_of()
        loss.backward()
        if not noise:
            noise = {n: p.grad.abs() <= 1e-12 * p.grad.abs().max()
                     for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters()), noise


def assert_like_reference(got: dict, ref_params: dict, noise: dict, steps: int,
                          lr: float) -> None:
    """Parameters ``got`` (by name) equal ``ref_params`` (relative 1e-5) where the gradient
    is not noise, and within AdamW's step bound everywhere."""
    assert set(got) == set(ref_params)
    for n, ref in ref_params.items():
        ref = ref.detach()
        keep = ~noise[n]
        torch.testing.assert_close(got[n][keep], ref[keep], rtol=1e-5, atol=1e-9, msg=n)
        assert (got[n] - ref).abs().max() <= 2 * steps * lr, n


def row_parallel_seq_dims(step) -> list:
    """The dim each row-parallel linear of a ``fitgraph.dist`` step's chunks reduce-scatters
    along (None: all-reduced, no sequence parallelism)."""
    from fitgraph.dist.runtime.tp_layers import RowLinear

    return [m.seq_dim for ch in step.chunks for m in ch.modules() if isinstance(m, RowLinear)]


def classifier_mlp(d_in: int, hidden: int, classes: int, rows: int, act=torch.nn.ReLU):
    """A two-layer classifier whose cross-entropy loss over ``classes`` dominates its peak:
    (model, batch, loss_fn), seeded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), act(),
                                torch.nn.Linear(hidden, classes))
    batch = (torch.randn(rows, d_in), torch.randint(0, classes, (rows,)))
    return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
