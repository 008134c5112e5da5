"""Op times in situ: a graph's eager plan run instruction by instruction, each one timed.

An op profiled alone runs again and again on the same inputs: its operands and output stay
in cache and the allocator hands back the block it just freed. Inside a step it reads operands
made a while ago and writes memory other ops touched last. The difference is not the same
for every op, so it does not cancel in a ratio: on a 2-core x86 CPU (one torch thread) a ViT
step split in 8 parts along its batch measured +9% over the whole step, while its ops
profiled alone said +2-4% (its 197-row matmuls ran 4-10% slower in the step than alone, the
1576-row ones 0-3%); eager PyTorch accumulating gradients over 8 micro-batches pays the same
(+6-7%). A plan chosen on the alone-profile then misses its latency limit.

``time_in_situ`` runs ``eager_plan(graph)`` through the executor's own instruction methods on
synthetic inputs (made as the profiler makes them), ``warmup + repeats`` times, and gives
each node the median of its timed runs less the timer's own cost. ``ProfiledCostModel`` keeps
these per node key beside the alone-profile and costs a node by its in-situ time where one was
measured (CPU; on CUDA kernels run asynchronously and a per-op timer would serialise them).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost.in_situ import time_in_situ
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    >>> g = fitgraph.capture(model, torch.randn(32, 64), lambda m, b: m(b).sum())
    >>> seconds = time_in_situ(g, torch.device("cpu"), repeats=3, warmup=1)
    >>> len(seconds) == len(g.nodes) and all(s >= 0 for s in seconds)
    True
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time

import torch

from ..execute.synthetic import SyntheticRunner, no_subnormals
from ..graph.ir import Graph
from ..plan.eager import eager_plan
from .cache import CacheEntry

__all__ = ["cached_over_now", "check_cache", "on_basis", "profile_in_situ", "time_in_situ"]

log = logging.getLogger("fitgraph.cost.profiler")

# NOTE: timed empty calls whose median is the timer's own cost, subtracted from every op
_TIMER_PROBES = 201
# NOTE: below this much op time a step's sum is too short to compare with the cache's
_CHECK_FLOOR_SECONDS = 20e-3
# NOTE: cached in-situ times this many times (or 1/this) what a graph's ops take now: stale.
# In-situ sums of one short step move by up to 1.35x between runs on a quiet machine (ALBERT)
STALE_CACHE = 1.5


def time_in_situ(graph: Graph, device: torch.device, repeats: int, warmup: int,
                 densities: dict[int, float] | None = None,
                 basis: dict[int, float] | None = None) -> list[float | None]:
    """Seconds of each node of ``graph`` (by node id) run in its eager plan, median over
    ``repeats`` runs after ``warmup``; None for a node that fails there (its outputs are then
    made synthetic, so the step goes on; the profiler costs it by its time alone).
    ``densities``: storage -> density of the random bits it holds. ``basis``: node id ->
    seconds already held for it (timed earlier): each run is put on their footing
    (``on_basis``) before the median.

    NOTE: a whole step carried on synthetic inputs computes values no real batch makes: all-zero
    token ids are all padding, and mBART's ``shift_tokens_right`` then gathers at index -1.
    Alone, each op runs on synthetic inputs of its own, which are valid (zero indices)."""
    from ..execute.executor import Executor

    plan = eager_plan(graph)
    ex = Executor(graph, plan, model=None)
    runner = SyntheticRunner(graph, device, densities)
    runs: list[list[float]] = []
    steps = list(zip(ex.steps, plan))
    clock = time.perf_counter
    failed: dict[int, str] = {}
    # NOTE: synthetic inputs carried through a whole step make subnormal floats (see
    # ``no_subnormals``): the ops' times on a real batch are those with them flushed
    with torch.no_grad(), no_subnormals():
        for run in range(warmup + repeats):
            ex.env = runner.values(graph.inputs)
            timed = run >= warmup
            per = [0.0] * len(graph.nodes)
            for step, ins in steps:
                t0 = clock()
                try:
                    step(ex, ins)
                except Exception as e:
                    if ins.op != "compute":
                        raise
                    failed.setdefault(ins.node, f"{type(e).__name__}: {e}")
                    _make_outputs(ex.env, runner, graph.nodes[ins.node])
                    continue
                if ins.op == "compute":
                    per[ins.node] = clock() - t0
            if timed:
                runs.append(per)
            ex.env = []
    for nid, why in failed.items():
        log.info("node %s (%s) fails in its step on synthetic inputs (%s): costed by its time "
                 "alone", graph.nodes[nid].name, graph.nodes[nid].target, why)
    overhead = _timer_seconds()
    runs = [[max(t - overhead, 0.0) for t in run] for run in runs]
    if basis:
        runs = on_basis(runs, {nid: t for nid, t in basis.items() if nid not in failed})
    return [None if nid in failed else statistics.median(ts)
            for nid, ts in enumerate(zip(*runs))]


def _make_outputs(env: list, runner: SyntheticRunner, node) -> None:
    """``node``'s outputs in ``env`` made synthetic, in place of what it failed to compute."""
    vids = [v for v in node.outputs if v is not None]
    fresh = runner.values(vids)
    for vid in vids:
        env[vid] = fresh[vid]


