"""The table of dimension rules: ATen target -> rule, and the targets that are boundaries.

Every target a zoo graph contains is either here with a rule or in ``BOUNDARY`` with the reason
it cannot be split; a test holds that, so a new op shows up as a failing test, never as a guess.

Example:
    >>> from fitgraph.graph.dim_rules import BOUNDARY, RULES
    >>> "aten.mm.default" in RULES, BOUNDARY["aten.bernoulli_.float"][:6]
    (True, 'random')
"""

from __future__ import annotations

from collections.abc import Callable

from . import dim_rules_index as ix
from . import dim_rules_linalg as la
from . import dim_rules_loss as ls
from . import dim_rules_norm as nm
from . import dim_rules_pointwise as pw
from . import dim_rules_views as vw
from . import dim_rules_window as wn
from .own_ops import UNPACK_BITS, UNPACK_SCALED

__all__ = ["BOUNDARY", "BOUNDARY_PREFIXES", "RANDOM_CHECKED", "ROW_WISE", "RULES", "SHAPE_ONLY",
           "row_wise"]

Rule = Callable  # rule(node, operand shapes, output shapes) -> list[Split]

_ELEMENTWISE = [
    # unary
    "abs", "alias", "clone", "contiguous", "cos", "detach", "exp", "gelu", "hardtanh", "log",
    "neg", "reciprocal", "relu", "rsqrt", "sigmoid", "silu", "sin", "sqrt", "square", "tanh",
    "_to_copy", "fill", "erf", "log1p", "expm1", "floor", "ceil", "trunc", "sign",
    "clamp", "clamp_min", "clamp_max", "leaky_relu", "elu", "hardsigmoid", "hardswish",
    "softplus", "mish", "bitwise_not",
    # binary / ternary with broadcasting
    "add", "sub", "mul", "div", "pow", "rsub", "maximum", "minimum", "where", "masked_fill",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "addcmul", "addcdiv", "lerp",
    # backward of pointwise ops
    "gelu_backward", "silu_backward", "threshold_backward", "sigmoid_backward",
    "tanh_backward", "native_dropout_backward", "leaky_relu_backward", "elu_backward",
    "hardsigmoid_backward", "hardswish_backward", "softplus_backward", "mish_backward",
]
_OVERLOADS = ["default", "Tensor", "Scalar", "self", "Tensor_Scalar", "Tensor_Tensor",
              "Scalar_Tensor", "ScalarOther", "Tensor_mode", "Scalar_mode"]

RULES: dict[str, Rule] = {}
for _name in _ELEMENTWISE:
    for _ov in _OVERLOADS:
        RULES[f"aten.{_name}.{_ov}"] = pw.elementwise
        RULES[f"aten.{_name}_.{_ov}"] = pw.elementwise  # NOTE: in place: output = operand 0

RULES.update({**{f: ls.pointwise_loss for f in ls.LOSSES},
              **{b: ls.pointwise_loss_backward for b in ls.LOSSES.values()}})
RULES.update({
    "aten.sum.dim_IntList": pw.sum_dim,
    "aten.sum.default": pw.sum_dim,
    "aten.mean.dim": pw.mean_dim,
    "aten.mean.default": pw.mean_dim,
    "aten.var_mean.correction": pw.moments,
    "aten.var.correction": pw.moments,
    "aten.std_mean.correction": pw.moments,
    "aten.std.correction": pw.moments,
    "aten._softmax.default": pw.log_softmax_like,
    "aten._log_softmax.default": pw.log_softmax_like,
    "aten._safe_softmax.default": pw.log_softmax_like,
    "aten.softmax.int": pw.log_softmax_like,
    "aten.log_softmax.int": pw.log_softmax_like,
    "aten._softmax_backward_data.default": pw.softmax_backward,
    "aten._log_softmax_backward_data.default": pw.softmax_backward,
    "aten.mm.default": la.mm,
    "aten.addmm.default": la.addmm,
    "aten.bmm.default": la.bmm,
    "aten.baddbmm.default": la.baddbmm,
    "aten.matmul.default": la.matmul,
    "aten.linear.default": la.linear,
    "aten.embedding.default": la.embedding,
    "aten.embedding_dense_backward.default": la.embedding_dense_backward,
    "aten._scaled_dot_product_flash_attention_for_cpu.default": la.sdpa_flash,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": la.sdpa_flash_backward,
    "aten.native_layer_norm.default": nm.native_layer_norm,
    "aten.native_layer_norm_backward.default": nm.native_layer_norm_backward,
    "aten.native_batch_norm.default": nm.native_batch_norm,
    "aten.native_batch_norm_backward.default": nm.native_batch_norm_backward,
    "aten.native_group_norm.default": nm.native_group_norm,
    "aten.native_group_norm_backward.default": nm.native_group_norm_backward,
    "aten.nll_loss_forward.default": nm.nll_loss,
    "aten.nll_loss2d_forward.default": nm.nll_loss,
    "aten.nll_loss_backward.default": nm.nll_loss_backward,
    "aten.nll_loss2d_backward.default": nm.nll_loss_backward,
    "aten.convolution.default": wn.convolution,
    "aten.convolution_backward.default": wn.convolution_backward,
    "aten.avg_pool2d.default": wn.avg_pool2d,
    "aten.avg_pool2d_backward.default": wn.avg_pool2d_backward,
    "aten.max_pool2d_with_indices.default": wn.max_pool2d,
    "aten.max_pool2d_with_indices_backward.default": wn.max_pool2d_backward,
    "aten.grid_sampler_2d.default": ix.grid_sample,
    "aten.grid_sampler_2d_backward.default": ix.grid_sample_backward,
    "aten.upsample_bilinear2d.default": wn.spatial_resample,
    "aten.upsample_nearest2d.default": wn.spatial_resample,
    "aten.upsample_bilinear2d_backward.default": wn.upsample_backward,
    "aten.upsample_nearest2d_backward.default": wn.upsample_backward,
    **{t: wn.upsample_backward if "backward" in t else wn.spatial_resample
       for t in wn.BATCH_AND_CHANNELS},
    "aten.view.default": vw.view,
    "aten._unsafe_view.default": vw.view,
    "aten.reshape.default": vw.view,
    "aten.expand.default": vw.expand,
    "aten.permute.default": vw.permute,
    "aten.transpose.int": vw.transpose,
    "aten.t.default": vw.t,
    "aten.unsqueeze.default": vw.unsqueeze,
    "aten.squeeze.dim": vw.squeeze,
    "aten.squeeze.dims": vw.squeeze,
    "aten.squeeze.default": vw.squeeze,
    "aten.slice.Tensor": vw.slice_,
    "aten.slice_backward.default": vw.slice_backward,
    "aten.select.int": vw.select,
    "aten.select_backward.default": vw.select_backward,
    "aten.split.Tensor": vw.split,
    "aten.split_with_sizes.default": vw.split,
    "aten.unbind.int": vw.unbind,
    "aten.cat.default": vw.cat,
    "aten.stack.default": vw.stack,
    UNPACK_BITS: vw.unpack_bits,
    UNPACK_SCALED: vw.unpack_bits,   # NOTE: the same bytes to elements, as floats
    "aten._unsafe_index.Tensor": ix.index_gather,
    "aten.index.Tensor": ix.index_gather,
    "aten._unsafe_index_put.default": ix.index_scatter,
    "aten.index_put.default": ix.index_scatter,
    "aten.new_zeros.default": ix.new_zeros,
})

