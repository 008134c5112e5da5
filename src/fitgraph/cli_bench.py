"""``fitgraph bench [--models ...] [--budgets 0.9,0.7,0.5]``: every system side by side, measured.

Writes a CSV (one row per system and budget), one PNG per model (measured peak vs step time, one
curve per system) and prints a Markdown table, then one verdict per peer: fitgraph asked for that
peer's measured peak, and whether it is faster there.
"""

from __future__ import annotations

import csv
import os
import platform

__all__ = ["add_parser", "cmd_bench", "plot_tradeoff"]

MIB = 2**20
DEFAULT_MODELS = "resnet50,unet,vit-b16,bert-base,gpt2,llama"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="eager, per-block checkpoint, torch.compile's memory "
                       "budget and fitgraph, measured side by side on zoo models")
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--budgets", default="0.9,0.7,0.5",
                   help="fractions of the eager peak for fitgraph and torch.compile")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile variants")
    p.add_argument("--time-budget", type=float, default=30.0, help="fitgraph solver time (s)")
    p.add_argument("--solver", default="auto", help="fitgraph's solver (auto: hotspot, joint "
                   "where offloading frees device memory, fission where it wins)")
    p.add_argument("--out", default="out/bench", help="folder for bench.csv and PNGs")
    p.add_argument("--threads", type=int, default=1)


def cmd_bench(args) -> int:
    import torch

    from . import zoo
    from .bench.harness import BenchRow, bench_model, verdicts

    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",") if b]
    rows: list[BenchRow] = []
    print(f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"AdamW, small configs, {args.repeats} interleaved rounds, fitgraph solver "
          f"{args.solver}\n")
    for name in args.models.split(","):
        case = zoo.build(name, "small")
        model_rows = bench_model(case, budgets, repeats=args.repeats,
                                 compile=not args.no_compile, time_budget=args.time_budget,
                                 solver=args.solver)
        rows += model_rows
        plot_tradeoff(model_rows, os.path.join(args.out, f"{name}.png"))
    path = os.path.join(args.out, "bench.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].as_dict()) + ["peak_vs_eager",
                                                                    "overhead"])
        w.writeheader()
        for r in rows:
            e = _eager(rows, r.model)
            w.writerow({**r.as_dict(), "peak_vs_eager": _ratio(r.peak_bytes, e.peak_bytes),
                        "overhead": r.overhead(e.step_s) if e.step_s else None})
    print(markdown_table(rows))
    print("\nAt each peer's measured peak (fitgraph planned for that many bytes):\n")
    print("\n".join(f"- {line}" for line in verdicts(rows)))
    print(f"\nwrote {path} and one PNG per model in {args.out}")
    return 0


def _eager(rows, model):
    return next(r for r in rows if r.model == model and r.system == "eager")


def _ratio(a, b):
    return None if a is None or not b else a / b


def markdown_table(rows) -> str:
    out = ["| model | system | budget | peak (MiB) | peak / eager | step (ms) | overhead | "
           "compile/solve (s) | error |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        e = _eager(rows, r.model)
        pr = _ratio(r.peak_bytes, e.peak_bytes)
        ov = r.overhead(e.step_s) if e.step_s else None
        system = f"{r.system} @ {r.matched}" if r.matched else r.system
        budget = "" if r.budget is None else f"{r.budget:.3g}"
        out.append(f"| {r.model} | {system} | {budget} | "
                   f"{'' if r.peak_bytes is None else f'{r.peak_bytes / MIB:.1f}'} | "
                   f"{'' if pr is None else f'{pr:.2f}'} | "
                   f"{'' if r.step_s is None else f'{r.step_s * 1e3:.0f}'} | "
                   f"{'' if ov is None else f'{100 * ov:+.1f}%'} | {r.prepare_s:.1f} | "
                   f"{r.error} |")
    return "\n".join(out)


def plot_tradeoff(rows, path: str) -> None:
    """Measured peak vs step time, one curve per system (the trade-off curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=110)
    for system in dict.fromkeys(r.system for r in rows):
        pts = sorted((r.step_s * 1e3, r.peak_bytes / MIB) for r in rows
                     if r.system == system and r.step_s is not None and r.peak_bytes is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=system)
    ax.set_xlabel("step time (ms, median, measured)")
    ax.set_ylabel("peak memory (MiB, measured)")
    ax.set_title(f"{rows[0].model}: memory vs time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
