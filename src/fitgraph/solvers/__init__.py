"""Planning strategies, each ``solve_x(problem) -> Solution``, in one registry (no torch)."""

from . import checkpoint_blocks, eager, fission, hotspot, ilp, joint, knapsack  # noqa: F401  (registers)
from .base import SOLVERS, BudgetInfeasible, Problem, Solution, register, solve

__all__ = ["SOLVERS", "BudgetInfeasible", "Problem", "Solution", "register", "solve"]
