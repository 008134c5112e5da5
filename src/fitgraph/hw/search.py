"""The co-search: every chip configuration of a space under an area budget, each with its best
multi-device plan for a model on a cluster of such chips; the best by throughput, throughput per
mm² or per watt, and the Pareto front of throughput against area.

Each configuration gets a bound first (``hw.bound.step_bound``: no plan steps faster), cheap
because the GEMMs' times are cached across configurations that share their arrays, SRAM and
HBM bandwidth (``hw.gemm``). Configurations are planned (``dist.search``, 1F1B, tensor
parallelism up to 8 wide as Phaze's) best bound first; once a configuration's bound cannot beat
the best plan found, neither can any after it: the rest are pruned, safely. A time limit stops
the planning earlier: the configurations left whose bound still beats the best are reported
(``unresolved``), never silently dropped. The baseline (the TPUv4-like chip the area budget is
made of) is planned the same way.

Example:
    >>> from fitgraph.dist import GptShape
    >>> from fitgraph.hw.space import Space
    >>> small = Space(array_sides=(64, 128), tensor_cores=(4, 8, 16), vector_cores=(2,),
    ...               sram_mib=(32, 128), hbm_bandwidth=(1.2e12,), links=((6, 50e9),))
    >>> r = co_search(GptShape(24, 2048, 16, seq=1024), 64, 512, space=small)
    >>> r.configs_evaluated > 0, r.best.tokens_per_s >= r.baseline.tokens_per_s
    (True, True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..dist.megatron_table import GptShape
from ..dist.memory import MIXED_ADAM, Precision
from ..dist.model import GptModel
from ..dist.search import search
from .area import TPUV4_LIKE, area_budget, chip_area, chip_power
from .bound import MAX_TP, graph_step_bounds, step_bounds
from .chip import Chip
from .device import chip_cluster
from .space import Space, configurations

__all__ = ["OBJECTIVES", "Candidate", "CoSearch", "co_search", "plan_chip"]

OBJECTIVES = ("throughput", "perf-per-area", "perf-per-watt")


@dataclass
class Candidate:
    """A chip configuration, its area and power, and its best plan (None: none fits)."""

    chip: Chip
    area_mm2: float
    power_w: float
    bound_tokens_per_s: float
    tokens_per_s: float = 0.0
    step_s: float = float("inf")
    parallelism: dict = field(default_factory=dict)
    binding: str = ""

    def score(self, objective: str, bound: bool = False) -> float:
        tps = self.bound_tokens_per_s if bound else self.tokens_per_s
        if objective == "throughput":
            return tps
        if objective == "perf-per-area":
            return tps / self.area_mm2
        return tps / self.power_w

    def to_json(self) -> dict:
        c = self.chip
        return {"chip": c.name, "tensor_cores": c.tensor_cores, "array": [c.array_rows,
                c.array_cols], "vector_cores": c.vector_cores, "vector_lanes": c.vector_lanes,
                "sram_mib": c.sram_bytes / 2**20, "hbm_tb_s": c.hbm_bandwidth / 1e12,
                "links": c.links, "link_gb_s": c.link_bandwidth / 1e9,
                "peak_tflops": c.peak_flops() / 1e12, "area_mm2": self.area_mm2,
                "power_w": self.power_w, "tokens_per_s": self.tokens_per_s,
                "step_s": self.step_s if self.tokens_per_s else None,
                "bound_tokens_per_s": self.bound_tokens_per_s,
                "parallelism": self.parallelism, "binding": self.binding}


@dataclass
class CoSearch:
    """What the co-search found (``to_json`` has ``configs_evaluated``, ``search_s``,
    ``best``, ``baseline``, ``pareto``)."""

    objective: str
    budget_mm2: float
    configs_total: int          # in the space
    configs_in_budget: int      # within the area budget: each bounded
    configs_evaluated: int      # planned
    pruned: int                 # skipped: their bound cannot beat the best plan (safe)
    unresolved: int             # not planned for the time limit, their bound beats the best
    search_s: float
    bound_s: float
    best: Candidate | None
    baseline: Candidate
    evaluated: list[Candidate]

    def pareto(self) -> list[Candidate]:
        """Of the planned configurations, those no other beats on throughput at no more area."""
        front: list[Candidate] = []
        for c in sorted(self.evaluated, key=lambda c: (c.area_mm2, -c.tokens_per_s)):
            if c.tokens_per_s > 0 and (not front or c.tokens_per_s > front[-1].tokens_per_s):
                front.append(c)
        return front

    def top(self, n: int = 5) -> list[Candidate]:
        return sorted((c for c in self.evaluated if c.tokens_per_s > 0),
                      key=lambda c: -c.score(self.objective))[:n]

    def to_json(self) -> dict:
        return {"objective": self.objective, "area_budget_mm2": self.budget_mm2,
                "configs_total": self.configs_total, "configs_in_budget":
                self.configs_in_budget, "configs_evaluated": self.configs_evaluated,
                "pruned_by_bound": self.pruned, "unresolved": self.unresolved,
                "search_s": self.search_s, "bound_s": self.bound_s,
                "best": self.best.to_json() if self.best else None,
                "baseline": self.baseline.to_json(),
                "gain": (self.best.score(self.objective) / self.baseline.score(self.objective)
                         if self.best and self.baseline.tokens_per_s else None),
                "top": [c.to_json() for c in self.top()],
                "pareto": [c.to_json() for c in self.pareto()]}


def _spec(model, chip: Chip):
    """The planner's model of ``model`` (a GPT shape or a captured ``GraphModel``) on ``chip``."""
    if isinstance(model, GptShape):
        return GptModel(model)
    from .cost_model import ChipCostModel

    return model.retimed(ChipCostModel(chip))