# NOTE: rules whose every split runs each row of its cut dims on its own, the rows' positions
# unread (no window, no offset, no index into them): such an op runs on rows cut along the
# inner dim of a merged dim (``Along.outer``) as on any rows
ROW_WISE = frozenset({
    pw.elementwise, pw.sum_dim, pw.mean_dim, pw.log_softmax_like, pw.softmax_backward, la.mm,
    pw.moments, la.addmm, la.linear, la.embedding, la.embedding_dense_backward, nm.native_layer_norm,
    nm.native_layer_norm_backward, nm.nll_loss, nm.nll_loss_backward, vw.permute, vw.transpose,
    vw.t, vw.unsqueeze, vw.squeeze, vw.expand,
})


def row_wise(node, split, ins, outs) -> bool:
    """Whether ``split`` of ``node`` (operand and output shapes ``ins``, ``outs``) may run on
    rows cut along the inner dim of a merged dim: a ``ROW_WISE`` rule, or a reshape that keeps
    the cut dim as it is (``[B*T, F] -> [B*T, H, F/H]``).

    Example:
        >>> from fitgraph.graph.ir import Node, Phase, ValueRef
        >>> n = Node(0, "v", "aten.view.default", (ValueRef(0), [16, 2, 4]), {}, (0,), (1,), (),
        ...          Phase.FORWARD, "")
        >>> [row_wise(n, s, [(16, 8)], [(16, 2, 4)]) for s in RULES[n.target](n, [(16, 8)],
        ...                                                                   [(16, 2, 4)])]
        [True, False, False]

        The rows (16) are kept; the features, unmerged into 2 x 4, are not.
    """
    rule = RULES.get(node.target)
    if rule in ROW_WISE:
        return True
    if rule is not vw.view or split.note == "inner":
        return False
    a, b = split.operands[0], split.outputs[0]
    return a.unit == b.unit == 1 and ins[0][a.dim] == outs[0][b.dim]


_RANDOM = "random: a part would draw other numbers than the whole op (law 1)"
_SOURCE = ("reads no tensor (a constant or a fresh buffer): nothing to split; it is computed "
           "whole before any region that reads it")

_SHAPE = ("reads only its input's shape, not its values: computed whole outside any region "
          "(no data edge from its input; see SHAPE_ONLY)")

# NOTE: ops whose tensor argument gives only a shape: their input is not a data dependence.
# Dropout draws its mask into empty_like(x); with that edge the mask would depend on x and
# every dropout would cut a batch region in two.
SHAPE_ONLY = frozenset({
    "aten.empty_like.default", "aten.ones_like.default", "aten.zeros_like.default",
    "aten.full_like.default",
})

BOUNDARY: dict[str, str] = {
    **{t: _SHAPE for t in SHAPE_ONLY},
    "aten.bernoulli_.float": _RANDOM,
    "aten.bernoulli.default": _RANDOM,
    "aten.native_dropout.default": _RANDOM,
    "aten.rand_like.default": _RANDOM,
    "aten.randn_like.default": _RANDOM,
    "aten.arange.default": _SOURCE,
    "aten.arange.start": _SOURCE,
    "aten.scalar_tensor.default": _SOURCE,
    "aten.empty.memory_format": _SOURCE,
    "aten.full.default": _SOURCE,
    "aten.zeros.default": _SOURCE,
    "aten.ones.default": _SOURCE,
}

# NOTE: fitgraph's optimizer nodes read whole parameters, gradients and state
BOUNDARY_PREFIXES: dict[str, str] = {
    "fitgraph.optimizer.": "an optimizer update: reads whole parameters, gradients and state",
}

# NOTE: ops tagged random whose rule itself refuses to split when they would draw (dropout_p>0)
RANDOM_CHECKED = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
})
