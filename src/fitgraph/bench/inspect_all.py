"""Benchmark table: for each zoo model, simulated vs measured eager-plan peak and step time.

    python -m fitgraph.bench.inspect_all [--models gpt2,unet] [--repeats 5]

Prints a Markdown table (BENCHMARKS.md holds the latest). One thread, AdamW, small configs;
ops profiled on this machine (cached).
"""

from __future__ import annotations

import argparse
import platform

import torch

from ..inspection import inspect_step

__all__ = ["main"]

MIB = 2**20


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    from .. import zoo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(zoo.names()))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, 1 thread, AdamW, small "
          f"configs, medians of {args.repeats} steps\n")
    print("| model | nodes | capture (s) | eager PyTorch peak (MiB) | eager plan measured (MiB) "
          "| simulated (MiB) | sim / measured | eager plan vs PyTorch | predicted / measured time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        case = zoo.build(name, "small")
        opt = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
        r = inspect_step(case.model, case.batch, case.loss_fn, opt, repeats=args.repeats,
                         name=name)
        print(f"| {name} | {r.nodes} | {r.capture_s:.2f} | {r.eager_peak_bytes / MIB:.1f} | "
              f"{r.measured_peak_bytes / MIB:.1f} | {r.simulated_peak_bytes / MIB:.1f} | "
              f"{r.sim_vs_measured:.4f} | {r.measured_peak_bytes / r.eager_peak_bytes:.4f} | "
              f"{r.time_prediction_ratio:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
