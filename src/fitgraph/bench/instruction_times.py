"""Where does the simulated step miss the measured one? Each instruction timed in place.

    python -m fitgraph.bench.instruction_times [--model gpt2] [--sweep]
                                    [--latency-limit 1.10 | --budget 0.4]
                                    [--solver hotspot] [--repeats 5] [--top 12]

Plans the zoo model's small configuration (``--sweep``: the sweep's model of that name)
(AdamW, this machine's measured op costs, one torch thread) for the latency limit (or the
budget: a fraction of eager's peak; the solver's own plan, without optimize's latency check),
then runs the captured graph's eager plan and the planned one (on the graph it runs: fission's
split one) through the executor instruction by instruction, a step of each in turn, timing each
(median over ``--repeats`` steps), and sets every instruction's time beside what the cost model
charged for it. Prints, per plan, the measured and simulated totals and the (kind, op) groups
that miss by the most, and the plan's step over the eager plan's, measured and simulated.
Inputs are the
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

__all__ = ["main", "misses", "timed_plans"]


def timed_plans(plans: dict, model, optimizer, batch, repeats: int) -> dict:
    """label -> the median seconds of each instruction of the plan ``plans[label]`` (a
    (graph, plan) pair: a plan runs on its own graph, fission's split one included) over
    ``repeats`` steps, one step of each plan in turn, after a step of each to warm up; run on
    copies of ``model`` and ``optimizer``: the step's optimizer nodes update the weights and
    state they are given.

    NOTE: step by step, not plan by plan: this machine's speed drifts by more than a plan's
    cost (U-Net small's eager plan: 230 then 324 ms a step in two consecutive runs), and two
    plans' medians taken minutes apart compare the moments, not the plans."""
    from ..execute.executor import Executor
    from .harness import _copied

    scratch, opt = _copied(model, optimizer)
    runs = {label: (Executor(graph, plan, scratch, opt), graph, plan)
            for label, (graph, plan) in plans.items()}
    per = {label: [[] for _ in plan] for label, (_, plan) in plans.items()}
    for r in range(repeats + 1):
        for label, run in runs.items():
            times = _one_step(*run, scratch, opt, batch)
            if r:   # NOTE: the first step of each warms up
                for ts, t in zip(per[label], times):
                    ts.append(t)
    return {label: [statistics.median(ts) for ts in per[label]] for label in plans}


def _one_step(ex, graph, plan, model, optimizer, batch) -> list[float]:
    """Seconds of each instruction of one step of ``plan`` through ``ex``."""
    from ..execute.executor import bind_inputs

    inputs = bind_inputs(graph, model, batch, optimizer)
    ex.env = env = [None] * len(graph.values)
    for vid, t in zip(graph.inputs, inputs):
        env[vid] = t
    del inputs
    out = []
    with torch.no_grad():
        for i, ins in enumerate(plan):
            t0 = time.perf_counter()
            ex.steps[i](ex, ins)
            out.append(time.perf_counter() - t0)
    ex.env, ex.rng_saved = [], {}
    return out


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
    # NOTE: the plan as its solver made it: optimize's latency check would plan again
    step = optimize(model, case.batch, case.loss_fn, opt, budget=args.budget,
                    latency_limit=limit, solver=args.solver, measure_latency=False)
    cm = step._cost()
    captured = step._capture(case.batch)   # NOTE: the plan may run on a rewritten graph
    constraint = f"budget {args.budget:g}" if limit is None else f"{limit:g}"
    plans = {"eager": (captured, solve(Problem(captured, cm, latency_limit=1.0), "eager").plan),
             f"{args.solver} {constraint}": (step.graph, step.plan)}
    times = timed_plans(plans, model, opt, case.batch, args.repeats)
    print(f"{case.name}, measured op costs ({cm.name}); medians of {args.repeats} steps, the "
          f"plans' steps in turn\n")
    totals = {}
    for label, (g, plan) in plans.items():
        meas, sim = _grouped(g, plan, times[label], cm)
        totals[label] = sum(meas.values()), sum(sim.values())
        print(f"{label}: measured {sum(meas.values()) * 1e3:.1f} ms, "
              f"simulated {sum(sim.values()) * 1e3:.1f} ms")
        print("| kind | op | measured (ms) | simulated (ms) | miss (ms) |")
        print("|---|---|---:|---:|---:|")
        for (kind, op), m, s in misses(meas, sim, args.top):
            print(f"| {kind} | {op or '—'} | {m * 1e3:.2f} | {s * 1e3:.2f} | "
                  f"{(m - s) * 1e3:+.2f} |")
        print()
    (me, se), (mp, sp) = totals.values()
    print(f"the plan over the eager plan: measured {mp / me:.3f}, simulated {sp / se:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
