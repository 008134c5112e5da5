"""How far is the production solver from optimal? ILP vs hotspot on zoo-derived graphs.

    python -m fitgraph.bench.ilp_gap [--models gpt2,bert-base] [--budgets 0.8,0.6,0.4]
                                     [--time-limit 120]

A zoo-derived graph is a zoo model's small configuration cut to its first block (``derived``),
captured without an optimizer and costed with the RTX 3090 roofline model (deterministic, no
profiling). For each budget (a fraction of the eager peak) it prints the ILP's status, proven
gap and solve time, and both solvers' simulated step time relative to eager. Checkmate's MILP
is exact but its LP relaxation is weak: graphs of more than a few dozen units may stop at the
time limit with a gap, which the table shows.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from torch import nn

__all__ = ["DERIVED", "derived", "main"]

DERIVED = ("gpt2", "bert-base", "vit-b16", "llama", "resnet50")


def derived(name: str, blocks: int = 1):
    """The zoo model's small configuration with only its first ``blocks`` blocks.

    Example:
        >>> case = derived("gpt2")
        >>> len(case.model.h)
        1
    """
    from .. import zoo

    case = zoo.build(name, "small")
    m = case.model
    for attr in ("h", "layers", "blocks"):
        if isinstance(getattr(m, attr, None), nn.ModuleList):
            setattr(m, attr, getattr(m, attr)[:blocks])
            return case
    if name == "resnet50":
        stages = [m.layer1, m.layer2, m.layer3, m.layer4]
        for i in range(len(stages)):
            if i >= blocks:
                setattr(m, f"layer{i + 1}", nn.Identity())
        width = stages[min(blocks, 4) - 1][-1].conv3.out_channels
        m.fc = nn.Linear(width, m.fc.out_features)
        return case
    raise ValueError(f"no derived graph for zoo model {name!r}; known: {', '.join(DERIVED)}")


def main(argv: list[str] | None = None) -> int:
    from ..capture.api import capture
    from ..cost.devices import DEVICES
    from ..cost.roofline import RooflineCostModel
    from ..solvers import BudgetInfeasible, Problem, solve
    from ..solvers.stages import stage_graph

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DERIVED))
    ap.add_argument("--budgets", default="0.8,0.6,0.4")
    ap.add_argument("--time-limit", type=float, default=120.0)
    args = ap.parse_args(argv)
    cm = RooflineCostModel(DEVICES["rtx3090"])
    print(f"machine: {platform.machine()}, torch {torch.__version__}, RTX 3090 roofline costs, "
          f"zoo small configs cut to one block, no optimizer; ILP time limit {args.time_limit:g} s\n")
    print("| graph | units | budget | ILP status | ILP gap | ILP solve (s) | ILP time / eager "
          "| hotspot time / eager | hotspot / ILP |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        case = derived(name)
        g = capture(case.model, case.batch, case.loss_fn)
        units = len(stage_graph(g, cm).units)
        eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
        for frac in (float(b) for b in args.budgets.split(",")):
            budget = int(frac * eager.peak_bytes)
            row = []
            for solver in ("ilp", "hotspot"):
                t0 = time.perf_counter()
                try:
                    s = solve(Problem(g, cm, budget_bytes=budget, time_budget_s=args.time_limit),
                              solver)
                    row.append((s, time.perf_counter() - t0))
                except BudgetInfeasible as e:
                    row.append((e, time.perf_counter() - t0))
            (ilp, ilp_s), (hot, _) = row
            if isinstance(ilp, BudgetInfeasible):
                status, gap, ilp_t = "infeasible", "", "—"
            else:
                status = "optimal" if ilp.optimal else "time limit"
                gap, ilp_t = f"{ilp.gap:.1%}", f"{ilp.sim.latency_s / eager.latency_s:.3f}"
            hot_t = ("infeasible" if isinstance(hot, BudgetInfeasible)
                     else f"{hot.sim.latency_s / eager.latency_s:.3f}")
            ratio = (f"{hot.sim.latency_s / ilp.sim.latency_s:.3f}"
                     if not isinstance(hot, BudgetInfeasible)
                     and not isinstance(ilp, BudgetInfeasible) else "—")
            print(f"| {name} (1 block) | {units} | {frac:.0%} | {status} | {gap} | {ilp_s:.1f} "
                  f"| {ilp_t} | {hot_t} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
