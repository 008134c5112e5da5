"""What operator fission finds by itself: eager vs ``hotspot`` vs ``fission``, simulated.

    python -m fitgraph.bench.fission_wins [--models gpt2-50k,unet,llama] [--latency 1.05]

Each graph is captured on the meta device (nothing is allocated or run) and costed with the
RTX 3090 roofline model, so the numbers are deterministic and need no GPU. ``gpt2-50k`` is GPT-2
with its real 50,257-token vocabulary at sequence 1024 (3 layers of width 256, batch 1, no
dropout: the LM head and the loss dominate — the classic chunked cross-entropy case); the others
are the zoo's paper configurations (no optimizer in the step). For each, the least peak within
``--latency`` × the eager step: remat alone (``hotspot``) and fission with remat on top
(``fission``), and what the search split.
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
    from .. import zoo
    from ..capture.api import capture
    from ..cost.devices import DEVICES
    from ..cost.roofline import RooflineCostModel
    from ..solvers import Problem, solve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-50k,unet,llama,bert-base,gpt2,vit-b16")
    ap.add_argument("--latency", type=float, default=1.05)
    ap.add_argument("--time-budget", type=float, default=60.0)
    args = ap.parse_args(argv)
    cm = RooflineCostModel(DEVICES["rtx3090"])
    print(f"torch {torch.__version__}, RTX 3090 roofline (simulated), least peak within "
          f"{args.latency:g}x of the eager step\n")
    print("| model | nodes | eager peak (MiB) | hotspot peak / eager | fission peak / eager "
          "| fission time / eager | fission solve (s) | splits |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        if name == "gpt2-50k":
            g = capture(*gpt2_50k())
            label = "gpt2, 50k vocab, seq 1024 (3x256)"
        else:
            case = zoo.build(name, "paper", device="meta")
            g = capture(case.model, case.batch, case.loss_fn)
            label = f"{name} (paper)"
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


if __name__ == "__main__":
    raise SystemExit(main())
