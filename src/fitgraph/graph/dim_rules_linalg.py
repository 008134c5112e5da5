"""Dimension rules of matrix products, embeddings and attention.

A product ``[M, K] @ [K, N]`` splits three ways: rows (M: the left operand is cut, the right is
read whole), columns (N: the reverse), or the contracted K (both cut, the parts' products are
partial sums). A weight gradient ``dY^T @ X`` of a linear layer split along tokens is the K case.

Example:
    >>> from fitgraph.graph.ir import Node, Phase, ValueRef
    >>> from fitgraph.graph.dim_rules_linalg import mm
    >>> n = Node(0, "mm", "aten.mm.default", (ValueRef(0), ValueRef(1)), {}, (0, 1), (2,), (),
    ...          Phase.FORWARD, "")
    >>> [type(s.outputs[0]).__name__ for s in mm(n, [(8, 4), (4, 6)], [(8, 6)])]
    ['Along', 'Along', 'Reduced']
"""

from __future__ import annotations

from .dim_types import Along, Reduced, Split, arg_of, per_arg

__all__ = ["addmm", "baddbmm", "bmm", "embedding", "embedding_dense_backward", "linear", "matmul", "mm",
           "sdpa_flash", "sdpa_flash_backward"]

_K_NOTE = "split along the contracted dim: the parts' products are partial sums"


def _big(*sizes: int) -> bool:
    return all(s >= 2 for s in sizes)


def mm(node, ins, outs) -> list[Split]:
    """mm(a [M, K], b [K, N]) -> [M, N]."""
    (m, k), (_, n) = ins
    splits = []
    if m >= 2:
        splits.append(Split((Along(0), None), (Along(0),)))
    if n >= 2:
        splits.append(Split((None, Along(1)), (Along(1),)))
    if k >= 2:
        splits.append(Split((Along(1), Along(0)), (Reduced(),), note=_K_NOTE))
    return splits


def addmm(node, ins, outs) -> list[Split]:
    """addmm(bias, a [M, K], b [K, N], beta, alpha): bias broadcasts to [M, N].

    NOTE: the K split is offered only with beta=0: otherwise every part would add the bias."""
    bias, (m, k), (_, n) = ins
    splits = []
    if m >= 2:
        bm = Along(0) if len(bias) == 2 and bias[0] == m else None
        splits.append(Split((bm, Along(0), None), (Along(0),)))
    if n >= 2:
        bn = Along(len(bias) - 1) if bias and bias[-1] == n else None
        splits.append(Split((bn, None, Along(1)), (Along(1),)))
    if k >= 2 and arg_of(node, 3, "beta", 1) == 0:
        splits.append(Split((None, Along(1), Along(0)), (Reduced(),), note=_K_NOTE))
    return splits


def bmm(node, ins, outs) -> list[Split]:
    """bmm(a [B, M, K], b [B, K, N]) -> [B, M, N]."""
    (bb, m, k), (_, _, n) = ins
    splits = []
    if bb >= 2:
        splits.append(Split((Along(0), Along(0)), (Along(0),)))
    if m >= 2:
        splits.append(Split((Along(1), None), (Along(1),)))
    if n >= 2:
        splits.append(Split((None, Along(2)), (Along(2),)))
    if k >= 2:
        splits.append(Split((Along(2), Along(1)), (Reduced(),), note=_K_NOTE))
    return splits


