"""Measure the gloo link between two local processes (TCP loopback): one-way time of a
message by size, from ping-pong round trips; the latency (the smallest message's time) and the
bandwidth (the largest messages' bytes over their time) that ``dist.cluster.LINKS
["gloo-loopback"]`` writes down for planning CPU launches.

    python -m fitgraph.bench.gloo_link [--out docs/dist/gloo_link.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SIZES = [2 ** k for k in range(10, 27, 2)]   # 1 KiB .. 64 MiB
ROUNDS = 7


def _pingpong(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    for size in SIZES:
        buf = torch.zeros(size // 4)
        times = []
        for i in range(ROUNDS + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i:
                times.append((time.perf_counter() - start) / 2)
        out[size] = statistics.median(times)
    return out


def measure() -> dict:
    from ..dist.runtime import run_processes

    times = run_processes(_pingpong, 2, timeout_s=600)[0]
    big = [s for s in SIZES if s >= 2 ** 24]
    bandwidth = statistics.median(s / (times[s] - times[SIZES[0]]) for s in big)
    return {"one_way_s": {str(s): t for s, t in times.items()},
            "latency_s": times[SIZES[0]], "bandwidth_bytes_per_s": bandwidth}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = measure()
    for s, t in res["one_way_s"].items():
        print(f"{int(s):>10d} B  {t * 1e6:10.1f} us  {int(s) / t / 1e9:6.2f} GB/s")
    print(f"latency {res['latency_s'] * 1e6:.1f} us, bandwidth "
          f"{res['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
