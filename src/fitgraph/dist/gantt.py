"""A simulated pipeline iteration drawn as a Gantt chart: one row per device, a box per action.

Forwards, backwards and weight-gradient parts (``zb-h1``) each have a color, darker for later
chunks of a device (interleaved); micro-batch numbers are written in the boxes when there are
few. matplotlib is imported when a chart is drawn, never when ``fitgraph.dist`` is (the planner
stays light and torch-free), and draws off-screen (Agg).

Example:
    >>> import pathlib, tempfile
    >>> from fitgraph.dist.simulate import simulate
    >>> tl = simulate("1f1b", [1.0] * 4, [2.0] * 4, m=8)
    >>> out = plot_gantt(tl, pathlib.Path(tempfile.mkdtemp()) / "1f1b.png", title="1F1B")
    >>> out.stat().st_size > 0
    True
"""

from __future__ import annotations

import pathlib
from collections import defaultdict

from .simulate import Timeline

__all__ = ["plot_gantt"]

_COLORS = {"F": (0.27, 0.51, 0.71), "B": (0.84, 0.37, 0.30), "W": (0.40, 0.65, 0.35)}
_ROW_INCHES = 0.45
_MIN_HEIGHT_INCHES = 2.5
_MAX_HEIGHT_INCHES = 12.0
# NOTE: a later chunk of a device is drawn this much darker, so interleaving shows
_CHUNK_SHADE = 0.35
_MAX_ROW_LABELS = 32


def _unit(makespan_s: float) -> tuple[str, float]:
    for name, scale in (("s", 1.0), ("ms", 1e3), ("µs", 1e6)):
        if makespan_s >= 1.0 / scale:
            return name, scale
    return "ns", 1e9


def _shade(color: tuple[float, float, float], local: int, v: int) -> tuple[float, ...]:
    f = 1.0 - _CHUNK_SHADE * local / max(v - 1, 1)
    return tuple(c * f for c in color)


def plot_gantt(timeline: Timeline, path: str | pathlib.Path, *, title: str = "",
               max_micro_labels: int = 400) -> pathlib.Path:
    """Draw ``timeline`` into the PNG ``path``; micro-batch numbers label the boxes when there
    are at most ``max_micro_labels`` of them. Returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = pathlib.Path(path)
    p = timeline.devices
    events = timeline.events
    v = max((e.action.chunk // p for e in events), default=0) + 1
    unit, scale = _unit(timeline.makespan_s)
    # NOTE: one broken_barh per (device, kind, chunk): thousands of boxes in a few collections
    boxes: dict[tuple[int, str, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        boxes[e.device, e.action.kind, e.action.chunk // p].append(
            (e.start * scale, (e.end - e.start) * scale))
    few = len(events) <= max_micro_labels
    height = min(_MAX_HEIGHT_INCHES, max(_MIN_HEIGHT_INCHES, 1.0 + _ROW_INCHES * p))
    fig = Figure(figsize=(12, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (d, kind, local), spans in sorted(boxes.items()):
        ax.broken_barh(spans, (d - 0.4, 0.8), facecolors=_shade(_COLORS[kind], local, v),
                       edgecolor="white", linewidth=0.3 if few else 0.0)
    if few:
        for e in events:
            ax.text((e.start + e.end) / 2 * scale, e.device, str(e.action.micro),
                    ha="center", va="center", fontsize=6, color="white")
    ax.set_ylim(p - 0.5, -0.5)
    ticks = range(0, p, max(1, p // _MAX_ROW_LABELS))
    ax.set_yticks(ticks, [f"device {d}" for d in ticks])
    ax.set_xlim(0, timeline.makespan_s * scale or 1.0)
    ax.set_xlabel(f"time ({unit})")
    kinds = sorted({k for _, k, _ in boxes}, key="FBW".index)
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
