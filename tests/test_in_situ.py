"""Op times in situ (``cost/in_situ.py``): each node timed inside its graph's eager step, and
``ProfiledCostModel`` costing nodes by those times (cached per key, like the alone-profile)."""

from __future__ import annotations

import pytest
import torch

import fitgraph
import fitgraph.cost.in_situ as in_situ
from fitgraph.cost import ProfiledCostModel
from fitgraph.cost.in_situ import time_in_situ
from fitgraph.execute.executor import Executor
from fitgraph.plan.eager import eager_plan
from fitgraph.sim import simulate


def _graph(rows=16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    batch = (torch.randn(rows, 32), torch.randint(0, 10, (rows,)))
    return fitgraph.capture(model, batch, lambda m, b: torch.nn.functional.cross_entropy(
        m(b[0]), b[1]), torch.optim.Adam(model.parameters()))


def _fake_times(graph, device, repeats, warmup, densities=None, basis=None):
    return [1e-3 * (n.id + 1) for n in graph.nodes]


def _refuse(*args, **kwargs):
    raise AssertionError("in-situ timing ran again")


def test_nodes_cost_their_in_situ_time_median_per_key(tmp_path, monkeypatch):
    monkeypatch.setattr(in_situ, "time_in_situ", _fake_times)
    g = _graph()
    cm = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False)
    cm.profile(g)
    by_key: dict[str, list[float]] = {}
    for n in g.nodes:
        by_key.setdefault(cm.key(g, n), []).append(1e-3 * (n.id + 1))
    shared = [k for k, v in by_key.items() if len(v) > 1]
    assert shared  # NOTE: the two same-shape ReLUs, the detaches, Adam's updates...
    for n in g.nodes:
        times = sorted(by_key[cm.key(g, n)])
        mid = len(times) // 2
        want = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        assert cm.node_cost(g, n).seconds == pytest.approx(want), n.name
    # NOTE: the simulator charges each node its in-situ time, nothing else
    sim = simulate(g, eager_plan(g), cm)
    assert sim.latency_s == pytest.approx(sum(cm.node_cost(g, n).seconds for n in g.nodes))


def test_in_situ_times_are_cached_across_instances(tmp_path, monkeypatch):
    g = _graph()
    cm = ProfiledCostModel(cache=tmp_path, repeats=2, warmup=1, progress=False)
    cm.profile(g)
    monkeypatch.setattr(in_situ, "time_in_situ", _refuse)
    again = ProfiledCostModel(cache=tmp_path, repeats=2, warmup=1, progress=False)
    assert again.profile(g) == 0
    assert [again.node_cost(g, n) for n in g.nodes] == [cm.node_cost(g, n) for n in g.nodes]
    fresh = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False, refresh=True)
    with pytest.raises(AssertionError, match="ran again"):
        fresh.profile(g)                     # NOTE: refresh times the step again


def test_in_situ_off_costs_ops_timed_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(in_situ, "time_in_situ", _refuse)
    g = _graph()
    cm = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False, in_situ=False)
    cm.profile(g)
    assert [cm.node_cost(g, n).seconds for n in g.nodes] == [
        cm.measurement(g, n).seconds for n in g.nodes]


def test_time_in_situ_times_the_work_and_keeps_the_callers_rng(tmp_path):
    g = _graph()
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    cm = ProfiledCostModel(cache=tmp_path, repeats=2, warmup=1, progress=False)
    cm.profile(g)
    assert torch.equal(torch.rand(3), want)
    seconds = time_in_situ(g, torch.device("cpu"), repeats=2, warmup=1)
    assert len(seconds) == len(g.nodes) and min(seconds) >= 0
    matmuls = [seconds[n.id] for n in g.nodes if n.target in ("aten.addmm.default",
                                                               "aten.mm.default")]
    assert matmuls and min(matmuls) > 0


def test_a_node_failing_in_its_step_is_costed_alone_and_the_step_goes_on(monkeypatch,
                                                                          tmp_path):
    """Values a whole step computes from synthetic inputs may be ones no batch makes (all-pad
    token ids gathered at index -1): the op is costed by its time alone, the rest in situ."""
    g = _graph()
    bad = next(n for n in g.nodes if n.target == "aten._log_softmax.default")
    run = Executor.run_compute

    def failing(self, ins):
        if ins.node == bad.id:
            raise RuntimeError("boom")
        run(self, ins)

    monkeypatch.setattr(Executor, "run_compute", failing)
    seconds = time_in_situ(g, torch.device("cpu"), repeats=1, warmup=0)
    assert seconds[bad.id] is None
    assert all(t is not None for nid, t in enumerate(seconds) if nid != bad.id)
    cm = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False)
    cm.prepare(g)
    key = cm.key(g, bad)
    assert key not in cm._situ and cm.node_cost(g, bad).seconds == cm._entry(key, bad).seconds


def test_a_step_whose_synthetic_token_ids_are_all_padding_is_profiled():
    """mBART's ``shift_tokens_right``: the last non-pad token, gathered at (count - 1); with
    every synthetic id 0 (the pad id) the count is 0."""
    class Shift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)

        def forward(self, ids):
            last = (ids.ne(0).sum(dim=1) - 1).unsqueeze(-1)
            start = ids.gather(1, last)
            return self.emb(torch.cat([start, ids[:, :-1]], dim=1)).sum()

    model = Shift()
    ids = torch.randint(1, 50, (4, 12))
    step = fitgraph.optimize(model, ids, lambda m, b: m(b), torch.optim.SGD(model.parameters()),
                             budget=0.9, time_budget=3)
    assert torch.isfinite(step(ids))


