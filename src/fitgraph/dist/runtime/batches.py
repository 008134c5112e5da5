"""A training batch as the flat tensors a pipeline passes, and this replica's part of it.

A batch is any pytree (a tensor, a tuple, a dict of tensors). Its tensor leaves whose first
dimension is the batch size are split between data-parallel replicas and then micro-batches;
other leaves (a shared mask, a scalar) go whole to every micro-batch; non-tensor leaves are
constants of the traced step.

Example:
    >>> import torch
    >>> flat = FlatBatch.of({"ids": torch.zeros(8, 3), "scale": 2.0})
    >>> [t.shape[0] for t in flat.replica_part(flat.tensors, 1, 4, 8)]
    [2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FlatBatch"]


@dataclass
class FlatBatch:
    spec: Any                    # the pytree spec of the whole batch
    tensors: list                # its tensor leaves, in order
    where: list[int]             # each tensor leaf's position among all leaves
    constants: dict[int, Any]    # non-tensor leaves by position

    @classmethod
    def of(cls, batch: Any) -> FlatBatch:
        import torch
        import torch.utils._pytree as pytree

        leaves, spec = pytree.tree_flatten(batch)
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if not where:
            raise ValueError("the batch holds no tensor: nothing to split between devices")
        return cls(spec, [leaves[i] for i in where], where,
                   {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)})

    def rebuild(self, tensors) -> Any:
        """The batch with ``tensors`` as its tensor leaves."""
        import torch.utils._pytree as pytree

        leaves = [None] * (len(self.where) + len(self.constants))
        for i, x in self.constants.items():
            leaves[i] = x
        for i, t in zip(self.where, tensors):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)

    def leaves_of(self, batch: Any) -> list:
        """``batch``'s tensor leaves, checked to be shaped as this batch's structure."""
        other = FlatBatch.of(batch)
        if other.spec != self.spec or other.where != self.where:
            raise ValueError("this batch is not structured as the example batch the plan was "
                             f"made with: {other.spec} vs {self.spec}")
        return other.tensors

    @staticmethod
    def batched(tensors, batch_size: int) -> list[bool]:
        """Which leaves carry the batch (first dimension = ``batch_size``)."""
        return [t.dim() > 0 and t.shape[0] == batch_size for t in tensors]

    def replica_part(self, tensors, replica: int, replicas: int, batch_size: int) -> list:
        """Replica ``replica``'s rows of every batched leaf (``replicas`` equal parts)."""
        if batch_size % replicas:
            raise ValueError(f"a batch of {batch_size} samples does not split into "
                             f"{replicas} equal data-parallel parts")
        rows = batch_size // replicas
        return [t[replica * rows:(replica + 1) * rows] if b else t
                for t, b in zip(tensors, self.batched(tensors, batch_size))]
