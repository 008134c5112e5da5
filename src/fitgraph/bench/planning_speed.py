"""Benchmark: how long the production solver (``hotspot``) takes to plan, and what it plans.

    python -m fitgraph.bench.planning_speed [--models bert-base] [--budgets 0.8,0.6,0.4]
        [--deep-layers 64] [--small gpt2,bert-base,vit-b16,unet,resnet50] [--device rtx3090]

Paper-size configurations are captured on fake tensors (meta device, AdamW), so nothing is
allocated; the cost model is the roofline of ``--device`` (no profiling). For each budget (a
fraction of the eager plan's simulated peak) it reports the wall time to plan, the simulated
step time and peak relative to eager, and how the solver got there. ``--deep-layers N`` adds
GPT-2's paper configuration with N layers (64 layers: ~10,000 nodes); ``--small`` adds zoo
models in their small configurations. Prints a Markdown table (BENCHMARKS.md holds the latest).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import torch

from ..capture.api import capture
from ..cost.devices import get_device
from ..cost.roofline import RooflineCostModel
from ..graph.ir import Graph
from ..solvers import BudgetInfeasible, Problem, solve

__all__ = ["deep_gpt2", "main", "plan_row", "zoo_graph"]


def zoo_graph(name: str, config: str) -> Graph:
    """The AdamW training step of zoo model ``name`` (paper configs on the meta device)."""
    from .. import zoo

    case = zoo.build(name, config, device="meta" if config == "paper" else "cpu")
    opt = torch.optim.AdamW(case.model.parameters())
    return capture(case.model, case.batch, case.loss_fn, opt)


def deep_gpt2(layers: int) -> Graph:
    """GPT-2's paper configuration (d=768, batch 8, seq 1024) with ``layers`` blocks, on fake
    tensors, with AdamW: 64 layers make a 10,000-node graph."""
    from ..zoo import gpt2
    from ..zoo.registry import BuildArgs, construct, generator, rand_ints, token_lm_loss

    cfg = dataclasses.replace(gpt2._CONFIGS["gpt2"]["paper"], n_layer=layers)
    args = BuildArgs("gpt2", "paper", None, None, None, torch.device("meta"), torch.float32, 0)
    model = construct(lambda: gpt2.GPT2LM(cfg), args)
    tokens = rand_ints((cfg.batch_size, cfg.seq_len + 1), cfg.vocab_size, generator(args), args)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    return capture(model, batch, token_lm_loss, torch.optim.AdamW(model.parameters()))


def plan_row(label: str, graph: Graph, cost_model, fraction: float,
             time_budget_s: float) -> dict:
    """Plan ``graph`` at ``fraction`` of its eager peak; the table row."""
    eager = solve(Problem(graph, cost_model, latency_limit=1.0), "eager").sim
    budget = int(fraction * eager.peak_bytes)
    t0 = time.perf_counter()
    row = {"model": label, "nodes": len(graph.nodes), "budget": fraction}
    try:
        s = solve(Problem(graph, cost_model, budget_bytes=budget, time_budget_s=time_budget_s),
                  "hotspot")
    except BudgetInfeasible as e:
        row.update(plan_s=time.perf_counter() - t0, error="infeasible, smallest peak "
                   f"{e.smallest_peak_bytes / eager.peak_bytes:.3f} of eager")
        return row
    row.update(plan_s=time.perf_counter() - t0, latency=s.sim.latency_s / eager.latency_s,
               peak=s.sim.peak_bytes / eager.peak_bytes, evaluations=s.notes["evaluations"],
               timed_out=s.notes["timed_out"], order=s.notes["order"])
    return row


def _table(rows: list[dict]) -> str:
    out = ["| model | nodes | budget | plan (s) | latency / eager | peak / eager | "
           "evaluations | best start |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['nodes']} | {r['budget']} | {r['plan_s']:.2f} | "
                       f"{r['error']} | | | |")
        else:
            late = " (timed out)" if r["timed_out"] else ""
            out.append(f"| {r['model']} | {r['nodes']} | {r['budget']} | {r['plan_s']:.2f}{late}"
                       f" | {r['latency']:.4f} | {r['peak']:.4f} | {r['evaluations']} | "
                       f"{r['order']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    p = argparse.ArgumentParser(prog="python -m fitgraph.bench.planning_speed",
                                description=__doc__.split("\n")[0])
    p.add_argument("--models", default="bert-base", help="paper configs, comma-separated")
    p.add_argument("--budgets", default="0.8,0.6,0.4", help="fractions of the eager peak")
    p.add_argument("--deep-layers", type=int, default=64,
                   help="GPT-2 paper config with this many layers (0: none)")
    p.add_argument("--deep-budgets", default="0.6")
    p.add_argument("--small", default="", help="zoo models in small configs, comma-separated")
    p.add_argument("--device", default="rtx3090", help="roofline device")
    p.add_argument("--time-budget", type=float, default=30.0, help="hotspot's time_budget_s")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cm = RooflineCostModel(get_device(a.device))
    cases: list[tuple[str, callable, list[float]]] = []
    budgets = [float(b) for b in a.budgets.split(",")]
    cases += [(f"{m} (paper)", lambda m=m: zoo_graph(m, "paper"), budgets)
              for m in a.models.split(",") if m]
    if a.deep_layers:
        cases.append((f"gpt2 paper, {a.deep_layers} layers", lambda: deep_gpt2(a.deep_layers),
                      [float(b) for b in a.deep_budgets.split(",")]))
    cases += [(f"{m} (small)", lambda m=m: zoo_graph(m, "small"), budgets)
              for m in a.small.split(",") if m]
    rows = []
    for label, build, fractions in cases:
        t0 = time.perf_counter()
        graph = build()
        print(f"captured {label}: {len(graph.nodes)} nodes in {time.perf_counter() - t0:.1f} s",
              flush=True)
        for f in fractions:
            rows.append(plan_row(label, graph, cm, f, a.time_budget))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{platform.python_version()}, torch {torch.__version__}, {cm.name}\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
