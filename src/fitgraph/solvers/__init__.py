"""Planning strategies, each ``solve_x(problem) -> Solution``, in one registry (no torch).

- ``remat/``: which activations to drop and recompute, and in what order (``hotspot``, the
  production solver; the ILP reference; the knapsack and stage planners they share moves with);
- ``fission/``: operator fission, regions run in parts (``fission``, ``split_backward``);
- ``offload/``: offloading to host memory with prefetch, weighed against remat (``joint``);
- ``peers/``: what the systems fitgraph succeeds do (DTR, Rotor/Rockmate's chain, per-block
  checkpointing), as baselines;
- here: the problem and solution types (``base``), ``auto`` (``portfolio``), ``search``
  (``coordinated``: rewrite rules composed with auto's plans, best first), the smallest peak
  (``smallest``), and what every solver shares.
"""

from . import coordinated, eager, portfolio  # noqa: F401  (each module registers its solvers)
from .base import SOLVERS, BudgetInfeasible, EvaluatorMismatch, Problem, Solution, register, solve
from .fission import search, splits  # noqa: F401
from .offload import remat_offload  # noqa: F401
from .peers import checkpoint_blocks, dtr, rotor  # noqa: F401
from .remat import hotspot, ilp, knapsack  # noqa: F401
from .smallest import solve_smallest

__all__ = ["SOLVERS", "BudgetInfeasible", "EvaluatorMismatch", "Problem", "Solution", "register",
           "solve", "solve_smallest"]
