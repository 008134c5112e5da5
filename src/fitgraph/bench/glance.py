"""The side-by-side run at a glance: what README.md and BENCHMARKS.md quote, from ``bench.csv``.

    python -m fitgraph.bench.glance out/report/bench.csv

Three things, each computed from the rows of one ``fitgraph bench`` run (nothing typed in):

- **wins**: at how many peers' measured peaks fitgraph (planned for that many bytes) measured
  a peak no higher and a step no slower (``verdicts.outcome``), out of how many;
- **in short**: per model, per-block checkpointing, torch.compile's activation memory budget
  (aot_eager, budget 0.5) and fitgraph at each of their peaks, and fitgraph at 0.5 of eager
  ("peak / eager, overhead");
- **planning time**: per classic planner (DTR, Rotor, Checkmate) and budget, its solve time
  beside fitgraph's at the peak it reached, and their ratio (the issue asks for ≤ 1/10).

Example:
    >>> from fitgraph.bench.harness import BenchRow
    >>> from fitgraph.bench.glance import planning_times, wins
    >>> rows = [BenchRow("m", "eager", None, 100, 1.0),
    ...         BenchRow("m", "rotor", 0.5, 60, 1.3, solve_s=0.5),
    ...         BenchRow("m", "fitgraph", None, 58, 1.2, matched="rotor 0.5", solve_s=2.0)]
    >>> wins(rows)
    (1, 1)
    >>> planning_times(rows)[0]["ratio"]
    4.0
"""

from __future__ import annotations

import argparse
import csv

from .harness import BenchRow
from .verdicts import fitgraph_at, outcome

__all__ = ["glance_text", "in_short", "planning_times", "read_csv", "wins"]

CLASSIC = ("dtr", "rotor", "checkmate")
_FLOATS = ("budget", "step_s", "prepare_s", "solve_s", "spread")
_INTS = ("peak_bytes",)


def read_csv(path: str) -> list[BenchRow]:
    """The rows ``report.write_csv`` wrote (its derived columns dropped)."""
    fields = set(BenchRow.__dataclass_fields__)
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            kw = {k: v for k, v in raw.items() if k in fields}
            for k in _FLOATS:
                kw[k] = float(kw[k]) if kw.get(k) not in (None, "") else (
                    0.0 if k == "prepare_s" else None)
            for k in _INTS:
                kw[k] = int(kw[k]) if kw.get(k) not in (None, "") else None
            rows.append(BenchRow(**kw))
    return rows


def wins(rows: list[BenchRow]) -> tuple[int, int]:
    """(peers' peaks where fitgraph won, peers' peaks where fitgraph planned and was measured)."""
    words = [outcome(rows, peer)[1] for peer in rows]
    return words.count("wins"), words.count("wins") + words.count("loses")


def _short(row: BenchRow | None, eager: BenchRow) -> str:
    if row is None:
        return "—"
    if row.error or row.peak_bytes is None or row.step_s is None:
        return "infeasible" if "Infeasible" in row.error else "error"
    return f"{row.peak_bytes / eager.peak_bytes:.2f}×, {row.step_s / eager.step_s - 1:+.0%}"


def in_short(rows: list[BenchRow]) -> str:
    """The per-model table README.md shows (see the module doc)."""
    out = ["| model | checkpoint per block: peak / eager, overhead | fitgraph at that peak "
           "| torch.compile (budget 0.5): peak / eager, overhead | fitgraph at that peak "
           "| fitgraph at 0.5 of eager |", "|---|---:|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        eager = next(r for r in mine if r.system == "eager")
        ckpt = next((r for r in mine if r.system == "checkpoint"), None)
        comp = next((r for r in mine if r.system == "compile_aot_eager" and r.budget == 0.5),
                    None)
        half = next((r for r in mine if r.system == "fitgraph" and r.budget == 0.5
                     and not r.matched), None)
        cells = [_short(ckpt, eager), _short(ckpt and fitgraph_at(mine, ckpt), eager),
                 _short(comp, eager), _short(comp and fitgraph_at(mine, comp), eager),
                 _short(half, eager)]
        out.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def planning_times(rows: list[BenchRow]) -> list[dict]:
    """Per classic planner's row that planned: its solve time, fitgraph's at its peak, and
    fitgraph's / its (None where fitgraph did not plan there)."""
    out = []
    for peer in rows:
        if peer.system not in CLASSIC or peer.solve_s is None or peer.error:
            continue
        fg = fitgraph_at(rows, peer)
        fg_s = None if fg is None or fg.error else fg.solve_s
        out.append({"model": peer.model, "planner": peer.system, "budget": peer.budget,
                    "planner_s": peer.solve_s, "fitgraph_s": fg_s,
                    "ratio": None if fg_s is None or not peer.solve_s else fg_s / peer.solve_s})
    return out


def _planning_table(rows: list[BenchRow]) -> str:
    out = ["| model | planner | budget | its solve (s) | fitgraph's at its peak (s) "
           "| fitgraph / planner |", "|---|---|---:|---:|---:|---:|"]
    for p in planning_times(rows):
        fg = "—" if p["fitgraph_s"] is None else f"{p['fitgraph_s']:.2f}"
        ratio = "—" if p["ratio"] is None else f"{p['ratio']:.2f}"
        out.append(f"| {p['model']} | {p['planner']} | {p['budget']:g} | {p['planner_s']:.2f} "
                   f"| {fg} | {ratio} |")
    return "\n".join(out)


def glance_text(rows: list[BenchRow]) -> str:
    """The three parts of the module doc, as Markdown."""
    won, of = wins(rows)
    within = [p for p in planning_times(rows) if p["ratio"] is not None]
    tenth = sum(p["ratio"] <= 0.1 for p in within)
    return "\n".join([
        f"fitgraph (planned for each peer's measured peak) measured a peak no higher and a step "
        f"no slower at **{won} of {of}** peers' peaks.", "", in_short(rows), "",
        "Planning time against the classic planners, at the peak each reached:", "",
        _planning_table(rows), "",
        f"fitgraph planned in at most a tenth of the planner's time at {tenth} of "
        f"{len(within)}."])


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="bench.csv of a `fitgraph bench` run")
    args = ap.parse_args(argv)
    print(glance_text(read_csv(args.csv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
