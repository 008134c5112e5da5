"""Dimension rules of advanced indexing: gathers ``x[..., i, j]`` and their scatters back.

``_unsafe_index(x, [None, None, i, j])`` gathers along the indexed dims with index tensors that
read no activation (an ``arange`` made into source rows); ``_unsafe_index_put(zeros, [None,
None, i, j], values, accumulate)`` is its backward, adding ``values`` into a fresh ``new_zeros``.
CUDA's bilinear upsampling runs as exactly these ops when deterministic algorithms are on
(``torch.nn.functional.interpolate`` then calls the decomposition whose backward is an
``index_put``), so a U-Net's batch and channels flow through them.

The dims before the first index tensor pass through, as many rows in as out: every part reads
the index tensors whole. With the index tensors adjacent the gathered dims stay in place; any
other layout (an index, a ``None``, an index: the gathered dims move first) is offered nothing.
``new_zeros(x, size)`` makes a tensor of ``size``: a dim it shares with ``x`` follows ``x``'s
part, and a part runs with its own size there.

Example:
    >>> from fitgraph.graph.ir import Node, Phase, ValueRef
    >>> from fitgraph.graph.dim_rules_index import index_gather
    >>> n = Node(0, "i", "aten._unsafe_index.Tensor", (ValueRef(0), [None, None, ValueRef(1),
    ...          ValueRef(2)]), {}, (0, 1, 2), (3,), (), Phase.FORWARD, "")
    >>> [s.operands for s in index_gather(n, [(2, 3, 8, 8), (16, 1), (16,)], [(2, 3, 16, 16)])]
    [(Along(0), None, None), (Along(1), None, None)]
"""

from __future__ import annotations

from .dim_types import Along, SizeArg, Split, arg_of

__all__ = ["index_gather", "index_scatter", "new_zeros"]


def _leading(indices) -> int | None:
    """How many dims lead the index tensors (``None`` entries before the first one), or None
    when the index tensors are not adjacent (the gathered dims would move to the front)."""
    if not isinstance(indices, (list, tuple)):
        return None
    given = [k for k, ix in enumerate(indices) if ix is not None]
    if not given or given != list(range(given[0], given[-1] + 1)):
        return None
    return given[0]


def index_gather(node, ins, outs) -> list[Split]:
    """index / _unsafe_index(x, indices): the dims before the index tensors follow."""
    lead = _leading(arg_of(node, 1, "indices"))
    if lead is None:
        return []
    x, out, n_index = ins[0], outs[0], len(ins) - 1
    return [Split((Along(d),) + (None,) * n_index, (Along(d),))
            for d in range(lead) if x[d] == out[d] and x[d] >= 2]


def index_scatter(node, ins, outs) -> list[Split]:
    """index_put / _unsafe_index_put(x, indices, values, accumulate): the dims before the index
    tensors follow in ``x``, ``values`` and the result."""
    lead = _leading(arg_of(node, 1, "indices"))
    if lead is None:
        return []
    x, values, out = ins[0], ins[-1], outs[0]
    n_index = len(ins) - 2
    if len(values) < lead:
        return []
    return [Split((Along(d),) + (None,) * n_index + (Along(d),), (Along(d),))
            for d in range(lead) if x[d] == out[d] == values[d] and x[d] >= 2]


def new_zeros(node, ins, outs) -> list[Split]:
    """new_zeros(x, size): a dim of the same size in ``x`` and the result follows ``x``'s part
    (only its shape is read); the part's ``size`` says the part's rows."""
    x, out = ins[0], outs[0]
    if len(x) != len(out):
        return []
    return [Split((Along(d),), (Along(d),), sizes=(SizeArg((1, d), ("out", 0), d),))
            for d in range(len(out)) if x[d] == out[d] and out[d] >= 2]
