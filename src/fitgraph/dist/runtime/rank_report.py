"""Each rank's measured step beside the plan's prediction for it (``DistStep.report()``).

Measured: the step time (median over the steps after the first, which builds the optimizer's
state and the pipeline's buffers) and, where the step was built with
``measure_memory=True``, the rank's peak in allocator bytes — what the rank held when its
first step began (its parameters and buffers) plus the most the CPU allocator meter
(``execute.meter.MemoryMeter``) saw added over the steps (gradients, optimizer state,
in-flight activations, communication buffers). Predicted: the plan's step time and its
stage's peak (weights, gradients, optimizer state, activations, working memory).

Example:
    >>> r = RankReport(0, 0, 0, 0, [0.2, 0.1, 0.1], 0.12, 1000, 990.0,
    ...                {"weights": 500.0, "activations": 490.0}, [])
    >>> round(r.step_s, 2), round(r.peak_ratio, 3)
    (0.1, 1.01)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["DistReport", "RankReport"]


@dataclass
class RankReport:
    rank: int
    stage: int
    replica: int
    shard: int
    seconds: list[float]               # every step's wall time on this rank
    predicted_step_s: float
    peak_bytes: int | None             # measured (None: not measured)
    predicted_peak_bytes: float
    predicted_memory: dict[str, float]
    notes: list[str] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)   # per step: inside this rank's chunks
    predicted_compute_s: float = 0.0                     # the plan's busy time of the stage
    optimizer: list[float] = field(default_factory=list)
    resident_bytes: int | None = None    # measured: parameters and buffers as steps begin

    @property
    def step_s(self) -> float:
        warm = self.seconds[1:] or self.seconds
        return statistics.median(warm) if warm else float("nan")

    @property
    def compute_s(self) -> float:
        warm = self.compute[1:] or self.compute
        return statistics.median(warm) if warm else float("nan")

    @property
    def optimizer_s(self) -> float:
        warm = self.optimizer[1:] or self.optimizer
        return statistics.median(warm) if warm else float("nan")

    def time_gap(self) -> str:
        """Where the measured step is over 1.2× the prediction: how much of it the rank's
        chunks computed, against the plan's compute for the stage, and the rest."""
        if not self.seconds or not self.predicted_step_s:
            return ""
        r = self.step_s / self.predicted_step_s
        if r <= 1.2 or not self.compute:
            return ""
        rest = self.step_s - self.compute_s - self.optimizer_s
        return (f"step {r:.2f}x the prediction: its chunks computed {self.compute_s * 1e3:.0f} "
                f"ms (predicted {self.predicted_compute_s * 1e3:.0f} ms), the optimizer "
                f"{self.optimizer_s * 1e3:.0f} ms, and {rest * 1e3:.0f} ms went to waiting, "
                f"communication and the pipeline's own work")

    @property
    def peak_ratio(self) -> float | None:
        if self.peak_bytes is None or not self.predicted_peak_bytes:
            return None
        return self.peak_bytes / self.predicted_peak_bytes

    def gap(self) -> str:
        """Where the measured peak is more than 5% from the prediction, what may explain it."""
        r = self.peak_ratio
        if r is None or abs(r - 1) <= 0.05:
            return ""
        side = "above" if r > 1 else "below"
        mib = 2 ** 20
        big = max(self.predicted_memory, key=self.predicted_memory.get)
        out = (f"peak measured {abs(r - 1):.0%} {side} the prediction; its largest predicted "
               f"term is {big} ({self.predicted_memory[big] / mib:.1f} MiB)")
        if self.resident_bytes is not None and "weights" in self.predicted_memory:
            # NOTE: what was held before the steps against what they added: a wrong size of
            # the parameters, or of what the steps make (gradients, state, activations)
            rest = self.predicted_peak_bytes - self.predicted_memory["weights"]
            out += (f"; held as the steps began {self.resident_bytes / mib:.1f} MiB (predicted "
                    f"weights {self.predicted_memory['weights'] / mib:.1f}), added by them "
                    f"{(self.peak_bytes - self.resident_bytes) / mib:.1f} MiB (predicted "
                    f"{rest / mib:.1f})")
        return out


@dataclass
class DistReport:
    ranks: list[RankReport]

    def __str__(self) -> str:
        mib = 2 ** 20
        lines = [f"{'rank':>4} {'stage':>5} {'dp':>3} {'tp':>3} {'step ms':>9} "
                 f"{'pred ms':>9} {'peak MiB':>9} {'pred MiB':>9} {'ratio':>6}"]
        for r in self.ranks:
            peak = f"{r.peak_bytes / mib:9.1f}" if r.peak_bytes is not None else f"{'-':>9}"
            ratio = f"{r.peak_ratio:6.3f}" if r.peak_ratio is not None else f"{'-':>6}"
            lines.append(f"{r.rank:>4} {r.stage:>5} {r.replica:>3} {r.shard:>3} "
                         f"{r.step_s * 1e3:9.1f} {r.predicted_step_s * 1e3:9.1f} {peak} "
                         f"{r.predicted_peak_bytes / mib:9.1f} {ratio}")
        for r in self.ranks:
            for why in filter(None, [r.gap(), r.time_gap(), *r.notes]):
                lines.append(f"rank {r.rank}: {why}")
        return "\n".join(lines)

    def to_json(self) -> list[dict]:
        return [{"rank": r.rank, "stage": r.stage, "replica": r.replica, "shard": r.shard,
                 "step_s": r.step_s, "predicted_step_s": r.predicted_step_s,
                 "peak_bytes": r.peak_bytes, "predicted_peak_bytes": r.predicted_peak_bytes,
                 "predicted_memory": r.predicted_memory, "gap": r.gap(),
                 "compute_s": r.compute_s, "predicted_compute_s": r.predicted_compute_s,
                 "optimizer_s": r.optimizer_s, "time_gap": r.time_gap(), "notes": r.notes}
                for r in self.ranks]
