"""``fitgraph bench --report DIR``: one Markdown page from one run's rows, with one PNG per model.

The page says where and how it was measured (machine, CPU, versions, the command), then per
model: the trade-off plot, a summary — per system, the least measured peak within 5% / 10%
measured overhead and the least measured overhead at or under 80% / 60% / 40% of eager's
measured peak (nothing interpolated: "—" where a system has no such row) — every row, the
verdicts at each peer's peak, and each error verbatim. Every figure comes from the rows.

Example:
    >>> from fitgraph.bench.harness import BenchRow
    >>> from fitgraph.bench.report_page import least_overhead_under, least_peak_within
    >>> rows = [BenchRow("m", "eager", None, 100, 1.0), BenchRow("m", "x", 0.9, 85, 1.04),
    ...         BenchRow("m", "x", 0.7, 70, 1.2)]
    >>> least_peak_within(rows, "x", 0.05).peak_bytes, least_overhead_under(rows, "x", 0.8).budget
    (85, 0.7)
    >>> least_overhead_under(rows, "x", 0.6) is None
    True
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
from importlib import metadata

from ..report.plot import FRACTIONS, OVERHEADS, plot_tradeoff
from .glance import glance_text
from .harness import SAC_SAVED, SAC_SAVED_PREFIX, BenchRow
from .verdicts import verdicts

__all__ = ["least_overhead_under", "least_peak_within", "machine_lines", "markdown_table",
           "summary_table", "write_csv", "write_report"]

MIB = 2**20
PAGE = "BENCHMARKS.md"
NONE = "—"
VERSIONS = ("torch", "numpy", "scipy", "highspy", "matplotlib")


def _eager(rows: list[BenchRow], model: str) -> BenchRow:
    return next(r for r in rows if r.model == model and r.system == "eager")


def _measured(rows: list[BenchRow], system: str) -> list[BenchRow]:
    return [r for r in rows if r.system == system and not r.error and r.step_s is not None
            and r.peak_bytes is not None]


def _overhead(r: BenchRow, eager: BenchRow) -> float | None:
    return r.overhead(eager.step_s) if eager.step_s else None


def least_peak_within(rows: list[BenchRow], system: str, overhead: float) -> BenchRow | None:
    """``system``'s measured row of least peak among those at most ``overhead`` slower than
    eager (measured; fitgraph's rows include its runs at the peers' peaks). ``rows``: one
    model's."""
    eager = _eager(rows, rows[0].model)
    ok = [r for r in _measured(rows, system) if (o := _overhead(r, eager)) is not None
          and o <= overhead]
    return min(ok, key=lambda r: (r.peak_bytes, r.step_s), default=None)


def least_overhead_under(rows: list[BenchRow], system: str, fraction: float) -> BenchRow | None:
    """``system``'s fastest measured row among those peaking at most ``fraction`` of eager's
    measured peak. ``rows``: one model's."""
    eager = _eager(rows, rows[0].model)
    if not eager.peak_bytes:
        return None
    ok = [r for r in _measured(rows, system) if r.peak_bytes <= fraction * eager.peak_bytes]
    return min(ok, key=lambda r: (r.step_s, r.peak_bytes), default=None)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _range(values: list[float]) -> str:
    if not values:
        return NONE
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}"


def _system_notes(rows: list[BenchRow]) -> str:
    """Per budget: an exact solver's optimality (or its stop at the time limit) and errors."""
    out = []
    for r in rows:
        where = r.system if r.budget is None else f"{r.budget:.3g}"
        if r.matched:
            where = f"@ {r.matched}"
        if r.error:
            out.append(f"{where}: error")
        elif r.notes and r.system == "checkmate":
            out.append(f"{where}: {r.notes.split('; ')[0]}")
    return "; ".join(out)


