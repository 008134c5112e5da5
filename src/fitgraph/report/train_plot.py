"""The picture of a training run, eager PyTorch beside fitgraph (``fitgraph demo-train``): the
loss curves, the measured peak of each metered step against the plan's, and the step times.

Example:
    >>> import tempfile, os
    >>> r = {"loss": {"eager": [5.0, 4.0, 3.5], "fitgraph": [5.0, 4.0, 3.5]},
    ...      "metered_steps": [2], "peak_bytes": {"eager": [9e6], "fitgraph": [5e6]},
    ...      "planned_peak_bytes": 5e6, "budget_bytes": 5.5e6,
    ...      "step_s": {"eager": [0.1, 0.1], "fitgraph": [0.12, 0.11]},
    ...      "model": "a GPT", "max_loss_diff": 0.0}
    >>> path = os.path.join(tempfile.mkdtemp(), "run.png")
    >>> plot_training_run(r, path); os.path.getsize(path) > 0
    True
"""

from __future__ import annotations

__all__ = ["plot_training_run"]

MIB = 2**20
COLORS = {"eager": "#555555", "fitgraph": "#1f77b4"}


def plot_training_run(r: dict, path: str) -> None:
    """Three panels over the steps of ``r`` (``demo_train.run``'s result), written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_peak, ax_time) = plt.subplots(3, 1, figsize=(9, 9), dpi=110, sharex=True)
    for k, losses in r["loss"].items():
        ax_loss.plot(range(len(losses)), losses, label=k, color=COLORS.get(k),
                     linestyle="-" if k == "eager" else "--", linewidth=1.2)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(f"{r['model']}\nlargest loss difference over the run: "
                      f"{r['max_loss_diff']:.1e}", fontsize=9)
    ax_loss.legend()
    for k, peaks in r["peak_bytes"].items():
        ax_peak.plot(r["metered_steps"], [p / MIB for p in peaks], "o-", label=f"{k} (measured)",
                     color=COLORS.get(k), markersize=3)
    ax_peak.axhline(r["planned_peak_bytes"] / MIB, color=COLORS["fitgraph"], linestyle=":",
                    label="fitgraph's plan (simulated)")
    if r.get("budget_bytes"):
        ax_peak.axhline(r["budget_bytes"] / MIB, color="#d62728", linestyle="--", linewidth=0.8,
                        label="budget")
    ax_peak.set_ylabel("peak memory (MiB)")
    ax_peak.set_ylim(bottom=0)
    ax_peak.legend(fontsize=8)
    # NOTE: the timed steps are those not metered (the meter's profiler slows a step)
    metered = set(r["metered_steps"])
    timed = [i for i in range(len(next(iter(r["loss"].values())))) if i not in metered]
    for k, times in r["step_s"].items():
        ax_time.plot(timed[:len(times)], [1e3 * t for t in times], label=k, color=COLORS.get(k),
                     linewidth=0.8)
    ax_time.set_ylabel("step time (ms)")
    ax_time.set_xlabel("step")
    ax_time.set_ylim(bottom=0)
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
