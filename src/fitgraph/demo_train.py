"""``fitgraph demo-train``: a real training run, eager PyTorch and fitgraph side by side.

A small byte-level GPT (``zoo.gpt2.GPT2LM``: pre-LN, dropout, tied head) learns Python's own
documentation — ``pydoc_data.topics``, the text ``help()`` prints, which ships inside every
CPython installation (nothing is downloaded) — for a few hundred AdamW steps with a warm-up and
cosine learning-rate schedule. Two copies of the model from the same initial weights see the
same batches and the same dropout seeds: one steps as eager PyTorch does, the other through
``fitgraph.optimize`` within a memory budget. The steps alternate (which system goes first
swaps each step), so both see the same machine. Every ``meter_every``-th step is measured
under the allocator meter (its peak, the bytes that exist before the step included); the
others are timed. The result: both loss curves, their largest difference, the peaks against
the plan's simulated peak (a measured step above it is a broken law, reported), the step
times, and a PNG of the three (``report.train_plot``).

Example:
    >>> r = run(steps=3, budget=0.7, seq=64, batch=4, layers=1, width=32, heads=2,
    ...         meter_every=2, time_budget=5, solver="hotspot", progress=None)
    >>> len(r["loss"]["eager"]) == len(r["loss"]["fitgraph"]) == 3
    True
    >>> r["max_loss_diff"] < 1e-4 and r["never_above_plan"]
    True
"""

from __future__ import annotations

import copy
import math
import platform
import statistics
import time
from collections.abc import Callable

__all__ = ["add_parser", "cmd_demo_train", "corpus_bytes", "run"]

MIB = 2**20


def corpus_bytes() -> bytes:
    """Python's documentation topics (``pydoc_data.topics``), as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode()


def run(steps: int = 300, budget=0.5, seq: int = 256, batch: int = 8, layers: int = 4,
        width: int = 128, heads: int = 4, dropout: float = 0.1, lr: float = 1e-3,
        meter_every: int = 10, time_budget: float = 30.0, seed: int = 0, solver: str = "auto",
        progress: Callable[[str], None] | None = print) -> dict:
    """Train twice (module doc) and return the run's numbers, JSON-ready."""
    import torch

    from . import optimize
    from .execute.meter import MemoryMeter
    from .measure import resident_bytes
    from .zoo.gpt2 import GPT2LM, GPT2Config
    from .zoo.registry import token_lm_loss

    say = progress or (lambda _msg: None)
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    cfg = GPT2Config(layers, width, heads, 256, seq, batch_size=batch, seq_len=seq,
                     dropout=dropout)
    torch.manual_seed(seed)
    models = {"eager": GPT2LM(cfg)}
    models["fitgraph"] = copy.deepcopy(models["eager"])
    opts = {k: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1)
            for k, m in models.items()}
    warmup = max(1, steps // 20)

    def schedule(i: int) -> float:
        # NOTE: linear warm-up, then cosine to a tenth: what a small GPT's recipe uses
        if i < warmup:
            return (i + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warmup) / max(1, steps - warmup)))

    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, schedule) for k, o in opts.items()}
    gen = torch.Generator().manual_seed(seed + 1)

    def next_batch() -> dict:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

    def eager_step(b):
        loss = token_lm_loss(models["eager"], b)
        loss.backward()
        opts["eager"].step()
        opts["eager"].zero_grad(set_to_none=True)
        return loss

    batches = [next_batch() for _ in range(steps)]
    say(f"demo-train: {sum(p.numel() for p in models['eager'].parameters()):,} parameters, "
        f"{len(data):,} bytes of text, {steps} steps of {batch}x{seq} tokens; planning "
        f"fitgraph's step (budget {budget}) ...")
    t0 = time.perf_counter()
    train_step = optimize(models["fitgraph"], batches[0], token_lm_loss, opts["fitgraph"],
                          budget=budget, time_budget=time_budget, solver=solver,
                          progress=progress is not None)
    plan_s = time.perf_counter() - t0

    def fitgraph_step(b):
        # NOTE: the step leaves .grad as torch's optimizer.step() does; the loop zeroes it
        # after the step, as the eager one (so neither step starts holding gradients)
        loss = train_step(b)
        opts["fitgraph"].zero_grad(set_to_none=True)
        return loss

    step_fns = {"eager": eager_step, "fitgraph": fitgraph_step}
    losses = {k: [] for k in models}
    times = {k: [] for k in models}
    peaks = {k: [] for k in models}
    metered = []
    for i, b in enumerate(batches):
        meter = i > 0 and i % meter_every == 0
        if meter:
            metered.append(i)
        for k in (("eager", "fitgraph") if i % 2 == 0 else ("fitgraph", "eager")):
            torch.manual_seed(seed + 1000 + i)   # NOTE: the same dropout draws for both
            if meter:
                before = resident_bytes(models[k], b, opts[k])
                with MemoryMeter() as m:
                    loss = step_fns[k](b)
                peaks[k].append(before + m.peak_bytes)
            else:
                t = time.perf_counter()
                loss = step_fns[k](b)
                times[k].append(time.perf_counter() - t)
            losses[k].append(float(loss.detach()))
            scheds[k].step()
        if (i + 1) % max(1, steps // 10) == 0:
            say(f"  step {i + 1}/{steps}: loss eager {losses['eager'][-1]:.4f}, fitgraph "
                f"{losses['fitgraph'][-1]:.4f}")
    report = train_step.report()
    planned = report.planned_peak_bytes
    weight_diff = max((pa - pb).abs().max().item() for pa, pb in zip(
        models["eager"].parameters(), models["fitgraph"].parameters()))
    ratios = [f / e for f, e in zip(times["fitgraph"], times["eager"])]
    return {
        "model": f"byte-level GPT: {layers} layers, d={width}, {heads} heads, seq {seq}, "
                 f"batch {batch}, dropout {dropout}",
        "corpus": f"pydoc_data.topics ({len(data):,} bytes)",
        "steps": steps, "budget": budget, "solver": report.solver,
        "winner": report.notes.get("winner"), "plan_s": plan_s,
        "loss": losses, "final_loss": {k: v[-1] for k, v in losses.items()},
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["eager"], losses["fitgraph"])),
        "max_weight_diff": weight_diff,
        "metered_steps": metered, "peak_bytes": peaks,
        "planned_peak_bytes": planned, "budget_bytes": report.budget_bytes,
        "eager_sim_peak_bytes": report.eager_peak_bytes,
        "never_above_plan": all(p <= planned for p in peaks["fitgraph"]),
        "step_s": times,
        "median_step_s": {k: statistics.median(v) if v else None for k, v in times.items()},
        "median_time_ratio": statistics.median(ratios) if ratios else None,
        "machine": platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def summary(r: dict) -> str:
    """The run in a few lines (what the CLI prints)."""
    pe, pf = max(r["peak_bytes"]["eager"], default=0), max(r["peak_bytes"]["fitgraph"], default=0)
    lines = [f"demo-train: {r['model']}; {r['corpus']}; {r['steps']} steps",
             f"  fitgraph plan   {r['solver']} ({r['winner']}), budget {r['budget']} = "
             f"{r['budget_bytes'] / MIB:,.1f} MiB, planned in {r['plan_s']:.1f} s",
             f"  final loss      eager {r['final_loss']['eager']:.4f}, fitgraph "
             f"{r['final_loss']['fitgraph']:.4f} (largest difference over the run "
             f"{r['max_loss_diff']:.2e}; weights {r['max_weight_diff']:.2e})",
             f"  peak memory     eager {pe / MIB:,.1f} MiB, fitgraph {pf / MIB:,.1f} MiB "
             f"(plan {r['planned_peak_bytes'] / MIB:,.1f} MiB; "
             f"{_against_plan(r)})"]
    if r["median_time_ratio"] is not None:
        lines.append(f"  step time       eager {1e3 * r['median_step_s']['eager']:.1f} ms, "
                     f"fitgraph {1e3 * r['median_step_s']['fitgraph']:.1f} ms (median of "
                     f"paired steps: {r['median_time_ratio']:.3f}x)")
    return "\n".join(lines)


