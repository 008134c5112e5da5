"""``ScaledCostModel``: split graphs costed from the original graph's costs, nothing profiled.

- on zoo models, a split graph costed by the wrapper (built on the roofline's costs of the
  original graph) agrees with the roofline itself: the same peak, latency within ``TOLERANCE``;
  nodes copied unchanged cost exactly the original's;
- the fission search with a measured cost model profiles the original graph and the one split
  graph it picks, nothing else (the slow path, ``scaled_costs=False``, profiles every
  candidate); the plan it returns is simulated on measured costs; deterministic.
"""

from __future__ import annotations

import pytest
import torch
from helpers import classifier_mlp

import fitgraph
from fitgraph import zoo
from fitgraph.api import graph_fingerprint
from fitgraph.cost import ProfiledCostModel, RooflineCostModel, get_device
from fitgraph.cost.scaled import ScaledCostModel, original_name
from fitgraph.graph.dim_region import grow_region
from fitgraph.plan.eager import eager_plan
from fitgraph.sim import simulate
from fitgraph.solvers import Problem, solve
from fitgraph.solvers.fission.peak_regions import trimmed
from fitgraph.solvers.fission.search import FissionConfig, solve_fission
from fitgraph.transform.fission import split_region
from fitgraph.transform.fission_loss import count_targets_apart, counting_nodes

# NOTE: the wrapper calibrates a roofline on the original graph (launch floor = its cheapest
# kernel, not the device's exact overhead; bytes per second = its median rate); worst case seen
# on these splits: 1.8%
TOLERANCE = 0.03


def _first_output(graph, target: str, index: int = 0) -> int:
    return [n for n in graph.nodes if n.target == target][index].outputs[0]


def _loss_region(g):
    return grow_region(g, _first_output(g, "aten._log_softmax.default"), 0,
                       exclude=counting_nodes(g))


def _llama_sequence(g):
    return trimmed(g, grow_region(g, _first_output(g, "aten.silu.default", 1), 1), 1 / 4)


@pytest.mark.parametrize("name,pick", [("gpt2", _loss_region), ("llama", _loss_region),
                                       ("llama", _llama_sequence)])
@pytest.mark.parametrize("device", ["rtx3090", "cpu-generic"])
def test_split_graph_costs_agree_with_the_roofline(name, pick, device):
    case = zoo.build(name, "small", batch_size=1, seq_len=64)
    original = fitgraph.capture(case.model, case.batch, case.loss_fn)
    g = count_targets_apart(original)
    roof = RooflineCostModel(get_device(device))
    scaled = ScaledCostModel(roof, original)
    region = pick(g)
    for k in (2, 4, 8):
        split = split_region(g, region, k)
        want = simulate(split, eager_plan(split), roof)
        got = simulate(split, eager_plan(split), scaled)
        assert got.peak_bytes == want.peak_bytes  # NOTE: the roofline has no workspaces
        # NOTE: the eager plan's latency is the sum of its nodes'; the roofline charges
        # ``new_ones(like, size)`` a read of ``like`` (an embedding!) that the op never does
        real = [n for n in split.nodes if not n.target.startswith("aten.new_")]
        assert sum(scaled.node_cost(split, n).seconds for n in real) == pytest.approx(
            sum(roof.node_cost(split, n).seconds for n in real), rel=TOLERANCE), k
        assert got.latency_s <= want.latency_s
    by_name = {n.name: n for n in original.nodes}
    copied = [n for n in split.nodes if n.name in by_name and n.target == by_name[n.name].target
              and n.bytes_moved == by_name[n.name].bytes_moved]
    assert len(copied) >= len(original.nodes) - len(region.nodes) - 8  # NOTE: all but the loss count
    for n in copied:  # NOTE: untouched nodes cost exactly what the base model says
        assert scaled.node_cost(split, n) == roof.node_cost(original, by_name[n.name])


def test_original_name_strips_part_suffixes():
    assert original_name("mm_3.part1.part0") == "mm_3"
    assert original_name("mm_3.acc1") == "mm_3.acc1"
    assert original_name("x.partial") == "x.partial"


class CountingProfiler(ProfiledCostModel):
    """A measured cost model that records every graph it is asked to profile."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.graphs = []

    def profile(self, graph):
        self.graphs.append(graph)
        return super().profile(graph)


def _loss_heavy_mlp():
    return classifier_mlp(32, 128, 2048, 256, torch.nn.GELU)


def test_fission_search_profiles_only_the_graph_it_picks(tmp_path):
    model, batch, loss_fn = _loss_heavy_mlp()
    g = fitgraph.capture(model, batch, loss_fn)
    cm = CountingProfiler(cache=tmp_path, repeats=1, warmup=0, progress=False)
    cm.profile(g)
    budget = int(0.6 * solve(Problem(g, cm, latency_limit=1.0), "eager").sim.peak_bytes)
    cm.graphs.clear()
    s = solve_fission(Problem(g, cm, budget_bytes=budget))
    assert s.graph is not None and s.notes["splits"] and s.notes["graphs_profiled"] == 1
    assert all(x is g or x is s.graph for x in cm.graphs), len(cm.graphs)
    assert s.sim.peak_bytes <= budget
    assert simulate(s.graph, s.plan, cm) == s.sim  # NOTE: the returned plan: measured costs
    again = solve_fission(Problem(g, cm, budget_bytes=budget))
    assert again.plan.instructions == s.plan.instructions  # deterministic
    assert graph_fingerprint(again.graph) == graph_fingerprint(s.graph)
    cm.graphs.clear()
    slow = solve_fission(Problem(g, cm, budget_bytes=budget),
                         config=FissionConfig(scaled_costs=False))
    assert len({id(x) for x in cm.graphs}) > 2  # the slow path profiles every candidate
    assert slow.sim.peak_bytes <= budget
