"""Does the simulator tell the truth about step time? Ops costed alone vs in situ, measured.

    python -m fitgraph.bench.sim_truth [--models vit-b16,bert-base] [--parts 2,4,8]
                                      [--repeats 9]

For each model (the zoo's small configuration, AdamW in the step, dropout masks as bits) the
whole step and the step split along its batch in k parts (``transform.fission``: gradient
accumulation found as fission) are each run through the executor (eager plan), interleaved
with eager PyTorch, and simulated twice: with every op costed by its time alone
(``ProfiledCostModel(in_situ=False)``) and by its time inside the step (the default on a CPU,
``cost/in_situ.py``). Columns: measured step; measured / the whole step's; each simulation
/ the whole step's simulation; measured / simulated. A planner choosing between the whole
step and its parts reads the ratios, so the simulation that follows the measured ratio is the
one that picks right (BENCHMARKS.md, "Simulated vs measured step time").
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

__all__ = ["main", "split_graphs"]


def split_graphs(graph, parts: list[int]) -> dict[str, object]:
    """"whole" -> ``graph``; "k parts" -> ``graph`` run in k parts along its batch (the region
    grown from the first batch input along dim 0, the loss's targets counted apart), for each
    k up to the batch's size.

    Example:
        >>> import torch, fitgraph
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> g = fitgraph.capture(model, torch.randn(4, 8), lambda m, b: m(b).sum())
        >>> sorted(split_graphs(g, [2]))
        ['2 parts', 'whole']
    """
    from ..graph.dim_region import grow_region
    from ..transform.fission import split_region
    from ..transform.fission_loss import count_targets_apart, counting_nodes
    from ..transform.view_chains import collapse_view_chains

    counted = count_targets_apart(graph)
    g = collapse_view_chains(counted)
    batch = g.inputs[g.input_names.index("batch:0")]
    region = grow_region(g, batch, 0, exclude=counting_nodes(g))
    out = {"whole": counted}
    for k in parts:
        if k <= region.length:  # NOTE: a batch of 2 has no 4 parts
            out[f"{k} parts"] = split_region(g, region, k)
    return out


def _rows(name: str, parts: list[int], repeats: int) -> list[dict]:
    from .. import zoo
    from ..capture.api import capture
    from ..cost import ProfiledCostModel
    from ..execute.executor import Executor
    from ..plan.eager import eager_plan
    from ..sim import simulate
    from ..transform.compact_masks import compact_masks
    from .harness import _copied, _eager_step

    case = zoo.build(name, "small")
    model, batch = case.model, case.batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _eager_step(model, batch, case.loss_fn, opt)()  # NOTE: AdamW state, as in steady state
    opt.zero_grad(set_to_none=True)
    graphs = split_graphs(compact_masks(capture(model, batch, case.loss_fn, opt)), parts)
    alone = ProfiledCostModel(progress=False, in_situ=False)
    situ = ProfiledCostModel(progress=False)
    systems = {}
    for label, g in graphs.items():
        alone.profile(g)
        situ.profile(g)
        plan = eager_plan(g)
        m, o = _copied(model, opt)
        ex = Executor(g, plan, m, o)
        systems[label] = (lambda ex=ex: ex(batch), o, simulate(g, plan, alone).latency_s,
                          simulate(g, plan, situ).latency_s)
    m, o = _copied(model, opt)
    systems["eager PyTorch"] = (_eager_step(m, batch, case.loss_fn, o), o, None, None)
    times: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(repeats + 1):  # NOTE: interleaved; the first round is warm-up
        for label, (run, o, _, _) in systems.items():
            o.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - t0)
    whole = systems["whole"]
    base = statistics.median(times["whole"][1:])
    out = []
    for label, (_, _, a, s) in systems.items():
        t = statistics.median(times[label][1:])
        out.append({"model": name, "graph": label, "measured_s": t, "measured_ratio": t / base,
                    "alone_ratio": a / whole[2] if a else None,
                    "situ_ratio": s / whole[3] if s else None,
                    "alone_fit": t / a if a else None, "situ_fit": t / s if s else None})
    return out


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vit-b16,bert-base")
    ap.add_argument("--parts", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    parts = [int(k) for k in args.parts.split(",")]
    print(f"machine: {platform.machine()} (1 torch thread), torch {torch.__version__}; "
          f"{args.repeats} interleaved rounds, medians\n")
    print("| model | graph | measured (ms) | measured / whole | simulated alone / whole | "
          "simulated in situ / whole | measured / simulated alone | measured / simulated "
          "in situ |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        for r in _rows(name, parts, args.repeats):
            print(f"| {r['model']} | {r['graph']} | {r['measured_s'] * 1e3:.1f} | "
                  f"{r['measured_ratio']:.3f} | {_fmt(r['alone_ratio'], '.3f')} | "
                  f"{_fmt(r['situ_ratio'], '.3f')} | {_fmt(r['alone_fit'], '.3f')} | "
                  f"{_fmt(r['situ_fit'], '.3f')} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
