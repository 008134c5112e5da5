"""The sweep: fitgraph on models it did not write — transformers' architectures and torch.nn blocks.

    python -m fitgraph.bench.sweep [--models gpt2,bert,...] [--rounds 7] [--out DIR]
        [--report FILE] [--timeout S] [--time-budget S]

Each model (``sweep_models``: small configs, random weights, nothing downloaded) runs in its own
subprocess (``sweep_measure.measure_model``), so a model that crashes the interpreter (a
segfault in a kernel or the profiler) or hangs becomes a row — "crashed: signal 11
(SIGSEGV) in stage capture", "timeout after 600 s in stage plan" — and the sweep goes on. Per
model: capture time, eager's measured peak, ``fitgraph.optimize(latency_limit=1.10)``'s plan time,
measured peak and paired overhead (the median over ``--rounds`` of each fitgraph step over the
eager steps around it, one thread, after warm-up), one AdamW step against eager's from the same
weights, state and RNG ("bitwise", "allclose" with its largest difference, or "MISMATCH"),
checkpointing's measured peak and overhead (Hugging Face's ``gradient_checkpointing_enable()``,
or per-block ``torch.utils.checkpoint``), fitgraph at that peak and its step time against
checkpointing's (paired in the same rounds), the smallest peak fitgraph reaches (``budget="smallest"``:
simulated and measured) and the lower bound: weights + gradients + AdamW state + batch. Writes ``DIR/sweep.csv``,
``DIR/sweep.md`` and each model's log (``DIR/logs``); ``--report FILE`` writes the section for
BENCHMARKS.md (machine, versions, command, table, errors grouped by cause).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cost.cache import CACHE_ENV

__all__ = ["main", "run_model"]

MIB = 2**20
OVERHEAD_MAX = 0.12      # NOTE: the acceptance: measured overhead at 1.10 within 12%
LOWER_BOUND_MAX = 1.25   # and, on transformers, the smallest peak within 1.25x the lower bound
TRANSFORMER_FAMILIES = ("decoder", "moe", "encoder", "encoder-decoder", "vision-transformer")
# NOTE: transformers filed under other families: speech, SegFormer (its encoder is a Mix
# Transformer), torch.nn's attention blocks
TRANSFORMER_MODELS = ("whisper", "wav2vec2", "hubert", "segformer", "nn-mha",
                      "nn-transformer-encoder")
LOG_TAIL = 3
NOISE = ("USDT:", "[W", "[transformers]", "STAGE:")   # NOTE: profiler / library chatter in logs
COLUMNS = ("model", "family", "status", "stage", "error", "error_type", "notes", "params",
           "nodes", "capture_s", "plan_s", "solve_s", "winner", "exact", "result",
           "result_detail", "lower_bound", "eager_peak", "eager_step_s", "peak_110",
           "overhead_110", "smallest_peak", "smallest_s", "smallest_measured",
           "smallest_result", "ckpt_kind", "ckpt_peak",
           "ckpt_overhead", "peak_at_ckpt", "at_ckpt_overhead", "at_ckpt_vs_ckpt", "wall_s",
           "stage_s", "latency_check")


def _save_atomic(path: str, row: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.replace(tmp, path)


def _log_tail(path: Path) -> str:
    try:
        lines = [s.strip() for s in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [s for s in lines if s and not s.startswith(NOISE)]
    return " / ".join(lines[-LOG_TAIL:])[-300:]


def run_model(name: str, *, rounds: int, timeout: float, time_budget: float,
              logdir: Path) -> dict:
    """Measure ``name`` in a fresh subprocess; its row, whatever happened to the process: the
    child's last saved row, with status "crashed: signal 11 (SIGSEGV)" (and the log's last
    lines) when it died, "timeout" when it ran past ``timeout`` seconds.
    ``tests/test_sweep.py`` runs it on a model that segfaults (slow for a doctest)."""
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"{name}.log"
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = [sys.executable, "-m", "fitgraph.bench.sweep", "--child", name, "--row-json", path,
           "--rounds", str(rounds), "--time-budget", str(time_budget)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    # NOTE: op costs measured in this sweep, not read from the user's cost cache: entries
    # measured while the machine was busy stay there, and Pegasus's were 1.45x its ops' times in
    # place (eager simulated at 335 ms, measured 231 ms), so its 1.10 plan, simulated 1.10x
    # eager, ran +19% (the cache's setting wins where the caller set one)
    env.setdefault(CACHE_ENV, str(logdir.parent / "cost-cache"))
    t0 = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc: int | None = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    try:
        with open(path) as f:
            row = json.load(f)
        os.unlink(path)
    except (OSError, ValueError):
        row = {"model": name, "stage": "start", "status": "", "error": "", "notes": ""}
    row["wall_s"] = time.perf_counter() - t0
    stage = row.get("stage", "start")
    if rc is None:
        row["status"] = "timeout"
        row["error"] = f"timeout after {timeout:.0f} s in stage {stage}"
    elif rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else "?"
        row["status"] = f"crashed: signal {-rc} ({sig})"
        row["error"] = f"in stage {stage}; log: {_log_tail(log)}"
    elif rc != 0 or not row.get("status"):
        row["status"] = f"crashed: exit {rc}"
        row["error"] = f"in stage {stage}; log: {_log_tail(log)}"
    return row


# -- tables -----------------------------------------------------------------------------------

def _mib(x) -> str:
    return "—" if x is None else f"{x / MIB:.1f}"


def _ratio(a, b) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}"


def _pct(x) -> str:
    return "—" if x is None else f"{x:+.1%}"


def is_transformer(row: dict) -> bool:
    """Whether the lower-bound criterion (1.25x) applies: attention models."""
    return row.get("family") in TRANSFORMER_FAMILIES or row["model"] in TRANSFORMER_MODELS


def checks(row: dict) -> str:
    """The acceptance checks a finished row fails, in words ("" when it passes every one).

    Example:
        >>> checks({"model": "m", "status": "ok", "overhead_110": 0.2, "family": "x"})
        'overhead +20.0% > 12%'
        >>> checks({"model": "m", "status": "ok", "ckpt_peak": 100, "peak_at_ckpt": 111,
        ...         "at_ckpt_vs_ckpt": 0.83})
        "at checkpointing's peak, peaked 1.110x it"
    """
    if row.get("status") != "ok":
        return ""
    out = []
    if row.get("overhead_110") is not None and row["overhead_110"] > OVERHEAD_MAX:
        out.append(f"overhead {row['overhead_110']:+.1%} > {OVERHEAD_MAX:.0%}")
    # NOTE: the smallest peak as measured where its plan ran, else as simulated
    small = row.get("smallest_measured") or row.get("smallest_peak")
    lb, ck = row.get("lower_bound"), row.get("ckpt_peak")
    if row.get("smallest_result") == "MISMATCH":
        out.append("the smallest plan's results differ from eager's")
    if small and lb and is_transformer(row) and small > LOWER_BOUND_MAX * lb:
        out.append(f"smallest {small / lb:.2f}x lower bound")
    if small and ck and small > ck:
        out.append("smallest above checkpointing's peak")
    at = row.get("peak_at_ckpt")
    if at and ck and at > ck:
        # NOTE: the plan made for checkpointing's peak must hold it (wav2vec2's step by
        # regions once peaked 1.11x over it while its time passed the check below)
        out.append(f"at checkpointing's peak, peaked {at / ck:.3f}x it")
    vs = row.get("at_ckpt_vs_ckpt")
    if ck and vs is None:
        out.append("no plan at checkpointing's peak")
    elif vs is not None and vs >= 1:
        out.append(f"at checkpointing's peak {vs:.2f}x its time")
    return "; ".join(out)


HEADER = ("| model | family | status | nodes | capture (s) | plan (s) | vs eager | eager peak (MiB) "
          "| lower bound (MiB) | @1.10: peak / eager | @1.10: overhead | smallest / LB (sim) "
          "| ckpt | ckpt peak / eager | ckpt overhead | fitgraph @ckpt peak: peak / ckpt "
          "| time / ckpt | fails | error / notes |")


def markdown_table(rows: list[dict]) -> str:
    """One line per model (failures included, with their error)."""
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in rows:
        e = r.get("eager_peak")
        result = r.get("result") or "—"
        if r.get("result") == "allclose":
            result += f" ({r.get('result_detail', '')})"
        text = (r.get("error") or "") + ("; " if r.get("error") and r.get("notes") else "") + \
            (r.get("notes") or "")
        vs = r.get("at_ckpt_vs_ckpt")
        lines.append(" | ".join([
            f"| {r['model']}", r.get("family", "—"), r.get("status", "—"),
            "—" if r.get("nodes") is None else f"{r['nodes']:.0f}", _num(r.get("capture_s")), _num(r.get("plan_s")), result,
            _mib(e), _mib(r.get("lower_bound")), _ratio(r.get("peak_110"), e),
            _pct(r.get("overhead_110")), _smallest(r),
            r.get("ckpt_kind") or "—", _ratio(r.get("ckpt_peak"), e), _pct(r.get("ckpt_overhead")),
            _ratio(r.get("peak_at_ckpt"), r.get("ckpt_peak")),
            "—" if vs is None else f"{vs:.2f}", checks(r) or ("—" if r.get("status") != "ok"
                                                              else "none"),
            text.replace("|", "\\|").replace("\n", " ") + " |"]))
    return "\n".join(lines)


def _smallest(r: dict) -> str:
    """The smallest peak over the lower bound: measured (simulated), or simulated alone."""
    sim = _ratio(r.get("smallest_peak"), r.get("lower_bound"))
    if not r.get("smallest_measured"):
        return sim
    return f"{_ratio(r['smallest_measured'], r.get('lower_bound'))} ({sim})"


def _num(x) -> str:
    return "—" if x is None else f"{x:.1f}"


def by_cause(rows: list[dict]) -> dict[str, list[dict]]:
    """Failed rows grouped by status and error type (the cause), in first-seen order."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("status") == "ok":
            continue
        key = r.get("status", "?") + (f" ({r['error_type']})" if r.get("error_type") else "")
        out.setdefault(key, []).append(r)
    return out