def plan_chip(candidate: Candidate, model, devices: int, global_batch: int,
              precision: Precision = MIXED_ADAM, fix: dict | None = None) -> Candidate:
    """Plan ``model`` (a ``GptShape`` or a captured ``dist.GraphModel``) on ``devices`` of the
    candidate's chip (1F1B unless ``fix`` says otherwise; tensor parallelism up to 8 wide);
    fills in its throughput."""
    found = search(_spec(model, candidate.chip), chip_cluster(candidate.chip, devices),
                   global_batch,
                   fixed={"schedule": "1f1b", **(fix or {})}, precision=precision, top=1,
                   max_tp=MAX_TP)
    if found.best is None:
        candidate.binding = "; ".join(f"{n}: {why}" for why, n in found.rejected.items())
        return candidate
    pred = found.best
    candidate.step_s = pred.step_s
    candidate.tokens_per_s = pred.tokens_per_s
    p = pred.parallelism
    candidate.parallelism = {"tp": p.tp, "pp": p.pp, "dp": p.dp, "micro_batch": p.micro_batch,
                             "zero": p.zero, "sp": p.sp, "schedule": p.schedule}
    return candidate


def _candidates(chips: list[Chip], model, devices: int,
                global_batch: int) -> list[Candidate]:
    tokens = global_batch * model.seq
    bounds = (step_bounds(chips, model, devices, global_batch) if isinstance(model, GptShape)
              else graph_step_bounds(chips, model, devices, global_batch))
    return [Candidate(c, chip_area(c).total, chip_power(c), tokens / b)
            for c, b in zip(chips, bounds)]


def co_search(model, devices: int, global_batch: int, *, space: Space | None = None,
              area: str | float = "tpuv4", objective: str = "throughput",
              precision: Precision = MIXED_ADAM, time_limit_s: float = 540.0,
              fix: dict | None = None, progress=None) -> CoSearch:
    """Search ``space`` for the chip whose best plan of ``model`` (a ``GptShape``, or a captured
    step as a ``dist.GraphModel``) on ``devices`` chips at ``global_batch`` samples per step
    scores best on ``objective``."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: one of {OBJECTIVES}")
    start = time.perf_counter()
    space = space or Space()
    budget = area_budget(area)
    cands = _candidates(list(configurations(space, budget)), model, devices, global_batch)
    bound_s = time.perf_counter() - start
    cands.sort(key=lambda c: -c.score(objective, bound=True))
    base_chip = (TPUV4_LIKE.replace(hbm_bytes=space.hbm_gib * 2**30) if space.hbm_gib
                 else TPUV4_LIKE)
    baseline = plan_chip(_candidates([base_chip], model, devices, global_batch)[0], model,
                         devices, global_batch, precision, fix)
    best: Candidate | None = None
    evaluated: list[Candidate] = []
    pruned = unresolved = 0
    for i, cand in enumerate(cands):
        if best is not None and cand.score(objective, bound=True) <= best.score(objective):
            pruned = len(cands) - i
            break
        if time.perf_counter() - start > time_limit_s:
            rest = cands[i:]
            unresolved = sum(1 for c in rest if best is None
                             or c.score(objective, bound=True) > best.score(objective))
            pruned = len(rest) - unresolved
            break
        plan_chip(cand, model, devices, global_batch, precision, fix)
        evaluated.append(cand)
        if cand.tokens_per_s and (best is None
                                  or cand.score(objective) > best.score(objective)):
            best = cand
        if progress is not None:
            progress(i + 1, len(cands), cand, best)
    return CoSearch(objective, budget, space.size(), len(cands), len(evaluated), pruned,
                    unresolved, time.perf_counter() - start, bound_s, best, baseline,
                    evaluated)
