"""``fitgraph bench [--models ...] [--budgets 0.9,0.7,0.5] [--systems ...] [--report DIR]``:
every system side by side, measured.

Writes a CSV (one row per system and budget), one PNG per model (measured peak vs step time, one
curve per system) and prints a Markdown table, then one verdict per peer: fitgraph asked for that
peer's measured peak, and whether it is faster there. ``--report DIR``: also one Markdown page
(``bench.report_page``) with the machine, the command, and per model the plot and summary tables.
"""

from __future__ import annotations

import os
import platform
import shlex
import time

from .bench.harness import COMPILERS, SYSTEMS
from .bench.report_page import markdown_table
from .report.plot import plot_tradeoff
from .units import parse_budget

__all__ = ["add_parser", "cmd_bench", "markdown_table", "plot_tradeoff"]

DEFAULT_MODELS = "resnet50,unet,vit-b16,bert-base,gpt2,llama"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="eager, per-block (selective) checkpointing, save_on_cpu, "
                       "torch.compile's memory budget, DTR, Rotor, Checkmate and fitgraph, "
                       "measured side by side on zoo models")
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--budgets", default="0.9,0.7,0.5",
                   help="fractions of the eager peak for the planners and torch.compile")
    p.add_argument("--systems", default="all",
                   help=f"comma-separated, from {','.join(SYSTEMS)} (default all; eager always "
                        "runs: overheads are against it)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--no-compile", action="store_true",
                   help="skip torch.compile variants (same as leaving them out of --systems)")
    p.add_argument("--time-budget", type=float, default=30.0,
                   help="solver time for fitgraph, dtr and rotor (s)")
    p.add_argument("--checkmate-time-limit", type=float, default=60.0,
                   help="Checkmate's MILP time limit (s); where it stops there, the row says "
                        "so with the proven gap")
    p.add_argument("--solver", default="auto", help="fitgraph's solver (auto: hotspot, joint "
                   "where offloading frees device memory, fission where it wins)")
    p.add_argument("--out", default="out/bench", help="folder for bench.csv and PNGs")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="write DIR/BENCHMARKS.md (machine, command, per model: plot, summary "
                        "tables, all rows, verdicts, errors) with its PNGs and bench.csv")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where models run: cpu or cuda (save_on_cpu "
                   "and fitgraph's offloading copy over PCIe there)")
    p.add_argument("--config", default="small", help="zoo configuration: small (CPU-sized) or "
                   "paper (the papers' sizes; for a GPU)")


def bench_budgets(text: str) -> list[float]:
    """``--budgets`` as fractions of the eager peak; a ValueError naming a bad one (the CLI
    exits with status 2 before measuring anything)."""
    out = []
    for item in (b.strip() for b in text.split(",")):
        if not item:
            continue
        try:
            value = float(item.removesuffix("%")) / (100 if item.endswith("%") else 1)
        except ValueError:
            raise ValueError(f"--budgets: cannot read {item!r}: give fractions of the eager "
                             "peak like 0.9,0.7,0.5") from None
        parse_budget(value, eager_peak_bytes=1)
        out.append(value)
    return out


def chosen_systems(args) -> list[str]:
    """``--systems`` (and ``--no-compile``) as a list in ``SYSTEMS`` order; unknown names are
    an error listing the known ones."""
    names = list(SYSTEMS) if args.systems == "all" else [
        s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"fitgraph bench: error: unknown systems {unknown}; known: "
                         f"{','.join(SYSTEMS)}")
    if args.no_compile:
        names = [s for s in names if s not in COMPILERS and s != "fitgraph_inductor"]
    return [s for s in SYSTEMS if s in names or s == "eager"]


def command(args, systems: list[str]) -> str:
    """The command line that reproduces this run, every setting spelled out."""
    parts = ["fitgraph", "bench", "--models", args.models, "--budgets", args.budgets,
             "--systems", ",".join(systems), "--repeats", str(args.repeats),
             "--time-budget", f"{args.time_budget:g}",
             "--checkmate-time-limit", f"{args.checkmate_time_limit:g}",
             "--solver", args.solver, "--threads", str(args.threads), "--out", args.out]
    if args.device != "cpu" or args.config != "small":
        parts += ["--device", args.device, "--config", args.config]
    if args.report:
        parts += ["--report", args.report]
    return " ".join(shlex.quote(p) for p in parts)


def cmd_bench(args) -> int:
    import torch

    from . import zoo
    from .bench.harness import BenchRow, bench_model
    from .bench.report_page import write_csv, write_report
    from .bench.verdicts import verdicts

    systems = chosen_systems(args)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    budgets = bench_budgets(args.budgets)
    rows: list[BenchRow] = []
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else platform.machine())
    print(f"machine: {where}, torch {torch.__version__}, {args.threads} thread(s), "
          f"AdamW, {args.config} configs, {args.repeats} interleaved rounds, fitgraph solver "
          f"{args.solver}; systems: {', '.join(systems)}\n")
    for name in args.models.split(","):
        case = zoo.build(name, args.config, device=args.device)
        model_rows = bench_model(case, budgets, systems=systems, repeats=args.repeats,
                                 time_budget=args.time_budget,
                                 checkmate_time_limit=args.checkmate_time_limit,
                                 solver=args.solver)
        rows += model_rows
        plot_tradeoff(model_rows, os.path.join(args.out, f"{name}.png"))
    path = os.path.join(args.out, "bench.csv")
    write_csv(rows, path)
    print(markdown_table(rows))
    print("\nAt each peer's measured peak (fitgraph planned for that many bytes):\n")
    print("\n".join(f"- {line}" for line in verdicts(rows)))
    print(f"\nwrote {path} and one PNG per model in {args.out}")
    if args.report:
        page = write_report(rows, args.report, command=command(args, systems),
                            threads=args.threads, repeats=args.repeats,
                            checkmate_time_limit=args.checkmate_time_limit,
                            wall_s=time.perf_counter() - t0,
                            load=(load0, os.getloadavg()[0]))
        print(f"wrote {page} with its PNGs and bench.csv")
    return 0
