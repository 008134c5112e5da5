"""Many devices: plan pipeline, tensor and data parallelism with per-stage memory plans.

``plan(model, cluster, global_batch)`` gives the fastest configuration that fits every device
(a ``DistPlan``: parallelism, stages, memory plans, predicted time and memory, saved as JSON;
``dist.planner``); ``dist.evaluate.evaluate`` predicts one configuration, ``dist.search`` finds
the best; the cluster, its collectives, the schedules and the
event-driven simulator are below them. Torch-free, like the single-device planner it builds on
(``tests/test_boundary.py``).

Example:
    >>> from fitgraph.dist import GptShape, dgx_a100, plan
    >>> p = plan(GptShape(24, 2304, 24), dgx_a100(nodes=1), global_batch=64)
    >>> p.fits, p.parallelism.devices
    (True, 8)
"""

from .calibration import calibrated_device
from .cluster import LINKS, Cluster, Link, dgx_a100
from .collectives import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s
from .config import Parallelism, parse_fix
from .evaluate import Prediction
from .graph_model import GraphModel
from .megatron_table import GPT_PRESETS, TABLE1, GptShape, MegatronRow
from .memory import FP32_ADAM, MIXED_ADAM, Precision
from .model import GptModel, ModelSpec
from .planner import DistPlan, Infeasible, plan

# NOTE: ``evaluate`` and ``search`` stay modules (``fitgraph.dist.evaluate.evaluate``): a
# function of a module's own name would hide the module
__all__ = ["FP32_ADAM", "GPT_PRESETS", "LINKS", "MIXED_ADAM", "TABLE1", "Cluster", "DistPlan",
           "GptModel", "GptShape", "GraphModel", "Infeasible", "Link", "MegatronRow",
           "ModelSpec", "Parallelism", "Precision", "Prediction", "all_gather_s",
           "all_reduce_s", "calibrated_device", "dgx_a100", "p2p_s", "parse_fix", "plan",
           "reduce_scatter_s", "parallelize"]


def __getattr__(name: str):
    # NOTE: running a plan needs torch (dist.runtime); planning does not, so the runtime is
    # imported only when asked for
    if name == "parallelize":
        from ..dist.runtime.parallelize import parallelize

        return parallelize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
