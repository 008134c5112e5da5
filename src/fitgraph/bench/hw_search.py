"""The co-search on Phaze's four models (issue 29): GPT-3 175B, Llama-2 7B, BERT-large and
GPT-2 XL at Phaze's sequence lengths (2048, 4096, 512, 1024) on 1,024 chips, each the whole
space under a TPUv4-like area — configurations, time, the best chip and its plan beside the
TPUv4-like baseline under the same planner.

    python -m fitgraph.bench.hw_search [--out docs/hw] [--models gpt3-175b,llama2-7b]
    python -m fitgraph.bench.hw_search --table docs/hw        # BENCHMARKS.md's table

Each model is the same as ``fitgraph hw-search MODEL --global-batch B --json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# NOTE: global batches: GPT-3 175B's in Megatron-LM's Table 1 (1,536), Llama-2's 4M tokens
# (1,024 x 4,096), GPT-2's (512), and one sample per chip for BERT-large (1,024)
MODELS = {"gpt3-175b": 1536, "llama2-7b": 1024, "bert-large": 1024, "gpt2-xl": 512}


def run(models: list[str], out: Path, time_limit_s: float) -> None:
    from ..dist.megatron_table import GPT_PRESETS
    from ..hw.search import co_search

    out.mkdir(parents=True, exist_ok=True)
    for name in models:
        r = co_search(GPT_PRESETS[name], 1024, MODELS[name], time_limit_s=time_limit_s)
        (out / f"search_{name}.json").write_text(json.dumps(r.to_json(), indent=1) + "\n")
        print(f"{name}: {r.configs_evaluated} planned, {r.pruned} pruned, {r.unresolved} "
              f"unresolved, {r.search_s:.0f} s", flush=True)


def _arrays(c: dict) -> str:
    return (f"{c['tensor_cores']} x {c['array'][0]}x{c['array'][1]}, {c['vector_cores']} vec, "
            f"{c['sram_mib']:.0f} MiB, {c['hbm_tb_s']:g} TB/s, {c['links']}x"
            f"{c['link_gb_s']:.0f} GB/s")


def _plan(c: dict) -> str:
    p = c["parallelism"]
    return f"tp{p['tp']} pp{p['pp']} dp{p['dp']} mb{p['micro_batch']} ZeRO-{p['zero']}"


def markdown(folder: Path) -> str:
    lines = ["| model | in budget | planned | pruned (safe) | unresolved | search | best chip "
             "| its plan | tokens/s | baseline (TPUv4-like) tokens/s | its plan | gain |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---|---:|"]
    for name in MODELS:
        path = folder / f"search_{name}.json"
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        b, base = d["best"], d["baseline"]
        lines.append(
            f"| {name} | {d['configs_in_budget']:,} | {d['configs_evaluated']} | "
            f"{d['pruned_by_bound']:,} | {d['unresolved']} | {d['search_s']:.0f} s | "
            f"{_arrays(b)}; {b['peak_tflops']:.0f} TFLOP/s, {b['area_mm2']:.0f} mm² | "
            f"{_plan(b)} | {b['tokens_per_s']:,.0f} | {base['tokens_per_s']:,.0f} | "
            f"{_plan(base)} | {d['gain']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/hw")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--time-limit", type=float, default=540.0)
    ap.add_argument("--table", metavar="DIR", help="print saved searches as a markdown table")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(Path(args.table)))
        return
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}: {', '.join(MODELS)}")
    run(names, Path(args.out), args.time_limit)


if __name__ == "__main__":
    main()
