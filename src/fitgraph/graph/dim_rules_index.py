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

from .dim_types import Along, Reduced, SizeArg, Split, arg_of

__all__ = ["MADE_ALIKE", "grid_sample", "grid_sample_backward", "index_gather", "index_scatter",
           "new_zeros"]


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
    """index / _unsafe_index(x, indices): the dims before the index tensors follow; with 1-D
    index tensors, also their rows (``x`` read whole)."""
    lead = _leading(arg_of(node, 1, "indices"))
    if lead is None:
        return []
    x, out, n_index = ins[0], outs[0], len(ins) - 1
    splits = [Split((Along(d),) + (None,) * n_index, (Along(d),))
              for d in range(lead) if x[d] == out[d] and x[d] >= 2]
    rows = out[lead] if len(out) > lead else 0
    # NOTE: rows gathered by 1-D index tensors (a relative position bias from its table, an
    # embedding by index): a part gathers its own rows, reading the table whole
    if rows >= 2 and all(len(i) == 1 and i[0] == rows for i in ins[1:]) \
            and len(out) == len(x) - n_index + 1:
        splits.append(Split((None,) + (Along(0),) * n_index, (Along(lead),),
                            note="rows gathered in parts"))
    return splits


def index_scatter(node, ins, outs) -> list[Split]:
    """index_put / _unsafe_index_put(x, indices, values, accumulate): the dims before the index
    tensors follow in ``x``, ``values`` and the result. Accumulating, the rows scattered may
    be split too: 1-D index tensors and ``values`` along the indexed dim, each part adding
    its rows into the result of the part before (``Reduced``: ``transform.fission_combine.
    THREADED``), ``x`` read by the first part only."""
    lead = _leading(arg_of(node, 1, "indices"))
    if lead is None:
        return []
    x, values, out = ins[0], ins[-1], outs[0]
    n_index = len(ins) - 2
    if len(values) < lead:
        return []
    splits = [Split((Along(d),) + (None,) * n_index + (Along(d),), (Along(d),))
              for d in range(lead) if x[d] == out[d] == values[d] and x[d] >= 2]
    rows = values[lead] if len(values) > lead else 0
    # NOTE: a gather's gradient (a relative position bias table's, an embedding's by index):
    # the rows to add arrive in parts from a region split along them; the whole [rows, ...]
    # tensor of them need not exist
    if (arg_of(node, 3, "accumulate", False) is True and rows >= 2
            and all(len(i) == 1 and i[0] == rows for i in ins[1:-1])
            and len(values) == len(x) - n_index + 1):
        splits.append(Split((None,) + (Along(0),) * n_index + (Along(lead),), (Reduced(),),
                            note="rows scattered in parts, each part adding into the last's"))
    return splits


def new_zeros(node, ins, outs) -> list[Split]:
    """new_zeros(x, size): a dim of the same size in ``x`` and the result follows ``x``'s part
    (only its shape is read); the part's ``size`` says the part's rows. Along any other dim
    of ``x`` every part makes the same whole zeros (``MADE_ALIKE``): ``x`` gives only the
    dtype and device."""
    x, out = ins[0], outs[0]
    follow = [Split((Along(d),), (Along(d),), sizes=(SizeArg((1, d), ("out", 0), d),))
              for d in range(len(out)) if len(x) == len(out) and x[d] == out[d] and out[d] >= 2]
    alike = [Split((Along(d),), (None,), note="the same zeros in every part")
             for d in range(len(x)) if x[d] >= 2
             and not (len(x) == len(out) and x[d] == out[d])]
    return follow + alike


# NOTE: ops whose output does not depend on their tensor operand's values or on which rows of
# it a part has: every part that runs one makes the same tensor
MADE_ALIKE = frozenset({"aten.new_zeros.default"})


def grid_sample(node, ins, outs) -> list[Split]:
    """grid_sampler_2d(input [N, C, H, W], grid [N, Ho, Wo, 2], ...) -> [N, C, Ho, Wo]: a
    gather at points the grid gives: each sample reads its own grid (N), each channel the same
    points (C; the grid whole)."""
    splits = []
    if ins[0][0] >= 2:
        splits.append(Split((Along(0), Along(0)), (Along(0),)))
    if ins[0][1] >= 2:
        splits.append(Split((Along(1), None), (Along(1),)))
    return splits


def grid_sample_backward(node, ins, outs) -> list[Split]:
    """grid_sampler_2d_backward(grad, input, grid, ..., output_mask) -> (grad_input,
    grad_grid): each sample's gradients from its own rows (N); along C the grid's gradient
    would be a sum over channels, not offered."""
    if ins[1][0] < 2:
        return []
    mask = arg_of(node, 6, "output_mask", (True, True))
    return [Split((Along(0), Along(0), Along(0)),
                  tuple(Along(0) if want else None for want in mask))]
