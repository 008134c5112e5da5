"""``rotor``: Rotor's dynamic program over a chain of blocks (issue 5's classic peers)."""

from __future__ import annotations

import copy
import heapq
import itertools
import types

import pytest
import torch
from helpers import assert_runs_like_eager
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_plan_sim import TableCost

import fitgraph
from fitgraph import zoo
from fitgraph.cost import ProfiledCostModel, RooflineCostModel, get_device
from fitgraph.graph.ir import GraphBuilder, Phase, Role
from fitgraph.measure import measure_plan
from fitgraph.plan.instructions import Recompute
from fitgraph.plan.verify import verify_plan
from fitgraph.solvers import BudgetInfeasible, Problem, solve
from fitgraph.solvers.peers.rotor import rotor_chain
from fitgraph.solvers.peers.rotor_chain import ChainModel, RotorTable, replay, rotor_dp
from fitgraph.solvers.remat.blocks import block_of
from fitgraph.solvers.remat.stages import stage_graph

ROOFLINE = RooflineCostModel(get_device("rtx3090"))


def persistent_optimum(model: ChainModel, memory: int) -> float | None:
    """Least time over every op sequence (Dijkstra over what is held) within ``memory``, among
    Rotor's persistent schedules: a_j is freed only right after F_{j+1} without tape consumed
    it (when made since the last backward) or once B_{j+1} ran, never while ā_{j+1} is held."""
    n = model.n

    def held(a, tape, nxt):
        return (sum(model.a[k] for k in a) + sum(model.tape[k] for k in tape)
                + sum(model.fixed[:nxt + 1]) + sum(model.grads[nxt + 1:])
                + (model.delta[nxt] if nxt >= 0 else 0))

    start = (frozenset(), frozenset(), frozenset(), n - 1, None)
    best = {start: 0.0}
    queue, tie = [(0.0, 0, start)], itertools.count()
    while queue:
        cost, _, state = heapq.heappop(queue)
        a, tape, fresh, nxt, last = state
        if best[state] < cost:
            continue
        if nxt == -1:
            return cost
        mem, avail = held(a, tape, nxt), a | tape | {-1}
        moves = []
        for k in range(nxt + 1):
            if k - 1 in avail and k not in tape:
                if mem + model.f_all[k] <= memory:
                    moves.append((model.uf[k], (a - {k}, tape | {k}, fresh | {k}, nxt,
                                                ("F", k, True))))
                if k not in a and mem + model.f_ck[k] <= memory:
                    moves.append((model.uf[k], (a | {k}, tape, fresh | {k}, nxt,
                                                ("F", k, False))))
        for j in a:
            if j + 1 not in tape and (nxt <= j or (last == ("F", j + 1, False) and j in fresh)):
                moves.append((0.0, (a - {j}, tape, fresh - {j}, nxt, last)))
        if nxt in tape and nxt - 1 in avail and mem + model.b_peak[nxt] <= memory:
            moves.append((model.ub[nxt], (a, tape - {nxt}, frozenset(), nxt - 1, ("B", nxt))))
        for dt, (na, nt, nf, nn, nl) in moves:
            nxt_state = (frozenset(na), frozenset(nt), frozenset(nf), nn, nl)
            if held(na, nt, nn) <= memory and cost + dt < best.get(nxt_state, float("inf")):
                best[nxt_state] = cost + dt
                heapq.heappush(queue, (cost + dt, next(tie), nxt_state))
    return None


@st.composite
def chain_models(draw):
    n = draw(st.integers(1, 4))
    ints = lambda lo, hi: draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))  # noqa: E731
    a = ints(1, 10)
    tape = [x + y for x, y in zip(a, ints(0, 20))]
    delta = ints(1, 10)[:n - 1] + [0]
    grads = ints(0, 5)
    return ChainModel(
        uf=tuple(float(x) for x in ints(1, 5)), ub=tuple(float(x) for x in ints(1, 5)),
        a=tuple(a), tape=tuple(tape), fixed=tuple(ints(0, 5)), delta=tuple(delta),
        grads=tuple(grads), f_ck=tuple(x + y for x, y in zip(a, ints(0, 5))),
        f_all=tuple(x + y for x, y in zip(tape, ints(0, 5))),
        b_peak=tuple((delta[k - 1] if k else 0) + grads[k] + e
                     for k, e in enumerate(ints(0, 5))))


@settings(max_examples=40, deadline=None)
@given(chain_models())
def test_dp_is_optimal_among_persistent_schedules_of_a_heterogeneous_chain(model):
    table = RotorTable(model, 150, slots=150)    # NOTE: one byte a slot: no rounding
    for memory in range(0, 151, 6):
        dp, opt = table.schedule(memory), persistent_optimum(model, memory)
        assert (dp is None) == (opt is None)
        if dp is not None:
            seconds, peak = replay(model, dp.ops)
            assert seconds == dp.seconds == opt and peak <= memory
            assert rotor_dp(model, memory, slots=memory) == dp


