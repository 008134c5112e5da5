"""Where does the simulated step miss the measured one? Each instruction timed in place.

    python -m fitgraph.bench.instruction_times [--model gpt2] [--sweep]
                                    [--latency-limit 1.10 | --budget 0.4]
                                    [--solver hotspot] [--repeats 5] [--top 12]

Plans the zoo model's small configuration (``--sweep``: the sweep's model of that name)
(AdamW, this machine's measured op costs, one torch thread) for the latency limit (or the
budget: a fraction of eager's peak), then runs eager's plan and the planned one through the executor
instruction by instruction, interleaved, timing each (median over ``--repeats`` steps), and sets
every instruction's time beside what the cost model charged for it. Prints, per plan, the
measured and simulated totals and the (kind, op) groups that miss by the most. Inputs are the
model's own weights and batch; optimizer nodes update scratch copies of its state, so the model
is left as it was.

Example:
    >>> from fitgraph.bench.instruction_times import misses
    >>> misses({("Compute", "aten.mm.default"): 3.0}, {("Compute", "aten.mm.default"): 2.0}, 1)
    [(('Compute', 'aten.mm.default'), 3.0, 2.0)]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

__all__ = ["main", "misses", "timed_instructions", "timed_plans"]


def timed_instructions(graph, plan, model, optimizer, batch, repeats: int) -> list[float]:
    """Median seconds of each instruction of ``plan`` over ``repeats`` steps."""
    from ..execute.executor import Executor, bind_inputs

    ex = Executor(graph, plan, model, optimizer)
    per: list[list[float]] = [[] for _ in plan]
    for _ in range(repeats):
        inputs = bind_inputs(graph, model, batch, optimizer)
        ex.env = env = [None] * len(graph.values)
        for vid, t in zip(graph.inputs, inputs):
            env[vid] = t
        del inputs
        with torch.no_grad():
            for i, ins in enumerate(plan):
                t0 = time.perf_counter()
                ex.steps[i](ex, ins)
                per[i].append(time.perf_counter() - t0)
        ex.env, ex.rng_saved = [], {}
    return [statistics.median(ts) for ts in per]


def timed_plans(graph, plans: dict, model, optimizer, batch, repeats: int) -> dict:
    """label -> ``timed_instructions`` of each plan, the plans interleaved (twice, the second
    pass kept), run on copies of ``model`` and ``optimizer``: the step's optimizer nodes
    update the weights and state they are given."""
    from .harness import _copied

    scratch, opt = _copied(model, optimizer)
    times: dict = {}
    for _ in range(2):  # NOTE: interleaved: both plans see the machine alike
        for label, plan in plans.items():
            times[label] = timed_instructions(graph, plan, scratch, opt, batch, repeats)
    return times


def misses(measured: dict, simulated: dict, top: int) -> list[tuple]:
    """The ``top`` groups by |measured - simulated|: (group, measured, simulated)."""
    keys = sorted(measured, key=lambda k: -abs(measured[k] - simulated.get(k, 0.0)))
    return [(k, measured[k], simulated.get(k, 0.0)) for k in keys[:top]]


def _grouped(graph, plan, times, cm) -> tuple[dict, dict]:
    meas: dict = defaultdict(float)
    sim: dict = defaultdict(float)
    for ins, t in zip(plan, times):
        kind = type(ins).__name__
        node = getattr(ins, "node", None)
        key = (kind, graph.nodes[node].target if kind in ("Compute", "Recompute") else "")
        meas[key] += t
        if kind in ("Compute", "Recompute"):
            sim[key] += cm.node_cost(graph, graph.nodes[node]).seconds
    return meas, sim


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    from .. import zoo
    from ..api import optimize
    from ..capture.calling import compute_loss
    from ..solvers import Problem, solve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--sweep", action="store_true",
                    help="the sweep's model of that name (bench/sweep_models.py)")
    ap.add_argument("--latency-limit", type=float, default=1.10)
    ap.add_argument("--budget", type=float, default=None,
                    help="a fraction of eager's peak: plan for least time within it instead")
    ap.add_argument("--solver", default="hotspot")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.sweep:
        from .sweep_models import build

        case = build(args.model)
    else:
        case = zoo.build(args.model, "small")
    model = case.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compute_loss(model, case.batch, case.loss_fn).backward()  # NOTE: AdamW state exists
    opt.step()
    opt.zero_grad(set_to_none=True)
    limit = None if args.budget is not None else args.latency_limit
    step = optimize(model, case.batch, case.loss_fn, opt, budget=args.budget,
                    latency_limit=limit, solver=args.solver)
    g, cm = step.graph, step._cost()
    constraint = f"budget {args.budget:g}" if limit is None else f"{limit:g}"
    plans = {"eager": solve(Problem(g, cm, latency_limit=1.0), "eager").plan,
             f"{args.solver} {constraint}": step.plan}
    times = timed_plans(g, plans, model, opt, case.batch, args.repeats)
    print(f"{case.name}, measured op costs ({cm.name}); medians of {args.repeats} steps\n")
    for label, plan in plans.items():
        meas, sim = _grouped(g, plan, times[label], cm)
        print(f"{label}: measured {sum(meas.values()) * 1e3:.1f} ms, "
              f"simulated {sum(sim.values()) * 1e3:.1f} ms")
        print("| kind | op | measured (ms) | simulated (ms) | miss (ms) |")
        print("|---|---|---:|---:|---:|")
        for (kind, op), m, s in misses(meas, sim, args.top):
            print(f"| {kind} | {op or '—'} | {m * 1e3:.2f} | {s * 1e3:.2f} | "
                  f"{(m - s) * 1e3:+.2f} |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
