"""The layers a tensor-parallel chunk runs (``tensor_parallel`` puts them in place of its
linear layers): Megatron's ``f`` and ``g`` as autograd functions, and a linear layer's column-
and row-parallel shards; with sequence parallelism (Korthikanti et al. 2022), the row-parallel
sums reduce-scattered along a dim other than the features (the sequence) and gathered again
before the next column-parallel layer, and the modules the rewrite puts where a tensor enters
or leaves that region (``SeqScatter``, ``SeqGather``) or a whole tensor meets a part of one
(``GradSum``: its gradient summed over the shards).

Example (inside a launch of ``tp`` processes, ``group`` their process group):
    >>> layer = ColumnLinear(weight_rows, bias_rows, group)        # doctest: +SKIP
    >>> y_part = layer(x)                       # this shard's output features  # doctest: +SKIP
"""

from __future__ import annotations

import functools

import torch

__all__ = ["ColumnLinear", "GradSum", "RowLinear", "SeqGather", "SeqScatter", "in_glue"]

_BUFFERS: dict[tuple, torch.Tensor] = {}
_GLUE = [0]


def in_glue() -> bool:
    """Whether a collective and its copies are running (``op_recompute``'s recorder passes
    their ops: not the plan's units, never re-run)."""
    return _GLUE[0] > 0


def _glue(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _GLUE[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _GLUE[0] -= 1
    return run


@_glue
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


@_glue
def _gathered(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every shard's ``x`` put together along ``dim``, in shard order.

    NOTE: through ``all_gather_into_tensor`` (and ``reduce_scatter_tensor`` below), which
    ``collective_frees`` keeps the buffers of on this thread while metering"""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    # NOTE: flat, gloo checks the first dims: the output's is the world's times the input's
    out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=group)
    shape = list(x.shape)
    shape[dim] *= n
    return out.view(n, *x.shape).movedim(0, dim).reshape(shape)


@_glue
def _scatter_summed(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This shard's part along ``dim`` of ``x`` summed over ``group`` (a reduce-scatter)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    shape = list(x.shape)
    parts = x.reshape(*shape[:dim], n, shape[dim] // n, *shape[dim + 1:]).movedim(dim, 0)
    shape[dim] //= n
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out.view(-1), parts.contiguous().view(-1), group=group)
    return out


@_glue
def _zeroed(t: torch.Tensor) -> torch.Tensor:
    return t * 0


@_glue
def _own_part(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    import torch.distributed as dist

    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


class _Gather(torch.autograd.Function):
    """Parts along ``dim`` put together, for ops every shard then runs whole alike. Its
    gradient: this shard's part of theirs."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gathered(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_part(grad, ctx.dim, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    """This shard's part along ``dim`` of a tensor each shard holds whole (``summed``: a
    partial sum each, reduce-scattered: a row-parallel layer's). Its gradient: every part's,
    gathered."""

    @staticmethod
    def forward(ctx, x, dim, group, summed):
        ctx.dim, ctx.group = dim, group
        return _scatter_summed(x, dim, group) if summed else _own_part(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gathered(grad, ctx.dim, ctx.group), None, None, None


class _GatheredLinear(torch.autograd.Function):
    """A column-parallel linear whose input is this shard's part along ``dim``: gathered for
    the matmul, and only the part saved — gathered again in the backward for the weight's
    gradient, the input's gradient reduce-scattered (Megatron's sequence-parallel linear: the
    whole input is never held from the forward to the backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim, group):
        ctx.dim, ctx.group, ctx.has_bias = dim, group, bias is not None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(_gathered(x, dim, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _gathered(x, ctx.dim, ctx.group)
        grad_x = _scatter_summed(grad.matmul(weight), ctx.dim, ctx.group)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_w = rows.t().matmul(whole.reshape(-1, whole.shape[-1]))
        grad_b = rows.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


class SeqGather(torch.nn.Module):
    """Where a tensor split along ``dim`` meets an op that needs it whole: gathered."""

    def __init__(self, dim: int, group) -> None:
        super().__init__()
        self.dim, self.group = dim, group

    def forward(self, x):
        return _Gather.apply(x, self.dim, self.group)


class SeqScatter(torch.nn.Module):
    """Where a tensor every shard holds whole meets parts along ``dim``: this shard's part."""

    def __init__(self, dim: int, group) -> None:
        super().__init__()
        self.dim, self.group = dim, group

    def forward(self, x):
        return _Scatter.apply(x, self.dim, self.group, False)


class GradSum(torch.nn.Module):
    """A whole tensor (a norm's weight, a broadcast bias) read by this shard's part."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def forward(self, x):
        # NOTE: Megatron's ``f`` alike: the tensor as it is, its gradient summed
        return _CopyToShards.apply(x, self.group)


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

    def __init__(self, weight, bias, group, transposed: bool = False,
                 seq_dim: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.bias = None if bias is None else torch.nn.Parameter(bias)
        self.group = group
        self.transposed = transposed
        self.seq_dim = seq_dim   # NOTE: sequence parallel: the dim its parts are split along

    def _weight(self) -> torch.Tensor:
        return self.weight.t() if self.transposed else self.weight


class ColumnLinear(_ShardLinear):
    """With ``seq_dim``, its input is this shard's part along that dim, gathered for the
    matmul (``_GatheredLinear``)."""

    def forward(self, x):
        if self.seq_dim is None:
            return torch.nn.functional.linear(_CopyToShards.apply(x, self.group),
                                              self._weight(), self.bias)
        return _GatheredLinear.apply(x, self._weight(), self.bias, self.seq_dim, self.group)


class RowLinear(_ShardLinear):
    """Its bias is whole and added once: by shard 0's partial sum (the others add zeros), so
    that each shard runs the one ``addmm`` the plan's op-level memory plan names
    (``op_recompute`` matches ops); the bias's gradient is then shard 0's alone, and the step
    sums it over the shards (``tensor_parallel.partial_names``). With ``seq_dim``, the sums
    are reduce-scattered along it: the output is this shard's part."""

    def __init__(self, weight, bias, group, transposed: bool = False,
                 seq_dim: int | None = None) -> None:
        super().__init__(weight, bias, group, transposed, seq_dim)
        import torch.distributed as dist

        self._adds_bias = dist.get_rank(group) == 0

    def forward(self, x):
        bias = self.bias
        if bias is not None and not self._adds_bias:
            # NOTE: zeros made from the bias, not apart from it: DDP then sees every
            # parameter used (a shard that left it out would stall its gradient reduction)
            bias = _zeroed(bias)
        out = torch.nn.functional.linear(x, self._weight(), bias)
        if self.seq_dim is None:
            return _SumShards.apply(out, self.group)
        return _Scatter.apply(out, self.seq_dim, self.group, True)