class Blocks(torch.nn.Module):
    def __init__(self, n: int, width: int = 64) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _blocks_graph(n: int):
    model, batch = Blocks(n), torch.randn(512, 64)
    loss_fn = lambda m, b: m(b).square().mean()  # noqa: E731
    return model, batch, loss_fn, fitgraph.capture(model, batch, loss_fn)


def _in_slots(model: ChainModel, quantum: int) -> ChainModel:
    q = lambda xs: tuple(-(-x // quantum) for x in xs)  # noqa: E731
    return ChainModel(model.uf, model.ub, q(model.a), q(model.tape), q(model.fixed),
                      q(model.delta), q(model.grads), q(model.f_ck), q(model.f_all),
                      q(model.b_peak))


def test_dp_is_optimal_on_a_chain_of_equal_linear_blocks():
    g = _blocks_graph(3)[3]
    chain = rotor_chain(g, stage_graph(g, ROOFLINE))
    assert chain.names == ("blocks.0", "blocks.1", "blocks.2", "<rest>")
    m = chain.model
    assert m.uf[0] == m.uf[1] == m.uf[2] and m.tape[0] == m.tape[1] > m.a[0] > 0
    model = _in_slots(m, 16384)
    full = sum(model.tape) + max(model.f_all) + max(model.b_peak) + max(model.delta)
    seen = set()
    for memory in range(1, full + 1):
        dp = rotor_dp(model, memory, slots=memory)
        opt = persistent_optimum(model, memory)
        assert (dp is None) == (opt is None) and (dp is None or dp.seconds == pytest.approx(
            opt, rel=1e-12)), memory
        if dp is not None:
            seen.add(sum(op.kind == "F" for op in dp.ops))
    # NOTE: with room for every tape nothing is recomputed; memory is bought with forwards
    assert min(seen) == model.n < max(seen)
    top = rotor_dp(model, full, slots=full)
    assert top.seconds == pytest.approx(sum(m.uf) + sum(m.ub), rel=1e-12)


def test_chain_attributes_each_backward_unit_to_the_block_it_differentiates():
    case = zoo.build("gpt2", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    sg = stage_graph(g, ROOFLINE)
    chain = rotor_chain(g, sg)
    assert chain.names == ("<prelude>", "h.0", "h.1", "h.2", "h.3", "<rest>")
    starts = chain.backward_start
    assert all(x > y for x, y in zip(starts, starts[1:]))  # backward runs the chain in reverse
    for k, name in enumerate(chain.names[1:-1], start=1):
        end = starts[k - 1]
        for u in range(starts[k], end):
            n = g.nodes[sg.units[u].members[0]]
            assert n.phase is Phase.BACKWARD and block_of(n.module) in (name, None)
        assert all(block_of(g.nodes[sg.units[u].members[0]].module) == name
                   for u in chain.recompute_units[k])
    assert len(set(chain.model.tape[1:-1])) == 1 and chain.model.a[1] < chain.model.tape[1]


@st.composite
def random_chains(draw):
    """Blocks of 1-4 forward ops (reading the last value, maybe an earlier one of the block,
    and the block's weight), a head and a loss, then each block's backward in reverse reading
    the incoming gradient and some of its forward values; random sizes, times, workspaces."""
    b = GraphBuilder()
    size = lambda lo=16, hi=256: ((draw(st.integers(lo, hi)),), "float32")  # noqa: E731
    cur = b.add_input("x", *size(), Role.INPUT)
    saved = []
    for k in range(draw(st.integers(2, 5))):
        w = b.add_input(f"w{k}", *size(1, 8), Role.PARAMETER)
        vals = [cur]
        for i in range(draw(st.integers(1, 4))):
            ins = [vals[-1], *draw(st.lists(st.sampled_from(vals), max_size=1)), w]
            vals.append(b.add_node("aten.op.default", list(dict.fromkeys(ins)), [size()],
                                   module=f"blocks.{k}.op{i}")[0])
        saved.append((w, vals))
        cur = vals[-1]
    head = b.add_node("aten.op.default", [cur], [size()], module="head")[0]
    loss = b.add_node("aten.sum.default", [head], [((), "float32")], phase=Phase.LOSS)[0]
    grad = b.add_node("aten.op.default", [loss, head], [size()], phase=Phase.BACKWARD,
                      module="head")[0]
    outputs = {"loss": loss}
    for k in reversed(range(len(saved))):
        w, vals = saved[k]
        for i in range(draw(st.integers(1, 3))):
            ins = [grad, *draw(st.lists(st.sampled_from(vals), min_size=1, max_size=2))]
            outs = b.add_node("aten.op.default", list(dict.fromkeys(ins)),
                              [size(), size(1, 8)] if i == 0 else [size()], phase=Phase.BACKWARD,
                              module=f"blocks.{k}.op{i}" if draw(st.booleans()) else "")
            grad = outs[0]
            if i == 0:
                outputs[f"grad:w{k}"] = outs[1]
    g = b.finish(outputs)
    n = len(g.nodes)
    seconds = draw(st.lists(st.floats(0, 1e-2), min_size=n, max_size=n))
    return g, TableCost(seconds, draw(st.lists(st.integers(0, 256), min_size=n, max_size=n)))


@settings(max_examples=80, deadline=None)
@given(random_chains(), st.floats(0.3, 1.1))
def test_rotor_on_random_chains_fits_or_says_infeasible(case, frac):
    g, cost = case
    eager = solve(Problem(g, cost, latency_limit=1.0), "eager").sim
    budget = int(frac * eager.peak_bytes)
    try:
        s = solve(Problem(g, cost, budget_bytes=budget, time_budget_s=5), "rotor")
    except BudgetInfeasible as e:
        assert e.smallest_peak_bytes > budget and e.solver == "rotor"
        return
    verify_plan(g, s.plan)
    assert s.sim.peak_bytes <= budget
    again = solve(Problem(g, cost, budget_bytes=budget, time_budget_s=5), "rotor")
    assert again.plan == s.plan, "deterministic: same inputs, same plan"


def test_no_chain_means_eager_or_a_clear_infeasible():
    case = zoo.build("gpt2", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    for n in g.nodes:
        n.module = ""
    eager = solve(Problem(g, ROOFLINE, latency_limit=1.0), "eager").sim
    s = solve(Problem(g, ROOFLINE, budget_bytes=eager.peak_bytes), "rotor")
    assert s.notes["stages"] == 1 and s.sim.peak_bytes == eager.peak_bytes
    with pytest.raises(BudgetInfeasible, match="no chain"):
        solve(Problem(g, ROOFLINE, budget_bytes=int(0.9 * eager.peak_bytes)), "rotor")


def test_rotor_reruns_a_block_more_than_once_at_a_low_budget():
    model, batch, loss_fn, g = _blocks_graph(8)
    eager = solve(Problem(g, ROOFLINE, latency_limit=1.0), "eager").sim
    budget = int(0.45 * eager.peak_bytes)
    s = solve(Problem(g, ROOFLINE, budget_bytes=budget), "rotor")
    verify_plan(g, s.plan)
    assert s.sim.peak_bytes <= budget and s.notes["max_reruns_of_a_stage"] >= 2
    rec = [i.node for i in s.plan if isinstance(i, Recompute)]
    assert any(rec.count(x) >= 2 for x in rec), "some node is recomputed twice"
    case = types.SimpleNamespace(batch=batch, loss_fn=loss_fn)
    assert_runs_like_eager(copy.deepcopy(model), model, g, s.plan, case, seed=0)


def test_rotor_latency_mode_keeps_the_limit_and_lowers_the_peak():
    case = zoo.build("vit-b16", "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    eager = solve(Problem(g, ROOFLINE, latency_limit=1.0), "eager").sim
    s = solve(Problem(g, ROOFLINE, latency_limit=1.2, time_budget_s=20), "rotor")
    assert s.sim.latency_s <= 1.2 * eager.latency_s * (1 + 1e-9)
    assert s.sim.peak_bytes < 0.8 * eager.peak_bytes


@pytest.fixture(scope="module", params=["gpt2", "resnet50"])
def profiled(request):
    case = zoo.build(request.param, "small")
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    cm.profile(g)
    return request.param, g, cm


@pytest.mark.parametrize("frac", [0.7, 0.5])
def test_rotor_plan_runs_bitwise_equal_and_measures_as_simulated(profiled, frac):
    name, g, cm = profiled
    case = zoo.build(name, "small")   # NOTE: fresh weights and buffers for each budget
    a, b = case.model, copy.deepcopy(case.model)
    eager = solve(Problem(g, cm, latency_limit=1.0), "eager")
    budget = int(frac * eager.sim.peak_bytes)
    s = solve(Problem(g, cm, budget_bytes=budget), "rotor")
    verify_plan(g, s.plan)
    assert s.notes["recomputes"] > 0 and s.sim.peak_bytes <= budget
    assert_runs_like_eager(a, b, g, s.plan, case, seed=0)
    measured = measure_plan(g, s.plan, b, case.batch, repeats=0)
    assert measured.peak_bytes == s.sim.peak_bytes <= budget