def report_section(rows: list[dict], command: str, wall_s: float, rounds: int) -> str:
    """The BENCHMARKS.md section: machine, versions, command, summary, table, errors by cause."""
    import numpy
    import torch

    from .sweep_measure import MIN_TIMED_S

    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    ok = [r for r in rows if r.get("status") == "ok"]
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    lines = [
        f"## The sweep: {len(rows)} models fitgraph did not write",
        "",
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"1 torch thread, load average {', '.join(f'{x:.2f}' for x in load)} at the end; "
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {tf}, "
        f"numpy {numpy.__version__}. Command: `{command}` (at least {rounds} rounds, more for a short step: "
        f"{MIN_TIMED_S:.0f} s of steps timed; the models took "
        f"{wall_s / 60:.0f} min). Each model in its own process; peaks measured (allocator events + resident "
        "bytes); overheads paired with eager (median of the rounds); smallest peak: every "
        "transformation allowed (fission's results allclose), planned with "
        "`budget=\"smallest\"` (the search's own plan), simulated and measured in one step "
        "against eager (a step by regions: each region at its least, measured); lower bound = weights + gradients + AdamW "
        "state + batch.",
        "",
        f"{len(ok)} of {len(rows)} models capture, plan and run with eager's results; "
        f"{sum(1 for r in ok if r.get('result') == 'bitwise')} bitwise. "
        f"{sum(1 for r in ok if not checks(r))} of them pass every acceptance check.",
        "",
        markdown_table(rows),
        "",
    ]
    causes = by_cause(rows)
    if causes:
        lines += ["Failures by cause:", ""]
        for cause, rs in causes.items():
            lines.append(f"- **{cause}**: {', '.join(r['model'] for r in rs)}")
            for r in rs:
                lines.append(f"  - {r['model']}: {r.get('error', '')}")
        lines.append("")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})


