"""How low does the peak go at a bounded slowdown? Measured on this machine (issue 4's benchmark).

    python -m fitgraph.bench.fit_within_latency [--models bert-base,vit-b16,gpt2,unet,resnet50]
        [--limits 1.05,1.10] [--solvers auto,joint] [--repeats 7] [--time-budget 60]
    python -m fitgraph.bench.fit_within_latency --models gpt2-50k --solvers hotspot,fission
    python -m fitgraph.bench.fit_within_latency ... --processes 3

For each model (the zoo's small configuration with AdamW in the step; ``gpt2-50k``: GPT-2 with
its 50,257-token vocabulary at sequence 1024, 3 layers of width 256, batch 1) fitgraph plans
with each solver under each latency limit (``fitgraph.optimize(latency_limit=...)``: the least
peak within the limit, on this machine's measured op costs), then every plan and eager are
measured in one process: the peak once under the allocator meter (resident bytes included), the
step time in interleaved rounds, each plan's step between two eager steps (overhead: the median
of the plan's time / the mean of the eager steps around it). ``--reprofile`` measures every op again first (a cached profile may date
from a busy machine). Torch runs on one thread. The table gives each
plan's measured peak / eager's and measured overhead, and the verdict against the target: at
most 10% overhead with a peak at most ``TARGETS[model]`` of eager's (the MAGIS paper's GPU
range, 15–60% of PyTorch at ≤10%). A second table gives, per model, the least measured peak
among the plans that measured within 10% (``best_within``), whatever limit each was planned for.
``--processes N`` runs each model in N fresh processes in turn and reports the median overhead
over them, each process's in brackets (``merged``): a plan's measured overhead moves by several
points from one process to the next (where its tensors land in the heap), more than the
rounds within one process show. The page-faults column gives the minor page faults of a timed
step, eager PyTorch's → the plan's (medians, per process): eager's blocks of 32 MiB or more
fault a varying number of pages from one process to the next, plans' usually none.

On the CPU, "host" and "device" are the same RAM: an offloaded tensor (solver ``joint``) moves
into a host buffer allocated before the step, off the measured peak exactly as host memory is
off a GPU's; the copies run in line and their time is in the step. ``auto`` (remat, reordering
and fission) offloads nothing.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

__all__ = ["TARGETS", "gpt2_50k_case", "main"]

TARGETS = {"bert-base": 0.40, "vit-b16": 0.40, "gpt2": 0.40, "unet": 0.40, "resnet50": 0.80,
           "gpt2-50k": 0.50}
OVERHEAD = 0.10


def gpt2_50k_case():
    """A ZooCase of GPT-2 with a 50k vocabulary at sequence 1024 (3 x 256, batch 1, no dropout).

    Example:
        >>> case = gpt2_50k_case()
        >>> case.model.wte.num_embeddings, tuple(case.batch["input_ids"].shape)
        (50257, (1, 1024))
    """
    from ..zoo.gpt2 import GPT2LM, GPT2Block, GPT2Config
    from ..zoo.registry import ZooCase, token_lm_loss

    cfg = GPT2Config(3, 256, 4, 50257, 1024, batch_size=1, seq_len=1024, dropout=0.0)
    torch.manual_seed(0)
    model = GPT2LM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 1025), generator=torch.Generator().manual_seed(0))
    return ZooCase(name="gpt2-50k", config="custom", model=model,
                   batch={"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]},
                   loss_fn=token_lm_loss, block_types=(GPT2Block,),
                   description="GPT-2, 50k vocabulary, sequence 1024, 3 x 256, batch 1")


def _case(name: str):
    from .. import zoo

    return gpt2_50k_case() if name == "gpt2-50k" else zoo.build(name, "small")


def _rows(case, limits: list[float], solvers: list[str], repeats: int, time_budget: float,
          progress, cost_model=None) -> list[dict]:
    from ..api import optimize
    from .harness import _eager_step, _measure_memory, _System, _time_rounds

    systems = []
    batch, loss_fn = case.batch, case.loss_fn

    def add(label, limit, make_step):
        model = copy.deepcopy(case.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        s = _System(label, limit, model, opt, lambda: None)
        try:
            t0 = time.perf_counter()
            s.step = make_step(model, opt)
            s.prepare_s = time.perf_counter() - t0
            opt.zero_grad(set_to_none=True)
            s.step()
        except Exception as e:  # NOTE: a failing plan is a row with its error
            s.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        systems.append(s)
        progress(f"  {case.name} {label}: {'ok' if not s.error else s.error}")

    add("eager", None, lambda m, o: _eager_step(m, batch, loss_fn, o))

    def planned(limit, solver):
        def make(m, o):
            _eager_step(m, batch, loss_fn, o)()  # NOTE: AdamW state exists, as in steady state
            o.zero_grad(set_to_none=True)
            step = optimize(m, batch, loss_fn, o, latency_limit=limit, time_budget=time_budget,
                            cost_model=cost_model, solver=solver)
            return lambda: step(batch)
        return make

    for limit in limits:
        for solver in solvers:
            add(f"fitgraph {solver}", limit, planned(limit, solver))
    ok = [s for s in systems if not s.error]
    _measure_memory(ok, batch)
    eager = systems[0]
    _time_rounds(ok, repeats, reference=eager)
    out = []
    for s in systems:
        ratio = (1.0 if s is eager else statistics.median(s.ratios)) if s.times else None
        out.append({"model": case.name, "system": s.name, "limit": s.budget, "peak": s.peak,
                    "peak_ratio": s.peak / eager.peak if s.peak else None,
                    "overhead": ratio - 1 if ratio else None,
                    "solve_s": s.prepare_s, "error": s.error,
                    "faults": statistics.median(s.faults) if s.faults else None,
                    "eager_faults": statistics.median(eager.faults) if eager.faults else None})
    return out


def _model_rows(name: str, args) -> list[dict]:
    cm = None
    if args.reprofile:
        from ..cost import ProfiledCostModel
        cm = ProfiledCostModel(progress=False, refresh=True)  # NOTE: one per model
    return _rows(_case(name), [float(x) for x in args.limits.split(",")],
                 args.solvers.split(","), args.repeats, args.time_budget,
                 progress=lambda m: None, cost_model=cm)


def verdict(row: dict, target: float) -> str:
    if row["error"]:
        return "error"
    if row["overhead"] > OVERHEAD:
        return f"over {OVERHEAD:.0%} overhead"
    return "meets" if row["peak_ratio"] <= target else f"peak above {target:.0%}"


def best_within(rows: list[dict], overhead: float = OVERHEAD) -> dict[str, dict | None]:
    """model -> the plan row with the least measured peak among those measured within
    ``overhead`` (None: no plan was), whatever limit it was planned for: the acceptance asks
    for the peak at a measured overhead, and a plan made for 1.10x may measure past it while
    one made for 1.05x does not.

    Example:
        >>> rows = [{"model": "m", "system": "eager", "peak_ratio": 1.0, "overhead": 0.0},
        ...         {"model": "m", "system": "auto", "peak_ratio": 0.5, "overhead": 0.04},
        ...         {"model": "m", "system": "auto", "peak_ratio": 0.4, "overhead": 0.12}]
        >>> best_within(rows)["m"]["peak_ratio"]
        0.5
    """
    out: dict[str, dict | None] = {}
    for r in rows:
        out.setdefault(r["model"], None)
        if r["system"] == "eager" or r.get("error") or r["overhead"] is None:
            continue
        best = out[r["model"]]
        if r["overhead"] <= overhead and (best is None or r["peak_ratio"] < best["peak_ratio"]):
            out[r["model"]] = r
    return out


def merged(runs: list[list[dict]]) -> list[dict]:
    """One row per (model, system, limit) from the rows of several processes: the median of
    their measured overheads (``overheads`` keeps each), the highest of their measured peaks
    (a plan is re-made in each process; on the same cached profile it is the same plan, and
    ``peaks_differ`` says where it was not); an error in any process is the row's error.

    Example:
        >>> a = [{"model": "m", "system": "auto", "limit": 1.1, "peak": 40, "peak_ratio": 0.4,
        ...       "overhead": 0.04, "solve_s": 9.0, "error": ""}]
        >>> b = [dict(a[0], overhead=0.12)]; c = [dict(a[0], overhead=0.07)]
        >>> r = merged([a, b, c])[0]
        >>> r["overhead"], r["overheads"], r["peaks_differ"]
        (0.07, [0.04, 0.12, 0.07], False)
    """
    out: dict[tuple, dict] = {}
    for rows in runs:
        for r in rows:
            key = (r["model"], r["system"], r["limit"])
            m = out.setdefault(key, dict(r, overheads=[], peaks=[], errors=[], faulted=[]))
            m["overheads"].append(r["overhead"])
            m["faulted"].append((r.get("eager_faults"), r.get("faults")))
            m["peaks"].append(r["peak_ratio"])
            m["errors"].append(r["error"])
    for m in out.values():
        ok = [o for o in m["overheads"] if o is not None]
        peaks = [p for p in m.pop("peaks") if p is not None]
        m["error"] = next((e for e in m.pop("errors") if e), "")
        m["overhead"] = statistics.median(ok) if ok and not m["error"] else None
        m["peak_ratio"] = max(peaks) if peaks else None
        m["peaks_differ"] = len(set(peaks)) > 1
    return list(out.values())


def _in_processes(name: str, args, n: int) -> list[dict]:
    """``_rows`` of model ``name`` run in ``n`` fresh processes one after another (the first
    re-profiles if asked; the others plan on its cache), merged (``merged``).

    NOTE: the same plan measured +4% in one process and +13% in another (BERT small, 1.10x,
    no page faults in either): where a step's tensors land in the heap moves a plan's time by
    more than a round-to-round spread shows; a median over processes is what a user would see."""
    import json
    import subprocess
    import sys
    import tempfile

    runs = []
    for i in range(n):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "fitgraph.bench.fit_within_latency", "--models", name,
                   "--limits", args.limits, "--solvers", args.solvers, "--repeats",
                   str(args.repeats), "--time-budget", str(args.time_budget),
                   "--rows-json", f.name] + (["--reprofile"] if args.reprofile and i == 0 else [])
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(f.name) as rows:
                runs.append(json.load(rows))
    return merged(runs)


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert-base,vit-b16,gpt2,unet,resnet50")
    ap.add_argument("--limits", default="1.05,1.10")
    ap.add_argument("--solvers", default="auto,joint")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--time-budget", type=float, default=60.0)
    ap.add_argument("--reprofile", action="store_true",
                    help="measure every op again now (the cost cache may hold timings taken "
                         "while other work shared the machine)")
    ap.add_argument("--processes", type=int, default=1,
                    help="run each model in this many fresh processes and report the median "
                         "overhead over them (1: all in this process)")
    ap.add_argument("--rows-json", help=argparse.SUPPRESS)  # NOTE: a child's rows, for its parent
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.rows_json:
        import json

        every = []
        for name in args.models.split(","):
            every += _model_rows(name, args)
        with open(args.rows_json, "w") as f:
            json.dump(every, f)
        return 0
    print(f"machine: {platform.machine()} ({torch.get_num_threads()} torch thread), torch "
          f"{torch.__version__}; measured; AdamW in the step; {args.repeats} interleaved rounds,"
          " medians\n")
    print("| model | system | latency limit | measured peak / eager | measured overhead "
          "| page faults a step (eager → plan) | solve (s) | target | verdict |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    every: list[dict] = []
    for name in args.models.split(","):
        rows = (_in_processes(name, args, args.processes) if args.processes > 1
                else _model_rows(name, args))
        for r in rows:
            if r["system"] == "eager":
                continue
            target = TARGETS.get(name, 0.40)
            peak = "—" if r["peak_ratio"] is None else f"{r['peak_ratio']:.3f}"
            ovh = "—" if r["overhead"] is None else f"{r['overhead']:+.1%}"
            pairs = r.get("faulted") or [(r.get("eager_faults"), r.get("faults"))]
            faults = ", ".join("—" if e is None or p is None else f"{e:,.0f} → {p:,.0f}"
                               for e, p in pairs)
            if len(r.get("overheads", ())) > 1:
                ovh += " (" + ", ".join("—" if o is None else f"{o:+.1%}"
                                        for o in r["overheads"]) + ")"
            if r.get("peaks_differ"):
                peak += " (max; plans differed)"
            print(f"| {name} | {r['system']} | {r['limit']:.2f} | {peak} | {ovh} "
                  f"| {faults} | {r['solve_s']:.0f} | {target:.0%} | {verdict(r, target)}"
                  f"{' ' + r['error'] if r['error'] else ''} |", flush=True)
        every += rows
    print(f"\nLeast measured peak among the plans measured within {OVERHEAD:.0%} overhead:\n")
    print("| model | measured peak / eager | measured overhead | planned for | target | verdict |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in best_within(every).items():
        target = TARGETS.get(name, 0.40)
        if r is None:
            print(f"| {name} | — | — | — | {target:.0%} | no plan within {OVERHEAD:.0%} |")
            continue
        print(f"| {name} | {r['peak_ratio']:.3f} | {r['overhead']:+.1%} | {r['system']} "
              f"{r['limit']:.2f} | {target:.0%} | {verdict(r, target)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
