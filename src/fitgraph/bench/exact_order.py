"""The exact scheduler against the greedy one on the zoo (issue 30): each graph's simulated peak
under eager's order, the greedy's two strategies and ``plan.exact_order``, and the exact
scheduler's time.

    python -m fitgraph.bench.exact_order [--models gpt2,bert-base] [--window 24] [--out FILE]
    python -m fitgraph.bench.exact_order --remat [--budgets 0.8,0.6] [--out FILE]

Each order becomes the plan that runs it (``plan.remat.remat_plan``, nothing dropped) and is
simulated on the roofline of cpu-generic (the peak does not depend on the times). With
``--remat``: hotspot's plan at each budget (a fraction of eager's simulated peak) beside the
plan of the same drop set in the exact scheduler's drop-aware order.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MODELS = ("gpt2", "bert-base", "resnet50", "unet", "vit-b16", "llama")


def run(models: list[str], window: int) -> list[dict]:
    from .. import capture, zoo
    from ..cost import RooflineCostModel, get_device
    from ..plan.exact_order import exact_order
    from ..plan.remat import remat_plan
    from ..plan.reorder import memory_aware_order
    from ..sim.simulate import simulate

    cost = RooflineCostModel(get_device("cpu-generic"))
    rows = []
    for name in models:
        case = zoo.build(name, "small")
        g = capture(case.model, case.batch, case.loss_fn)

        def peak(order, g=g):
            return simulate(g, remat_plan(g, set(), order), cost).peak_bytes

        start = time.perf_counter()
        exact = exact_order(g, window=window)
        seconds = time.perf_counter() - start
        row = {"model": name, "nodes": len(g.nodes), "eager": peak([n.id for n in g.nodes]),
               "strict": peak(memory_aware_order(g, "strict")),
               "conservative": peak(memory_aware_order(g, "conservative")),
               "exact": peak(exact), "exact_s": seconds}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_remat(models: list[str], budgets: list[float], window: int) -> list[dict]:
    from .. import capture, zoo
    from ..cost import RooflineCostModel, get_device
    from ..plan.exact_order import exact_order
    from ..plan.remat import remat_plan
    from ..sim.simulate import simulate
    from ..solvers.base import BudgetInfeasible, Problem
    from ..solvers.remat.hotspot import solve_hotspot

    cost = RooflineCostModel(get_device("cpu-generic"))
    rows = []
    for name in models:
        case = zoo.build(name, "small")
        g = capture(case.model, case.batch, case.loss_fn)
        eager = simulate(g, remat_plan(g, set(), None), cost).peak_bytes
        for frac in budgets:
            try:
                sol = solve_hotspot(Problem(g, cost, budget_bytes=int(frac * eager)))
            except BudgetInfeasible:
                continue
            drop = sol.plan.meta["dropped"]
            start = time.perf_counter()
            order = exact_order(g, drop, window=window)
            seconds = time.perf_counter() - start
            ex = simulate(g, remat_plan(g, drop, order), cost)
            row = {"model": name, "budget": frac, "hotspot_peak": sol.sim.peak_bytes,
                   "hotspot_latency_s": sol.sim.latency_s, "exact_peak": ex.peak_bytes,
                   "exact_latency_s": ex.latency_s, "exact_s": seconds}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def markdown_remat(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| model | budget | hotspot peak | exact order's peak | ratio | latency ratio | "
             "exact's time |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['budget']:g} | {r['hotspot_peak'] / mib:.2f} MiB | "
                     f"{r['exact_peak'] / mib:.2f} MiB | "
                     f"{r['exact_peak'] / r['hotspot_peak']:.4f} | "
                     f"{r['exact_latency_s'] / r['hotspot_latency_s']:.4f} | "
                     f"{r['exact_s']:.1f} s |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| model | nodes | eager order | greedy strict | greedy conservative | exact | "
             "exact / best greedy | exact's time |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        best = min(r["strict"], r["conservative"])
        lines.append(f"| {r['model']} | {r['nodes']} | {r['eager'] / mib:.2f} MiB | "
                     f"{r['strict'] / mib:.2f} MiB | {r['conservative'] / mib:.2f} MiB | "
                     f"{r['exact'] / mib:.2f} MiB | {r['exact'] / best:.4f} | "
                     f"{r['exact_s']:.1f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--window", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--remat", action="store_true",
                    help="hotspot's drop sets at --budgets, in the exact drop-aware order")
    ap.add_argument("--budgets", default="0.8,0.6")
    ap.add_argument("--table", metavar="JSON", help="print a saved run as a markdown table")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            rows = json.load(f)
        print(markdown_remat(rows) if rows and "budget" in rows[0] else markdown(rows))
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.remat:
        rows = run_remat(models, [float(b) for b in args.budgets.split(",")], args.window)
        print(markdown_remat(rows))
    else:
        rows = run(models, args.window)
        print(markdown(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