TEXT_COLUMNS = ("model", "family", "status", "stage", "error", "error_type", "notes", "winner",
                "result", "result_detail", "ckpt_kind", "exact", "stage_s", "smallest_result",
                "latency_check")


def read_csv(paths: list[str]) -> list[dict]:
    """Rows of earlier runs' ``sweep.csv`` files, numbers as numbers; a model in a later file
    replaces its row from an earlier one (a rerun of a few models), in first-seen order."""
    rows: dict[str, dict] = {}
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                for k, v in r.items():
                    if k not in TEXT_COLUMNS:
                        r[k] = float(v) if v not in ("", None) else None
                rows[r["model"]] = r
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    from .sweep_models import names

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(names()))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="out/sweep")
    ap.add_argument("--report", help="write the BENCHMARKS.md section to this file")
    # NOTE: the unrolled GRU (23,615 nodes) takes about 15 minutes on a 2-core machine
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per model")
    ap.add_argument("--time-budget", type=float, default=30.0, help="fitgraph's solver time")
    ap.add_argument("--child", help=argparse.SUPPRESS)      # NOTE: a subprocess's one model
    ap.add_argument("--row-json", help=argparse.SUPPRESS)
    ap.add_argument("--from-csv", help="comma-separated sweep.csv files to merge (later ones "
                    "replace a model's row) into the tables and --report, measuring nothing")
    args = ap.parse_args(argv)
    if args.child:
        from .sweep_measure import measure_model

        measure_model(args.child, args.rounds, args.time_budget,
                      save=lambda row: _save_atomic(args.row_json, row))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m fitgraph.bench.sweep " + " ".join(argv if argv is not None
                                                            else sys.argv[1:])
    rows = read_csv(args.from_csv.split(",")) if args.from_csv else []
    for name in [] if args.from_csv else [m for m in args.models.split(",") if m]:
        row = run_model(name, rounds=args.rounds, timeout=args.timeout,
                        time_budget=args.time_budget, logdir=out / "logs")
        rows.append(row)
        print(f"{name}: {row['status']} ({row['wall_s']:.0f} s)"
              + (f": {row['error']}" if row.get("error") else ""), flush=True)
        write_csv(rows, out / "sweep.csv")   # NOTE: after each model: a killed sweep keeps its rows
    if args.from_csv:
        write_csv(rows, out / "sweep.csv")   # NOTE: the merged rows, one file
    (out / "sweep.md").write_text(markdown_table(rows) + "\n")
    if args.report:
        # NOTE: the models' own wall times: a merged report (--from-csv) measured nothing now
        wall = sum(r.get("wall_s") or 0 for r in rows)
        Path(args.report).write_text(report_section(rows, command, wall, args.rounds))
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
