"""Offload or recompute? ``joint`` vs ``hotspot`` (remat alone) on the zoo, simulated.

    python -m fitgraph.bench.joint_tradeoff [--models gpt2,bert-base] [--budgets 0.8,0.6,0.4]
                                            [--time-budget 30]

Each zoo model's small configuration is captured (no optimizer) and costed with the RTX 3090
roofline model (deterministic, no profiling; copies at the device's host-link bandwidth). For
each budget (a fraction of the eager peak) it prints both solvers' simulated step time and peak
relative to eager, how many storages ``joint`` offloads and how many nodes each recomputes, and
the remat budget B' that ``joint`` offloaded from. Simulated only: nothing is executed.
"""

from __future__ import annotations

import argparse
import platform

import torch

__all__ = ["MODELS", "main"]

MODELS = ("gpt2", "bert-base", "vit-b16", "resnet50", "unet", "llama")


def _cells(sol, eager) -> tuple[str, str]:
    from ..solvers import BudgetInfeasible

    if isinstance(sol, BudgetInfeasible):
        return f"infeasible (min {sol.smallest_peak_bytes / eager.peak_bytes:.3f})", "—"
    return f"{sol.sim.latency_s / eager.latency_s:.3f}", f"{sol.sim.peak_bytes / eager.peak_bytes:.3f}"


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    from .. import zoo
    from ..capture.api import capture
    from ..cost.devices import DEVICES
    from ..cost.roofline import RooflineCostModel
    from ..solvers import BudgetInfeasible, Problem, solve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budgets", default="0.8,0.6,0.4")
    ap.add_argument("--time-budget", type=float, default=30.0)
    args = ap.parse_args(argv)
    cm = RooflineCostModel(DEVICES["rtx3090"])
    print(f"machine: {platform.machine()}, torch {torch.__version__}, RTX 3090 roofline costs, "
          f"zoo small configs, no optimizer, simulated; time budget {args.time_budget:g} s\n")
    print("| model | budget | hotspot time / eager | hotspot peak / eager | hotspot recomputes "
          "| joint time / eager | joint peak / eager | joint recomputes | joint offloads "
          "| joint B' / eager | joint solve (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        case = zoo.build(name, "small")
        g = capture(case.model, case.batch, case.loss_fn)
        eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
        for frac in (float(b) for b in args.budgets.split(",")):
            row = {}
            for solver in ("hotspot", "joint"):
                problem = Problem(g, cm, budget_bytes=int(frac * eager.peak_bytes),
                                  time_budget_s=args.time_budget)
                try:
                    row[solver] = solve(problem, solver)
                except BudgetInfeasible as e:
                    row[solver] = e
            h, j = row["hotspot"], row["joint"]
            h_rec = "—" if isinstance(h, BudgetInfeasible) else str(h.notes["recomputes"])
            if isinstance(j, BudgetInfeasible):
                j_rec = j_off = j_b = j_s = "—"
            else:
                at = j.notes["base_budget_bytes"]
                j_rec, j_off = str(j.notes["recomputes"]), str(j.notes["offloaded"])
                j_b = (f"{at / eager.peak_bytes:.3f}" if at is not None
                       else "eager" if j.notes["base"] == "eager plan" else "least peak")
                j_s = f"{j.solve_s:.1f}" + (" (timed out)" if j.notes["timed_out"] else "")
            print(f"| {name} | {frac:.0%} | {' | '.join(_cells(h, eager))} | {h_rec} "
                  f"| {' | '.join(_cells(j, eager))} | {j_rec} | {j_off} | {j_b} | {j_s} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
