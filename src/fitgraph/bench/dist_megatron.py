"""The multi-device planner against Megatron-LM's published throughput (SC'21, Table 1).

For every row: (1) the prediction of the published configuration (``--fix`` at its t, p, d,
micro-batch 1, 1F1B, full recompute, gradient reduction after the backward, as Megatron-LM ran
in 2021) against the published TFLOP/s per GPU; (2) the planner's own plan for the same model,
cluster and global batch, its predicted step against the published configuration's predicted
step, and what it changed; (3) how long planning took. Then planning time against devices and
layers (GPT-3 175B). Device constants: ``dist.calibration`` (A100 calibrated once, on row 1).

    python -m fitgraph.bench.dist_megatron [--out docs/dist/megatron.json] [--rows 1,2,3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ..dist.calibration import calibrated_device
from ..dist.cluster import Cluster, dgx_a100
from ..dist.megatron_table import TABLE1, GptShape, MegatronRow
from ..dist.planner import plan

__all__ = ["main", "markdown", "run_row", "scaling"]


def _cluster(gpus: int) -> Cluster:
    base = dgx_a100(max(1, gpus // 8))
    device, _ = calibrated_device("a100-80gb")
    return Cluster(device, base.devices_per_node, base.nodes, base.intra, base.inter)


def _published_fix(row: MegatronRow) -> dict:
    return {"tp": row.t, "pp": row.p, "dp": row.dp, "micro_batch": 1, "schedule": "1f1b",
            "recompute": "full", "overlap_grad_reduce": False}


def _summary(par) -> str:
    s = f"t{par.tp} p{par.pp} d{par.dp} b{par.micro_batch} {par.schedule}"
    if par.chunks > 1:
        s += f"x{par.chunks}"
    return s + f" Z{par.zero}" + (" sp" if par.sp else "")


def _why(row: MegatronRow, par, recompute: float) -> str:
    """What the planner's plan changes against the published configuration."""
    out = [f"recomputes {recompute * 100:.0f}% of a forward (full: 100%)"]
    if par.micro_batch != 1:
        out.append(f"micro-batch {par.micro_batch}")
    if (par.tp, par.pp) != (row.t, row.p):
        out.append(f"t{par.tp} p{par.pp}")
    if par.schedule != "1f1b":
        out.append(par.schedule + (f" x{par.chunks}" if par.chunks > 1 else ""))
    if par.zero:
        out.append(f"ZeRO-{par.zero}")
    if par.sp:
        out.append("sequence parallel")
    out.append("gradient reduction overlapped")
    return ", ".join(out)


def run_row(row: MegatronRow) -> dict:
    cluster = _cluster(row.gpus)
    fixed = plan(row.shape, cluster, row.batch, fix=_published_fix(row))
    flops = row.shape.flops_per_iteration(row.batch)
    predicted = flops / fixed.predicted["step_s"] / row.gpus / 1e12
    start = time.perf_counter()
    own = plan(row.shape, cluster, row.batch)
    plan_s = time.perf_counter() - start
    # the planner held to the published t, p, d: what per-stage memory plans, micro-batch and
    # schedule alone buy
    same = plan(row.shape, cluster, row.batch, fix={"tp": row.t, "pp": row.p, "dp": row.dp})
    plans = [n for s in own.stages for n in s["memory_plan"]]
    fwd = sum(s["time"]["fwd_s"] for s in own.stages)
    recompute = sum(s["time"]["recompute_s"] for s in own.stages) / fwd if fwd else 0.0
    return {
        "billions": row.billions, "gpus": row.gpus, "t": row.t, "p": row.p, "d": row.dp,
        "batch": row.batch, "published_tflops": row.tflops_per_gpu,
        "predicted_tflops": predicted, "error": predicted / row.tflops_per_gpu - 1,
        "published_config_step_s": fixed.predicted["step_s"],
        "published_config_peak_gib": fixed.predicted["peak_bytes_per_device"] / 2**30,
        "published_config_fits": fixed.fits,
        "planner": _summary(own.parallelism), "planner_step_s": own.predicted["step_s"],
        "planner_eq3_tflops": flops / own.predicted["step_s"] / row.gpus / 1e12,
        "planner_mfu": own.predicted["mfu"], "planner_peak_gib":
            own.predicted["peak_bytes_per_device"] / 2**30,
        "speedup": fixed.predicted["step_s"] / own.predicted["step_s"],
        "same_tpd": _summary(same.parallelism),
        "same_tpd_speedup": fixed.predicted["step_s"] / same.predicted["step_s"],
        "planner_memory_plans": sorted(set(plans)), "plan_s": plan_s,
        "planner_recompute_fraction": recompute,
        "why": _why(row, own.parallelism, recompute),
        "searched": own.search,
    }


def scaling() -> list[dict]:
    """Planning time of GPT-3-width models against devices and layers."""
    out = []
    for layers, gpus in ((96, 64), (96, 256), (96, 1024), (96, 2048), (24, 1024), (48, 1024)):
        shape = GptShape(layers, 12288, 96)
        start = time.perf_counter()
        p = plan(shape, _cluster(gpus), 1536)
        out.append({"layers": layers, "gpus": gpus, "plan_s": time.perf_counter() - start,
                    "candidates": p.search["candidates"], "evaluated": p.search["evaluated"],
                    "plan": _summary(p.parallelism)})
    return out


def markdown(rows: list[dict], scale: list[dict]) -> str:
    errs = [abs(r["error"]) for r in rows]
    lines = [
        "| model | GPUs | t/p/d | batch | published TFLOP/s | predicted | error | planner's plan "
        "| step (published cfg → planner) | speedup | at published t/p/d | plan time | why |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['billions']:g}B | {r['gpus']} | {r['t']}/{r['p']}/{r['d']} | {r['batch']} | "
            f"{r['published_tflops']} | {r['predicted_tflops']:.1f} | {r['error'] * 100:+.1f}% | "
            f"{r['planner']} | {r['published_config_step_s']:.2f} s → {r['planner_step_s']:.2f} s"
            f" | {r['speedup']:.2f}x | {r['same_tpd_speedup']:.2f}x ({r['same_tpd']}) "
            f"| {r['plan_s']:.1f} s | {r['why']} |")
    lines += ["", f"Prediction error: mean {statistics.mean(errs) * 100:.1f}%, max "
              f"{max(errs) * 100:.1f}% over {len(rows)} rows (row 1 is the calibration)."]
    if scale:
        lines += ["", "| layers | GPUs | candidates | evaluated | plan time | plan |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {s['layers']} | {s['gpus']} | {s['candidates']} | {s['evaluated']} | "
                  f"{s['plan_s']:.1f} s | {s['plan']} |" for s in scale]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fitgraph.bench.dist_megatron")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--rows", default="", help="1-based rows of Table 1 (default all)")
    ap.add_argument("--no-scaling", action="store_true")
    args = ap.parse_args(argv)
    picked = ([TABLE1[int(i) - 1] for i in args.rows.split(",")] if args.rows else list(TABLE1))
    rows = []
    for row in picked:
        rows.append(run_row(row))
        r = rows[-1]
        print(f"{r['billions']:g}B: predicted {r['predicted_tflops']:.1f} vs "
              f"{r['published_tflops']} ({r['error'] * 100:+.1f}%); planner {r['planner']} "
              f"{r['speedup']:.2f}x in {r['plan_s']:.1f} s", flush=True)
    scale = [] if args.no_scaling else scaling()
    print(markdown(rows, scale))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "scaling": scale}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