def on_basis(runs: list[list[float]], basis: dict[int, float]) -> list[list[float]]:
    """Each run's times (``runs[r][node id]``) scaled so that the nodes of ``basis`` (node id
    -> seconds timed earlier) sum to what they summed then; runs unchanged where those nodes
    took under 20 ms (too short a yardstick).

    NOTE: this machine's speed drifts by up to a third within minutes (a shared VM: Llama's
    step timed in situ three times in a row summed 1.12, 1.10 and 0.86 s), and a cost model
    gathers its times graph by graph as the planner makes them. A split graph timed in a slow
    minute then costs more than the captured graph it came from, timed in a quick one, and
    the planner picks between them on the machine's mood: Llama at 0.4 of its peak simulated
    its 4-part plan 1.09 s, measured 0.86 s (the unsplit plans: 0.75 s simulated, 0.87 s
    measured). The nodes a new graph shares with those already timed (the optimizer's
    updates, the layers outside a split region) are a yardstick timed in the same run as the
    new nodes, and each run is scaled by it: every time the model holds is then on one
    footing, the first one's.

    Example:
        >>> on_basis([[0.25, 0.5, 1.0], [0.5, 1.0, 2.0]], {0: 0.25, 1: 0.5})  # twice slower
        [[0.25, 0.5, 1.0], [0.25, 0.5, 1.0]]
        >>> on_basis([[0.001, 0.5]], {0: 0.002})   # a yardstick under 20 ms: kept as timed
        [[0.001, 0.5]]
    """
    held = sum(basis.values())
    if held < _CHECK_FLOOR_SECONDS:
        return runs
    out = []
    for run in runs:
        now = sum(run[nid] for nid in basis)
        out.append([t * held / now for t in run] if now > 0 else run)
    return out


def _timer_seconds() -> float:
    """The median time the timing loop itself adds to an instruction (an empty call)."""
    clock = time.perf_counter

    def nothing(_ex, _ins) -> None:
        return None

    ts = []
    for _ in range(_TIMER_PROBES):
        t0 = clock()
        nothing(None, None)
        ts.append(clock() - t0)
    return statistics.median(ts)


def _situ_key(key: str) -> str:
    return hashlib.sha256(f"in-situ|{key}".encode()).hexdigest()


