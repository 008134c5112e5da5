"""Benchmark: step time of executing the eager plan vs eager PyTorch, interleaved, one thread.

    python -m fitgraph.bench.executor_overhead [--models gpt2,resnet50] [--repeats 15]

Each round runs one eager step and one executor step on the same model and optimizer (AdamW),
alternating which goes first, so that machine noise hits both alike; the overhead is the
median over rounds of the executor's step / eager's in the same round (``paired_ratio``). Prints a Markdown table (BENCHMARKS.md holds the latest).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from ..capture.api import capture
from ..capture.calling import compute_loss
from ..execute.executor import Executor
from ..execute.host_memory import keep_host_memory
from ..plan.eager import eager_plan
from .harness import paired_ratio

__all__ = ["measure_overhead", "main"]

DEFAULT_MODELS = ["resnet50", "unet", "vit-b16", "bert-base", "gpt2", "llama"]


def measure_overhead(model, batch, loss_fn, optimizer, repeats: int) -> tuple[float, float]:
    """(median eager step s, median per-round ratio executor / eager), interleaved."""
    def eager():
        loss = compute_loss(model, batch, loss_fn)
        loss.backward()
        optimizer.step()

    def zero():
        optimizer.zero_grad(set_to_none=True)

    keep_host_memory()  # NOTE: both time with warm memory (harness._time_rounds says why)
    zero()
    eager()  # NOTE: creates optimizer state, so the captured graph is the steady-state one
    zero()
    graph = capture(model, batch, loss_fn, optimizer)
    ex = Executor(graph, eager_plan(graph), model, optimizer)
    runners = {"eager": eager, "fitgraph": lambda: ex(batch)}
    times: dict[str, list[float]] = {"eager": [], "fitgraph": []}
    for r in range(repeats + 1):
        order = ["eager", "fitgraph"] if r % 2 == 0 else ["fitgraph", "eager"]
        for name in order:
            zero()
            t0 = time.perf_counter()
            runners[name]()
            if r > 0:  # NOTE: round 0 is warm-up
                times[name].append(time.perf_counter() - t0)
    zero()
    return statistics.median(times["eager"]), paired_ratio(times["fitgraph"], times["eager"])


def main(argv: list[str] | None = None) -> int:
    from .. import zoo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, torch "
          f"{torch.__version__}, {args.threads} thread(s), {args.repeats} interleaved rounds, "
          "AdamW, small configs\n")
    print("| model | eager step (ms) | fitgraph eager plan (ms) | overhead |")
    print("|---|---:|---:|---:|")
    for name in args.models.split(","):
        case = zoo.build(name, "small")
        opt = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
        e, ratio = measure_overhead(case.model, case.batch, case.loss_fn, opt, args.repeats)
        print(f"| {name} | {e * 1e3:.1f} | {e * ratio * 1e3:.1f} | {100 * (ratio - 1):+.1f}% |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
