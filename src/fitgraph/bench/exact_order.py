"""The exact scheduler against the greedy one on the zoo (issue 30): each graph's simulated peak
under eager's order, the greedy's two strategies and ``plan.exact_order``, and the exact
scheduler's time.

    python -m fitgraph.bench.exact_order [--models gpt2,bert-base] [--window 24] [--out FILE]

Each order becomes the plan that runs it (``plan.remat.remat_plan``, nothing dropped) and is
simulated on the roofline of cpu-generic (the peak does not depend on the times).
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
    ap.add_argument("--table", metavar="JSON", help="print a saved run as a markdown table")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return
    rows = run([m.strip() for m in args.models.split(",") if m.strip()], args.window)
    print(markdown(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
