"""HiGHS (the one scipy ships) on one MILP: warm-started where scipy's bindings are there.

``solve_milp`` passes the model to scipy's private HiGHS bindings, which take a start (a known
schedule: branch-and-bound prunes with it early) and a fixed seed and one thread; a scipy without
them is solved through the public ``scipy.optimize.milp``, which takes no start, and the answer
says which route ran (``route``: the ILP's notes name it, never a silent fallback).

Example:
    >>> import numpy as np
    >>> from scipy.sparse import csc_matrix
    >>> from fitgraph.solvers.remat.ilp_highs import HighsConfig, solve_milp
    >>> # max x + y (min -x - y) with x + y <= 1.5, x, y binary
    >>> r = solve_milp(np.array([-1.0, -1.0]), csc_matrix([[1.0, 1.0]]), np.array([-np.inf]),
    ...                np.array([1.5]), np.array([1.0, 1.0]), np.array([1, 1]), 5.0, None, 0.0,
    ...                HighsConfig())
    >>> r.status, round(r.objective, 6), sorted(r.x.round().tolist())
    ('optimal', -1.0, [0.0, 1.0])
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["MIP_REL_GAP", "HighsConfig", "MilpAnswer", "solve_milp"]

MIP_REL_GAP = 1e-4  # NOTE: of the whole step time (or peak): 'optimal' is within 0.01%
WARM = "scipy's HiGHS bindings (warm start, one thread, seed 0)"
PUBLIC = "scipy.optimize.milp (no warm start: this scipy lacks its HiGHS bindings)"


@dataclass(frozen=True)
class HighsConfig:
    """How HiGHS runs. ``log``: HiGHS's own log on stdout (else its output is kept off the
    terminal); ``options``: more HiGHS options by name, for experiments
    (``(("mip_pool_soft_limit", 50000),)``)."""

    log: bool = False
    options: tuple[tuple[str, object], ...] = ()


class MilpAnswer(NamedTuple):
    x: np.ndarray | None   # the solution (None: none found)
    status: str            # "optimal", "time limit", "infeasible"
    objective: float       # offset included
    gap: float             # proven relative gap
    route: str             # which HiGHS ran (``WARM`` or ``PUBLIC``)


@contextlib.contextmanager
def _quiet_stdout(config: HighsConfig):
    """HiGHS 1.12 prints a debug line from C++ on some MIP starts; keep it off the user's
    terminal (``config.log`` shows HiGHS's own log instead)."""
    if config.log:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def solve_milp(c, A, lo, hi, upper, integral, time_limit_s: float,
               start: dict[int, float] | None, offset: float,
               config: HighsConfig) -> MilpAnswer:
    """min ``c @ x + offset`` with ``lo <= A @ x <= hi``, ``0 <= x <= upper``, ``integral``
    entries integer; ``start``: variable -> value of a known solution."""
    try:
        from scipy.optimize._highspy import _core as h
    except ImportError:  # NOTE: scipy without its HiGHS bindings: the public API, no start
        return _public(c, A, lo, hi, upper, integral, time_limit_s, offset)
    lp = h.HighsLp()
    lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = A.shape[1], A.shape[0]
    lp.a_matrix_.format_ = h.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_ = A.indptr, A.indices
    lp.a_matrix_.value_ = A.data
    lp.col_cost_, lp.col_lower_ = c, np.zeros(len(c))
    lp.offset_ = offset
    lp.col_upper_ = np.where(np.isinf(upper), h.kHighsInf, upper)
    lp.row_lower_ = np.where(np.isinf(lo), -h.kHighsInf, lo)
    lp.row_upper_ = np.where(np.isinf(hi), h.kHighsInf, hi)
    lp.integrality_ = [h.HighsVarType(int(i)) for i in integral]
    highs = h._Highs()
    highs.setOptionValue("output_flag", config.log)
    highs.setOptionValue("time_limit", float(max(time_limit_s, 1.0)))
    highs.setOptionValue("mip_rel_gap", MIP_REL_GAP)
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("random_seed", 0)
    for name, value in config.options:
        highs.setOptionValue(name, value)
    highs.passModel(lp)
    if start:
        idx = np.array(sorted(start), dtype=np.int32)
        highs.setSolution(len(idx), idx, np.array([start[i] for i in idx], dtype=float))
    with _quiet_stdout(config):
        highs.run()
    ms = highs.getModelStatus()
    info = highs.getInfo()
    if ms == h.HighsModelStatus.kInfeasible:
        return MilpAnswer(None, "infeasible", float("nan"), float("inf"), WARM)
    has_x = info.primal_solution_status == h.kSolutionStatusFeasible
    status = "optimal" if ms == h.HighsModelStatus.kOptimal else "time limit"
    if not has_x:
        return MilpAnswer(None, status, float("nan"), float("inf"), WARM)
    gap = max(float(info.mip_gap), 0.0)
    return MilpAnswer(np.array(highs.getSolution().col_value), status,
                      info.objective_function_value, gap, WARM)


def _public(c, A, lo, hi, upper, integral, time_limit_s: float, offset: float) -> MilpAnswer:
    from scipy.optimize import Bounds, LinearConstraint, milp

    res = milp(c, integrality=integral, bounds=Bounds(np.zeros(len(c)), upper),
               constraints=LinearConstraint(A, lo, hi),
               options={"time_limit": max(time_limit_s, 1.0), "mip_rel_gap": MIP_REL_GAP,
                        "disp": False})
    status = {0: "optimal", 2: "infeasible"}.get(res.status, "time limit")
    fun = res.fun + offset if res.x is not None else float("nan")
    bound = getattr(res, "mip_dual_bound", None)
    gap = ((fun - bound - offset) / fun if bound is not None and res.x is not None
           else 0.0 if status == "optimal" else np.inf)
    return MilpAnswer(res.x, status, fun, gap, PUBLIC)
