"""Checkmate's MILP for a stage graph, written row by row (``solvers.remat.ilp`` solves it).

Binary ``R[t,i]``: unit ``i`` is (re)computed in stage ``t``; binary ``S[t,v]``: storage ``v``
is kept from stage ``t-1`` into stage ``t``; ``F[t,v,k]``: ``v`` is freed right after ``k`` runs
in stage ``t`` (continuous: it only lowers memory, so the solver sets it to the product of its
binary conditions, Checkmate's linearisation written as upper bounds); ``U[t,k]``: bytes live
while ``k`` runs in stage ``t``. A variable exists only where it can matter (a unit's live
range, extended through the units that could recompute from it); where it does not, a
reference to it is a constant (``refs``: (variable index or None, constant)).

Example:
    >>> import sys; sys.path.insert(0, "tests")
    >>> from synthetic_graphs import transformer_like
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> from fitgraph.solvers.remat.stages import stage_graph
    >>> sg = stage_graph(transformer_like(1, seq=8), RooflineCostModel(get_device("cpu-generic")))
    >>> ms = MilpSchedule(sg)
    >>> points = ms.presence_rows()
    >>> len(points) == len(sg.units) and len(ms.m.rows) > 0
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .stages import StageGraph

__all__ = ["LARGEST_COEF", "MS", "MilpSchedule", "Model"]

MS = 1e-3          # NOTE: time in ms keeps HiGHS's objective coefficients near 1
LARGEST_COEF = 2.0**12  # NOTE: the largest storage, in the MILP's byte unit (see byte_unit)

Ref = tuple[int | None, float]


@dataclass
class Model:
    """A sparse MILP under construction: variables by key, rows of (coefs, lo, hi)."""

    index: dict = field(default_factory=dict)
    integral: list = field(default_factory=list)
    upper: list = field(default_factory=list)
    rows: list = field(default_factory=list)

    def var(self, key, binary: bool, upper: float = 1.0) -> int:
        self.index[key] = len(self.integral)
        self.integral.append(1 if binary else 0)
        self.upper.append(upper)
        return self.index[key]

    def row(self, terms: dict[int, float], const: float, lo: float, hi: float) -> None:
        """lo <= sum(terms) + const <= hi; a row without variables must already hold."""
        terms = {k: v for k, v in terms.items() if v != 0.0}
        if not terms:
            if not lo - 1e-9 <= const <= hi + 1e-9:
                raise AssertionError(f"constant row violated: {lo} <= {const} <= {hi}")
            return
        self.rows.append((terms, lo - const, hi - const))


def byte_unit(sg: StageGraph) -> float:
    """The MILP's unit of memory: a power of two that puts the largest storage near
    ``LARGEST_COEF``. NOTE: HiGHS accepts rows violated by its tolerance (1e-7 units, more after
    its scaling); with bytes as the unit on small graphs that is far under a byte, so the
    schedule is exact; on large graphs a few bytes over are possible and ``solve_ilp`` repairs
    them (``IlpResult.tolerance_bytes`` bounds what can be explained that way)."""
    largest = max([*sg.value_bytes, *(u.nbytes + u.kept_bytes for u in sg.units), 1])
    return float(2.0 ** max(0, int(np.floor(np.log2(largest / LARGEST_COEF)))))


def live_ranges(sg: StageGraph) -> tuple[list[int], list[int], list[int]]:
    """(value -> its last direct reader, value -> the last stage it may be needed, through
    recomputable readers, unit -> the last stage it may be recomputed)."""
    n = len(sg.units)
    direct = [max(us, default=sg.value_unit[v]) for v, us in enumerate(sg.value_users)]
    extended = list(direct)
    unit_last = list(range(n))
    for i in range(n - 1, -1, -1):
        for v in sg.units[i].values:
            for k in sg.value_users[v]:
                if sg.units[k].recomputable:
                    extended[v] = max(extended[v], unit_last[k])
            unit_last[i] = max(unit_last[i], extended[v])
    return direct, extended, unit_last


def use_stages(sg: StageGraph) -> list[set[int]]:
    """unit -> the stages where something that reads it may run: its own, its non-recomputable
    readers', and (recursively) those of its recomputable readers. A unit is recomputed only in
    such a stage (just in time), never to be held through stages that do not read it."""
    n = len(sg.units)
    when: list[set[int]] = [set() for _ in range(n)]
    for i in range(n - 1, -1, -1):
        when[i].add(i)
        for v in sg.units[i].values:
            for k in sg.value_users[v]:
                when[i] |= when[k] if sg.units[k].recomputable else {k}
    return when


def add(terms: dict, const: float, ref: Ref, coef: float) -> float:
    """``coef * ref`` added to a row: to ``terms`` where ``ref`` is a variable, else to the
    constant returned."""
    k, c = ref
    if k is None:
        return const + coef * c
    terms[k] = terms.get(k, 0.0) + coef
    return const


class MilpSchedule:
    """The MILP of one stage graph, its R and S variables made (``solve_stages`` adds the rows
    in this order: presence, memory, stage-end knapsacks, objective; HiGHS's path depends on
    the order)."""

    def __init__(self, sg: StageGraph) -> None:
        self.sg, self.m = sg, Model()
        units = sg.units
        self.direct, self.last, unit_last = live_ranges(sg)
        self.byte_unit = byte_unit(sg)
        when = use_stages(sg)
        for i, u in enumerate(units):
            if u.recomputable:
                for t in sorted(when[i]):
                    if i < t <= unit_last[i]:
                        self.m.var(("R", t, i), True)
        for v, p in enumerate(sg.value_unit):
            for t in range(p + 1, self.last[v] + 1):
                if units[p].recomputable or t > self.direct[v]:
                    self.m.var(("S", t, v), True)
        self.kept_before = np.concatenate([[0], np.cumsum([u.kept_bytes for u in units])])
        self.alive_at: list[list[int]] = [[] for _ in range(len(units))]
        for v, p in enumerate(sg.value_unit):
            for t in range(p + 1, self.last[v] + 1):
                self.alive_at[t].append(v)

    def R(self, t: int, i: int) -> Ref:
        """Unit ``i`` (re)computed in stage ``t``."""
        if t == i:
            return None, 1.0
        k = self.m.index.get(("R", t, i))
        return (k, 0.0) if k is not None else (None, 0.0)

    def S(self, t: int, v: int) -> Ref:
        """Storage ``v`` kept into stage ``t``."""
        if not self.sg.value_unit[v] < t <= self.last[v]:
            return None, 0.0
        k = self.m.index.get(("S", t, v))
        return (k, 0.0) if k is not None else (None, 1.0)

    def presence_rows(self) -> list[list[int]]:
        """A storage is kept only if it existed in the stage before; a unit runs only when what
        it reads is there. Returns, per stage, the units that may run in it."""
        sg, m, R, S = self.sg, self.m, self.R, self.S
        for v, p in enumerate(sg.value_unit):
            for t in range(p + 1, self.last[v] + 1):
                terms: dict[int, float] = {}
                const = add(terms, 0.0, S(t, v), 1.0)
                const = add(terms, const, R(t - 1, p), -1.0)
                const = add(terms, const, S(t - 1, v), -1.0)
                m.row(terms, const, -np.inf, 0.0)
        n = len(sg.units)
        points: list[list[int]] = [[] for _ in range(n)]
        for t in range(n):
            points[t] = [k for k in range(t + 1) if R(t, k) != (None, 0.0)]
            for k in points[t]:
                for v in sg.units[k].reads:
                    terms = {}
                    const = add(terms, 0.0, R(t, k), 1.0)
                    const = add(terms, const, R(t, sg.value_unit[v]), -1.0)
                    const = add(terms, const, S(t, v), -1.0)
                    m.row(terms, const, -np.inf, 0.0)
        return points

    def memory_rows(self, points: list[list[int]], cap: float, peak_var: int | None) -> None:
        """Per stage: when each storage is freed (``F``), the bytes live while each unit runs
        (``U``), and those plus its workspace within ``cap`` (or under the peak variable)."""
        for t in range(len(self.sg.units)):
            frees = self._frees(t, points[t])
            self._usage_rows(t, points[t], frees, cap, peak_var)

    def _frees(self, t: int, points: list[int]) -> dict[int, list[tuple[int, float]]]:
        sg, m, R, S = self.sg, self.m, self.R, self.S
        units, vbytes, vusers, n = sg.units, sg.value_bytes, sg.value_users, len(sg.units)
        frees: dict[int, list[tuple[int, float]]] = {}
        in_stage = set(points)
        for k in points:
            for v in sorted({*units[k].reads, *units[k].values}):
                if vbytes[v] == 0:
                    continue
                s_next = S(t + 1, v) if t + 1 < n else (None, 0.0)
                later = [R(t, j) for j in vusers[v] if k < j <= t and j in in_stage]
                if s_next == (None, 1.0) or (None, 1.0) in later:
                    continue  # NOTE: still needed after k in this stage or kept: never freed
                f = m.var(("F", t, v, k), False)
                if t != k:   # FREE <= R[t,k]
                    terms = {f: 1.0}
                    m.row(terms, add(terms, 0.0, R(t, k), -1.0), -np.inf, 0.0)
                for ref in [s_next, *later]:   # FREE <= 1 - S[t+1,v], FREE <= 1 - R[t,j]
                    terms = {f: 1.0}
                    m.row(terms, add(terms, 0.0, ref, 1.0), -np.inf, 1.0)
                frees.setdefault(k, []).append((f, vbytes[v] / self.byte_unit))
        return frees

    def _usage_rows(self, t: int, points: list[int], frees: dict[int, list[tuple[int, float]]],
                    cap: float, peak_var: int | None) -> None:
        sg, m, R, S, bu = self.sg, self.m, self.R, self.S, self.byte_unit
        units, vbytes = sg.units, sg.value_bytes
        prev = None
        for pos, k in enumerate(points):
            u = m.var(("U", t, k), False, upper=np.inf)
            terms = {u: 1.0}
            const = add(terms, 0.0, R(t, k), -units[k].nbytes / bu)
            if t == k:
                const -= units[k].kept_bytes / bu
            if prev is None:
                const -= self.kept_before[t] / bu
                for v in self.alive_at[t]:
                    if vbytes[v]:
                        const = add(terms, const, S(t, v), -vbytes[v] / bu)
            else:
                terms[prev] = -1.0
                for f, size in frees.get(points[pos - 1], ()):
                    terms[f] = terms.get(f, 0.0) + size
            m.row(terms, const, 0.0, 0.0)
            ws = units[k].workspace if t == k else units[k].recompute_workspace
            terms = {u: 1.0}
            const = add(terms, 0.0, R(t, k), ws / bu)
            if peak_var is not None:
                terms[peak_var] = -1.0
            m.row(terms, const, -np.inf, 0.0 if peak_var is not None else cap)
            prev = u

    def stage_end_knapsacks(self, cap: float) -> None:
        """One redundant row per stage, on binaries only: while unit ``t`` runs (the last point
        of stage ``t``), every storage kept into stage ``t+1`` is live (nothing runs after ``t``
        in its stage), and so are ``t``'s reads, outputs and workspace:
        ``sum(S[t+1,v] * bytes(v)) + reads + outputs + workspace + kept outputs <= cap``.

        NOTE: the model already implies it through ``U`` and the continuous frees, but there the
        relaxation can keep 90% of a tensor through a binding stage and top it up after with a
        10% recompute (a fractional knapsack at every stage). Written on the keep binaries alone
        it is a knapsack row HiGHS derives cover cuts from: on GPT-2 (2 blocks, 116 units) at
        60% the gap after 120 s went from 6.8% to 1.9%, and the incumbent from hotspot's 1.192x
        of eager to 1.149x."""
        units, vbytes, bu = self.sg.units, self.sg.value_bytes, self.byte_unit
        for t in range(len(units) - 1):
            own, reads = set(units[t].values), set(units[t].reads)
            const = (self.kept_before[t] + units[t].kept_bytes + units[t].nbytes
                     + units[t].workspace + sum(vbytes[v] for v in reads if v not in own)) / bu
            terms: dict[int, float] = {}
            for v in self.alive_at[t + 1]:
                if v in own or v in reads or not vbytes[v]:
                    continue
                const = add(terms, const, self.S(t + 1, v), vbytes[v] / bu)
            if terms:  # NOTE: a constant over the cap: the U rows make it infeasible already
                self.m.row(terms, const, -np.inf, cap)

    def objective(self, peak_var: int | None, latency_limit_s: float | None
                  ) -> tuple[np.ndarray, float]:
        """(objective coefficients, the step's own compute seconds): the recomputes' time, or
        with a latency limit the peak, their time capped by a row."""
        m, units = self.m, self.sg.units
        c = np.zeros(len(m.integral))
        recompute_terms: dict[int, float] = {}
        for key, k in m.index.items():
            if key[0] == "R":
                recompute_terms[k] = units[key[2]].seconds / MS
        base_s = sum(u.seconds for u in units)
        if peak_var is not None:
            c[peak_var] = 1.0
            m.row(recompute_terms, 0.0, -np.inf, (latency_limit_s - base_s) / MS)
        else:
            for k, v in recompute_terms.items():
                c[k] = v
        return c, base_s

    def start(self, recompute: list[list[int]]) -> dict[int, float] | None:
        """The binaries (R, S) of a known schedule, for HiGHS to start from; None if the
        schedule does not fit this model's variables."""
        sg, m = self.sg, self.m
        n = len(sg.units)
        runs = [{t} for t in range(n)]            # unit -> stages where it is (re)computed
        for t, us in enumerate(recompute):
            for u in us:
                runs[u].add(t)
        keep: dict[tuple, float] = {}
        for v, p in enumerate(sg.value_unit):
            made = sorted(runs[p])
            uses = {t for k in sg.value_users[v] for t in runs[k] if t not in runs[p]}
            for t in uses:
                q0 = max((q for q in made if q < t), default=None)
                if q0 is None:
                    return None
                for q in range(q0 + 1, t + 1):
                    keep[("S", q, v)] = 1.0
        out: dict[int, float] = {}
        for key, k in m.index.items():
            if key[0] == "R":
                out[k] = 1.0 if key[1] in runs[key[2]] else 0.0
            elif key[0] == "S":
                out[k] = keep.pop(key, 0.0)
        for (_, q, v) in keep:   # fixed-1 keeps are fine; a keep outside the model is not
            if not sg.value_unit[v] < q or sg.units[sg.value_unit[v]].recomputable:
                return None
        for t, us in enumerate(recompute):
            if any(("R", t, u) not in m.index for u in us):
                return None
        return out
