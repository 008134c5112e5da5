"""What a tensor-parallel rewrite knows of a traced chunk's values: how each is split
between the shards (``Sharded`` along its features, ``SeqSplit`` along the sequence), the
ops that act element by element, and a node's shape (``tensor_parallel``,
``sequence_parallel``).

Example:
    >>> Sharded(2), SeqSplit(1)
    (Sharded(dim=2, parts=1), SeqSplit(dim=1))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ELEMENTWISE", "SeqSplit", "Sharded", "TensorParallelError", "flat", "ndim", "prod",
           "shape"]

aten = torch.ops.aten


class TensorParallelError(ValueError):
    """The chunk cannot run the plan's tensor parallelism."""


@dataclass(frozen=True)
class Sharded:
    """A tensor split along ``dim``: each of its ``parts`` equal parts split in ``tp``."""

    dim: int
    parts: int = 1


@dataclass(frozen=True)
class SeqSplit:
    """A tensor of which each shard holds its part along ``dim`` (sequence parallelism)."""

    dim: int


# NOTE: ops each of whose outputs' elements reads its inputs' at the same index (broadcast)
ELEMENTWISE = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
         aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default,
         aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default,
         aten.sigmoid.default, aten.exp.default, aten.pow.Tensor_Scalar, aten.rsqrt.default,
         aten.dropout.default, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf,
         aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.clone.default,
         aten.contiguous.default, aten.alias.default, aten.to.dtype, aten.to.dtype_layout,
         aten._to_copy.default, aten.type_as.default, aten.erf.default, aten.cos.default,
         aten.sin.default}


def flat(args) -> list:
    out = []
    for a in args:
        if isinstance(a, (tuple, list)):
            out.extend(flat(a))
        else:
            out.append(a)
    return out


def shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def ndim(node) -> int:
    return len(node.meta["val"].shape)


def prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
