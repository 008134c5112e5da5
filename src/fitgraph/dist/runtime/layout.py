"""Where this rank sits in a plan: its pipeline stage, data-parallel replica and
tensor-parallel shard, and the ``DeviceMesh`` (pp × dp × tp) the plan's ranks form.

The planner numbers ranks ``stage·dp·tp + replica·tp + shard`` (``dist.config.Parallelism``);
a row-major mesh of shape (pp, dp, tp) numbers them the same way.

Example:
    >>> from fitgraph.dist.config import Parallelism
    >>> lay = RankLayout.of(Parallelism(tp=2, pp=2, dp=1, micro_batch=1, n_micro=2), rank=3,
    ...                     world=4)
    >>> lay.stage, lay.replica, lay.shard
    (1, 0, 1)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PlanMismatch", "RankLayout"]


class PlanMismatch(ValueError):
    """The launch does not match the plan (world size, mesh, model, batch)."""


@dataclass(frozen=True)
class RankLayout:
    pp: int
    dp: int
    tp: int
    rank: int

    @classmethod
    def of(cls, par, rank: int, world: int) -> RankLayout:
        if par.widths and len(set(map(tuple, par.widths))) > 1:
            raise PlanMismatch(
                f"the plan gives its stages different widths {list(par.widths)}: the runtime "
                f"runs stages of one (tp, dp); plan again with --fix tp=...,dp=...")
        need = par.pp * par.dp * par.tp
        if world != need:
            raise PlanMismatch(
                f"the plan needs {need} processes (pp {par.pp} x dp {par.dp} x tp {par.tp}) "
                f"but this launch has {world}: start it with torchrun --nproc-per-node {need} "
                f"(or plan for {world} devices)")
        return cls(par.pp, par.dp, par.tp, rank)

    @property
    def stage(self) -> int:
        return self.rank // (self.dp * self.tp)

    @property
    def replica(self) -> int:
        return self.rank // self.tp % self.dp

    @property
    def shard(self) -> int:
        return self.rank % self.tp

    def rank_of(self, stage: int, replica: int, shard: int) -> int:
        return (stage * self.dp + replica) * self.tp + shard

    def stages_group(self, stages, mesh):
        """The process group joining this rank's replica and shard on pipeline ``stages``
        (sorted, distinct), or None where this rank is not on them or they are one stage.
        Every rank calls it with the same stages (groups are made by all ranks)."""
        import torch.distributed as dist

        stages = sorted(set(stages))
        if len(stages) < 2:
            return None
        if len(stages) == self.pp:
            return mesh["pp"].get_group() if self.stage in stages else None
        ranks = [[self.rank_of(s, r, t) for s in stages]
                 for r in range(self.dp) for t in range(self.tp)]
        mine, _ = dist.new_subgroups_by_enumeration(ranks)
        return mine if self.stage in stages else None

    def mesh(self, device_type: str = "cpu"):
        """The (pp, dp, tp) ``DeviceMesh`` of this launch."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp),
                                mesh_dim_names=("pp", "dp", "tp"))