def _against_plan(r: dict) -> str:
    peaks = r["peak_bytes"]["fitgraph"]
    if peaks and all(p == r["planned_peak_bytes"] for p in peaks):
        return "every metered step equal to it, to the byte"
    return "never above it" if r["never_above_plan"] else "ABOVE IT on some step"


def add_parser(sub) -> None:
    p = sub.add_parser("demo-train", help="train a small GPT on Python's bundled docs, eager "
                       "and fitgraph side by side; loss, peak memory and step time (PNG)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=256, help="bytes per sequence")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128, help="model width (4 heads)")
    p.add_argument("--budget", default="0.5",
                   help="fitgraph's budget: a fraction of the eager peak, or a size (800MB)")
    p.add_argument("--solver", default="auto")
    p.add_argument("--time-budget", type=float, default=30.0, help="planning seconds")
    p.add_argument("--meter-every", type=int, default=10,
                   help="measure every N-th step's peak (the others are timed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--plot", metavar="FILE", help="write loss, peak and step time (PNG)")
    p.add_argument("--results", metavar="FILE", help="write the run's numbers (JSON)")
    p.add_argument("--json", action="store_true", help="print one JSON object, no progress")


def cmd_demo_train(args) -> int:
    import json

    import torch

    from .cli_optimize import _budget

    torch.set_num_threads(args.threads)
    r = run(steps=args.steps, budget=_budget(args.budget), solver=args.solver,
            batch=args.batch, seq=args.seq, layers=args.layers, width=args.width,
            time_budget=args.time_budget, meter_every=args.meter_every,
            progress=None if args.json else print)
    if args.plot:
        from .report.train_plot import plot_training_run

        plot_training_run(r, args.plot)
        r["plot"] = args.plot
    if args.results:
        with open(args.results, "w") as f:
            json.dump(r, f, indent=1)
    print(json.dumps(r, indent=1) if args.json else summary(r))
    return 0 if r["never_above_plan"] else 1
