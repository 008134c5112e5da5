"""``fitgraph hw-search MODEL --devices N --global-batch B``: which accelerator to build for a
model — every chip configuration of the space under an area budget, each with its best
multi-device plan (``fitgraph.hw.search``); the best ones, the TPUv4-like baseline's plan, and
the Pareto front of throughput against area (``--plot``).

Example:
    >>> args = build_parser().parse_args(["gpt3-175b", "--global-batch", "1536"])
    >>> args.devices, args.area_budget, args.objective
    (1024, 'tpuv4', 'throughput')
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

__all__ = ["add_parser", "build_parser", "cmd_hw_search", "format_search"]


def _arguments(p: argparse.ArgumentParser) -> None:
    from .cli_plan_dist import model_arguments

    model_arguments(p, "re-timed on each chip", "bfloat16")
    p.add_argument("--devices", type=int, default=1024, help="chips in the cluster")
    p.add_argument("--global-batch", type=int, required=True, help="samples per step")
    p.add_argument("--area-budget", default="tpuv4",
                   help="'tpuv4' (eight 128x128 arrays + 128 MiB, the baseline) or mm²")
    p.add_argument("--objective", default="throughput",
                   choices=["throughput", "perf-per-area", "perf-per-watt"])
    p.add_argument("--space", default="phaze", choices=["phaze", "small"],
                   help="phaze: Phaze's axes (array sides 2-256, 1-4096 tensor and vector "
                        "cores, 2-128 MiB) x HBM bandwidth x links; small: a quick look")
    p.add_argument("--hbm-gib", type=int, default=None,
                   help="HBM capacity of every chip searched, the baseline's too (default "
                        "TPUv4's 32; Phaze sweeps 32, 64, 80)")
    p.add_argument("--precision", default=None,
                   choices=["mixed-adam", "fp32-adam", "mixed-sgd"],
                   help="bytes per parameter (default mixed-adam; fp32-adam for a zoo model "
                        "captured in float32)")
    p.add_argument("--time-limit", type=float, default=540.0,
                   help="seconds for the whole search; configurations left unplanned whose "
                        "bound still beats the best are counted as unresolved")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE", help="write throughput against area (PNG)")


def add_parser(sub) -> None:
    p = sub.add_parser("hw-search", help="search accelerator architectures (tensor and "
                       "vector cores, SRAM, HBM bandwidth, links) under an area budget, each "
                       "with its best multi-device plan")
    _arguments(p)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fitgraph hw-search")
    _arguments(p)
    return p


def cmd_hw_search(args) -> int:
    from .cli_plan_dist import require_model
    from .dist.memory import PRECISIONS
    from .hw.search import co_search
    from .hw.space import SPACES

    require_model(args, "hw-search")
    model = _model(args)

    def progress(i, n, cand, best):
        if not args.json and i % 50 == 0:
            print(f"  planned {i} (of {n} bounded), best {best.tokens_per_s:,.0f} tokens/s"
                  if best else f"  planned {i}", file=sys.stderr, flush=True)

    space = SPACES[args.space]
    if args.hbm_gib:
        space = dataclasses.replace(space, hbm_gib=args.hbm_gib)
    result = co_search(model, args.devices, args.global_batch, space=space,
                       area=args.area_budget, objective=args.objective,
                       precision=PRECISIONS[args.precision or "mixed-adam"],
                       time_limit_s=args.time_limit, progress=progress)
    if args.plot:
        _plot(result, args.plot)
    print(json.dumps(result.to_json(), indent=1) if args.json else format_search(result))
    return 0 if result.best is not None else 2


def _model(args):
    """A GPT by its shape, or a zoo model's captured step (timed per chip by
    ``hw.cost_model``: the capture's times are replaced)."""
    from .cli_plan_dist import captured_model, gpt_shape
    from .dist.megatron_table import GPT_PRESETS

    if args.model == "gpt" or args.model in GPT_PRESETS:
        return gpt_shape(args)
    from .hw.area import TPUV4_LIKE
    from .hw.cost_model import ChipCostModel

    return captured_model(args, ChipCostModel(TPUV4_LIKE), "bfloat16", "hw-search")


def _row(c) -> str:
    ch, p = c.chip, c.parallelism
    plan = (f"tp{p['tp']} pp{p['pp']} dp{p['dp']} mb{p['micro_batch']} zero{p['zero']}"
            if p else f"no plan fits ({c.binding})")
    return (f"{ch.tensor_cores:>5} x {ch.array_rows:>3}x{ch.array_cols:<3} "
            f"{ch.vector_cores:>5} {ch.sram_bytes / 2**20:>6.0f} "
            f"{ch.hbm_bandwidth / 1e12:>5.2f} {ch.links}x{ch.link_bandwidth / 1e9:<4.0f} "
            f"{ch.peak_flops() / 1e12:>7.1f} {c.area_mm2:>7.1f} {c.power_w:>6.0f} "
            f"{c.tokens_per_s:>12,.0f}  {plan}")


def format_search(r) -> str:
    head = (f"{'arrays':>17} {'vec':>5} {'MiB':>6} {'TB/s':>5} {'links':<7}"
            f" {'TFLOP/s':>7} {'mm²':>7} {'W':>6} {'tokens/s':>12}  plan")
    lines = [f"fitgraph hw-search: {r.configs_in_budget} configurations within "
             f"{r.budget_mm2:.0f} mm² (of {r.configs_total}); {r.configs_evaluated} planned, "
             f"{r.pruned} pruned by their bound (safe), {r.unresolved} unresolved; "
             f"{r.search_s:.0f} s (bounds {r.bound_s:.0f} s); objective {r.objective}",
             "", head]
    lines += [_row(c) for c in r.top()]
    lines += ["", "baseline (TPUv4-like):", head, _row(r.baseline)]
    if r.best and r.baseline.tokens_per_s:
        gain = r.best.score(r.objective) / r.baseline.score(r.objective)
        lines += ["", f"best / baseline ({r.objective}): {gain:.2f}x"]
    return "\n".join(lines)


def _plot(r, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    planned = [c for c in r.evaluated if c.tokens_per_s]
    ax.scatter([c.area_mm2 for c in planned], [c.tokens_per_s for c in planned], s=8,
               alpha=0.4, label="planned configurations")
    front = r.pareto()
    ax.plot([c.area_mm2 for c in front], [c.tokens_per_s for c in front], "o-", color="C1",
            label="Pareto front")
    if r.baseline.tokens_per_s:
        ax.scatter([r.baseline.area_mm2], [r.baseline.tokens_per_s], marker="*", s=150,
                   color="C3", label="TPUv4-like baseline")
    ax.axvline(r.budget_mm2, color="grey", ls="--", lw=1, label="area budget")
    ax.set_xlabel("area (mm²)")
    ax.set_ylabel("tokens / s (whole cluster)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
