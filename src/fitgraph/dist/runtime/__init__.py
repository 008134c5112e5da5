"""Running multi-device plans on torch.distributed (issue 28): ``parallelize`` turns a model,
its loss and optimizer and a ``DistPlan`` into a training step run by every rank of a launch;
``run_processes`` starts local gloo processes (tests, examples).

The planner (``fitgraph.dist``) is torch-free; this package is its torch side.
"""

from .processes import DistributedRunError, run_processes

__all__ = ["DistributedRunError", "run_processes"]
