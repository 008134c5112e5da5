"""Running multi-device plans on torch.distributed (issue 28, in progress): the processes a
test or a launcher starts, and a plan's pipeline stages cut from the user's module.

The planner (``fitgraph.dist``) is torch-free; this package is its torch side.
"""

from .pipeline_split import build_stage, split_points
from .processes import run_processes

__all__ = ["build_stage", "run_processes", "split_points"]
