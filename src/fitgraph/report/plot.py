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

__all__ = ["plot_memory"]

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