def summary_table(rows: list[BenchRow]) -> str:
    """One model's rows: per system, least peak within 5% / 10% overhead, overhead at 80% /
    60% / 40% of eager's peak, solve / compile times, notes."""
    eager = _eager(rows, rows[0].model)
    head = (["system"] + [f"least peak, ≤{o:.0%} overhead" for o in OVERHEADS]
            + [f"overhead, peak ≤{f:.0%} of eager" for f in FRACTIONS]
            + ["solve (s)", "warm-up (s)", "notes"])
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for system in dict.fromkeys(r.system for r in rows):
        mine = [r for r in rows if r.system == system]
        cells = [system]
        for o in OVERHEADS:
            r = least_peak_within(rows, system, o)
            cells.append(NONE if r is None else
                         f"{r.peak_bytes / MIB:.1f} MiB = {r.peak_bytes / eager.peak_bytes:.2f}× "
                         f"({_overhead(r, eager):+.1%})")
        for f in FRACTIONS:
            r = least_overhead_under(rows, system, f)
            cells.append(NONE if r is None else
                         f"{_overhead(r, eager):+.1%} ({r.peak_bytes / eager.peak_bytes:.2f}×)")
        cells.append(_range([r.solve_s for r in mine if r.solve_s is not None]))
        cells.append(_range([r.prepare_s for r in mine if r.prepare_s]))
        cells.append(_cell(_system_notes(mine)))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def markdown_table(rows: list[BenchRow], *, details: bool = False) -> str:
    """Every row; ``details`` adds the spread of the timed steps, solve time and notes."""
    head = ["model", "system", "budget", "peak (MiB)", "peak / eager", "step (ms)", "overhead"]
    head += (["spread", "warm-up (s)", "solve (s)", "notes"] if details
             else ["compile/solve (s)"])
    head.append("error")
    text = 2 if details else 1   # NOTE: left-aligned columns at the end: notes, error
    out = ["| " + " | ".join(head) + " |",
           "|---|---|" + "---:|" * (len(head) - 2 - text) + "---|" * text]
    for r in rows:
        e = _eager(rows, r.model)
        pr = None if r.peak_bytes is None or not e.peak_bytes else r.peak_bytes / e.peak_bytes
        ov = _overhead(r, e)
        cells = [r.model, f"{r.system} @ {r.matched}" if r.matched else r.system,
                 "" if r.budget is None else f"{r.budget:.3g}",
                 "" if r.peak_bytes is None else f"{r.peak_bytes / MIB:.1f}",
                 "" if pr is None else f"{pr:.2f}",
                 "" if r.step_s is None else f"{r.step_s * 1e3:.0f}",
                 "" if ov is None else f"{100 * ov:+.1f}%"]
        if details:
            cells += ["" if r.spread is None else f"{r.spread:.0%}", f"{r.prepare_s:.1f}",
                      "" if r.solve_s is None else f"{r.solve_s:.2f}", r.notes]
        else:
            cells.append(f"{r.prepare_s:.1f}")
        cells.append(r.error)
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out)


def write_csv(rows: list[BenchRow], path: str) -> None:
    """One line per row: its fields, plus its peak over eager's and its overhead."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].as_dict()) + ["peak_vs_eager",
                                                                    "overhead"])
        w.writeheader()
        for r in rows:
            e = _eager(rows, r.model)
            w.writerow({**r.as_dict(),
                        "peak_vs_eager": (None if r.peak_bytes is None or not e.peak_bytes
                                          else r.peak_bytes / e.peak_bytes),
                        "overhead": _overhead(r, e)})


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    from ..cost.profiler import cpu_model

    return cpu_model()


def machine_lines(threads: int) -> list[str]:
    """Where this ran: OS, CPU, cores, threads, GPU, versions (Markdown list items)."""
    import torch

    gpu = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
    versions = ", ".join(f"{n} {_version(n)}" for n in VERSIONS)
    return [f"- machine: {platform.machine()}, {platform.platform()}",
            f"- CPU: {_cpu_model()}, {os.cpu_count()} logical cores; torch threads: {threads}",
            f"- GPU: {gpu}",
            f"- python {platform.python_version()}, {versions}",
            f"- cost cache: `FITGRAPH_CACHE_DIR={os.environ.get('FITGRAPH_CACHE_DIR', '')}`"
            " (op costs measured on first use and kept there)"]


def _how_to_read(rows: list[BenchRow], repeats: int, checkmate_time_limit: float) -> str:
    saved = ", ".join(f"aten.{n}" for n in sorted(SAC_SAVED))
    return f"""\
Each system runs on its own copy of the model with its own AdamW, in one process: warmed up
(two steps), measured once under the memory meter, then timed in {repeats} interleaved rounds
(the order rotates each round), each of its steps between two eager steps.