def _scaled_times(factor):
    def times(graph, device, repeats, warmup, densities=None, basis=None):
        return [factor * t for t in _fake_times(graph, device, repeats, warmup)]
    return times


@pytest.mark.parametrize("now_factor", [0.25, 4.0])
def test_a_stale_cache_is_measured_again_with_a_warning(tmp_path, monkeypatch, caplog,
                                                        now_factor):
    g = _graph()
    monkeypatch.setattr(in_situ, "time_in_situ", _fake_times)
    ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False).profile(g)
    # NOTE: the machine was busier (or quieter) when the cache was filled than it is now
    monkeypatch.setattr(in_situ, "time_in_situ", _scaled_times(now_factor))
    cm = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False)
    with caplog.at_level("WARNING", logger="fitgraph.cost.profiler"):
        measured = cm.profile(g)
    # NOTE: the cache holds a median per key (layers alike share one), hence not exactly
    assert cm.stale_cache_ratio == pytest.approx(1 / now_factor, rel=0.05)
    assert cm.refresh and measured == len({cm.key(g, n) for n in g.nodes})
    assert ("busier" if now_factor < 1 else "quieter") in caplog.text
    n = g.nodes[-1]
    assert cm.node_cost(g, n).seconds == pytest.approx(now_factor * 1e-3 * (n.id + 1), rel=0.5)
    # NOTE: the cache now holds the new times: the next instance finds it fresh
    again = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False)
    assert again.profile(g) == 0 and again.stale_cache_ratio is None and not again.refresh


def test_a_cache_within_its_noise_is_kept(tmp_path, monkeypatch):
    g = _graph()
    monkeypatch.setattr(in_situ, "time_in_situ", _fake_times)
    ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False).profile(g)
    monkeypatch.setattr(in_situ, "time_in_situ", _scaled_times(1.2))
    cm = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False)
    assert cm.profile(g) == 0 and cm.stale_cache_ratio is None and not cm.refresh
    n = g.nodes[-1]
    assert cm.node_cost(g, n).seconds == pytest.approx(
        1e-3 * (n.id + 1), rel=0.5)  # NOTE: the cached time (a median over its key's nodes)


def test_ops_are_timed_with_subnormal_floats_flushed_and_the_mode_is_put_back(monkeypatch):
    # NOTE: synthetic inputs carried through a step make subnormal floats a real batch does
    # not; x86 computes them many times slower (Gemma-2's eager plan: 150 ms against 73)
    from fitgraph.cost import in_situ
    from fitgraph.execute import synthetic

    seen = []

    class Spy(synthetic.SyntheticRunner):
        def values(self, vids):
            seen.append(synthetic._flushing())
            return super().values(vids)

    monkeypatch.setattr(in_situ, "SyntheticRunner", Spy)
    g = fitgraph.capture(torch.nn.Linear(8, 8), torch.randn(4, 8), lambda m, b: m(b).sum())
    in_situ.time_in_situ(g, torch.device("cpu"), repeats=2, warmup=1)
    assert seen == [True] * 3
    assert not synthetic._flushing()


def test_a_new_graphs_nodes_are_timed_against_those_already_held(tmp_path, monkeypatch):
    """The nodes of a second graph whose keys the model holds (the optimizer's updates: the
    same parameters) are the yardstick its new nodes are timed against."""
    first, second = _graph(16), _graph(8)
    cm = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False)
    monkeypatch.setattr(in_situ, "time_in_situ", _fake_times)
    cm.profile(first)
    seen = []

    def times(graph, device, repeats, warmup, densities=None, basis=None):
        seen.append(basis)
        return _fake_times(graph, device, repeats, warmup)

    monkeypatch.setattr(in_situ, "time_in_situ", times)
    cm.profile(second)
    held = {cm.key(first, n) for n in first.nodes}
    want = {n.id for n in second.nodes if cm.key(second, n) in held}
    assert want and len(want) < len(second.nodes)
    # NOTE: each at the time held for its key (node_cost reads the key's time)
    assert seen[0] == {nid: cm.node_cost(second, second.nodes[nid]).seconds for nid in want}


class _Clock:
    """``time`` as ``in_situ`` reads it, on a machine ``factor`` times slower."""

    def __init__(self, factor):
        import time
        self.factor, self._time = factor, time

    def perf_counter(self):
        return self.factor * self._time.perf_counter()


def test_a_run_timed_while_the_machine_is_slower_is_put_on_the_basis_footing(monkeypatch):
    g = _graph()
    cpu = torch.device("cpu")
    # NOTE: the clock magnified (a thousandfold) so that the tiny step's yardstick is long
    monkeypatch.setattr(in_situ, "time", _Clock(1000.0))
    before = time_in_situ(g, cpu, repeats=5, warmup=2)
    updates = {n.id for n in g.nodes if n.target.startswith("fitgraph.optimizer")}
    basis = {nid: before[nid] for nid in updates}
    assert sum(basis.values()) > 0.02
    monkeypatch.setattr(in_situ, "time", _Clock(3000.0))   # NOTE: three times slower now
    slower = time_in_situ(g, cpu, repeats=5, warmup=2)
    footed = time_in_situ(g, cpu, repeats=5, warmup=2, basis=basis)
    rest = [n.id for n in g.nodes if n.id not in updates]
    total = {k: sum(ts[nid] for nid in rest)
             for k, ts in (("before", before), ("slower", slower), ("footed", footed))}
    assert total["slower"] / total["before"] > 2.0
    assert 0.5 < total["footed"] / total["before"] < 1.6
