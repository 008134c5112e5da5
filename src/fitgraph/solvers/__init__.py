"""Planning strategies, each ``solve_x(problem) -> Solution``, in one registry (no torch)."""

from . import (  # noqa: F401  (registers)
    checkpoint_blocks,
    dtr,
    eager,
    fission,
    fission_splits,
    hotspot,
    ilp,
    joint,
    knapsack,
    portfolio,
    rotor,
)
from .base import SOLVERS, BudgetInfeasible, EvaluatorMismatch, Problem, Solution, register, solve
from .smallest import solve_smallest

__all__ = ["SOLVERS", "BudgetInfeasible", "EvaluatorMismatch", "Problem", "Solution", "register",
           "solve", "solve_smallest"]
