"""The GEMM model (``fitgraph.hw.gemm``) against GEMMs measured: a sweep of shapes, predicted
and measured TFLOP/s side by side.

On the CPU: this machine's core in the template (``hw.host.host_chip``), float32 ``torch.mm``
on one thread (warmed up, the median of rounds that take every shape in turn). On a GPU
(``--device cuda``): the H100 or A100 preset, bfloat16, ``torch.cuda.Event`` timing.

    python -m fitgraph.bench.gemm_sweep [--device cpu|cuda] [--out docs/hw/gemm_cpu.json]
    python -m fitgraph.bench.gemm_sweep --table docs/hw/gemm_cpu.json     # BENCHMARKS.md's
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

# (M, N, K): square, a transformer layer's matmuls at 512 tokens (d=768), skinny ones
SHAPES = [(128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
          (2048, 2048, 2048), (512, 2304, 768), (512, 768, 768), (512, 3072, 768),
          (512, 768, 3072), (16, 4096, 4096), (64, 1024, 1024), (4096, 64, 1024),
          (2048, 2048, 64)]


def _chip(device: str):
    import torch

    from ..hw.chip import CHIPS
    from ..hw.host import host_chip

    if device == "cpu":
        return host_chip(cores=1), torch.float32
    name = torch.cuda.get_device_name().lower()
    return (CHIPS["h100"] if "h100" in name else CHIPS["a100"]), torch.bfloat16


def _measure(shapes, device: str, dtype, rounds: int) -> list[float]:
    import torch

    mats = [(torch.randn(m, k, dtype=dtype, device=device),
             torch.randn(k, n, dtype=dtype, device=device)) for m, n, k in shapes]
    times: list[list[float]] = [[] for _ in shapes]
    for r in range(rounds + 1):
        for i, (a, b) in enumerate(mats):
            reps = max(1, int(2e8 / (2 * a.shape[0] * a.shape[1] * b.shape[1])))
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(reps):
                    torch.mm(a, b)
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1e3 / reps
            else:
                t = time.perf_counter()
                for _ in range(reps):
                    torch.mm(a, b)
                seconds = (time.perf_counter() - t) / reps
            if r:                       # NOTE: round 0 warms up
                times[i].append(seconds)
    return [statistics.median(t) for t in times]


def run(device: str, rounds: int, shapes: list[tuple[int, int, int]] | None = None) -> dict:
    import torch

    from ..hw.gemm import gemm_timing

    torch.set_num_threads(1)
    chip, dtype = _chip(device)
    itemsize = torch.finfo(dtype).bits // 8
    shapes = shapes or SHAPES
    measured = _measure(shapes, device, dtype, rounds)
    rows = []
    for (m, n, k), seconds in zip(shapes, measured):
        g = gemm_timing(chip, m, n, k, itemsize=itemsize)
        flops = 2.0 * m * n * k
        rows.append({"m": m, "n": n, "k": k, "measured_s": seconds, "predicted_s": g.seconds,
                     "measured_tflops": flops / seconds / 1e12,
                     "predicted_tflops": flops / g.seconds / 1e12,
                     "bound": max(("compute", g.compute_s), ("hbm", g.traffic_s),
                                  ("sram", g.sram_s), key=lambda x: x[1])[0]})
    return {"device": device, "chip": chip.description, "peak_tflops": chip.peak_flops() / 1e12,
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "rounds": rounds, "rows": rows}


def markdown(res: dict) -> str:
    lines = ["| M | N | K | measured TFLOP/s | predicted TFLOP/s | predicted / measured | "
             "model's bound |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['m']} | {r['n']} | {r['k']} | {r['measured_tflops']:.4f} | "
                     f"{r['predicted_tflops']:.4f} | "
                     f"{r['predicted_tflops'] / r['measured_tflops']:.2f} | {r['bound']} |")
    ratios = sorted(r["predicted_tflops"] / r["measured_tflops"] for r in res["rows"])
    lines.append("")
    lines.append(f"predicted / measured: median {statistics.median(ratios):.2f}, "
                 f"range {ratios[0]:.2f}–{ratios[-1]:.2f} ({res['chip']}; peak "
                 f"{res['peak_tflops']:.3f} TFLOP/s {res['dtype']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", metavar="JSON", help="print a saved run as a markdown table")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return
    res = run(args.device, args.rounds)
    print(markdown(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
