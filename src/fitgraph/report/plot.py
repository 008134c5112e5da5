"""PNG of memory over a step, phases marked (matplotlib, headless).

Example:
    >>> import tempfile, os
    >>> from fitgraph.report.plot import plot_memory
    >>> path = os.path.join(tempfile.mkdtemp(), "m.png")
    >>> plot_memory({"eager": [10, 30, 20]}, path, phase_starts={"forward": 0, "backward": 2})
    >>> os.path.getsize(path) > 0
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["plot_memory", "plot_tradeoff"]

MIB = 2**20
PHASE_COLORS = {"forward": "#dbeafe", "loss": "#fef3c7", "backward": "#fce7f3",
                "optimizer": "#dcfce7"}


def plot_memory(series: Mapping[str, Sequence[int]], path: str, *, title: str = "",
                phase_starts: Mapping[str, int] | None = None, resident_bytes: int | None = None,
                budget_bytes: int | None = None) -> None:
    """One line per series (bytes after each instruction); phases shaded; peak annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    longest = max((len(s) for s in series.values()), default=0)
    if phase_starts:
        starts = sorted(phase_starts.items(), key=lambda kv: kv[1])
        for i, (phase, start) in enumerate(starts):
            end = starts[i + 1][1] if i + 1 < len(starts) else longest
            ax.axvspan(start, end, color=PHASE_COLORS.get(phase, "#eeeeee"), alpha=0.7, lw=0)
            ax.text((start + end) / 2, 1.0, phase, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8)
    for label, ys in series.items():
        mib = [y / MIB for y in ys]
        line, = ax.plot(range(len(mib)), mib, label=f"{label} (peak {max(mib):.1f} MiB)", lw=1.2)
        k = max(range(len(mib)), key=mib.__getitem__)
        ax.plot([k], [mib[k]], "o", color=line.get_color(), ms=4)
    if resident_bytes is not None:
        ax.axhline(resident_bytes / MIB, color="gray", ls=":", lw=1,
                   label="resident (weights, batch, state)")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / MIB, color="red", ls="--", lw=1, label="budget")
    ax.set_xlabel("instruction")
    ax.set_ylabel("device memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, pad=14)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


MARKERS = "osD^v<>ph*Xd"
FRACTIONS = (0.8, 0.6, 0.4)       # the report's "at 80% / 60% / 40% of the eager peak"
OVERHEADS = (0.05, 0.10)          # the report's "least peak at <= 5% / 10% overhead"


def plot_tradeoff(rows, path: str, *, title: str = "") -> None:
    """Measured peak vs step time, one curve (or marker set) per system; fitgraph at each
    peer's peak as hollow markers; dotted lines at 80/60/40% of eager's peak and at 5/10%
    over eager's time. ``rows``: one model's ``BenchRow``s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=110)
    eager = next((r for r in rows if r.system == "eager" and r.peak_bytes), None)
    if eager is not None and eager.step_s:
        for f in FRACTIONS:
            ax.axhline(f * eager.peak_bytes / MIB, color="gray", ls=":", lw=0.8)
            ax.text(1.0, f * eager.peak_bytes / MIB, f" {f:.0%}", va="center", fontsize=7,
                    color="gray", transform=ax.get_yaxis_transform())
        for o in OVERHEADS:
            ax.axvline((1 + o) * eager.step_s * 1e3, color="gray", ls=":", lw=0.8)
            ax.text((1 + o) * eager.step_s * 1e3, 1.0, f"+{o:.0%}", ha="center", va="bottom",
                    fontsize=7, color="gray", transform=ax.get_xaxis_transform())
    groups = {}
    for r in rows:
        if r.step_s is not None and r.peak_bytes is not None:
            key = "fitgraph @ peer's peak" if r.matched else r.system
            groups.setdefault(key, []).append((r.step_s * 1e3, r.peak_bytes / MIB))
    for i, (label, pts) in enumerate(groups.items()):
        pts.sort(key=lambda p: p[1])
        style = MARKERS[i % len(MARKERS)] + ("" if label.startswith("fitgraph @") else "-")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, ms=6,
                mfc="none" if label.startswith("fitgraph @") else None)
    ax.set_xlabel("step time (ms, median, measured)")
    ax.set_ylabel("peak memory (MiB, measured)")
    ax.set_title(title or f"{rows[0].model}: measured peak vs step time", pad=12)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