def cached_over_now(cm, graph: Graph, repeats: int = 3, warmup: int = 2) -> float | None:
    """How many times the cache's in-situ times of ``graph``'s ops are what they take now.

    Sums the cached time of every node whose key ``cm``'s cache holds and divides it by the
    same nodes' times in the step timed now (``time_in_situ``, ``repeats`` runs). None where
    the cache holds none of them, or under 20 ms of them in all (too short to compare). A
    cache filled while other work shared the machine reads well above 1.
    """
    keys = {node.id: cm.key(graph, node) for node in graph.nodes}
    got = cm.cache.get_many({_situ_key(k) for k in keys.values()})

    def cached(nids: list[int]) -> float:
        return sum(got[_situ_key(keys[nid])].seconds for nid in nids)

    nids = [nid for nid, k in keys.items() if _situ_key(k) in got]
    if cached(nids) < _CHECK_FLOOR_SECONDS:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # NOTE: the inputs the cached times were taken on
        now = time_in_situ(graph, cm.device, repeats, warmup, cm._graph_facts(graph)[1])
    nids = [nid for nid in nids if now[nid] is not None]   # NOTE: failed in the step
    if cached(nids) < _CHECK_FLOOR_SECONDS:
        return None
    return cached(nids) / max(sum(now[nid] for nid in nids), 1e-9)


def check_cache(cm, graph: Graph) -> None:
    """``cached_over_now`` for ``ProfiledCostModel`` ``cm`` (CPU, in situ, not refreshing):
    where the cache reads over ``STALE_CACHE`` times (or under 1/that) what ``graph``'s ops
    take now, warn, keep the ratio in ``cm.stale_cache_ratio`` and turn ``cm.refresh`` on, so
    that every op is measured again and the cache overwritten."""
    if cm.refresh or not cm.in_situ:
        return
    ratio = cached_over_now(cm, graph)
    if ratio is None or 1 / STALE_CACHE <= ratio <= STALE_CACHE:
        return
    cm.stale_cache_ratio = ratio
    log.warning("the cost cache (%s) holds times for this graph's ops %.2fx what they take "
                "now (measured while the machine was %s); measuring every op again and "
                "overwriting the cache", cm.cache, ratio, "busier" if ratio > 1 else "quieter")
    cm.refresh = True  # NOTE: nothing of this graph was read from the cache yet


def profile_in_situ(cm, graph: Graph) -> None:
    """Give ``ProfiledCostModel`` ``cm`` the in-situ time of every node key of ``graph``: from
    its cache, else by timing the graph's step (``time_in_situ``, under a forked RNG); keys
    with a time already keep it (a layer shared by two graphs is timed once)."""
    keys: dict[str, list[int]] = {}
    for node in graph.nodes:
        keys.setdefault(cm.key(graph, node), []).append(node.id)
    situ_key = {k: _situ_key(k) for k in keys}
    missing = [k for k in keys if k not in cm._situ]
    if missing and not cm.refresh:
        got = cm.cache.get_many([situ_key[k] for k in missing])
        for k in missing:
            if situ_key[k] in got:
                cm._situ[k] = got[situ_key[k]].seconds
        missing = [k for k in missing if k not in cm._situ]
    if not missing:
        return
    # NOTE: the nodes whose keys already have a time: the new ones are put on their footing
    basis = {nid: cm._situ[k] for k, nids in keys.items() if k in cm._situ for nid in nids}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # NOTE: synthetic inputs are the same in every process
        seconds = time_in_situ(graph, cm.device, cm.repeats, cm.warmup,
                               cm._graph_facts(graph)[1], basis=basis)
    for k in missing:
        timed = [seconds[nid] for nid in keys[k] if seconds[nid] is not None]
        if not timed:
            continue  # NOTE: failed in its step (``time_in_situ``): costed alone
        # NOTE: one key, many nodes (a deep stack's layers): the median of their times
        cm._situ[k] = statistics.median(timed)
        cm.cache.put(situ_key[k], CacheEntry(cm._situ[k], 0, 0), device=cm.hardware,
                     torch_version=torch.__version__, target="in situ")
