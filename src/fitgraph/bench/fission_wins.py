"""What operator fission finds by itself: eager vs ``hotspot`` vs ``fission``, simulated.

    python -m fitgraph.bench.fission_wins [--models gpt2-50k,unet,llama] [--latency 1.05]
    python -m fitgraph.bench.fission_wins --config small --budgets 0.7,0.5,0.3

Each graph is captured on the meta device (nothing is allocated or run) and costed with the
RTX 3090 roofline model, so the numbers are deterministic and need no GPU. ``gpt2-50k`` is GPT-2
with its real 50,257-token vocabulary at sequence 1024 (3 layers of width 256, batch 1, no
dropout: the LM head and the loss dominate — the classic chunked cross-entropy case); the others
are the zoo's paper configurations (no optimizer in the step). For each, the least peak within
``--latency`` × the eager step: remat alone (``hotspot``) and fission with remat on top
(``fission``), and what the search split. With ``--budgets``, the fastest plan of each within
each fraction of the eager peak instead, and fission's solve time.
"""

from __future__ import annotations

import argparse
import time

import torch

__all__ = ["gpt2_50k", "main"]


def gpt2_50k():
    """(model, batch, loss_fn) of GPT-2 with a 50k vocabulary, on the meta device.

    Example:
        >>> model, batch, loss_fn = gpt2_50k()
        >>> tuple(batch["input_ids"].shape), model.wte.num_embeddings
        ((1, 1024), 50257)
    """
    from ..zoo.gpt2 import GPT2LM, GPT2Config
    from ..zoo.registry import token_lm_loss

    cfg = GPT2Config(3, 256, 4, 50257, 1024, batch_size=1, seq_len=1024, dropout=0.0)
    with torch.device("meta"):
        model = GPT2LM(cfg)
    tokens = torch.zeros((1, 1025), dtype=torch.long, device="meta")
    return model, {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}, token_lm_loss


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    from ..cost.devices import DEVICES
    from ..cost.roofline import RooflineCostModel
    from ..solvers import Problem, solve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-50k,unet,llama,bert-base,gpt2,vit-b16")
    ap.add_argument("--latency", type=float, default=1.05)
    ap.add_argument("--time-budget", type=float, default=60.0)
    ap.add_argument("--budgets", default=None,
                    help="fractions of the eager peak (e.g. 0.7,0.5,0.3): the fastest plan "
                         "within each budget instead of the least peak within --latency")
    ap.add_argument("--config", default="paper", choices=("small", "paper"))
    args = ap.parse_args(argv)
    cm = RooflineCostModel(DEVICES["rtx3090"])
    if args.budgets:
        return _budget_table(args, cm)
    print(f"torch {torch.__version__}, RTX 3090 roofline (simulated), least peak within "
          f"{args.latency:g}x of the eager step\n")
    print("| model | nodes | eager peak (MiB) | hotspot peak / eager | fission peak / eager "
          "| fission time / eager | fission solve (s) | splits |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        g, label = _graph(name, args.config)
        eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
        hot = solve(Problem(g, cm, latency_limit=args.latency, time_budget_s=args.time_budget),
                    "hotspot").sim
        t0 = time.perf_counter()
        fis = solve(Problem(g, cm, latency_limit=args.latency, time_budget_s=args.time_budget),
                    "fission")
        solve_s = time.perf_counter() - t0
        splits = "; ".join(fis.notes.get("splits", [])) or "none"
        print(f"| {label} | {len(g.nodes)} | {eager.peak_bytes / 2**20:.0f} "
              f"| {hot.peak_bytes / eager.peak_bytes:.3f} "
              f"| {fis.sim.peak_bytes / eager.peak_bytes:.3f} "
              f"| {fis.sim.latency_s / eager.latency_s:.3f} | {solve_s:.1f} | {splits} |",
              flush=True)
    return 0


def _graph(name: str, config: str):
    """(graph, label): ``gpt2-50k``, or a zoo model's ``config``, captured on the meta device."""
    from .. import zoo
    from ..capture.api import capture

    if name == "gpt2-50k":
        return capture(*gpt2_50k()), "gpt2, 50k vocab, seq 1024 (3x256)"
    case = zoo.build(name, config, device="meta")
    return capture(case.model, case.batch, case.loss_fn), f"{name} ({config})"


def _budget_table(args, cm) -> int:
    """Budget mode: per model and budget, the step time / eager of remat alone and of fission
    (remat on top), fission's solve time and its splits."""
    from ..solvers import BudgetInfeasible, Problem, solve

    print(f"torch {torch.__version__}, RTX 3090 roofline (simulated), {args.config} configs, "
          "fastest plan within each budget\n")
    print("| model | budget | hotspot time / eager | fission time / eager | fission solve (s) "
          "| splits |")
    print("|---|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        g, label = _graph(name, args.config)
        eager = solve(Problem(g, cm, latency_limit=1.0), "eager").sim
        for frac in (float(b) for b in args.budgets.split(",")):
            budget = int(frac * eager.peak_bytes)
            row = []
            for solver in ("hotspot", "fission"):
                t0 = time.perf_counter()
                try:
                    sol = solve(Problem(g, cm, budget_bytes=budget,
                                        time_budget_s=args.time_budget), solver)
                    row.append((f"{sol.sim.latency_s / eager.latency_s:.3f}",
                                time.perf_counter() - t0, sol.notes.get("splits", [])))
                except BudgetInfeasible:
                    row.append(("infeasible", time.perf_counter() - t0, []))
            (hot, _, _), (fis, fis_s, splits) = row
            print(f"| {label} | {frac:.0%} | {hot} | {fis} | {fis_s:.1f} "
                  f"| {'; '.join(splits) or 'none'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
