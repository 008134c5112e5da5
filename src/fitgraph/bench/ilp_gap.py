"""How far is the production solver from optimal? ILP vs hotspot on zoo-derived graphs.

    python -m fitgraph.bench.ilp_gap [--graphs gpt2:4:8,vit-b16:4:32] [--budgets 0.8,0.6,0.4]
                                     [--time-limit 120] [--relaxation]

A zoo-derived graph (``GRAPH:BLOCKS:BATCH``) is the first ``BLOCKS`` blocks of a zoo model's
small configuration at batch ``BATCH`` (``bench.derived.block_stack``: the model's own blocks
on the hidden states they receive, MSE loss; ``GRAPH:BLOCKS:BATCH:nodropout`` without dropout),
captured without an optimizer and costed with the
RTX 3090 roofline model (deterministic, no profiling). The batch is large enough that
activations dominate, as in a deep model, so 40% of the eager peak is reachable.

For each budget (a fraction of the eager peak) it prints the ILP's status and proven gap, both
solvers' simulated step time relative to eager, and two ratios: hotspot / ILP incumbent, and
hotspot / the ILP's proven lower bound (``(1 - gap) ×`` its incumbent's step time) — an upper
bound on how far hotspot is from the optimum, proven even when HiGHS stops at its time limit —
and the ILP's schedule read as a drop set in hotspot's own model (below hotspot's time: a plan
hotspot can express but did not find).
The ILP schedules in the captured order; hotspot also reorders, so it may beat the "optimum".
Checkmate's LP relaxation is weak: graphs of a few hundred units often stop with a gap;
``--relaxation`` adds the relaxation's own bound / eager (where branch-and-bound starts).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from torch import nn

__all__ = ["DERIVED", "GRAPHS", "derived", "gap_row", "main"]

DERIVED = ("gpt2", "bert-base", "vit-b16", "llama", "resnet50")
# NOTE: block stacks whose floor is under 40% of eager (3-4 blocks at a batch where activations
# are ~97% of the peak), one per zoo model; without dropout the transformers' MILPs are smaller
# (BERT's 3 blocks: 111 units, not 195) and prove at 40%, as Llama's (no dropout) does
GRAPHS = ("llama:3:16", "bert-base:3:8:nodropout", "vit-b16:3:32:nodropout",
          "gpt2:4:8:nodropout", "resnet50:6:32")


def derived(name: str, blocks: int = 1):
    """The zoo model's small configuration with only its first ``blocks`` blocks (embedding
    and head kept).

    Example:
        >>> case = derived("gpt2")
        >>> len(case.model.h)
        1
    """
    from .. import zoo

    case = zoo.build(name, "small")
    m = case.model
    for attr in ("h", "layers", "blocks"):
        if isinstance(getattr(m, attr, None), nn.ModuleList):
            setattr(m, attr, getattr(m, attr)[:blocks])
            return case
    if name == "resnet50":
        stages = [m.layer1, m.layer2, m.layer3, m.layer4]
        for i in range(len(stages)):
            if i >= blocks:
                setattr(m, f"layer{i + 1}", nn.Identity())
        width = stages[min(blocks, 4) - 1][-1].conv3.out_channels
        m.fc = nn.Linear(width, m.fc.out_features)
        return case
    raise ValueError(f"no derived graph for zoo model {name!r}; known: {', '.join(DERIVED)}")


def gap_row(graph, cm, budget: int, eager, time_limit_s: float) -> dict:
    """ILP and hotspot at one budget: status, gap, step times / eager and the two ratios
    (None where a solver found the budget infeasible)."""
    from ..solvers import BudgetInfeasible, Problem, solve

    out: dict = {}
    ilp_none = "infeasible"
    for solver in ("ilp", "hotspot"):
        t0 = time.perf_counter()
        try:
            out[solver] = solve(Problem(graph, cm, budget_bytes=budget,
                                        time_budget_s=time_limit_s), solver)
        except BudgetInfeasible as e:
            out[solver] = None
            if solver == "ilp" and "time limit" in e.solver:
                ilp_none = "no schedule in time"  # NOTE: not proven infeasible
        out[f"{solver}_s"] = time.perf_counter() - t0
    ilp, hot = out["ilp"], out["hotspot"]
    row = {"ilp_status": (ilp_none if ilp is None
                          else "optimal" if ilp.optimal else "time limit"),
           "ilp_gap": None if ilp is None else ilp.gap, "ilp_s": out["ilp_s"],
           "ilp_time": None if ilp is None else ilp.sim.latency_s / eager.latency_s,
           "hotspot_time": None if hot is None else hot.sim.latency_s / eager.latency_s,
           "vs_ilp": None, "vs_bound": None,
           "in_hotspot_model": None if ilp is None else _in_hotspot_model(graph, cm, ilp, budget,
                                                                          eager)}
    if ilp is not None and hot is not None:
        row["vs_ilp"] = hot.sim.latency_s / ilp.sim.latency_s
        row["vs_bound"] = hot.sim.latency_s / (ilp.sim.latency_s * (1 - ilp.gap))
    return row


def _in_hotspot_model(graph, cm, ilp, budget: int, eager) -> float | str:
    """The ILP's schedule as a drop set in ``hotspot``'s own model (each recomputed node
    dropped after the forward and recomputed at its first backward use, captured order; those
    the ILP recomputes more than once dropped per use, ``plan.remat.per_use``): its step time
    / eager if it fits ``budget`` — where that beats hotspot, hotspot's search missed a plan it
    can express — else why not."""
    from ..plan.instructions import Recompute
    from ..plan.remat import RematError, per_use, remat_tables
    from ..sim.remat_eval import RematEvaluator

    counts: dict[int, int] = {}
    for ins in ilp.plan.instructions:
        if isinstance(ins, Recompute):
            counts[ins.node] = counts.get(ins.node, 0) + 1
    drop = [per_use(graph, nid) if c > 1 else nid for nid, c in counts.items()]
    try:
        r = RematEvaluator(graph, cm, tables=remat_tables(graph)).evaluate(drop)
    except RematError:
        return "not a drop set"
    return r.latency_s / eager.latency_s if r.peak_bytes <= budget else "over budget"


def _model_cell(x) -> str:
    return x if isinstance(x, str) else _fmt(x, ".3f")


def _fmt(x, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    from ..capture.api import capture
    from ..cost.devices import DEVICES
    from ..cost.roofline import RooflineCostModel
    from ..solvers import Problem, solve
    from ..solvers.remat.ilp import solve_stages
    from ..solvers.remat.stages import stage_graph
    from .derived import block_stack

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default=",".join(GRAPHS), help="GRAPH:BLOCKS:BATCH[:nodropout],...")
    ap.add_argument("--budgets", default="0.8,0.6,0.4")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--relaxation", action="store_true",
                    help="add the LP relaxation's bound (integrality off) / eager per cell")
    args = ap.parse_args(argv)
    cm = RooflineCostModel(DEVICES["rtx3090"])
    print(f"machine: {platform.machine()}, torch {torch.__version__}, RTX 3090 roofline costs, "
          f"zoo block stacks (small configs), no optimizer; ILP time limit "
          f"{args.time_limit:g} s\n")
    lp_col = " LP relaxation / eager |" if args.relaxation else ""
    print("| graph | units | budget | ILP status | ILP gap | ILP solve (s) | ILP time / eager "
          "| hotspot time / eager | hotspot / ILP | hotspot / ILP bound "
          "| ILP's drop set in hotspot's model / eager |" + lp_col)
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if lp_col else ""))
    for spec in args.graphs.split(","):
        name, blocks, batch, *flags = spec.split(":")
        unknown = set(flags) - {"nodropout"}
        if unknown:
            raise SystemExit(f"unknown graph flag(s) {', '.join(sorted(unknown))} in {spec!r}; "
                             "known: nodropout")
        case = block_stack(name, int(blocks), int(batch), dropout="nodropout" not in flags)
        g = capture(case.model, case.batch, case.loss_fn)
        sg = stage_graph(g, cm)
        units = len(sg.units)
        eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
        for frac in (float(b) for b in args.budgets.split(",")):
            r = gap_row(g, cm, int(frac * eager.peak_bytes), eager, args.time_limit)
            lp = ""
            if args.relaxation:
                root = solve_stages(sg, int(frac * eager.peak_bytes),
                                    time_limit_s=args.time_limit, relaxed=True)
                bound = (root.objective / eager.latency_s if root.status == "optimal"
                         else None)
                lp = f" {_fmt(bound, '.3f')} |"
            tag = ", no dropout" if "nodropout" in flags else ""
            print(f"| {name} ({blocks} blocks, batch {batch}{tag}) | {units} | {frac:.0%} "
                  f"| {r['ilp_status']} | {_fmt(r['ilp_gap'], '.1%', '')} | {r['ilp_s']:.0f} "
                  f"| {_fmt(r['ilp_time'], '.3f')} "
                  f"| {_fmt(r['hotspot_time'], '.3f', 'infeasible')} "
                  f"| {_fmt(r['vs_ilp'], '.3f')} | {_fmt(r['vs_bound'], '.3f')} "
                  f"| {_model_cell(r['in_hotspot_model'])} |{lp}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
