"""A dropout mask re-made from its packed bits: one gather (``fitgraph::unpack_scaled``) against
unpacking to bools, converting and scaling (``unpack_bits`` → ``_to_copy`` → ``div_``), the
two ways ``transform.compact_masks`` has re-made a mask — timed on the masks of the zoo's
attention and MLP shapes.

    python -m fitgraph.bench.mask_remake [--rounds 31] [--out FILE]

One thread; each round times both once, in alternating order, after warm-up; the table gives
the median time of each and the median of the rounds' ratios with its 10th–90th percentile
spread. Both give the mask bit for bit (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

# NOTE: the zoo's small configurations: GPT-2's and BERT's attention masks (batch 8, 12
# heads, 128 tokens), ViT's (16 images, 12 heads, 65 tokens rounded to rows of 8 bytes: 72),
# and a 3072-wide MLP's
SHAPES = {"attention 8x12x128x128": (8, 12, 128, 128), "attention 16x12x72x72": (16, 12, 72, 72),
          "mlp 8x128x3072": (8, 128, 3072)}
P_KEEP = 0.9


def _quantiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=10)
    return q[0], q[-1]


def run(rounds: int) -> list[dict]:
    import torch

    from ..execute.bit_packing import pack_bits, unpack_bits, unpack_scaled

    torch.set_num_threads(1)
    rows = []
    for label, shape in SHAPES.items():
        bits = torch.empty(shape, dtype=torch.bool).bernoulli_(P_KEEP)
        packed, size = pack_bits(bits), list(shape)

        def chain(packed=packed, size=size):
            return unpack_bits(packed, size).to(torch.float32).div_(P_KEEP)

        def gather(packed=packed, size=size):
            return unpack_scaled(packed, size, torch.float32, "aten.div_.Scalar", [P_KEEP])

        assert torch.equal(chain(), gather())
        times: dict[str, list[float]] = {"chain": [], "gather": []}
        for r in range(rounds + 3):
            order = (("chain", chain), ("gather", gather))
            for name, fn in order if r % 2 else order[::-1]:
                t0 = time.perf_counter()
                fn()
                if r >= 3:   # NOTE: three warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        ratios = [g / c for g, c in zip(times["gather"], times["chain"])]
        lo, hi = _quantiles(ratios)
        rows.append({"mask": label, "elements": bits.numel(),
                     "chain_ms": 1e3 * statistics.median(times["chain"]),
                     "gather_ms": 1e3 * statistics.median(times["gather"]),
                     "ratio": statistics.median(ratios), "ratio_p10": lo, "ratio_p90": hi})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| mask | elements | unpack + convert + scale | one gather | gather / chain (p10–p90) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mask']} | {r['elements']:,} | {r['chain_ms']:.2f} ms | "
                     f"{r['gather_ms']:.2f} ms | {r['ratio']:.2f} ({r['ratio_p10']:.2f}–"
                     f"{r['ratio_p90']:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fitgraph.bench.mask_remake",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = run(args.rounds)
    print(markdown(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
