"""The layers a tensor-parallel chunk runs (``tensor_parallel`` puts them in place of its
linear layers): Megatron's ``f`` and ``g`` as autograd functions, and a linear layer's column-
and row-parallel shards.

Example (inside a launch of ``tp`` processes, ``group`` their process group):
    >>> layer = ColumnLinear(weight_rows, bias_rows, group)        # doctest: +SKIP
    >>> y_part = layer(x)                       # this shard's output features  # doctest: +SKIP
"""

from __future__ import annotations

import torch

__all__ = ["ColumnLinear", "RowLinear"]

_BUFFERS: dict[tuple, torch.Tensor] = {}


def _summed(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group``, in a new tensor.

    NOTE: the collective runs on a buffer kept for the shape, not on a tensor made for it: a
    tensor gloo last holds is freed on gloo's thread, unseen by the allocator meter (and
    the copy is a few microseconds)."""
    import torch.distributed as dist

    key = (tuple(x.shape), x.dtype, x.device, id(group))
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = _BUFFERS[key] = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    buf.copy_(x)
    dist.all_reduce(buf, group=group)
    return buf.clone()


class _CopyToShards(torch.autograd.Function):
    """Megatron's ``f``: the input of a column-parallel region; its gradient is summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


class _SumShards(torch.autograd.Function):
    """Megatron's ``g``: partial sums of a row-parallel matmul, all-reduced."""

    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ShardLinear(torch.nn.Module):
    """A linear layer's shard (``weight``, ``bias``: this shard's), tensor parallel over
    ``group``; parameter names as ``nn.Linear``'s. ``transposed``: the weight is stored (in
    features, out features), as Hugging Face's ``Conv1D`` computes ``x @ weight + bias`` —
    kept so (its checkpoint names and shapes)."""

    def __init__(self, weight, bias, group, transposed: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.bias = None if bias is None else torch.nn.Parameter(bias)
        self.group = group
        self.transposed = transposed

    def _weight(self) -> torch.Tensor:
        return self.weight.t() if self.transposed else self.weight


class ColumnLinear(_ShardLinear):
    def forward(self, x):
        return torch.nn.functional.linear(_CopyToShards.apply(x, self.group), self._weight(),
                                          self.bias)


class RowLinear(_ShardLinear):
    """Its bias is whole, added once after the partial sums are."""

    def forward(self, x):
        out = _SumShards.apply(torch.nn.functional.linear(x, self._weight()), self.group)
        return out if self.bias is None else out + self.bias
