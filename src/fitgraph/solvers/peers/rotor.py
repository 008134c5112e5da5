"""``rotor``: Rotor's optimal checkpointing of a chain of blocks (Beaumont et al., 2019; what
Rockmate builds on) — a classic peer, own code from the paper.

The graph is cut into a chain: what runs before the first repeated block (``blocks.block_of``:
``h.3``, ``encoder.layer.11``, ``layer2.1``; top-level modules when a model has no repeated
blocks), one stage per block, and the rest (head, loss: forward and backward adjacent, always
with tape). Each backward unit belongs to the block whose forward it differentiates (its module
path; units outside any block to the next block's backward). Per stage the stage graph
(``solvers.remat.stages``) gives the chain model of ``rotor_chain``: forward and backward times,
``a_k`` (what the next stage or its backward reads), ``ā_k`` (``a_k`` and what its own backward
reads), what cannot be recomputed (random ops run once, values read far down the chain:
attention masks, U-Net skips — kept from the first forward until the backward that frees them),
the gradients handed down, and the transient peaks of each forward and backward. Rotor's dynamic
program picks the operation sequence; every forward it re-runs between ``B_{k+1}`` and ``B_k``
recomputes that block's units right before ``B_k``'s first unit (a staged schedule, turned into
a Plan by ``plan.staged``, whose frees are last-use based: what Rotor drops is freed there).

The DP is solved once, for every memory up to one where nothing is recomputed (``SLOTS``
slots); its distinct sequences are those at the memories where its best time drops. The
simulator is the judge (the chain model over-counts: kept values are held from the start,
inputs until their block's backward): a bisection over those memories finds where the plans
stop fitting the budget, a short scan past it catches later ones that fit again, and the
fastest plan that fits wins. With a ``latency_limit`` the same search finds the least peak
within the limit. A graph with no chain (fewer than two stages) gets eager's plan, and
BudgetInfeasible below eager's peak.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers import Problem, solve
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> batch = torch.randn(256, 64)
    >>> g = fitgraph.capture(model, batch, lambda m, b: m(b).square().mean())
    >>> cm = RooflineCostModel(get_device("rtx3090"))
    >>> eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
    >>> s = solve(Problem(g, cm, budget_bytes=int(0.7 * eager.peak_bytes)), "rotor")
    >>> s.sim.peak_bytes <= 0.7 * eager.peak_bytes, s.notes["stages"], s.notes["recomputes"] > 0
    (True, 9, True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ...graph.ir import Graph, Phase
from ...plan.instructions import Plan
from ...plan.staged import staged_plan
from ...sim.simulate import SimResult, simulate
from ..base import BudgetInfeasible, Problem, Solution, dominated_by, register
from ..remat.blocks import block_of
from ..remat.stages import StageGraph, stage_graph
from .rotor_chain import ChainModel, Op, RotorSchedule, RotorTable, replay

__all__ = ["RotorChain", "chain_stages", "rotor_chain", "rotor_recompute", "solve_rotor",
           "value_readers"]

SLOTS = 1000       # NOTE: one DP table for every memory up to what recomputes nothing
SCAN = 4           # plans tried past the boundary a bisection finds (fits are not monotone)
_FWD = (Phase.FORWARD, Phase.LOSS)


@dataclass(frozen=True)
class RotorChain:
    """The chain a graph is cut into: ``model`` (Rotor's numbers), per stage its name, the
    units one forward of it re-runs and the first unit of its backward (None: no backward)."""

    model: ChainModel
    names: tuple[str, ...]
    recompute_units: tuple[tuple[int, ...], ...]
    backward_start: tuple[int | None, ...]
    baseline: int              # bytes live through the whole step: resident, forward outputs


def rotor_chain(graph: Graph, sg: StageGraph) -> RotorChain | None:
    """Cut ``graph`` into Rotor's chain, or None when fewer than two stages are found."""
    fstage, bstage, names = _stages(graph, sg)
    n = len(names)
    if n < 2 or not bstage:
        return None
    units = sg.units
    readers = _readers(sg, fstage, bstage)
    # NOTE: a unit whose value is read beyond its stage and the next (a mask, a skip, the
    # optimizer) is not re-run: its values stay from the first forward, outside the chain
    pinned = {u for u, k in fstage.items() if not units[u].recomputable or any(
        side == "O" or s not in (k, k + 1) for v in units[u].values for side, s in readers[v])}
    a, tape, fixed, delta, grads = ([0] * n for _ in range(5))
    keep_a: list[set[int]] = [set() for _ in range(n)]
    keep_tape: list[set[int]] = [set() for _ in range(n)]
    baseline = sg.resident_bytes
    for u, k in fstage.items():
        baseline += units[u].kept_bytes
        for v in units[u].values:
            nbytes, rd = sg.value_bytes[v], readers[v]
            if u in pinned:  # NOTE: held from the first forward to the last backward reading it
                if rd:
                    fixed[0 if ("O", -1) in rd else min(
                        [k] + [s for side, s in rd if side == "B"])] += nbytes
                continue
            if any(s == k + 1 for _, s in rd):
                keep_a[k].add(v)
                a[k] += nbytes
            if v in keep_a[k] or ("B", k) in rd:
                keep_tape[k].add(v)
                tape[k] += nbytes
    keep_b: list[set[int]] = [set() for _ in range(n)]
    for u, k in bstage.items():
        grads[k] += units[u].kept_bytes
        for v in units[u].values:
            rd = readers[v]
            lows = [s for side, s in rd if side == "B" and s < k]
            if any(side == "O" for side, _ in rd):
                grads[k] += sg.value_bytes[v]
                keep_b[k].add(v)
            if lows:
                keep_b[k].add(v)
                for i in range(min(lows), k):
                    delta[i] += sg.value_bytes[v]
    fwd = [[u for u in sorted(fstage) if fstage[u] == k] for k in range(n)]
    bwd = [[u for u in sorted(bstage) if bstage[u] == k] for k in range(n)]
    rec = [tuple(u for u in fwd[k] if u not in pinned) for k in range(n)]
    model = ChainModel(
        uf=tuple(sum(units[u].seconds for u in r) for r in rec),
        ub=tuple(sum(units[u].seconds for u in b) for b in bwd),
        a=tuple(a), tape=tuple(tape), fixed=tuple(fixed), delta=tuple(delta),
        grads=tuple(grads),
        f_ck=tuple(_walk_peak(sg, rec[k], keep_a[k], recompute=True) for k in range(n)),
        f_all=tuple(_walk_peak(sg, rec[k], keep_tape[k], recompute=True) for k in range(n)),
        b_peak=tuple(_walk_peak(sg, bwd[k], keep_b[k], recompute=False) for k in range(n)))
    return RotorChain(model, tuple(names), tuple(rec),
                      tuple(b[0] if b else None for b in bwd), baseline)


def rotor_recompute(chain: RotorChain, schedule: RotorSchedule, n_units: int) -> list[list[int]]:
    """The staged schedule of a Rotor sequence: the forwards re-run after the first backward
    go, in order, before the first unit of the next backward that has units."""
    out: list[list[int]] = [[] for _ in range(n_units)]
    pending: list[int] = []
    started = False
    for op in schedule.ops:
        if op.kind == "F" and started:
            pending.extend(chain.recompute_units[op.stage])
        elif op.kind == "B":
            started = True
            at = chain.backward_start[op.stage]
            if at is not None and pending:
                out[at].extend(pending)
                pending = []
    return out


def _stages(graph: Graph, sg: StageGraph):
    """unit -> stage for forward units, the same for backward units, and the stage names."""
    units, nodes = sg.units, graph.nodes
    blocks = {block_of(n.module) for n in nodes if n.phase is Phase.FORWARD} - {None}

    def key(nid: int) -> str | None:
        n = nodes[nid]
        if n.phase is Phase.LOSS:
            return None
        if len(blocks) >= 2:
            return block_of(n.module)
        return n.module.split(".")[0] or None

    fwd = [i for i, u in enumerate(units) if nodes[u.members[0]].phase in _FWD]
    bwd = [i for i, u in enumerate(units) if nodes[u.members[0]].phase is Phase.BACKWARD]
    prelude: list[int] = []
    runs: list[tuple[str, list[int], int]] = []   # key, units, units up to its last keyed one
    for i in fwd:
        k = key(units[i].members[0])
        if k is None:
            (runs[-1][1] if runs else prelude).append(i)
        elif runs and runs[-1][0] == k:
            runs[-1][1].append(i)
            runs[-1] = (k, runs[-1][1], len(runs[-1][1]))
        else:
            runs.append((k, [i], 1))
    if not runs:
        return {}, {}, []
    rest = runs[-1][1][runs[-1][2]:]
    del runs[-1][1][runs[-1][2]:]
    # NOTE: a block that runs twice (shared weights) merges everything between its runs
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for j, (k, _, _) in enumerate(runs):
        first.setdefault(k, j)
        last[k] = j
    groups: list[list[int]] = []
    for j in range(len(runs)):
        if groups and j <= max(last[runs[g][0]] for g in groups[-1]):
            groups[-1].append(j)
        else:
            groups.append([j])
    stage_units = ([prelude] if prelude else []) + [
        [u for j in grp for u in runs[j][1]] for grp in groups] + ([rest] if rest else [])
    names = (["<prelude>"] if prelude else []) + [
        runs[grp[0]][0] if len(grp) == 1 else f"{runs[grp[0]][0]}..{runs[grp[-1]][0]}"
        for grp in groups] + (["<rest>"] if rest else [])
    base = 1 if prelude else 0
    of_key = {runs[j][0]: base + g for g, grp in enumerate(groups) for j in grp}
    fstage = {u: k for k, us in enumerate(stage_units) for u in us}
    keyed = [(p, of_key[k]) for p, i in enumerate(bwd)
             if (k := key(units[i].members[0])) in of_key]
    if not keyed:
        return fstage, {}, names
    bstage: dict[int, int] = {}
    nxt = 0
    for p, i in enumerate(bwd):
        while nxt < len(keyed) and keyed[nxt][0] < p:
            nxt += 1
        if nxt < len(keyed) and keyed[nxt][0] == p:
            bstage[i] = keyed[nxt][1]
        elif nxt == 0:
            bstage[i] = len(names) - 1     # before any block's backward: the rest's
        elif nxt == len(keyed):
            bstage[i] = 0                  # after the first block's: the prelude's
        else:
            bstage[i] = keyed[nxt][1]      # between blocks: the next block's
    return fstage, bstage, names


def chain_stages(graph: Graph, sg: StageGraph):
    """The chain's cut (also what the multi-device planner cuts a captured graph into):
    forward unit -> stage, backward unit -> stage, stage names."""
    return _stages(graph, sg)


def value_readers(sg: StageGraph, fstage: dict[int, int], bstage: dict[int, int]):
    """value -> sorted {(side, stage)} of its readers: "F"/"B" and the stage, "O" otherwise."""
    return _readers(sg, fstage, bstage)


def _readers(sg: StageGraph, fstage: dict[int, int], bstage: dict[int, int]):
    """value -> sorted {(side, stage)} of its readers: "F"/"B" and the stage, "O" otherwise."""
    out = []
    for users in sg.value_users:
        out.append(sorted({("F", fstage[u]) if u in fstage else
                           ("B", bstage[u]) if u in bstage else ("O", -1) for u in users}))
    return out


def _walk_peak(sg: StageGraph, seq, keep: set[int], recompute: bool) -> int:
    """Peak bytes of running units ``seq`` in order on their own: their values freed after their
    last reader in ``seq`` unless kept, step outputs kept; what they read is held outside."""
    pos = {u: p for p, u in enumerate(seq)}
    free_at: dict[int, list[int]] = {}
    for p, u in enumerate(seq):
        for v in sg.units[u].values:
            if v not in keep:
                end = max([p] + [pos[r] for r in sg.value_users[v] if r in pos])
                free_at.setdefault(end, []).append(v)
    live = peak = 0
    for p, u in enumerate(seq):
        unit = sg.units[u]
        made = sum(sg.value_bytes[v] for v in unit.values) + (0 if recompute else
                                                              unit.kept_bytes)
        ws = max(unit.workspace, unit.recompute_workspace) if recompute else unit.workspace
        peak = max(peak, live + made + ws)
        live += made - sum(sg.value_bytes[v] for v in free_at.get(p, ()))
    return peak


@dataclass(frozen=True)
class _Try:
    sim: SimResult
    plan: Plan
    schedule: RotorSchedule | None
    memory: int


class _Planner:
    """Runs the DP at a given memory and simulates its plan; plans are cached by schedule."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        g, cm = problem.graph, problem.cost_model
        self.sg = stage_graph(g, cm)
        self.chain = rotor_chain(g, self.sg)
        plan = staged_plan(g, self.sg, [[] for _ in self.sg.units])
        self.eager = _Try(simulate(g, plan, cm), plan, None, 0)
        self.cache: dict[tuple, _Try] = {}
        self.top = self.eager.sim.peak_bytes   # NOTE: a DP memory that recomputes nothing
        if self.chain is not None:
            chain = self.chain
            n = chain.model.n
            keep_all = [Op("F", k, True) for k in range(n)] + [Op("B", k) for k in reversed(
                range(n))]
            self.top = max(self.top, chain.baseline + replay(chain.model, keep_all)[1])
            self.table = RotorTable(chain.model, self.top - chain.baseline, SLOTS)

    def breakpoints(self) -> list[int]:
        """DP memories (ascending) where the chain model's best time drops: one a sequence."""
        t = self.table
        c = t.cost[0, t.n - 1, t.pad:]
        drops = np.nonzero(c < np.concatenate(([np.inf], c[:-1])))[0]
        return [self.chain.baseline + int(m) * t.unit for m in drops]

    def attempt(self, memory: int) -> _Try | None:
        chain = self.chain
        sched = self.table.schedule(memory - chain.baseline)
        if sched is None:
            return None
        rec = rotor_recompute(chain, sched, len(self.sg.units))
        k = tuple(map(tuple, rec))
        if k not in self.cache:
            g = self.problem.graph
            plan = staged_plan(g, self.sg, rec)
            self.cache[k] = _Try(simulate(g, plan, self.problem.cost_model), plan, sched, memory)
        return self.cache[k]


@register("rotor")
def solve_rotor(problem: Problem) -> Solution:
    t0 = time.perf_counter()
    pl = _Planner(problem)
    eager, budget = pl.eager, problem.budget_bytes
    if pl.chain is None:
        if budget is not None and eager.sim.peak_bytes > budget:
            raise BudgetInfeasible(budget, eager.sim.peak_bytes, dominated_by(eager.sim) +
                                   "; rotor found no chain of blocks to checkpoint",
                                   "rotor")
        return _solution(pl, eager, t0)
    if budget is not None and eager.sim.peak_bytes <= budget:
        return _solution(pl, eager, t0)
    mems = pl.breakpoints()
    if budget is None:   # least peak within the latency limit (eager's is within any)
        limit = problem.latency_limit * eager.sim.latency_s * (1 + 1e-9)
        ok = _search(pl, mems, lambda x: x.sim.latency_s <= limit, upward=False, t0=t0)
        return _solution(pl, min([eager, *ok], key=lambda x: (x.sim.peak_bytes,
                                                               x.sim.latency_s)), t0)
    fits = _search(pl, mems, lambda x: x.sim.peak_bytes <= budget, upward=True, t0=t0)
    if not fits:
        low = min([eager, *pl.cache.values()], key=lambda x: x.sim.peak_bytes)
        raise BudgetInfeasible(budget, low.sim.peak_bytes, dominated_by(low.sim), "rotor")
    return _solution(pl, min(fits, key=lambda x: (x.sim.latency_s, x.sim.peak_bytes)), t0)


def _search(pl: _Planner, mems: list[int], ok, upward: bool, t0: float) -> list[_Try]:
    """Plans at DP memories ``mems`` (ascending) that are ``ok``: bisection for the boundary
    (``ok`` below it when ``upward``, above it otherwise), then a scan past it until ``SCAN``
    plans in a row are not ok — the simulated peak follows the DP's memory only roughly."""
    found: list[_Try] = []

    def test(i: int) -> bool:
        got = pl.attempt(mems[i])
        if got is not None and ok(got):
            found.append(got)
            return True
        return False

    order = range(len(mems)) if upward else range(len(mems) - 1, -1, -1)
    first = next((j for j in order[:SCAN] if test(j)), None)
    if first is None:
        return found
    good, bad = first, len(mems) if upward else -1
    while abs(bad - good) > 1 and time.perf_counter() - t0 <= pl.problem.time_budget_s:
        mid = (good + bad) // 2
        if test(mid):
            good = mid
        else:
            bad = mid
    step, misses, i = (1 if upward else -1), 0, bad
    while 0 <= i < len(mems) and misses < SCAN and (
            time.perf_counter() - t0 <= pl.problem.time_budget_s):
        misses = 0 if test(i) else misses + 1
        i += step
    return found


def _solution(pl: _Planner, got: _Try, t0: float) -> Solution:
    runs: dict[int, int] = {}
    if got.schedule is not None:
        started = False
        for op in got.schedule.ops:
            started = started or op.kind == "B"
            if op.kind == "F" and started:
                runs[op.stage] = runs.get(op.stage, 0) + 1
    notes = {"chain": list(pl.chain.names) if pl.chain else "none: one stage, eager's plan",
             "stages": len(pl.chain.names) if pl.chain else 1,
             "recomputes": got.plan.meta.get("recomputes", 0),
             "forward_reruns": sum(runs.values()),
             "max_reruns_of_a_stage": max(runs.values(), default=0),
             "dp_memory": got.memory}
    return Solution(got.plan, got.sim, "rotor", time.perf_counter() - t0, notes=notes)
