"""Planning strategies, each ``solve_x(problem) -> Solution``, in one registry (no torch)."""

from . import checkpoint_blocks, eager, hotspot, knapsack  # noqa: F401  (registers the solvers)
from .base import SOLVERS, BudgetInfeasible, Problem, Solution, register, solve

__all__ = ["SOLVERS", "BudgetInfeasible", "Problem", "Solution", "register", "solve"]
