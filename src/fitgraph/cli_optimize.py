"""``fitgraph optimize MODEL --budget 50% | --latency-limit 1.1``: plan a zoo model's step,
measure it against eager PyTorch, print the before/after table; CSV (MAGIS columns) and PNG."""

from __future__ import annotations

import dataclasses
import json
import time

from .cli_case import OPTIMIZERS, build_case

__all__ = ["add_parser", "cmd_optimize"]

MIB = 2**20
IN_BACKWARD = {"off": False, "on": True, "auto": "auto"}  # flag -> optimize(optimizer_in_backward=)


def add_parser(sub) -> None:
    p = sub.add_parser("optimize", help="plan a built-in model's step within a memory budget "
                       "(or latency limit) and compare it with eager PyTorch, measured")
    p.add_argument("model")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--budget", help="bytes, '800MB', '12GiB', '50%%', a fraction 0.5 or "
                        "'smallest' (the least peak fitgraph reaches)")
    target.add_argument("--latency-limit", type=float, help="factor of eager step time (1.1)")
    p.add_argument("--config", default="small", choices=["small", "paper"])
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--solver", default="auto",
                   help="auto (hotspot; joint where offloading frees device memory; "
                   "fission where it wins), hotspot, joint, fission, ...")
    p.add_argument("--optimizer-in-backward", default="off", choices=list(IN_BACKWARD),
                   help="update each parameter as soon as its gradient is complete and free "
                        "the gradient (on: an error if impossible; auto: only when possible)")
    p.add_argument("--exact", action="store_true",
                   help="only plans with eager's results bit for bit (no operator fission)")
    p.add_argument("--time-budget", type=float, default=30.0, help="solver time (s)")
    p.add_argument("--device-model", default=None, help="roofline device (paper configs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE")
    p.add_argument("--csv", metavar="FILE", help="MAGIS results.csv columns plus fitgraph's")


def _budget(value: str | None):
    if value is None:
        return None
    try:
        return float(value) if "." in value and value.replace(".", "", 1).isdigit() else (
            int(value) if value.isdigit() else value)
    except ValueError:
        return value


def cmd_optimize(args) -> int:
    from .api import optimize
    from .execute.executor import Executor
    from .measure import eager_step, measure_eager, measure_plan, time_interleaved
    from .transform.optimizer_in_backward import OptimizerInBackwardError

    if args.optimizer_in_backward == "on" and args.optimizer == "none":
        raise OptimizerInBackwardError(
            "--optimizer-in-backward on needs an optimizer update in the step: pass --optimizer "
            "adamw, sgd, rmsprop..., or --optimizer-in-backward auto to plan without it")
    case, opt = build_case(args)
    paper = args.config == "paper"
    measured = not paper
    eager_m = None
    if measured:
        eager_m = measure_eager(case.model, case.batch, case.loss_fn, opt, repeats=args.repeats)
    t0 = time.perf_counter()
    try:
        step = optimize(case.model, case.batch, case.loss_fn, opt, budget=_budget(args.budget),
                        latency_limit=args.latency_limit, time_budget=args.time_budget,
                        solver=args.solver,
                        cost_model=args.device_model or ("cpu-generic" if paper else None),
                        optimizer_in_backward=IN_BACKWARD[args.optimizer_in_backward],
                        exact=args.exact, progress=not args.json)
    except OptimizerInBackwardError as e:
        raise OptimizerInBackwardError(f"--optimizer-in-backward on: {e} "
                                       "(--optimizer-in-backward auto)") from e
    plan_s = time.perf_counter() - t0
    rep = step.report()
    planned = step._current()
    plan_m = None
    if measured:
        plan_m = measure_plan(planned.graph, planned.solution.plan, case.model, case.batch, opt,
                              repeats=0)
        # NOTE: both steps timed in interleaved rounds after planning (eager's before and the
        # plan's after it drifted apart by several % on this machine: GPT-2 within 1.05x read
        # +10.5% so, where the latency check's paired rounds read +2.5%)
        ex = Executor(planned.graph, planned.solution.plan, case.model, opt)
        timed = time_interleaved({"eager": eager_step(case.model, case.batch, case.loss_fn, opt),
                                  "plan": lambda: ex(case.batch)}, case.model, args.repeats)
        eager_m = dataclasses.replace(eager_m, step_s=timed["eager"].step_s,
                                      step_times=timed["eager"].step_times)
        plan_m = dataclasses.replace(plan_m, step_s=timed["plan"].step_s,
                                     step_times=timed["plan"].step_times)
    row = _row(args, case, rep, planned, eager_m, plan_m)
    out = {"model": args.model, "config": args.config, "description": case.description,
           "solver": rep.solver, "solve_s": rep.solve_s, "plan_s": plan_s,
           "budget_bytes": rep.budget_bytes, "latency_limit": rep.latency_limit,
           "eager": {"simulated_peak_bytes": rep.eager_peak_bytes,
                     "simulated_step_s": rep.eager_step_s,
                     "measured_peak_bytes": eager_m.peak_bytes if eager_m else None,
                     "measured_step_s": eager_m.step_s if eager_m else None},
           "fitgraph": {"simulated_peak_bytes": rep.planned_peak_bytes,
                        "simulated_step_s": rep.planned_step_s,
                        "measured_peak_bytes": plan_m.peak_bytes if plan_m else None,
                        "measured_step_s": plan_m.step_s if plan_m else None,
                        "recomputes": rep.recomputes},
           "optimizer_in_backward": {
               "requested": args.optimizer_in_backward,
               "status": rep.notes.get("optimizer_in_backward", "off"),
               "parameters_updated_in_backward": len(
                   planned.graph.meta.get("optimizer_in_backward", ()))},
           "cost_model": rep.cost_model, "simulate_only": not measured}
    if args.csv:
        from .report.magis_csv import write_rows

        write_rows(args.csv, [row])
        out["csv"] = args.csv
    if args.plot:
        from .plan.eager import eager_plan
        from .report.plot import plot_memory
        from .sim.simulate import simulate

        cm = step._cost()
        eager_sim = simulate(planned.graph, eager_plan(planned.graph), cm)
        plot_memory({"eager (simulated)": eager_sim.peak_during,
                     f"fitgraph {rep.solver} (simulated)": planned.solution.sim.peak_during},
                    args.plot, title=f"{args.model} ({args.config}): {case.description}",
                    phase_starts=eager_sim.phase_starts, resident_bytes=eager_sim.resident_bytes,
                    budget_bytes=rep.budget_bytes)
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(_table(out))
    return 0


