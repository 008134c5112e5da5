"""The ``fitgraph`` command.

    fitgraph inspect MODEL [--config small|paper] [--batch N] [--json] [--plot FILE]
                           [--simulate-only] [--device-model NAME] [--optimizer adamw|adam|sgd|rmsprop|...|none]
    fitgraph optimize MODEL --budget 50% | --latency-limit 1.1 [--config small|paper] [--json]
                            [--optimizer-in-backward off|on|auto] [--plot FILE] [--csv FILE]
    fitgraph bench [--models gpt2,unet] [--budgets 0.9,0.7,0.5] [--out DIR]
    fitgraph plan-dist MODEL --devices N --global-batch B [--device a100-80gb]
                             [--gpus-per-node 8] [--fix tp=8,pp=8,...] [--json] [--plot FILE]
    fitgraph hw-search MODEL --global-batch B [--devices 1024] [--area-budget tpuv4|MM2]
                             [--objective throughput|perf-per-area|perf-per-watt] [--json]
    fitgraph models

Example:
    >>> from fitgraph.cli import build_parser
    >>> build_parser().parse_args(["inspect", "gpt2", "--json"]).json
    True
"""

from __future__ import annotations

import argparse
import json
import sys

from .cli_case import OPTIMIZERS, build_case

__all__ = ["build_parser", "main"]

MIB = 2**20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fitgraph", description="Make PyTorch training fit in "
                                "memory, fast: capture, simulate, plan and run a training step.")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="capture a built-in model's training step; simulated "
                         "vs measured peak, breakdown, top tensors, predicted vs measured time")
    ins.add_argument("model", help="a name from `fitgraph models`")
    ins.add_argument("--config", default="small", choices=["small", "paper"])
    ins.add_argument("--batch", type=int, default=None, help="batch size (default: config's)")
    ins.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.add_argument("--plot", metavar="FILE", help="write a PNG of memory over the step")
    ins.add_argument("--simulate-only", action="store_true", default=None,
                     help="do not run the step (automatic for configs that do not fit here)")
    ins.add_argument("--device-model", metavar="NAME", default=None,
                     help="plan for a roofline device model (rtx3090, a100-40gb, a100-80gb, "
                          "h100, cpu-generic) instead of measuring ops here")
    ins.add_argument("--repeats", type=int, default=3, help="timed steps (median reported)")
    ins.add_argument("--reprofile", action="store_true",
                     help="measure every op again, replacing the cached costs")
    ins.add_argument("--threads", type=int, default=1,
                     help="torch threads (1 gives stable timings on small machines)")
    from .cli_bench import add_parser as add_bench
    from .cli_hw_search import add_parser as add_hw_search
    from .cli_optimize import add_parser
    from .cli_plan_dist import add_parser as add_plan_dist
    from .demo_train import add_parser as add_demo_train

    add_parser(sub)
    add_bench(sub)
    add_plan_dist(sub)
    add_hw_search(sub)
    add_demo_train(sub)
    sub.add_parser("models", help="list the built-in models")
    return p


def _mib(b) -> str:
    return "-" if b is None else f"{b / MIB:,.1f} MiB"


def _fmt_s(s) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f} ms"


def format_inspect(r) -> str:
    lines = [f"fitgraph inspect: {r.model}", ""]
    phases = ", ".join(f"{k} {v}" for k, v in r.nodes_by_phase.items())
    lines += [f"graph          {r.nodes} nodes ({phases}), {r.storages} storages, "
              f"captured in {r.capture_s:.2f} s",
              f"cost model     {r.cost_model}"]
    if r.simulate_only:
        lines.append(f"simulate-only  {r.simulate_only_reason}")
    lines += ["", f"{'':22s}{'simulated':>14s}{'measured':>14s}{'eager PyTorch':>16s}",
              f"{'peak memory':22s}{_mib(r.simulated_peak_bytes):>14s}"
              f"{_mib(r.measured_peak_bytes):>14s}{_mib(r.eager_peak_bytes):>16s}",
              f"{'step time':22s}{_fmt_s(r.predicted_step_s):>14s}"
              f"{_fmt_s(r.measured_step_s):>14s}{_fmt_s(r.eager_step_s):>16s}"]
    if r.sim_vs_measured is not None:
        lines.append(f"{'simulated / measured':22s}{'peak ' + format(r.sim_vs_measured, '.4f'):>14s}"
                     f"{'time ' + format(r.time_prediction_ratio, '.2f'):>14s}")
    lines += ["", f"peak breakdown (resident before the step: {_mib(r.resident_bytes)})"]
    for k, v in sorted(r.breakdown.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:18s}{_mib(v):>14s}  {100 * v / r.simulated_peak_bytes:5.1f}%")
    lines += ["", "largest tensors alive at the peak"]
    for t in r.top_tensors:
        lines.append(f"  {_mib(t['nbytes']):>12s}  {t['role']:16s}{t['phase']:10s}"
                     f"{t['module'] or '<top>':30s}{t['name']}")
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    from .inspection import inspect_step
    from .report.plot import plot_memory

    case, opt = build_case(args)
    name = f"{args.model} ({args.config}: {case.description})"
    r = inspect_step(case.model, case.batch, case.loss_fn, opt, cost_model=args.device_model,
                     simulate_only=args.simulate_only, repeats=args.repeats, name=name,
                     progress=not args.json, reprofile=args.reprofile)
    if args.plot:
        plot_memory({"eager plan (simulated)": r.timeline}, args.plot, title=name,
                    phase_starts=r.phase_starts, resident_bytes=r.resident_bytes)
    if args.json:
        out = r.to_json()
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out, indent=2))
    else:
        print(format_inspect(r))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0


def cmd_models(args) -> int:
    from . import zoo

    for n in zoo.names():
        print(n)
    try:
        for n in zoo.hf_names():
            print(n, "(Hugging Face, needs the hf extra)")
    except ImportError:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .capture.errors import CaptureError
    from .execute.host_memory import keep_host_memory

    # NOTE: the command is a process of its own that times eager and planned steps: freed host
    # memory stays mapped for both (opt-in in a user's process: execute/host_memory.py)
    keep_host_memory()
    from .cli_bench import cmd_bench
    from .cli_hw_search import cmd_hw_search
    from .cli_optimize import cmd_optimize
    from .cli_plan_dist import cmd_plan_dist
    from .demo_train import cmd_demo_train
    from .solvers import BudgetInfeasible

    try:
        return {"inspect": cmd_inspect, "models": cmd_models,
                "optimize": cmd_optimize, "bench": cmd_bench,
                "plan-dist": cmd_plan_dist, "hw-search": cmd_hw_search,
                "demo-train": cmd_demo_train}[args.command](args)
    except (CaptureError, ValueError, BudgetInfeasible) as e:
        print(f"fitgraph: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
