"""Multi-device plans run on this machine (gloo, 2–4 CPU processes): each rank's measured step
time and allocator peak beside the plan's prediction.

GPT-2 (zoo, small, float32; global batch 8 of 64 tokens) under each configuration: the plan is
made with ``--fix`` on the CPU device model (op times measured on this machine, the gloo link
measured once: ``bench.gloo_link``), run twice by ``fitgraph.dist.parallelize`` — once timed
(the median of the steps after the first, no meter), once with every rank's allocator meter
(``measure_memory=True``) — and reported per rank.

    python -m fitgraph.bench.dist_runtime [--out docs/dist/runtime.json] [--steps 6] [--seq 64]
    python -m fitgraph.bench.dist_runtime --table docs/dist/runtime.json   # BENCHMARKS.md's
"""

from __future__ import annotations

import argparse
import json
import platform
import time

BATCH, SEQ = 8, 64
CONFIGS = {
    "pp2 1f1b": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b", "recompute": "none"},
    "pp2 1f1b recompute": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b",
                           "recompute": "full"},
    # op by op: each stage's budget halfway between re-making every block and none
    "pp2 1f1b op-level": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b",
                          "between": 0.5},
    "pp2 interleaved": {"pp": 2, "dp": 1, "micro_batch": 1, "schedule": "interleaved",
                        "chunks": 2},
    "pp2 zb-v": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "zb-v", "chunks": 2},
    "tp2": {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b"},
    # sequence parallel: norms and residuals on each rank's part of the sequence
    "tp2 sp": {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b", "sp": True},
    "dp2 zero1": {"pp": 1, "dp": 2, "micro_batch": 2, "schedule": "1f1b", "zero": 1},
    "dp2 zero3": {"pp": 1, "dp": 2, "micro_batch": 2, "schedule": "1f1b", "zero": 3},
    "pp2 x tp2": {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b"},
    "pp2 x dp2": {"pp": 2, "dp": 2, "micro_batch": 2, "schedule": "1f1b", "zero": 3},
}


def _case(seq: int = SEQ):
    import fitgraph.zoo as zoo

    case = zoo.build("gpt2", "small", batch_size=BATCH, seq_len=seq)
    case.model.eval()     # NOTE: no dropout: the same step on every run
    return case


def _rank(rank: int, world: int, plan_json: dict, steps: int, memory: bool, seq: int = SEQ):
    import torch

    from ..dist import parallelize

    torch.set_num_threads(1)
    case = _case(seq)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
    step = parallelize(case.model, case.batch, case.loss_fn, opt, plan=plan_json,
                       measure_memory=memory)
    for _ in range(steps):
        step(case.batch)
    return step.report().to_json()[rank]


def _plan(fix: dict, cost_model, seq: int = SEQ):
    from .. import capture
    from ..cost import get_device
    from ..dist import FP32_ADAM, LINKS, Cluster
    from ..dist.graph_model import GraphModel
    from ..dist.planner import budget_between, plan

    fix = {"tp": 1, **fix}
    between = fix.pop("between", None)
    case = _case(seq)
    mb = fix["micro_batch"]
    graph = capture(case.model, {k: v[:mb] for k, v in case.batch.items()}, case.loss_fn)
    world = fix["tp"] * fix["pp"] * fix["dp"]
    link = LINKS["gloo-loopback"]
    cluster = Cluster(get_device("cpu-generic"), world, 1, link, link)
    if hasattr(cost_model, "profile"):
        cost_model.profile(graph)      # NOTE: ops timed here, one thread, as the ranks run
    gm = GraphModel(graph, cost_model, batch_size=mb, seq=seq)
    budget = (None if between is None else
              budget_between(gm, cluster, BATCH, fix, between, precision=FP32_ADAM))
    return plan(gm, cluster, BATCH, fix=fix, precision=FP32_ADAM, budget=budget)


def run(steps: int, names: list[str], seq: int = SEQ) -> dict:
    import torch

    from ..cost import cost_model_for
    from ..dist.runtime import run_processes

    torch.set_num_threads(1)
    cost_model = cost_model_for("measured:cpu", progress=False)
    rows = []
    for name in names:
        p = _plan(CONFIGS[name], cost_model, seq)
        world = p.parallelism.devices
        timed = run_processes(_rank, world, p.to_json(), steps, False, seq, timeout_s=600)
        metered = run_processes(_rank, world, p.to_json(), 3, True, seq, timeout_s=600)
        for t, m in zip(timed, metered):
            rows.append({"config": name, "rank": t["rank"], "stage": t["stage"],
                         "step_s": t["step_s"], "predicted_step_s": t["predicted_step_s"],
                         "compute_s": t["compute_s"],
                         "predicted_compute_s": t["predicted_compute_s"],
                         "optimizer_s": t["optimizer_s"],
                         "peak_bytes": m["peak_bytes"],
                         "predicted_peak_bytes": m["predicted_peak_bytes"],
                         "notes": m["notes"]})
        print(_format(rows[-world:]), flush=True)
    return {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "torch": torch.__version__, "model": f"gpt2 small fp32, batch {BATCH} x {seq}",
            "steps": steps, "rows": rows}


def _format(rows: list[dict]) -> str:
    mib = 2 ** 20
    out = []
    for r in rows:
        ratio = r["peak_bytes"] / r["predicted_peak_bytes"]
        out.append(f"{r['config']:<20} {r['rank']:>4} {r['step_s'] * 1e3:9.1f} "
                   f"{r['predicted_step_s'] * 1e3:9.1f} {r['peak_bytes'] / mib:9.1f} "
                   f"{r['predicted_peak_bytes'] / mib:9.1f} {ratio:6.3f}")
    return "\n".join(out)


def markdown(res: dict) -> str:
    """The results as BENCHMARKS.md's table."""
    mib = 2 ** 20
    lines = ["| configuration | rank | stage | step (measured) | step (predicted) | ratio | "
             "compute (measured) | compute (predicted) | "
             "peak (measured) | peak (predicted) | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['config']} | {r['rank']} | {r['stage']} | {r['step_s'] * 1e3:.0f} ms | "
            f"{r['predicted_step_s'] * 1e3:.0f} ms | {r['step_s'] / r['predicted_step_s']:.2f} | "
            f"{r['compute_s'] * 1e3:.0f} ms | {r['predicted_compute_s'] * 1e3:.0f} ms | "
            f"{r['peak_bytes'] / mib:.1f} MiB | {r['predicted_peak_bytes'] / mib:.1f} MiB | "
            f"{r['peak_bytes'] / r['predicted_peak_bytes']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sample")
    ap.add_argument("--table", metavar="JSON", help="print a saved run as a markdown table")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of: {', '.join(CONFIGS)}")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}: {', '.join(CONFIGS)}")
    print(f"{'config':<20} {'rank':>4} {'step ms':>9} {'pred ms':>9} {'peak MiB':>9} "
          f"{'pred MiB':>9} {'ratio':>6}")
    start = time.perf_counter()
    res = run(args.steps, names, args.seq)
    res["seconds"] = time.perf_counter() - start
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
