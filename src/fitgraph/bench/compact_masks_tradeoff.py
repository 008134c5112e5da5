"""Dropout masks as bits or as floats? ``hotspot`` on the captured graph and on
``transform.compact_masks``'s rewrite, simulated on this machine's measured op costs.

    python -m fitgraph.bench.compact_masks_tradeoff [--models gpt2] [--limits 1.05,1.10]
                                                    [--budgets 0.6,0.5,0.45] [--time-budget 30]

Each zoo model's small configuration is captured with AdamW in the step (its state made by one
eager step first, as in steady state) and profiled on this machine (one thread). For each latency limit (a factor of the captured graph's eager step time)
it prints the least peak ``hotspot`` reaches on each graph, and for each budget (a fraction of
the eager peak) the step time; all relative to the captured graph's eager plan. The rewrite's
own eager plan is printed first (its forward makes the bits: a little slower). Simulated only.
"""

from __future__ import annotations

import argparse
import platform

import torch

__all__ = ["main"]


def _cells(graph, cm, eager, time_budget_s: float, **kw) -> str:
    """'peak / eager | time / eager' of ``hotspot``'s plan for ``graph``, or 'infeasible'."""
    from ..solvers import BudgetInfeasible, Problem, solve

    try:
        s = solve(Problem(graph, cm, time_budget_s=time_budget_s, **kw), "hotspot")
    except BudgetInfeasible:
        return "infeasible | —"
    return f"{s.sim.peak_bytes / eager.peak_bytes:.3f} | {s.sim.latency_s / eager.latency_s:.3f}"


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    from .. import zoo
    from ..capture.api import capture
    from ..cost import ProfiledCostModel
    from ..solvers import Problem, solve
    from ..transform.compact_masks import compact_masks, dropout_masks
    from .harness import _eager_step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2")
    ap.add_argument("--limits", default="1.05,1.10")
    ap.add_argument("--budgets", default="0.6,0.5,0.45")
    ap.add_argument("--time-budget", type=float, default=30.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, 1 thread, measured op "
          "costs, AdamW, small configs, simulated\n")
    print("| model | masks | setting | captured: peak / eager | captured: time / eager "
          "| bits: peak / eager | bits: time / eager |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        case = zoo.build(name, "small")
        opt = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
        # NOTE: one eager step first, so AdamW's state exists during the step, as in steady
        # state (fit_within_latency does the same); otherwise it is made after the backward,
        # off the peak, and ratios come out lower than training would see after step one
        _eager_step(case.model, case.batch, case.loss_fn, opt)()
        opt.zero_grad(set_to_none=True)
        g = capture(case.model, case.batch, case.loss_fn, opt)
        c = compact_masks(g)
        cm = ProfiledCostModel(progress=False)
        cm.profile(g)
        cm.profile(c)
        eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
        bits_eager = solve(Problem(c, cm, latency_limit=1.0), "eager").sim

        def cells(graph, **kw) -> str:
            return _cells(graph, cm, eager, args.time_budget, **kw)  # noqa: B023 (called at once)

        row = f"| {name} | {len(dropout_masks(g))} "
        print(row + f"| eager plan | 1.000 | 1.000 | {bits_eager.peak_bytes / eager.peak_bytes:.3f} "
              f"| {bits_eager.latency_s / eager.latency_s:.3f} |", flush=True)
        for lim in (float(x) for x in args.limits.split(",")):
            # NOTE: Problem's latency_limit is a factor of its own graph's eager step time
            own = lim * eager.latency_s / bits_eager.latency_s
            print(row + f"| within {lim:.2f}x | {cells(g, latency_limit=lim)} "
                  f"| {cells(c, latency_limit=own)} |", flush=True)
        for frac in (float(x) for x in args.budgets.split(",")):
            budget = int(frac * eager.peak_bytes)
            print(row + f"| budget {frac:.0%} | {cells(g, budget_bytes=budget)} "
                  f"| {cells(c, budget_bytes=budget)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
