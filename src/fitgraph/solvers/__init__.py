"""Planning strategies, each ``solve_x(problem) -> Solution``, in one registry (no torch)."""

from . import eager, hotspot  # noqa: F401  (registers the solvers)
from .base import SOLVERS, BudgetInfeasible, Problem, Solution, register, solve

__all__ = ["SOLVERS", "BudgetInfeasible", "Problem", "Solution", "register", "solve"]
