"""``checkpoint_blocks``: what ``torch.utils.checkpoint`` around each block does, as a plan.

Each repeated block (``h.3``, ``encoder.layer.11``, ``layer2.1``: see ``blocks.block_of``) keeps
only what leaves it; everything computed inside is dropped after the forward and recomputed in
the backward. Unlike torch.utils.checkpoint, random ops (dropout) are not re-run with a replayed
RNG state: their outputs are kept, so this baseline saves a little less than the real one.
It does not adapt to the budget: a budget it misses raises BudgetInfeasible.
"""

from __future__ import annotations

import time

from ...plan.remat import remat_plan
from ...sim.simulate import simulate
from ..base import BudgetInfeasible, Problem, Solution, dominated_by, register
from ..remat.blocks import block_drop_sets

__all__ = ["solve_checkpoint_blocks"]


@register("checkpoint_blocks")
def solve_checkpoint_blocks(problem: Problem) -> Solution:
    t0 = time.perf_counter()
    g = problem.graph
    blocks = block_drop_sets(g)
    drop = set().union(*blocks.values()) if blocks else set()
    plan = remat_plan(g, drop)
    sim = simulate(g, plan, problem.cost_model)
    if problem.budget_bytes is not None and sim.peak_bytes > problem.budget_bytes:
        raise BudgetInfeasible(problem.budget_bytes, sim.peak_bytes, dominated_by(sim),
                               "checkpoint_blocks")
    return Solution(plan, sim, "checkpoint_blocks", time.perf_counter() - t0,
                    notes={"dropped": len(drop), "blocks": len(blocks)})
