"""fitgraph: make PyTorch training fit in memory, fast.

Capture a whole training step as a graph, plan it within a memory budget, prove the plan by
simulation, and execute it with the same results as eager PyTorch.

Example:
    >>> import torch, fitgraph
    >>> model = torch.nn.Linear(4, 1)
    >>> g = fitgraph.capture(model, torch.randn(2, 4), lambda m, b: m(b).sum())
    >>> g.summary()["nodes"] > 0
    True
"""

from .api import OptimizeReport, TrainStep, load, optimize
from .capture.api import capture
from .capture.combined_optimizer import CombinedOptimizer
from .capture.errors import CaptureError
from .compile_backend import BackendReport, FitgraphBackend, backend, named_backend
from .graph.ir import Graph, Phase, Role
from .plan.eager import eager_plan
from .plan.instructions import Plan
from .solvers import BudgetInfeasible
from .transform.optimizer_in_backward import OptimizerInBackwardError

__all__ = ["BackendReport", "BudgetInfeasible", "CaptureError", "CombinedOptimizer",
           "FitgraphBackend", "Graph",
           "OptimizeReport", "OptimizerInBackwardError", "Phase", "Plan", "Role", "TrainStep",
           "backend", "capture", "eager_plan", "load", "named_backend", "optimize"]
__version__ = "0.1.0"
