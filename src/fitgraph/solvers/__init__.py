"""Planning strategies, each ``solve_x(problem) -> Solution``, in one registry (no torch)."""

from . import checkpoint_blocks, eager, hotspot, ilp, knapsack  # noqa: F401  (registers them)
from .base import SOLVERS, BudgetInfeasible, Problem, Solution, register, solve

__all__ = ["SOLVERS", "BudgetInfeasible", "Problem", "Solution", "register", "solve"]