def _row(args, case, rep, planned, eager_m, plan_m) -> dict:
    elems = 4  # NOTE: MAGIS counts fp32 elements
    weights = sum(planned.graph.storages[s].nbytes for s in planned.graph.input_storages()
                  if planned.graph.storages[s].role.value in ("parameter", "buffer"))
    return {
        "name": f"{args.model}-{args.config}", "device memory limit": "",
        "latency limit": "" if rep.latency_limit is None else rep.latency_limit * rep.eager_step_s,
        "memory limit": "" if rep.budget_bytes is None else rep.budget_bytes // elems,
        "latency limit ratio": rep.latency_limit or "",
        "memory limit ratio": "" if rep.budget_bytes is None
        else rep.budget_bytes / rep.eager_peak_bytes,
        "weight memory": weights // elems,
        "opt-is-prof-result": plan_m is not None,
        "opt-latency": plan_m.step_s if plan_m else "",
        "opt-memory": plan_m.peak_bytes // elems if plan_m else "",
        "opt-simul-latency": rep.planned_step_s, "opt-simul-memory": rep.planned_peak_bytes // elems,
        "ori-is-prof-result": eager_m is not None,
        "ori-latency": eager_m.step_s if eager_m else "",
        "ori-memory": eager_m.peak_bytes // elems if eager_m else "",
        "ori-simul-latency": rep.eager_step_s, "ori-simul-memory": rep.eager_peak_bytes // elems,
        "solver": rep.solver, "solve-s": rep.solve_s, "recomputes": rep.recomputes,
        "budget-bytes": rep.budget_bytes if rep.budget_bytes is not None else "",
        "opt-memory-bytes": plan_m.peak_bytes if plan_m else "",
        "ori-memory-bytes": eager_m.peak_bytes if eager_m else "",
        "opt-simul-memory-bytes": rep.planned_peak_bytes,
        "ori-simul-memory-bytes": rep.eager_peak_bytes, "cost-model": rep.cost_model,
    }


def _table(o: dict) -> str:
    def mib(b):
        return "-" if b is None else f"{b / MIB:,.1f} MiB"

    def ms(s):
        return "-" if s is None else f"{s * 1e3:,.1f} ms"

    e, f = o["eager"], o["fitgraph"]
    target = (f"budget {mib(o['budget_bytes'])}" if o["budget_bytes"] is not None
              else f"latency limit {o['latency_limit']:.2f}x")
    lines = [f"fitgraph optimize: {o['model']} ({o['config']}: {o['description']})",
             f"{target}; solver {o['solver']} in {o['solve_s']:.2f} s "
             f"({f['recomputes']} recomputes); costs: {o['cost_model']}"]
    oib = o["optimizer_in_backward"]
    if oib["requested"] != "off":
        lines.append(f"optimizer-in-backward: {oib['status']} "
                     f"({oib['parameters_updated_in_backward']} parameters updated in the backward)")
    lines.append("")
    if o["simulate_only"]:
        lines.append("simulate-only: paper-size configuration on the meta device\n")
    lines.append(f"{'':12s}{'sim peak':>13s}{'meas. peak':>13s}{'sim step':>12s}"
                 f"{'meas. step':>12s}{'overhead':>10s}")
    base = e["measured_step_s"] or e["simulated_step_s"]
    for name, r in (("eager", e), ("fitgraph", f)):
        t = r["measured_step_s"] or r["simulated_step_s"]
        lines.append(f"{name:12s}{mib(r['simulated_peak_bytes']):>13s}"
                     f"{mib(r['measured_peak_bytes']):>13s}{ms(r['simulated_step_s']):>12s}"
                     f"{ms(r['measured_step_s']):>12s}{100 * (t / base - 1):>+9.1f}%")
    pe = e["measured_peak_bytes"] or e["simulated_peak_bytes"]
    pf = f["measured_peak_bytes"] or f["simulated_peak_bytes"]
    lines.append(f"\npeak: {pf / pe:.2f}x eager")
    return "\n".join(lines)