- **peak**: resident bytes before the step (weights, batch, AdamW state) plus the allocator's
  peak during one step, measured (CPU: the allocator's own events; CUDA: `max_memory_allocated`).
- **step**: eager's median step time × the median of the system's step / the mean of the two
  eager steps around it (the machine's speed drifts by tens of percent over minutes; within
  one bracket it does not); **overhead**: step / eager's step − 1; **spread**: (max − min) /
  median of that system's raw timed steps. torch.compile variants are timed the same way right
  after compiling (after the next variant's `dynamo.reset()` they would recompile).
- **budget**: the fraction of eager's measured peak asked for; for torch.compile it is
  `activation_memory_budget`, which bounds saved activations, not the peak. **fitgraph @ X**:
  fitgraph (auto) asked for X's measured peak, in bytes — "at X's memory, who is faster"
  (the verdicts).
- **least peak, ≤5% / ≤10% overhead**: the least measured peak among a system's rows whose
  measured overhead is at most that. **overhead, peak ≤80% / 60% / 40% of eager**: the least
  measured overhead among a system's rows whose measured peak is at most that share of eager's.
  Nothing is interpolated; "—": the system has no such row. fitgraph's rows include its runs at
  the peers' peaks.
- **warm-up (s)**: wall time until two steps have run: compiling (torch.compile, with torch's
  on-disk caches as found), or capture + op profiling + solving (fitgraph's solvers; the first
  one pays the profiling of each new op into the cost cache). **solve (s)**: the solver alone.
- Systems: `checkpoint` = `torch.utils.checkpoint` (non-reentrant) around every block; `sac` =
  the same with `create_selective_checkpoint_contexts`: outputs of {saved} and
  `aten.{SAC_SAVED_PREFIX}*` saved, everything else recomputed; `save_on_cpu` =
  `torch.autograd.graph.save_on_cpu(pin_memory=True)` (CUDA only: on a CPU run host memory is
  the same RAM); `compile_aot_eager` / `compile_inductor` = `torch.compile` with that backend and
  `activation_memory_budget`, compiled fresh per budget; `dtr`, `rotor`, `checkmate` = DTR's
  greedy eviction, Rotor's DP over blocks and Checkmate's MILP (HiGHS, time limit
  {checkmate_time_limit:g} s; "time limit, gap g" = stopped with that proven gap) as fitgraph
  solvers executed by fitgraph; `fitgraph` = solver `auto`; `fitgraph_inductor` =
  `torch.compile` with `fitgraph.backend(inner="inductor")`: fitgraph's plan (hotspot) chooses
  what the forward saves, inductor compiles both halves (its budget is a fraction of the
  compiled graph's simulated eager peak; at an inductor peer's peak, those bytes less the
  optimizer state, which the backend does not plan).
- Step times on a shared machine are noisy: {_noise(rows)}"""


def _noise(rows: list[BenchRow]) -> str:
    spreads = [r.spread for r in rows if r.spread is not None]
    if not spreads:
        return "no system was timed."
    return (f"the median spread of a system's timed steps in this run is "
            f"{statistics.median(spreads):.0%} (largest {max(spreads):.0%}); read differences "
            "smaller than that as ties.")


def write_report(rows: list[BenchRow], directory: str, *, command: str, threads: int,
                 repeats: int, checkmate_time_limit: float, wall_s: float,
                 load: tuple[float, float] | None = None) -> str:
    """Write ``directory``/BENCHMARKS.md, one PNG per model and bench.csv; return the page's
    path. ``command``: the command line that reproduces the run; ``load``: the 1-minute load
    average at its start and end."""
    os.makedirs(directory, exist_ok=True)
    write_csv(rows, os.path.join(directory, "bench.csv"))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# fitgraph bench", "",
             f"Generated by `{command}` ({now}; the run took {wall_s / 60:.1f} min). Every "
             "number on this page comes from that run; running the command again regenerates "
             "the page, its plots and `bench.csv`.", "", "## Machine", "",
             *machine_lines(threads)]
    if load is not None:
        lines.append(f"- load average (1 min) at start / end: {load[0]:.2f} / {load[1]:.2f} "
                     "(other work on the machine slows and spreads step times)")
    lines += ["", "## How to read it", "", _how_to_read(rows, repeats, checkmate_time_limit)]
    lines += ["", "## At a glance", "", glance_text(rows)]
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        png = f"{model}.png"
        plot_tradeoff(mine, os.path.join(directory, png))
        e = _eager(mine, model)
        eager_line = (f"eager: peak {e.peak_bytes / MIB:.1f} MiB, step {e.step_s * 1e3:.0f} ms"
                      if e.peak_bytes and e.step_s else f"eager: {e.error}")
        lines += ["", f"## {model}", "", eager_line + ".", "", f"![{model}]({png})", "",
                  summary_table(mine), "", "All rows:", "", markdown_table(mine, details=True)]
        said = verdicts(mine)
        if said:
            lines += ["", "At each peer's measured peak (fitgraph planned for that many bytes):",
                      "", *[f"- {s}" for s in said]]
        errors = [r for r in mine if r.error]
        if errors:
            lines += ["", "Errors, verbatim:", ""]
            for r in errors:
                label = r.system if r.budget is None else f"{r.system} {r.budget:.3g}"
                label = f"{label} @ {r.matched}" if r.matched else label
                lines.append(f"- {label}: `{r.error}`")
    lines.append("")
    path = os.path.join(directory, PAGE)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path