def baddbmm(node, ins, outs) -> list[Split]:
    """baddbmm(self, a [B, M, K], b [B, K, N], beta, alpha): ``self`` broadcasts to [B, M, N]
    (Bloom's attention scores: an ALiBi bias [B, 1, N] plus the scaled product).

    NOTE: the K split is offered only with beta=0: otherwise every part would add ``self``.

    Example:
        >>> from fitgraph.graph.ir import Node, Phase, ValueRef
        >>> n = Node(0, "b", "aten.baddbmm.default", (ValueRef(0), ValueRef(1), ValueRef(2)),
        ...          {}, (0, 1, 2), (3,), (), Phase.FORWARD, "")
        >>> [s.operands for s in baddbmm(n, [(4, 1, 6), (4, 5, 3), (4, 3, 6)], [(4, 5, 6)])]
        [(Along(0), Along(0), Along(0)), (None, Along(1), None), (Along(2), None, Along(2))]
    """
    bias, (bb, m, k), (_, _, n) = ins
    out = (bb, m, n)

    def along(d: int) -> Along | None:   # NOTE: ``self`` aligns right, size-1 dims broadcast
        at = d - (len(out) - len(bias))
        return Along(at) if at >= 0 and bias[at] == out[d] else None

    splits = []
    if bb >= 2:
        splits.append(Split((along(0), Along(0), Along(0)), (Along(0),)))
    if m >= 2:
        splits.append(Split((along(1), Along(1), None), (Along(1),)))
    if n >= 2:
        splits.append(Split((along(2), None, Along(2)), (Along(2),)))
    if k >= 2 and arg_of(node, 3, "beta", 1) == 0:
        splits.append(Split((None, Along(2), Along(1)), (Reduced(),), note=_K_NOTE))
    return splits


def matmul(node, ins, outs) -> list[Split]:
    """matmul with numpy semantics: 1-D operands, broadcast batch dims."""
    a, b = ins
    out = outs[0]
    a_mat, b_mat = len(a) >= 2, len(b) >= 2
    batch_nd = len(out) - int(a_mat) - int(b_mat)
    splits = []
    for d in range(batch_nd):
        ea = _batch_entry(a, a_mat, batch_nd, d, out[d])
        eb = _batch_entry(b, b_mat, batch_nd, d, out[d])
        if out[d] >= 2:
            splits.append(Split((ea, eb), (Along(d),)))
    if a_mat and a[-2] >= 2:
        splits.append(Split((Along(len(a) - 2), None), (Along(batch_nd),)))
    if b_mat and b[-1] >= 2:
        splits.append(Split((None, Along(len(b) - 1)), (Along(len(out) - 1),)))
    if a[-1] >= 2:
        splits.append(Split((Along(len(a) - 1), Along(max(len(b) - 2, 0))), (Reduced(),),
                            note=_K_NOTE))
    return splits


def _batch_entry(shape, is_mat: bool, batch_nd: int, d: int, size: int) -> Along | None:
    nb = len(shape) - 2 if is_mat else 0
    k = d - (batch_nd - nb)
    return Along(k) if k >= 0 and shape[k] == size else None


def linear(node, ins, outs) -> list[Split]:
    """linear(x [..., K], weight [N, K], bias [N]) -> [..., N]."""
    x, w = ins[0], ins[1]
    has_bias = len(ins) > 2
    splits = [Split(per_arg(node, {0: Along(i)}), (Along(i),))
              for i in range(len(x) - 1) if x[i] >= 2]
    if w[0] >= 2:
        splits.append(Split(per_arg(node, {1: Along(0), 2: Along(0)}), (Along(len(x) - 1),)))
    if w[1] >= 2 and not has_bias:
        splits.append(Split((Along(len(x) - 1), Along(1)), (Reduced(),), note=_K_NOTE))
    return splits


def embedding(node, ins, outs) -> list[Split]:
    """embedding(weight [V, D], indices [...]) -> [..., D]: tokens, or the embedding dim."""
    w, idx = ins
    splits = [Split((None, Along(i)), (Along(i),)) for i, s in enumerate(idx) if s >= 2]
    if w[1] >= 2:
        splits.append(Split((Along(1), None), (Along(len(idx)),)))
    return splits


