"""Fission's first round as alternatives: the single splits of a graph that ``fission`` weighs
before it commits to one, the best of each region, for a search to plan each one by itself.

``fission`` is greedy: it takes the split its estimates rank first and goes on from there, and
near-equal estimates on measured costs rank differently from one process to the next (Llama
small within 1.05x of its step: 701 nodes grown from the loss, in 4 parts, 0.38 of eager's
peak, in one run; the loss's 12 nodes in 4 parts, 0.59, in the next). ``first_splits`` returns the
runners-up of that first round — each region's best part count (regions that share nearly
all their nodes counted once: ``ALIKE``), estimated as fission estimates
(``ScaledCostModel`` over a measured cost model: nothing is profiled), within the latency limit
(without fission's estimate slack) or, in budget mode, lowering the peak — ranked by fission's own
key (latency mode: the least peak; budget mode: within the budget the least time, over it the
most bytes saved per second added). The coordinated search plans each split graph with
``auto``, which may split its parts further and puts remat on top.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers import Problem
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(),
    ...                             torch.nn.Linear(256, 4096))
    >>> batch = (torch.randn(512, 16), torch.randint(0, 4096, (512,)))
    >>> loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    >>> g = fitgraph.capture(model, batch, loss_fn)
    >>> cm = RooflineCostModel(get_device("rtx3090"))
    >>> found = first_splits(Problem(g, cm, latency_limit=2.0), deadline=float("inf"))
    >>> [what for what, _ in found][:2]
    ['11 nodes from _log_softmax dim 0 in 4 parts', '21 nodes from _log_softmax dim 0 in 2 parts']
"""

from __future__ import annotations

from ...cost.scaled import ScaledCostModel
from ...graph.analysis import verify_graph
from ...graph.ir import Graph
from ...plan.instructions import Plan
from ...sim.simulate import SimResult
from ...transform.fission import FissionError, split_region
from ...transform.fission_loss import counting_nodes
from ...transform.registry import FISSION_SEARCH_READS, fission_reads
from ..base import Problem
from .peak_regions import candidate_regions, peak_starts
from .search import FissionConfig, _best_split, _simulate, _Step, described
from .walk import rate

__all__ = ["first_splits", "splits_at"]


def first_splits(problem: Problem, *, deadline: float, n: int = 3,
                 skip: tuple[str, ...] = (), config: FissionConfig | None = None
                 ) -> list[tuple[str, Graph]]:
    """Up to ``n`` single splits of ``problem.graph`` from different regions, best first (see
    the module doc), as (what, split graph); those described in ``skip`` (a plan's own
    splits) left out. Stops weighing splits at ``deadline`` (planning clock)."""
    config = config or FissionConfig()
    cm, budget = problem.cost_model, problem.budget_bytes
    eager = _simulate(problem.graph, cm)
    search = ScaledCostModel(cm, problem.graph) if cm.measures else cm
    graph = fission_reads(problem.graph, FISSION_SEARCH_READS)
    start = _Step(graph, eager if graph is problem.graph else _simulate(graph, search), "")
    limit = float("inf")
    if problem.latency_limit is not None:
        # NOTE: without fission's estimate slack (which fission's own measured check backs):
        # a search plans each split graph once, and one whose measured eager step is over
        # the limit plans nothing (Llama small within 1.05x, with the slack: its three
        # splits, estimated within 1.155x, all measured over the limit)
        limit = problem.latency_limit * eager.latency_s
    strategy = "least peak" if budget is None else "cheapest"
    _, _, seen = _best_split(start, search, budget, limit, config, deadline, strategy,
                             config.max_splits, {})

    def key(sim: SimResult) -> tuple:
        if budget is None:
            return (sim.peak_bytes, sim.latency_s)
        if sim.peak_bytes <= budget:
            return (0, sim.latency_s, sim.peak_bytes)
        return (1, -rate(sim, start.sim), sim.peak_bytes)

    best: dict[tuple, _Step] = {}
    for step in seen:
        if step.what in skip:
            continue
        region = (step.region.start, step.region.nodes)
        if region not in best or key(step.sim) < key(best[region].sim):
            best[region] = step
    ranked: list[_Step] = []
    for step in sorted(best.values(), key=lambda s: key(s.sim)):
        if len(ranked) < n and not any(_alike(step, other) for other in ranked):
            ranked.append(step)
    for s in ranked:
        verify_graph(s.graph)  # NOTE: the search splits without verifying (_split)
    return [(s.what, s.graph) for s in ranked]


# NOTE: regions sharing this much of their nodes (of their union) are one alternative: trims of
# one region that differ by a view or two (ViT's MLP in 8 parts: 445, 447 and 468 nodes) plan
# alike; the loss alone and 701 nodes grown from it (Llama small: 12 and 701 nodes) do not
ALIKE = 0.9


def _alike(a: _Step, b: _Step) -> bool:
    na, nb = set(a.region.nodes), set(b.region.nodes)
    return len(na & nb) >= ALIKE * len(na | nb)


def splits_at(graph: Graph, plan: Plan, sim: SimResult, *, n: int = 3,
              config: FissionConfig | None = None) -> list[tuple[str, Graph]]:
    """Up to ``n`` single splits, in 2 parts, of the regions live at ``plan``'s peak on
    ``graph`` (``sim``: its simulation) — not the eager plan's, where the first round grows
    its regions — those holding the peak's own node first: where a budget is below every
    plan's peak, the least-peak plan's peak is what a split must cut, and its node's
    transients (a convolution backward's workspace and gradients) are what parts shrink. As
    (what, split graph), verified; unranked otherwise (no estimate: the caller plans each).

    NOTE: ResNet-50 small at 0.4 of its peak: DTR's least-peak plan peaks in layer2.0's
    backward (its input, both convolutions' input gradients, a convolution backward's
    workspace), 55.4 MiB for 54.4 asked; the downsample convolution's backward in 2 parts
    along its batch, planned by DTR, 53.5 MiB. The eager plan's peak is the forward's end:
    the first round never grows that region."""
    config = config or FissionConfig()
    starts = peak_starts(graph, plan, sim, config.max_storages, peak_inputs=True)
    regions = candidate_regions(graph, starts, config.shares, counting_nodes(graph))
    node = getattr(plan[sim.peak_instruction], "node", None) if sim.peak_instruction >= 0 \
        else None
    regions.sort(key=lambda r: node not in r.nodes)   # NOTE: stable: the peak's node first
    out: list[tuple[str, Graph]] = []
    for region in regions:
        if len(out) >= n:
            break
        try:
            split = split_region(graph, region, 2)
        except FissionError:
            continue
        out.append((described(graph, region, 2), split))
    return out
