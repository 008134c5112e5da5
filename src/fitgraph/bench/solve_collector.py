"""Benchmark: a solve with CPython's default garbage-collector thresholds against one with
``solvers.collector.fewer_collections`` (what ``solvers.solve`` does), interleaved.

    python -m fitgraph.bench.solve_collector [--models resnet50,vit-b16,bert-base]
        [--budgets 0.9,0.7,0.5] [--solvers auto] [--rounds 3]

Each zoo model in its small configuration is captured with AdamW and costed by op times
measured on this machine (``ProfiledCostModel``, its cache as ``fitgraph bench`` uses it). At
each budget (a fraction of the eager plan's simulated peak) each solver runs ``--rounds``
times each way, alternating which goes first; the table gives the median wall times, their
ratio, and whether the two ways made the same plan (same simulated step time and peak: they
must, the collector decides nothing). Prints a Markdown table (BENCHMARKS.md quotes it).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from ..solvers import SOLVERS, BudgetInfeasible, Problem, solve

__all__ = ["main", "time_both"]


def _default_gc(problem: Problem, solver: str):
    return SOLVERS[solver](problem)  # NOTE: the registry's function, without solve's wrapper


def time_both(problem: Problem, solver: str, rounds: int) -> dict:
    """Median seconds of ``solver`` on ``problem`` with the default collector and with
    ``solve``'s fewer collections, interleaved; ``same``: both made the same plan."""
    ways = {"default": _default_gc, "fewer": solve}
    times: dict[str, list[float]] = {k: [] for k in ways}
    sims = {}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            t0 = time.perf_counter()
            try:
                s = ways[name](problem, solver)
                sims[name] = (s.sim.latency_s, s.sim.peak_bytes)
            except BudgetInfeasible as e:
                sims[name] = ("infeasible", e.smallest_peak_bytes)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"default_s": med["default"], "fewer_s": med["fewer"],
            "ratio": med["fewer"] / med["default"], "same": sims["default"] == sims["fewer"]}


def _table(rows: list[dict]) -> str:
    out = ["| model | budget | solver | default collector (s) | fewer collections (s) | "
           "ratio | same plan |", "|---|---:|---|---:|---:|---:|---|"]
    out += [f"| {r['model']} | {r['budget']} | {r['solver']} | {r['default_s']:.2f} | "
            f"{r['fewer_s']:.2f} | {r['ratio']:.2f} | {'yes' if r['same'] else 'NO'} |"
            for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    from .. import capture, eager_plan, zoo
    from ..cost import ProfiledCostModel
    from ..sim import simulate

    p = argparse.ArgumentParser(prog="python -m fitgraph.bench.solve_collector",
                                description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,vit-b16,bert-base")
    p.add_argument("--budgets", default="0.9,0.7,0.5", help="fractions of the eager peak")
    p.add_argument("--solvers", default="auto")
    p.add_argument("--rounds", type=int, default=3, help="runs each way, interleaved")
    p.add_argument("--time-budget", type=float, default=30.0, help="each solve's time_budget_s")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in a.models.split(","):
        case = zoo.build(name, "small")
        g = capture(case.model, case.batch, case.loss_fn, torch.optim.AdamW(
            case.model.parameters()))
        cm = ProfiledCostModel(progress=False)
        cm.profile(g)
        eager = simulate(g, eager_plan(g), cm)
        for frac in (float(b) for b in a.budgets.split(",")):
            problem = Problem(g, cm, budget_bytes=int(frac * eager.peak_bytes),
                              time_budget_s=a.time_budget)
            for solver in a.solvers.split(","):
                rows.append(dict(model=name, budget=frac, solver=solver,
                                 **time_both(problem, solver, a.rounds)))
                print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{platform.machine()}, {torch.get_num_threads()} torch thread, python "
          f"{platform.python_version()}, torch {torch.__version__}\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
