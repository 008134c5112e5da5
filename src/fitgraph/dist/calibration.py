"""What a device reaches of its datasheet peaks, for the multi-device planner's predictions.

A roofline on datasheet peaks is a lower bound on time; a prediction of what a cluster does
needs the fraction kernels reach. fitgraph sets it once per device kind, never per prediction:

- **memory bandwidth**: 0.9 of the HBM peak — what streaming kernels (STREAM/BabelStream copy
  and triad) reach on A100-class GPUs, from published measurements (not fitted here);
- **matmul FLOP/s**: one calibration against one published measurement, Megatron-LM's Table 1
  first row (GPT 1.7B on 32 A100-80GB, data parallel only: no tensor or pipeline parallelism,
  so the row measures compute and the data-parallel all-reduce). The fraction is the one at
  which the planner's prediction of that row equals its published 137 TFLOP/s per GPU
  (``calibrate_flop_efficiency`` re-derives it: a test holds it to the stored value). Every
  other row of the table is then a prediction (``fitgraph.bench.dist_megatron``).

Links keep their datasheet bandwidths (``dist.cluster.LINKS``). Devices without a calibration
are planned on their datasheet peaks, and a plan says so (``calibrated_device``).

Example:
    >>> dev, note = calibrated_device("a100-80gb")
    >>> dev.flop_efficiency, dev.bandwidth_efficiency, note
    (0.63, 0.9, 'calibrated: Megatron-LM Table 1, row 1')
"""

from __future__ import annotations

from ..cost.devices import DeviceSpec, get_device
from .cluster import Cluster, dgx_a100
from .config import Parallelism
from .evaluate import evaluate
from .megatron_table import TABLE1, MegatronRow
from .model import GptModel

__all__ = ["ACHIEVABLE", "calibrate_flop_efficiency", "calibrated_device"]

BANDWIDTH_EFFICIENCY = 0.9
# NOTE: calibrate_flop_efficiency() on TABLE1[0] gives 0.634...; stored rounded to 2 places
# (tests/test_dist_calibration.py re-derives it).
A100_FLOP_EFFICIENCY = 0.63
ACHIEVABLE = {
    "a100-80gb": (A100_FLOP_EFFICIENCY, BANDWIDTH_EFFICIENCY),
    "a100-40gb": (A100_FLOP_EFFICIENCY, BANDWIDTH_EFFICIENCY),
}
CALIBRATION_NOTE = "calibrated: Megatron-LM Table 1, row 1"


def calibrated_device(name: str) -> tuple[DeviceSpec, str]:
    """The device with its achievable fractions, and a note saying where they come from."""
    spec = get_device(name)
    if spec.name in ACHIEVABLE:
        flops, bandwidth = ACHIEVABLE[spec.name]
        return (spec.replace(flop_efficiency=flops, bandwidth_efficiency=bandwidth),
                CALIBRATION_NOTE)
    return spec, "datasheet peaks (no calibration for this device: a lower bound on time)"


def calibrate_flop_efficiency(row: MegatronRow = TABLE1[0], *,
                              bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY,
                              tol: float = 1e-4) -> float:
    """The matmul fraction of peak at which ``row``'s published configuration is predicted at
    its published TFLOP/s per GPU (bisection; the prediction rises with the fraction)."""
    base = dgx_a100(row.gpus // 8)
    par = Parallelism(tp=row.t, pp=row.p, dp=row.dp, micro_batch=1,
                      n_micro=row.batch // row.dp, recompute="full", overlap_grad_reduce=False)

    def tflops(eff: float) -> float:
        device = base.device.replace(flop_efficiency=eff, bandwidth_efficiency=bandwidth_efficiency)
        cluster = Cluster(device, base.devices_per_node, base.nodes, base.intra, base.inter)
        pred = evaluate(GptModel(row.shape), cluster, par)
        return row.shape.flops_per_iteration(row.batch) / pred.step_s / row.gpus / 1e12

    lo, hi = 0.05, 1.0
    if tflops(hi) < row.tflops_per_gpu:
        raise ValueError(f"row {row.billions}B: even the datasheet peak predicts less than the "
                         f"published {row.tflops_per_gpu} TFLOP/s")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if tflops(mid) < row.tflops_per_gpu:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