def embedding_dense_backward(node, ins, outs) -> list[Split]:
    """(grad [..., D], indices [...], num_weights, padding_idx, scale_grad_by_freq) -> [V, D].

    NOTE: with scale_grad_by_freq the counts are over all tokens: no token split then."""
    g, idx = ins
    splits = []
    if not arg_of(node, 4, "scale_grad_by_freq", False):
        splits += [Split((Along(i), Along(i)), (Reduced(),),
                         note="tokens split: the parts' scatter-adds are partial sums")
                   for i, s in enumerate(idx) if s >= 2]
    if g[-1] >= 2:
        splits.append(Split((Along(len(g) - 1), None), (Along(1),)))
    return splits


def _head_units(q, k) -> tuple[int, int] | None:
    """(q unit, k/v unit) of a head split; grouped-query attention cuts whole kv groups."""
    if q[1] < 2 or k[1] < 1 or q[1] % k[1]:
        return None
    if k[1] == 1:
        return None  # NOTE: one shared kv head: every part needs it whole; not offered
    return q[1] // k[1], 1


def _mask_entry(node, mask_key: str, mask_shape, d: int, size: int) -> dict:
    if mask_shape is None:
        return {}
    k = d - (4 - len(mask_shape))
    return {mask_key: Along(k) if k >= 0 and mask_shape[k] == size else None}


def sdpa_flash(node, ins, outs) -> list[Split]:
    """_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=,
    scale=) -> (out [B, H, L, E], logsumexp [B, H, L]): batch, heads, and (not causal)
    query rows with k and v read whole."""
    if arg_of(node, 3, "dropout_p", 0.0) != 0.0:
        return []  # NOTE: random: a part would draw another dropout mask (law 1)
    q, k = ins[0], ins[1]
    mask = ins[3] if len(ins) > 3 else None
    splits = []
    if q[0] >= 2:
        ops = per_arg(node, {0: Along(0), 1: Along(0), 2: Along(0),
                             **_mask_entry(node, "attn_mask", mask, 0, q[0])})
        splits.append(Split(ops, (Along(0), Along(0))))
    units = _head_units(q, k)
    if units:
        hq, hk = Along(1, units[0]), Along(1, units[1])
        ops = per_arg(node, {0: hq, 1: hk, 2: hk, **_mask_entry(node, "attn_mask", mask, 1, q[1])})
        splits.append(Split(ops, (hq, hq)))
    # NOTE: no query-row split under is_causal: a part's queries would need a shifted mask
    # (torch aligns a causal mask of a non-square score matrix top-left)
    if q[2] >= 2 and not arg_of(node, 4, "is_causal", False):
        ops = per_arg(node, {0: Along(2), **_mask_entry(node, "attn_mask", mask, 2, q[2])})
        splits.append(Split(ops, (Along(2), Along(2))))
    return splits


def sdpa_flash_backward(node, ins, outs) -> list[Split]:
    """(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=, scale=) ->
    (gq, gk, gv): a query-row split makes gk, gv partial sums."""
    if arg_of(node, 6, "dropout_p", 0.0) != 0.0:
        return []
    q, k = ins[1], ins[2]
    mask = ins[6] if len(ins) > 6 else None
    splits = []
    if q[0] >= 2:
        b = Along(0)
        ops = per_arg(node, {i: b for i in range(6)} | _mask_entry(node, "attn_mask", mask, 0, q[0]))
        splits.append(Split(ops, (b, b, b)))
    units = _head_units(q, k)
    if units:
        hq, hk = Along(1, units[0]), Along(1, units[1])
        ops = per_arg(node, {0: hq, 1: hq, 2: hk, 3: hk, 4: hq, 5: hq,
                             **_mask_entry(node, "attn_mask", mask, 1, q[1])})
        splits.append(Split(ops, (hq, hk, hk)))
    if q[2] >= 2 and not arg_of(node, 7, "is_causal", False):
        r = Along(2)
        ops = per_arg(node, {0: r, 1: r, 4: r, 5: r, **_mask_entry(node, "attn_mask", mask, 2, q[2])})
        splits.append(Split(ops, (r, Reduced(), Reduced()),
                            note="query rows split: the key and value gradients are partial sums"))
    return splits
